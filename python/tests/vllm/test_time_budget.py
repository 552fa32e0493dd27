"""A time budget with a simulated four-term step time reported back: the plugin's steps stay
within it (a step over it is one the component reports with its time-overrun reason), where
vLLM's token budget alone runs over it. The fabricated step takes exactly the latency model's
time for what vLLM scheduled, on a simulated clock the scheduler measures its steps with."""


from harness import Driver, VllmScheduler, four_term_ms, kv_all_free, make_scheduler

from mstar_chunking.vllm import Scheduler

BUDGET = 2048
MAX_STEP_MS = 80.0
COST = (5.0, 0.0624, 0.00033, 3.4e-6)  # base, per token, per KV token read, per attention pair
BLOCKS = 8192


class Timed(Scheduler):
    def chunking_settings(self):
        return {**super().chunking_settings(), "max_step_ms": {"llm": {"mixed": MAX_STEP_MS}}, "cost": {"llm": COST}}


def run(cls):
    s = make_scheduler(cls, budget=BUDGET, num_blocks=BLOCKS, max_num_seqs=32)
    now = [0.0]
    s.clock = lambda: now[0]
    times = {}  # our step number (or vLLM's step index) -> simulated ms

    def advance(out, chunks):
        ms = four_term_ms(COST, chunks)
        rec = s._in_flight[0][1] if isinstance(s, Scheduler) else None
        times[rec.step if rec is not None else len(times)] = ms
        now[0] += ms / 1e3

    d = Driver(s, step_ms=advance)
    for i in range(8):
        d.add(f"d{i}", [500 + i] * 64, 120)
    for _ in range(4):
        d.step()
    for i in range(4):
        d.add(f"p{i}", [(7 * i + j) % 30_000 + 10 for j in range(12_000)], 4)
    out = d.drain()
    assert all(out.outputs[r] == (120 if r.startswith("d") else 4) for r in out.outputs)
    assert kv_all_free(s, BLOCKS)
    return s, times


def test_time_budget_holds_where_the_token_budget_alone_runs_over():
    ours, ours_ms = run(Timed)
    outcomes = {o.step: o for o in ours.mstar_stats.outcomes}
    over = {step: ms for step, ms in ours_ms.items() if ms > MAX_STEP_MS + 1e-6}
    for step, ms in over.items():
        assert outcomes[step].time_overrun is not None, (step, ms)
    assert len(over) <= 2, over
    # The measured times reached the component: each completed step carries its simulated time.
    measured = [o for o in outcomes.values() if o.measured_ms is not None]
    assert measured and all(abs(o.measured_ms - ours_ms[o.step]) < 1e-6 for o in measured)
    ours.shutdown()
    theirs, theirs_ms = run(VllmScheduler)
    assert sum(ms > MAX_STEP_MS for ms in theirs_ms.values()) > 10
    theirs.shutdown()
