#!/usr/bin/env python3
"""A step of this crate against a step of vLLM 0.11.2's V1 scheduler, measured in one run
(`make bench-vs-vllm`; not part of `make test`).

1. Installs vLLM 0.11.2 from PyPI into a venv outside the clone (default
   `${XDG_CACHE_HOME:-~/.cache}/mstar-chunking/vllm-0.11.2-venv`, or `MSTAR_VLLM_0112_VENV`),
   reused when complete. PyPI's `vllm==0.11.2` pulls its torch with the CUDA libraries (a few
   GB); nothing here touches a GPU. One install at a time: a lock file beside the venv.
2. Builds the criterion benchmark `benches/step.rs`.
3. Runs, in turn for `--rounds` rounds (the order flips every round, so neither side always
   runs first): vLLM's `Scheduler.schedule()` + `update_from_output()` per step with fabricated
   model outputs (`scripts/vllm_v1_step.py`, `--steps` steps per workload), and criterion's
   `actors_one_trip/W1..W3` (the one-trip step through the facade and the actors,
   `complete_and_assemble_with`).
4. Prints µs per step of both, the load average around each, and vLLM ÷ this crate per round and
   for the medians over the rounds; writes them to `<target dir>/vs-vllm.json`.

Both sides are compared by their mean time per step: criterion's estimate is one (its samples
are runs of many steps, timed whole), so vLLM's side is the mean of its timed steps too. On a
machine shared with other work both then pay for the time taken from them alike; a median of
vLLM's steps would leave out the steps that were preempted while every criterion sample
includes them. vLLM's median is printed beside it.

Both sides run the same workloads (benches/common/mod.rs): W1 256 decode rows + 64 prompts of
2,048 tokens with a budget of 2,048; W2 1,024 + 64 × 8,192, budget 8,192; W3 32 + 16 × 512,
budget 512; prompts kept queued (a finished one is forgotten and replaced).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VLLM_VERSION = "0.11.2"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mstar-chunking"
VENV = Path(os.environ.get("MSTAR_VLLM_0112_VENV") or CACHE / f"vllm-{VLLM_VERSION}-venv")
WORKLOADS = ("W1", "W2", "W3")
GROUP = "actors_one_trip"
CRITERION_TIME = re.compile(r"^(\w+)/(W\d)\s+time:\s+\[\S+ \S+ (\S+) (\S+)")
UNITS = {"ns": 1e-3, "µs": 1.0, "us": 1.0, "ms": 1e3, "s": 1e6}


def fail(msg: str) -> None:
    print(f"vs-vllm: {msg}", file=sys.stderr)
    sys.exit(1)


def run(cmd: list[str], **kw) -> str:
    print(f"vs-vllm: {' '.join(str(c) for c in cmd)}", file=sys.stderr)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, **kw)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        fail(f"`{' '.join(str(c) for c in cmd)}` failed (exit {proc.returncode})")
    return proc.stdout


def venv_python() -> Path:
    """The venv's interpreter, installing vLLM 0.11.2 into it first unless it is there."""
    py = VENV / "bin" / "python"
    stamp = VENV / f".mstar-vllm-{VLLM_VERSION}"
    check = f"import vllm, sys; sys.exit(vllm.__version__ != {VLLM_VERSION!r})"
    VENV.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{VENV}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists() and subprocess.run([py, "-c", check], capture_output=True).returncode == 0:
            return py
        base = os.environ.get("MSTAR_VLLM_PYTHON", "python3")
        if subprocess.run([base, "-c", "import sys; sys.exit(sys.version_info < (3, 10))"]).returncode:
            fail(f"{base} is older than 3.10, which vLLM {VLLM_VERSION} needs (set MSTAR_VLLM_PYTHON)")
        print(f"vs-vllm: installing vllm=={VLLM_VERSION} into {VENV} (a few GB)", file=sys.stderr)
        # An interrupted install leaves the venv without its stamp: pip resumes over it.
        if not py.exists():
            run([base, "-m", "venv", str(VENV)])
        pip = [str(py), "-m", "pip", "--disable-pip-version-check"]
        run([*pip, "install", "-q", "--upgrade", "pip"])
        run([*pip, "install", "--progress-bar", "off", f"vllm=={VLLM_VERSION}"])
        if subprocess.run([py, "-c", check]).returncode != 0:
            fail(f"{VENV} has no vLLM {VLLM_VERSION} after the install")
        stamp.touch()
    return py


def vllm_step(py: Path, steps: int) -> dict[str, tuple[float, float]]:
    """vLLM's µs per step on each workload: the mean, and the median."""
    out = run([str(py), str(ROOT / "scripts" / "vllm_v1_step.py"), "--steps", str(steps), *WORKLOADS])
    found = {}
    for line in out.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            found[r["workload"]] = (r["mean_us"], r["us_per_step"])
    missing = [w for w in WORKLOADS if w not in found]
    if missing:
        fail(f"vllm_v1_step.py printed no time for {missing}")
    return found


def ours(measurement_s: int) -> dict[str, float]:
    """Criterion's µs per one-trip step on each workload (its estimate of the mean)."""
    out = run([
        "cargo", "bench", "--bench", "step", "--", f"^{GROUP}/",
        "--warm-up-time", "2", "--measurement-time", str(measurement_s),
    ])
    found = {}
    for line in out.splitlines():
        m = CRITERION_TIME.match(line.strip())
        if m and m.group(1) == GROUP:
            scale = UNITS.get(m.group(4))
            if scale is None:
                fail(f"unknown time unit {m.group(4)!r} in `{line.strip()}`")
            found[m.group(2)] = float(m.group(3)) * scale
    missing = [w for w in WORKLOADS if w not in found]
    if missing:
        fail(f"criterion printed no {GROUP} time for {missing}")
    return found


def target_dir() -> Path:
    return Path(os.environ.get("CARGO_TARGET_DIR") or ROOT / "target")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="measurements of each side, in turn")
    ap.add_argument("--steps", type=int, default=200, help="vLLM steps timed per workload and round")
    ap.add_argument("--measurement-time", type=int, default=4, help="criterion's seconds per workload")
    args = ap.parse_args()
    if args.rounds < 1 or args.steps < 1 or args.measurement_time < 1:
        fail("--rounds, --steps and --measurement-time must be at least 1")
    py = venv_python()
    run(["cargo", "bench", "--bench", "step", "--no-run"])
    rounds = []
    for i in range(args.rounds):
        load = [os.getloadavg()[0]]
        if i % 2 == 0:
            v = vllm_step(py, args.steps)
            load.append(os.getloadavg()[0])
            o = ours(args.measurement_time)
        else:
            o = ours(args.measurement_time)
            load.append(os.getloadavg()[0])
            v = vllm_step(py, args.steps)
        load.append(os.getloadavg()[0])
        rounds.append({
            "vllm_us": {w: v[w][0] for w in WORKLOADS},
            "vllm_median_us": {w: v[w][1] for w in WORKLOADS},
            "ours_us": o,
            "load_average": load,
        })
        print(f"round {i + 1}: load average {', '.join(f'{x:.2f}' for x in load)}; "
              + "; ".join(f"{w} vLLM {v[w][0]:.1f} µs (median {v[w][1]:.1f}), ours {o[w]:.2f} µs, "
                          f"×{v[w][0] / o[w]:.0f}" for w in WORKLOADS),
              flush=True)
    med = {w: (statistics.median(r["vllm_us"][w] for r in rounds),
               statistics.median(r["ours_us"][w] for r in rounds)) for w in WORKLOADS}
    vllm_median = {w: statistics.median(r["vllm_median_us"][w] for r in rounds) for w in WORKLOADS}
    print(f"\nvLLM {VLLM_VERSION} V1 scheduler (schedule + update_from_output) against the one-trip "
          f"step through the facade, mean µs per step, medians of {args.rounds} rounds:")
    print("| workload | vLLM 0.11.2 (its median) | one-trip step | vLLM ÷ one-trip step | per round |")
    print("|---|---:|---:|---:|---|")
    for w in WORKLOADS:
        v, o = med[w]
        per = ", ".join(f"{r['vllm_us'][w] / r['ours_us'][w]:.0f}" for r in rounds)
        print(f"| {w} | {v:,.1f} ({vllm_median[w]:,.1f}) | {o:.2f} | **{v / o:,.0f}×** | {per} |")
    report = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "vllm": VLLM_VERSION,
        "rounds": rounds,
        "median": {w: {"vllm_us": v, "vllm_median_us": vllm_median[w], "ours_us": o, "ratio": v / o}
                   for w, (v, o) in med.items()},
    }
    out = target_dir() / "vs-vllm.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1), encoding="utf-8")
    print(f"\n(written to {out})")


if __name__ == "__main__":
    main()
