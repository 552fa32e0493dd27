"""An engine loop on mstar_chunking's step API: replays a request trace on a simulated clock.

The same loop as `mstar-chunking replay` with the same settings (the demo model's node `llm`
stepping its combined walk `mixed`, policies of 2048 tokens aligned to 16, the floor 64, no
speculation, no prefix cache), so both print the same step count:

    python python/examples/engine_loop.py --requests 500
    cargo run --release -- replay --requests 500

A step's simulated time is the replay's cost model over what it ran: by default `8 ms + 0.02
ms per token`; with `--sim-cost PRESET` (or `--cost PRESET`, which also sets it) the preset's
four terms (tokens, context tokens read, attention pairs), as `replay.cost = "PRESET"`. Under
a time budget the planner predicts with `--cost` (`chunking.cost`):

    python python/examples/engine_loop.py --requests 500 --max-step-ms 100 --cost llama2-7b-a100
    # the same as `replay --requests 500` with chunking.max_step_ms.llm = 100.0,
    # chunking.cost.llm = "llama2-7b-a100" and replay.cost = "llama2-7b-a100"

One message per step: every step is `complete_and_assemble`, carrying what changed since the
step was planned (`NextStep`): requests that finished are forgotten, prompts whose final chunk
ran continue as `decode` rows, and every request that arrived by the step's end is admitted;
when nothing is left queued the clock jumps to the next arrival first; a decode row starts
with its true context (the prompt and its first token), as the replay's. A prompt's final chunk
yields its first token; each further token takes its continuing row one step. Prints the summary
as `key: value` lines (`steps: N` first).
"""

from __future__ import annotations

import argparse
import calendar
import csv
import sys
from pathlib import Path
from typing import Optional, Sequence

from mstar_chunking import (
    Batch,
    ChunkingManagement,
    ChunkingPolicy,
    LatencyModel,
    NextStep,
    SubmoduleCaps,
    preset_cost,
)

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "data" / "traces" / "AzureLLMInferenceTrace_code.csv"
NODE, PREFILL, DECODE, MIXED = "llm", "prefill", "decode", "mixed"
# The replay's default step cost (`replay.cost`): 8 ms + 0.02 ms per token.
DEFAULT_SIM_COST = LatencyModel(8.0, 0.02, 0.0, 0.0)

Request = tuple[float, int, int]


def wall_ns(stamp: str, line: int) -> int:
    """`2023-11-16 18:17:03.9799600` as integer ns since the epoch (exact, any fraction)."""
    try:
        date, time = stamp.strip().split(" ")
        y, mo, d = (int(x) for x in date.split("-"))
        hms, _, frac = time.partition(".")
        h, mi, s = (int(x) for x in hms.split(":"))
        if len(frac) > 9 or (frac and not frac.isdigit()):
            raise ValueError(frac)
    except ValueError:
        sys.exit(f"trace line {line}: TIMESTAMP {stamp!r} is not `YYYY-MM-DD HH:MM:SS[.fraction]`")
    return calendar.timegm((y, mo, d, h, mi, s, 0, 0, 0)) * 10**9 + int(frac.ljust(9, "0") or 0)


def read_azure(path: Path, limit: Optional[int]) -> list[Request]:
    """`(arrival_ms, prompt_tokens, output_tokens)` per request, times from the first one."""
    out: list[Request] = []
    first: Optional[int] = None
    with open(path, newline="") as f:
        for line, rec in enumerate(csv.DictReader(f), start=2):
            if limit is not None and len(out) == limit:
                break
            ns = wall_ns(rec["TIMESTAMP"], line)
            first = ns if first is None else first
            out.append(((ns - first) / 1e6, int(rec["ContextTokens"]), int(rec["GeneratedTokens"])))
    return out


def replay(
    requests: Sequence[Request],
    budget: Optional[int] = None,
    *,
    max_step_ms: Optional[float] = None,
    cost: Optional[str] = None,
    sim_cost: Optional[str] = None,
) -> dict[str, object]:
    """Replays `requests` under the token budget `budget` of llm/mixed (`None`: the policy's)
    and, with `max_step_ms`, a time budget planned with the preset `cost`; the simulated step
    time is the preset `sim_cost` (default: `cost`, else 8 ms + 0.02 ms per token)."""
    cm = ChunkingManagement({NODE: SubmoduleCaps([PREFILL, MIXED], False)}, model="engine-loop")
    try:
        cm.set_policies(
            {(NODE, PREFILL): ChunkingPolicy(2048, align=16), (NODE, MIXED): ChunkingPolicy(2048, align=16)}
        )
        overrides = {} if budget is None else {NODE: {MIXED: budget}}
        cm.set_budgets(
            overrides,
            [PREFILL, DECODE, MIXED],
            combined_walk_of={PREFILL: MIXED, DECODE: MIXED},
            max_step_ms=None if max_step_ms is None else {NODE: max_step_ms},
            cost=None if cost is None else {NODE: cost},
        )
        sim_name = sim_cost if sim_cost is not None else cost
        sim = DEFAULT_SIM_COST if sim_name is None else preset_cost(sim_name)
        return run(cm, requests, sim)
    finally:
        cm.close()


def run(cm: ChunkingManagement, requests: Sequence[Request], sim: LatencyModel) -> dict[str, object]:
    n = len(requests)
    remaining = [0] * n  # tokens still to generate after the current one
    context = [0] * n  # a generating request's true context: its prompt and tokens so far
    t_ms, nxt = 0.0, 0
    prefilling = decoding = 0
    steps = scheduled = prefill_tokens = decode_tokens = chunks = time_overruns = 0

    def admit_arrived(next_step: Optional[NextStep]) -> None:
        """Admits every request that arrived by `t_ms` (into `next_step`, or at once)."""
        nonlocal nxt, prefilling
        while nxt < n and requests[nxt][0] <= t_ms:
            prompt = requests[nxt][1]
            base = (nxt * 31) & 0xFFFFFFFF  # synthetic token ids, a real prompt-length input
            ids = range(base, base + prompt) if base + prompt <= 2**32 else [1] * prompt
            if next_step is None:
                cm.admit(nxt, NODE, PREFILL, ids)
            else:
                next_step.admit(nxt, PREFILL, ids)
            prefilling += 1
            nxt += 1

    if n:
        t_ms = requests[0][0]
        admit_arrived(None)
    batch: Optional[Batch] = cm.assemble(NODE, MIXED) if n else None
    while batch is not None:
        if len(batch) == 0:
            raise SystemExit(f"stalled at {t_ms} ms: {prefilling} prompts and {decoding} decode rows queued")
        ran = batch.planned()
        tokens = kv = pairs = 0
        for row in batch.rows:
            tokens += row.tokens
            chunk = row.range  # None for a continuing row
            if chunk is None:
                kv += context[row.rid]
            else:
                pairs += LatencyModel.attention_pairs(chunk.start, chunk.end)
        step_ms = sim.predict_ms(tokens, kv, pairs)
        t_ms += step_ms
        steps += 1
        scheduled += batch.scheduled_tokens
        next_step = NextStep(NODE, MIXED)
        for row, r in zip(batch.rows, ran):
            rid, chunk = row.rid, row.range
            if chunk is None:
                decode_tokens += r
                context[rid] += 1
                remaining[rid] -= 1
                if remaining[rid] == 0:
                    next_step.forget_request(rid)
                    decoding -= 1
            else:
                prefill_tokens += r
                chunks += 1
                if not row.is_final:
                    continue
                prefilling -= 1
                context[rid] = chunk.total + 1
                remaining[rid] = max(requests[rid][2], 1) - 1
                if remaining[rid] > 0:
                    # Its context lets the planner predict its KV and attention terms.
                    next_step.continue_row(rid, DECODE, 1, context=context[rid])
                    decoding += 1
        if prefilling == 0 and decoding == 0:
            if nxt == n:
                # The last step: nothing follows it.
                outcome = cm.complete(batch.step, ran, step_ms)
                time_overruns += outcome.time_overrun is not None
                break
            t_ms = max(t_ms, requests[nxt][0])
        admit_arrived(next_step)
        done = cm.complete_and_assemble(batch.step, ran, step_ms, next=next_step)
        time_overruns += done.outcome.time_overrun is not None
        batch = done.next
    return {
        "steps": steps,
        "requests": n,
        "scheduled_tokens": scheduled,
        "prefill_tokens": prefill_tokens,
        "decode_tokens": decode_tokens,
        "chunks": chunks,
        "time_overruns": time_overruns,
        "simulated_ms": round(t_ms - (requests[0][0] if requests else 0.0), 3),
        "prepared_left": len(cm.prepared),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--requests", type=int, default=500, help="replay the trace's first N requests")
    ap.add_argument("--trace", type=Path, default=TRACE, help="an Azure CSV trace")
    ap.add_argument("--budget", type=int, default=None, help="max_batch_tokens of llm/mixed (as replay --budget)")
    ap.add_argument("--max-step-ms", type=float, default=None, help="the time budget of llm (chunking.max_step_ms)")
    ap.add_argument("--cost", default=None, help="the planner's latency model preset (chunking.cost)")
    ap.add_argument("--sim-cost", default=None, help="the simulated step time's preset (replay.cost; default: --cost)")
    a = ap.parse_args()
    if a.requests < 1:
        ap.error("--requests must be at least 1")
    summary = replay(
        read_azure(a.trace, a.requests), a.budget, max_step_ms=a.max_step_ms, cost=a.cost, sim_cost=a.sim_cost
    )
    for k, v in summary.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
