"""GNU parallel as the cluster engine (docs/cluster-sweeps.md): every cell of each wave run by
`parallel`, two at a time, merged until no wave is added, gives the local sweep's sweep.csv
byte for byte. Run by `make test-ray` (MSTAR_CHUNKING_BIN: the binary). Every command has a
timeout.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from conftest import BIN, GRID, TIMEOUT, assert_merge_is_local, merge_waves, run_ok


def test_gnu_parallel_runs_the_cells_and_the_merge_is_the_local_sweep(tmp_path: Path) -> None:
    jobs, merged, local = tmp_path / "jobs", tmp_path / "merged", tmp_path / "local"
    run_ok("sweep", "--emit-jobs", str(jobs), *GRID)

    def wave(n: int) -> None:
        # The docs' command: one `sweep-cell` per index; the cells of earlier waves return at once.
        p = subprocess.run(
            ["parallel", "--will-cite", "--halt", "now,fail=1", "-j", "2",
             BIN, "sweep-cell", str(jobs), "{}", ":::", *map(str, range(n))],
            capture_output=True, text=True, timeout=TIMEOUT * 4, check=False)
        assert p.returncode == 0, p.stderr

    merge_waves(jobs, merged, wave)
    assert_merge_is_local(merged, local, GRID)
