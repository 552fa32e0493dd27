#!/usr/bin/env python3
"""Replay speed of a disaggregated fleet against a colocated one.

results/pd-azure-2026-12-05.md#replay-speed-of-a-split-fleet shows the figures.

Runs `replay` on the same trace and config for a colocated fleet of 4 and two splits of it (1
prefill + 3 decode, 2 + 2), alternated round by round so that every layout sees the same load on
the machine, and prints each one's steps, its wall time per step (best and median over the
rounds, from `wall_ms / steps` of its `--report-json`) and the ratio to the colocated fleet's.

Usage: scripts/pd_speed.py BINARY [ROUNDS] [-- EXTRA REPLAY FLAGS]
  BINARY  an mstar-chunking binary (a release build: `cargo build --release`)
  ROUNDS  rounds of the three replays (default 5)
Run from the repository's root (it reads config/examples/pd-azure.toml).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

LAYOUTS = {
    "colocated 4": ["--workers", "4"],
    "1 prefill + 3 decode": ["--prefill-workers", "1", "--decode-workers", "3"],
    "2 prefill + 2 decode": ["--prefill-workers", "2", "--decode-workers", "2"],
}


def main() -> int:
    args = sys.argv[1:]
    extra: list[str] = []
    if "--" in args:
        extra = args[args.index("--") + 1 :]
        args = args[: args.index("--")]
    if not args:
        print(__doc__, file=sys.stderr)
        return 2
    binary = args[0]
    rounds = int(args[1]) if len(args) > 1 else 5
    common = ["replay", "--no-progress", "--config", "config/examples/pd-azure.toml", *extra]
    per_step: dict[str, list[float]] = {k: [] for k in LAYOUTS}
    steps: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as d:
        report = Path(d) / "report.json"
        for _ in range(rounds):
            for name, flags in LAYOUTS.items():
                subprocess.run(
                    [binary, *common, *flags, "--report-json", str(report)],
                    check=True,
                    capture_output=True,
                )
                r = json.loads(report.read_text())
                steps[name] = r["steps"]
                per_step[name].append(r["wall_ms"] * 1000.0 / r["steps"])
    base = per_step["colocated 4"]
    base_best, base_median = min(base), statistics.median(base)
    head = ("fleet of 4", "steps", "us/step best", "median", "ratio best", "median")
    print("{:22} {:>8} {:>13} {:>8} {:>11} {:>8}".format(*head))
    for name, v in per_step.items():
        best, median = min(v), statistics.median(v)
        print(
            f"{name:22} {steps[name]:>8} {best:>13.3f} {median:>8.3f} "
            f"{best / base_best:>11.3f} {median / base_median:>8.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
