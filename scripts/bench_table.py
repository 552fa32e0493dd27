#!/usr/bin/env python3
"""Prints the table of `cargo bench --bench step`: per workload, the median of `planner/<W>`,
`planner_timed/<W>` (under a binding time budget), `actors/<W>` (two round trips a step) and
`actors_one_trip/<W>` (`complete_and_assemble`) in µs, their ratios, and allocations per step,
read from criterion's `<dir>/<group>/<W>/new/estimates.json` and the bench's
`<dir>/step-allocs.json`.

Usage: bench_table.py [CRITERION_DIR]   (default: $CRITERION_HOME, else target/criterion)
Exits 1 if a result is missing.
"""

import json
import os
import sys
from pathlib import Path

WORKLOADS = ["W1", "W2", "W3"]
# Targets for a whole step through the facade, medians in µs.
ACTORS_TARGET_US = {"W1": 15.0, "W2": 75.0, "W3": 5.0}
# Target for the time budget's cost: timed ÷ token planner. Its one-trip targets compare this build's one-trip
# step with the two-trip step of the build before it, not with this build's (which shares every
# gain): `make bench-before` measures them.
TIMED_TARGET = 1.15


def criterion_dir() -> Path:
    if len(sys.argv) > 1:
        return Path(sys.argv[1])
    if os.environ.get("CRITERION_HOME"):
        return Path(os.environ["CRITERION_HOME"])
    target = os.environ.get("CARGO_TARGET_DIR", "target")
    return Path(target) / "criterion"


def median_us(root: Path, group: str, workload: str) -> float:
    path = root / group / workload / "new" / "estimates.json"
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)["median"]["point_estimate"] / 1000.0
    except (OSError, KeyError, ValueError) as e:
        sys.exit(f"bench_table: no median for {group}/{workload} in {path}: {e}")


def main() -> None:
    root = criterion_dir()
    allocs_path = root / "step-allocs.json"
    try:
        with open(allocs_path, encoding="utf-8") as f:
            allocs = {row["workload"]: row for row in json.load(f)}
    except (OSError, KeyError, ValueError) as e:
        sys.exit(f"bench_table: no allocation counts in {allocs_path}: {e}")

    header = (
        "| workload | planner median µs | timed planner median µs | timed/planner "
        "| actors median µs (two trips) | one trip µs | one/two trips | actors/planner "
        "| allocations per step (planner / two trips / one trip) | targets met |"
    )
    print(header)
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for w in WORKLOADS:
        planner = median_us(root, "planner", w)
        timed = median_us(root, "planner_timed", w)
        actors = median_us(root, "actors", w)
        one_trip = median_us(root, "actors_one_trip", w)
        a = allocs.get(w)
        if a is None:
            sys.exit(f"bench_table: no allocation count for {w} in {allocs_path}")
        misses = []
        if actors > ACTORS_TARGET_US[w]:
            misses.append(f"actors > {ACTORS_TARGET_US[w]:g} µs")
        if actors > 2 * planner + 10:
            misses.append("actors > 2 × planner + 10 µs")
        if timed > TIMED_TARGET * planner:
            misses.append(f"timed planner > {TIMED_TARGET} × planner")
        print(
            f"| {w} | {planner:.2f} | {timed:.2f} | {timed / planner:.2f} "
            f"| {actors:.2f} | {one_trip:.2f} | {one_trip / actors:.2f} | {actors / planner:.1f} "
            f"| {a['planner']:.2f} / {a['actors']:.2f} / {a.get('actors_one_trip', float('nan')):.2f} "
            f"| {'; '.join(misses) or 'yes'} |"
        )
    print(
        "\nOne trip against two on the build before `complete_and_assemble` (W1/W2 ≤ 0.85, "
        "W3 ≤ 0.60): `make bench-before`."
    )
    counts = [allocs[w]["actors"] for w in WORKLOADS]
    print(
        f"\nactors allocations per step span {min(counts):.2f}..{max(counts):.2f} over "
        "W3 (48 rows) to W2 (1,088 rows); the rest is prompts admitted per step: "
        + ", ".join(f"{w} {allocs[w]['finished_per_step']:.3f}" for w in WORKLOADS)
    )


if __name__ == "__main__":
    main()
