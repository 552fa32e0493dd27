"""LoRA under the plugin. vLLM runs at most `max_loras` distinct adapters at once: a waiting
request whose adapter would be one more than the running requests and those started in the step
have is skipped, and the requests behind it are looked at. The plugin admits waiting requests to
the component under the same bound, over the running and the admitted requests in queue order,
so the plan never gives budget to a request vLLM will not start, and a request whose adapter
cannot run does not hold back those behind it.

With vLLM's chunk rules (no alignment, no floor) the plugin schedules a trace of requests on four
adapters (and none) step for step as vLLM's own scheduler does, and no planned row is handed
back; with its defaults every request completes and nothing is held."""

import pytest
from harness import Driver, VllmScheduler, kv_all_free, make_scheduler

from mstar_chunking.vllm import Scheduler

BUDGET = 512
MAX_LORAS = 2

# (id, prompt length, adapter (0: none), max_tokens), all waiting at the start
REQUESTS = [
    ("r0", 300, 1, 12),
    ("r1", 200, 2, 10),
    ("r2", 400, 3, 8),  # a third adapter: waits while 1 and 2 run
    ("r3", 150, 1, 20),  # behind it, on a running adapter: starts at once
    ("r4", 260, 0, 6),  # no adapter: never held back
    ("r5", 90, 4, 5),
    ("r6", 333, 2, 9),
    ("r7", 64, 3, 7),
]


class VllmRules(Scheduler):
    """The plugin with vLLM's chunk rules (no alignment, no floor): vLLM's exact chunks."""

    def chunking_settings(self):
        return {**super().chunking_settings(), "align": 1, "min_chunk_tokens": 1}


def run(cls, async_scheduling=False):
    s = make_scheduler(cls, budget=BUDGET, max_num_seqs=8, max_loras=MAX_LORAS, async_scheduling=async_scheduling)
    d = Driver(s, async_depth=2 if async_scheduling else 1)
    for i, (req_id, n, lora, max_tokens) in enumerate(REQUESTS):
        d.add(req_id, [40 + i] * 5 + list(range(3000 * i, 3000 * i + n - 5)), max_tokens, lora=lora)
    adapters = dict((r, lora) for r, _, lora, _ in REQUESTS)
    started = {}
    while s.has_requests() and len(d.run.steps) < 1_000:
        for c in d.step():
            started.setdefault(c.req_id, len(d.run.steps) - 1)
        running = {adapters[r.request_id] for r in s.running} - {0}
        assert len(running) <= MAX_LORAS, running
    out = d.drain()
    for req_id, _, _, max_tokens in REQUESTS:
        assert out.outputs[req_id] == max_tokens, (req_id, dict(out.outputs))
    assert kv_all_free(s, 10_000)
    if isinstance(s, Scheduler):
        assert not s._rid_of and len(s.chunking.prepared) == 0
    stats = getattr(s, "mstar_stats", None)
    s.shutdown()
    return [sorted((c.req_id, c.start, c.tokens) for c in st) for st in out.steps], started, stats


def test_the_plugin_schedules_as_vllm_with_lora():
    theirs, their_started, _ = run(VllmScheduler)
    ours, started, stats = run(VllmRules)
    assert ours == theirs
    # r2's third adapter waited for r0's or r1's to finish; r3, r4 and r6 behind it started as
    # soon as the budget reached them.
    assert max(started[r] for r in ("r3", "r4", "r6")) == 1 < started["r2"], started
    assert stats.handed_back == 0  # nothing planned for a request vLLM would skip


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_defaults_hold_back_only_the_adapter_that_cannot_run(async_scheduling):
    _, started, stats = run(Scheduler, async_scheduling)
    assert max(started[r] for r in ("r3", "r4", "r6")) == 1 < started["r2"], started
    assert stats.handed_back == 0
