#!/usr/bin/env python3
"""Helpers of engine/scripts/capacity.sh: the objective scaled to the calibration run, each
probe's verdict, the next rate of a capacity search, the replay's capacities, the summary."""
import csv
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import analyze  # noqa: E402  (the step-log and fit readers of bench.sh)


def prompts_and_span(trace):
    with open(trace) as f:
        rows = list(csv.DictReader(f))
    return [int(r["prompt_tokens"]) for r in rows], float(rows[-1]["arrival_ms"]) / 1000.0


def prefill_alone_ms(c, p):
    """The fitted price of a prompt of `p` tokens prefilled in one step with nothing beside it."""
    return (c["base_ms"] + c["per_row_ms"] + c["per_token_ms"] * p
            + c["per_attention_pair_ms"] * p * (p + 1) / 2)


def objective(cal, tbt_factor, ttft_factor, time_share):
    """Shell assignments: the calibration's decode-only median, the objective scaled to it, the
    time budget, the fitted cost, and the trace's arrival span at the calibration rate."""
    cal = Path(cal)
    decode = analyze.decode_ms(cal / "steps.jsonl", 1.0)
    c, r2 = analyze.fit_coefficients(cal / "fit.txt")
    prompts, span = prompts_and_span(cal / "scaled.csv")
    p90 = analyze.quantile(prompts, 0.9)
    tbt = round(float(tbt_factor) * decode)
    ttft = math.ceil(float(ttft_factor) * prefill_alone_ms(c, p90) / 100.0) * 100
    x = round(float(time_share) * tbt, 1)
    cost = ",".join(repr(v) for v in c.values())
    print(f"DECODE_MS={decode:.2f} TBT_MS={tbt} TTFT_MS={ttft} X_MS={x} P90_PROMPT={p90} "
          f"SPAN_S={span:.3f} COST={cost} FIT_R2={r2}")


def probe(bench_json, ttft_ms, tbt_ms):
    """`meets|misses TTFT_P90 TBT_P99 COMPLETED/REQUESTS` of one probe's bench report; a probe
    without a report (it ran past its time bound) misses."""
    p = Path(bench_json)
    if not p.exists():
        print("misses - - timeout")
        return
    b = json.loads(p.read_text())
    ttft = (b.get("ttft_ms") or {}).get("p90")
    tbt = (b.get("tbt_ms") or {}).get("p99")
    ok = (b["completed"] == b["requests"] and b["failed"] == 0 and ttft is not None
          and ttft <= float(ttft_ms) and (tbt is None or tbt <= float(tbt_ms)))
    print(f"{'meets' if ok else 'misses'} {ttft} {tbt} {b['completed']}/{b['requests']}")


def probes_of(tsv, setting):
    """(rate, met) of a setting's probes so far, in the order run."""
    if not Path(tsv).exists():
        return []
    with open(tsv) as f:
        return [(float(r["rate"]), r["outcome"] == "meets")
                for r in csv.DictReader(f, delimiter="\t") if r["setting"] == setting]


def bracket(probes):
    """The highest rate that met below the lowest that missed, and that miss (either may be
    None). A rate that met above a miss is not trusted, as the sweep's search does."""
    hi = min((r for r, ok in probes if not ok), default=None)
    lo = max((r for r, ok in probes if ok and (hi is None or r < hi)), default=None)
    return lo, hi


def next_rate(tsv, setting, start, step, tol, max_probes):
    """The next rate to probe, or nothing when the search is done: from `start` (the replay's
    capacity), up or down by `step` until one rate meets and one misses, then geometric
    bisection until the miss is within `tol` of the meet, at most `max_probes` probes."""
    probes = probes_of(tsv, setting)
    step, tol = float(step), float(tol)
    if len(probes) >= int(max_probes):
        return
    lo, hi = bracket(probes)
    if lo is None and hi is None:
        r = float(start)
    elif hi is None:
        r = lo * step
    elif lo is None:
        r = hi / step
        if r < 0.001:
            return
    elif hi <= lo * (1 + tol):
        return
    else:
        r = math.sqrt(lo * hi)
    r = round(r, 3)
    if any(abs(r - p) < 5e-4 for p, _ in probes):
        return
    print(f"{r:.3f}")


def capacity(tsv, setting):
    """The highest rate of a setting that met below its lowest miss, or nothing."""
    lo, _ = bracket(probes_of(tsv, setting))
    if lo is not None:
        print(f"{lo:.3f}")


def replay_capacities(sweep_dir, cal_rate, label=None):
    """`LABEL CAPACITY` per setting of a sweep, the capacity in the engine's rate scale (the
    sweep's rate scale times the calibration's, whose scaled trace it replayed); `label` names
    a sweep of one setting."""
    s = json.loads((Path(sweep_dir) / "sweep.json").read_text())
    for c in s["capacity"]:
        name = label or str(c.get("label") or c.get("budget")).replace(" ", "")
        rate = c.get("rate_scale")
        cap = 0.0 if rate is None else rate * float(cal_rate)
        print(f"{name} {cap:.4f}")


def decode_steps(steps_in, steps_out):
    """The steps of a step log that run at least one continuing (decode) row, the steps whose
    times are the gaps between a request's tokens, written to `steps_out`; prints how many of
    how many."""
    kept = total = 0
    with open(steps_in) as f, open(steps_out, "w") as out:
        for line in f:
            if not line.strip():
                continue
            total += 1
            if any(r.get("kind") == "continue" for r in json.loads(line)["rows"]):
                out.write(line)
                kept += 1
    print(f"{kept} of {total} steps run a decode row")


def median_capacities(seeds_tsv):
    """`LABEL CAPACITY` per setting: the median over the noise seeds of `seeds_tsv` (lines
    `SEED LABEL CAPACITY`), in the order the settings first appear."""
    caps = {}
    for line in Path(seeds_tsv).read_text().splitlines():
        _, name, cap = line.split()
        caps.setdefault(name, []).append(float(cap))
    for name, v in caps.items():
        v.sort()
        n = len(v)
        med = v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2
        print(f"{name} {med:.4f}")


def best_token_budgets(capacities, n):
    """The `n` token budgets with the most replayed capacity (the smallest of equals), as `a,b`."""
    rows = []
    for line in Path(capacities).read_text().splitlines():
        name, cap = line.split()
        if name.isdigit():
            rows.append((-float(cap), int(name)))
    print(",".join(str(b) for _, b in sorted(rows)[: int(n)]))


def time_steps(d, x):
    """A time-budget probe's step p99 ÷ X and its time overruns of all its steps."""
    p = d / "steps.jsonl"
    if not d.name.startswith("r") or not p.exists() or not d.parent.name.startswith("time"):
        return "-"
    st = analyze.steps(p)
    over = sum(1 for s in st if s.get("time_overrun"))
    return f"{analyze.quantile([s['ms'] for s in st], 0.99) / x:.3f}, {over} of {len(st)}"


def summary(out, settings):
    """The markdown summary: the objective, then per setting the engine's capacity (the last
    rate that met and the first that missed), the replay's, and the ratio."""
    out = Path(out)
    env = dict(kv.split("=", 1) for kv in (out / "objective.env").read_text().split())
    replay = dict(line.split() for line in (out / "replay-capacity.txt").read_text().splitlines())
    with open(out / "probes.tsv") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    lines = [f"Objective: TBT p99 <= {env['TBT_MS']} ms and TTFT p90 <= {env['TTFT_MS']} ms "
             f"(calibration: decode-only median {env['DECODE_MS']} ms, fit R² {env['FIT_R2']}, "
             f"p90 prompt {env['P90_PROMPT']} tokens); time budget X = {env['X_MS']} ms.", "",
             "| setting | engine capacity (met / missed) | probes | repeat at capacity | load avg (1 min) | replay capacity | replay ÷ engine |",
             "|---|---|---|---|---|---|---|"]
    caps = {}
    for s in settings.split(","):
        probes = [(float(r["rate"]), r["outcome"] == "meets") for r in rows if r["setting"] == s]
        lo, hi = bracket(probes)
        loads = [float(r[k]) for r in rows if r["setting"].startswith(s) for k in ("load_start", "load_end")]
        again = [r for r in rows if r["setting"] == f"{s}-repeat"]
        repeat = ", ".join(f"{r['outcome']} (TTFT p90 {r['ttft_p90_ms']}, TBT p99 {r['tbt_p99_ms']})" for r in again) or "-"
        label = s if s != "time" else f"{env['X_MS']} ms"
        rep = float(replay.get(s, "nan"))
        caps[s] = (lo, rep)
        ratio = f"{rep / lo:.2f}" if lo else "-"
        load = f"{min(loads):.1f}–{max(loads):.1f}" if loads else "-"
        lines.append(f"| {label} | {lo if lo is not None else 0} / {hi if hi is not None else '-'} "
                     f"| {len(probes)} | {repeat} | {load} | {rep:.3f} | {ratio} |")
    time = [s for s in caps if s.startswith("time")]
    tokens = [s for s in caps if not s.startswith("time")]
    if time and tokens:
        lines.append("")
        for i, who in ((0, "engine"), (1, "replay")):
            best = max(tokens, key=lambda s: caps[s][i] or 0.0)
            t = caps[time[0]][i] or 0.0
            b = caps[best][i] or 0.0
            lines.append(f"- {who}: time budget {t:.3f} against the best token budget ({best}) "
                         f"{b:.3f}: time ÷ tokens {t / b:.2f}" if b else f"- {who}: no token budget met it")
    lines += ["", "Every probe, in the order run (load average: 1 minute, at its start and end):", "",
              "| setting | rate | outcome | TTFT p90 ms | TBT p99 ms | completed | step p99 ÷ X, time overruns | load | started (UTC) | s |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['rate']} | {r['outcome']} | {r['ttft_p90_ms']} | {r['tbt_p99_ms']} "
                     f"| {r['completed']} | {time_steps(out / r['setting'] / ('r' + r['rate']), float(env['X_MS']))} "
                     f"| {r['load_start']} → {r['load_end']} | {r['started_utc']} | {r['secs']} |")
    print("\n".join(lines))


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    {"objective": objective, "probe": probe, "next": next_rate, "replay": replay_capacities,
     "best-tokens": best_token_budgets,
     "decode-steps": decode_steps, "median": median_capacities, "capacity": capacity, "summary": summary}[cmd](*args)
