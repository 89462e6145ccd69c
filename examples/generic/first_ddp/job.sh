#!/bin/bash
#SBATCH --job-name=first_ddp
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=2
#SBATCH --cpus-per-task=4
#SBATCH --mem=16G
#SBATCH --time=00:10:00

# Stop at the first failing command.
set -e

# --- Site-specific: make torch importable (a module, conda or a venv) -----------------
# This is a virtual environment; create it once, on a login node:
#   python3 -m venv ~/venvs/ddp
#   ~/venvs/ddp/bin/pip install torch==2.14.1 torchvision==0.29.1
# That torch is built for CUDA 13.0: it needs NVIDIA driver 580 or newer, and GPUs of
# compute capability 7.5 (Turing) or newer.
# shellcheck source=/dev/null
source "$HOME/venvs/ddp/bin/activate"

# torchrun starts a process per GPU itself, so it must run once
# per node. With a task per GPU, each of G tasks would start G
# processes: G x G in all, and the job would fail or crawl.
if ((SLURM_NTASKS != SLURM_JOB_NUM_NODES)); then
    echo "error: $SLURM_NTASKS tasks on $SLURM_JOB_NUM_NODES node(s), but torchrun" \
        "must run once per node: use #SBATCH --ntasks-per-node=1" >&2
    exit 1
fi

# One task on one node runs torchrun, which starts a process per GPU of the node.
# --standalone: a rendezvous on this node only, on a free
# port; enough for a single node.
# --cpus-per-task: each task gets the CPUs per task that the job asked for, for its
# DataLoader workers. Slurm 23.11 and later pass them on to srun unasked; 22.05
# to 23.02 do not.
srun --cpus-per-task="$SLURM_CPUS_PER_TASK" \
    torchrun --standalone --nproc-per-node="$SLURM_GPUS_ON_NODE" main.py "$@"
