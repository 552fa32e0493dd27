#!/usr/bin/env python3
"""How long each prompt of a replay waited before its first chunk, from the step log and the
trace (docs/scheduling.md#orders-measured): the wait of trace request `rid` is the `t_ms` of the
first step that ran a chunk of it (its first admission, `rid < 2^32`) minus its arrival, scaled
by the replay's `--rate-scale`.

Usage: order_waits.py STEP_LOG TRACE [--rate-scale X] [--bound-ms MS]
TRACE is an Azure CSV (TIMESTAMP,ContextTokens,GeneratedTokens) or a generic CSV with an
`arrival_ms` column. Prints the wait's p50/p99/max and, with --bound-ms, how many prompts waited
past the bound by more than one step (the bound is checked at step boundaries).
"""

import argparse
import csv
import json
import sys
from datetime import datetime


def arrivals(path: str) -> list:
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    if rows and "arrival_ms" in rows[0]:
        return [float(r["arrival_ms"]) for r in rows]
    times = [datetime.fromisoformat(r["TIMESTAMP"][:26]) for r in rows]
    first = times[0]
    return [(t - first).total_seconds() * 1000.0 for t in times]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("step_log")
    ap.add_argument("trace")
    ap.add_argument("--rate-scale", type=float, default=1.0)
    ap.add_argument("--bound-ms", type=float)
    a = ap.parse_args()
    arr = [t / a.rate_scale for t in arrivals(a.trace)]
    first = {}
    longest_step = 0.0
    with open(a.step_log, encoding="utf-8") as f:
        for line in f:
            s = json.loads(line)
            longest_step = max(longest_step, s["ms"])
            for r in s["rows"]:
                if r["kind"] == "chunk" and r["rid"] < 2**32 and r["rid"] not in first:
                    first[r["rid"]] = s["t_ms"]
    waits = sorted(first[rid] - arr[rid] for rid in first)
    if not waits:
        print("no chunk in the step log", file=sys.stderr)
        return 1
    q = lambda p: waits[min(len(waits) - 1, int(p * len(waits)))]
    print(f"prompts {len(waits)}, wait to first chunk p50 {q(0.5):.1f} ms, p99 {q(0.99):.1f} ms, max {waits[-1]:.1f} ms")
    if a.bound_ms is not None:
        past = sum(1 for w in waits if w > a.bound_ms + longest_step)
        print(f"past the bound of {a.bound_ms} ms by more than the longest step ({longest_step:.1f} ms): {past}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
