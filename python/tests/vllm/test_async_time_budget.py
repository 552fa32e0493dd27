"""A time budget under ASYNC scheduling (vLLM's `AsyncScheduler` under the plugin): step N is
completed in the component when step N+1 is scheduled, before N's time is known, and N's
measured time reaches the component later, through `measured(step, ms)` when N's output
arrives. Those late times must feed the online fit and the time margin: the component starts
from a configured latency model that underpredicts every step (0.6 of the truth), so its early
steps overrun the time budget; once enough late times have come back, the fit (or the margin)
corrects the plan and no step overruns by misprediction again. Without the late path the fit
never sees a step and the margin stays at 1: the wrong model would overrun to the end.

The fabricated step takes exactly the four-term time of what vLLM scheduled (the truth), on a
simulated clock the scheduler measures its steps with."""

import pytest
from harness import Driver, four_term_ms, kv_all_free, make_scheduler

from mstar_chunking.vllm import AsyncScheduler, Scheduler

BUDGET = 2048
MAX_STEP_MS = 80.0
COST = (5.0, 0.0624, 0.00033, 3.4e-6)  # the truth: base, per token, per KV token read, per pair
WRONG = tuple(0.6 * c for c in COST)  # what the component is configured with
BLOCKS = 8192
LIVENESS = {"floor", "uncut_row", "continuing"}  # docs/cost-model.md#time-overruns
FIT_SAMPLES = 50  # the online fit is trusted from 50 steps on (docs/fitting.md#online)
MARGIN_STEPS = 32  # the time margin is 1 until 32 steps are seen (docs/cost-model.md)


class Learning(Scheduler):
    """The wrong model, learning online from the steps' measured times."""

    def chunking_settings(self):
        return {
            **super().chunking_settings(),
            "max_step_ms": {"llm": {"mixed": MAX_STEP_MS}},
            "cost": {"llm": WRONG},
            "learn_cost": True,
        }


class Margin(Scheduler):
    """The wrong model, planned against the budget over the measured / predicted quantile."""

    def chunking_settings(self):
        return {
            **super().chunking_settings(),
            "max_step_ms": {"llm": {"mixed": MAX_STEP_MS}},
            "cost": {"llm": WRONG},
            "time_margin": 0.9,
        }


def run(cls):
    s = make_scheduler(cls, budget=BUDGET, num_blocks=BLOCKS, max_num_seqs=32, async_scheduling=True)
    assert isinstance(s, AsyncScheduler) and isinstance(s, cls)
    now = [0.0]
    s.clock = lambda: now[0]
    times = {}  # the component's step number -> simulated ms
    reported = {}  # step number -> measured times the component had been given when it was planned
    measured_before = [0]

    def advance(out, chunks):
        ms = four_term_ms(COST, chunks)
        times[s._in_flight[0][1].step] = ms
        now[0] += ms / 1e3

    d = Driver(s, async_depth=2, step_ms=advance)
    for i in range(8):
        d.add(f"d{i}", [500 + i] * 64, 300)
    for i in range(8):
        d.add(f"p{i}", [(7 * i + j) % 30_000 + 10 for j in range(12_000)], 4)
    for _ in range(20_000):
        if not s.has_requests():
            break
        measured_before[0] = s.mstar_stats.late_measured
        d.step()
        reported[s._uncompleted.step] = measured_before[0]
    out = d.drain()
    assert all(out.outputs[r] == (300 if r.startswith("d") else 4) for r in out.outputs), dict(out.outputs)
    assert len(out.outputs) == 16
    assert kv_all_free(s, BLOCKS)
    return s, times, reported


@pytest.mark.parametrize("cls, needed", [(Learning, FIT_SAMPLES), (Margin, MARGIN_STEPS)], ids=["fit", "margin"])
def test_async_late_times_feed_the_fit_and_the_margin(cls, needed):
    s, times, reported = run(cls)
    stats = s.mstar_stats
    late = {o["step"]: o for o in stats.late_outcomes}
    # Each step over the budget is one the component reports with a time-overrun reason.
    over = {step: ms for step, ms in times.items() if ms > MAX_STEP_MS + 1e-6}
    reasons = {}
    for step in over:
        o = late[step] if step in late else next(o for o in stats.outcomes if o.step == step)
        reason = o["time_overrun"] if isinstance(o, dict) else o.time_overrun
        assert reason is not None, (step, over[step])
        reasons[step] = reason
    # The wrong model overran by misprediction at first ...
    early = [st for st, r in reasons.items() if r == "misprediction" and st <= needed]
    assert len(early) >= needed // 2, reasons
    # ... and once enough late times could have come back (step N is planned when the times of
    # steps up to N - 2 are known), never again: what remains over the budget is a liveness
    # case (a floor chunk, an uncut row, continuing rows alone over it).
    settled = needed + 3
    later = {st: r for st, r in reasons.items() if st >= settled}
    assert all(r in LIVENESS for r in later.values()), later
    assert len(later) <= 2, later
    assert len(times) > settled + 100
    # Every step but the last was completed before its time was known, and every one of those
    # times came back later and was applied: one late outcome per such step, with its time,
    # each before the step two on was planned.
    assert stats.unmeasured_steps >= len(times) - 1
    assert stats.late_measured == stats.unmeasured_steps == len(late)
    assert all(reported[st] >= st - 2 for st in times), reported
    for step, o in late.items():
        assert abs(o["measured_ms"] - times[step]) < 1e-6, (step, o, times[step])
        assert o["max_step_ms"] == MAX_STEP_MS
    # A request whose last token was in a step in flight was not planned again (vLLM would have
    # handed its decode row back, and the row's KV would have counted in the step's features).
    assert stats.ended_in_flight == 16 and stats.handed_back == 0
    lm = s.chunking.latency_model("llm")
    if cls is Learning:
        # The fit saw every late time (and the last step's, measured in time), and is the truth.
        assert lm.fit.samples == stats.late_measured + (len(times) - stats.unmeasured_steps)
        assert lm.source == "online" and lm.fit.trusted
        for got, want in zip(lm.model, COST):
            assert abs(got - want) <= 1e-3 * want + 1e-12, (lm.model, COST)
    else:
        # The margin was planned with the measured / predicted ratio, 1 / 0.6, once it was known.
        margins = [late[st]["time_margin"] for st in sorted(late) if st >= settled]
        assert margins and all(abs(m - 1 / 0.6) < 1e-3 for m in margins), margins[:5]
        assert lm.source == "config"
    s.shutdown()
