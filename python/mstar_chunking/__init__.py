"""mstar_chunking: chunked prefill's state on the engine, with the API of
``mstar.engine.chunking``, run by the Rust crate ``mstar-chunking``.

Per (node, walk): the model's chunking policy and the token budget a step runs under, after the
serving config's overrides. Per row mid-prefill: its whole prepared input, which every chunk is
cut from. And the count of steps that ran over their budget, for the warning.

Every method blocks until the actors (on a thread of their own) answer, with the GIL released;
one ``ChunkingManagement`` may be used from several threads at once. From ``asyncio``, run the
calls in an executor: ``await loop.run_in_executor(None, cm.assemble, "llm", "mixed")``.

Importing the package installs the process's metrics recorder (before any manager starts, so
every series is exported from its start): ``serve_metrics(addr)`` serves it, ``render_metrics()``
renders it for an engine's own ``/metrics``.
"""

from __future__ import annotations

from collections.abc import Mapping as _Mapping
import os
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence, Tuple, Union

from . import _native
from ._errors import (
    ActorsStoppedError,
    ChunkingError,
    ChunkingTimeoutError,
    ConfigError,
    ConflictError,
    InvalidRequestError,
    RefusedSettingsError,
    TimeSettingsError,
    TransientError,
)
from ._types import (
    NO_CHUNKING,
    ChunkingPolicy,
    ChunkRange,
    LatencyModel,
    LatencyModelState,
    OnlineFit,
    Overrun,
    SubmoduleCaps,
)

__all__ = [
    "ChunkRange",
    "ChunkingManagement",
    "ChunkingPolicy",
    "NO_CHUNKING",
    "DEFAULT_MIN_CHUNK_TOKENS",
    "DEFAULT_REQUEST_TIMEOUT",
    "SubmoduleCaps",
    "Overrun",
    "Batch",
    "Row",
    "Tokens",
    "StepOutcome",
    "NextStep",
    "Completed",
    "PreparedInputs",
    "LatencyModel",
    "LatencyModelState",
    "OnlineFit",
    "serve_metrics",
    "render_metrics",
    "preset_cost",
    "preset_names",
    "ChunkingError",
    "InvalidRequestError",
    "RefusedSettingsError",
    "TimeSettingsError",
    "ConfigError",
    "ConflictError",
    "TransientError",
    "ChunkingTimeoutError",
    "ActorsStoppedError",
]

DEFAULT_MIN_CHUNK_TOKENS: int = _native.DEFAULT_MIN_CHUNK_TOKENS
"""``min_chunk_tokens`` when the serving config sets none (64)."""

DEFAULT_REQUEST_TIMEOUT: float = _native.DEFAULT_REQUEST_TIMEOUT_S
"""Seconds a call waits for the actors before raising ``ChunkingTimeoutError`` (5)."""

Batch = _native.Batch
Row = _native.Row
Tokens = _native.Tokens
StepOutcome = _native.StepOutcome
NextStep = _native.NextStep
Completed = _native.Completed
serve_metrics = _native.serve_metrics
render_metrics = _native.render_metrics
preset_names = _native.preset_names


def preset_cost(name: str) -> LatencyModel:
    """The latency model preset ``name`` (one of ``preset_names()``), as ``cost=name`` uses it."""
    m = _native.preset_cost(name)
    assert isinstance(m, LatencyModel)
    return m


_U32_MAX = 2**32 - 1
_U64_MAX = 2**64 - 1


def _refuse(key: str, what: str) -> RefusedSettingsError:
    e = RefusedSettingsError(f"refused budgets: {key} {what}")
    e.problems = [f"{key} {what}"]
    return e


def _refuse_time(argument: str, node: Optional[str], walk: Optional[str], key: str, what: str) -> TimeSettingsError:
    e = TimeSettingsError(f"refused budgets: {key} {what}")
    e.problems = [f"{key} {what}"]
    e.argument, e.node, e.walk = argument, node, walk
    e.refusals = [(argument, node, walk)]
    return e


def _refuse_arg(argument: str, node: Optional[str], key: str, what: str) -> RefusedSettingsError:
    """A ``RefusedSettingsError`` naming ``argument`` (and ``node``) as the core's refusals do."""
    e = _refuse(key, what)
    e.argument, e.node, e.walk = argument, node, None
    e.refusals = [(argument, node, None)]
    return e


_ORDERS = ("fcfs", "priority", "shortest_first", "longest_prefix")
"""The orders of waiting prompts ``set_budgets(order=...)`` takes (``chunking.order``)."""


def _order(value: Any) -> Tuple[Optional[str], list]:
    """``order=``: ``None`` (``fcfs``), one name for every node, or a mapping node -> name. The
    names are checked by the core's parser, which lists the known ones."""
    if value is None:
        return None, []
    if isinstance(value, str):
        return value, []
    if isinstance(value, _Mapping):
        per_node = []
        for node, name in value.items():
            if not isinstance(node, str):
                raise _refuse_arg("order", None, "order", f"is keyed by node name (str), got {node!r}")
            if not isinstance(name, str):
                raise _refuse_arg(
                    "order", node, f"order[{node!r}]", f"must be an order's name ({', '.join(_ORDERS)}), got {name!r}"
                )
            per_node.append((node, name))
        return None, per_node
    raise _refuse_arg(
        "order", None, "order", f"must be an order's name ({', '.join(_ORDERS)}) or a mapping node -> name, got {value!r}"
    )


def _count(value: Any, key: str, *, allow_zero: bool = True) -> int:
    """``value`` as a u32 count, or a ``RefusedSettingsError`` naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _refuse(key, f"must be a whole number of tokens, got {value!r}")
    if value < (0 if allow_zero else 1) or value > _U32_MAX:
        least = "0" if allow_zero else "1"
        raise _refuse(key, f"must be between {least} and {_U32_MAX}, got {value}")
    return value


def _budget(value: Any, key: str) -> Optional[int]:
    """A budget override: ``None`` (chunking off) or a positive token count
    (``docs/budgets.md#not-a-positive-whole-number``)."""
    if value is None:
        return None
    return _count(value, key, allow_zero=False)


def _number(value: Any) -> Optional[float]:
    """``value`` as a float if it is a real number (not a bool), else ``None``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:
        return float("inf")


def _ms(value: Any, node: str, walk: Optional[str], key: str) -> Optional[float]:
    """A time budget: ``None`` (off) or a number of ms, which the core checks (finite, > 0)."""
    if value is None:
        return None
    ms = _number(value)
    if ms is None:
        raise _refuse_time("max_step_ms", node, walk, key, f"must be a number of milliseconds or None, got {value!r}")
    return ms


_COST_SPELLING = "a preset's name (see preset_names()) or (base_ms, per_token_ms, per_kv_token_ms, per_attention_pair_ms[, per_row_ms])"


def _cost(value: Any, node: str, key: str) -> Union[str, Tuple[float, ...]]:
    """A latency model: a preset's name, or four coefficients, or five with ``per_row_ms``
    (checked by the core)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (tuple, list)) and len(value) in (4, 5):
        c = [_number(x) for x in value]
        if all(x is not None for x in c):
            return tuple(c)  # type: ignore[arg-type]
    raise _refuse_time("cost", node, None, key, f"must be {_COST_SPELLING}, got {value!r}")


def _time_floor(value: Any) -> str:
    """``time_floor``: ``"yield"`` or ``"run"`` (the core names anything else)."""
    if not isinstance(value, str):
        raise _refuse_time("time_floor", None, None, "time_floor", f'must be "yield" or "run", got {value!r}')
    return value


def _names(value: Any, key: str) -> list:
    if isinstance(value, str):
        raise TypeError(f"{key} is a collection of names, not one string: {value!r}")
    out = list(value)
    for v in out:
        if not isinstance(v, str):
            raise TypeError(f"{key} holds names (str), got {v!r}")
    return out


class PreparedInputs(_Mapping):
    """``cm.prepared``: a read-only mapping ``(rid, node) -> memoryview`` of every whole prepared
    input held now (format ``I``, no copy). Each access asks the actors."""

    __slots__ = ("_engine",)

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def __getitem__(self, key: Tuple[int, str]) -> memoryview:
        try:
            rid, node = key
        except (TypeError, ValueError):
            raise KeyError(key) from None
        if not isinstance(rid, int) or not isinstance(node, str) or not 0 <= rid <= _U64_MAX:
            raise KeyError(key)
        tokens = self._engine.prepared(rid, node)
        if tokens is None:
            raise KeyError(key)
        return memoryview(tokens)

    def __iter__(self) -> Iterator[Tuple[int, str]]:
        return iter(self._engine.prepared_keys())

    def __len__(self) -> int:
        return self._engine.prepared_totals()[0]

    def tokens(self) -> int:
        """Tokens held over every node."""
        return self._engine.prepared_totals()[1]

    def __repr__(self) -> str:
        return f"PreparedInputs({dict.fromkeys(self, '...')!r})"


_NATIVE_STEP_API = (
    "assemble",
    "complete",
    "complete_and_assemble",
    "abandon",
    "admit",
    "continue_row",
    "forget_request",
    "release",
    "queue_stats",
    "overrun_count",
)


class ChunkingManagement:
    """One model's chunking state on the engine (its actors run on a thread of their own).

    ``submodules`` maps node names to ``SubmoduleCaps`` or any object with
    ``chunkable_walks`` and ``can_override_mixed_max_tokens``. ``model`` labels the metric
    series; ``timeout`` is how many seconds a call waits for the actors (``None``: no limit).
    ``ChunkingManagement.from_config(...)`` starts one from the component's config files.

    With ``caller_thread=True`` the actors run on the thread that made the manager instead,
    each call running them until its answer is there (the GIL held, nothing running between
    two calls): no thread is woken per call, which is what a call costs most on a loaded
    machine. Every call must then come from that thread (from another one it raises
    ``ChunkingError``; ``close()`` from another does nothing). For an engine that drives its
    steps from one thread, as vLLM's scheduler does.

    In a process forked from the one that started it, every call raises
    ``ActorsStoppedError`` at once (the actors' thread is not in the child) and ``close()`` or
    dropping it does nothing: make a new one in the child.
    """

    def __init__(
        self,
        submodules: Mapping[str, Any],
        *,
        model: str = "mstar_chunking",
        timeout: Optional[float] = DEFAULT_REQUEST_TIMEOUT,
        caller_thread: bool = False,
    ) -> None:
        caps = []
        for node, sub in submodules.items():
            if not isinstance(node, str):
                raise TypeError(f"submodules are keyed by node name (str), got {node!r}")
            try:
                walks = sub.chunkable_walks
            except AttributeError:
                raise TypeError(
                    f"submodule of node `{node}` has no `chunkable_walks` (a SubmoduleCaps, or an object with "
                    "`chunkable_walks` and `can_override_mixed_max_tokens`)"
                ) from None
            flag = getattr(sub, "can_override_mixed_max_tokens", False)
            caps.append((node, _names(walks, f"submodules[{node!r}].chunkable_walks"), bool(flag)))
        if not isinstance(model, str):
            raise TypeError(f"model is the metric series' label (str), got {model!r}")
        self._attach(_native.Engine(model, caps, timeout, bool(caller_thread)), [c[0] for c in caps], {})

    @classmethod
    def from_config(
        cls,
        paths: Iterable[Union[str, os.PathLike[str]]] = (),
        *,
        model: Optional[str] = None,
        manifest: Optional[Union[str, os.PathLike[str]]] = None,
        timeout: Optional[float] = DEFAULT_REQUEST_TIMEOUT,
        caller_thread: bool = False,
    ) -> "ChunkingManagement":
        """Starts a manager configured as the ``mstar-chunking`` binary is: the model manifest
        ``manifest`` (as ``--model FILE``; default ``config/models/demo.toml``, else the built-in
        demo), the layered serving config (``config/default.toml``, ``config/$MSTAR_ENV.toml``,
        each of ``paths`` as ``--config FILE``, then ``MSTAR__SECTION__KEY`` variables), the
        model's policies and the config's ``[chunking]`` applied. ``model`` labels the metric
        series (default: the manifest's name); ``caller_thread`` as for the constructor.
        ``cm.config`` tells what was loaded.

        Raises ``ConfigError`` naming each problem's key and layer.
        """
        if isinstance(paths, (str, bytes)):
            raise TypeError(f"paths is a collection of config files, not one path: {paths!r}")
        files = [os.fspath(p) for p in paths]
        where = None if manifest is None else os.fspath(manifest)
        engine, info = _native.Engine.from_config(files, model, where, timeout, bool(caller_thread))
        self = cls.__new__(cls)
        self._attach(engine, list(info["nodes"]), info)
        if info["warnings"]:
            import logging

            for w in info["warnings"]:
                logging.getLogger("mstar_chunking").warning("%s", w)
        return self

    def _attach(self, engine: Any, nodes: list, config: dict) -> None:
        self._engine = engine
        self._nodes = nodes
        self._config = config
        self._prepared = PreparedInputs(engine)
        # The step API goes straight to the native methods (no Python frame per call); the
        # methods of the class below document them and call the same. A subclass that
        # overrides one keeps its override.
        for name in _NATIVE_STEP_API:
            if getattr(type(self), name) is getattr(ChunkingManagement, name):
                setattr(self, name, getattr(engine, name))

    @property
    def config(self) -> dict:
        """What ``from_config`` loaded: ``model``, ``manifest``, ``layers`` (in order),
        ``warnings``, ``walks``, ``combined_walk``, ``slots_per_row`` and ``metrics_listen`` (the config's
        ``metrics.listen``, for ``serve_metrics``; ``None`` when ``"off"``). Empty for a
        manager made by the constructor."""
        return dict(self._config)

    @property
    def model(self) -> str:
        """The ``model`` label of this manager's metric series."""
        return self._engine.model

    # The documented API.

    def set_policies(self, policies: Mapping[Tuple[str, str], ChunkingPolicy]) -> None:
        """The model's ``chunking_policy_of()``, bound at load.

        Separate from ``set_budgets``: the policy is the model's and fixed, the budget is the
        deployment's and layered on top.
        """
        flat = []
        for key, p in policies.items():
            try:
                node, walk = key
            except (TypeError, ValueError):
                raise TypeError(f"policies are keyed by (node, walk), got {key!r}") from None
            where = f"policies[({node!r}, {walk!r})]"
            budget = p.max_batch_tokens
            flat.append(
                (
                    node,
                    walk,
                    None if budget is None else _count(budget, f"{where}.max_batch_tokens"),
                    _count(p.align, f"{where}.align"),
                )
            )
        self._engine.set_policies(flat)

    def set_budgets(
        self,
        overrides: Mapping[str, Union[int, None, Mapping[str, Optional[int]]]],
        walks: Iterable[str],
        combined_walk_of: Optional[Mapping[str, str]] = None,
        override_mixed: Iterable[str] = (),
        no_chunking: Iterable[str] = (),
        min_chunk_tokens: int = DEFAULT_MIN_CHUNK_TOKENS,
        *,
        max_row_tokens: Optional[int] = None,
        max_partial_prefills: Optional[int] = None,
        slots_per_row: int = 0,
        max_step_ms: Union[float, None, Mapping[str, Union[float, None, Mapping[str, Optional[float]]]]] = None,
        cost: Union[str, Sequence[float], None, Mapping[str, Union[str, Sequence[float]]]] = None,
        learn_cost: bool = False,
        time_margin: Optional[float] = None,
        order: Union[str, None, Mapping[str, str]] = None,
        max_wait_ms: Optional[float] = None,
        max_wait_steps: Optional[int] = None,
        time_floor: str = "yield",
    ) -> None:
        """Apply a serving config's ``max_batch_tokens`` and ``min_chunk_tokens`` to this
        engine's nodes, over the budgets ``set_policies`` declared (so it runs after it).

        Per node, one budget for every walk the model budgets, or a mapping walk -> budget;
        ``None`` turns chunking off. ``override_mixed`` names the nodes whose submodule caps
        member walks inside a combined walk (their ``can_override_mixed_max_tokens``): there a
        member walk's own budget (``{"llm": {"prefill": 512}}``) caps that walk's rows in a
        ``mixed`` step. Settings are checked whole: on ``RefusedSettingsError`` nothing
        changed. ``max_row_tokens`` and ``max_partial_prefills`` are this package's additions
        (the Rust crate's planner limits). ``slots_per_row``: input slots the engine adds to
        every row it schedules (a speculative drafter's), charged to the token budget beside
        the row's tokens; refused at or above a step's budget.

        Time budgets (``docs/cost-model.md``), keywords only: ``max_step_ms`` is one time
        budget in ms for every node, or per node one value or a mapping walk -> ms (``None``:
        off); each step's predicted time stays within it. A node with a time budget needs a
        latency model: ``cost`` (a preset's name, ``(base_ms, per_token_ms, per_kv_token_ms,
        per_attention_pair_ms[, per_row_ms])``, one for every node or a mapping node -> model),
        or ``learn_cost=True`` (fitted from the ``measured_ms`` steps report). ``time_margin``, a
        quantile in (0, 1], plans against the budget divided by that quantile of recent
        measured / predicted ratios. ``time_floor``: when even a floor chunk of the first
        waiting prompt does not fit beside the step's continuing rows, ``"yield"`` (the default)
        runs them alone and the prompt waits up to ``max_wait_ms`` / ``max_wait_steps`` (100
        steps when neither is given), ``"run"`` runs the floor at once. Refusals (a budget not finite or below the model's
        ``base_ms``, an all-zero model, a margin without a time budget, ...) raise
        ``TimeSettingsError`` naming the argument, node and walk.

        The order of waiting prompts (``docs/scheduling.md``), keywords only: ``order`` is one of
        ``fcfs`` (the default), ``priority`` (``admit(..., priority=)``, lower first),
        ``shortest_first`` or ``longest_prefix``, for every node or as a mapping node -> name.
        Mid-prefill rows keep their place first under every order. ``max_wait_ms`` (measured
        from ``admit(..., arrival_ms=)`` to the step's ``at_ms``) and ``max_wait_steps`` (the
        node's planned steps since admission) bound the wait: a prompt that waited that long
        goes first, oldest first. An unknown order, an order for an unknown node, a
        ``max_wait_ms`` that is not a finite number above 0 or a ``max_wait_steps`` below 1 raise
        ``RefusedSettingsError`` naming the argument (and node).
        """
        node_wide, per_walk = [], []
        for node, value in overrides.items():
            if isinstance(value, _Mapping):
                per_walk.append(
                    (
                        node,
                        [(walk, _budget(b, f"overrides[{node!r}][{walk!r}]")) for walk, b in value.items()],
                    )
                )
            else:
                node_wide.append((node, _budget(value, f"overrides[{node!r}]")))
        time_wide, time_per_walk = [], []
        if isinstance(max_step_ms, _Mapping):
            for node, value in max_step_ms.items():
                if isinstance(value, _Mapping):
                    time_per_walk.append(
                        (
                            node,
                            [
                                (walk, _ms(v, node, walk, f"max_step_ms[{node!r}][{walk!r}]"))
                                for walk, v in value.items()
                            ],
                        )
                    )
                else:
                    time_wide.append((node, _ms(value, node, None, f"max_step_ms[{node!r}]")))
        elif max_step_ms is not None:
            for node in self._all_nodes():
                time_wide.append((node, _ms(max_step_ms, node, None, "max_step_ms")))
        costs = []
        if isinstance(cost, _Mapping):
            costs = [(node, _cost(c, node, f"cost[{node!r}]")) for node, c in cost.items()]
        elif cost is not None:
            costs = [(node, _cost(cost, node, "cost")) for node in self._all_nodes()]
        if not isinstance(learn_cost, bool):
            raise _refuse_time("learn_cost", None, None, "learn_cost", f"must be True or False, got {learn_cost!r}")
        margin = None
        if time_margin is not None:
            margin = _number(time_margin)
            if margin is None:
                raise _refuse_time(
                    "time_margin", None, None, "time_margin", f"must be a number in (0, 1] or None, got {time_margin!r}"
                )
        order_all, order_per_node = _order(order)
        wait_ms = None
        if max_wait_ms is not None:
            wait_ms = _number(max_wait_ms)
            if wait_ms is None:
                raise _refuse_arg(
                    "max_wait_ms", None, "max_wait_ms", f"must be a number of milliseconds above 0 or None, got {max_wait_ms!r}"
                )
        if max_wait_steps is not None and (
            isinstance(max_wait_steps, bool) or not isinstance(max_wait_steps, int) or not 0 <= max_wait_steps <= _U64_MAX
        ):
            raise _refuse_arg(
                "max_wait_steps", None, "max_wait_steps", f"must be a whole number of steps of at least 1 or None, got {max_wait_steps!r}"
            )
        combined = list((combined_walk_of or {}).items())
        self._engine.set_budgets(
            walks=_names(walks, "walks"),
            node_wide=node_wide,
            per_walk=per_walk,
            combined_walk_of=combined,
            override_mixed=_names(override_mixed, "override_mixed"),
            no_chunking=_names(no_chunking, "no_chunking"),
            min_chunk_tokens=_count(min_chunk_tokens, "min_chunk_tokens"),
            max_row_tokens=None if max_row_tokens is None else _count(max_row_tokens, "max_row_tokens"),
            max_partial_prefills=(
                None if max_partial_prefills is None else _count(max_partial_prefills, "max_partial_prefills")
            ),
            slots_per_row=_count(slots_per_row, "slots_per_row"),
            max_step_ms=time_wide,
            max_step_ms_per_walk=time_per_walk,
            cost=costs,
            learn_cost=learn_cost,
            time_margin=margin,
            order=order_all,
            order_per_node=order_per_node,
            max_wait_ms=wait_ms,
            max_wait_steps=max_wait_steps,
            time_floor=_time_floor(time_floor),
        )

    def _all_nodes(self) -> list:
        return list(self._nodes)

    def policy(self, node_name: str, graph_walk: str) -> ChunkingPolicy:
        """The model's, or ``NO_CHUNKING`` where it declares none."""
        budget, align = self._engine.policy(node_name, graph_walk)
        if budget is None and align == 1:
            return NO_CHUNKING
        return ChunkingPolicy(budget, align)

    def chunkable(self, node_name: str, graph_walk: str) -> bool:
        """The submodule's say, unless the serving config turned the walk's chunking off (a
        null budget) or the worker chunks nothing on the node."""
        return self._engine.chunkable(node_name, graph_walk)

    def max_batch_tokens(self, node_name: str, graph_walk: str) -> Optional[int]:
        """The walk's budget, unless the serving config overrides it or the worker chunks
        nothing on the node."""
        return self._engine.max_batch_tokens(node_name, graph_walk)

    def min_chunk_tokens(self, budget: int) -> int:
        """The fewest tokens the scheduler cuts a row to under ``budget``, or the whole budget
        when that is smaller."""
        if isinstance(budget, bool) or not isinstance(budget, int) or not 0 <= budget <= _U32_MAX:
            raise InvalidRequestError(
                f"budget must be a whole number of tokens between 0 and {_U32_MAX}, got {budget!r}"
            )
        return self._engine.min_chunk_tokens(budget)

    def walk_caps(self, node_name: str, graph_walk: str) -> Optional[dict]:
        """Under a combined walk on a node with ``can_override_mixed_max_tokens``: walk -> the
        most tokens that walk's rows may run in one step, for the walks with a budget of their
        own. ``None`` otherwise."""
        return self._engine.walk_caps(node_name, graph_walk)

    def measured(self, step: int, measured_ms: float) -> dict[str, Any]:
        """Report the measured time of ``step``, completed before its time was known (an engine
        that schedules step N+1 before step N's output, as asynchronous scheduling does): the
        time budget check, the online fit and the time margin read it then. Kept for the latest
        16 steps completed without a time on nodes that learn or plan with a margin, once each.
        Returns ``step``, ``node``, ``walk``, ``measured_ms``, ``predicted_ms``, ``max_step_ms``,
        ``time_overrun`` (a reason or None) and ``time_margin``."""
        return self._engine.measured(step, measured_ms)

    def latency_model(self, node_name: str) -> LatencyModelState:
        """The latency model ``node_name`` plans its time budgets with: the model in force, where
        it came from (``online``, ``config`` or ``none``), the configured one, whether the node
        learns, the online fit's estimate (coefficients, samples, error, trusted), and how many of
        its steps were planned without their time budget and why the latest was."""
        return self._engine.latency_model(node_name)

    @property
    def prepared(self) -> PreparedInputs:
        """Every whole prepared input held, ``(rid, node) -> memoryview`` (read-only)."""
        return self._prepared

    def release(self, rid: int, node_name: str) -> bool:  # type: ignore[no-redef]
        """Drop a row's whole input (and its row) at ``node_name`` once its last chunk lands.
        Answers whether an input was held; unknown rows are a no-op."""
        return self._engine.release(rid, node_name)

    def forget_request(self, rid: int) -> None:  # type: ignore[no-redef]
        """End a request, finished or aborted: its rows and inputs on every node are dropped."""
        self._engine.forget_request(rid)

    def check_budget(self, batch: Batch, node_inputs: Sequence[Any]) -> Optional[Overrun]:
        """Warn when a step runs over the budget it was scheduled under: that of the combined
        walk it ran in, if any. Logged on the 1st, 2nd, 4th, ... overrun per walk.

        ``node_inputs`` has one entry per row of ``batch``: the tokens the row ran (an int), or
        the input it ran (anything with a ``len()``). Answers the overrun, if any. ``complete``
        checks its step itself; call this for steps run outside the scheduler.
        """
        ran = [x if isinstance(x, int) else len(x) for x in node_inputs]
        return self._engine.check_budget(batch, ran)

    # The step API (each instance calls the native methods directly; these document them).

    def admit(  # type: ignore[no-redef]
        self,
        rid: int,
        node_name: str,
        graph_walk: str,
        tokens: Any,
        cached: int = 0,
        *,
        priority: int = 0,
        arrival_ms: Optional[float] = None,
    ) -> None:
        """Hold a prompt's whole prepared input and queue its row at ``node_name`` for
        ``graph_walk``; ``cached`` tokens of it are a cached prefix (clamped to leave the last
        token to run). ``tokens`` are token ids: a buffer of ``uint32`` (``array('I')``, a numpy
        ``uint32`` array, either byte order), a list, a range, another integer buffer; text is
        refused (tokenize it first). The ids are copied once, here.

        ``priority`` (a 32-bit int, lower first) orders the prompt on a node whose order is
        ``priority``; on another node it is kept but orders nothing, and the first such
        admission per node raises a ``RuntimeWarning``. ``arrival_ms``, in ms on the engine's
        clock (any origin; the steps' ``at_ms`` on the same), starts its wait for
        ``max_wait_ms``."""
        self._engine.admit(rid, node_name, graph_walk, tokens, cached, priority=priority, arrival_ms=arrival_ms)

    def continue_row(  # type: ignore[no-redef]
        self, rid: int, node_name: str, graph_walk: str, estimate: int = 1, context: Optional[int] = None
    ) -> None:
        """Queue a continuing row (decode, speculative verify) that runs ``estimate`` tokens in
        every step until ``forget_request`` or ``release``; ``context`` (its prompt and the
        tokens generated so far) lets a time budget predict its KV and attention terms."""
        self._engine.continue_row(rid, node_name, graph_walk, estimate, context)

    def assemble(  # type: ignore[no-redef]
        self, node_name: str, graph_walk: str, *, at_ms: Optional[float] = None
    ) -> Batch:
        """Plan the node's next step; while it is in flight, the same batch is answered again.
        ``at_ms`` is the step's time on the engine's clock (that of ``admit``'s
        ``arrival_ms``), which ``max_wait_ms`` measures prompts' waits to."""
        return self._engine.assemble(node_name, graph_walk, at_ms=at_ms)

    def complete(  # type: ignore[no-redef]
        self, step: int, ran: Union[Sequence[int], Batch], measured_ms: Optional[float] = None
    ) -> StepOutcome:
        """Complete a step: ``ran[i]`` is the tokens row ``i`` ran (a chunk: 0 or its planned
        tokens), or ``ran`` is the step's ``Batch`` itself when every row ran its planned tokens
        (as ``batch.planned()``, without a list of a Python int per row), ``measured_ms`` its
        measured time (checked against the time budget, fed to the
        online fit and the margin). A token overrun is logged; a failure of that logging call
        is reported through ``sys.unraisablehook``, never raised: the outcome is answered."""
        return self._engine.complete(step, ran, measured_ms)

    def complete_and_assemble(  # type: ignore[no-redef]
        self,
        step: int,
        ran: Union[Sequence[int], Batch],
        measured_ms: Optional[float] = None,
        *,
        next: Optional[Union[NextStep, Tuple[str, str]]] = None,
        at_ms: Optional[float] = None,
    ) -> Completed:
        """Complete step ``step`` (as ``complete``), apply ``next``'s row changes (a
        ``NextStep``: requests ended, decode rows continued, prompts admitted), and assemble
        the node's next step, in one round trip. Answers a ``Completed``: ``outcome`` and
        ``next`` (the next ``Batch``; reading it raises what its assembly failed with). A
        repeat of a call whose answer was lost gets the same outcome and the batch in flight:
        the completion and the changes are applied once. Without ``next``, the next step is
        the same node and walk as step ``step``'s, with no row changes. ``at_ms`` (else
        ``next.at_ms``) is the next step's time on the engine's clock, as ``assemble``'s."""
        return self._engine.complete_and_assemble(step, ran, measured_ms, next=next, at_ms=at_ms)

    def abandon(self, step: int) -> None:  # type: ignore[no-redef]
        """The step ran nothing: no row advances, and the node can assemble again."""
        self._engine.abandon(step)

    def queue_stats(self) -> dict:  # type: ignore[no-redef]
        """``{prefill_rows, mid_prefill_rows, continuing_rows, steps_in_flight}``."""
        return self._engine.queue_stats()

    def overrun_count(  # type: ignore[no-redef]
        self, node_name: str, graph_walk: str, reason: Optional[str] = None
    ) -> int:
        """Overruns counted for ``(node_name, graph_walk)``, for one reason (``uncut_row``,
        ``speculation_estimate``, ``other``) or all."""
        return self._engine.overrun_count(node_name, graph_walk, reason)

    # Shutdown.

    def begin_drain(self) -> int:
        """Start the shutdown: from now on admissions, continuing rows and new steps are refused
        (``ChunkingError``, draining); the step in flight may still be completed or abandoned,
        requests forgotten. Answers the steps in flight. Then call ``drain()``."""
        return self._engine.begin_drain()

    def drain(self) -> dict:
        """End the shutdown (starting it if needed): abandon steps still in flight, drop every
        queued row and prepared input, and answer what was dropped: ``{steps_abandoned,
        requests, rows, prepared_inputs, prepared_tokens}`` (all 0 when the engine completed its
        steps and forgot its requests first)."""
        return self._engine.drain()

    def close(self) -> Optional[dict]:
        """Drain (``drain()``) and stop the actors; answers the drain report (``None`` when
        already closed). Later calls raise ``ActorsStoppedError``. In a forked child, a no-op."""
        return self._engine.close()

    def __enter__(self) -> "ChunkingManagement":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
