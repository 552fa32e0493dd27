"""The cost of one W3-sized step call (`complete_and_assemble` with its row changes) with the
actors on the calling thread, with the CPU's caches warm or emptied before each call, as vLLM's
own step empties them between two calls of the scheduler plugin.

    python python/scripts/cold_step.py [--steps 3000]          # warm and cold, µs per call
    valgrind --tool=cachegrind --cache-sim=yes --D1=49152,12,64 --LL=4194304,16,64 \\
        python python/scripts/cold_step.py --steps 200 --only cold

Under Cachegrind, two runs of different `--steps` (`cg_diff` of their outputs) give the cache
misses per function of the extra steps alone; `cg_annotate --sort=D1mr` ranks what the call
touches on a cold cache (the copy that empties the caches is `memcpy`: skip it).
"""

from __future__ import annotations

import argparse
import array
import time

from mstar_chunking import ChunkingManagement, ChunkingPolicy, NextStep, SubmoduleCaps

DECODE_ROWS, PROMPTS, PROMPT_TOKENS, BUDGET = 32, 16, 512, 512  # W3 (benches/common)
EVICT_BYTES = 16 << 20  # more than the last-level cache of the machines this ran on


def calls(steps: int, cold: bool) -> float:
    """Seconds per call over `steps` steps, the caches emptied before each call when `cold`."""
    cm = ChunkingManagement({"llm": SubmoduleCaps(["prefill", "mixed"])}, model="cold-step", caller_thread=True)
    try:
        cm.set_policies({("llm", "mixed"): ChunkingPolicy(BUDGET, align=16)})
        cm.set_budgets({}, ["prefill", "decode", "mixed"], combined_walk_of={"prefill": "mixed", "decode": "mixed"})
        for rid in range(1, DECODE_ROWS + 1):
            cm.continue_row(rid, "llm", "decode", 1)
        prompt = array.array("I", range(PROMPT_TOKENS))
        next_rid = 1 << 32
        for _ in range(PROMPTS):
            cm.admit(next_rid, "llm", "prefill", prompt)
            next_rid += 1
        src, dst = bytearray(EVICT_BYTES), bytearray(EVICT_BYTES)
        batch = cm.assemble("llm", "mixed")
        spent = 0.0
        for _ in range(steps):
            if cold:
                dst[:] = src
            nxt = NextStep("llm", "mixed")
            for rid in batch.final_rids():
                nxt.forget_request(rid)
                nxt.admit(next_rid, "prefill", prompt)
                next_rid += 1
            t = time.perf_counter()
            batch = cm.complete_and_assemble(batch.step, batch, None, next=nxt).next
            spent += time.perf_counter() - t
        return spent / steps
    finally:
        cm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--only", choices=["warm", "cold"], help="one of the two runs")
    a = ap.parse_args()
    if a.steps < 1:
        ap.error("--steps must be at least 1")
    for name in ["warm", "cold"]:
        if a.only in (None, name):
            print(f"{name}: {calls(a.steps, name == 'cold') * 1e6:.2f} us per call")


if __name__ == "__main__":
    main()
