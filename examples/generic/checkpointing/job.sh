#!/bin/bash
#SBATCH --job-name=checkpointing
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --gpus-per-node=2
#SBATCH --cpus-per-task=4
#SBATCH --time=00:10:00
# Allow the job to go back in the queue, whether Slurm preempts it or it asks itself.
#SBATCH --requeue
# SIGUSR1 to every task 120 s before the time limit: time to save a checkpoint and requeue.
# Without `B:`, Slurm signals the tasks that srun started, which is where Python runs.
#SBATCH --signal=USR1@120
# Append, so that the log of every run of a requeued job stays in one file.
#SBATCH --open-mode=append

# Stop at the first failing command.
set -e

echo "Job $SLURM_JOB_ID, start number $((${SLURM_RESTART_COUNT:-0} + 1)), on $SLURM_JOB_NODELIST"

# --- Site-specific: make torch importable (a module, a conda or a virtual environment) ----
# shellcheck source=/dev/null
source "$HOME/venvs/ddp/bin/activate"
# --- Site-specific: storage that outlives the job and that every node sees ----------------
# A requeued job keeps its ID, so it finds its own checkpoints here.
export CHECKPOINT_DIR=$SCRATCH/checkpoints/$SLURM_JOB_ID

# Where the processes meet: the job's first node, on a port derived from the job ID so that
# jobs sharing a node do not collide.
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
export MASTER_ADDR=${nodes[0]}
export MASTER_PORT=$((10000 + SLURM_JOB_ID % 10000))
# Since Slurm 22.05, srun no longer inherits --cpus-per-task from the job: pass it on.
export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK

# One task per GPU on every node (--ntasks-per-node = GPUs per node), each a DDP process.
# --kill-on-bad-exit: if one task fails, end the others at once. With NCCL, they could
# otherwise wait for it in their next collective until a timeout.
srun --kill-on-bad-exit=1 python main.py "$@"
