"""An engine loop on mstar_chunking's step API: replays a request trace on a simulated clock.

The same loop as `mstar-chunking replay` with the default settings (the demo model's node `llm`
stepping its combined walk `mixed`, policies of 2048 tokens aligned to 16, the floor 64, the
step cost `8 ms + 0.02 ms per token`, no speculation, no prefix cache), so both print the same
step count:

    python python/examples/engine_loop.py --requests 500
    cargo run --release -- replay --requests 500

Before each step every request that has arrived by the step's start is admitted; when nothing
is queued the clock jumps to the next arrival. A prompt's final chunk yields its first token;
each further token takes its continuing `decode` row one step. Prints the summary as
`key: value` lines (`steps: N` first).
"""

from __future__ import annotations

import argparse
import calendar
import csv
import sys
from pathlib import Path

from mstar_chunking import ChunkingManagement, ChunkingPolicy, SubmoduleCaps

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "data" / "traces" / "AzureLLMInferenceTrace_code.csv"
NODE, PREFILL, DECODE, MIXED = "llm", "prefill", "decode", "mixed"
BASE_MS, PER_TOKEN_MS = 8.0, 0.02


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


def read_azure(path: Path, limit: int | None):
    """`(arrival_ms, prompt_tokens, output_tokens)` per request, times from the first one."""
    out, first = [], None
    with open(path, newline="") as f:
        for line, rec in enumerate(csv.DictReader(f), start=2):
            if limit is not None and len(out) == limit:
                break
            ns = wall_ns(rec["TIMESTAMP"], line)
            first = ns if first is None else first
            out.append(((ns - first) / 1e6, int(rec["ContextTokens"]), int(rec["GeneratedTokens"])))
    return out


def replay(requests, budget: int | None = None) -> dict:
    cm = ChunkingManagement({NODE: SubmoduleCaps([PREFILL, MIXED], False)}, model="engine-loop")
    try:
        cm.set_policies(
            {(NODE, PREFILL): ChunkingPolicy(2048, align=16), (NODE, MIXED): ChunkingPolicy(2048, align=16)}
        )
        overrides = {} if budget is None else {NODE: {MIXED: budget}}
        cm.set_budgets(overrides, [PREFILL, DECODE, MIXED], combined_walk_of={PREFILL: MIXED, DECODE: MIXED})
        return run(cm, requests)
    finally:
        cm.close()


def run(cm: ChunkingManagement, requests) -> dict:
    n = len(requests)
    remaining = [0] * n  # tokens still to generate after the current one
    t_ms, nxt = 0.0, 0
    prefilling = decoding = 0
    steps = scheduled = prefill_tokens = decode_tokens = chunks = 0
    while True:
        if prefilling == 0 and decoding == 0:
            if nxt == n:
                break
            t_ms = max(t_ms, requests[nxt][0])
        while nxt < n and requests[nxt][0] <= t_ms:
            prompt = requests[nxt][1]
            base = (nxt * 31) & 0xFFFFFFFF  # synthetic token ids, a real prompt-length input
            cm.admit(
                nxt, NODE, PREFILL, range(base, base + prompt) if base + prompt <= 2**32 else [1] * prompt
            )
            prefilling += 1
            nxt += 1
        batch = cm.assemble(NODE, MIXED)
        if len(batch) == 0:
            cm.complete(batch.step, [])
            raise SystemExit(f"stalled at {t_ms} ms: {prefilling} prompts and {decoding} decode rows queued")
        ran = batch.planned()
        step_ms = BASE_MS + PER_TOKEN_MS * float(sum(ran))
        t_end = t_ms + step_ms
        cm.complete(batch.step, ran, step_ms)
        steps += 1
        scheduled += batch.scheduled_tokens
        for row, r in zip(batch.rows, ran):
            rid = row.rid
            if row.kind == "continue":
                decode_tokens += r
                remaining[rid] -= 1
                if remaining[rid] == 0:
                    cm.forget_request(rid)
                    decoding -= 1
            else:
                prefill_tokens += r
                chunks += 1
                if not row.range.is_final:
                    continue
                prefilling -= 1
                remaining[rid] = max(requests[rid][2], 1) - 1
                if remaining[rid] > 0:
                    cm.continue_row(rid, NODE, DECODE, 1)
                    decoding += 1
        t_ms = t_end
    return {
        "steps": steps,
        "requests": n,
        "scheduled_tokens": scheduled,
        "prefill_tokens": prefill_tokens,
        "decode_tokens": decode_tokens,
        "chunks": chunks,
        "simulated_ms": round(t_ms - (requests[0][0] if requests else 0.0), 3),
        "prepared_left": len(cm.prepared),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=500, help="replay the trace's first N requests")
    ap.add_argument("--trace", type=Path, default=TRACE, help="an Azure CSV trace")
    ap.add_argument(
        "--budget", type=int, default=None, help="max_batch_tokens of llm/mixed (as replay --budget)"
    )
    a = ap.parse_args()
    summary = replay(read_azure(a.trace, a.requests), a.budget)
    for k, v in summary.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
