#!/bin/bash
# A job that hangs on purpose, for the triage tests (tests/test_triage.py): 2 nodes, 2
# tasks each; `main.py --stuck` leaves rank 1 stuck while the others wait in all_reduce.
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=1
#SBATCH --time=00:10:00
set -euo pipefail

MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR
export MASTER_PORT=$((10000 + SLURM_JOB_ID % 10000))
srun --kill-on-bad-exit=1 python3 main.py "$@"
