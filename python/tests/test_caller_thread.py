"""Actors run on the calling thread (`caller_thread=True`): the same steps as on their own
thread, calls from that thread only; the rows in bulk (`Batch.columns()`, `Batch.keyed()`);
prompts given as lists of ints."""

from __future__ import annotations

import threading

import pytest

from mstar_chunking import (
    ChunkingError,
    ChunkingManagement,
    ChunkingPolicy,
    InvalidRequestError,
    NextStep,
    SubmoduleCaps,
)


def mixed(make_cm, **kw):
    cm = make_cm({"llm": SubmoduleCaps(["prefill", "mixed"])}, **kw)
    cm.set_policies({("llm", "mixed"): ChunkingPolicy(256, align=16)})
    cm.set_budgets(
        {}, ["prefill", "decode", "mixed"], combined_walk_of={"prefill": "mixed", "decode": "mixed"}, max_row_tokens=160
    )
    return cm


def drive(cm, steps=30):
    """A loop as an engine's: prompts arrive, finished ones decode until their 5th step, each
    step one `complete_and_assemble`; answers each batch's rows and each outcome."""
    seen = []
    for r in range(1, 4):
        cm.admit(r, "llm", "prefill", [r] * (100 + 70 * r))
    b = cm.assemble("llm", "mixed")
    decoding = {}
    for i in range(steps):
        nxt = NextStep("llm", "mixed")
        for rid in b.final_rids():
            nxt.continue_row(rid, "decode", 1)
            decoding[rid] = 0
        for rid in list(decoding):
            decoding[rid] += 1
            if decoding[rid] == 5:
                nxt.forget_request(rid)
                del decoding[rid]
        if i % 3 == 0:
            nxt.admit(10 + i, "prefill", list(range(50 + 20 * i)))
        ran = [t if k % 4 != 3 else 0 for k, t in enumerate(b.planned())] if i % 5 == 4 else b
        done = cm.complete_and_assemble(b.step, ran, 2.0, next=nxt)
        seen.append(([(r.rid, r.kind, r.tokens, r.range) for r in b.rows], done.outcome.finished, done.outcome.ran_tokens))
        b = done.next
    cm.abandon(b.step)
    return seen


def test_the_steps_are_those_of_actors_on_their_own_thread(make_cm):
    own, here = mixed(make_cm), mixed(make_cm, caller_thread=True)
    a, b = drive(own), drive(here)
    assert a == b
    assert sum(len(rows) for rows, _, _ in a) > 60 and any(ran for _, _, ran in a)
    assert own.queue_stats() == here.queue_stats()
    assert sorted(own.prepared) == sorted(here.prepared)


def test_calls_come_from_the_thread_that_made_it(make_cm):
    cm = mixed(make_cm, caller_thread=True)
    cm.admit(1, "llm", "prefill", [1] * 300)
    caught = []

    def elsewhere():
        try:
            cm.queue_stats()
        except ChunkingError as e:
            caught.append(str(e))
        caught.append(cm.close())  # does nothing from another thread

    t = threading.Thread(target=elsewhere)
    t.start()
    t.join()
    assert len(caught) == 2 and "caller_thread=True" in caught[0] and caught[1] is None
    # Still running here: the other thread's close() left it.
    assert cm.queue_stats()["prefill_rows"] == 1


def test_from_config_on_the_calling_thread(tmp_path):
    cm = ChunkingManagement.from_config(caller_thread=True)
    try:
        assert cm.queue_stats()["steps_in_flight"] == 0
        assert cm.config["nodes"]
    finally:
        cm.close()


def test_columns_and_keyed_are_the_rows_in_bulk(make_cm):
    cm = mixed(make_cm)
    cm.continue_row(7, "llm", "decode", 1)
    cm.continue_row(8, "llm", "decode", 2)
    cm.admit(1, "llm", "prefill", [1] * 40)
    cm.admit(2, "llm", "prefill", [2] * 500, cached=32)
    b = cm.assemble("llm", "mixed")
    rids, tokens, starts, finals = b.columns()
    rows = b.rows
    assert rids == [r.rid for r in rows] == [7, 8, 1, 2]
    assert tokens == [r.tokens for r in rows] == b.planned()
    chunks = [r for r in rows if r.kind == "chunk"]
    assert [r.rid for r in rows[len(rows) - len(starts) :]] == [r.rid for r in chunks]  # chunks last
    assert starts == [r.range.start for r in chunks] == [0, 32]
    assert finals == [i for i, r in enumerate(rows) if r.is_final] == [2]
    keys = {7: "d7", 8: "d8", 1: "p1", 2: "p2", 99: "other"}
    row_keys, by_key, chunk_starts, final_rows = b.keyed(keys)
    assert row_keys == ["d7", "d8", "p1", "p2"]
    assert list(by_key.items()) == list(zip(row_keys, tokens))  # in row order
    assert chunk_starts == {"p1": 0, "p2": 32} and final_rows == finals
    with pytest.raises(KeyError, match="rid 2 of row 3 has no key"):
        b.keyed({7: "d7", 8: "d8", 1: "p1"})
    cm.complete(b.step, b)
    b2 = cm.assemble("llm", "mixed")
    assert b2.columns()[2] == [r.range.start for r in b2.rows if r.kind == "chunk"] == [32 + tokens[3]]
    cm.abandon(b2.step)


def test_keyed_refuses_two_rows_under_one_key_naming_it(make_cm):
    cm = mixed(make_cm)
    cm.admit(1, "llm", "prefill", [1] * 100)
    cm.admit(2, "llm", "prefill", [2] * 50)
    b = cm.assemble("llm", "mixed")
    assert [r.tokens for r in b.rows] == [100, 50]
    # Both rows under "same" would have answered {'same': 50}: the 100-token row lost.
    with pytest.raises(ValueError, match=r"rid 2 of row 1 has key 'same', as rid 1 of row 0 has"):
        b.keyed({1: "same", 2: "same"})
    # Keys Python's dict takes as one (1 and 1.0) are one key too.
    with pytest.raises(ValueError, match=r"has key 1\.0, as rid 1 of row 0 has"):
        b.keyed({1: 1, 2: 1.0})
    # A missing key is still a KeyError naming the rid; distinct keys answer every row.
    with pytest.raises(KeyError, match="rid 2 of row 1 has no key"):
        b.keyed({1: "same"})
    row_keys, by_key, starts, finals = b.keyed({1: "a", 2: "b"})
    assert row_keys == ["a", "b"] and by_key == {"a": 100, "b": 50} and finals == [0, 1]
    cm.abandon(b.step)


def test_a_prompt_list_is_taken_as_its_ints_or_refused_as_before(make_cm):
    cm = mixed(make_cm)
    ids = [0, 1, 2**32 - 1, 7, True]
    cm.admit(1, "llm", "prefill", ids)
    assert cm.prepared[(1, "llm")].tolist() == [0, 1, 2**32 - 1, 7, 1]
    with pytest.raises(InvalidRequestError, match="between 0 and 4294967295"):
        cm.admit(2, "llm", "prefill", [1, -1])
    with pytest.raises(InvalidRequestError, match="between 0 and 4294967295"):
        cm.admit(3, "llm", "prefill", [1, 2**32])
    with pytest.raises(InvalidRequestError, match="sequence of ints"):
        cm.admit(4, "llm", "prefill", [1, 2.5])
    assert sorted(cm.prepared) == [(1, "llm")]


def drive_keyed(cm, steps=30, one_call=True):
    """`drive`'s loop as the vLLM scheduler makes it, with the step's row changes as lists and
    the plan keyed by request id: through the one native call (`one_call`), or through
    `complete_and_assemble` with a `NextStep`, then `Batch.keyed`. Answers each step's keyed
    plan and outcome."""
    keys = {}
    changes = []
    for r in range(1, 4):
        keys[r] = f"r{r}"
        changes.append((r, [r] * (100 + 70 * r), 16 * (r - 1)))
    for rid, tokens, cached in changes:
        cm.admit(rid, "llm", "prefill", tokens, cached=cached)
    b = cm.assemble("llm", "mixed")
    decoding = {}
    seen = []
    for i in range(steps):
        continues = b.final_rids()
        changes = []
        for rid in continues:
            decoding[rid] = 0
        for rid in list(decoding):
            decoding[rid] += 1
            if decoding[rid] == 5:
                changes.append((rid, None, 0))
                del decoding[rid]
        if i % 3 == 0:
            keys[10 + i] = f"r{10 + i}"
            changes.append((10 + i, list(range(50 + 20 * i)), 0))
        ran = [t if k % 4 != 3 else 0 for k, t in enumerate(b.planned())] if i % 5 == 4 else b
        if one_call:
            outcome, nxt = cm._engine._complete_and_assemble_keyed(
                b.step, ran, 2.0, "llm", "mixed", "decode", continues, "prefill", changes, keys
            )
            b, row_keys, plan, starts, final_rows = nxt
        else:
            n = NextStep("llm", "mixed")
            for rid in continues:
                n.continue_row(rid, "decode", 1)
            for rid, tokens, cached in changes:
                if tokens is None:
                    n.forget_request(rid)
                else:
                    n.admit(rid, "prefill", tokens, cached)
            done = cm.complete_and_assemble(b.step, ran, 2.0, next=n)
            outcome, b = done.outcome, done.next
            row_keys, plan, starts, finals = b.keyed(keys)
            final_rows = [(k, b.rows[k].rid) for k in finals]
        seen.append((row_keys, list(plan.items()), starts, final_rows, outcome.finished, outcome.ran_tokens))
    cm.abandon(b.step)
    return seen


def test_the_one_call_step_is_the_step_with_a_next_step_then_keyed(make_cm):
    a = drive_keyed(mixed(make_cm, caller_thread=True))
    b = drive_keyed(mixed(make_cm, caller_thread=True), one_call=False)
    assert a == b
    assert any(f for _, _, _, f, _, _ in a) and any(fin for *_, fin, _ in a)  # chunks ended, requests ended
    assert any("r10" in dict(plan) for _, plan, *_ in a)  # an admission made by the call planned


def test_the_one_call_step_refuses_bad_changes_and_answers_a_failed_assembly(make_cm):
    cm = mixed(make_cm, caller_thread=True)
    call = cm._engine._complete_and_assemble_keyed
    cm.admit(1, "llm", "prefill", [1] * 40)
    cm.admit(2, "llm", "prefill", [2] * 400)
    b = cm.assemble("llm", "mixed")
    keys = {1: "a", 2: "b"}
    with pytest.raises(InvalidRequestError, match=r"changes\[1\] is \(rid, tokens or None, cached\), got \(2, \[1\]\)"):
        call(b.step, b, None, "llm", "mixed", "decode", [], "prefill", [(2, [3], 0), (2, [1])], keys)
    with pytest.raises(InvalidRequestError, match=r"changes\[0\]: rid must be between 0 and"):
        call(b.step, b, None, "llm", "mixed", "decode", [], "prefill", [(-1, None, 0)], keys)
    with pytest.raises(InvalidRequestError, match=r"changes\[0\]: cached must be"):
        call(b.step, b, None, "llm", "mixed", "decode", [], "prefill", [(3, [1], 1.5)], keys)
    with pytest.raises(InvalidRequestError, match=r"continues\[1\] must be a whole number"):
        call(b.step, b, None, "llm", "mixed", "decode", [1, "x"], "prefill", [], keys)
    assert cm.queue_stats()["steps_in_flight"] == 1  # nothing was sent: the step is still in flight
    # Prompt 2, mid-prefill, admitted again: that change fails after the completion.
    outcome, nxt = call(b.step, b, None, "llm", "mixed", "decode", [1], "prefill", [(2, [5] * 10, 0)], keys)
    assert outcome.step == b.step and outcome.finished == [1]
    assert isinstance(nxt, ChunkingError) and "2" in str(nxt)
    assert cm.queue_stats()["steps_in_flight"] == 0  # the completion stands
    b = cm.assemble("llm", "mixed")
    with pytest.raises(KeyError, match="rid 2 of row 1 has no key"):
        call(b.step, [1, 160], None, "llm", "mixed", "decode", [], "prefill", [], {1: "a"})
    # The step was completed and the next one assembled: `assemble` answers it again.
    again = cm.assemble("llm", "mixed")
    assert again.step == b.step + 1 and again.keyed(keys)[0] == ["a", "b"]
