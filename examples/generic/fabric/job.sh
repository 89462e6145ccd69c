#!/bin/bash
#SBATCH --job-name=fabric
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=8
#SBATCH --mem=128G
#SBATCH --time=00:15:00
# --- Site-specific #SBATCH lines: remove a "#" to use one -----------------------------
# (values: see "Adapt it to your cluster" in the guide)
##SBATCH --partition=gpu
##SBATCH --account=my-project

# Stop at the first failing command.
set -e

# --- Site-specific: make torch importable ---------------------------------------------
# This is a virtual environment; create it once, on a login node:
#   python3 -m venv ~/venvs/ddp
#   ~/venvs/ddp/bin/pip install torch==2.14.1 torchvision==0.29.1
# That torch is built for CUDA 13.0: it needs NVIDIA driver 580 or newer, and GPUs of
# compute capability 7.5 (Turing) or newer.
# shellcheck source=/dev/null
source "$HOME/venvs/ddp/bin/activate"

# The resources Slurm granted, at the top of the output, for when something looks wrong.
# Only a record: if the controller does not answer (a restart, say), the job goes on.
scontrol show job "$SLURM_JOB_ID" || true
# NCCL_DEBUG=INFO logs the network and GPU links NCCL picks at start: the check's
# second result. (The training examples keep WARN: INFO on every run fills the output.)
# PYTHONFAULTHANDLER=1 prints each thread's Python stack when a process dies of a fatal
# signal, such as the abort by which NCCL's watchdog ends a collective that timed out.
export NCCL_DEBUG=INFO
export PYTHONFAULTHANDLER=1
# The check computes nothing on the CPUs: one OpenMP thread per process is plenty.
export OMP_NUM_THREADS=1

# Where the processes meet to form the process group: the job's first node, which
# every node reaches by name, on a port derived from the job ID, so that two jobs
# sharing a node do not pick the same one. 10000-19999 is below the range the kernel
# hands out to outgoing connections.
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
export MASTER_ADDR=${nodes[0]}
export MASTER_PORT=$((10000 + SLURM_JOB_ID % 10000))

# srun starts one task per GPU on every node, as step 3 does: the check measures the
# links that step 3's job would use. Arguments after `sbatch job.sh` reach main.py:
# `sbatch job.sh --max-bytes 64M`.
# --cpus-per-task: Slurm 23.11 and later pass the job's CPUs per task on to srun
# unasked; 22.05 to 23.02 do not.
# --kill-on-bad-exit: if one task fails, end the others at once.
srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" python main.py "$@"
