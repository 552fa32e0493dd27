"""One message a step: `complete_and_assemble` with its row changes, its repeat and
lost-answer guarantees; the drain on shutdown."""

from __future__ import annotations

import pytest

from mstar_chunking import (
    ActorsStoppedError,
    ChunkingError,
    ChunkingPolicy,
    ConflictError,
    InvalidRequestError,
    NextStep,
    SubmoduleCaps,
)


@pytest.fixture
def cm(make_cm):
    cm = make_cm({"llm": SubmoduleCaps(["prefill", "mixed"])})
    cm.set_policies({("llm", "mixed"): ChunkingPolicy(256)})
    cm.set_budgets({}, ["prefill", "decode", "mixed"], combined_walk_of={"prefill": "mixed", "decode": "mixed"})
    return cm


def test_a_step_completes_and_the_next_is_assembled_with_its_row_changes(cm):
    cm.admit(1, "llm", "prefill", [1] * 100)
    b = cm.assemble("llm", "mixed")
    nxt = NextStep("llm", "mixed").continue_row(1, "decode", 1, context=101).admit(2, "prefill", range(50))
    assert len(nxt) == 2 and (nxt.node, nxt.walk) == ("llm", "mixed")
    done = cm.complete_and_assemble(b.step, b.planned(), 12.5, next=nxt)
    assert done.outcome.finished == [1] and done.outcome.measured_ms == 12.5
    rows = done.next.rows
    assert [(r.rid, r.kind) for r in rows] == [(1, "continue"), (2, "chunk")]
    assert rows[0].context == 101 and rows[1].is_final and rows[1].range.is_final
    assert done.next_error is None
    # Without changes: a (node, walk) pair.
    done2 = cm.complete_and_assemble(done.next.step, done.next.planned(), next=("llm", "mixed"))
    assert done2.outcome.finished == [2]
    assert [r.rid for r in done2.next.rows] == [1]


def test_without_a_next_step_the_same_node_and_walk_follow_with_no_row_changes(cm):
    cm.admit(1, "llm", "prefill", [1] * 600)
    cm.continue_row(7, "llm", "decode")
    b = cm.assemble("llm", "mixed")
    done = cm.complete_and_assemble(b.step, b.planned(), 3.0)
    assert (done.next.node, done.next.walk) == ("llm", "mixed")
    assert [(r.rid, r.kind) for r in done.next.rows] == [(7, "continue"), (1, "chunk")]
    assert done.next.rows[1].range.start == b.rows[1].range.end
    assert cm.queue_stats()["continuing_rows"] == 1
    # Its repeat answers the batch in flight; a time for the next step is taken as `at_ms`.
    again = cm.complete_and_assemble(b.step, b.planned(), 3.0)
    assert again.next.step == done.next.step
    last = cm.complete_and_assemble(done.next.step, done.next.planned(), at_ms=50.0)
    assert (last.next.node, last.next.walk) == ("llm", "mixed")
    with pytest.raises(ChunkingError):
        cm.complete_and_assemble(last.next.step + 100, [1])


def test_a_repeat_whose_answer_was_lost_gets_the_same_outcome_and_batch(cm):
    cm.admit(1, "llm", "prefill", [1] * 600)
    b = cm.assemble("llm", "mixed")
    nxt = NextStep("llm", "mixed").continue_row(9, "decode")
    first = cm.complete_and_assemble(b.step, b.planned(), next=nxt)
    again = cm.complete_and_assemble(b.step, b.planned(), next=nxt)
    assert again.outcome.step == first.outcome.step == b.step
    assert (again.outcome.chunks, again.outcome.ran_tokens) == (first.outcome.chunks, first.outcome.ran_tokens)
    assert again.next.step == first.next.step
    assert [r.rid for r in again.next.rows] == [r.rid for r in first.next.rows]
    # The changes were applied once: one continuing row.
    assert cm.queue_stats()["continuing_rows"] == 1
    with pytest.raises(ConflictError):
        cm.complete_and_assemble(b.step, [0], next=nxt)


def test_a_refused_change_leaves_the_completion_standing(cm):
    cm.admit(1, "llm", "prefill", [1] * 600)
    cm.admit(2, "llm", "prefill", [1] * 10)
    b = cm.assemble("llm", "mixed")
    nxt = NextStep("llm", "mixed").admit(2, "prefill", [5] * 10)
    done = cm.complete_and_assemble(b.step, b.planned(), next=nxt)
    assert done.outcome.step == b.step
    assert isinstance(done.next_error, ConflictError)
    with pytest.raises(ConflictError, match="already queued"):
        done.next
    assert "error(" in repr(done)
    b2 = cm.assemble("llm", "mixed")
    assert b2.step != b.step


def test_a_step_of_another_node_or_a_bad_next_is_refused_before_anything_changes(cm):
    cm.admit(1, "llm", "prefill", [1] * 600)
    b = cm.assemble("llm", "mixed")
    with pytest.raises(InvalidRequestError):
        cm.complete_and_assemble(b.step, b.planned(), next=("llm", "nope"))
    with pytest.raises(InvalidRequestError, match="next must be"):
        cm.complete_and_assemble(b.step, b.planned(), next="llm")
    assert cm.queue_stats()["steps_in_flight"] == 1
    cm.abandon(b.step)


def test_drain_refuses_new_work_and_reports_what_it_dropped(cm):
    cm.admit(1, "llm", "prefill", [1] * 1000)
    cm.continue_row(5, "llm", "decode")
    b = cm.assemble("llm", "mixed")
    assert cm.begin_drain() == 1
    with pytest.raises(ChunkingError, match="drain"):
        cm.admit(2, "llm", "prefill", [1] * 10)
    cm.complete(b.step, b.planned())
    report = cm.drain()
    assert report == {"steps_abandoned": 0, "requests": 2, "rows": 2, "prepared_inputs": 1, "prepared_tokens": 1000}
    assert len(cm.prepared) == 0


@pytest.mark.parametrize("caller_thread", [False, True], ids=["own-thread", "caller-thread"])
def test_close_drains_and_answers_the_report(make_cm, caller_thread):
    # With the actors on the calling thread too: the System ends with them, later calls find
    # them stopped.
    cm = make_cm(caller_thread=caller_thread)
    cm.set_policies({("llm", "mixed"): ChunkingPolicy(256)})
    cm.set_budgets({}, ["prefill", "decode", "mixed"], combined_walk_of={"prefill": "mixed", "decode": "mixed"})
    cm.admit(1, "llm", "prefill", [1] * 1000)
    cm.assemble("llm", "mixed")
    report = cm.close()
    assert report is not None and report["steps_abandoned"] == 1 and report["prepared_inputs"] == 1
    assert cm.close() is None
    with pytest.raises(ActorsStoppedError):
        cm.queue_stats()


def test_prompts_admitted_with_a_step_are_listed_in_prepared(cm):
    cm.admit(1, "llm", "prefill", [1] * 600)
    b = cm.assemble("llm", "mixed")
    done = cm.complete_and_assemble(b.step, b.planned(), next=NextStep("llm", "mixed").admit(2, "prefill", [2] * 30))
    assert sorted(cm.prepared) == [(1, "llm"), (2, "llm")]
    assert cm.prepared[(2, "llm")].tolist() == [2] * 30
    cm.abandon(done.next.step)


def test_ran_may_be_the_step_s_batch(make_cm):
    cm = make_cm({"llm": SubmoduleCaps(["prefill", "mixed"])})
    cm.set_policies({("llm", "mixed"): ChunkingPolicy(256)})
    cm.set_budgets({}, ["prefill", "decode", "mixed"], combined_walk_of={"prefill": "mixed", "decode": "mixed"})
    cm.continue_row(1, "llm", "decode", 1)
    cm.admit(2, "llm", "prefill", [2] * 400)
    b = cm.assemble("llm", "mixed")
    out = cm.complete(b.step, b)
    assert (out.ran_tokens, out.scheduled_tokens, out.chunks) == (256, 256, 1)
    b2 = cm.assemble("llm", "mixed")
    with pytest.raises(InvalidRequestError, match=f"ran is the Batch of step {b.step}, not of step {b2.step}"):
        cm.complete_and_assemble(b2.step, b, next=("llm", "mixed"))
    done = cm.complete_and_assemble(b2.step, b2, next=("llm", "mixed"))
    assert done.outcome.finished == [2] and done.outcome.ran_tokens == b2.scheduled_tokens
    assert done.next.planned() == [1]


@pytest.mark.parametrize(
    "last, index",
    [(True, 3), (-1, 3), (1.0, 3), (2**32, 2)],
    ids=["bool", "negative", "float", "too-big-repeated"],
)
def test_a_bad_item_after_a_run_of_the_same_int_is_named(cm, last, index):
    # `ran` is read fast over runs of one int object (decode rows' 1s): an item that is
    # not an exact int in range is still refused, by its index, and nothing is completed.
    for rid in range(1, 5):
        cm.continue_row(rid, "llm", "decode", 1)
    b = cm.assemble("llm", "mixed")
    assert b.planned() == [1, 1, 1, 1]
    ran = [1, 1, last, last] if index == 2 else [1, 1, 1, last]
    with pytest.raises(InvalidRequestError, match=rf"ran\[{index}\] must be a whole number"):
        cm.complete_and_assemble(b.step, ran, next=("llm", "mixed"))
    done = cm.complete_and_assemble(b.step, b.planned(), next=("llm", "mixed"))
    assert done.outcome.ran_tokens == 4
