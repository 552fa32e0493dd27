"""The Slurm batch script without Slurm: run with SLURM_ARRAY_TASK_ID set for every index of
each wave, as `sbatch --array=0-N` would, merged until no wave is added, it gives the local
sweep's sweep.csv byte for byte; and it refuses to run outside a job array.

Run by `make test-ray` (MSTAR_CHUNKING_BIN: the binary), after shellcheck on the script.
Every command has a timeout.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from conftest import BIN, GRID, TIMEOUT, assert_merge_is_local, cells, merge_waves, run, run_ok

SCRIPT = Path(__file__).resolve().parent / "sweep-cell.sh"


def script(*args: str, task: str | None) -> subprocess.CompletedProcess[str]:
    """The script as a Slurm array task runs it: a clean environment, its array index."""
    env = {"PATH": os.environ.get("PATH", ""), "MSTAR_CHUNKING": BIN}
    if task is not None:
        env["SLURM_ARRAY_TASK_ID"] = task
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True,
                          text=True, timeout=TIMEOUT, check=False)


def test_every_array_task_then_merges_into_the_local_sweep(tmp_path: Path) -> None:
    jobs, merged, local = tmp_path / "jobs", tmp_path / "merged", tmp_path / "local"
    run_ok("sweep", "--emit-jobs", str(jobs), *GRID)

    def wave(n: int) -> None:
        # sbatch --array=0-(N-1): every index; the cells done in earlier waves return at once.
        for i in range(n):
            r = script(str(jobs), task=str(i))
            assert r.returncode == 0, f"task {i}: {r.stderr}"

    waves = merge_waves(jobs, merged, wave)
    assert waves >= 2, f"the capacity searches took {waves} waves"
    assert_merge_is_local(merged, local, GRID)


def test_it_refuses_to_run_outside_a_job_array(tmp_path: Path) -> None:
    jobs = tmp_path / "jobs"
    assert run("sweep", "--emit-jobs", str(jobs), *GRID).returncode == 0
    r = script(str(jobs), task=None)
    assert r.returncode == 2 and "SLURM_ARRAY_TASK_ID is not set" in r.stderr, r
    r = script(task="0")
    assert r.returncode == 2 and "usage:" in r.stderr, r
    # An index outside the cells is refused by the binary (exit 2), nothing written.
    r = script(str(jobs), task=str(len(cells(jobs))))
    assert r.returncode == 2, r
    assert not any((jobs / "results").iterdir())
