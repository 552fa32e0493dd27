"""vLLM's V1 scheduler alone on the step workloads W1-W3, timed per step (run by
`scripts/vs_vllm.py` with the interpreter of a venv holding vLLM 0.11.2).

Each step is what vLLM's engine core does around its model: `Scheduler.schedule()`, then
`update_from_output()` with a fabricated model-runner output that samples one token for every
request that decoded or finished its prompt. Only those two calls are timed. The workloads are
benches/common/mod.rs's: decode rows that never finish (a 16-token prompt, then one token a
step), and `prompts` prompts of `prompt_tokens` queued at all times, each asking for one output
token, so a prompt whose prefill ends finishes and a new one is queued in its place. The model
is a `config.json` of a tiny Llama (no weights, no tokenizer), the KV cache a block count large
enough that nothing is preempted, prefix caching off (every prompt is distinct anyway).

Usage: python vllm_v1_step.py --steps N [--warmup N] W1 W2 W3
Prints one JSON object per workload: {"workload", "us_per_step" (median), "mean_us", "steps",
"tokens_per_step", "vllm"}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

# name -> decode rows, prompts, prompt tokens, token budget (benches/common/mod.rs)
WORKLOADS = {
    "W1": (256, 64, 2_048, 2_048),
    "W2": (1_024, 64, 8_192, 8_192),
    "W3": (32, 16, 512, 512),
}
BLOCK = 16
EOS = 2
SAMPLED = 7  # the token every fabricated step samples (never EOS)
MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 65536,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": EOS,
}

init_none_hash(sha256)
HASHER = get_request_block_hasher(BLOCK, sha256)


def scheduler(model_dir: str, rows: int, prompts: int, prompt_tokens: int, budget: int, steps: int) -> Scheduler:
    max_len = 32_768
    sc = SchedulerConfig(
        max_num_seqs=rows + prompts,
        max_num_batched_tokens=budget,
        max_model_len=max_len,
        enable_chunked_prefill=True,
        policy="fcfs",
    )
    mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32", seed=0, max_model_len=max_len)
    cc = CacheConfig(block_size=BLOCK, enable_prefix_caching=False)
    vc = VllmConfig(scheduler_config=sc, model_config=mc, cache_config=cc, device_config=DeviceConfig("cpu"))
    # Every decode row's KV for the whole run, and every queued prompt's, with room to spare.
    blocks = (rows * (16 + steps + 64) + (prompts + 8) * prompt_tokens) // BLOCK + 1024
    attn = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], attn)])
    cc.num_gpu_blocks = blocks
    return Scheduler(
        vllm_config=vc,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=BLOCK,
        log_stats=True,
    )


def request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        eos_token_id=EOS,
        block_hasher=HASHER,
    )


class Run:
    """One workload on one scheduler."""

    def __init__(self, model_dir: str, name: str, steps: int, warmup: int) -> None:
        rows, self.prompts, self.prompt_tokens, budget = WORKLOADS[name]
        self.s = scheduler(model_dir, rows, self.prompts, self.prompt_tokens, budget, steps + warmup + 200)
        self.next = 0
        self.queued: set[str] = set()
        for i in range(rows):
            self.s.add_request(request(f"d{i}", [1000 + i % 30_000] * 16, 1_000_000))
        for _ in range(self.prompts):
            self.prompt()
        # Every decode row past its prompt before measuring (vLLM schedules them first too).
        for _ in range(200):
            self.step()
            if all(r.num_output_tokens > 0 for k, r in self.s.requests.items() if k.startswith("d")):
                break

    def prompt(self) -> None:
        rid = f"p{self.next}"
        base = (self.next * 7919) % 20_000
        self.s.add_request(request(rid, [base + j % 10_000 for j in range(self.prompt_tokens)], 1))
        self.queued.add(rid)
        self.next += 1

    def step(self) -> tuple[float, int]:
        """One step; returns the seconds spent in the two calls and the tokens scheduled."""
        t0 = time.perf_counter()
        out = self.s.schedule()
        t1 = time.perf_counter()
        ids = list(out.num_scheduled_tokens)
        # A request samples unless this step ran a chunk that leaves part of its prompt to do.
        sample = []
        for rid in ids:
            r = self.s.requests[rid]
            sample.append(r.num_computed_tokens >= r.num_prompt_tokens)
        mro = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            # vLLM 0.11.2 takes each request's sampled tokens as an array (`.tolist()`).
            sampled_token_ids=[np.array([SAMPLED] if s else [], dtype=np.int64) for s in sample],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
        )
        t2 = time.perf_counter()
        result = self.s.update_from_output(out, mro)
        t3 = time.perf_counter()
        for eco in result.values():
            for o in eco.outputs:
                if o.finish_reason is not None and o.request_id in self.queued:
                    self.queued.discard(o.request_id)
                    self.prompt()
        return (t1 - t0) + (t3 - t2), out.total_num_scheduled_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("workloads", nargs="+", choices=sorted(WORKLOADS))
    args = ap.parse_args()
    model_dir = tempfile.mkdtemp(prefix="mstar-vllm-model-")
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(MODEL, f)
    for name in args.workloads:
        run = Run(model_dir, name, args.steps, args.warmup)
        for _ in range(args.warmup):
            run.step()
        times, tokens = [], 0
        for _ in range(args.steps):
            t, n = run.step()
            times.append(t)
            tokens += n
        budget = WORKLOADS[name][3]
        if tokens < 0.9 * budget * args.steps:
            sys.exit(f"vllm_v1_step: {name}: {tokens / args.steps:.0f} tokens a step, not near the budget {budget}")
        print(json.dumps({
            "workload": name,
            "us_per_step": statistics.median(times) * 1e6,
            "mean_us": statistics.mean(times) * 1e6,
            "steps": args.steps,
            "tokens_per_step": tokens / args.steps,
            "vllm": vllm.__version__,
        }), flush=True)
        run.s.shutdown()


if __name__ == "__main__":
    main()
