"""vLLM's `priority` scheduling policy under the plugin. vLLM keeps its waiting requests in a heap
by (priority, arrival time), starts them in that order and, when KV blocks run out, preempts the
running request last in that order. The plugin admits waiting requests to the component in the
heap's order (an arrival of higher priority goes ahead of requests admitted already: those behind
it are admitted again, and one pushed out of vLLM's free slots is forgotten until it is reached),
and leaves preemption to vLLM, so the victim is vLLM's.

With vLLM's chunk rules (no alignment, no floor) the plugin schedules a trace of waves of
requests at three priorities, under a KV cache small enough to preempt, step for step as vLLM's
own scheduler does: the same requests, the same chunks, the same preemptions. With its defaults
it completes every request, starts the waiting ones in the heap's order, and holds nothing."""

import pytest
from harness import Driver, VllmScheduler, kv_all_free, make_scheduler

from mstar_chunking.vllm import Scheduler

BUDGET = 256
SEQS = 6
BLOCKS = 70  # 1,104 tokens of KV: preemption once the running requests grow


class VllmRules(Scheduler):
    """The plugin with vLLM's chunk rules (no alignment, no floor): vLLM's exact chunks."""

    def chunking_settings(self):
        return {**super().chunking_settings(), "align": 1, "min_chunk_tokens": 1}


# (step at which it arrives, id, prompt length, priority, max_tokens)
WAVES = [
    (0, "a0", 300, 2, 40),
    (0, "a1", 200, 2, 40),
    (0, "a2", 350, 1, 30),
    (0, "a3", 120, 2, 30),
    (0, "a4", 260, 1, 30),
    (3, "b0", 180, 0, 20),  # more urgent than every request waiting or running
    (3, "b1", 90, 1, 20),
    (6, "c0", 400, 0, 25),
    (6, "c1", 64, 2, 10),
    (9, "d0", 150, 0, 15),
    (12, "e0", 500, 1, 20),
    (12, "e1", 33, 0, 12),
]


def prompt(i, n):
    return [30 + i] * 5 + list(range(2000 + 3000 * i, 2000 + 3000 * i + n - 5))


def run(cls, async_scheduling=False):
    s = make_scheduler(
        cls, budget=BUDGET, max_num_seqs=SEQS, num_blocks=BLOCKS, policy="priority", async_scheduling=async_scheduling
    )
    d = Driver(s, async_depth=2 if async_scheduling else 1)
    preempted = []
    started = {}
    k = 0
    while k < 2_000:
        for i, (at, req_id, n, priority, max_tokens) in enumerate(WAVES):
            if at == k:
                d.add(req_id, prompt(i, n), max_tokens, priority=priority, arrival_time=1000.0 + i)
        if k > WAVES[-1][0] and not s.has_requests():
            break
        before = {r.request_id for r in s.running}
        chunks = d.step()
        for c in chunks:
            started.setdefault(c.req_id, k)
        preempted.append(sorted(before - {r.request_id for r in s.running} - set(d.run.finished)))
        k += 1
    d.drain()
    for _, req_id, _, _, max_tokens in WAVES:
        assert d.run.outputs[req_id] == max_tokens, (req_id, dict(d.run.outputs))
    assert kv_all_free(s, BLOCKS)
    if isinstance(s, Scheduler):
        assert not s._rid_of and len(s.chunking.prepared) == 0
    stats = getattr(s, "mstar_stats", None)
    s.shutdown()
    steps = [[(c.req_id, c.start, c.tokens) for c in st] for st in d.run.steps]
    return steps, preempted, started, stats


def test_the_plugin_schedules_as_vllm_under_the_priority_policy():
    theirs, their_preempted, _, _ = run(VllmScheduler)
    ours, our_preempted, _, stats = run(VllmRules)
    assert any(their_preempted), "the trace must preempt"
    for i, (a, b) in enumerate(zip(theirs, ours)):
        assert sorted(a) == sorted(b), (i, a, b)
    assert len(ours) == len(theirs)
    assert our_preempted == their_preempted
    # Arrivals of higher priority went ahead of requests admitted already (admitted again).
    assert stats.readmitted > 0


def test_async_starts_requests_in_vllms_order():
    # vLLM's async scheduler here runs a decode row every other step where the plugin plans
    # it every step (without the priority policy too), so the steps differ; the order in which
    # the requests start is vLLM's.
    _, their_preempted, theirs, _ = run(VllmScheduler, async_scheduling=True)
    _, _, ours, _ = run(VllmRules, async_scheduling=True)
    assert sorted(theirs, key=theirs.get) == sorted(ours, key=ours.get), (theirs, ours)


def test_the_defaults_start_waiting_requests_in_the_heaps_order():
    _, preempted, started, stats = run(Scheduler)
    assert any(preempted)
    # b0 (priority 0) arrived at step 3 behind requests of priority 1 and 2 still waiting: it
    # starts ahead of them.
    waiting_at_3 = [r for at, r, *_ in WAVES if at < 3 and started[r] >= 3]
    assert waiting_at_3 and all(started["b0"] < started[r] for r in waiting_at_3), started
    assert stats.readmitted > 0
