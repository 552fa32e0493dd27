"""Streaming input (resumable requests) under the plugin. A stream's turn stops at its
`max_tokens`; vLLM keeps the request, waiting for its next input (`WAITING_FOR_STREAMING_REQ`),
or extends its prompt with an input that came meanwhile and queues it again; an input that is not
resumable ends the stream. The plugin forgets the request when a turn stops and admits it again
from what it computed once it waits with tokens to run.

With vLLM's chunk rules the plugin schedules step for step as vLLM's own scheduler, sync and
async; with its defaults every turn completes and nothing is held."""

import pytest
from harness import Driver, VllmScheduler, kv_all_free, make_request, make_scheduler
from vllm.v1.core.sched.async_scheduler import AsyncScheduler

from mstar_chunking.vllm import Scheduler

BUDGET = 64
BLOCKS = 2_000


class VllmRules(Scheduler):
    def chunking_settings(self):
        return {**super().chunking_settings(), "align": 1, "min_chunk_tokens": 1}


# step -> (stream, its next input's tokens and max_tokens; None ends the stream)
INPUTS = {
    3: ("s0", (list(range(300, 350)), 4)),  # s0 still in its first turn: queued until it stops
    9: ("s1", (list(range(500, 530)), 3)),
    16: ("s1", (list(range(600, 700)), 5)),  # s1 likely paused, waiting for this input
    30: ("s0", None),
    34: ("s1", None),
}


def run(cls, async_scheduling):
    s = make_scheduler(cls, budget=BUDGET, num_blocks=BLOCKS, async_scheduling=async_scheduling, max_num_seqs=6)
    d = Driver(s, async_depth=2 if async_scheduling else 1)
    d.add("s0", list(range(100, 190)), 6, resumable=True)
    d.add("p1", [7] * 150, 20)
    d.add("s1", list(range(200, 240)), 2, resumable=True)
    d.add("p2", [8] * 70, 9)
    for step in range(400):
        if step in INPUTS:
            req_id, update = INPUTS[step]
            if update is None:
                s.add_request(make_request(req_id, [], 1))  # not resumable: the stream ends
            else:
                s.add_request(make_request(req_id, update[0], update[1], resumable=True))
        if step > max(INPUTS) and not s.has_requests():
            break
        d.step()
    out = d.drain()
    assert not s.has_requests() and kv_all_free(s, BLOCKS)
    if isinstance(s, Scheduler):
        assert not s._rid_of and not s.chunking.queue_stats()["prefill_rows"]
        assert len(s.chunking.prepared) == 0
    s.shutdown()
    return [sorted((c.req_id, c.start, c.tokens) for c in st) for st in out.steps], dict(out.outputs)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_streams_are_scheduled_as_vllm_schedules_them(async_scheduling):
    theirs, their_outputs = run(AsyncScheduler if async_scheduling else VllmScheduler, async_scheduling)
    ours, our_outputs = run(VllmRules, async_scheduling)
    # Each stream ran three turns: 6 + 4 tokens for s0, 2 + 3 + 5 for s1.
    assert their_outputs["s0"] == 10 and their_outputs["s1"] == 10, their_outputs
    # Both streams' later inputs were prefilled: chunks past each first prompt.
    assert any(r == "s0" and start >= 90 and n > 1 for st in theirs for r, start, n in st)
    assert any(r == "s1" and start >= 70 and n > 1 for st in theirs for r, start, n in st)
    for i, (a, b) in enumerate(zip(theirs, ours)):
        assert a == b, (i, a, b)
    assert len(ours) == len(theirs) and our_outputs == their_outputs


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_defaults_run_every_turn(async_scheduling):
    _, outputs = run(Scheduler, async_scheduling)
    assert outputs == {"s0": 10, "s1": 10, "p1": 20, "p2": 9}
