#!/usr/bin/env python3
"""Prefill and decode tokens/s of the engine and of llama.cpp on the same GGUF file, at one and
two threads, measured in one run (alternating, so that both see the same machine).

    make engine-speed            # installs llama-cpp-python into the model cache, builds, runs

Workload (the same on both sides, `engine/examples/speed.rs` for the engine): prefill is one
256-token prompt in one step (best of 3); decode is 64 one-token steps after a 16-token prompt
(the best run's mean). llama.cpp keeps its KV cache in f32, as the engine does. Writes a
Markdown table to stdout and, with --out, to a file.
"""

import argparse
import json
import os
import subprocess
import sys
import time

PREFILL = 256
DECODE_AFTER = 16
DECODED = 64
RUNS = 3


def prompt():
    return [(i * 7 + 3) % 256 + 300 for i in range(PREFILL)]


def llama_cpp_speed(python, gguf, threads):
    """llama.cpp's figures, in a child process so that each thread count starts clean."""
    code = f"""
import json, time, llama_cpp
llm = llama_cpp.Llama(model_path={gguf!r}, n_ctx=1024, n_batch={PREFILL}, n_ubatch={PREFILL},
                      n_threads={threads}, n_threads_batch={threads}, verbose=False,
                      type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
toks = {prompt()!r}
pre = 1e9
for _ in range({RUNS}):
    llm.reset(); t0 = time.perf_counter(); llm.eval(toks); pre = min(pre, time.perf_counter() - t0)
dec = 1e9
for _ in range({RUNS}):
    llm.reset(); llm.eval(toks[:{DECODE_AFTER}]); t0 = time.perf_counter()
    for i in range({DECODED}):
        llm.eval([toks[{DECODE_AFTER} + i]])
    dec = min(dec, (time.perf_counter() - t0) / {DECODED})
print(json.dumps({{"prefill_ms": pre * 1e3, "prefill_tok_s": {PREFILL} / pre,
                   "decode_ms_per_token": dec * 1e3, "decode_tok_s": 1 / dec,
                   "version": llama_cpp.__version__}}))
"""
    out = subprocess.run([python, "-c", code], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def engine_speed(binary, gguf, threads, fmt):
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    cmd = [binary, gguf] + ([fmt] if fmt else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--engine", required=True, help="the built `speed` example")
    ap.add_argument("--python", required=True, help="a Python with llama-cpp-python")
    ap.add_argument("--format", default="", help="the engine's weight format (default: its own)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = []
    for th in [int(t) for t in a.threads.split(",")]:
        e = engine_speed(a.engine, a.gguf, th, a.format)
        ll = llama_cpp_speed(a.python, a.gguf, th)
        rows.append((th, e, ll))
        print(f"threads {th}: engine {e}, llama.cpp {ll}", file=sys.stderr)
    lines = [
        f"# Engine vs llama.cpp on {os.path.basename(a.gguf)}",
        "",
        f"`make engine-speed`, {time.strftime('%Y-%m-%d')}, llama-cpp-python "
        f"{rows[0][2]['version']} (llama.cpp built from source for this CPU), engine format "
        f"`{rows[0][1]['format']}`. Prefill: one {PREFILL}-token prompt in one step (best of "
        f"{RUNS}); decode: {DECODED} one-token steps after {DECODE_AFTER} tokens (best run's "
        "mean). A ratio is engine time ÷ llama.cpp time (above 1: the engine is slower).",
        "",
        "| threads | prefill tok/s engine | llama.cpp | ratio | decode tok/s engine | llama.cpp | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for th, e, ll in rows:
        lines.append(
            f"| {th} | {e['prefill_tok_s']:.0f} | {ll['prefill_tok_s']:.0f} | "
            f"{ll['prefill_tok_s'] / e['prefill_tok_s']:.2f} | {e['decode_tok_s']:.1f} | "
            f"{ll['decode_tok_s']:.1f} | {ll['decode_tok_s'] / e['decode_tok_s']:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
