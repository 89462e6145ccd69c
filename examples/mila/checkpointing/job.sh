#!/bin/bash
#SBATCH --job-name=cifar10-resnet18
#SBATCH --nodes=2
#SBATCH --gpus-per-node=rtx8000:4
#SBATCH --cpus-per-task=4
#SBATCH --ntasks-per-node=4
#SBATCH --mem=64G
#SBATCH --time=00:15:00
# Allow the job to go back in the queue, whether Slurm preempts it or it asks itself.
#SBATCH --requeue
# SIGUSR1 to every task 120 s before the time limit: time to save and requeue. Without
# `B:`, Slurm signals the tasks that srun started, which is where Python runs.
#SBATCH --signal=USR1@120
# Append, so that the log of every run of a requeued job stays in one file.
#SBATCH --open-mode=append
# The job name names the run: its checkpoints are kept under it, so that a job
# resubmitted with the same name resumes, after a time limit, an scancel or a failed
# requeue. Start a new run with another name:
# `sbatch --job-name=cifar10-resnet18-2 job.sh`. singleton: one job of a name runs at a
# time, or two would write the same checkpoints.
#SBATCH --dependency=singleton

# Stop at the first failing command rather than train on a half-prepared job.
set -e

echo "Date:     $(date)"
echo "Hostname: $(hostname)"
echo "Start:    number $((${SLURM_RESTART_COUNT:-0} + 1)) of job $SLURM_JOB_ID"

# --- Mila: software environment -------------------------------------------------------
# Create the environment once, on a login node:
#   module load anaconda/3
#   conda create -y -n pytorch python=3.11
#   conda activate pytorch
#   pip install torch==2.14.1 torchvision==0.29.1
# That torch is built for CUDA 13.0: it needs NVIDIA driver 580 or newer, and GPUs of
# compute capability 7.5 or newer, such as the RTX 8000s asked for above.
module --quiet purge
module load anaconda/3
conda activate pytorch

# --- Mila: checkpoints go to $SCRATCH: it outlives the job, and every node sees it ----
storage=${SCRATCH:?"is not set: set it, or this line, to shared storage outliving jobs"}
export CHECKPOINT_DIR=$storage/checkpoints/$SLURM_JOB_NAME
# Fail now rather than at the first save, an epoch into training.
if ! mkdir -p "$CHECKPOINT_DIR" || [[ ! -w $CHECKPOINT_DIR ]]; then
    echo "error: cannot write checkpoints to $CHECKPOINT_DIR" >&2
    exit 1
fi

# --- Mila: stage the dataset on every node's local disk -------------------------------
# Each node has its own $SLURM_TMPDIR, so one task per node does the copy. The single
# quotes make $SLURM_TMPDIR expand on that node, not here. A copy that fails (or that a
# preemption stops) goes to supervise.py too.
# shellcheck disable=SC2016
python3 supervise.py srun --ntasks-per-node=1 --ntasks="$SLURM_JOB_NUM_NODES" bash -c \
    'mkdir -p "$SLURM_TMPDIR/data" &&
     cp /network/datasets/cifar10/cifar-10-python.tar.gz "$SLURM_TMPDIR/data/"'

# Each process holds open files: its connections to the other processes and to the
# rendezvous, its DataLoader workers' pipes. The limit per process that the job got
# from the shell that submitted it is often 1,024: raise it to the most the site
# allows. srun passes it on to the tasks.
ulimit -n "$(ulimit -Hn)"

# Where the tasks meet to form the process group: the first node of the
# job, which every node can reach by name, on a port derived from the job
# ID, so that two jobs sharing a node do not pick the same one.
# 10000-19999 is below the range the kernel uses for outgoing connections.
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
export MASTER_ADDR=${nodes[0]}
export MASTER_PORT=$((10000 + SLURM_JOB_ID % 10000))

# srun starts one task per GPU on every node, each with its own SLURM_PROCID. Arguments
# after `sbatch job.sh` reach main.py, as in a trial run, under a name of its own:
# `sbatch --job-name=trial job.sh --synthetic-data --max-steps 50`.
# --cpus-per-task: each task gets the CPUs per task that the job asked for, for its
# DataLoader workers. Slurm 23.11 and later pass them on to srun unasked; 22.05
# to 23.02 do not.
# --kill-on-bad-exit: if one task fails, end the others at once. With NCCL, they could
# otherwise wait for it in their next collective until a timeout.
# supervise.py runs srun, then decides: done, requeue (a crash, the time limit's
# warning), wait for Slurm (a preemption), or stop for good with the reason.
exec python3 supervise.py \
    srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" python main.py "$@"
