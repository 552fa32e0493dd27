#!/usr/bin/env python3
"""vLLM features on the real engine (vLLM's CPU build, SmolLM2), the plugin against vLLM's own
scheduler, greedy: structured output (a JSON-schema `response_format`, as the OpenAI server
passes it: `StructuredOutputsParams(json=schema)`), and the same requests again with n-gram
speculative decoding (`--speculative-config '{"method": "ngram", ...}'`).

    python real_features.py --model MODEL_DIR [--out RESULTS.md] [--json FILE]

Each scheduler runs in a process of its own (one model load each): the same requests, all
submitted at once (the JSON request beside long plain prompts, so that its prompt is chunked
and it decodes beside other prompts' chunks), token budget `--budget`. Checked, each a failure
naming the run and request: every request finishes; the JSON request's text parses as JSON and
has the schema's required keys; every completion's token ids equal vLLM's own scheduler's in the
same setting (with speculation, vLLM's own with speculation). A setting the CPU build cannot run
is reported with its error.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "is_capital": {"type": "boolean"},
    },
    "required": ["city", "country", "is_capital"],
    "additionalProperties": False,
}
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
QUESTION = (
    "<|im_start|>user\nGive the capital of France as JSON with the keys city, country and "
    "is_capital.<|im_end|>\n<|im_start|>assistant\n"
)


def requests(model: Path) -> list[dict]:
    """The JSON request (after a window of the docs as context) and three long plain prompts."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    text = "\n\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))
    ids = tok.encode(text, add_special_tokens=False).ids
    question = tok.encode(QUESTION, add_special_tokens=False).ids
    out = [{"id": "json", "tokens": ids[:300] + question, "max_tokens": 96, "schema": SCHEMA}]
    at = 300
    for i, n in enumerate((900, 700, 1100)):
        out.append({"id": f"plain{i}", "tokens": ids[at : at + n], "max_tokens": 24})
        at += n
    return out


def child(args: argparse.Namespace) -> int:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    reqs = json.loads(Path(args.requests).read_text())
    kwargs: dict[str, Any] = {}
    if args.child.startswith("plugin"):
        kwargs["scheduler_cls"] = "mstar_chunking.vllm.Scheduler"
    if args.child.endswith("-ngram"):
        kwargs["speculative_config"] = SPEC
    llm = LLM(
        model=str(args.model),
        dtype="float32",
        max_model_len=2048,
        max_num_batched_tokens=args.budget,
        max_num_seqs=8,
        seed=0,
        enforce_eager=True,
        **kwargs,
    )
    s = llm.llm_engine.engine_core.engine_core.scheduler
    params = []
    for r in reqs:
        so = StructuredOutputsParams(json=r["schema"]) if "schema" in r else None
        params.append(SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], structured_outputs=so))
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=r["tokens"]) for r in reqs], params, use_tqdm=False)
    result = {
        "scheduler": type(s).__module__ + "." + type(s).__qualname__,
        "generate_s": time.perf_counter() - t0,
        "outputs": {
            r["id"]: {"text": o.outputs[0].text, "token_ids": list(o.outputs[0].token_ids), "finish": o.outputs[0].finish_reason}
            for r, o in zip(reqs, outs)
        },
        "requests_left": len(s.requests),
        "spec_tokens": s.num_spec_tokens,
        "held": len(getattr(s, "_rid_of", {})),
    }
    Path(args.result).write_text(json.dumps(result))
    llm.llm_engine.engine_core.shutdown()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--work", type=Path, default=REPO / "target" / "vllm-real-features")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--child", default=None)
    ap.add_argument("--requests", default=None)
    ap.add_argument("--result", default=None)
    args = ap.parse_args()
    if args.child:
        return child(args)
    args.work.mkdir(parents=True, exist_ok=True)
    reqs_file = args.work / "requests.json"
    reqs_file.write_text(json.dumps(requests(args.model)))
    runs: dict[str, dict] = {}
    errors: dict[str, str] = {}
    for kind in ("vllm", "plugin", "vllm-ngram", "plugin-ngram"):
        out, log = args.work / f"{kind}.json", args.work / f"{kind}.log"
        cmd = [sys.executable, __file__, "--child", kind, "--model", str(args.model), "--requests", str(reqs_file),
               "--result", str(out), "--budget", str(args.budget)]
        with open(log, "w") as f:
            p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout)
        if p.returncode != 0:
            tail = log.read_text()[-3000:]
            print(tail)
            errors[kind] = next((ln.strip() for ln in reversed(tail.splitlines()) if "Error" in ln), f"exit {p.returncode}")
            continue
        runs[kind] = json.loads(out.read_text())
    failures = []
    for base, ours_kind in (("vllm", "plugin"), ("vllm-ngram", "plugin-ngram")):
        if base in errors or ours_kind in errors:
            if ours_kind in errors and base not in errors:
                failures.append(f"{ours_kind} failed where {base} ran: {errors[ours_kind]}")
            continue
        theirs, ours = runs[base]["outputs"], runs[ours_kind]["outputs"]
        for req_id, o in ours.items():
            if o["finish"] is None:
                failures.append(f"{ours_kind}: {req_id} did not finish")
            if o["token_ids"] != theirs[req_id]["token_ids"]:
                failures.append(f"{ours_kind}: {req_id}'s tokens differ from {base}'s")
    for kind, r in runs.items():
        try:
            value = json.loads(r["outputs"]["json"]["text"])
            missing = [k for k in SCHEMA["required"] if k not in value]
            if missing:
                failures.append(f"{kind}: the JSON lacks {missing}")
        except ValueError as e:
            failures.append(f"{kind}: the JSON request's text is not JSON ({e})")
        if r["requests_left"] or r["held"]:
            failures.append(f"{kind}: {r['requests_left']} requests left, {r['held']} held")
    lines = [
        "# Structured output and n-gram speculation on vLLM's real engine (CPU build, SmolLM2-135M-Instruct)",
        "",
        "Written by `python/tests/vllm/real_features.py`: a JSON-schema request (`response_format`'s "
        "`StructuredOutputsParams(json=...)`) beside three long plain prompts (900, 700 and 1,100 "
        f"tokens), greedy, token budget {args.budget}, with vLLM's own scheduler and with "
        f"`mstar_chunking.vllm.Scheduler`; then the same with n-gram speculation (`{json.dumps(SPEC)}`).",
        "",
        "| run | scheduler | speculative tokens | JSON text | generate s |",
        "|---|---|---:|---|---:|",
    ]
    for kind, r in runs.items():
        text = r["outputs"]["json"]["text"].replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {kind} | `{r['scheduler']}` | {r['spec_tokens']} | `{text}` | {r['generate_s']:.1f} |")
    for kind, e in errors.items():
        lines.append(f"| {kind} | failed: `{e[:300]}` | | | |")
    lines += ["", "Failures: " + ("; ".join(failures) if failures else "none (the same tokens for every request in each pair).")]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "errors": errors}, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
