"""The plugin's stats (`Scheduler.mstar_stats`) without vLLM: steps planned without their time
budget are counted with their reason and logged at the 1st, 2nd, 4th, ... such step."""

import logging
from types import SimpleNamespace

from mstar_chunking._plugin_stats import ChunkingStats


def outcome(step, time_inactive):
    return SimpleNamespace(step=step, time_inactive=time_inactive)


def test_steps_without_their_time_budget_are_counted_with_their_reason_and_logged(caplog):
    stats = ChunkingStats()
    reasons = ["no_measurements"] * 2 + ["untrusted_fit"] * 3
    with caplog.at_level(logging.WARNING, logger="mstar_chunking.vllm"):
        for step, why in enumerate(reasons, start=1):
            stats.completed(outcome(step, why))
    assert stats.time_budget_inactive_steps == 5
    assert stats.time_budget_inactive_reason == "untrusted_fit"
    assert len(stats.outcomes) == 5
    warned = [r.getMessage() for r in caplog.records if "time budget not applied" in r.getMessage()]
    assert len(warned) == 3, warned  # steps 1, 2 and 4
    assert "step 1 planned under its token budget alone (no_measurements); 1 such steps" in warned[0]
    assert "(untrusted_fit); 4 such steps" in warned[2]
    # A step planned under its time budget clears the reason; the count stays.
    stats.completed(outcome(6, None))
    assert (stats.time_budget_inactive_steps, stats.time_budget_inactive_reason) == (5, None)
    assert len(stats.outcomes) == 6
