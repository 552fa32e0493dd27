"""A vLLM V1 scheduler whose chunked prefill is planned by mstar_chunking.

    vllm serve MODEL --scheduler-cls mstar_chunking.vllm.Scheduler

`Scheduler` is the one dotted path: it becomes `AsyncScheduler` (a subclass of vLLM's own
`AsyncScheduler`) when vLLM's async scheduling is on, and stays over vLLM's `Scheduler`
otherwise, so the overlap of async scheduling is kept. Each step the component
decides how many tokens every running and waiting request gets (floor, alignment, per-row cap,
partial-prefill limit, token and time budgets); vLLM's own scan then allocates the KV blocks,
preempts and frees exactly as it does without the plugin, taking for each request at most the
planned tokens (a request the plan leaves out gets none). A planned request vLLM could not
schedule is reported to the component as not run and planned again. The design, the settings
read and what is refused are in docs/vllm.md.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections import deque
from itertools import islice, repeat
from typing import Any, Optional

import vllm

SUPPORTED_VLLM = ((0, 32), (0, 34))  # [lower, upper): the releases whose internals this follows
SUPPORTED_NAME = "0.32.x and 0.33.x"


def _release(version: str) -> tuple[int, int]:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (-1, -1)


if not SUPPORTED_VLLM[0] <= _release(vllm.__version__) < SUPPORTED_VLLM[1]:
    raise ImportError(
        f"mstar_chunking.vllm supports vLLM {SUPPORTED_NAME} (it overrides those releases' scheduler "
        f"internals); found vLLM {vllm.__version__}. Install `mstar-chunking[vllm]`, which pins them."
    )

from vllm.outputs import RequestError  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler as _VllmAsyncScheduler  # noqa: E402
from vllm.v1.core.sched.request_queue import SchedulingPolicy  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler as _VllmScheduler  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from ._plugin_stats import ChunkingStats  # noqa: E402
from . import (  # noqa: E402
    ChunkingError,
    ChunkingManagement,
    ChunkingPolicy,
    SubmoduleCaps,
    serve_metrics,
)

log = logging.getLogger("mstar_chunking.vllm")

NODE, PREFILL, DECODE, MIXED = "llm", "prefill", "decode", "mixed"
CONFIG_ENV = "MSTAR_CHUNKING_CONFIG"
MANIFEST_ENV = "MSTAR_CHUNKING_MANIFEST"
METRICS_ENV = "MSTAR_CHUNKING_METRICS"


class UnsupportedVllmFeature(ValueError):
    """A vLLM feature this scheduler does not support yet, refused when it starts."""


class _Bound:
    """vLLM's `prefill_capacity_bound` as it stood before `schedule()`, set in its place for the
    step: vLLM reads only its truth, and a step that assigns the attribute (one that admitted
    prefills: a release step) replaces it, which is how the plugin tells such a step apart."""

    __slots__ = ("value",)

    def __init__(self, value: bool) -> None:
        self.value = value

    def __bool__(self) -> bool:
        return self.value


_BOUND = (_Bound(False), _Bound(True))


class _Queues:
    """vLLM's two waiting queues as its scan takes them: the requests holding KV blocks, then
    the rest (for the admission: iterated and counted, nothing else)."""

    __slots__ = ("first", "rest")

    def __init__(self, first: Any, rest: Any) -> None:
        self.first, self.rest = first, rest

    def __iter__(self) -> Any:
        yield from self.first
        yield from self.rest

    def __len__(self) -> int:
        return len(self.first) + len(self.rest)


class _Step:
    """One vLLM step as the component planned it, until vLLM reports its output: its rows in
    bulk (`Batch.keyed`: the continuing rows, then the chunks), row `i` being vLLM's request
    `req_ids[i]`, planned `plan[req_ids[i]]` tokens."""

    __slots__ = ("step", "batch", "req_ids", "plan", "chunks", "finals", "ran", "returned_at", "completed", "measured_ms")

    def __init__(
        self,
        batch: Any,
        req_ids: list[str],
        plan: dict[str, int],
        chunks: int,
        finals: list[tuple[int, int]],
        ran: Optional[list[int]],
    ) -> None:
        self.step: int = batch.step
        self.batch = batch  # the component's `Batch`: the `ran` of a step whose every row ran as planned
        self.req_ids = req_ids
        self.plan = plan
        self.chunks = chunks  # the last `chunks` rows are chunks, the others continuing (decode) rows
        self.finals = finals  # (row, rid) of the rows whose chunk ends its prompt's prefill
        self.ran = ran  # the tokens each row ran; None: every row its planned tokens
        self.returned_at = 0.0
        self.completed = False
        self.measured_ms: Optional[float] = None  # known once its output came, if it was not completed yet

    def rows(self) -> list[tuple[str, int, int, int]]:
        """`(vLLM request id, rid, planned, ran)` per row."""
        planned = list(self.plan.values())
        ran = planned if self.ran is None else self.ran
        return list(zip(self.req_ids, self.batch.columns()[0], planned, ran))


def _vllm_config_of(args: tuple, kwargs: dict) -> Any:
    return kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]


def _kv_cache_config_of(args: tuple, kwargs: dict) -> Any:
    return kwargs["kv_cache_config"] if "kv_cache_config" in kwargs else (args[1] if len(args) > 1 else None)


def _refusals(cfg: Any, kv_cache_config: Any = None) -> list[str]:
    """The configured vLLM features this scheduler does not support, by name."""
    out = []
    if getattr(cfg, "ec_transfer_config", None) is not None:
        out.append("encoder-cache transfer (--ec-transfer-config)")
    if cfg.parallel_config.pipeline_parallel_size > 1:
        out.append("pipeline parallelism (--pipeline-parallel-size > 1)")
    mc = cfg.model_config
    if mc.is_encoder_decoder or mc.supports_multimodal_inputs:
        out.append("encoder inputs (an encoder-decoder or multimodal model)")
    if mc.runner_type == "pooling":
        out.append("pooling models (--runner pooling)")
    if getattr(mc, "is_diffusion", False):
        out.append("diffusion models")
    if getattr(kv_cache_config, "has_mamba_layers", False) and cfg.cache_config.mamba_cache_mode == "align":
        out.append("Mamba's 'align' cache mode (--mamba-cache-mode align), whose chunks vLLM aligns itself")
    sc = cfg.scheduler_config
    if not sc.enable_chunked_prefill:
        out.append("chunked prefill turned off (--no-enable-chunked-prefill)")
    if sc.max_num_scheduled_tokens is not None and sc.max_num_scheduled_tokens != sc.max_num_batched_tokens:
        out.append("max_num_scheduled_tokens other than max_num_batched_tokens")
    if getattr(sc, "long_prefill_token_threshold_adaptive", False):
        # vLLM floors the threshold at a fair share of the budget each step; the component's
        # per-row cap is fixed.
        out.append("the adaptive long-prefill threshold (--long-prefill-token-threshold-adaptive)")
    return out


def _mstar_env() -> bool:
    return any(k.startswith("MSTAR__") for k in os.environ)


class _Chunking:
    """The component's side of a vLLM scheduler; mixed in before vLLM's class."""

    chunking: ChunkingManagement
    mstar_stats: ChunkingStats
    #: Where the component's metrics are served (`MSTAR_CHUNKING_METRICS`), once they are.
    metrics_address: Optional[str] = None
    #: The clock steps are measured with (seconds); a test replaces it with a simulated one.
    clock: Any = staticmethod(time.perf_counter)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        cfg = _vllm_config_of(args, kwargs)
        refused = _refusals(cfg, _kv_cache_config_of(args, kwargs))
        if refused:
            raise UnsupportedVllmFeature(
                "mstar_chunking.vllm.Scheduler does not support " + "; ".join(refused) + " (docs/vllm.md)"
            )
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        if self.need_mamba_block_aligned_split or self.num_prefill_lookahead:  # type: ignore[attr-defined]
            # Both are refused above (Mamba's 'align' mode; the MTP lookahead comes with a
            # speculative config): this guards against another way of turning them on.
            raise UnsupportedVllmFeature(
                "mstar_chunking.vllm.Scheduler does not support models whose chunks vLLM aligns "
                "itself (Mamba 'align' cache mode, multi-module MTP lookahead)"
            )
        self.mstar_stats = ChunkingStats()
        self._rid_of: dict[str, int] = {}
        self._req_of: dict[int, str] = {}
        # The rids by the address (`id`) of vLLM's request object, and that address by request
        # id: the admission scan reads the waiting queue's entries without touching the requests.
        self._rid_at: dict[int, int] = {}
        self._at_of: dict[str, int] = {}
        # The requests added since the last admission and not admitted yet (at the back of
        # vLLM's queue, in its order), and whether the queue may hold others not admitted in
        # order (after a preemption, a request forgotten while it waits or not admitted, a scan
        # that ran out of slots): then the admission scans the queue, else it takes the
        # arrivals alone.
        self._arrived: list[Request] = []
        self._rescan = True
        self._next_rid = 1
        self._start_hint: dict[str, int] = {}  # observed chunk starts after a mismatch
        self._plan: Optional[dict[str, int]] = None  # the step being scheduled: request id -> tokens
        self._starts: dict[str, int] = {}  # and its chunks' starts
        self._observed: dict[str, int] = {}
        # vLLM 0.33 moves a waiting request it is given no tokens for into `deferred_waiting`, which
        # counts as deferred in its stats and against the data-parallel throttle's escape
        # (`prefill_capacity_bound`); the requests the plan alone left out are noted here (those
        # not deferred already) and taken out of it again after the step.
        self._deferred: Optional[set] = getattr(self, "deferred_waiting", None)
        self._left_out: list[Request] = []
        self._uncompleted: Optional[_Step] = None
        self._changes: list[tuple[int, Any, int]] = []  # (rid, tokens or None to forget, cached)
        self._in_flight: deque[tuple[Any, Optional[_Step]]] = deque()
        self._last_update = 0.0
        self._async = isinstance(self, _VllmAsyncScheduler)
        # The `priority` policy: vLLM's waiting queue is a heap by (priority, arrival time), so an
        # arrival may go ahead of requests admitted already; the queue is scanned at each arrival.
        self._by_priority = SchedulingPolicy(cfg.scheduler_config.policy) == SchedulingPolicy.PRIORITY
        # LoRA: at most `max_loras` distinct adapters among the running requests and those vLLM
        # starts in a step (vLLM skips a waiting request whose adapter would be one more); the
        # admission keeps the same bound over the running and the admitted requests, in queue order.
        self._max_loras: Optional[int] = cfg.lora_config.max_loras if cfg.lora_config is not None else None
        # KV transfer: vLLM's queue of waiting requests that hold KV blocks, scanned before the rest.
        self._holding: Any = getattr(self, "kv_holding_waiting", None)
        # Speculative decoding: a decode row is planned for 1 + k tokens (the token and k drafts,
        # vLLM's most); vLLM schedules 1 + the drafts proposed, and the row reports what it ran.
        self._estimate = 1 + (self.num_spec_tokens or 0)  # type: ignore[attr-defined]
        self._padded: dict[str, int] = {}  # new decode rows vLLM padded to 1 + k: their planned tokens
        self._moved: list[str] = []
        self._decoding: list[int] = []  # rids admitted as decode rows (their prompt done elsewhere)  # waiting requests run from vLLM's larger start (an external hit)
        # The estimate each decode row was last given (with speculative decoding): 1 + the drafts
        # vLLM holds for the request, which is what vLLM's scan charges its budget for the row.
        self._row_estimate: dict[int, int] = {}
        # vLLM 0.33 caps a prefix-cache hit at the aux-output connector's retained outputs; 0.32's
        # lookup takes the request alone.
        self._capped_hits = "max_cache_hit_length" in inspect.signature(
            self.kv_cache_manager.get_computed_blocks  # type: ignore[attr-defined]
        ).parameters
        self.chunking = self._start_component(cfg)
        # The one-trip step with its row changes as lists and the plan keyed by request id.
        self._one_call = self.chunking._engine._complete_and_assemble_keyed

    # -- settings ---------------------------------------------------------------------------

    def _start_component(self, cfg: Any) -> ChunkingManagement:
        sc = cfg.scheduler_config
        budget = self.max_num_scheduled_tokens  # type: ignore[attr-defined]
        # A drafter's input slots (a draft model, parallel drafting), which vLLM charges its
        # budget on every request it schedules: the component charges them on every row.
        spec = cfg.speculative_config
        slots = spec.max_num_new_slots_for_drafting if spec is not None else 0
        threshold = sc.long_prefill_token_threshold or None
        model = str(getattr(cfg.model_config, "served_model_name", None) or cfg.model_config.model)
        metrics = os.environ.get(METRICS_ENV)
        if metrics:
            pc = cfg.parallel_config
            rank = pc.data_parallel_index if pc.data_parallel_size > 1 else 0
            if rank:  # one engine core per data-parallel rank, each on its own port
                host, _, port = metrics.rpartition(":")
                if not port.isdigit():
                    raise UnsupportedVllmFeature(f"{METRICS_ENV}={metrics!r} is not host:port")
                metrics = f"{host}:{int(port) + rank}"
            self.metrics_address = serve_metrics(metrics)
        paths = [p for p in os.environ.get(CONFIG_ENV, "").split(os.pathsep) if p]
        if paths or _mstar_env():
            if threshold is not None:
                raise UnsupportedVllmFeature(
                    f"long_prefill_token_threshold={threshold} with {CONFIG_ENV}: set "
                    "chunking.max_row_tokens in the config instead"
                )
            cm = ChunkingManagement.from_config(
                paths, model=model, manifest=os.environ.get(MANIFEST_ENV) or None, caller_thread=True
            )
            try:
                self._check_component(cm, budget)
                self._check_slots(cm.config.get("slots_per_row", 0), slots, "chunking.slots_per_row")
            except BaseException:
                cm.close()
                raise
            return cm
        settings = dict(self.chunking_settings())
        align = settings.pop("align", self.block_size)  # type: ignore[attr-defined]
        self._check_slots(settings.setdefault("slots_per_row", slots), slots, "chunking_settings()['slots_per_row']")
        cm = ChunkingManagement({NODE: SubmoduleCaps([PREFILL, MIXED], False)}, model=model, caller_thread=True)
        try:
            policy = ChunkingPolicy(budget, align=align)
            cm.set_policies({(NODE, PREFILL): policy, (NODE, MIXED): policy})
            cm.set_budgets({}, [PREFILL, DECODE, MIXED], combined_walk_of={PREFILL: MIXED, DECODE: MIXED}, **settings)
        except BaseException:
            cm.close()
            raise
        return cm

    def chunking_settings(self) -> dict[str, Any]:
        """The component's settings when no chunking config is given: `align` (the policy's,
        default vLLM's block size) and keyword arguments of `set_budgets` (`min_chunk_tokens`,
        `max_row_tokens`, `max_partial_prefills`, and the time-budget ones where the package has
        them). The default is vLLM's `long_prefill_token_threshold` as the per-row cap; a
        subclass overrides this to set the limits in code (`--scheduler-cls my.Scheduler`)."""
        threshold = self.scheduler_config.long_prefill_token_threshold  # type: ignore[attr-defined]
        return {"max_row_tokens": threshold or None}

    @staticmethod
    def _check_component(cm: ChunkingManagement, budget: int) -> None:
        try:
            b = cm.max_batch_tokens(NODE, MIXED)
        except Exception as e:
            raise UnsupportedVllmFeature(
                f"the chunking config needs node {NODE!r} with walks {PREFILL!r}, {DECODE!r} and the "
                f"combined walk {MIXED!r} (the demo manifest has them): {e}"
            ) from e
        if b is None or b > budget:
            raise UnsupportedVllmFeature(
                f"chunking.max_batch_tokens.{NODE}.{MIXED} is {b if b is not None else 'off'}: it must be "
                f"a budget of at most vLLM's max_num_batched_tokens ({budget})"
            )

    @staticmethod
    def _check_slots(given: int, slots: int, where: str) -> None:
        if given != slots:
            raise UnsupportedVllmFeature(
                f"{where} is {given}: vLLM's drafter takes {slots} input slots on every request it "
                f"schedules (--speculative-config), which the plan must charge: set it to {slots}"
            )

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        update = request.request_id in self.requests  # type: ignore[attr-defined]
        super().add_request(request)  # type: ignore[misc]
        if update:
            # A stream's next input (or its end): vLLM extends the request's prompt
            # in place when it waits for input, else queues the update until its turn stops;
            # the queue is scanned again for it (the request object is not a new arrival).
            self._rescan = True
            return
        self._arrived.append(request)
        if self._by_priority:
            self._rescan = True
        if request.has_encoder_inputs and request.request_id in self.requests:  # type: ignore[attr-defined]
            # Refused at start with the model that takes them; a request carrying them anyway
            # would have its chunks cut at its inputs by vLLM, which the plan does not know.
            self.mstar_stats.refused_requests += 1
            message = "encoder inputs is not supported by mstar_chunking.vllm.Scheduler"
            errors = self.grammar_compile_error_reqs  # type: ignore[attr-defined]
            if isinstance(errors, dict):  # vLLM 0.33: the error carries its code and message
                errors[request.request_id] = RequestError(code="validation_error", message=message)
            else:
                # vLLM 0.32 keeps the ids alone: the request finishes with an error, no message.
                log.warning("request %s refused: %s", request.request_id, message)
                errors.add(request.request_id)

    def _forget(self, req_id: str) -> None:
        """Ends the request in the component, with the next step's row changes."""
        rid = self._rid_of.pop(req_id, None)
        self._start_hint.pop(req_id, None)
        if rid is not None:
            self._row_estimate.pop(rid, None)
            del self._req_of[rid]
            del self._rid_at[self._at_of.pop(req_id)]
            self._changes.append((rid, None, 0))

    def _free_request(self, request: Request, delay_free_blocks: bool = False) -> Any:
        self._forget(request.request_id)
        if self._arrived and any(r is request for r in self._arrived):  # it leaves the queue before its admission
            self._rescan = True
        return super()._free_request(request, delay_free_blocks)  # type: ignore[misc]

    def _preempt_request(self, request: Request, timestamp: float, drop_stale_output: bool = False) -> None:
        # Recompute: the request starts over from the waiting queue and is admitted again there.
        super()._preempt_request(request, timestamp, drop_stale_output)  # type: ignore[misc]
        self._forget(request.request_id)
        self._rescan = True

    def _handle_stopped_request(self, request: Request) -> bool:
        finished = super()._handle_stopped_request(request)  # type: ignore[misc]
        if not finished:
            # A stream's turn ended: vLLM keeps the request waiting for its next
            # input, or extends its prompt with it now; it is admitted again from what it has
            # computed once it is waiting with tokens to run (a stream waiting for input is not
            # admissible, as vLLM skips it).
            self._forget(request.request_id)
            self._rescan = True
        return finished

    def _admit_waiting(self) -> None:
        """Admits waiting requests, in vLLM's order, while vLLM has slots to start them in, each
        with its prefix-cache hit as `cached` (vLLM looks it up again when it reaches the request,
        and a different answer makes the request be admitted again from there)."""
        free = self.max_num_active_reqs - len(self.running) - self.num_waiting_for_streaming_input  # type: ignore[attr-defined]
        if free <= 0:
            return
        waiting: Any = self.waiting  # type: ignore[attr-defined]
        holding = self._holding
        if holding is not None and holding:
            # vLLM starts the requests that hold KV blocks (a remote load finished, or under
            # way) before the rest of its queue: the order admission follows.
            waiting = _Queues(holding, waiting)
            self._rescan = True
        loras = None if self._max_loras is None else self._running_loras()
        if not self._rescan and loras is None:
            # Every request in the queue but the arrivals is admitted, in order: the arrivals
            # are left, behind them (most steps: one prompt, or none).
            arrived = self._arrived
            if not arrived:
                return
            pending, last = len(waiting) - len(arrived), self._next_rid - 1
            todo: Any = arrived
            fast = True
        else:
            # Over the requests admitted already in vLLM's order (their rids increasing) at the
            # front of the queue, done in C and by the requests' addresses (a request object is
            # not read: after vLLM's step they are mostly out of the CPU's caches).
            ahead = list(map(self._rid_at.get, map(id, islice(waiting, free)), repeat(0)))
            known = ahead.index(0) if 0 in ahead else len(ahead)  # rids start at 1
            front = ahead[:known]
            if known and front == sorted(front) and loras is None:  # increasing: one rid per request
                if known == len(ahead):
                    if known == len(waiting):
                        self._arrived, self._rescan = [], False
                    return
                pending, last = known, front[-1]
            else:
                known = pending = 0
                last = 0  # the latest admission ahead in vLLM's queue: the component plans in admission order
            todo = islice(waiting, known, None)
            fast = False
        self._arrived, self._rescan = [], False
        for i, request in enumerate(todo):
            if pending >= free:
                # The rest waits for slots: arrivals still behind every admitted request, or,
                # after a scan, anywhere in the queue.
                if fast:
                    self._arrived = todo[i:]
                else:
                    self._rescan = True
                    if self._by_priority:
                        self._forget_behind(request, todo)
                break
            req_id = request.request_id
            rid = self._rid_of.get(req_id)
            if loras is not None and self._admissible(request) and not self._lora_fits(request, loras):
                # Its adapter would be one more than vLLM runs at once: not admitted (forgotten,
                # were it admitted), and the requests behind it are looked at.
                if rid is not None:
                    self._forget(req_id)
                self._rescan = True
                continue
            if rid is not None:
                if rid > last:
                    last = rid
                    pending += 1
                    continue
                # vLLM put it behind a request admitted after it (a preempted request goes back to
                # the front of vLLM's queue): admitted again, so that the component plans the
                # waiting requests in vLLM's order. (vLLM 0.32 stops at the first waiting request
                # that gets no tokens, so a plan in another order would never run.)
                self.mstar_stats.readmitted += 1
                hint = self._start_hint.get(req_id)
                self._forget(req_id)
                if hint is not None:
                    self._start_hint[req_id] = hint
            if not self._admissible(request):
                # Not admitted (it may still be in the queue, or have left it already).
                self._rescan = True
                continue
            start = self._start_hint.pop(req_id, None)
            if start is None:
                start = request.num_computed_tokens
                if start == 0:
                    start = self._prefix_hit(request)
                elif start >= request.num_tokens:
                    # A remote load of the whole prompt: vLLM recomputes its last token.
                    start = request.num_tokens - 1
            rid = self._next_rid
            self._next_rid += 1
            # vLLM's token list itself (its `all_token_ids` is a read-only view the package would
            # convert element by element); the package copies it once, here.
            self._changes.append((rid, request._all_token_ids, start))
            self._rid_of[req_id] = rid
            self._req_of[rid] = req_id
            self._rid_at[id(request)] = rid
            self._at_of[req_id] = id(request)
            last = rid
            pending += 1

    def _admissible(self, request: Request) -> bool:
        """Whether vLLM can start the waiting request in the coming step: waiting or preempted, or
        waiting for its structured-output grammar with the grammar compiled (vLLM promotes it to
        waiting when its scan reaches it). A grammar still compiling, or one that failed (vLLM
        finishes the request with the compile error), is not admitted."""
        status = request.status
        if status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            # Its KV load finished: vLLM promotes it in this step's scan, from what was loaded.
            return request.request_id in self.finished_recving_kv_req_ids  # type: ignore[attr-defined]
        if status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR:
            so = request.structured_output_request
            grammar = so.grammar if so is not None else None
            return grammar is not None and not isinstance(grammar, Exception)
        return (status == RequestStatus.WAITING or status == RequestStatus.PREEMPTED) and (
            request.request_id not in self.grammar_compile_error_reqs  # type: ignore[attr-defined]
        )

    def _running_loras(self) -> set[int]:
        """The adapters of vLLM's running requests, as vLLM counts them against `max_loras`."""
        return {
            r.lora_request.lora_int_id
            for r in self.running  # type: ignore[attr-defined]
            if r.lora_request and r.lora_request.lora_int_id > 0
        }

    def _lora_fits(self, request: Request, loras: set[int]) -> bool:
        """Whether the request's adapter is one of `loras` or fits beside them (then it joins)."""
        lora = request.lora_request
        if lora is None or lora.lora_int_id <= 0 or lora.lora_int_id in loras:
            return True
        if len(loras) >= self._max_loras:  # type: ignore[operator]
            return False
        loras.add(lora.lora_int_id)
        return True

    def _forget_behind(self, first: Request, rest: Any) -> None:
        """Priority policy: a request admitted earlier that an arrival of higher priority pushed
        out of the first free slots of vLLM's queue (`first` and `rest`, the queue from there on)
        is forgotten until it is reached again, so that the component plans no request ahead of
        those vLLM would start first."""
        rid_of = self._rid_of
        for request in (first, *rest):
            if request.request_id in rid_of:
                self._forget(request.request_id)

    def _prefix_hit(self, request: Request) -> int:
        """The prefix-cache hit vLLM will find for a waiting request, looked up as vLLM does
        (vLLM 0.33 caps it at the auxiliary outputs the aux-output connector retains)."""
        aux = getattr(self, "aux_output_connector", None)
        if aux is not None and self._capped_hits:
            return self.kv_cache_manager.get_computed_blocks(request, aux.max_cache_hit(request))[1]  # type: ignore[attr-defined]
        return self.kv_cache_manager.get_computed_blocks(request)[1]  # type: ignore[attr-defined]

    # -- one step ---------------------------------------------------------------------------

    def _reserve_prefill_lookahead(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> int:
        # vLLM calls this for every request it considers, running and waiting, with the tokens it
        # would give it; the plan's tokens are what it gets, or nothing. (vLLM's own method only
        # acts with a multi-module MTP lookahead, refused at start.)
        plan = self._plan
        if plan is None:
            return num_new_tokens
        req_id = request.request_id
        tokens = plan.get(req_id)
        if tokens is not None:
            start = self._starts.get(req_id)
            if start is None:  # a continuing row: the token, and as many drafts as vLLM has
                return tokens if num_new_tokens >= tokens else num_new_tokens
            if start != num_computed_tokens:
                if num_computed_tokens > start and self.connector is not None and (  # type: ignore[attr-defined]
                    request.status != RequestStatus.RUNNING
                ):
                    # The KV connector's external hit, found in vLLM's scan (the plugin never
                    # asks the connector): vLLM's larger start is taken in this step, with at most
                    # the planned tokens; the request is admitted again from where it ends.
                    self._moved.append(req_id)
                    return tokens if num_new_tokens >= tokens else num_new_tokens
                self._observed[req_id] = num_computed_tokens
            elif num_new_tokens == tokens:
                return tokens
            elif num_new_tokens > tokens:
                if self._estimate > 1 and tokens == 1 and num_new_tokens == self._estimate and (
                    request.num_tokens - num_computed_tokens == 1
                ):
                    # vLLM pads a new decode row (a prompt's last token after a full cache hit,
                    # a resumed request) to 1 + k rows, placeholders for drafts: taken whole.
                    self._padded[req_id] = tokens
                    return num_new_tokens
                return tokens
        deferred = self._deferred
        if deferred is not None and request not in deferred:
            self._left_out.append(request)  # a running request too: never in the set, no harm
        return 0

    def _continues(self, prev: Optional[_Step]) -> list[int]:
        """The rids whose final chunk ran in `prev` and that vLLM still runs: they decode now."""
        out: list[int] = []
        if prev is None:
            return out
        ran = prev.ran
        for i, rid in prev.finals:
            req_id = prev.req_ids[i]
            if (ran is None or ran[i] == prev.plan[req_id]) and self._rid_of.get(req_id) == rid:
                request = self.requests.get(req_id)  # type: ignore[attr-defined]
                if request is not None and request.status == RequestStatus.RUNNING:
                    out.append(rid)
        return out

    def _draft_estimates(self, new: list[int]) -> list[tuple[int, int]]:
        """Speculative decoding: `(rid, estimate)` for the new decode rows (`new`) and for the
        decode rows whose drafts changed: 1 + the drafts vLLM will offer the row (vLLM's own
        count for a running request, at most 1 + k), so the plan charges what vLLM's scan will."""
        rows = self._row_estimate
        most = self._estimate
        for rid in new:
            rows[rid] = 0
        out = []
        requests = self.requests  # type: ignore[attr-defined]
        req_of = self._req_of
        for rid, was in rows.items():
            r = requests.get(req_of.get(rid))
            if r is None:
                continue
            n = r.num_tokens_with_spec + r.num_output_placeholders - r.num_computed_tokens
            estimate = 1 if n < 1 else (most if n > most else n)
            if estimate != was:
                rows[rid] = estimate
                out.append((rid, estimate))
        return out

    def _advance(self, prev: Optional[_Step], *, assemble: bool = True) -> Any:
        """Completes `prev` (the step before), applies the row changes since (decode rows of the
        prompts it finished, requests ended, prompts admitted), and assembles the next step, in one
        native call that answers it keyed by vLLM's request ids: `(batch, req_ids, plan, starts,
        final_rows)` (as `Batch.keyed`, with `final_rows` the `(row, rid)` of the final chunks).
        The first step, and the last one when the engine goes idle (nothing to assemble), make
        the calls one by one."""
        changes, self._changes = self._changes, []
        continues: list[Any] = self._continues(prev)
        if self._decoding:
            continues += self._decoding
            self._decoding = []
        if self._estimate > 1:
            continues = self._draft_estimates(continues)
        ms = None
        if prev is not None:
            prev.completed = True
            ms = prev.measured_ms
            if ms is None:
                self.mstar_stats.unmeasured_steps += 1
        cm = self.chunking
        if prev is not None and assemble:
            outcome, nxt = self._one_call(
                prev.step,
                prev.batch if prev.ran is None else prev.ran,
                ms,
                NODE,
                MIXED,
                DECODE,
                continues,
                PREFILL,
                changes,
                self._req_of,
                self._estimate,
            )
            self.mstar_stats.completed(outcome)
            if isinstance(nxt, BaseException):  # the completion stands; the assembly failed
                raise nxt
            return nxt
        if prev is not None:
            ran = prev.batch if prev.ran is None else prev.ran
            self.mstar_stats.completed(cm.complete(prev.step, ran, ms))
        for item in continues:
            rid, estimate = item if isinstance(item, tuple) else (item, self._estimate)
            cm.continue_row(rid, NODE, DECODE, estimate)
        for rid, tokens, cached in changes:
            if tokens is None:
                cm.forget_request(rid)
            else:
                cm.admit(rid, NODE, PREFILL, tokens, cached=cached)
        if not assemble:
            return None
        batch = cm.assemble(NODE, MIXED)
        req_ids, plan, starts, finals = batch.keyed(self._req_of)
        return batch, req_ids, plan, starts, [(i, self._rid_of[req_ids[i]]) for i in finals]

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        # The step before is completed here with what it was scheduled to run: under async
        # scheduling it is still running (its time comes later), otherwise its output came.
        prev, self._uncompleted = self._uncompleted, None
        self._admit_waiting()
        # The plan in bulk (no object per row): the rows' request ids, the tokens each is
        # planned and the chunks' starts, keyed by request id for the hook.
        batch, req_ids, plan, starts, final_rows = self._advance(prev)
        self._plan, self._starts, self._observed = plan, starts, {}
        deferred = self._deferred
        if deferred is not None:
            bound = self.prefill_capacity_bound  # type: ignore[has-type]
            self.prefill_capacity_bound = _BOUND[bool(bound)]
        try:
            out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        except BaseException:
            self._plan = None
            self.chunking.abandon(batch.step)
            if deferred is not None:
                self._undefer(deferred)
            raise
        self._plan = None
        if deferred is not None:
            self._undefer(deferred)
        scheduled = out.num_scheduled_tokens
        if self._padded:
            # A padded new decode row ran its planned token (the rest are vLLM's placeholders).
            scheduled = {**scheduled, **{r: t for r, t in self._padded.items() if r in scheduled}}
            self._padded.clear()
        moved = self._moved
        if moved:
            # Run from another start than planned: reported to the component as not run, and
            # admitted again from where vLLM now stands (below).
            scheduled = {r: t for r, t in scheduled.items() if r not in moved}
        # vLLM schedules a planned request's tokens whole or not at all (the hook answers the
        # plan's tokens or 0), and nothing the plan did not hold: checked in bulk. Every row ran
        # as planned (the common case) when vLLM scheduled exactly the plan's requests and its
        # tokens; then no list of what ran is made (the completion reads the batch).
        ran: Optional[list[int]] = None
        if scheduled != plan:
            ran = list(map(scheduled.get, req_ids, repeat(0)))
            unrun = ran.count(0)
            self.mstar_stats.handed_back += unrun
            planned = list(plan.values())  # in row order
            if len(scheduled) != len(req_ids) - unrun or sum(ran) != sum(p for p, n in zip(planned, ran) if n):
                self._scheduled_otherwise(req_ids, planned, ran, scheduled, len(req_ids) - len(starts))
            if self.connector is not None:  # type: ignore[attr-defined]
                self._forget_loading(req_ids, ran)
        rec = _Step(batch, req_ids, plan, len(starts), final_rows, ran)
        if self._async and self._estimate == 1:
            # (With drafts in flight vLLM cannot tell whether the step reaches the last token:
            # the request stays planned, and a decode row vLLM skips is handed back.)
            self._end_in_flight(rec)
        if moved:
            for req_id in moved:
                request = self.requests.get(req_id)  # type: ignore[attr-defined]
                self._forget(req_id)
                if request is not None and request.status == RequestStatus.RUNNING:
                    self._admit_running(request)
                else:
                    self._rescan = True
            moved.clear()
        for req_id, start in self._observed.items():
            # vLLM found another prefix-cache hit than at admission (or, with a KV connector, an
            # external hit, or a rewind): admitted again from there.
            self.mstar_stats.start_mismatches += 1
            self._forget(req_id)
            request = self.requests.get(req_id)  # type: ignore[attr-defined]
            if request is not None and request.status == RequestStatus.RUNNING:
                self._admit_running(request)
                continue
            self._start_hint[req_id] = start
            self._rescan = True
        self.mstar_stats.steps += 1
        rec.returned_at = self.clock()
        self._uncompleted = rec
        self._in_flight.append((out, rec))
        return out

    def _forget_loading(self, req_ids: list[str], ran: list[int]) -> None:
        """KV transfer: a planned request that vLLM's scan sent to load its KV from elsewhere
        (`WAITING_FOR_REMOTE_KVS`) is forgotten until the load is done (then admitted again,
        from what was loaded)."""
        requests = self.requests  # type: ignore[attr-defined]
        for req_id, n in zip(req_ids, ran):
            if not n:
                r = requests.get(req_id)
                if r is not None and r.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                    self._forget(req_id)
                    self._rescan = True

    def _update_requests_with_invalid_blocks(self, requests: Any, *args: Any, **kwargs: Any) -> Any:
        # A KV load that failed: vLLM rewinds the affected requests to their valid prefix. A
        # running one (a synchronous load) is forgotten and admitted again from there; a waiting
        # one is admitted when its load is promoted.
        out = super()._update_requests_with_invalid_blocks(requests, *args, **kwargs)  # type: ignore[misc]
        for req_id in out[0]:
            r = self.requests.get(req_id)  # type: ignore[attr-defined]
            if r is not None and req_id in self._rid_of:
                self._forget(req_id)
                if r.status == RequestStatus.RUNNING:
                    self._admit_running(r)
                else:
                    self._rescan = True
        return out

    def _admit_running(self, request: Request) -> None:
        """Admits a running request again from where vLLM now stands (after a rewind, or a step
        run from another start than planned): as a prompt when it has tokens left to compute,
        else as a decode row (its prompt done, it samples next): vLLM's running queue is not
        scanned."""
        req_id = request.request_id
        rid = self._next_rid
        self._next_rid += 1
        if request.num_computed_tokens >= request.num_tokens:
            self._decoding.append(rid)
        else:
            self._changes.append((rid, request._all_token_ids, request.num_computed_tokens))
        self._rid_of[req_id] = rid
        self._req_of[rid] = req_id
        self._rid_at[id(request)] = rid
        self._at_of[req_id] = id(request)

    def _undefer(self, deferred: set) -> None:
        """After vLLM 0.33's scan: the waiting requests the plan alone gave no tokens are taken
        out of `deferred_waiting` again (vLLM's own scheduler would have scheduled them, or
        stopped before them with its budget spent: either way not deferred), and on a step that
        admitted prefills the throttle's escape is recomputed as vLLM computes it, so that a
        backlog left by the plan counts as one. The flag is restored if the step left it."""
        bound = self.prefill_capacity_bound  # type: ignore[has-type]
        left_out = self._left_out
        if left_out:
            deferred.difference_update(left_out)
            left_out.clear()
            if not isinstance(bound, _Bound):  # vLLM assigned it: a release step
                self.prefill_capacity_bound = self.get_request_counts()[1] > len(deferred)  # type: ignore[attr-defined]
                return
        if isinstance(bound, _Bound):
            self.prefill_capacity_bound = bound.value

    @staticmethod
    def _scheduled_otherwise(
        req_ids: list[str], planned: list[int], ran: list[int], scheduled: dict, continuing: int
    ) -> None:
        """Raises naming what vLLM scheduled other than planned. A continuing row (the first
        `continuing` rows) may run fewer tokens than planned (fewer drafts than the most)."""
        for i, (req_id, tokens, n) in enumerate(zip(req_ids, planned, ran)):
            if n not in (0, tokens) and not (i < continuing and 0 < n < tokens):
                raise RuntimeError(f"vLLM scheduled {n} tokens of request {req_id!r}, planned {tokens}")
        extra = sorted(set(scheduled) - set(req_ids))
        if extra:
            raise RuntimeError(f"vLLM scheduled requests the plan did not hold: {extra}")

    def _end_in_flight(self, rec: _Step) -> None:
        """Async: a request whose last token (its `max_tokens`-th, or the one reaching
        `max_model_len`) is in the step just scheduled is never scheduled again (vLLM skips it
        until that step's output finishes it), so it is forgotten now rather than planned a
        decode row in the next step that vLLM would hand back."""
        requests = self.requests  # type: ignore[attr-defined]
        max_len = self.max_model_len  # type: ignore[attr-defined]
        ran = rec.ran
        decoding = len(rec.req_ids) - rec.chunks  # the continuing rows, then the final chunks
        for i in [*range(decoding), *(i for i, _ in rec.finals)]:
            if ran is None or ran[i]:
                req_id = rec.req_ids[i]
                r = requests[req_id]
                produced = r.num_output_tokens + r.num_output_placeholders
                if produced >= r.max_tokens or r.num_prompt_tokens + produced >= max_len:
                    self.mstar_stats.ended_in_flight += 1
                    self._forget(req_id)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        now = self.clock()
        in_flight = self._in_flight
        if not in_flight or in_flight[0][0] is not scheduler_output:
            if not any(out is scheduler_output for out, _ in in_flight):
                if not scheduler_output.total_num_scheduled_tokens:
                    # An output that ran nothing, built by the caller (it carries a connector's
                    # finished transfers, say): vLLM's alone, no step of the component's.
                    return super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
                raise RuntimeError("update_from_output for a step this scheduler did not schedule")
            # Outputs of earlier steps never passed on (vLLM's engine passes every one, in
            # order; a caller may drop some): those steps were completed when the next was
            # scheduled, and their times are unknown.
            while in_flight[0][0] is not scheduler_output:
                in_flight.popleft()
                self.mstar_stats.dropped_outputs += 1
        _, rec = in_flight.popleft()
        result = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        # The step ran from when its schedule() returned, or from when the step before it
        # finished if that was later (async: it was queued behind that step), until now.
        ms = (now - max(rec.returned_at, self._last_update)) * 1e3
        self._last_update = now
        self.mstar_stats.measured_ms.append(ms)
        if not rec.completed:
            rec.measured_ms = ms
        else:
            # Completed when the next step was scheduled (async): its time goes to the fit, the
            # margin and the time budget check now. A node that reads no time keeps no step.
            try:
                self.mstar_stats.late_outcomes.append(self.chunking.measured(rec.step, ms))
                self.mstar_stats.late_measured += 1
            except ChunkingError:
                pass
        if not self._in_flight and not self.requests:  # type: ignore[attr-defined]
            # Idle: vLLM's `requests` holds every request it has not finished.
            self._settle()
        return result

    def _settle(self) -> None:
        """Idle: completes the last step and applies the changes now, so nothing stays held."""
        prev, self._uncompleted = self._uncompleted, None
        self._advance(prev, assemble=False)

    def shutdown(self) -> None:
        try:
            super().shutdown()  # type: ignore[misc]
        finally:
            try:
                if not self._in_flight:
                    self._settle()
            finally:
                self.chunking.close()


class Scheduler(_Chunking, _VllmScheduler):
    """The dotted path for `--scheduler-cls`. Over vLLM's `Scheduler` when async scheduling is
    off; with it on, constructing `Scheduler` makes an `AsyncScheduler` (its subclass), and a
    subclass of `Scheduler` gets its own variant over vLLM's `AsyncScheduler` the same way."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if _vllm_config_of(args, kwargs).scheduler_config.async_scheduling and not issubclass(cls, _VllmAsyncScheduler):
            cls = _async_variant(cls)
        return object.__new__(cls)


class AsyncScheduler(Scheduler, _VllmAsyncScheduler):
    """Over vLLM's `AsyncScheduler`: step N+1 is scheduled before step N's output arrives."""


_async_variants: dict[type, type] = {Scheduler: AsyncScheduler}


def _async_variant(cls: type) -> type:
    """A subclass of `Scheduler` over vLLM's `AsyncScheduler` (made once per class)."""
    variant = _async_variants.get(cls)
    if variant is None:
        variant = type(cls.__name__ + "Async", (cls, AsyncScheduler), {"__module__": cls.__module__})
        _async_variants[cls] = variant
    return variant
