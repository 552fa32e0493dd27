"""The order of waiting prompts from Python: `set_budgets(order=..., max_wait_ms=...,
max_wait_steps=...)` and their refusals, `admit(..., priority=, arrival_ms=)` (and the same on
`NextStep`), the step's time (`assemble(at_ms=)`, `complete_and_assemble(at_ms=)`,
`NextStep(at_ms=)`), the starvation bound at its exact boundary, and the warning for a
priority given where it orders nothing."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest

from mstar_chunking import (
    ChunkingManagement,
    ChunkingPolicy,
    InvalidRequestError,
    NextStep,
    RefusedSettingsError,
    SubmoduleCaps,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cm(make_cm):
    """Node `llm` cutting `prefill` rows under a budget of 256 (the floor 64)."""
    cm = make_cm({"llm": SubmoduleCaps(["prefill", "mixed"])})
    cm.set_policies({("llm", "prefill"): ChunkingPolicy(256)})
    return cm


def first_rids(cm, **kw):
    """The rids of the next step's rows, the step abandoned (planned again afresh)."""
    b = cm.assemble("llm", "prefill", **kw)
    cm.abandon(b.step)
    return [r.rid for r in b.rows]


def test_priority_orders_prompts_under_the_priority_order(cm):
    cm.set_budgets({}, ["prefill"], order="priority")
    cm.admit(1, "llm", "prefill", [1] * 256, priority=5)
    cm.admit(2, "llm", "prefill", [2] * 256, priority=-3)
    cm.admit(3, "llm", "prefill", [3] * 256, priority=5)
    cm.admit(4, "llm", "prefill", [4] * 256)  # priority 0
    order = []
    for _ in range(4):
        b = cm.assemble("llm", "prefill")
        order += [r.rid for r in b.rows]
        cm.complete(b.step, b.planned())
    assert order == [2, 4, 1, 3], "lower first, ties by admission"


def test_priority_under_fcfs_keeps_admission_order_and_warns_once_per_node(make_cm):
    cm = make_cm({"llm": SubmoduleCaps(["prefill"]), "vit": SubmoduleCaps(["prefill"])})
    cm.set_policies({("llm", "prefill"): ChunkingPolicy(256), ("vit", "prefill"): ChunkingPolicy(256)})
    cm.set_budgets({}, ["prefill"], order={"vit": "priority"})
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        cm.admit(1, "llm", "prefill", [1] * 256, priority=5)
        cm.admit(2, "llm", "prefill", [2] * 256, priority=0)
        cm.admit(3, "llm", "prefill", [3] * 256, priority=-1)
        cm.admit(1, "vit", "prefill", [1] * 256, priority=5)  # vit orders by priority: no warning
    assert [x.category for x in w] == [RuntimeWarning], [str(x.message) for x in w]
    message = str(w[0].message)
    assert "rid 1" in message and "`llm`" in message and "`fcfs`" in message and "priority 5" in message
    assert w[0].filename == __file__, "the warning points at the caller's line"
    assert first_rids(cm) == [1], "fcfs: admission order, the priority ignored"


def test_a_priority_of_0_never_warns(cm):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cm.admit(1, "llm", "prefill", [1] * 10, priority=0)
        cm.admit(2, "llm", "prefill", [1] * 10)


def test_a_warning_turned_into_an_error_admits_nothing(cm):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeWarning, match="rid 1"):
            cm.admit(1, "llm", "prefill", [1] * 10, priority=2)
    assert cm.queue_stats()["prefill_rows"] == 0
    # Warned once: the next one on the node is admitted without a warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cm.admit(1, "llm", "prefill", [1] * 10, priority=2)
    assert cm.queue_stats()["prefill_rows"] == 1


def test_next_step_admissions_carry_their_priority(cm):
    cm.set_budgets({}, ["prefill"], order="priority")
    cm.admit(1, "llm", "prefill", [1] * 300, priority=5)
    b = cm.assemble("llm", "prefill")
    assert [(r.rid, r.tokens) for r in b.rows] == [(1, 256)]
    nxt = NextStep("llm", "prefill").admit(3, "prefill", [3] * 500, priority=9).admit(2, "prefill", [2] * 500, priority=0)
    done = cm.complete_and_assemble(b.step, b.planned(), next=nxt)
    # The mid-prefill row keeps its place first; then the lower priority before the earlier
    # admission.
    assert [(r.rid, r.tokens) for r in done.next.rows] == [(1, 44), (2, 212)]


def test_next_step_priority_under_fcfs_warns_once(cm):
    cm.admit(1, "llm", "prefill", [1] * 300)
    b = cm.assemble("llm", "prefill")
    nxt = NextStep("llm", "prefill").admit(3, "prefill", [3] * 500, priority=9).admit(2, "prefill", [2] * 500, priority=0)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        done = cm.complete_and_assemble(b.step, b.planned(), next=nxt)
    assert [str(x.message).split(" given")[0] for x in w] == ["priority 9"]
    assert [r.rid for r in done.next.rows] == [1, 3], "fcfs: admission order"


def test_the_wait_bound_in_ms_at_its_exact_boundary(cm):
    cm.set_budgets({}, ["prefill"], order="priority", max_wait_ms=100)
    cm.admit(1, "llm", "prefill", [1] * 256, priority=9, arrival_ms=-20.0)
    cm.admit(2, "llm", "prefill", [2] * 256, priority=0, arrival_ms=50.0)
    assert first_rids(cm, at_ms=79.999) == [2], "rid 1 waited 99.999 ms: by priority"
    assert first_rids(cm, at_ms=80.0) == [1], "rid 1 waited exactly max_wait_ms: it goes first"
    assert first_rids(cm) == [2], "no step time: no wait in ms"
    # The same through the one-trip step: `at_ms` of the call, else the NextStep's.
    cm.admit(9, "llm", "prefill", [9] * 256, priority=0, arrival_ms=0.0)
    b = cm.assemble("llm", "prefill", at_ms=0.0)
    assert [r.rid for r in b.rows] == [2]
    done = cm.complete_and_assemble(b.step, b.planned(), next=NextStep("llm", "prefill", at_ms=79.0))
    assert [r.rid for r in done.next.rows] == [9]
    nxt = NextStep("llm", "prefill", at_ms=0.0)
    done = cm.complete_and_assemble(done.next.step, done.next.planned(), next=nxt, at_ms=80.0)
    assert [r.rid for r in done.next.rows] == [1], "the call's at_ms over the NextStep's"


def test_the_wait_bound_in_steps_at_its_exact_boundary(cm):
    cm.set_budgets({}, ["prefill"], order="priority", max_wait_steps=2)
    cm.admit(1, "llm", "prefill", [1] * 256, priority=9)
    for rid in (2, 3, 4):
        cm.admit(rid, "llm", "prefill", [rid] * 256, priority=0)
    order = []
    for _ in range(4):
        b = cm.assemble("llm", "prefill")
        order += [r.rid for r in b.rows]
        cm.complete(b.step, b.planned())
    assert order == [2, 3, 1, 4], "rid 1 goes first once it has waited through 2 planned steps"


def test_shortest_first_and_longest_prefix_per_node(cm):
    cm.set_budgets({}, ["prefill"], order={"llm": "shortest_first"})
    cm.admit(1, "llm", "prefill", [1] * 900)
    cm.admit(2, "llm", "prefill", [2] * 100)
    assert first_rids(cm)[0] == 2
    cm.set_budgets({}, ["prefill"], order="longest_prefix")
    cm.admit(3, "llm", "prefill", [3] * 900, cached=800)
    assert first_rids(cm)[0] == 3
    cm.set_budgets({}, ["prefill"])  # back to fcfs
    assert first_rids(cm)[0] == 1


def test_order_refusals_name_the_argument_and_change_nothing(cm):
    cm.set_budgets({}, ["prefill"], order="priority")
    cases = [
        (dict(order="lifo"), "order", None, "unknown order"),
        (dict(order={"llm": "lifo"}), "order", "llm", "unknown order"),
        (dict(order={"gpu": "fcfs"}), "order", "gpu", "gpu"),
        (dict(order={"llm": 1}), "order", "llm", "order's name"),
        (dict(order=["fcfs"]), "order", None, "order's name"),
        (dict(max_wait_ms=0), "max_wait_ms", None, "above 0"),
        (dict(max_wait_ms=-5.0), "max_wait_ms", None, "above 0"),
        (dict(max_wait_ms=math.inf), "max_wait_ms", None, "finite"),
        (dict(max_wait_ms=math.nan), "max_wait_ms", None, "finite"),
        (dict(max_wait_ms="100"), "max_wait_ms", None, "number"),
        (dict(max_wait_ms=True), "max_wait_ms", None, "number"),
        (dict(max_wait_steps=0), "max_wait_steps", None, "at least 1"),
        (dict(max_wait_steps=-1), "max_wait_steps", None, "at least 1"),
        (dict(max_wait_steps=2.0), "max_wait_steps", None, "whole number"),
        (dict(max_wait_steps=True), "max_wait_steps", None, "whole number"),
    ]
    for kw, argument, node, text in cases:
        with pytest.raises(RefusedSettingsError, match=text) as e:
            cm.set_budgets({}, ["prefill"], **kw)
        assert (e.value.argument, e.value.node) == (argument, node), kw
        assert e.value.refusals[0][:2] == (argument, node), kw
    # Nothing changed: still `priority`, and no warning for a priority.
    cm.admit(1, "llm", "prefill", [1] * 256, priority=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cm.admit(2, "llm", "prefill", [2] * 256, priority=1)
    assert first_rids(cm) == [2]


@pytest.mark.parametrize(
    "kw, argument",
    [
        (dict(priority=2**31), "priority"),
        (dict(priority=-(2**31) - 1), "priority"),
        (dict(priority=1.0), "priority"),
        (dict(priority=True), "priority"),
        (dict(priority="1"), "priority"),
        (dict(arrival_ms=math.nan), "arrival_ms"),
        (dict(arrival_ms=math.inf), "arrival_ms"),
        (dict(arrival_ms="0"), "arrival_ms"),
        (dict(arrival_ms=False), "arrival_ms"),
    ],
)
def test_admission_refusals_name_the_argument(cm, kw, argument):
    with pytest.raises(InvalidRequestError, match=argument):
        cm.admit(1, "llm", "prefill", [1] * 10, **kw)
    with pytest.raises(InvalidRequestError, match=argument):
        NextStep("llm", "prefill").admit(1, "prefill", [1] * 10, **kw)
    assert cm.queue_stats()["prefill_rows"] == 0


def test_the_extreme_priorities_are_accepted(cm):
    cm.set_budgets({}, ["prefill"], order="priority")
    cm.admit(1, "llm", "prefill", [1] * 256, priority=2**31 - 1, arrival_ms=-1e12)
    cm.admit(2, "llm", "prefill", [2] * 256, priority=-(2**31))
    assert first_rids(cm) == [2]


@pytest.mark.parametrize("bad", [math.nan, -math.inf, "1", True])
def test_step_time_refusals_name_at_ms(cm, bad):
    with pytest.raises(InvalidRequestError, match="at_ms"):
        cm.assemble("llm", "prefill", at_ms=bad)
    with pytest.raises(InvalidRequestError, match="at_ms"):
        NextStep("llm", "prefill", at_ms=bad)
    nxt = NextStep("llm", "prefill", at_ms=1.5)
    with pytest.raises(InvalidRequestError, match="at_ms"):
        nxt.at_ms = bad
    assert nxt.at_ms == 1.5
    nxt.at_ms = None
    assert nxt.at_ms is None and "at_ms" not in repr(nxt)
    with pytest.raises(AttributeError):
        del nxt.at_ms
    cm.admit(1, "llm", "prefill", [1] * 300)
    b = cm.assemble("llm", "prefill")
    with pytest.raises(InvalidRequestError, match="at_ms"):
        cm.complete_and_assemble(b.step, b.planned(), next=("llm", "prefill"), at_ms=bad)
    cm.complete_and_assemble(b.step, b.planned(), next=("llm", "prefill"), at_ms=-3)


def test_from_config_orders_as_the_config_says(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    layer = tmp_path / "order.toml"
    layer.write_text('[chunking]\norder = { llm = "priority" }\nmax_wait_steps = 4\n')
    cm = ChunkingManagement.from_config([layer], manifest=ROOT / "config" / "models" / "demo.toml")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            cm.admit(1, "llm", "prefill", [1] * 3000, priority=5)
            cm.admit(2, "llm", "prefill", [2] * 3000, priority=0)
        b = cm.assemble("llm", "mixed")
        assert b.rows[0].rid == 2
    finally:
        cm.close()
