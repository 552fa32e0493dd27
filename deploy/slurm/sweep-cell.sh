#!/usr/bin/env bash
# One cell of a sweep's job directory per Slurm array task (docs/cluster-sweeps.md).
#
#   mstar-chunking sweep --emit-jobs jobs ...        # prints the number of cells, N
#   sbatch --array=0-$((N - 1)) deploy/slurm/sweep-cell.sh jobs
#   mstar-chunking sweep --merge jobs --out sweep-out
#
# Each task runs `mstar-chunking sweep-cell DIR`, which takes its cell from
# SLURM_ARRAY_TASK_ID. A cell already done is not run again, so a requeued or repeated task is
# harmless. The job directory must be on a file system every node sees; `mstar-chunking` must
# be on PATH (or set MSTAR_CHUNKING to the binary).
#SBATCH --job-name=mstar-sweep
#SBATCH --cpus-per-task=1
#SBATCH --output=sweep-cell-%A_%a.out
set -euo pipefail

if [ "$#" -ne 1 ]; then
    echo "usage: sbatch --array=0-N deploy/slurm/sweep-cell.sh JOB_DIR" >&2
    exit 2
fi
if [ -z "${SLURM_ARRAY_TASK_ID:-}" ]; then
    echo "SLURM_ARRAY_TASK_ID is not set: submit this script as a job array (sbatch --array=...)" >&2
    exit 2
fi
exec "${MSTAR_CHUNKING:-mstar-chunking}" sweep-cell "$1"
