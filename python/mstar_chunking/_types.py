"""The value types of the documented API: pure Python, so each is what the documentation says
(``ChunkRange`` is a ``NamedTuple``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, NamedTuple, Optional

__all__ = ["ChunkRange", "ChunkingPolicy", "NO_CHUNKING", "SubmoduleCaps", "Overrun"]


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
    object with these two attributes (the original's ``SubmoduleManagement``)."""

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


def _view(tokens) -> memoryview:
    """A read-only ``memoryview`` (format ``I``) over token ids the actors hold, without a copy.

    ``tokens`` is a native ``Tokens`` object (its ``address`` and length); the ctypes array the
    view is made from keeps it, and so the Rust allocation, alive as long as the view lives.
    """
    n = len(tokens)
    if n == 0:
        return memoryview(_array("I")).toreadonly()
    arr = (_ctypes.c_uint32 * n).from_address(tokens.address)
    arr._owner = tokens  # type: ignore[attr-defined]
    return memoryview(arr).cast("B").cast("I").toreadonly()


import ctypes as _ctypes  # noqa: E402
from array import array as _array  # noqa: E402

if _ctypes.sizeof(_ctypes.c_uint32) != 4 or _array("I").itemsize != 4:  # pragma: no cover
    raise ImportError("mstar_chunking needs a platform whose C unsigned int is 32 bits")
