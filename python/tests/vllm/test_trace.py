"""A trace of long and short prompts through the plugin, with a token budget equal to vLLM's:
every request gets exactly its prompt and max_tokens, no step runs more than the budget, every
non-final chunk meets the floor and the alignment, and every KV block is free at the end."""

import random

import pytest
from harness import BLOCK, Driver, VllmScheduler, kv_all_free, make_scheduler

from mstar_chunking import DEFAULT_MIN_CHUNK_TOKENS
from mstar_chunking.vllm import AsyncScheduler, Scheduler

BUDGET = 512
BLOCKS = 4096


def trace(seed: int = 7):
    """(arrival step, prompt tokens, max_tokens): long prompts between short ones."""
    rng = random.Random(seed)
    out = []
    for i in range(30):
        long = i % 3 == 0
        n = rng.randint(1500, 5000) if long else rng.randint(5, 300)
        out.append((i * 3, [rng.randint(10, 31_000) for _ in range(n)], rng.randint(1, 40)))
    return out


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_trace_completes_exactly_within_budget_floor_and_alignment(async_scheduling):
    s = make_scheduler(Scheduler, budget=BUDGET, num_blocks=BLOCKS, async_scheduling=async_scheduling, max_num_seqs=32)
    assert type(s) is (AsyncScheduler if async_scheduling else Scheduler)
    d = Driver(s, async_depth=2 if async_scheduling else 1)
    reqs = trace()
    prompt_of = {}
    i = 0
    for step in range(20_000):
        while i < len(reqs) and reqs[i][0] <= step:
            prompt_of[f"r{i}"] = reqs[i]
            d.add(f"r{i}", reqs[i][1], reqs[i][2])
            i += 1
        if i == len(reqs):
            break
        d.step()
    run = d.drain()

    floor = min(DEFAULT_MIN_CHUNK_TOKENS, BUDGET)
    prefill = {r: 0 for r in prompt_of}
    chunks_cut = 0
    for chunks in run.steps:
        assert sum(c.tokens for c in chunks) <= BUDGET
        for c in chunks:
            if c.start < len(prompt_of[c.req_id][1]):
                prefill[c.req_id] += c.tokens
                if not c.final:
                    chunks_cut += 1
                    assert c.tokens >= floor, c
                    assert (c.start + c.tokens) % BLOCK == 0, c
    assert chunks_cut > 20  # the long prompts were cut
    for r, (_, prompt, max_tokens) in prompt_of.items():
        assert prefill[r] == len(prompt), r
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
    assert not s._rid_of and not s._req_of and not s._rid_at and not s._at_of
    s.shutdown()


def test_vllms_own_chunks_miss_the_floor_and_alignment():
    """The checks above can fail: vLLM's own scheduler, on the same trace and budget, cuts
    prompts wherever its budget ends."""
    s = make_scheduler(VllmScheduler, budget=BUDGET, num_blocks=BLOCKS, max_num_seqs=32)
    d = Driver(s)
    reqs = trace()
    lengths = {}
    for step in range(20_000):
        for i, (at, prompt, max_tokens) in enumerate(reqs):
            if at == step:
                lengths[f"r{i}"] = len(prompt)
                d.add(f"r{i}", prompt, max_tokens)
        if step > reqs[-1][0]:
            break
        d.step()
    run = d.drain()
    cut = [c for st in run.steps for c in st if c.start < lengths[c.req_id] and not c.final]
    assert any((c.start + c.tokens) % BLOCK for c in cut)
    assert any(c.tokens < DEFAULT_MIN_CHUNK_TOKENS for c in cut)
