"""Errors as Python exceptions by kind; no panic crosses; threads and asyncio."""

import asyncio
import threading
import time

import pytest

import mstar_chunking
from mstar_chunking import (
    ActorsStoppedError,
    ChunkingError,
    ChunkingManagement,
    ChunkingPolicy,
    ChunkingTimeoutError,
    ConflictError,
    InvalidRequestError,
    RefusedSettingsError,
    SubmoduleCaps,
    TransientError,
    _native,
)


@pytest.fixture
def cm(make_cm):
    cm = make_cm({"llm": SubmoduleCaps(["prefill"])})
    cm.set_policies({("llm", "prefill"): ChunkingPolicy(64)})
    return cm


def test_the_exception_hierarchy():
    assert issubclass(InvalidRequestError, ChunkingError) and issubclass(InvalidRequestError, ValueError)
    assert issubclass(RefusedSettingsError, ChunkingError) and issubclass(RefusedSettingsError, ValueError)
    assert issubclass(ChunkingTimeoutError, TimeoutError) and issubclass(ChunkingTimeoutError, TransientError)
    assert issubclass(ConflictError, ChunkingError) and not issubclass(ConflictError, ValueError)
    assert mstar_chunking.ChunkingError is ChunkingError


def test_invalid_requests_are_value_errors_naming_node_walk_and_rid(cm):
    with pytest.raises(ValueError, match="node `ghost` is not a node of the model") as e:
        cm.admit(1, "ghost", "prefill", [1])
    assert isinstance(e.value, InvalidRequestError) and e.value.kind == "invalid_request"
    assert not e.value.retryable
    with pytest.raises(InvalidRequestError, match="walk `nope` is not a walk of the model on node `llm`"):
        cm.assemble("llm", "nope")
    with pytest.raises(InvalidRequestError, match="rid 3 on `llm`: an empty prepared input"):
        cm.admit(3, "llm", "prefill", [])
    with pytest.raises(
        InvalidRequestError, match="rid 4 on `llm`: a continuing row must run at least 1 token"
    ):
        cm.continue_row(4, "llm", "prefill", 0)
    with pytest.raises(InvalidRequestError, match="finite number of ms"):
        cm.admit(5, "llm", "prefill", [1])
        b = cm.assemble("llm", "prefill")
        cm.complete(b.step, b.planned(), measured_ms=float("nan"))


def test_a_bad_budget_argument_is_an_invalid_request(cm):
    with pytest.raises(InvalidRequestError, match="budget must be a whole number") as e:
        cm.min_chunk_tokens(-1)
    assert e.value.kind == "invalid_request" and not e.value.retryable


def test_the_package_ships_its_stub_and_py_typed():
    from pathlib import Path

    here = Path(mstar_chunking.__file__).parent
    assert (here / "py.typed").exists() and (here / "__init__.pyi").exists()
    assert "class ChunkingManagement" in (here / "__init__.pyi").read_text()


def test_conflicts_name_the_row(cm):
    cm.admit(1, "llm", "prefill", [1])
    with pytest.raises(ConflictError, match="rid 1 on `llm` is already queued") as e:
        cm.admit(1, "llm", "prefill", [1])
    assert e.value.kind == "conflict" and not isinstance(e.value, ValueError)


def test_a_timeout_is_a_timeout_error():
    # The facade's timeout cannot be provoked deterministically from outside; this runs a
    # Rust `ChunkingError::Timeout` through the same conversion every call uses.
    e = _native._error_for_test("timeout")
    assert isinstance(e, ChunkingTimeoutError) and isinstance(e, TimeoutError)
    assert e.retryable and e.kind == "transient"
    assert "the Scheduler actor did not answer within 5ms" in str(e)


def test_a_call_waits_its_timeout_and_no_longer():
    # Every call is timed on the calling thread: here the wait of a call whose answer never
    # comes, under the same deadline, with the GIL released meanwhile.
    t0 = time.monotonic()
    with pytest.raises(ChunkingTimeoutError, match="did not answer within 50ms") as e:
        _native._timeout_for_test(0.05)
    waited = time.monotonic() - t0
    assert 0.05 <= waited < 2.0, waited
    assert e.value.retryable and e.value.kind == "transient"


def test_no_panic_crosses_into_python():
    with pytest.raises(ChunkingError, match=r"\(a Rust panic, caught\): injected") as e:
        _native._panic_for_test()
    assert e.value.kind == "internal"


def test_a_closed_instance_raises_actors_stopped(make_cm):
    cm = make_cm({"llm": SubmoduleCaps(["prefill"])})
    cm.close()
    with pytest.raises(ActorsStoppedError, match="stopped"):
        cm.set_policies({("llm", "prefill"): ChunkingPolicy(64)})


def test_submodules_are_duck_typed(make_cm):
    class SubmoduleManagement:
        chunkable_walks = ("prefill",)
        can_override_mixed_max_tokens = False

    cm = make_cm({"llm": SubmoduleManagement()})
    cm.set_policies({("llm", "prefill"): ChunkingPolicy(64)})
    assert cm.chunkable("llm", "prefill")
    with pytest.raises(TypeError, match="node `x` has no `chunkable_walks`"):
        ChunkingManagement({"x": object()})


def test_bad_timeouts_are_refused():
    with pytest.raises(ValueError, match="timeout"):
        ChunkingManagement({"llm": SubmoduleCaps([])}, timeout=-1)


def test_usable_from_several_threads_at_once(cm):
    errors = []
    barrier = threading.Barrier(8)

    def worker(t):
        try:
            barrier.wait()
            for i in range(50):
                rid = t * 1000 + i
                cm.admit(rid, "llm", "prefill", [t] * 10)
                assert cm.max_batch_tokens("llm", "prefill") == 64
                assert cm.prepared[(rid, "llm")].tolist() == [t] * 10
                cm.forget_request(rid)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(cm.prepared) == 0


def test_one_thread_steps_while_others_admit(cm):
    total = 6 * 30 * 100
    stepped = []
    done = threading.Event()

    def admitter(t):
        for i in range(30):
            cm.admit(t * 100 + i, "llm", "prefill", [1] * 100)

    def stepper():
        ran = 0
        while ran < total:
            b = cm.assemble("llm", "prefill")
            if len(b) == 0:
                cm.abandon(b.step)
                continue
            out = cm.complete(b.step, b.planned())
            ran += out.ran_tokens
        stepped.append(ran)
        done.set()

    s = threading.Thread(target=stepper)
    s.start()
    admitters = [threading.Thread(target=admitter, args=(t,)) for t in range(6)]
    for t in admitters:
        t.start()
    for t in admitters:
        t.join()
    assert done.wait(60)
    s.join()
    assert stepped == [total] and len(cm.prepared) == 0


def test_asyncio_through_run_in_executor(cm):
    async def main():
        loop = asyncio.get_running_loop()
        await asyncio.gather(
            *(loop.run_in_executor(None, cm.admit, rid, "llm", "prefill", [1] * 100) for rid in range(10))
        )
        ran = 0
        while True:
            b = await loop.run_in_executor(None, cm.assemble, "llm", "prefill")
            if len(b) == 0:
                await loop.run_in_executor(None, cm.abandon, b.step)
                return ran
            out = await loop.run_in_executor(None, cm.complete, b.step, b.planned())
            ran += out.ran_tokens

    assert asyncio.run(main()) == 1000
    assert len(cm.prepared) == 0
