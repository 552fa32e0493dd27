"""vLLM's own limits under the plugin, and the plugin's hand-offs with vLLM:

- `long_prefill_token_threshold` is the component's per-row cap: no chunk is larger, even for a
  request alone (where vLLM's own scheduler lifts it);
- `max_num_seqs` and `max_model_len` still hold, sync and async;
- a waiting request whose prefix-cache hit changed between its admission and vLLM reaching it
  is admitted again from the new hit, and runs from there;
- a planned request vLLM cannot allocate KV blocks for is handed back in the same step (its
  row reported as not run) and planned again, never lost."""

import pytest
from harness import BLOCK, Driver, VllmScheduler, kv_all_free, make_scheduler

from mstar_chunking.vllm import Scheduler

THRESHOLD = 200  # not a multiple of the block: the cap, aligned down, gives 192-token chunks


def prefill_chunks(run, prompts):
    """Every prompt chunk of a run: (step index, chunk), the last chunk of each prompt included."""
    return [(i, c) for i, st in enumerate(run.steps) for c in st if c.start < prompts[c.req_id]]


def test_long_prefill_token_threshold_is_the_per_row_cap():
    prompts = {"alone": 3000}
    prompts.update({f"r{i}": 1000 + 300 * i for i in range(4)})

    def run(cls, threshold):
        s = make_scheduler(cls, budget=1024, threshold=threshold, max_num_seqs=8)
        d = Driver(s)
        d.add("alone", [11] * 7 + list(range(100, 100 + prompts["alone"] - 7)), 2)
        for _ in range(3):  # the first request runs alone for a while
            d.step()
        for i in range(4):
            d.add(f"r{i}", [20 + i] * 7 + list(range(5000, 5000 + prompts[f"r{i}"] - 7)), 2)
        out = d.drain()
        assert all(out.outputs[r] == 2 for r in prompts), dict(out.outputs)
        s.shutdown()
        return prefill_chunks(out, prompts)

    ours = run(Scheduler, THRESHOLD)
    assert max(c.tokens for _, c in ours) <= THRESHOLD
    assert all(c.tokens == 192 for _, c in ours if not c.final and c.start % BLOCK == 0)
    assert sum(1 for i, c in ours if i < 3) == 3  # the lone request's chunks were capped too
    # Without the threshold the same trace runs larger chunks; vLLM's own scheduler lifts its
    # threshold for a request alone.
    assert max(c.tokens for _, c in run(Scheduler, 0)) > THRESHOLD
    theirs = run(VllmScheduler, THRESHOLD)
    assert max(c.tokens for i, c in theirs if i < 3) > THRESHOLD
    assert max(c.tokens for i, c in theirs if i >= 3) <= THRESHOLD


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_max_num_seqs_and_max_model_len_hold(async_scheduling):
    max_seqs, max_len = 4, 1024
    s = make_scheduler(
        Scheduler, budget=512, max_num_seqs=max_seqs, max_model_len=max_len, async_scheduling=async_scheduling
    )
    d = Driver(s, async_depth=2 if async_scheduling else 1)
    want = {}
    for i in range(10):
        prompt = 100 + 97 * i  # 100 .. 973 tokens
        max_tokens = 60 + 30 * i  # the last three would pass max_model_len
        want[f"q{i}"] = (prompt, max_tokens)
        d.add(f"q{i}", [30 + i] * prompt, max_tokens)
    held = []
    while s.has_requests():
        chunks = d.step()
        assert len(chunks) <= max_seqs and len(s.running) <= max_seqs
        assert all(c.start + c.tokens <= max_len for c in chunks)
        held.append(len(s._rid_of))
    run = d.drain()
    # The component never held more requests than vLLM had slots for.
    assert max(held) <= max_seqs
    capped = 0
    for r, (prompt, max_tokens) in want.items():
        expected = min(max_tokens, max_len - prompt)
        capped += expected < max_tokens
        assert run.outputs[r] == expected, (r, run.outputs[r], expected)
        assert run.finished[r] == "length", r
    assert capped == 3
    assert kv_all_free(s, 10_000)
    assert len(s.chunking.prepared) == 0 and not s._rid_of
    s.shutdown()


class OnePrefill(Scheduler):
    def chunking_settings(self):
        return {**super().chunking_settings(), "max_partial_prefills": 1}


def test_readmitted_when_the_prefix_cache_hit_changes():
    """`late` shares `first`'s 1,024-token prompt and waits behind it (one prefill at a time):
    admitted with the hit `first` had cached by then, it finds `first`'s whole prompt cached when
    vLLM reaches it, and is admitted again from there."""
    s = make_scheduler(OnePrefill, budget=256)
    d = Driver(s)
    shared = [(7 * j) % 30_000 + 10 for j in range(1024)]
    d.add("first", shared, 3)
    d.step()  # first's chunk [0, 256) runs; its blocks are cached
    d.add("late", shared + list(range(20_000, 20_100)), 3)
    plans = []  # late's rows: (rid, planned, ran)
    while s.has_requests():
        d.step()
        rec = s._uncompleted
        if rec is not None:
            plans += [(rid, t, n) for r, rid, t, n in rec.rows() if r == "late"]
    run = d.drain()
    late = [c for st in run.steps for c in st if c.req_id == "late" and c.start < 1124]
    assert s.mstar_stats.start_mismatches == 1
    # Planned once under its first admission (from the hit then), not run; then under a second.
    rids = sorted({rid for rid, _, _ in plans})
    under_first = [(t, n) for rid, t, n in plans if rid == rids[0]]
    assert len(rids) == 2 and len(under_first) == 1 and under_first[0][1] == 0, plans
    assert late[0].start == 1024 and sum(c.tokens for c in late) == 100, late
    assert run.outputs["first"] == 3 and run.outputs["late"] == 3
    assert len(s.chunking.prepared) == 0 and not s._rid_of and not s._start_hint
    s.shutdown()


def test_unallocatable_request_is_handed_back_and_planned_again():
    """A KV cache of 64 blocks (1,024 tokens) for prompts of 300-600 tokens: vLLM cannot
    allocate for some planned chunks (no preemption: a waiting request does not preempt). Each
    such row is reported to the component as not run in that step's completion, planned again
    in the next step, and runs once blocks are free; every prompt is prefilled exactly once."""
    blocks = 64
    s = make_scheduler(Scheduler, budget=512, num_blocks=blocks, max_num_seqs=8)
    d = Driver(s)
    prompts = {}
    for i in range(6):
        prompts[f"k{i}"] = 300 + 60 * i
        d.add(f"k{i}", [40 + i] * 7 + list(range(1000 * i, 1000 * i + prompts[f"k{i}"] - 7)), 24)
    steps = []  # the component's steps: (step, {request id: (planned, ran)})
    preemptions = 0
    while s.has_requests():
        d.step()
        preemptions = max([preemptions] + [r.num_preemptions for r in s.requests.values()])
        rec = s._uncompleted
        if rec is None:  # idle: the last step was completed at once
            break
        steps.append((rec.step, {req_id: (planned, ran) for req_id, _, planned, ran in rec.rows()}))
    run = d.drain()
    assert preemptions == 0
    outcome = {o.step: o for o in s.mstar_stats.outcomes}
    handed_back = 0
    for i, (step, rows) in enumerate(steps):
        back = [r for r, (planned, ran) in rows.items() if planned and not ran]
        handed_back += len(back)
        # Reported in the same step's completion, and planned again in the next step.
        assert outcome[step].unrun_chunks == len(back), (step, back)
        for r in back:
            assert r in steps[i + 1][1], (step, r)
    assert handed_back == s.mstar_stats.handed_back >= 20
    first = {}
    for step, rows in steps:
        for r, (planned, ran) in rows.items():
            first.setdefault(r, (planned, ran))
    assert sum(1 for planned, ran in first.values() if not ran) >= 2  # first plans vLLM could not take
    prefilled = {r: 0 for r in prompts}
    for st in run.steps:
        for c in st:
            if c.start < prompts[c.req_id]:
                prefilled[c.req_id] += c.tokens
    assert prefilled == prompts
    for r in prompts:
        assert run.outputs[r] == 24 and run.finished[r] == "length", r
    assert kv_all_free(s, blocks)
    assert len(s.chunking.prepared) == 0 and not s._rid_of
    s.shutdown()


class Shortening(Scheduler):
    """vLLM giving a planned chunk fewer tokens than planned (it never does: the plugin's hook
    answers the plan's tokens or 0; this stands for a vLLM that would)."""

    def _reserve_prefill_lookahead(self, request, num_computed_tokens, num_new_tokens):
        n = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        return n - BLOCK if n > BLOCK else n


def test_vllm_scheduling_other_than_the_plan_is_an_error():
    s = make_scheduler(Shortening, budget=256)
    d = Driver(s)
    d.add("long", [9] * 1000, 2)
    with pytest.raises(RuntimeError, match=r"vLLM scheduled 240 tokens of request 'long', planned 256"):
        d.step()
    s.shutdown()
