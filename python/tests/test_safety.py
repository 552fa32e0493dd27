"""What no Python program can do to the component: write a prepared input, free the memory a
live view reads, hang or panic in a forked child, overflow an argument into a panic, lose a
step's outcome to a failing log call, or pass text or a foreign byte order as token ids."""

from __future__ import annotations

import array
import ctypes
import gc
import logging
import math
import os
import select
import sys

import pytest

from mstar_chunking import (
    ActorsStoppedError,
    ChunkingError,
    ChunkingManagement,
    ChunkingPolicy,
    InvalidRequestError,
    SubmoduleCaps,
)


@pytest.fixture
def cm(make_cm):
    cm = make_cm({"llm": SubmoduleCaps(["prefill", "mixed"]), "enc": SubmoduleCaps([])})
    cm.set_policies(
        {
            ("llm", "prefill"): ChunkingPolicy(256),
            ("llm", "mixed"): ChunkingPolicy(256),
            ("enc", "mixed"): ChunkingPolicy(100),
        }
    )
    cm.set_budgets({}, ["prefill", "decode", "mixed"], combined_walk_of={"prefill": "mixed", "decode": "mixed"})
    return cm


def test_no_view_of_a_prepared_input_can_be_written(cm):
    cm.admit(1, "llm", "prefill", array.array("I", range(1000, 1600)))
    b = cm.assemble("llm", "mixed")
    views = [b.rows[0].input, cm.prepared[(1, "llm")]]
    for mv in views:
        assert mv.readonly
        base = mv.obj
        # The view's base is the native token object itself, which exports only read-only
        # buffers: every way of asking for a writable one is refused.
        assert memoryview(base).readonly
        with pytest.raises((TypeError, BufferError)):
            (ctypes.c_uint32 * len(mv)).from_buffer(base)
        with pytest.raises((TypeError, BufferError)):
            (ctypes.c_uint32 * len(mv)).from_buffer(mv)
        with pytest.raises(TypeError):
            mv[0] = 7
        with pytest.raises(TypeError):
            base[0] = 7  # type: ignore[index]
    assert cm.prepared[(1, "llm")].tolist() == list(range(1000, 1600))
    assert b.rows[0].input.tolist() == list(range(1000, 1256))
    cm.abandon(b.step)


def test_a_view_keeps_its_tokens_alive_whatever_the_program_drops(cm):
    cm.admit(1, "llm", "prefill", array.array("I", range(5000, 9096)))
    b = cm.assemble("llm", "mixed")
    mv = cm.prepared[(1, "llm")]
    chunk = b.rows[0].input
    # The lifetime hangs on the export itself: the base has no attribute a program could clear.
    with pytest.raises(AttributeError):
        mv.obj._owner = None  # type: ignore[union-attr]
    cm.abandon(b.step)
    cm.forget_request(1)
    del b
    gc.collect()
    assert len(cm.prepared) == 0
    # Other allocations of the same size would reuse freed memory.
    for rid in range(2, 10):
        cm.admit(rid, "llm", "prefill", [rid] * 4096)
    assert mv.tolist() == list(range(5000, 9096))
    assert chunk.tolist() == list(range(5000, 5256))


def _in_child(fn) -> bytes:
    """Runs `fn` in a forked child and answers what it wrote (bounded: 20 s)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        os.close(r)
        try:
            out = fn()
        except BaseException as e:  # noqa: BLE001
            out = f"child raised {type(e).__name__}: {e}".encode()
        os.write(w, out)
        os._exit(0)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], 20.0)
        if not ready:
            os.kill(pid, 9)
            pytest.fail("the forked child did not answer within 20 s")
        data = b""
        while chunk := os.read(r, 65536):
            data += chunk
    finally:
        os.close(r)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, data
    return data


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_forked_child_gets_an_error_at_once_and_close_or_drop_do_nothing(make_cm):
    cm = make_cm(timeout=2.0)
    cm.set_policies({("llm", "mixed"): ChunkingPolicy(256)})

    def child() -> bytes:
        import time

        t0 = time.monotonic()
        try:
            cm.assemble("llm", "mixed")
            return b"no error"
        except ActorsStoppedError as e:
            took = time.monotonic() - t0
            if took > 0.5 or "forked child" not in str(e):
                return f"slow or unclear: {took:.2f}s {e}".encode()
        one_call = cm._engine._complete_and_assemble_keyed  # the vLLM scheduler's step
        for call in (
            lambda: cm.admit(1, "llm", "prefill", [1]),
            lambda: cm.queue_stats(),
            lambda: len(cm.prepared),
            lambda: one_call(1, [1], None, "llm", "mixed", "decode", [], "prefill", [], {}),
        ):
            try:
                call()
                return b"a call succeeded in the child"
            except ActorsStoppedError:
                pass
        if cm.close() is not None:
            return b"close drained in the child"
        cm.close()
        import gc as _gc

        del _gc.garbage[:]
        return b"ok"

    assert _in_child(child) == b"ok"
    # The parent's actors are untouched.
    cm.admit(1, "llm", "prefill", [1] * 10)
    assert cm.queue_stats()["prefill_rows"] == 1


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_dropping_a_manager_in_a_forked_child_is_a_no_op(make_cm):
    cm = make_cm()

    def child() -> bytes:
        nonlocal cm
        del cm
        gc.collect()
        return b"ok"

    assert _in_child(child) == b"ok"
    assert cm.queue_stats()["steps_in_flight"] == 0


@pytest.mark.parametrize("timeout", [1e300, float("inf"), float("nan"), -1.0, 0.0, 2.0**64])
def test_a_timeout_a_duration_cannot_hold_is_a_value_error_naming_it(timeout):
    with pytest.raises(ValueError, match="timeout"):
        ChunkingManagement({"llm": SubmoduleCaps(["prefill"])}, timeout=timeout)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda cm: cm.admit(-1, "llm", "prefill", [1]), "rid"),
        (lambda cm: cm.admit(2**64, "llm", "prefill", [1]), "rid"),
        (lambda cm: cm.admit(1, "llm", "prefill", [1], cached=-1), "cached"),
        (lambda cm: cm.admit(1, "llm", "prefill", [1], cached=2**32), "cached"),
        (lambda cm: cm.continue_row(1, "llm", "decode", 2**32), "estimate"),
        (lambda cm: cm.continue_row(1, "llm", "decode", 1, context=-5), "context"),
        (lambda cm: cm.continue_row("1", "llm", "decode"), "rid"),
        (lambda cm: cm.complete(-1, []), "step"),
        (lambda cm: cm.complete(1.5, []), "step"),
        (lambda cm: cm.complete(1, [-1]), r"ran\[0\]"),
        (lambda cm: cm.complete(1, [0, 2**40]), r"ran\[1\]"),
        (lambda cm: cm.complete(1, "abc"), "ran"),
        (lambda cm: cm.complete(1, [1, True]), r"ran\[1\]"),
        (lambda cm: cm.complete(1, (1, 2.0)), r"ran\[1\]"),
        (lambda cm: cm.complete(1, 5), "ran must be a sequence"),
        (lambda cm: cm.complete(1, [], math.nan), "measured_ms"),
        (lambda cm: cm.complete(1, [], 1e309), "measured_ms"),
        (lambda cm: cm.complete(1, [], -1.0), "measured_ms"),
        (lambda cm: cm.complete(1, [], "5"), "measured_ms"),
        (lambda cm: cm.abandon(2**70), "step"),
        (lambda cm: cm.forget_request(-3), "rid"),
        (lambda cm: cm.release(True, "llm"), "rid"),
        (lambda cm: cm.complete_and_assemble(1, [], next=("llm",)), "next"),
    ],
)
def test_every_bad_argument_is_a_value_error_naming_it_never_a_panic(cm, call, name):
    with pytest.raises(ValueError, match=name) as e:
        call(cm)
    assert isinstance(e.value, InvalidRequestError)


def test_an_exception_from_the_overrun_log_call_does_not_lose_the_outcome(cm, monkeypatch):
    class Refusing(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            raise RuntimeError("the log pipeline is broken")

    logger = logging.getLogger("mstar_chunking")
    flt = Refusing()
    logger.addFilter(flt)
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u))
    try:
        cm.admit(1, "enc", "prefill", [1] * 300)
        b = cm.assemble("enc", "mixed")
        out = cm.complete(b.step, b.planned())
    finally:
        logger.removeFilter(flt)
    assert out.finished == [1] and out.overrun is not None and out.overrun.reason == "uncut_row"
    assert len(seen) == 1 and isinstance(seen[0].exc_value, RuntimeError)
    # The step is done: nothing is in flight, nothing held.
    assert cm.queue_stats()["steps_in_flight"] == 0 and len(cm.prepared) == 0


def test_a_big_endian_uint32_buffer_is_converted(cm):
    ids = list(range(70000, 70010))
    foreign = _foreign_view(ids)
    with pytest.raises(NotImplementedError):
        foreign.tolist()  # what the conversion used to call
    cm.admit(1, "llm", "prefill", foreign)
    assert cm.prepared[(1, "llm")].tolist() == ids


def _foreign_view(ids: list[int]) -> memoryview:
    """A memoryview of format `>I` (`<I` on a big-endian machine): uint32 of the other byte
    order, through a ctypes array of that byte order."""
    other = ctypes.c_uint32.__ctype_be__ if sys.byteorder == "little" else ctypes.c_uint32.__ctype_le__  # type: ignore[attr-defined]
    arr = (other * len(ids))(*ids)
    mv = memoryview(arr)
    assert mv.format in (">I", "<I"), mv.format
    return mv


def test_a_buffer_of_another_format_is_refused_saying_what_is_accepted(cm):
    with pytest.raises(InvalidRequestError, match="token ids are a sequence of ints"):
        cm.admit(1, "llm", "prefill", array.array("d", [1.0, 2.0]))
    with pytest.raises(InvalidRequestError, match="dimensions"):
        cm.admit(1, "llm", "prefill", memoryview(bytes(16)).cast("I", (2, 2)))


def test_a_str_prompt_is_refused_saying_to_tokenize_it_first(cm):
    with pytest.raises(InvalidRequestError, match="tokenize it first"):
        cm.admit(1, "llm", "prefill", "hello world")
    assert len(cm.prepared) == 0


def test_no_panic_exception_from_any_call(cm):
    # Whatever the arguments, a failure is a ChunkingError or a TypeError, never a
    # pyo3_runtime.PanicException (a BaseException).
    for args in [(2**63, "llm", "prefill", [1] * 3), (0, "llm", "prefill", range(2**32 - 3, 2**32))]:
        try:
            cm.admit(*args)
        except ChunkingError:
            pass


def test_a_manager_made_after_a_fork_works_in_the_child(make_cm):
    # The forks counted by `os.register_at_fork` tell the child from the parent: a manager the
    # child makes is its own, and works.
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            cm = ChunkingManagement({"llm": SubmoduleCaps(["prefill"])})
            cm.set_policies({("llm", "prefill"): ChunkingPolicy(64)})
            cm.admit(1, "llm", "prefill", [1] * 100)
            code = 0 if cm.assemble("llm", "prefill").planned() == [64] else 2
            cm.close()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
