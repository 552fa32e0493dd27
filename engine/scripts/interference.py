#!/usr/bin/env python3
"""The tables of engine/scripts/interference.sh: the engine's steps before, during and after a
CPU hog shared its core, against the time budget X."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import analyze  # noqa: E402

SKIPS = (0, 16, 32, 64, 128, 256)


def phases(out):
    """(name, start, end) in the step log's ms. The step log counts from the engine's start; the
    first step starts when the first request arrives, which pins the wall clock to it."""
    t = dict(line.split() for line in (out / "times.txt").read_text().splitlines())
    steps = analyze.steps(out / "steps.jsonl")
    first_arrival = float(open(out / "scaled.csv").readlines()[1].split(",")[0])
    zero = float(t["bench"]) * 1000 + first_arrival - steps[0]["t_ms"]
    on = float(t["hog_on"]) * 1000 - zero
    off = float(t["hog_off"]) * 1000 - zero
    return steps, [("before", -1e18, on), ("during", on, off), ("after", off, 1e18)]


def describe(out, x):
    out, x = Path(out), float(x)
    steps, ph = phases(out)
    lines = [f"Time budget X = {x} ms. Step p99 ÷ X per phase after skipping its first N steps "
             f"(target <= 1.2), then the phase's overruns by reason and its margin.", "",
             "| phase | steps | p50 ms | " + " | ".join(f"p99/X, N={n}" for n in SKIPS)
             + " | least N with p99 <= 1.2 X | time overruns by reason | margin p10 / p50 / p90 |",
             "|---|---|---|" + "---|" * len(SKIPS) + "---|---|---|"]
    for name, a, b in ph:
        ss = [s for s in steps if a <= s["t_ms"] < b]
        ms = [s["ms"] for s in ss]
        if not ms:
            lines.append(f"| {name} | 0 |")
            continue
        cells, least = [], None
        for n in SKIPS:
            rest = ms[n:]
            if len(rest) < 20:
                cells.append("-")
                continue
            r = analyze.quantile(rest, 0.99) / x
            cells.append(f"{r:.3f}")
            if least is None and r <= 1.2:
                least = n
        reasons = {}
        for s in ss:
            if s.get("time_overrun"):
                k = s["time_overrun"]["reason"]
                reasons[k] = reasons.get(k, 0) + 1
        m = [s["time_margin"] for s in ss if s.get("time_margin") is not None]
        marg = " / ".join(f"{analyze.quantile(m, q):.2f}" for q in (0.1, 0.5, 0.9)) if m else "-"
        lines.append(f"| {name} | {len(ms)} | {analyze.quantile(ms, 0.5):.1f} | " + " | ".join(cells)
                     + f" | {least if least is not None else 'none'} | {reasons or '{}'} | {marg} |")
    # The margin and the measured ÷ predicted ratio step by step across each change, in windows.
    lines += ["", "Across each change, windows of 32 steps: step p99 ÷ X, the time overruns, "
              "the median margin, the median measured ÷ predicted.", "",
              "| change | window (steps after) | p99/X | overruns | margin p50 | measured ÷ predicted p50 |",
              "|---|---|---|---|---|---|"]
    for name, at in (("hog on", ph[1][1]), ("hog off", ph[2][1])):
        i0 = next((i for i, s in enumerate(steps) if s["t_ms"] >= at), len(steps))
        for w in range(-1, 8):
            ss = steps[max(0, i0 + 32 * w): max(0, i0 + 32 * (w + 1))]
            if not ss:
                continue
            ms = [s["ms"] for s in ss]
            over = sum(1 for s in ss if s.get("time_overrun"))
            m = [s["time_margin"] for s in ss if s.get("time_margin") is not None]
            ratio = [s["ms"] / s["predicted_ms"] for s in ss if s.get("predicted_ms")]
            r = f"{analyze.quantile(ratio, 0.5):.2f}" if ratio else "-"
            lines.append(f"| {name} | {32 * w} to {32 * (w + 1)} | {analyze.quantile(ms, 0.99) / x:.2f} | {over} | "
                         f"{analyze.quantile(m, 0.5) if m else '-':.2f} | {r} |")
    # The whole run in 10-second buckets of the step log's clock.
    on, off = ph[1][1], ph[2][1]
    lines += ["", f"The run in 10 s buckets (the hog from {on / 1000:.1f} s to {off / 1000:.1f} s of the step log's clock):", "",
              "| from s | steps | step p99/X | time overruns | margin p50 | measured ÷ predicted p50 |",
              "|---|---|---|---|---|---|"]
    buckets = {}
    for s in steps:
        buckets.setdefault(int(s["t_ms"] // 10000), []).append(s)
    for k in sorted(buckets):
        ss = buckets[k]
        m = [s["time_margin"] for s in ss if s.get("time_margin") is not None]
        ratio = [s["ms"] / s["predicted_ms"] for s in ss if s.get("predicted_ms")]
        hog = " (hog)" if on <= k * 10000 < off or on <= k * 10000 + 9999 < off else ""
        lines.append(f"| {k * 10}{hog} | {len(ss)} | {analyze.quantile([s['ms'] for s in ss], 0.99) / x:.2f} | "
                     f"{sum(1 for s in ss if s.get('time_overrun'))} | "
                     f"{analyze.quantile(m, 0.5) if m else float('nan'):.2f} | "
                     f"{analyze.quantile(ratio, 0.5) if ratio else float('nan'):.2f} |")
    print("\n".join(lines))


if __name__ == "__main__":
    describe(sys.argv[1], sys.argv[2])
