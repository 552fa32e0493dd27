"""GNU parallel as the cluster engine (docs/cluster-sweeps.md): every cell of each wave run by
`parallel`, two at a time, merged until no wave is added, gives the local sweep's sweep.csv
byte for byte. Run by `make test-ray` (MSTAR_CHUNKING_BIN: the binary). Every command has a
timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

BIN = os.path.abspath(os.environ.get("MSTAR_CHUNKING_BIN", "target/debug/mstar-chunking"))
TIMEOUT = 120
GRID = [
    "--requests", "40",
    "--budgets", "1024,off",
    "--rates", "0.5,1",
    "--slo-tbt-p99", "60",
    "--slo-ttft-p90", "3000",
]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([BIN, *args], capture_output=True, text=True, timeout=TIMEOUT,
                          check=False)


def test_gnu_parallel_runs_the_cells_and_the_merge_is_the_local_sweep(tmp_path: Path) -> None:
    jobs, merged, local = tmp_path / "jobs", tmp_path / "merged", tmp_path / "local"
    r = run("sweep", "--emit-jobs", str(jobs), *GRID)
    assert r.returncode == 0, r.stderr
    waves = 0
    while True:
        n = len(json.loads((jobs / "jobs.json").read_text())["body"]["cells"])
        # The docs' command: one `sweep-cell` per index; the cells of earlier waves return at once.
        p = subprocess.run(
            ["parallel", "--will-cite", "--halt", "now,fail=1", "-j", "2",
             BIN, "sweep-cell", str(jobs), "{}", ":::", *map(str, range(n))],
            capture_output=True, text=True, timeout=TIMEOUT * 4, check=False)
        assert p.returncode == 0, p.stderr
        r = run("sweep", "--merge", str(jobs), "--out", str(merged))
        if r.returncode == 0:
            break
        assert r.returncode == 3, r.stderr
        waves += 1
        assert waves < 30, r.stderr
    r = run("sweep", "--no-progress", "--out", str(local), *GRID)
    assert r.returncode == 0, r.stderr
    assert (merged / "sweep.csv").read_bytes() == (local / "sweep.csv").read_bytes()
