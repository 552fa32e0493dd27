"""The partial-prefill limit holds in every step under the plugin; vLLM's own scheduler, given the
same settings, runs more prompts mid-prefill at once (vLLM 0.33 has no such limit at all: its V1
scheduler never read `max_num_partial_prefills`, and the setting is gone from its config)."""

import pytest
from harness import Driver, kv_all_free, make_scheduler, VllmScheduler

from mstar_chunking.vllm import Scheduler

LIMIT = 2
BUDGET = 512
THRESHOLD = 128  # vLLM's long_prefill_token_threshold: the per-row cap, so prompts go side by side
BLOCKS = 4096


class Limited(Scheduler):
    def chunking_settings(self):
        return {**super().chunking_settings(), "max_partial_prefills": LIMIT}


def mid_prefill_counts(cls, prompts):
    s = make_scheduler(cls, budget=BUDGET, threshold=THRESHOLD, num_blocks=BLOCKS)
    d = Driver(s)
    for i, n in enumerate(prompts):
        d.add(f"p{i}", [100 + i] * 7 + list(range(1000, 1000 + n - 7)), 4)
    counts = []
    for _ in range(2_000):
        if not s.has_requests():
            break
        d.step()
        counts.append(sum(1 for r in s.requests.values() if 0 < r.num_computed_tokens < r.num_prompt_tokens))
    run = d.drain()
    assert all(run.outputs[f"p{i}"] == 4 for i in range(len(prompts)))
    assert kv_all_free(s, BLOCKS)
    if isinstance(s, Scheduler):
        assert len(s.chunking.prepared) == 0
    s.shutdown()
    return counts


@pytest.mark.parametrize("prompts", [[1500] * 6, [2000, 300, 1200, 90, 2500, 700, 1800]], ids=["equal", "mixed"])
def test_limit_holds_where_vllm_does_not(prompts):
    ours = mid_prefill_counts(Limited, prompts)
    theirs = mid_prefill_counts(VllmScheduler, prompts)
    assert max(ours) <= LIMIT, ours
    assert max(ours) == LIMIT  # the limit, not the budget, is what held them back
    assert max(theirs) > LIMIT, theirs  # vLLM starts every prompt the budget reaches
