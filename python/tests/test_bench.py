"""`bench.py`'s loops run on every side and mode it compares, on a workload small enough for
a test: each answers the wall-clock and CPU seconds of its steps."""

import importlib.util
import math
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("bench", Path(__file__).resolve().parents[1] / "bench.py")
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

SMALL = bench.Workload("small", 4, 2, 64, 64)


@pytest.mark.parametrize(
    "run",
    [
        lambda: bench.rust_loop(SMALL, 20),
        lambda: bench.rust_loop(SMALL, 20, facade_timeout=False),
        lambda: bench.rust_loop(SMALL, 20, same_thread=True),
        lambda: bench.python_loop(SMALL, 20),
        lambda: bench.python_loop(SMALL, 20, ran_batch=True),
        lambda: bench.python_loop(SMALL, 20, caller_thread=True),
    ],
    ids=["rust", "rust-no-timeout", "rust-same-thread", "python", "python-ran-batch", "python-caller-thread"],
)
def test_each_loop_runs_its_steps(run):
    wall, cpu = run()
    assert math.isfinite(wall) and wall > 0
    assert math.isfinite(cpu) and cpu >= 0


def test_an_unknown_workload_is_refused_naming_it(capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["bench.py", "--workloads", "W9"])
    with pytest.raises(SystemExit) as exit:
        bench.main()
    assert exit.value.code == 2
    assert "unknown ['W9']" in capsys.readouterr().err
