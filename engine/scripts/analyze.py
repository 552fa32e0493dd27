#!/usr/bin/env python3
"""Helpers of engine/scripts/bench.sh: the decode-only step time of a step log, the replay
config from a `fit` output, and the summary tables of
docs/engine-measuring.md#measurements-make-engine-bench."""
import json
import math
import re
import statistics
import sys
from pathlib import Path


def steps(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def quantile(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = max(1, min(len(xs), math.ceil(q * len(xs))))  # nearest rank
    return xs[k - 1]


def decode_ms(path, factor):
    """`factor` x the median measured time of steps that ran only decode rows."""
    d = [s["ms"] for s in steps(path) if s["rows"] and all(r["kind"] == "continue" for r in s["rows"])]
    if not d:
        sys.exit(f"{path}: no decode-only step")
    return factor * statistics.median(d)


def fit_coefficients(fit_txt):
    text = Path(fit_txt).read_text()
    c = {}
    for key in ("base_ms", "per_token_ms", "per_kv_token_ms", "per_attention_pair_ms", "per_row_ms"):
        m = re.search(rf"^{key}\s*=\s*([-0-9.eE+]+)", text, re.M)
        if not m and key == "per_row_ms":
            # Printed only when the fit kept a per-row cost.
            c[key] = 0.0
            continue
        if not m:
            sys.exit(f"{fit_txt}: no `{key} = ...` line in the fit output")
        c[key] = float(m.group(1))
    r2 = re.search(r"R²\s*[=:]?\s*([-0-9.]+)|R2\s*[=:]?\s*([-0-9.]+)", text)
    return c, (float(r2.group(1) or r2.group(2)) if r2 else None)


def replay_config(fit_txt):
    """The replay's config: run A's chunking floor and the `[replay.cost]` table of
    `fit --for replay` (the fitted coefficients, each step drawn from A's measured ÷ predicted
    spread), or, from a plain `fit` output, the coefficients without noise."""
    text = Path(fit_txt).read_text()
    print("[chunking]\nmin_chunk_tokens = 16\n")
    at = text.find("[replay.cost]")
    if at >= 0:
        print(text[at:], end="")
        return
    c, _ = fit_coefficients(fit_txt)
    body = ", ".join(f"{k} = {v!r}" for k, v in c.items())
    print(f"[replay]\ncost = {{ {body}, noise = 0.0 }}")


def replay_table(a, r):
    """The replay's TTFT and TBT p50/p99 beside the engine's run A, as table lines."""
    lines = ["| metric | engine | replay | replay/engine |", "|---|---|---|---|"]
    for m in ("ttft_ms", "tbt_ms"):
        for q in ("p50", "p99"):
            e, s = a[m][q], (r.get(m) or {}).get(q)
            ratio = f"{s / e:.3f}" if s is not None and e else "-"
            lines.append(f"| {m} {q} | {e:.2f} | {s if s is None else round(s, 2)} | {ratio} |")
    return lines


def replay_vs_engine(out, replay_json):
    """`replay-vs-engine OUT [REPLAY_JSON]`: run A's engine figures beside a replay's report."""
    out = Path(out)
    a = json.loads((out / "A.bench.json").read_text())
    r = json.loads(Path(replay_json or out / "R.replay.json").read_text())
    print("\n".join(replay_table(a, r)))


def summary(out, x):
    out = Path(out)
    x = float(x)
    a, b = (json.loads((out / f"{n}.bench.json").read_text()) for n in "AB")
    # C (chunking off) is optional: a run of RUNS="A B R" leaves it out.
    c_path = out / "C.bench.json"
    c = json.loads(c_path.read_text()) if c_path.exists() else None
    r = json.loads((out / "R.replay.json").read_text())
    coef, r2 = fit_coefficients(out / "A.fit.txt")
    lines = ["## Fit on the engine's step log (run A, token budget 256)", ""]
    lines.append(f"R² = {r2}; " + ", ".join(f"{k} = {v:.6g}" for k, v in coef.items()))
    sb = steps(out / "B.steps.jsonl")
    ms = [s["ms"] for s in sb]
    reasons = {}
    for s in sb:
        if s.get("time_overrun"):
            k = s["time_overrun"]["reason"]
            reasons[k] = reasons.get(k, 0) + 1
    p99 = quantile(ms, 0.99)
    lines += ["", f"## Time budget X = {x:.2f} ms (run B, online fit)", ""]
    lines.append(f"steps {len(ms)}, p50 {quantile(ms, 0.5):.2f} ms, p99 {p99:.2f} ms = {p99 / x:.3f} X "
                 f"(target: <= 1.1 X: {'holds' if p99 <= 1.1 * x else 'MISSES'}); "
                 f"completed {b['completed']}/{b['requests']}; time overruns by reason {reasons or '{}'}")
    lines += ["", "## Replay vs engine (run A, same scaled trace and rate)", ""]
    lines += replay_table(a, r)
    lines += ["", "## TBT p99 by chunking mode (same workload)", "",
              "| mode | TBT p50 ms | TBT p99 ms | TTFT p99 ms | p99 ratio to off |", "|---|---|---|---|---|"]
    off = c["tbt_ms"]["p99"] if c else None
    modes = [("token budget 256", a), (f"time budget {x:.1f} ms", b)] + ([("off", c)] if c else [])
    for name, rep in modes:
        ratio = f"{rep['tbt_ms']['p99'] / off:.3f}" if off else "(C not run)"
        lines.append(f"| {name} | {rep['tbt_ms']['p50']:.2f} | {rep['tbt_ms']['p99']:.2f} | "
                     f"{rep['ttft_ms']['p99']:.2f} | {ratio} |")
    print("\n".join(lines))


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "decode-ms":
        print(f"{decode_ms(sys.argv[2], float(sys.argv[3])):.3f}")
    elif cmd == "cost":
        c, _ = fit_coefficients(sys.argv[2])
        print(",".join(repr(v) for v in c.values()))
    elif cmd == "replay-config":
        replay_config(sys.argv[2])
    elif cmd == "replay-vs-engine":
        replay_vs_engine(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
    elif cmd == "summary":
        summary(sys.argv[2], sys.argv[3])
    else:
        sys.exit(f"unknown command {cmd}")
