#!/usr/bin/env python3
"""Instruction counts as the benchmark of record (docs/benchmarks.md).

Runs `cargo bench --bench instructions` (Callgrind through gungraun-runner) and compares every
benchmark's figures with the committed baseline `benches/baseline/instructions.json`.

Usage:
  bench_check.py check [--features F] [--results FILE]
      Fails (exit 1) when any checked figure of any benchmark rises more than 3% over the
      baseline, or when a benchmark is missing on either side. Counts depend on the machine
      (glibc and crates such as memchr pick their routines by the CPU's features, and the cycle
      estimate simulates the CPU's caches) and on the toolchain. Where both match the recorded
      baseline's, the recorded counts are compared. Anywhere else the baseline's commit (recorded
      with it) is checked out in a worktree under `target/bench-check/base/`, built and counted on
      this machine in the same run, and this build is compared with those counts: the check
      compares on every machine, and fails only when the counts rose.
  bench_check.py baseline [--results FILE]
      Runs the benchmarks and writes the baseline with the commit it was counted at (refresh it
      deliberately, in its own commit, from a tree whose code and benchmarks are committed).
  bench_check.py table [--results FILE]
      Prints the counts of the last run (or FILE) as a markdown table, per repetition.

--features F builds the benchmarks with extra cargo features (e.g. `bench-slow-planner`, the
deliberately slowed planner that the check must catch). --results FILE reads a previous run's
JSON lines instead of running the benchmarks.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / "benches" / "baseline" / "instructions.json"
LAST_RUN = ROOT / "target" / "bench-check" / "last-run.jsonl"
# A figure may rise this much over the baseline.
TOLERANCE = 0.03
# The figures checked, as gungraun names them: instructions, every data access (read + write)
# and the cycles estimated from the simulated cache hits (L1, LL, RAM).
CHECKED = ["Ir", "TotalRW", "EstimatedCycles"]
# Recorded for reading, not checked: small counts that move with memory layout.
RECORDED = ["L1hits", "LLhits", "RamHits"]
# Repetitions per benchmark run (sim/benches/instructions.rs: PLANS, STEPS), for per-call figures.
REPETITIONS = {"planner": 100, "facade": 100, "replay_group": 1}


def fail(msg: str) -> None:
    print(f"bench-check: {msg}", file=sys.stderr)
    sys.exit(1)


def command_output(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as e:
        fail(f"cannot run {' '.join(cmd)}: {e}")
        return ""


def gungraun_version() -> str:
    lock = (ROOT / "Cargo.lock").read_text(encoding="utf-8")
    m = re.search(r'name = "gungraun"\nversion = "([^"]+)"', lock)
    if not m:
        fail("no `gungraun` package in Cargo.lock")
    return m.group(1)


def cpu_model() -> str:
    """The host CPU: Callgrind simulates its caches (the cycle estimate) and glibc picks its
    string routines by the CPU's features, so counts compare only on the same model."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def build_info() -> dict:
    """What the counts depend on besides the code."""
    return {
        "rustc": command_output(["rustc", "-V"]),
        "valgrind": command_output(["valgrind", "--version"]),
        "gungraun": gungraun_version(),
        "rustflags": os.environ.get("RUSTFLAGS", ""),
        "profile": "bench (inherits release)",
        "cpu": cpu_model(),
    }


def check_runner(version: str) -> None:
    out = command_output(["gungraun-runner", "--version"])
    if version not in out:
        fail(
            f"gungraun-runner is `{out}`, the crate is {version}: "
            f"cargo install gungraun-runner --version {version} --locked"
        )


def run_benches(features: str | None, tree: Path = ROOT, target: Path | None = None) -> list[dict]:
    """The benchmarks' JSON summaries, built and run in `tree` (this clone, or the baseline
    commit's worktree with its own `target`)."""
    check_runner(gungraun_version())
    cmd = ["cargo", "bench", "--bench", "instructions"]
    if features:
        cmd += ["--features", features]
    cmd += ["--", "--output-format=json"]
    env = dict(os.environ)
    if target is not None:
        env["CARGO_TARGET_DIR"] = str(target)
    print(f"bench-check: {' '.join(cmd)} (in {tree})", file=sys.stderr)
    proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        fail(f"the benchmarks failed in {tree} (exit {proc.returncode})")
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if tree == ROOT:
        LAST_RUN.parent.mkdir(parents=True, exist_ok=True)
        LAST_RUN.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return [json.loads(l) for l in lines]


def git(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def recorded_commit() -> str:
    """The commit the baseline is counted at: HEAD, with its code and benchmarks committed (a
    baseline of uncommitted code could not be rebuilt on another machine)."""
    dirty = git(["status", "--porcelain", "--", "src", "benches", "Cargo.toml", "Cargo.lock"])
    if dirty.returncode != 0:
        fail(f"git status failed: {dirty.stderr.strip()}")
    changed = [l for l in dirty.stdout.splitlines() if not l.endswith("benches/baseline/instructions.json")]
    if changed:
        fail("commit the code and benchmarks before recording a baseline: " + "; ".join(changed[:5]))
    head = git(["rev-parse", "--verify", "HEAD^{commit}"])
    if head.returncode != 0:
        fail("no HEAD commit to record the baseline at")
    return head.stdout.strip()


def base_counts(commit: str) -> dict[str, dict[str, int]]:
    """The baseline commit's counts on this machine: a worktree of it, built and counted here."""
    found = git(["rev-parse", "--verify", "--quiet", "--end-of-options", f"{commit}^{{commit}}"])
    if found.returncode != 0:
        fail(
            f"the baseline's commit {commit} is not in this clone (a shallow clone?): "
            "fetch its history (`git fetch --unshallow`) so it can be built and counted here"
        )
    work = ROOT / "target" / "bench-check" / "base"
    tree = work / "tree"
    if tree.exists():
        git(["worktree", "remove", "--force", str(tree)])
        shutil.rmtree(tree, ignore_errors=True)
    git(["worktree", "prune"])
    work.mkdir(parents=True, exist_ok=True)
    added = git(["worktree", "add", "--detach", str(tree), found.stdout.strip()])
    if added.returncode != 0:
        fail(f"cannot check out {commit}: {added.stderr.strip()}")
    try:
        # Its own target directory, kept across runs: the base is built once per machine.
        return collect(run_benches(None, tree, work / "target"))
    finally:
        git(["worktree", "remove", "--force", str(tree)])


def read_results(path: Path) -> list[dict]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        fail(f"cannot read {path}: {e}")
    return [json.loads(l) for l in text.splitlines() if l.startswith("{")]


def figures(summary: dict) -> dict[str, int]:
    """The Callgrind metrics of one benchmark's summary (gungraun 0.20: summary version 7),
    `profiles[0].data.total.metrics.<name>.values.new`."""
    try:
        metrics = summary["profiles"][0]["data"]["total"]["metrics"]
    except (KeyError, IndexError, TypeError):
        return {}
    found = {}
    for name, value in metrics.items():
        new = value.get("values", {}).get("new") if isinstance(value, dict) else None
        if isinstance(new, (int, float)):
            found[name] = int(new)
    return found


def bench_id(summary: dict) -> str:
    """`group::function::id`, e.g. `planner::token::w1`."""
    parts = [summary.get("group"), summary.get("function_name"), summary.get("id")]
    return "::".join(p for p in parts if p)


def collect(summaries: list[dict]) -> dict[str, dict[str, int]]:
    out = {}
    for s in summaries:
        f = figures(s)
        if "Ir" not in f:
            fail(f"no instruction count in the summary of {bench_id(s)}")
        out[bench_id(s)] = {k: f[k] for k in CHECKED + RECORDED if k in f}
    if not out:
        fail("the benchmarks reported nothing")
    return dict(sorted(out.items()))


def check(results: dict[str, dict[str, int]], features: str | None) -> None:
    try:
        base = json.loads(BASELINE.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        fail(f"no baseline in {BASELINE} ({e}): make bench-baseline")
    info = build_info()
    differs = [
        f"{key} `{value}` (here `{info.get(key)}`)"
        for key, value in base["build"].items()
        if info.get(key) != value
    ]
    if differs:
        commit = base.get("commit")
        if not commit:
            fail("the baseline names no commit to count here: record it with `make bench-baseline`")
        # Counts of another machine or toolchain say nothing about this build: the baseline's
        # commit is counted here instead, in the same run.
        print(
            f"bench-check: the baseline was recorded with {', '.join(differs)}: "
            f"comparing with its commit {commit[:12]}, built and counted on this machine",
            file=sys.stderr,
        )
        base_benches = base_counts(commit)
        against = f"commit {commit[:12]} counted here"
    else:
        base_benches = base["benchmarks"]
        against = str(BASELINE.relative_to(ROOT))
    problems = []
    for name in sorted(set(base_benches) | set(results)):
        if name not in results:
            problems.append(f"{name}: in the baseline but not run")
            continue
        if name not in base_benches:
            problems.append(f"{name}: not in the baseline (make bench-baseline)")
            continue
        for fig in CHECKED:
            was, now = base_benches[name].get(fig), results[name].get(fig)
            if was is None or now is None:
                problems.append(f"{name}: {fig} missing")
                continue
            change = (now - was) / was if was else 0.0
            mark = "FAIL" if change > TOLERANCE else "ok"
            print(f"{mark:4} {name:32} {fig:16} {was:>14,} -> {now:>14,} ({change:+.2%})")
            if change > TOLERANCE:
                problems.append(
                    f"{name}: {fig} rose {change:+.2%} ({was:,} -> {now:,}), over {TOLERANCE:.0%}"
                )
    suffix = f" (features: {features})" if features else ""
    if problems:
        print(f"\nbench-check: {len(problems)} problem(s){suffix}:", file=sys.stderr)
        for p in problems:
            print(f"  {p}", file=sys.stderr)
        sys.exit(1)
    print(f"\nbench-check: every figure within {TOLERANCE:.0%} of {against}{suffix}")


def write_baseline(results: dict[str, dict[str, int]]) -> None:
    BASELINE.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "note": "Callgrind counts of sim/benches/instructions.rs; refresh with `make bench-baseline`. "
        f"`make bench-check` fails when any of {', '.join(CHECKED)} rises more than "
        f"{TOLERANCE:.0%}; on another machine or toolchain it counts `commit` there instead.",
        "commit": recorded_commit(),
        "build": build_info(),
        "benchmarks": results,
    }
    BASELINE.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    print(f"bench-check: wrote {BASELINE.relative_to(ROOT)} ({len(results)} benchmarks)")


def table(results: dict[str, dict[str, int]]) -> None:
    print("| benchmark | instructions per repetition | estimated cycles per repetition |")
    print("|---|---:|---:|")
    for name, f in results.items():
        reps = REPETITIONS.get(name.split("::")[0], 1)
        print(f"| {name} | {f['Ir'] / reps:,.0f} | {f.get('EstimatedCycles', 0) / reps:,.0f} |")
    ratios = []
    for w in ("w1", "w2", "w3"):
        t, p = results.get(f"planner::timed::{w}"), results.get(f"planner::token::{w}")
        one, two = results.get(f"facade::one_trip::{w}"), results.get(f"facade::two_trips::{w}")
        if t and p:
            ratios.append(f"{w} timed/token {t['Ir'] / p['Ir']:.3f}")
        if one and two:
            ratios.append(f"{w} one_trip/two_trips {one['Ir'] / two['Ir']:.3f}")
    if ratios:
        print("\ninstruction ratios: " + ", ".join(ratios))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("mode", choices=["check", "baseline", "table"])
    ap.add_argument("--features", default=os.environ.get("BENCH_FEATURES") or None)
    ap.add_argument("--results", type=Path)
    args = ap.parse_args()
    if args.mode == "baseline" and args.features:
        fail("a baseline is recorded without extra features")
    if args.results:
        summaries = read_results(args.results)
    elif args.mode == "table" and LAST_RUN.exists():
        summaries = read_results(LAST_RUN)
    else:
        summaries = run_benches(args.features)
    results = collect(summaries)
    if args.mode == "check":
        check(results, args.features)
    elif args.mode == "baseline":
        write_baseline(results)
    else:
        table(results)


if __name__ == "__main__":
    main()
