"""The vLLM plugin's own counts (`mstar_chunking.vllm.Scheduler.mstar_stats`), kept apart from
the plugin so that they import and test without vLLM."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

log = logging.getLogger("mstar_chunking.vllm")


@dataclass
class ChunkingStats:
    """What the plugin saw, for logs and tests (the component's own metrics are separate)."""

    steps: int = 0
    handed_back: int = 0  # planned rows vLLM did not schedule (no blocks, no slot, preempted)
    start_mismatches: int = 0  # a waiting request's prefix-cache hit changed before vLLM reached it
    ended_in_flight: int = 0  # async: forgotten once their last token was scheduled
    refused_requests: int = 0
    readmitted: int = 0  # admitted again to follow vLLM's waiting order (after a preemption)
    unmeasured_steps: int = 0  # async: completed before their time was known
    dropped_outputs: int = 0  # steps whose output never came to update_from_output
    late_measured: int = 0  # of those, times reported after the completion (`measured`)
    # Steps planned without their time budget (no latency model yet: `--learn-cost` without a
    # configured cost, before the fit is trusted), and why the latest completed step was.
    time_budget_inactive_steps: int = 0
    time_budget_inactive_reason: Optional[str] = None
    late_outcomes: deque = field(default_factory=lambda: deque(maxlen=4096))
    measured_ms: deque = field(default_factory=lambda: deque(maxlen=4096))
    outcomes: deque = field(default_factory=lambda: deque(maxlen=4096))  # the component's StepOutcomes

    def completed(self, outcome: Any) -> None:
        """Keeps a completed step's outcome and counts a step planned without its time budget,
        warning at the 1st, 2nd, 4th, ... such step."""
        self.outcomes.append(outcome)
        why = getattr(outcome, "time_inactive", None)
        self.time_budget_inactive_reason = why
        if why is None:
            return
        self.time_budget_inactive_steps += 1
        n = self.time_budget_inactive_steps
        if n & (n - 1) == 0:
            log.warning(
                "time budget not applied: step %d planned under its token budget alone (%s); %d such steps so far "
                "(logged on the 1st, 2nd, 4th, ...); give the plugin a latency model to start from "
                "(docs/cost-model.md#when-a-time-budget-is-not-in-force)",
                getattr(outcome, "step", -1),
                why,
                n,
            )
