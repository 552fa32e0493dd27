"""Per-step cost of the step API from Python against the Rust facade, per workload, in one run.

The workloads are the benchmarks' W1–W3 (`benches/common/mod.rs`): node `llm` cutting `prefill`
rows inside `mixed` under the budget (align 16), persistent `decode` rows (estimate 1) and
prompts, each replaced by a new one when its final chunk runs, 200 warm-up steps first. Both
sides drive one message per step (`complete_and_assemble`, carrying the replacement
admissions, each with a copy of its prompt's tokens) on actors of their own
(`start_on_own_thread`), awaited from the calling thread: the Rust side is
`_native._bench_facade`, the loop written against the facade directly; the Python side goes
through `ChunkingManagement` as an engine would (`final_rids()`, a `NextStep` when a prompt
finishes). The Rust loop reports each step's tokens read from its batch; the Python loop the
same way, with the step's `Batch` itself (`ran=batch`: every row ran as planned), the ratio the
limit (`--check`) is on; and, in a second loop, as the list `planned()` makes (`list`: what an
engine whose rows did not all run passes, with a Python `int` per row both ways). Prints the
medians of `--repeats` interleaved runs per side and the ratios Python / Rust per workload, of
the process's CPU time per step (both threads: what a step costs the machine) and of
wall-clock time (which on a loaded machine is mostly the wait for the other thread to be
scheduled). The Rust side runs twice: with the
facade's request timeout (`rust`, a Rust handle's default: a timer task on the actors' thread
per request) and without it (`rust*`, `with_timeout(None)`: the package's handle is made so,
and times its calls on the calling thread instead), and the `ran=batch` loop is compared with both. A last pair runs the actors on the calling
thread on both sides (`same_thread`: the Rust loop inside the actors' System, the Python loop
with `caller_thread=True`): no thread is woken, so that ratio is the package's own cost per step.
Build the wheel with `--release` first.

    python python/bench.py [--steps 5000] [--repeats 5] [--workloads W1,W2,W3]
"""

from __future__ import annotations

import argparse
import array
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

# This script's directory holds the package's sources without the native module: import the
# installed wheel instead (after `maturin develop` the sources hold it too, and either works).
_here = Path(__file__).resolve().parent
if not [p for p in (_here / "mstar_chunking").glob("_native*") if p.suffix in (".so", ".pyd")]:
    sys.path = [p for p in sys.path if Path(p or ".").resolve() != _here]

from mstar_chunking import ChunkingManagement, ChunkingPolicy, NextStep, SubmoduleCaps, _native  # noqa: E402

WARM_STEPS = 200
# The aim: a step from Python costs at most this much the Rust step (CPU, `ran=batch`).
LIMIT = 1.1


class Workload(NamedTuple):
    name: str
    decode_rows: int
    prompts: int
    prompt_tokens: int
    budget: int


WORKLOADS = {
    w.name: w
    for w in [
        Workload("W1", 256, 64, 2048, 2048),
        Workload("W2", 1024, 64, 8192, 8192),
        Workload("W3", 32, 16, 512, 512),
    ]
}


def python_loop(
    w: Workload, steps: int, ran_batch: bool = False, caller_thread: bool = False
) -> tuple[float, float]:
    """Wall-clock and CPU seconds (the process's, the actors' thread included) of `steps`
    steps after the warm-up, through the Python API; `ran_batch`: each step reported with
    its `Batch` (every row ran as planned) rather than the list `planned()` makes;
    `caller_thread`: the actors run on the calling thread."""
    cm = ChunkingManagement(
        {"llm": SubmoduleCaps(["prefill", "mixed"])}, model="bench-python", caller_thread=caller_thread
    )
    try:
        cm.set_policies({("llm", "mixed"): ChunkingPolicy(w.budget, align=16)})
        cm.set_budgets(
            {}, ["prefill", "decode", "mixed"], combined_walk_of={"prefill": "mixed", "decode": "mixed"}
        )
        for rid in range(1, w.decode_rows + 1):
            cm.continue_row(rid, "llm", "decode", 1)
        prompt = array.array("I", range(w.prompt_tokens))
        next_rid = 1 << 32
        for _ in range(w.prompts):
            cm.admit(next_rid, "llm", "prefill", prompt)
            next_rid += 1
        plain = ("llm", "mixed")
        step = cm.complete_and_assemble
        batch = cm.assemble("llm", "mixed")
        t0, cpu0 = time.perf_counter(), time.process_time()
        for i in range(WARM_STEPS + steps):
            if i == WARM_STEPS:
                t0, cpu0 = time.perf_counter(), time.process_time()
            finals = batch.final_rids()
            nxt: NextStep | tuple[str, str] = plain
            if finals:
                nxt = NextStep("llm", "mixed")
                for _ in finals:
                    nxt.admit(next_rid, "prefill", prompt)
                    next_rid += 1
            batch = step(batch.step, batch if ran_batch else batch.planned(), next=nxt).next
        return time.perf_counter() - t0, time.process_time() - cpu0
    finally:
        cm.close()


def rust_loop(
    w: Workload, steps: int, facade_timeout: bool = True, same_thread: bool = False
) -> tuple[float, float]:
    return _native._bench_facade(
        steps, w.decode_rows, w.prompts, w.prompt_tokens, w.budget, WARM_STEPS, facade_timeout, same_thread
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--steps", type=int, default=5000, help="steps measured per run")
    ap.add_argument("--repeats", type=int, default=5, help="runs per side and workload")
    ap.add_argument("--workloads", default="W1,W2,W3", help="a comma-separated subset of W1,W2,W3")
    ap.add_argument("--check", action="store_true", help=f"exit 1 when a workload's ratio is above {LIMIT}")
    a = ap.parse_args()
    if a.steps < 1 or a.repeats < 1:
        ap.error("--steps and --repeats must be at least 1")
    steps: int = a.steps
    names = [n.strip() for n in a.workloads.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or not names:
        ap.error(f"--workloads: unknown {unknown or names}; known: {', '.join(WORKLOADS)}")
    print(f"steps per run: {a.steps} (after {WARM_STEPS} warm-up steps), runs per side: {a.repeats}")
    print("us/step, medians; cpu: the process's CPU time (both threads), wall: wall-clock time")
    print("ratio: python / rust; python: each step reported with its Batch (ran=batch); list: with planned();")
    print("rust*: the facade without its request timeout, and python / rust*")
    print("same thread: the actors on the calling thread on both sides (caller_thread=True), cpu")
    print(
        f"{'workload':<9} {'rust cpu':>9} {'python cpu':>11} {'ratio':>6} {'list cpu':>10} {'ratio':>6}"
        f" {'rust* cpu':>10} {'ratio':>6} {'rust wall':>10} {'python wall':>12} {'ratio':>6}"
        f" {'same: rust':>11} {'python':>7} {'ratio':>6}"
    )
    ratios = {}
    for name in names:
        w = WORKLOADS[name]
        rust, rust_nt, py, py_list, rust_st, py_st = [], [], [], [], [], []
        for _ in range(a.repeats):  # interleaved, so load on the machine hits every side alike
            rust.append(rust_loop(w, a.steps))
            py.append(python_loop(w, a.steps, ran_batch=True))
            py_list.append(python_loop(w, a.steps))
            rust_nt.append(rust_loop(w, a.steps, facade_timeout=False))
            rust_st.append(rust_loop(w, a.steps, same_thread=True))
            py_st.append(python_loop(w, a.steps, ran_batch=True, caller_thread=True))

        def us(runs: list[tuple[float, float]], i: int) -> float:
            return float(statistics.median(r[i] for r in runs)) / steps * 1e6

        r_wall, p_wall, r_cpu, p_cpu = us(rust, 0), us(py, 0), us(rust, 1), us(py, 1)
        b_cpu, n_cpu = us(py_list, 1), us(rust_nt, 1)
        rs_cpu, ps_cpu = us(rust_st, 1), us(py_st, 1)
        ratios[name] = p_cpu / r_cpu
        print(
            f"{name:<9} {r_cpu:9.2f} {p_cpu:11.2f} {p_cpu / r_cpu:6.2f} {b_cpu:10.2f} {b_cpu / r_cpu:6.2f}"
            f" {n_cpu:10.2f} {p_cpu / n_cpu:6.2f} {r_wall:10.2f} {p_wall:12.2f} {p_wall / r_wall:6.2f}"
            f" {rs_cpu:11.2f} {ps_cpu:7.2f} {ps_cpu / rs_cpu:6.2f}"
        )
    over = [n for n, r in ratios.items() if r > LIMIT]
    listed = ", ".join(f"{n} {r:.2f}" for n, r in ratios.items())
    print(f"python/rust (cpu, ran=batch): {listed}; {'OVER' if over else 'within'} the aim of {LIMIT}")
    if a.check and over:
        sys.exit(1)


if __name__ == "__main__":
    main()
