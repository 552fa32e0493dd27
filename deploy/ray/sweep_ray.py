#!/usr/bin/env python3
"""Runs a sweep's job directory on a Ray cluster (docs/cluster-sweeps.md).

    mstar-chunking sweep --emit-jobs jobs ...
    python3 deploy/ray/sweep_ray.py jobs --out merged [--address ray://head:10001]

Each cell of the current wave without a result is one Ray task (one CPU) running
`mstar-chunking sweep-cell DIR INDEX`; once all are done the driver runs
`mstar-chunking sweep --merge DIR --out OUT`, and while the merge exits 3 (it added a wave of
probe cells) runs the new cells and merges again, at most --max-waves times. Without --address
it starts a local Ray instance of its own. The job directory must be at the same path on every
node (a shared file system), and the binary too (--bin, else `mstar-chunking` on PATH).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import ray

# `sweep --merge` exits 3 when it added a wave of probe cells to the manifest.
MORE_CELLS = 3


@ray.remote(num_cpus=1)
def sweep_cell(binary: str, job_dir: str, index: int, timeout: float | None) -> tuple[int, int, str]:
    """Runs one cell; returns (index, exit code, stderr)."""
    r = subprocess.run(
        [binary, "sweep-cell", job_dir, str(index)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return index, r.returncode, r.stderr


def cell_indices(job_dir: Path) -> list[int]:
    """The indices of the manifest's cells that have no result yet (the current wave, and any
    earlier cell that failed)."""
    manifest: dict[str, Any] = json.loads((job_dir / "jobs.json").read_text())
    cells = manifest["body"]["cells"]
    return [
        int(c["index"])
        for c in cells
        if not (job_dir / "results" / f"cell-{int(c['index']):06d}.json").exists()
    ]


def run_wave(binary: str, job_dir: Path, timeout: float | None) -> None:
    pending = cell_indices(job_dir)
    print(f"sweep_ray: running {len(pending)} cells", file=sys.stderr, flush=True)
    refs = [sweep_cell.remote(binary, str(job_dir), i, timeout) for i in pending]
    failed = []
    # A task's own timeout kills its cell; this one bounds the wait for a worker too.
    wait = None if timeout is None else timeout * max(1, len(refs))
    for index, code, stderr in ray.get(refs, timeout=wait):
        if code != 0:
            failed.append(index)
            print(f"sweep_ray: cell {index} exited {code}:\n{stderr}", file=sys.stderr)
    if failed:
        raise SystemExit(f"sweep_ray: {len(failed)} cells failed: {failed}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("job_dir", type=Path, help="the job directory (sweep --emit-jobs DIR)")
    p.add_argument("--out", type=Path, required=True, help="where the merge writes the outputs")
    p.add_argument("--address", default=None,
                   help="a Ray cluster to join (ray.init address); default: start a local one")
    p.add_argument("--bin", default=None,
                   help="the mstar-chunking binary (default: on PATH); the same path on every node")
    p.add_argument("--max-waves", type=int, default=50,
                   help="give up after this many merges that asked for more cells")
    p.add_argument("--cell-timeout", type=float, default=None,
                   help="seconds one cell (or a merge) may take (default: no limit)")
    p.add_argument("--num-cpus", type=int, default=None,
                   help="CPUs of the local Ray instance (only without --address)")
    args = p.parse_args(argv)

    binary = args.bin or shutil.which("mstar-chunking")
    if binary is None:
        p.error("mstar-chunking is not on PATH: pass --bin")
    binary = os.path.abspath(binary)
    job_dir = args.job_dir.resolve()
    if not (job_dir / "jobs.json").is_file():
        p.error(f"{job_dir} has no jobs.json: emit it with `mstar-chunking sweep --emit-jobs`")

    # A caller that already connected (a test, a notebook) keeps its connection.
    owned = not ray.is_initialized()
    if not owned:
        pass
    elif args.address is None:
        ray.init(num_cpus=args.num_cpus, include_dashboard=False)
    else:
        ray.init(address=args.address)
    try:
        for _ in range(args.max_waves + 1):
            run_wave(binary, job_dir, args.cell_timeout)
            merge = subprocess.run(
                [binary, "sweep", "--merge", str(job_dir), "--out", str(args.out)],
                check=False,
                timeout=args.cell_timeout,
            )
            if merge.returncode == 0:
                return 0
            if merge.returncode != MORE_CELLS:
                print(f"sweep_ray: the merge exited {merge.returncode}", file=sys.stderr)
                return merge.returncode
        print(f"sweep_ray: still more cells after {args.max_waves} waves", file=sys.stderr)
        return 1
    finally:
        if owned:
            ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
