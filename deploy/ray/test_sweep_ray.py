"""The Ray driver against a local Ray head on 127.0.0.1: every wave of a sweep's job directory
run as Ray tasks and merged gives the local sweep's sweep.csv byte for byte.

Run by `make test-ray` (MSTAR_CHUNKING_BIN: the binary). Every command has a timeout, so a hung
cell or merge fails the test instead of hanging it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sweep_ray  # noqa: E402
from conftest import BIN, GRID, TIMEOUT, assert_merge_is_local, cells  # noqa: E402
from conftest import run_ok as run  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():  # type: ignore[no-untyped-def]
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
    yield
    ray.shutdown()


def test_the_ray_driver_merges_the_local_sweep(local_ray, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    jobs, merged, local = tmp_path / "jobs", tmp_path / "merged", tmp_path / "local"
    run("sweep", "--emit-jobs", str(jobs), *GRID)
    first = len(cells(jobs))
    assert first == 4

    code = sweep_ray.main([str(jobs), "--out", str(merged), "--bin", BIN,
                           "--cell-timeout", str(TIMEOUT), "--max-waves", "30"])
    assert code == 0
    done = cells(jobs)
    # The merge asked for probe cells: the driver ran more than the first wave.
    assert len(done) > first, done
    assert max(int(c["wave"]) for c in done) >= 2  # type: ignore[call-overload]
    for c in done:
        assert (jobs / "results" / f"cell-{int(c['index']):06d}.json").is_file(), c  # type: ignore[call-overload]

    assert_merge_is_local(merged, local, GRID)


def test_a_failing_cell_fails_the_driver(local_ray, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    jobs = tmp_path / "jobs"
    run("sweep", "--emit-jobs", str(jobs), *GRID)
    # An edited manifest is refused by every cell (exit 2): the driver stops, merging nothing.
    m = jobs / "jobs.json"
    m.write_text(m.read_text().replace('"1024"', '"2048"', 1))
    with pytest.raises(SystemExit, match="cells failed"):
        sweep_ray.main([str(jobs), "--out", str(tmp_path / "merged"), "--bin", BIN,
                        "--cell-timeout", str(TIMEOUT)])
    assert not (tmp_path / "merged").exists()


def test_the_driver_as_a_command_joins_a_running_cluster(local_ray, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    jobs, merged, local = tmp_path / "jobs", tmp_path / "merged", tmp_path / "local"
    run("sweep", "--emit-jobs", str(jobs), *GRID)
    address = ray.get_runtime_context().gcs_address
    r = subprocess.run(
        [sys.executable, str(Path(sweep_ray.__file__)), str(jobs), "--out", str(merged),
         "--address", address, "--bin", BIN, "--cell-timeout", str(TIMEOUT)],
        capture_output=True, text=True, timeout=4 * TIMEOUT, check=False,
    )
    assert r.returncode == 0, r.stderr
    assert "Connecting to existing Ray cluster" in r.stderr, r.stderr
    assert "more cells (wave 2)" in r.stderr, r.stderr
    assert_merge_is_local(merged, local, GRID)
