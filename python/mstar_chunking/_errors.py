"""The exceptions of mstar_chunking: one base class, subclasses by what the caller can do.

The native module raises these with the Rust error's message (naming the node, walk, rid or key
that was wrong) and three attributes: ``kind`` (``"invalid_request"``, ``"refused_settings"``,
``"conflict"``, ``"transient"``, ``"fatal"`` or ``"internal"``), ``retryable`` (retrying the same
call may succeed) and ``problems`` (every problem of refused settings, one string each).
"""

from __future__ import annotations

__all__ = [
    "ChunkingError",
    "InvalidRequestError",
    "RefusedSettingsError",
    "ConflictError",
    "TransientError",
    "ChunkingTimeoutError",
    "ActorsStoppedError",
    "TimeSettingsError",
    "ConfigError",
]


class ChunkingError(Exception):
    """A refused call to the chunking component. Nothing changed when one is raised."""

    kind: str = "internal"
    retryable: bool = False
    problems: list[str] = []


class InvalidRequestError(ChunkingError, ValueError):
    """The call was wrong for the model or the request (an unknown node or walk, an empty
    input, a misreported step): retrying it fails the same way."""

    kind = "invalid_request"


class RefusedSettingsError(ChunkingError, ValueError):
    """``set_budgets`` or ``set_policies`` refused the settings whole; the previous ones stay.
    ``problems`` lists each, naming its node and walk. For ``set_budgets``,
    ``refusals`` holds each problem's ``(argument, node, walk)`` (``None`` where it names
    none), and ``argument``, ``node`` and ``walk`` are the first one's."""

    kind = "refused_settings"
    argument: str | None = None
    node: str | None = None
    walk: str | None = None
    refusals: list[tuple[str | None, str | None, str | None]] = []


class TimeSettingsError(RefusedSettingsError):
    """A refused time budget (``max_step_ms``), latency model (``cost``) or time margin
    (``time_margin``): not a finite number, a budget below the model's ``base_ms``, an all-zero
    model, an unknown preset, a margin outside (0, 1] or without a time budget, a time budget
    without a latency model. ``argument``, ``node`` and ``walk`` name it."""


class ConfigError(RefusedSettingsError):
    """``ChunkingManagement.from_config``: the layered config or the model manifest did not load
    or validate; ``problems`` lists each, naming its key and the layer that set it."""


class ConflictError(ChunkingError, RuntimeError):
    """The call conflicts with the state (a row already queued, a step in flight, no policies
    bound yet): it can succeed once the state changes."""

    kind = "conflict"


class TransientError(ChunkingError, RuntimeError):
    """A transient failure (an actor restarted after a panic, an input forgotten while its step
    was cut): retrying may succeed."""

    kind = "transient"
    retryable = True


class ChunkingTimeoutError(TransientError, TimeoutError):
    """An actor did not answer within the request timeout."""


class ActorsStoppedError(ChunkingError, RuntimeError):
    """The actors are stopped (``close()`` was called) or could not start."""

    kind = "fatal"
