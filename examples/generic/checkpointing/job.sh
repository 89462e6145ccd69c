#!/bin/bash
#SBATCH --job-name=classifier
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=8
#SBATCH --mem=128G
#SBATCH --time=04:00:00
# Allow the job to go back in the queue, whether Slurm preempts it or it asks itself.
#SBATCH --requeue
# SIGUSR1 to every task 120 s before the time limit: time to save and requeue. Without
# `B:`, Slurm signals the tasks that srun started, which is where Python runs.
#SBATCH --signal=USR1@120
# Append, so that the log of every run of a requeued job stays in one file.
#SBATCH --open-mode=append
# The job name names the run: its checkpoints are kept under it, so that a job
# resubmitted with the same name resumes, after a time limit, an scancel or a failed
# requeue. Start a new run with another name: `sbatch --job-name=classifier-2 job.sh`.
# singleton: one job of a name runs at a time, or two would write the same checkpoints.
#SBATCH --dependency=singleton
# --- Site-specific #SBATCH lines: remove a "#" to use one -----------------------------
# (values: see "Adapt it to your cluster" in the guide)
##SBATCH --partition=gpu
##SBATCH --account=my-project

# Stop at the first failing command.
set -e

echo "Job $SLURM_JOB_ID, start number $((${SLURM_RESTART_COUNT:-0} + 1))," \
    "on $SLURM_JOB_NODELIST"

# --- Site-specific: make torch importable, and say where the dataset lives ------------
# This is a virtual environment; create it once, on a login node:
#   python3 -m venv ~/venvs/ddp
#   ~/venvs/ddp/bin/pip install torch==2.14.1 torchvision==0.29.1
# That torch is built for CUDA 13.0: it needs NVIDIA driver 580 or newer, and GPUs of
# compute capability 7.5 (Turing) or newer.
# shellcheck source=/dev/null
source "$HOME/venvs/ddp/bin/activate"
# A folder with train/ and val/, one subfolder of images per class, on storage that
# every node reads. main.py reads DATA_DIR; `sbatch job.sh --synthetic-data` needs none.
export DATA_DIR=$SCRATCH/data/imagenet
# --- Site-specific: storage that outlives the job and that every node sees ------------
storage=${SCRATCH:?"is not set: set it, or this line, to shared storage outliving jobs"}
export CHECKPOINT_DIR=$storage/checkpoints/$SLURM_JOB_NAME
# Fail now rather than at the first save, an epoch into training.
if ! mkdir -p "$CHECKPOINT_DIR" || [[ ! -w $CHECKPOINT_DIR ]]; then
    echo "error: cannot write checkpoints to $CHECKPOINT_DIR" >&2
    exit 1
fi

# The resources Slurm granted, at the top of the output, for when something looks wrong.
# Only a record: if the controller does not answer (a restart, say), the job goes on.
scontrol show job "$SLURM_JOB_ID" || true
# NCCL_DEBUG=WARN logs NCCL's warnings and errors only; INFO logs the network and GPU
# links it picks at start, to debug a slow or hanging job. PYTHONFAULTHANDLER=1 prints
# each thread's Python stack when a process dies of a fatal signal, such as the abort
# by which NCCL's watchdog ends a collective that timed out: a hang that ends that way
# shows where. (SIGTERM and SIGKILL print nothing.)
export NCCL_DEBUG=WARN
export PYTHONFAULTHANDLER=1
# The processes get their parallelism from DataLoader workers and the GPU; one OpenMP
# thread each keeps them from crowding the task's CPUs.
export OMP_NUM_THREADS=1
# Each process holds open files: its connections to the other processes and to the
# rendezvous, its DataLoader workers' pipes. The limit per process that the job got
# from the shell that submitted it is often 1,024: raise it to the most the site
# allows. srun passes it on to the tasks.
ulimit -n "$(ulimit -Hn)"

# Where the processes meet to form the process group: the job's first node, which
# every node reaches by name, on a port derived from the job ID, so that two jobs
# sharing a node do not pick the same one. 10000-19999 is below the range the kernel
# hands out to outgoing connections.
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
export MASTER_ADDR=${nodes[0]}
export MASTER_PORT=$((10000 + SLURM_JOB_ID % 10000))

# srun starts one task per GPU on every node, each a process of the group.
# Arguments after `sbatch job.sh` reach main.py, as in a trial run, under a name of
# its own: `sbatch --job-name=trial job.sh --synthetic-data --max-steps 50`.
# --cpus-per-task: each task gets the CPUs per task that the job asked for, for its
# DataLoader workers. Slurm 23.11 and later pass them on to srun unasked; 22.05
# to 23.02 do not.
# --kill-on-bad-exit: if one task fails, end the others at once. With NCCL, they could
# otherwise wait for it in their next collective until a timeout.
# supervise.py runs srun, then decides: done, requeue (a crash, the time limit's
# warning), wait for Slurm (a preemption), or stop for good with the reason.
exec python3 supervise.py \
    srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" python main.py "$@"
