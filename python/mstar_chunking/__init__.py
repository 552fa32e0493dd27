"""mstar_chunking: chunked prefill's state on the engine, with the API of
``mstar.engine.chunking``, run by the Rust crate ``mstar-chunking``.

Per (node, walk): the model's chunking policy and the token budget a step runs under, after the
serving config's overrides. Per row mid-prefill: its whole prepared input, which every chunk is
cut from. And the count of steps that ran over their budget, for the warning.

Every method blocks until the actors (on a thread of their own) answer, with the GIL released;
one ``ChunkingManagement`` may be used from several threads at once. From ``asyncio``, run the
calls in an executor: ``await loop.run_in_executor(None, cm.assemble, "llm", "mixed")``.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Mapping as _Mapping
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence, Tuple, Union

from . import _native
from ._errors import (
    ActorsStoppedError,
    ChunkingError,
    ChunkingTimeoutError,
    ConflictError,
    InvalidRequestError,
    RefusedSettingsError,
    TransientError,
)
from ._types import NO_CHUNKING, ChunkingPolicy, ChunkRange, Overrun, SubmoduleCaps, _view

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
    "StepOutcome",
    "PreparedInputs",
    "ChunkingError",
    "InvalidRequestError",
    "RefusedSettingsError",
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
StepOutcome = _native.StepOutcome

_U32_MAX = 2**32 - 1
_U64_MAX = 2**64 - 1


def _refuse(key: str, what: str) -> RefusedSettingsError:
    e = RefusedSettingsError(f"refused budgets: {key} {what}")
    e.problems = [f"{key} {what}"]
    return e


def _count(value: Any, key: str, *, allow_zero: bool = True) -> int:
    """``value`` as a u32 count, or a ``RefusedSettingsError`` naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _refuse(key, f"must be a whole number of tokens, got {value!r}")
    if value < (0 if allow_zero else 1) or value > _U32_MAX:
        least = "0" if allow_zero else "1"
        raise _refuse(key, f"must be between {least} and {_U32_MAX}, got {value}")
    return value


def _budget(value: Any, key: str) -> Optional[int]:
    """A budget override: ``None`` (chunking off) or a positive token count (rule 6)."""
    if value is None:
        return None
    return _count(value, key, allow_zero=False)


def _names(value: Any, key: str) -> list:
    if isinstance(value, str):
        raise TypeError(f"{key} is a collection of names, not one string: {value!r}")
    out = list(value)
    for v in out:
        if not isinstance(v, str):
            raise TypeError(f"{key} holds names (str), got {v!r}")
    return out


_NATIVE_U32 = {"I", "@I", "=I", "<I" if sys.byteorder == "little" else ">I"}


def _token_bytes(rid: int, node: str, tokens: Any) -> bytes:
    """Token ids as native-endian uint32 bytes: a buffer of uint32 as it is, anything else (a
    list, a range, a buffer of other ints) converted."""
    try:
        mv = memoryview(tokens)
    except TypeError:
        mv = None
    if mv is not None and mv.itemsize == 4 and mv.format in _NATIVE_U32:
        return mv.tobytes()
    try:
        return array("I", mv.tolist() if mv is not None else tokens).tobytes()
    except OverflowError as e:
        raise InvalidRequestError(f"rid {rid} on `{node}`: token ids must be between 0 and {_U32_MAX} ({e})") from None


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
        return _view(tokens)

    def __iter__(self) -> Iterator[Tuple[int, str]]:
        return iter(self._engine.prepared_keys())

    def __len__(self) -> int:
        return self._engine.prepared_totals()[0]

    def tokens(self) -> int:
        """Tokens held over every node."""
        return self._engine.prepared_totals()[1]

    def __repr__(self) -> str:
        return f"PreparedInputs({dict.fromkeys(self, '...')!r})"


class ChunkingManagement:
    """One model's chunking state on the engine (its actors run on a thread of their own).

    ``submodules`` maps node names to ``SubmoduleCaps`` or any object with
    ``chunkable_walks`` and ``can_override_mixed_max_tokens``. ``model`` labels the metric
    series; ``timeout`` is how many seconds a call waits for the actors (``None``: no limit).
    """

    def __init__(
        self,
        submodules: Mapping[str, Any],
        *,
        model: str = "mstar_chunking",
        timeout: Optional[float] = DEFAULT_REQUEST_TIMEOUT,
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
        self._engine = _native.Engine(model, caps, timeout)
        self._prepared = PreparedInputs(self._engine)
        e = self._engine
        # The step API goes straight to the native methods (no Python frame per call).
        self.assemble = e.assemble
        self.complete = e.complete
        self.abandon = e.abandon
        self.continue_row = e.continue_row
        self.queue_stats = e.queue_stats
        self.overrun_count = e.overrun_count

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
    ) -> None:
        """Apply a serving config's ``max_batch_tokens`` and ``min_chunk_tokens`` to this
        engine's nodes, over the budgets ``set_policies`` declared (so it runs after it).

        Per node, one budget for every walk the model budgets, or a mapping walk -> budget;
        ``None`` turns chunking off. Settings are checked whole: on ``RefusedSettingsError``
        nothing changed. ``max_row_tokens`` and ``max_partial_prefills`` are this package's
        additions (the Rust crate's planner limits).
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
        combined = list((combined_walk_of or {}).items())
        self._engine.set_budgets(
            node_wide,
            per_walk,
            _names(walks, "walks"),
            combined,
            _names(override_mixed, "override_mixed"),
            _names(no_chunking, "no_chunking"),
            _count(min_chunk_tokens, "min_chunk_tokens"),
            None if max_row_tokens is None else _count(max_row_tokens, "max_row_tokens"),
            None if max_partial_prefills is None else _count(max_partial_prefills, "max_partial_prefills"),
        )

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

    @property
    def prepared(self) -> PreparedInputs:
        """Every whole prepared input held, ``(rid, node) -> memoryview`` (read-only)."""
        return self._prepared

    def release(self, rid: int, node_name: str) -> bool:
        """Drop a row's whole input (and its row) at ``node_name`` once its last chunk lands.
        Answers whether an input was held; unknown rows are a no-op."""
        return self._engine.release(rid, node_name)

    def forget_request(self, rid: int) -> None:
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

    # The step API.

    def admit(self, rid: int, node_name: str, graph_walk: str, tokens: Any, cached: int = 0) -> None:
        """Hold a prompt's whole prepared input (token ids: a buffer of uint32, a list, ...) and
        queue its row at ``node_name`` for ``graph_walk``; ``cached`` tokens of it are a cached
        prefix (clamped to leave the last token to run). The ids are copied once, here."""
        self._engine.admit(rid, node_name, graph_walk, _token_bytes(rid, node_name, tokens), cached)

    def close(self) -> None:
        """Stop the actors; later calls raise ``ActorsStoppedError``."""
        self._engine.close()

    def __enter__(self) -> "ChunkingManagement":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
