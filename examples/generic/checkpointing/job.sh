#!/bin/bash
#SBATCH --job-name=regression
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --gpus-per-node=2
#SBATCH --cpus-per-task=4
#SBATCH --mem=16G
#SBATCH --time=00:10:00
# Allow the job to go back in the queue, whether Slurm preempts it or it asks itself.
#SBATCH --requeue
# SIGUSR1 to every task 120 s before the time limit: time to
# save a checkpoint and requeue. Without `B:`, Slurm signals
# the tasks that srun started, which is where Python runs.
#SBATCH --signal=USR1@120
# Append, so that the log of every run of a requeued job stays in one file.
#SBATCH --open-mode=append
# The job name names the run: its checkpoints are kept under it, so that a job
# resubmitted with the same name resumes, after a time limit, an scancel or a failed
# requeue. Start a new run with another name: `sbatch --job-name=regression-2 job.sh`.
# singleton: one job of a name runs at a time, or two would write the same checkpoints.
#SBATCH --dependency=singleton

# Stop at the first failing command.
set -e

echo "Job $SLURM_JOB_ID, start number $((${SLURM_RESTART_COUNT:-0} + 1))," \
    "on $SLURM_JOB_NODELIST"

# --- Site-specific: make torch importable (a module, conda or a venv) -----------------
# This is a virtual environment; create it once, on a login node:
#   python3 -m venv ~/venvs/ddp
#   ~/venvs/ddp/bin/pip install torch==2.14.1 torchvision==0.29.1
# That torch is built for CUDA 13.0: it needs NVIDIA driver 580 or newer, and GPUs of
# compute capability 7.5 (Turing) or newer.
# shellcheck source=/dev/null
source "$HOME/venvs/ddp/bin/activate"
# --- Site-specific: storage that outlives the job and that every node sees ------------
storage=${SCRATCH:?"is not set: set it, or this line, to shared storage outliving jobs"}
export CHECKPOINT_DIR=$storage/checkpoints/$SLURM_JOB_NAME
# Fail now rather than at the first save, an epoch into training.
if ! mkdir -p "$CHECKPOINT_DIR" || [[ ! -w $CHECKPOINT_DIR ]]; then
    echo "error: cannot write checkpoints to $CHECKPOINT_DIR" >&2
    exit 1
fi

# Where the processes meet: the job's first node, on a port derived from the job ID so
# that jobs sharing a node do not collide.
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
export MASTER_ADDR=${nodes[0]}
export MASTER_PORT=$((10000 + SLURM_JOB_ID % 10000))
# One task per GPU on every node (--ntasks-per-node = GPUs
# per node), each a DDP process.
# --cpus-per-task: each task gets the CPUs per task that the job asked for, for its
# DataLoader workers. Slurm 23.11 and later pass them on to srun unasked; 22.05
# to 23.02 do not.
# --kill-on-bad-exit: if one task fails, end the others at once. With NCCL, they could
# otherwise wait for it in their next collective until a timeout.
srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" python main.py "$@"
