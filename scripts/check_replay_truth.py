#!/usr/bin/env python3
"""Checks a replay's step log against the simulated engine's truth (docs/replay.md#the-step-cost-model):
every continuing row's `context` must be its prompt plus the tokens its request has generated
(the first one with its final chunk), and every step's `ms` the replay cost of its rows at
those contexts: base_ms + per_token_ms * ran_tokens + per_kv_token_ms * K +
per_attention_pair_ms * A (to the 0.001 ms the log keeps; run without noise).

Usage: check_replay_truth.py TRACE STEP_LOG REPORT_JSON
  TRACE        the replayed trace: Mooncake JSON Lines (`input_length`) or a CSV with
               `prompt_tokens` / `ContextTokens` / `num_prefill_tokens` (rid = record index)
  REPORT_JSON  the run's --report-json, for its `settings.cost`
Prints "<stale> of <rows> continuing rows carry a stale context; <wrong> of <steps> steps
are priced wrong" and exits 1 if either is not 0.
"""

import csv
import json
import sys


def prompts(path):
    with open(path, newline="") as f:
        first = f.readline()
        f.seek(0)
        if first.lstrip().startswith("{"):
            return [json.loads(line)["input_length"] for line in f if line.strip()]
        rows = csv.DictReader(f)
        for key in ("prompt_tokens", "ContextTokens", "num_prefill_tokens"):
            if key in (rows.fieldnames or []):
                return [int(r[key]) for r in rows]
    sys.exit(f"{path}: no prompt column")


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    trace, log, report = sys.argv[1:]
    prompt = prompts(trace)
    cost = json.load(open(report))["settings"]["cost"]
    if cost.get("noise", 0) > 0:
        sys.exit("run the replay without noise: the check compares exact costs")
    base, per_token = cost["base_ms"], cost["per_token_ms"]
    per_kv, per_pair = cost["per_kv_token_ms"], cost["per_attention_pair_ms"]
    generated = {}
    rows = stale = steps = wrong = 0
    for line in open(log):
        step = json.loads(line)
        kv = pairs = 0
        for r in step["rows"]:
            if r["kind"] == "chunk":
                s, e = r["start"], r["end"]
                pairs += (e * (e + 1) - s * (s + 1)) // 2
            else:
                truth = prompt[r["rid"]] + generated[r["rid"]]
                rows += 1
                stale += r["context"] != truth
                kv += truth
        want = base + per_token * step["ran_tokens"] + per_kv * kv + per_pair * pairs
        steps += 1
        wrong += abs(want - step["ms"]) > 0.0006 + 1e-12 * want
        for r in step["rows"]:
            if r["kind"] == "continue":
                generated[r["rid"]] += 1
            elif r["final"]:
                generated[r["rid"]] = 1
    print(
        f"{stale} of {rows} continuing rows carry a stale context; "
        f"{wrong} of {steps} steps are priced wrong"
    )
    sys.exit(1 if stale or wrong else 0)


if __name__ == "__main__":
    main()
