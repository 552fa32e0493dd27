"""Preemption by recompute under a small KV cache, aborts mid-prefill and mid-decode, prefix-cache
hits: every request that was not aborted gets exactly its max_tokens, and at the end nothing is
held: every KV block is free, the component's queues and prepared inputs are empty."""

import random

import pytest
from harness import BLOCK, Driver, kv_all_free, make_scheduler

from mstar_chunking import DEFAULT_MIN_CHUNK_TOKENS

from mstar_chunking.vllm import Scheduler

BLOCKS = 160  # 2,560 tokens of KV cache for about 5,000 tokens of prompts: vLLM must preempt
BUDGET = 256


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_nothing_lost_nothing_held(async_scheduling):
    rng = random.Random(3)
    s = make_scheduler(Scheduler, budget=BUDGET, num_blocks=BLOCKS, async_scheduling=async_scheduling, max_num_seqs=8)
    d = Driver(s, async_depth=2 if async_scheduling else 1)
    shared = [rng.randint(10, 31_000) for _ in range(320)]  # a prefix several prompts share
    want = {}
    for i in range(12):
        tail = [rng.randint(10, 31_000) for _ in range(rng.randint(100, 500))]
        prompt = shared + tail if i % 3 == 0 else tail + shared[: rng.randint(0, 200)]
        want[f"q{i}"] = (prompt, rng.randint(120, 260))
    # The prefix's owner goes first; the others sharing it arrive once its KV is cached.
    order = ["q0"] + [r for r in want if r != "q0"]
    d.add("q0", *want["q0"])
    added, aborted, first_start = 1, {}, {}
    abort_prefill, abort_decode = "q4", "q5"
    preempted = set()
    for step in range(5_000):
        if added < len(order) and (step >= 12 or added > 1):
            r = order[added]
            d.add(r, *want[r])
            added += 1
        if not s.has_requests() and added == len(order):
            break
        for c in d.step():
            first_start.setdefault(c.req_id, c.start)
        for r in s.running:
            if r.num_preemptions:
                preempted.add(r.request_id)
        req = s.requests.get(abort_prefill)
        if abort_prefill not in aborted and req is not None and 0 < req.num_computed_tokens < req.num_prompt_tokens:
            d.abort(abort_prefill)
            aborted[abort_prefill] = "prefill"
        req = s.requests.get(abort_decode)
        if abort_decode not in aborted and req is not None and req.num_output_tokens >= 3:
            d.abort(abort_decode)
            aborted[abort_decode] = "decode"
    run = d.drain()
    for chunks in run.steps:
        assert sum(c.tokens for c in chunks) <= BUDGET
        for c in chunks:
            if not c.final:  # a recomputed prompt (after a preemption) is cut by the same rules
                assert c.tokens >= DEFAULT_MIN_CHUNK_TOKENS and (c.start + c.tokens) % BLOCK == 0, c
    assert aborted == {abort_prefill: "prefill", abort_decode: "decode"}
    assert preempted, "the small KV cache preempted nothing"
    hits = [r for r in order if first_start.get(r, 0) > 0]
    assert hits, "no request started from a prefix-cache hit"
    for r, (_, max_tokens) in want.items():
        if r in aborted:
            assert run.outputs[r] < max_tokens
        else:
            assert run.outputs[r] == max_tokens, r
            assert run.finished[r] == "length", r
    assert kv_all_free(s, BLOCKS)
    assert s.chunking.queue_stats() == {
        "prefill_rows": 0,
        "mid_prefill_rows": 0,
        "continuing_rows": 0,
        "steps_in_flight": 0,
    }
    assert len(s.chunking.prepared) == 0
    assert not s._rid_of and not s._req_of and not s._rid_at and not s._at_of and not s.requests
    s.shutdown()


class _FullScan(Scheduler):
    """Scans vLLM's whole waiting queue at every admission, as after a preemption."""

    def _admit_waiting(self):
        self._rescan = True
        super()._admit_waiting()


class _Counting(Scheduler):
    """Counts the admissions that took the arrivals alone."""

    arrivals_alone = 0

    def _admit_waiting(self):
        if not self._rescan and self._arrived:
            _Counting.arrivals_alone += 1
        super()._admit_waiting()


def _queue_churn(cls, async_scheduling):
    """Prompts arriving in a burst then one by one, for 6 slots and a KV cache small enough to
    preempt, two of them aborted before their first step: each step's chunks and the requests'
    outputs."""
    rng = random.Random(5)
    blocks = 100
    s = make_scheduler(cls, budget=BUDGET, num_blocks=blocks, async_scheduling=async_scheduling, max_num_seqs=6)
    d = Driver(s, async_depth=2 if async_scheduling else 1)
    prompts = [(f"a{i}", [rng.randint(10, 31_000) for _ in range(rng.randint(50, 600))], rng.randint(20, 120)) for i in range(16)]
    for step in range(5_000):
        if prompts and step % (2 if len(prompts) > 8 else 15) == 0:
            req_id, prompt, max_tokens = prompts.pop(0)
            d.add(req_id, prompt, max_tokens)
            if req_id in ("a5", "a11"):
                d.abort(req_id)  # waiting, not admitted yet
        if not prompts and not s.has_requests():
            break
        d.step()
    run = d.drain()
    assert kv_all_free(s, blocks) and not s._rid_of and not s.chunking.queue_stats()["prefill_rows"]
    return s, [[(c.req_id, c.start, c.tokens) for c in chunks] for chunks in run.steps], dict(run.outputs)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_admitting_the_arrivals_alone_plans_as_the_whole_queue_scan(async_scheduling):
    _Counting.arrivals_alone = 0
    fast, steps, outputs = _queue_churn(_Counting, async_scheduling)
    full, steps_full, outputs_full = _queue_churn(_FullScan, async_scheduling)
    assert steps == steps_full and outputs == outputs_full
    assert _Counting.arrivals_alone > 5  # the arrivals-alone path ran
    assert fast.mstar_stats.readmitted == full.mstar_stats.readmitted
    preempted = fast.mstar_stats.handed_back or fast.mstar_stats.readmitted
    assert preempted, "the KV cache was big enough for every prompt: no preemption was exercised"
    for s in (fast, full):
        s.shutdown()
