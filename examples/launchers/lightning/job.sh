#!/bin/bash
#SBATCH --job-name=lightning
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=8
#SBATCH --mem=128G
#SBATCH --time=04:00:00
# Allow the job to go back in the queue: this script requeues it after SIGUSR1.
#SBATCH --requeue
# SIGUSR1 to every task 120 s before the time limit: main.py saves a checkpoint and
# stops, and this script requeues the job. Without it, the time limit's SIGTERM
# stops training unsaved.
#SBATCH --signal=USR1@120
# Append, so that the log of every run of a requeued job stays in one file.
#SBATCH --open-mode=append
# singleton: one job of a name runs at a time, or two would write the same checkpoints.
#SBATCH --dependency=singleton
# --- Site-specific #SBATCH lines: remove a "#" to use one -----------------------------
# (values: see "Adapt it to your cluster" in the guide)
##SBATCH --partition=gpu
##SBATCH --account=my-project

# Stop at the first failing command.
set -e

# --- Site-specific: make torch importable, and say where the dataset lives ------------
# This is a virtual environment; create it once, on a login node:
#   python3 -m venv ~/venvs/ddp
#   ~/venvs/ddp/bin/pip install torch==2.14.1 torchvision==0.29.1 lightning==2.6.6
# That torch is built for CUDA 13.0: it needs NVIDIA driver 580 or newer, and GPUs of
# compute capability 7.5 (Turing) or newer.
# shellcheck source=/dev/null
source "$HOME/venvs/ddp/bin/activate"
# A folder with train/ and val/, one subfolder of images per class, on storage that
# every node reads. main.py reads DATA_DIR; `sbatch job.sh --synthetic-data` needs none.
export DATA_DIR=$SCRATCH/data/imagenet
# --- Site-specific: storage that outlives the job and that every node sees ------------
storage=${SCRATCH:?"is not set: set it, or this line, to shared storage outliving jobs"}
# The checkpoint of SIGUSR1, under the job's name: a requeued job resumes from it.
# Start a new run with another name: `sbatch --job-name=lightning-2 job.sh`.
export CHECKPOINT_DIR=$storage/checkpoints/$SLURM_JOB_NAME
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

# Where the processes meet to form the process group: the job's first node, which
# every node reaches by name, on a port derived from the job ID, so that two jobs
# sharing a node do not pick the same one. 10000-19999 is below the range the kernel
# hands out to outgoing connections.
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
export MASTER_ADDR=${nodes[0]}
export MASTER_PORT=$((10000 + SLURM_JOB_ID % 10000))

# main.py leaves this mark after SIGUSR1, once it has saved its checkpoint and stopped.
rm -f "$CHECKPOINT_DIR/requeue"
# Slurm's controller may not answer for a while (a restart, a failover): each call to it
# below tries again every 20 s, for about 3 minutes, before it fails.
ask_slurm() {
    local try
    for try in 1 2 3 4 5; do
        "$@" && return 0
        echo "$1 $2 failed (try $try of 6): trying again in 20 s" >&2
        sleep 20
    done
    "$@"
}

# srun starts one task per GPU on every node, each a process of the group. Lightning
# reads each task's place from srun's variables, and checks --ntasks-per-node against
# the GPUs per node, its `devices`.
# Arguments after `sbatch job.sh` reach main.py:
# `sbatch job.sh --synthetic-data --max-steps 50`.
# --cpus-per-task: each task gets the CPUs per task that the job asked for, for its
# DataLoader workers. Slurm 23.11 and later pass them on to srun unasked; 22.05
# to 23.02 do not.
# --kill-on-bad-exit: if one task fails, end the others at once. With NCCL, they could
# otherwise wait for it in their next collective until a timeout.
# --gpu-bind=none: every task sees all the GPUs the job holds on its node, and
# Lightning picks the one of its local rank, even where the site binds GPUs to tasks.
status=0
srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" --gpu-bind=none \
    python main.py "$@" || status=$?
# The job that a requeue below puts back in the queue: in a job array, this task alone.
# (The array's own ID, which one of its tasks has as its job ID, names every task.)
this_job=$SLURM_JOB_ID
[[ -z ${SLURM_ARRAY_TASK_ID:-} ]] || this_job=${SLURM_ARRAY_JOB_ID}_$SLURM_ARRAY_TASK_ID
# From here, not from main.py: NGC's and most other images have no scontrol. Even
# after a failure: the mark comes after a checkpoint saved whole.
if [[ -e $CHECKPOINT_DIR/requeue ]]; then
    # Slurm ends this script within seconds as it requeues the job: the sleep keeps it
    # from going on meanwhile.
    ask_slurm scontrol requeue "$this_job" && sleep 600
    echo "error: scontrol requeue failed: resubmit job.sh to resume" >&2
    exit 1
fi
# Preempted with a grace time (GraceTime, the partition's or the QOS's), main.py
# saved and stopped. Slurm 24.05 and later requeue the job once this script ends;
# older ones end it COMPLETED, unfinished: there, wait for the grace time to end,
# when Slurm requeues the job (or cancels it, as its PreemptMode says).
version=$(scontrol --version) || version=""  # "slurm 23.11.4", "slurm-wlm 23.11.4"
version=${version##* } && version=${version%%.*}
if ((status == 0 && ${version:-99} < 24)) &&
    [[ $(ask_slurm scontrol show job "$this_job") == *" PreemptTime="[0-9]* ]]
then
    sleep infinity
fi
exit "$status"
