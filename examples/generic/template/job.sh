#!/bin/bash
#SBATCH --job-name=template
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=8
#SBATCH --mem=128G
#SBATCH --time=12:00:00
# Allow the job to go back in the queue, whether Slurm preempts it or it asks itself.
#SBATCH --requeue
# SIGUSR1 to every task 120 s before the time limit: time to save and requeue. Without
# `B:`, Slurm signals the tasks that srun started, which is where Python runs.
#SBATCH --signal=USR1@120
# Append, so that the log of every run of a requeued job stays in one file.
#SBATCH --open-mode=append
# The job name names the run: its checkpoints are kept under it, so that a job
# resubmitted with the same name resumes, after a time limit, an scancel or a failed
# requeue. Start a new run with another name: `sbatch --job-name=template-2 job.sh`.
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

# --- Site-specific: make torch importable, and say where the dataset goes -------------
# This is a virtual environment; create it once, on a login node:
#   python3 -m venv ~/venvs/ddp
#   ~/venvs/ddp/bin/pip install torch==2.14.1 torchvision==0.29.1
# That torch is built for CUDA 13.0: it needs NVIDIA driver 580 or newer, and GPUs of
# compute capability 7.5 (Turing) or newer.
# shellcheck source=/dev/null
source "$HOME/venvs/ddp/bin/activate"
# The dataset: train/ and val/ (one subfolder of images per class), packed once into
# one uncompressed archive (JPEGs do not compress) on storage that every node reads:
#   tar -cf $SCRATCH/data/imagenet.tar -C /path/to/imagenet train val
# A language model's token files (language_model.py) go in an archive of their own:
#   tar -cf $SCRATCH/data/tokens.tar -C /path/to/tokens train.bin val.bin
# `sbatch job.sh --synthetic-data` needs none. An archive named at submission wins:
# `sbatch --export=ALL,DATA_ARCHIVE=$SCRATCH/data/tokens.tar job.sh`.
export DATA_ARCHIVE=${DATA_ARCHIVE:-$SCRATCH/data/imagenet.tar}
# A folder on each node's own disk, private to the job, the same path on every node:
# $SLURM_TMPDIR at Mila and the Alliance; /tmp where Slurm gives each job its own
# (job_container/tmpfs to Slurm 25.05; namespace/tmpfs or namespace/linux from 25.11).
local_disk=$SLURM_TMPDIR
export DATA_DIR=$local_disk/dataset  # unpacked there; main.py reads it there
# --- Site-specific: storage that outlives the job and that every node sees ------------
storage=${SCRATCH:?"is not set: set it, or this line, to shared storage outliving jobs"}
export CHECKPOINT_DIR=$storage/checkpoints/$SLURM_JOB_NAME

# --- A sweep: one run per task of a job array -----------------------------------------
# `sbatch --job-name=lr-sweep --array=0-2%2 job.sh --epochs 10` runs one run per line of
# SWEEP_FILE (sweep.txt by default), 2 at a time (%2): task 0 adds the first line's
# arguments to those after job.sh, task 1 the second's. Each task has its own
# checkpoints and is requeued on its own. The tasks of one array run together:
# singleton holds back another job of the same name only.
settings=()
if [[ -n ${SLURM_ARRAY_TASK_ID:-} ]]; then
    sweep=${SWEEP_FILE:-sweep.txt}
    if [[ ! -r $sweep ]]; then
        echo "error: this is task $SLURM_ARRAY_TASK_ID of a job array, and there is" \
            "no file $sweep of settings, one line per task: write it, or set" \
            "SWEEP_FILE (sbatch --export=ALL,SWEEP_FILE=...)" >&2
        exit 1
    fi
    # The lines that are not blank or comments, without a Windows line end ($'\r').
    mapfile -t lines < <(tr -d '\r' <"$sweep" | grep -v -e '^\s*#' -e '^\s*$')
    if ((SLURM_ARRAY_TASK_ID >= ${#lines[@]})); then
        echo "error: task $SLURM_ARRAY_TASK_ID has no line in $sweep, which has" \
            "${#lines[@]}: submit with --array=0-$((${#lines[@]} - 1)) (0-N: one task" \
            "per line)" >&2
        exit 1
    fi
    # Split at spaces; quotes are not read: a value holds no space.
    read -ra settings <<<"${lines[SLURM_ARRAY_TASK_ID]}"
    echo "Task $SLURM_ARRAY_TASK_ID of array $SLURM_ARRAY_JOB_ID: ${settings[*]}"
    # A folder of its own, by its number: a sweep resubmitted under its name resumes.
    export CHECKPOINT_DIR=$CHECKPOINT_DIR/task-$SLURM_ARRAY_TASK_ID
fi
# Fail now rather than at the first save, an epoch into training.
if ! mkdir -p "$CHECKPOINT_DIR" || [[ ! -w $CHECKPOINT_DIR ]]; then
    echo "error: cannot write checkpoints to $CHECKPOINT_DIR" >&2
    exit 1
fi
# The task's own arguments come last: they win over the same ones after job.sh.
set -- "$@" "${settings[@]}"

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

# --- Copy the dataset to every node's own disk ----------------------------------------
# Read from shared storage, an epoch opens 1.28 million small files among the nodes:
# slow for this job and for everyone else's. Each node unpacks the archive instead, at
# each start. A trial run with --synthetic-data (written in full) skips it.
if [[ " $* " != *" --synthetic-data "* ]]; then
    if [[ -z $local_disk ]]; then
        echo "error: SLURM_TMPDIR is not set: set local_disk in job.sh to a folder on" \
            "each node's own disk" >&2
        exit 1
    fi
    start=$SECONDS
    # One task per node: stage.py checks that the archive is there and fits, then
    # unpacks it. A failure goes to supervise.py, as after training (below).
    python3 supervise.py srun --ntasks-per-node=1 --ntasks="$SLURM_JOB_NUM_NODES" \
        python3 stage.py
    echo "Unpacked the dataset in $DATA_DIR on every node in $((SECONDS - start)) s."
fi

# Where the processes meet to form the process group: the job's first node, which
# every node reaches by name, on a port derived from the job ID, so that two jobs
# sharing a node do not pick the same one. 10000-19999 is below the range the kernel
# hands out to outgoing connections.
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
export MASTER_ADDR=${nodes[0]}
export MASTER_PORT=$((10000 + SLURM_JOB_ID % 10000))

# srun starts one task per GPU on every node, each a process of the group.
# Arguments after `sbatch job.sh` reach main.py, as in a trial run, under a name of
# its own: `sbatch --job-name=trial job.sh --synthetic-data --max-steps 200`.
# --cpus-per-task: each task gets the CPUs per task that the job asked for, for its
# DataLoader workers. Slurm 23.11 and later pass them on to srun unasked; 22.05
# to 23.02 do not.
# --kill-on-bad-exit: if one task fails, end the others at once. With NCCL, they could
# otherwise wait for it in their next collective until a timeout.
# supervise.py runs srun, then decides: done, requeue (a crash, the time limit's
# warning), wait for Slurm (a preemption), or stop for good with the reason.
exec python3 supervise.py \
    srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" python main.py "$@"
