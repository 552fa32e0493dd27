"""The value types of the documented API: pure Python, so each is what the documentation says
(``ChunkRange`` is a ``NamedTuple``)."""

from __future__ import annotations

from dataclasses import dataclass
import sys
from array import array
from typing import Any, Iterable, NamedTuple, Optional

__all__ = [
    "ChunkRange",
    "ChunkingPolicy",
    "NO_CHUNKING",
    "SubmoduleCaps",
    "Overrun",
    "LatencyModel",
    "LatencyModelState",
    "OnlineFit",
]


class ChunkRange(NamedTuple):
    """The tokens [start, end) a chunked row runs this step, of the total its whole input was
    measured at.

    ``stride`` is how far the chunk moves the row's chunk Loop, which counts the tokens run up
    to ``total``: ``end`` for a prompt's first chunk, whose Loop starts at 0 even when a cached
    prefix moves ``start`` on, and ``end - start`` for each later one.
    """

    start: int
    end: int
    total: int
    stride: int

    @property
    def is_final(self) -> bool:
        """Whether this chunk ends the row's prefill."""
        return self.end == self.total

    @property
    def tokens(self) -> int:
        """The tokens this chunk runs (a cached prefix is not run)."""
        return self.end - self.start

    @classmethod
    def cut(cls, first: bool, start: int, end: int, total: int) -> "ChunkRange":
        """The chunk [start, end) of total with its stride: ``end`` for a prompt's first chunk,
        ``end - start`` for a later one."""
        if not 0 <= start < end <= total:
            raise ValueError(f"a chunk needs 0 <= start < end <= total, got [{start}, {end}) of {total}")
        return cls(start, end, total, end if first else end - start)


@dataclass(frozen=True)
class ChunkingPolicy:
    """What the model declares for one (node, walk): its token budget per step (``None``: the
    walk is never chunked) and the alignment of every non-final chunk's end."""

    max_batch_tokens: Optional[int]
    align: int = 1


NO_CHUNKING = ChunkingPolicy(None, 1)
"""The policy of a walk the model does not chunk."""


@dataclass(frozen=True, init=False)
class SubmoduleCaps:
    """What a node's submodule can do with chunks. ``ChunkingManagement`` also accepts any
    object with these two attributes (the original's ``SubmoduleManagement``).

    ``chunkable_walks``: the walks whose rows the submodule can run a part of (a chunk) and
    continue later; rows of other walks always run whole. ``can_override_mixed_max_tokens``:
    inside a combined walk (``mixed``), the submodule can cap each member walk's tokens
    separately (``walk_caps``), so a per-walk budget of a member walk (``prefill``) means
    something there; it takes effect for the nodes also named in ``set_budgets(...,
    override_mixed=[...])``.
    """

    chunkable_walks: frozenset
    can_override_mixed_max_tokens: bool

    def __init__(self, chunkable_walks: Iterable[str], can_override_mixed_max_tokens: bool = False):
        if isinstance(chunkable_walks, str):
            raise TypeError("chunkable_walks is a collection of walk names, not one string")
        object.__setattr__(self, "chunkable_walks", frozenset(chunkable_walks))
        object.__setattr__(self, "can_override_mixed_max_tokens", bool(can_override_mixed_max_tokens))


class Overrun(NamedTuple):
    """A step that ran more tokens than the budget it was scheduled under, and why
    (``uncut_row``, ``speculation_estimate`` or ``other``)."""

    node: str
    walk: str
    budget: int
    tokens: int
    reason: str


class LatencyModel(NamedTuple):
    """A node's latency model: a step's predicted milliseconds are ``base_ms + per_token_ms *
    tokens + per_kv_token_ms * kv_tokens + per_attention_pair_ms * attention_pairs +
    per_row_ms * rows`` (``docs/cost-model.md`` of the repository). Each coefficient is a finite
    number >= 0; ``per_row_ms`` is 0 unless given."""

    base_ms: float
    per_token_ms: float
    per_kv_token_ms: float
    per_attention_pair_ms: float
    per_row_ms: float = 0.0

    def predict_ms(
        self, tokens: int = 0, kv_tokens: int = 0, attention_pairs: int = 0, rows: int = 0
    ) -> float:
        """The predicted milliseconds of a step running ``tokens`` tokens, its continuing rows
        reading ``kv_tokens`` context tokens, its chunks ``attention_pairs`` causal pairs, in
        ``rows`` rows (in the crate's order of operations, so the same features give the same
        float)."""
        return (
            self.base_ms
            + self.per_token_ms * float(tokens)
            + self.per_kv_token_ms * float(kv_tokens)
            + self.per_attention_pair_ms * float(attention_pairs)
            + self.per_row_ms * float(rows)
        )

    @staticmethod
    def attention_pairs(start: int, end: int) -> int:
        """The causal attention pairs of a chunk ``[start, end)``: each of its tokens attends
        to itself and every token before it (0 when ``end <= start``)."""
        if end <= start:
            return 0
        return (end - start) * (end + start + 1) // 2


class OnlineFit(NamedTuple):
    """The online fit's current estimate of a node's latency model."""

    model: LatencyModel
    samples: int
    """Steps observed."""
    relative_rms: float
    """The weighted relative RMS error of the fit over the steps it remembers."""
    trusted: bool
    """Whether the planner uses it (enough samples, a small enough error)."""


class LatencyModelState(NamedTuple):
    """``cm.latency_model(node)``: the model a node plans its time budgets with."""

    model: Optional[LatencyModel]
    """The model in force: the trusted online fit, else the configured one (``None``: neither,
    so the node's time budgets cannot apply)."""
    source: str
    """Where ``model`` came from: ``"online"`` (the trusted fit), ``"config"`` (``cost=``, a
    preset or coefficients) or ``"none"``."""
    configured: Optional[LatencyModel]
    """The configured model, if any."""
    learn_cost: bool
    """Whether the node fits its model from measured step times."""
    fit: Optional[OnlineFit]
    """The online fit's estimate; ``None`` before the first measured step or without
    ``learn_cost``."""
    time_budget_inactive_steps: int = 0
    """Steps of the node on walks with a time budget that were planned without it (the node
    learns its model, has no configured one and its fit is not trusted yet), since the start."""
    time_budget_inactive_reason: Optional[str] = None
    """Why the node's latest step on a walk with a time budget was planned without it
    (``"no_measurements"`` or ``"untrusted_fit"``); ``None`` when it was planned under it."""


_NON_NATIVE_U32 = {">I", "!I"} if sys.byteorder == "little" else {"<I"}


def _token_array(rid: int, node: str, tokens: Any) -> "array[int]":
    """Token ids as an ``array('I')`` for the native module, which reads a buffer of native
    ``uint32`` itself: ``uint32`` of the other byte order is swapped, other integer buffers and
    sequences are converted, anything else is refused naming what is accepted."""
    from ._errors import InvalidRequestError

    where = f"rid {rid} on `{node}`"
    accepted = (
        "token ids are a sequence of ints (a list, a range) or a one-dimensional buffer of integers "
        "(array('I'), a numpy uint32 array; uint32 of either byte order)"
    )
    try:
        mv: Optional[memoryview] = memoryview(tokens)
    except TypeError:
        mv = None
    if mv is not None:
        if mv.ndim != 1:
            raise InvalidRequestError(f"{where}: a buffer of {mv.ndim} dimensions: {accepted}")
        if mv.format in _NON_NATIVE_U32:
            out = array("I")
            out.frombytes(mv.tobytes())
            out.byteswap()
            return out
        try:
            values: Any = mv.tolist()
        except NotImplementedError:
            raise InvalidRequestError(f"{where}: a buffer of format {mv.format!r}: {accepted}") from None
    else:
        values = tokens
    try:
        return array("I", values)
    except OverflowError as e:
        raise InvalidRequestError(f"{where}: token ids must be between 0 and {2**32 - 1} ({e})") from None
    except TypeError as e:
        raise InvalidRequestError(f"{where}: {accepted} ({e})") from None


if array("I").itemsize != 4:  # pragma: no cover
    raise ImportError("mstar_chunking needs a platform whose C unsigned int is 32 bits")
