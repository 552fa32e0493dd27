"""What the cluster recipes' tests share (run by `make test-ray`): the binary
(MSTAR_CHUNKING_BIN), the timeout every command has, the sweep every recipe runs, and the
checks that a recipe's merge is the local sweep byte for byte.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

BIN = os.path.abspath(os.environ.get("MSTAR_CHUNKING_BIN", "target/debug/mstar-chunking"))
TIMEOUT = 120
# Two budgets, two rates and an objective: the capacity searches add waves of probe cells.
GRID = [
    "--requests", "40",
    "--budgets", "1024,off",
    "--rates", "0.5,1",
    "--slo-tbt-p99", "60",
    "--slo-ttft-p90", "3000",
]
# The same grid without an objective: 4 cells, one wave.
PLAIN_GRID = GRID[:6]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    """The binary with `args`, bounded by TIMEOUT."""
    return subprocess.run([BIN, *args], capture_output=True, text=True, timeout=TIMEOUT,
                          check=False)


def run_ok(*args: str) -> subprocess.CompletedProcess[str]:
    """`run`, failing the test unless it exits 0."""
    r = run(*args)
    assert r.returncode == 0, f"{args}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


def cells(jobs: Path) -> list[dict[str, object]]:
    """The cells of a job directory's manifest, every wave so far."""
    return json.loads((jobs / "jobs.json").read_text())["body"]["cells"]  # type: ignore[no-any-return]


def merge_waves(jobs: Path, merged: Path, run_wave: Callable[[int], None]) -> int:
    """Runs every cell of each wave with `run_wave(number of cells)` and merges, until the merge
    adds no wave (exit 0 rather than 3); answers how many waves were added."""
    waves = 0
    while True:
        run_wave(len(cells(jobs)))
        r = run("sweep", "--merge", str(jobs), "--out", str(merged))
        if r.returncode == 0:
            return waves
        assert r.returncode == 3, r.stderr
        waves += 1
        assert waves < 30, r.stderr


def assert_merge_is_local(merged: Path, local: Path, grid: list[str]) -> None:
    """The merged sweep.csv is the one the same sweep run locally writes."""
    run_ok("sweep", "--no-progress", "--out", str(local), *grid)
    assert (merged / "sweep.csv").read_bytes() == (local / "sweep.csv").read_bytes()
