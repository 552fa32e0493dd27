"""The step API, prepared inputs, release and forget, check_budget and its warning cadence."""

import array
import logging

import pytest

from mstar_chunking import (
    ChunkingPolicy,
    ChunkRange,
    ConflictError,
    InvalidRequestError,
    Overrun,
    SubmoduleCaps,
    _native,
)

from conftest import run_all


@pytest.fixture
def cm(make_cm):
    cm = make_cm({"llm": SubmoduleCaps(["prefill", "mixed"]), "enc": SubmoduleCaps([])})
    cm.set_policies(
        {
            ("llm", "prefill"): ChunkingPolicy(256),
            ("llm", "mixed"): ChunkingPolicy(256),
            ("enc", "mixed"): ChunkingPolicy(100),
        }
    )
    cm.set_budgets(
        {}, ["prefill", "decode", "mixed"], combined_walk_of={"prefill": "mixed", "decode": "mixed"}
    )
    return cm


def test_a_prompt_is_cut_into_budget_sized_chunks_with_zero_copy_inputs(cm):
    prompt = array.array("I", range(1000, 1600))
    cm.admit(1, "llm", "prefill", prompt)
    b = cm.assemble("llm", "mixed")
    (row,) = b.rows
    assert (row.rid, row.kind, row.walk, row.tokens) == (1, "chunk", "prefill", 256)
    assert row.range == ChunkRange(0, 256, 600, 256)
    view = row.input
    assert isinstance(view, memoryview) and view.format == "I" and view.readonly
    assert view.tolist() == list(range(1000, 1256))
    whole = cm.prepared[(1, "llm")]
    # The chunk's view points into the whole prepared input: the same memory, not a copy.
    assert _native._buffer_address(view) == _native._buffer_address(whole)
    assert _native._buffer_address(whole.obj) == _native._buffer_address(row.input_tokens)
    assert row.input_tokens.span == (0, 256)
    with pytest.raises(TypeError):
        view[0] = 5
    out = cm.complete(b.step, b.planned())
    assert (out.chunks, out.final_chunks, out.finished, out.overrun) == (1, 0, [], None)
    b2 = cm.assemble("llm", "mixed")
    assert b2.rows[0].range == ChunkRange(256, 512, 600, 256)
    assert b2.rows[0].input.tolist() == list(range(1256, 1512))
    cm.complete(b2.step, b2.planned())
    b3 = cm.assemble("llm", "mixed")
    assert b3.rows[0].range.is_final
    out = cm.complete(b3.step, b3.planned(), measured_ms=12.5)
    assert out.finished == [1] and out.final_chunks == 1 and out.measured_ms == 12.5
    # "Drop a row's whole input once its last chunk lands": the scheduler releases it.
    assert (1, "llm") not in cm.prepared and len(cm.prepared) == 0


def test_a_view_keeps_its_tokens_alive_after_the_input_is_released(cm):
    cm.admit(1, "llm", "prefill", range(300))
    b = cm.assemble("llm", "mixed")
    view = b.rows[0].input
    del b
    cm.forget_request(1)
    assert len(cm.prepared) == 0
    assert view.tolist() == list(range(256))


def test_tokens_in_many_spellings(cm):
    for rid, tokens in enumerate(
        [[5, 6, 7], range(3), array.array("L", [1, 2]), array.array("H", [9, 9]), bytearray(3)]
    ):
        cm.admit(rid, "llm", "prefill", tokens)
    assert cm.prepared[(0, "llm")].tolist() == [5, 6, 7]
    assert cm.prepared[(3, "llm")].tolist() == [9, 9]
    assert cm.prepared[(4, "llm")].tolist() == [0, 0, 0]
    with pytest.raises(InvalidRequestError, match="rid 9 on `llm`"):
        cm.admit(9, "llm", "prefill", [-1])


def test_a_failed_step_reports_zero_and_the_same_chunk_is_planned_again(cm):
    cm.admit(1, "llm", "prefill", [1] * 600)
    b = cm.assemble("llm", "mixed")
    assert cm.assemble("llm", "mixed").step == b.step, "a step in flight is answered again"
    out = cm.complete(b.step, [0])
    assert out.unrun_chunks == 1 and out.chunks == 0
    again = cm.assemble("llm", "mixed")
    assert again.step != b.step and again.rows[0].range == ChunkRange(0, 256, 600, 256)
    with pytest.raises(InvalidRequestError, match="planned at 256 tokens but 100"):
        cm.complete(again.step, [100])
    cm.abandon(again.step)
    with pytest.raises(InvalidRequestError, match="not in flight"):
        cm.complete(again.step, [256])


def test_continue_rows_run_every_step_until_forgotten(cm):
    cm.continue_row(5, "llm", "decode", 1)
    cm.continue_row(6, "llm", "decode", 3)
    cm.admit(1, "llm", "prefill", [1] * 600)
    b = cm.assemble("llm", "mixed")
    assert [(r.kind, r.rid, r.estimate) for r in b.rows] == [
        ("continue", 5, 1),
        ("continue", 6, 3),
        ("chunk", 1, None),
    ]
    assert b.rows[2].tokens == 256 - 4, "continuing rows first, the chunk takes what is left"
    cm.complete(b.step, b.planned())
    cm.forget_request(5)
    b = cm.assemble("llm", "mixed")
    assert [r.rid for r in b.rows if r.kind == "continue"] == [6]
    cm.complete(b.step, b.planned())
    with pytest.raises(ConflictError, match="still prefilling"):
        cm.continue_row(1, "llm", "decode", 1)


def test_step_in_flight_under_another_walk_is_a_conflict(cm):
    cm.admit(1, "llm", "prefill", [1] * 600)
    b = cm.assemble("llm", "mixed")
    with pytest.raises(ConflictError, match=f"step {b.step} of `llm`/`mixed` is still in flight"):
        cm.assemble("llm", "prefill")
    cm.abandon(b.step)


# The floor: "Without a floor, decode rows that fill the budget leave a prompt a token or two a step."


def test_the_floor_keeps_a_prompt_from_running_a_few_tokens_a_step(cm):
    for rid in range(100, 100 + 250):
        cm.continue_row(rid, "llm", "decode", 1)
    cm.admit(1, "llm", "prefill", [1] * 600)
    b = cm.assemble("llm", "mixed")
    assert b.floor == 64
    assert [r.kind for r in b.rows].count("chunk") == 0, "6 tokens left < the floor: the prompt waits"
    cm.complete(b.step, b.planned())
    for rid in range(100, 100 + 200):
        cm.forget_request(rid)
    b = cm.assemble("llm", "mixed")
    chunks = [r for r in b.rows if r.kind == "chunk"]
    assert [c.tokens for c in chunks] == [206], "256 - 50 continuing rows >= the floor: cut to fit"
    cm.complete(b.step, b.planned())


def test_a_lower_floor_lets_the_prompt_run_what_is_left(cm):
    cm.set_budgets(
        {},
        ["prefill", "decode", "mixed"],
        combined_walk_of={"prefill": "mixed", "decode": "mixed"},
        min_chunk_tokens=4,
    )
    for rid in range(100, 100 + 250):
        cm.continue_row(rid, "llm", "decode", 1)
    cm.admit(1, "llm", "prefill", [1] * 600)
    b = cm.assemble("llm", "mixed")
    assert b.floor == 4
    assert [r.tokens for r in b.rows if r.kind == "chunk"] == [6]
    cm.complete(b.step, b.planned())


# release and forget leave nothing held.


def test_release_drops_one_nodes_row_and_input(cm):
    cm.admit(1, "llm", "prefill", [1] * 600)
    cm.admit(1, "enc", "prefill", [2] * 50)
    assert set(cm.prepared) == {(1, "llm"), (1, "enc")}
    assert cm.release(1, "llm") is True
    assert set(cm.prepared) == {(1, "enc")}
    assert cm.release(1, "llm") is False, "unknown rows are a no-op"
    assert cm.queue_stats()["prefill_rows"] == 1
    b = cm.assemble("llm", "mixed")
    assert len(b) == 0, "the released row is not scheduled"
    cm.abandon(b.step)


def test_forget_request_leaves_nothing_held(cm):
    cm.admit(1, "llm", "prefill", [1] * 600)
    cm.admit(1, "enc", "prefill", [2] * 50)
    cm.admit(2, "llm", "prefill", [3] * 10)
    b = cm.assemble("llm", "mixed")
    cm.complete(b.step, b.planned())
    cm.forget_request(1)
    assert set(cm.prepared) == {(2, "llm")}
    cm.forget_request(2)
    cm.forget_request(2)  # a no-op
    assert len(cm.prepared) == 0 and cm.prepared.tokens() == 0 and list(cm.prepared) == []
    assert cm.queue_stats() == {
        "prefill_rows": 0,
        "mid_prefill_rows": 0,
        "continuing_rows": 0,
        "steps_in_flight": 0,
    }
    cm.admit(1, "llm", "prefill", [1] * 10)  # the rid can be admitted again


def test_prepared_is_a_read_only_mapping_by_rid_and_node(cm):
    cm.admit(7, "llm", "prefill", [4, 5, 6])
    p = cm.prepared
    assert p[(7, "llm")].tolist() == [4, 5, 6]
    assert (7, "llm") in p and (7, "enc") not in p and "junk" not in p
    assert p.get((8, "llm")) is None
    with pytest.raises(KeyError):
        p[(8, "llm")]
    assert dict(p.items()).keys() == {(7, "llm")}
    with pytest.raises(TypeError):
        p[(7, "llm")] = [1]


# check_budget: "Warn when a step runs over the budget it was scheduled under: that of the
# combined walk it ran in, if any. ... Logged on the 1st, 2nd, 4th, ... overrun per walk."


def test_check_budget_logs_the_1st_2nd_4th_8th_overrun_per_walk(cm, caplog):
    caplog.set_level(logging.WARNING, logger="mstar_chunking")
    cm.admit(1, "llm", "prefill", [1] * 600)
    b = cm.assemble("llm", "mixed")
    logged = []
    for n in range(1, 10):
        caplog.clear()
        o = cm.check_budget(b, [300])
        assert o == Overrun("llm", "mixed", 256, 300, "other")
        if caplog.records:
            logged.append(n)
            (rec,) = caplog.records
            assert rec.levelno == logging.WARNING and rec.name == "mstar_chunking"
            assert "llm/mixed ran 300 tokens over its budget of 256 (other)" in rec.getMessage()
            assert f"overrun {n} " in rec.getMessage()
    assert logged == [1, 2, 4, 8]
    assert cm.check_budget(b, [256]) is None, "within the budget"
    assert cm.check_budget(b, [b.rows[0].input]) is None, "an input counts its tokens"
    assert cm.overrun_count("llm", "mixed") == 9
    cm.abandon(b.step)


def test_the_cadence_counts_per_walk(cm, caplog):
    caplog.set_level(logging.WARNING, logger="mstar_chunking")
    cm.admit(1, "llm", "prefill", [1] * 600)
    b = cm.assemble("llm", "mixed")
    cm.check_budget(b, [300])
    cm.abandon(b.step)
    cm.admit(2, "enc", "prefill", [1] * 50)
    b = cm.assemble("enc", "mixed")
    caplog.clear()
    cm.check_budget(b, [300])
    assert len(caplog.records) == 1, "the first overrun of enc/mixed is logged too"
    cm.abandon(b.step)


def test_complete_counts_an_estimate_overrun_of_a_combined_step(cm, caplog):
    caplog.set_level(logging.WARNING, logger="mstar_chunking")
    cm.continue_row(5, "llm", "decode", 1)
    cm.admit(1, "llm", "prefill", [1] * 600)
    b = cm.assemble("llm", "mixed")
    # A speculation merge sized the continuing row by estimate; it ran 4 tokens.
    out = cm.complete(b.step, [4, 255])
    assert out.overrun == Overrun("llm", "mixed", 256, 259, "speculation_estimate")
    assert len(caplog.records) == 1
    assert cm.overrun_count("llm", "mixed", "speculation_estimate") == 1


def test_a_row_too_long_to_cut_runs_whole(cm):
    cm.admit(1, "enc", "prefill", [1] * 300)
    b = cm.assemble("enc", "mixed")
    assert b.uncut_over_budget and b.rows[0].range == ChunkRange(0, 300, 300, 300)
    out = cm.complete(b.step, b.planned())
    assert out.overrun == Overrun("enc", "mixed", 100, 300, "uncut_row")


def test_drain_runs_every_token_once(cm):
    for rid in range(5):
        cm.admit(rid, "llm", "prefill", [rid] * (100 + 150 * rid))
    batches = run_all(cm, "llm", "mixed")
    per_rid = {}
    for b in batches:
        assert b.scheduled_tokens <= 256
        for r in b.rows:
            per_rid.setdefault(r.rid, []).append(r.range)
    for rid, ranges in per_rid.items():
        assert sum(r.stride for r in ranges) == 100 + 150 * rid
    assert len(cm.prepared) == 0


def test_prepared_lists_a_row_admitted_again_after_it_was_dropped(cm):
    cm.admit(1, "llm", "prefill", [1, 2])
    cm.forget_request(1)
    assert list(cm.prepared) == []
    cm.admit(1, "llm", "prefill", [3])
    assert list(cm.prepared) == [(1, "llm")] and cm.prepared[(1, "llm")].tolist() == [3]


def test_ran_is_read_alike_from_any_sequence_of_ints(cm):
    # A list of ints is read item by item; any other sequence (a tuple, an array, ints of a
    # subclass) goes the general way: the same counts either way.
    import enum

    class Tokens(enum.IntEnum):
        CHUNK = 255
        DECODE = 1

    forms = [
        lambda b: b.planned(),
        lambda b: tuple(b.planned()),
        lambda b: array.array("I", b.planned()),
        lambda b: [Tokens(t) for t in b.planned()],
    ]
    cm.continue_row(1, "llm", "decode", 1)
    for i, form in enumerate(forms):
        cm.admit(10 + i, "llm", "prefill", [1] * 255)
        b = cm.assemble("llm", "mixed")
        assert b.planned() == [1, 255]
        out = cm.complete(b.step, form(b))
        assert (out.ran_tokens, out.finished) == (256, [10 + i]), i


def test_the_prepared_keys_follow_admissions_releases_and_forgets(cm):
    cm.admit(7, "llm", "prefill", [1] * 10)
    cm.admit(7, "enc", "mixed", [1] * 10)
    cm.admit(3, "llm", "prefill", [1] * 10)
    assert list(cm.prepared) == [(3, "llm"), (7, "enc"), (7, "llm")]
    assert cm.release(7, "llm")
    assert list(cm.prepared) == [(3, "llm"), (7, "enc")]
    cm.forget_request(7)
    assert list(cm.prepared) == [(3, "llm")]
    cm.admit(7, "llm", "prefill", [1] * 10)
    assert list(cm.prepared) == [(3, "llm"), (7, "llm")]
    # A prompt whose prefill ended is no longer held: found gone and dropped from the keys.
    b = cm.assemble("llm", "mixed")
    done = cm.complete_and_assemble(
        b.step, b, next=_native.NextStep("llm", "mixed").admit(9, "prefill", [1] * 10)
    )
    assert sorted(done.outcome.finished) == [3, 7]
    assert list(cm.prepared) == [(9, "llm")]
    assert dict(cm.prepared.items())[(9, "llm")].tolist() == [1] * 10
