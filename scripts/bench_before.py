#!/usr/bin/env python3
"""The cost of a step against the build before `complete_and_assemble` (`make bench-before`).

The one-trip step's targets bound the facade's cost per step with one round trip as a share of
the build *before the change*, measured side by side in one run. This script:

1. checks out that build (`--rev`, default the commit before `complete_and_assemble`) into a
   worktree under `target/bench-before/`, adds `benches/before/instructions.rs` (its two-trip
   step, written against that build's API) and the `gungraun` dev-dependency to it;
2. counts its instructions (Callgrind) and times its criterion `actors/W*` step;
3. does the same for this build (`facade::one_trip` and `actors_one_trip/W*`);
4. prints each workload's figures and the ratio now ÷ before.

Needs git history (a clone, not an archive), valgrind and gungraun-runner (`make test-deps`).
It builds a second copy of the crate (a few minutes on 2 cores); not part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

# The locked `gungraun` version, read as `make bench-check` reads it.
from bench_check import gungraun_version

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "target" / "bench-before"
# The last commit before `complete_and_assemble` (one round trip per step) was added.
DEFAULT_REV = "27f0736"
WORKLOADS = ("w1", "w2", "w3")
# Steps per facade benchmark, in both builds' instruction benchmarks.
STEPS = 100
CRITERION_TIME = re.compile(r"^(actors(?:_one_trip)?)/(W\d)\s+time:\s+\[\S+ \S+ (\S+) (\S+)")


def fail(msg: str) -> None:
    print(f"bench-before: {msg}", file=sys.stderr)
    sys.exit(1)


def run(cmd: list[str], cwd: Path) -> str:
    print(f"bench-before: {' '.join(cmd)} (in {cwd})", file=sys.stderr)
    env = dict(os.environ)
    if cwd != ROOT:
        # The old build keeps its own target directory across runs (the worktree does not).
        env["CARGO_TARGET_DIR"] = str(WORK / "target")
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        fail(f"`{' '.join(cmd)}` failed (exit {proc.returncode})")
    return proc.stdout


def prepare(rev: str) -> Path:
    """A worktree of `rev` with the two-trip instruction benchmark added."""
    tree = WORK / "tree"
    if tree.exists():
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT)
        shutil.rmtree(tree, ignore_errors=True)
    WORK.mkdir(parents=True, exist_ok=True)
    # Resolved to a commit first, so that a `--rev` such as `--orphan` is never read as an option.
    proc = subprocess.run(
        ["git", "rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}"],
        cwd=ROOT, capture_output=True, text=True,
    )
    if proc.returncode != 0:
        fail(f"--rev {rev!r} is not a commit of this repository (a clone with its history)")
    run(["git", "worktree", "add", "--detach", str(tree), proc.stdout.strip()], ROOT)
    shutil.copy(ROOT / "benches" / "before" / "instructions.rs", tree / "benches" / "instructions.rs")
    manifest = tree / "Cargo.toml"
    text = manifest.read_text(encoding="utf-8")
    if "[dev-dependencies]" not in text or '\n[[bench]]\nname = "step"' not in text:
        fail(f"{rev}'s Cargo.toml has no [dev-dependencies] or no `step` bench to add beside")
    text = text.replace(
        "[dev-dependencies]\n", f'[dev-dependencies]\ngungraun = "={gungraun_version()}"\n', 1
    )
    text = text.replace(
        '\n[[bench]]\nname = "step"',
        '\n[[bench]]\nname = "instructions"\nharness = false\n\n[[bench]]\nname = "step"',
        1,
    )
    manifest.write_text(text, encoding="utf-8")
    return tree


def instructions(tree: Path, function: str) -> dict[str, float]:
    """Instructions per step of `facade::<function>::w*`."""
    out = run(["cargo", "bench", "--bench", "instructions", "--", "--output-format=json"], tree)
    found = {}
    for line in out.splitlines():
        if not line.startswith("{"):
            continue
        s = json.loads(line)
        if s.get("function_name") != function:
            continue
        ir = s["profiles"][0]["data"]["total"]["metrics"]["Ir"]["values"]["new"]
        found[s["id"]] = ir / STEPS
    missing = [w for w in WORKLOADS if w not in found]
    if missing:
        fail(f"no instruction count of {function} for {missing} in {tree}")
    return found


def wall(tree: Path, group: str, features: list[str]) -> dict[str, float]:
    """Criterion's median time per step of `<group>/W*`, in µs."""
    out = run(["cargo", "bench", "--bench", "step", *features, "--", f"^{group}/"], tree)
    found = {}
    for line in out.splitlines():
        m = CRITERION_TIME.match(line.strip())
        if m and m.group(1) == group:
            value, unit = float(m.group(3)), m.group(4)
            scale = {"ns": 1e-3, "µs": 1.0, "us": 1.0, "ms": 1e3}.get(unit)
            if scale is None:
                fail(f"unknown time unit {unit!r} in `{line.strip()}`")
            found[m.group(2).lower()] = value * scale
    missing = [w for w in WORKLOADS if w not in found]
    if missing:
        fail(f"no criterion time of {group} for {missing} in {tree}")
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", default=DEFAULT_REV, help="the build before the change")
    ap.add_argument("--no-wall", action="store_true", help="instruction counts only")
    args = ap.parse_args()
    tree = prepare(args.rev)
    try:
        before_ir = instructions(tree, "two_trips")
        now_ir = instructions(ROOT, "one_trip")
        if not args.no_wall:
            # The old build's criterion bench needs the `config` feature it declared then.
            before_wall = wall(tree, "actors", ["--features", "config"])
            now_wall = wall(ROOT, "actors_one_trip", [])
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT)
    print(f"one round trip (this build) against two (the build at {args.rev}), per step:")
    print("| workload | instructions before | now | now ÷ before |"
          + ("" if args.no_wall else " wall before (µs) | now | now ÷ before |"))
    print("|---|---|---|---|" + ("" if args.no_wall else "---|---|---|"))
    for w in WORKLOADS:
        row = f"| {w.upper()} | {before_ir[w]:,.0f} | {now_ir[w]:,.0f} | {now_ir[w] / before_ir[w]:.3f} |"
        if not args.no_wall:
            row += f" {before_wall[w]:.2f} | {now_wall[w]:.2f} | {now_wall[w] / before_wall[w]:.3f} |"
        print(row)


if __name__ == "__main__":
    main()
