"""Per-step cost of the step API from Python against the Rust facade, in the same run.

Both sides run the same loop on their own actors (`start_on_own_thread`): `decode_rows`
continuing rows plus one prompt of `prompt_tokens` cut into `budget`-token chunks, re-admitted
as it finishes; each step is one `assemble` and one `complete` (plus a `forget_request` and an
`admit` when a prompt finishes). The Rust side is `_native._bench_facade`, the loop written
against the facade directly, awaited on a current-thread runtime; the Python side goes through
`ChunkingManagement`. Prints the median of `--repeats` runs per side and the ratio.

    python python/bench.py [--steps 20000] [--decode-rows 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import array
import statistics
import sys
import time
from pathlib import Path

# This script's directory holds the package's sources without the native module: import the
# installed wheel instead (after `maturin develop` the sources hold it too, and either works).
_here = Path(__file__).resolve().parent
if not list((_here / "mstar_chunking").glob("_native*")):
    sys.path = [p for p in sys.path if Path(p or ".").resolve() != _here]

from mstar_chunking import ChunkingManagement, ChunkingPolicy, SubmoduleCaps, _native  # noqa: E402


def python_loop(steps: int, prompt_tokens: int, budget: int, decode_rows: int) -> float:
    cm = ChunkingManagement({"llm": SubmoduleCaps(["prefill", "mixed"])}, model="bench-python")
    try:
        p = ChunkingPolicy(budget)
        cm.set_policies({("llm", "prefill"): p, ("llm", "mixed"): p})
        cm.set_budgets(
            {}, ["prefill", "decode", "mixed"], combined_walk_of={"prefill": "mixed", "decode": "mixed"}
        )
        base = 1 << 40
        for d in range(decode_rows):
            cm.continue_row(base + d, "llm", "decode", 1)
        prompt = array.array("I", range(prompt_tokens))
        rid = 0
        cm.admit(rid, "llm", "prefill", prompt)
        assemble, complete = cm.assemble, cm.complete
        t0 = time.perf_counter()
        for _ in range(steps):
            b = assemble("llm", "mixed")
            out = complete(b.step, b.planned())
            if rid in out.finished:
                cm.forget_request(rid)
                rid += 1
                cm.admit(rid, "llm", "prefill", prompt)
        return time.perf_counter() - t0
    finally:
        cm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--decode-rows", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    args = (a.steps, a.prompt_tokens, a.budget, a.decode_rows)
    rust, py, rust_cpu, py_cpu = [], [], [], []
    for _ in range(a.repeats):  # interleaved, so load on the machine hits both sides alike
        c0 = time.process_time()
        rust.append(_native._bench_facade(*args)[1])
        c1 = time.process_time()
        py.append(python_loop(*args))
        c2 = time.process_time()
        rust_cpu.append(c1 - c0)
        py_cpu.append(c2 - c1)
    r_us = statistics.median(rust) / a.steps * 1e6
    p_us = statistics.median(py) / a.steps * 1e6
    print(
        f"steps per run: {a.steps}, decode rows: {a.decode_rows}, prompt {a.prompt_tokens} tokens, budget {a.budget}"
    )
    def runs(xs):
        return ", ".join(f"{x / a.steps * 1e6:.2f}" for x in xs)

    print(f"rust facade:  {r_us:8.2f} us/step (median of {a.repeats}; runs {runs(rust)})")
    print(f"python API:   {p_us:8.2f} us/step (median of {a.repeats}; runs {runs(py)})")
    print(f"ratio python/rust: {p_us / r_us:.2f} (wall time)")
    # CPU time of the whole process (the caller's thread and the actors' thread), setup
    # included on both sides: less sensitive than wall time to other load on the machine.
    rc = statistics.median(rust_cpu) / a.steps * 1e6
    pc = statistics.median(py_cpu) / a.steps * 1e6
    print(f"cpu per step: rust facade {rc:.2f} us, python API {pc:.2f} us, ratio {pc / rc:.2f}")


if __name__ == "__main__":
    main()
