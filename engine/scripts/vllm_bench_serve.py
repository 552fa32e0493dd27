#!/usr/bin/env python3
"""vLLM's own load generator, `vllm bench serve`, against the engine: every request must succeed,
with vLLM's `/tokenize` prompt alignment working (its probe must not be skipped).

    make test-vllm-bench   # in `make test`: the debug engine, 20 short prompts, both backends
    make vllm-bench        # engine/results/vllm-bench-serve.md: the release engine, without and with a time budget

For each setting (`--setting LABEL=SERVE-FLAGS`, or one plain run) and each `--backends` entry,
the engine is started on a free port of 127.0.0.1, `vllm bench serve` runs the random dataset
with the model's tokenizer as `export-tokenizer` writes it, and the engine is stopped with
SIGTERM. Prints a Markdown table of TTFT, TPOT and ITL at p50/p99; `--out` also writes it, and
`--json` the figures. Exits non-zero naming the run if a request failed, the alignment probe
was skipped, or a process did not finish in time.
"""

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time

METRICS = ["ttft", "tpot", "itl"]


def fail(msg):
    print(f"vllm_bench_serve: {msg}", file=sys.stderr)
    sys.exit(1)


def start_engine(engine, serve_flags, log):
    """The engine serving SmolLM2 on a free port; answers the process and its base URL."""
    cmd = [engine, "serve", "--model", "smollm2", "--listen", "127.0.0.1:0", *serve_flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                            text=True)
    # The first line of stdout names the address once the model is loaded and the port bound.
    line = proc.stdout.readline()
    if "http://" not in line:
        proc.kill()
        proc.wait()
        fail(f"`{shlex.join(cmd)}` did not start (first line {line!r}); its log is {log.name}")
    return proc, "http://" + line.split("http://", 1)[1].split()[0]


def stop_engine(proc):
    """SIGTERM, as a service manager stops it; a kill if it has not exited in 60 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            fail("the engine did not stop within 60 s of SIGTERM")
    if proc.returncode != 0:
        fail(f"the engine exited {proc.returncode} after SIGTERM")


def bench(args, url, backend, workdir, label):
    name = f"{label}-{backend}.json".replace(" ", "_")
    cmd = [
        args.vllm, "bench", "serve", "--backend", backend, "--base-url", url,
        "--endpoint", "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions",
        "--dataset-name", "random", "--num-prompts", str(args.num_prompts),
        "--request-rate", str(args.request_rate), "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--tokenizer", args.tokenizer,
        "--seed", str(args.seed), "--temperature", "0", "--ignore-eos",
        "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", workdir, "--result-filename", name, "--disable-tqdm",
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        fail(f"{label} / {backend}: `vllm bench serve` did not finish in {args.timeout} s")
    text = out.stdout + out.stderr
    if out.returncode != 0:
        fail(f"{label} / {backend}: `vllm bench serve` exited {out.returncode}:\n{text[-3000:]}")
    if "skipping alignment" in text:
        fail(f"{label} / {backend}: vLLM skipped its /tokenize alignment:\n{text[-3000:]}")
    with open(os.path.join(workdir, name)) as f:
        r = json.load(f)
    done, failed = r.get("completed"), r.get("failed", 0)
    if done != args.num_prompts or failed:
        errors = [e for e in r.get("errors", []) if e][:3]
        fail(f"{label} / {backend}: {done} of {args.num_prompts} requests completed, {failed} "
             f"failed; first errors {errors}")
    return r


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True, help="the mstar-engine binary")
    p.add_argument("--vllm", required=True, help="the `vllm` command of a vLLM venv")
    p.add_argument("--tokenizer", required=True, help="the directory `export-tokenizer` wrote")
    p.add_argument("--backends", default="openai,openai-chat")
    p.add_argument("--setting", action="append", default=[],
                   help="LABEL=SERVE-FLAGS: one engine setting (repeatable; default one plain run)")
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--request-rate", type=float, default=4.0)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=int, default=900, help="seconds per `vllm bench serve` run")
    p.add_argument("--out", help="also write the Markdown table here")
    p.add_argument("--json", help="write every run's figures here")
    args = p.parse_args()
    if not 1 <= args.num_prompts <= 10_000:
        fail(f"--num-prompts {args.num_prompts}: 1 to 10,000")
    settings = []
    for s in args.setting or ["token budget="]:
        label, sep, flags = s.partition("=")
        if not sep or not label:
            fail(f"--setting {s!r}: LABEL=SERVE-FLAGS")
        settings.append((label, shlex.split(flags)))
    backends = [b for b in args.backends.split(",") if b]
    for b in backends:
        if b not in ("openai", "openai-chat"):
            fail(f"--backends: {b!r} is neither openai nor openai-chat")

    rows, runs = [], []
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as workdir:
        for label, flags in settings:
            for backend in backends:
                log = open(os.path.join(workdir, f"engine-{len(runs)}.log"), "w")
                proc, url = start_engine(args.engine, flags, log)
                try:
                    t0 = time.monotonic()
                    r = bench(args, url, backend, workdir, label)
                finally:
                    stop_engine(proc)
                    log.close()
                runs.append({"setting": label, "serve_flags": flags, "backend": backend,
                             "seconds": round(time.monotonic() - t0, 1),
                             **{k: v for k, v in r.items() if isinstance(v, (int, float))}})
                cells = [f"{r.get(f'p{q}_{m}_ms', float('nan')):.1f}" for m in METRICS
                         for q in (50, 99)]
                rows.append(f"| {label} | `{backend}` | {r['completed']}/{args.num_prompts} | "
                            + " | ".join(cells) + " |")
                print(f"{label} / {backend}: {r['completed']}/{args.num_prompts} completed",
                      file=sys.stderr)
    head = ("| engine setting | backend | completed | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | "
            "TPOT p99 ms | ITL p50 ms | ITL p99 ms |\n|---|---|---|---:|---:|---:|---:|---:|---:|")
    table = head + "\n" + "\n".join(rows) + "\n"
    workload = (f"`vllm bench serve --dataset-name random --num-prompts {args.num_prompts} "
                f"--request-rate {args.request_rate:g} --random-input-len {args.input_len} "
                f"--random-output-len {args.output_len} --temperature 0 --ignore-eos "
                f"--seed {args.seed}`\n\n")
    print(workload + table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(workload + table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
