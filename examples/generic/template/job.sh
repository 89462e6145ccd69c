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
# SIGUSR1 to every task 120 s before the time limit: time to
# save a checkpoint and requeue. Without `B:`, Slurm signals
# the tasks that srun started, which is where Python runs.
#SBATCH --signal=USR1@120
# Append, so that the log of every run of a requeued job stays in one file.
#SBATCH --open-mode=append
# The job name names the run: its checkpoints are kept under it, so that a job
# resubmitted with the same name resumes, after a time limit, an scancel or a failed
# requeue. Start a new run with another name: `sbatch --job-name=template-2 job.sh`.
# singleton: one job of a name runs at a time, or two would write the same checkpoints.
# (The tasks of one job array still run together: see "A sweep" below.)
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
# The dataset: a folder with train/ and val/, one subfolder of images per class, packed
# once into one archive, with train/ and val/ at its top, on storage that every node
# reads. JPEGs do not compress: leave it uncompressed. For example, in a CPU job:
#   tar -cf $SCRATCH/data/imagenet.tar -C /path/to/imagenet train val
# A language model's token files (the section of language_model.py) travel the same
# way, in an archive of their own:
#   tar -cf $SCRATCH/data/tokens.tar -C /path/to/tokens train.bin val.bin
# `sbatch job.sh --synthetic-data` needs none. An archive named at submission wins:
# `sbatch --export=ALL,DATA_ARCHIVE=$SCRATCH/data/tokens.tar job.sh`.
export DATA_ARCHIVE=${DATA_ARCHIVE:-$SCRATCH/data/imagenet.tar}
# A folder on each node's own disk, private to the job and emptied when it ends, at the
# same path on every node: each node unpacks the archive there. $SLURM_TMPDIR at Mila
# and the Alliance; /tmp where Slurm gives each job its own (job_container/tmpfs up to
# Slurm 25.05, namespace/tmpfs or namespace/linux from 25.11).
local_disk=$SLURM_TMPDIR
# main.py reads the dataset from DATA_DIR.
export DATA_DIR=$local_disk/dataset
# --- Site-specific: storage that outlives the job and that every node sees ------------
storage=${SCRATCH:?"is not set: set it, or this line, to shared storage outliving jobs"}
export CHECKPOINT_DIR=$storage/checkpoints/$SLURM_JOB_NAME
# Fail now rather than at the first save, an epoch into training.
if ! mkdir -p "$CHECKPOINT_DIR" || [[ ! -w $CHECKPOINT_DIR ]]; then
    echo "error: cannot write checkpoints to $CHECKPOINT_DIR" >&2
    exit 1
fi

# --- A sweep: one run per task of a job array -----------------------------------------
# `sbatch --job-name=lr-sweep --array=0-2%2 job.sh --epochs 10` runs one run per line of
# the file SWEEP_FILE (sweep.txt by default), 2 at a time (%2; without it, as many as
# fit): task 0 adds the first line's arguments to those after job.sh, task 1 the
# second's. Each task has its own checkpoints, under the job name and its task number,
# and is requeued on its own. The tasks of one array run together: singleton holds back
# another job of the same name only.
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
    # A folder of its own in the sweep's, named by the task's number: a sweep
    # resubmitted under the same name resumes each of its tasks.
    export CHECKPOINT_DIR=$CHECKPOINT_DIR/task-$SLURM_ARRAY_TASK_ID
    if ! mkdir -p "$CHECKPOINT_DIR" || [[ ! -w $CHECKPOINT_DIR ]]; then
        echo "error: cannot write checkpoints to $CHECKPOINT_DIR" >&2
        exit 1
    fi
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
# Training reads every image once an epoch: from shared storage, 1.28 million small
# files opened per epoch among the nodes, slow for this job and for everyone else's.
# One task per node unpacks the archive instead, before training; each requeued start
# does it again. A trial run with --synthetic-data (written in full) skips it.
if [[ " $* " != *" --synthetic-data "* ]]; then
    if [[ -z $local_disk ]]; then
        echo "error: SLURM_TMPDIR is not set: set local_disk in job.sh to a folder on" \
            "each node's own disk" >&2
        exit 1
    fi
    if [[ ! -r $DATA_ARCHIVE ]]; then
        echo "error: no dataset archive at $DATA_ARCHIVE: make it (see DATA_ARCHIVE" \
            "in job.sh), or try the job with --synthetic-data" >&2
        exit 1
    fi
    start=$SECONDS
    # The single quotes: each task's shell reads the two exported variables itself,
    # and checks its own node's disk first. An uncompressed archive unpacks to its own
    # size, and a little more for the last block of each file: 5%, to be safe.
    # shellcheck disable=SC2016
    srun --ntasks-per-node=1 --ntasks="$SLURM_JOB_NUM_NODES" bash -c '
        mkdir -p "$DATA_DIR" || exit 1
        need=$(($(stat -c %s "$DATA_ARCHIVE") * 105 / 100))
        free=$(df --output=avail -B1 "$DATA_DIR" | tail -n 1)
        if ((free < need)); then
            echo "error: $(hostname): $DATA_DIR has $((free >> 30)) GiB free, and the" \
                "dataset needs $((need >> 30)) GiB: set local_disk in job.sh to a" \
                "larger disk, or read the dataset where it is" >&2
            exit 1
        fi
        # In memory (tmpfs), the dataset counts against the memory the job asked for
        # on the node, whatever the size of the folder: leave half to training. Asked
        # per CPU or per GPU, that memory times the CPUs or GPUs on the node. In MB.
        memory=${SLURM_MEM_PER_NODE:-$((${SLURM_MEM_PER_CPU:-0} * SLURM_CPUS_ON_NODE +
            ${SLURM_MEM_PER_GPU:-0} * ${SLURM_GPUS_ON_NODE:-0}))}
        memory=$((memory << 20))
        if [[ $(stat -f -c %T "$DATA_DIR") == tmpfs ]] &&
            ((memory > 0 && need > memory / 2)); then
            echo "error: $(hostname): $DATA_DIR is in memory (tmpfs): the dataset" \
                "needs $((need >> 30)) GiB of the $((memory >> 30)) GiB the job asked" \
                "for per node, more than half. Ask for more (--mem), or set" \
                "local_disk in job.sh to a folder on a disk" >&2
            exit 1
        fi
        tar -xf "$DATA_ARCHIVE" -C "$DATA_DIR"'
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
# The newest checkpoint's name: if srun fails and it has changed, this start saved one.
newest_checkpoint() {
    find "$CHECKPOINT_DIR" -maxdepth 1 -name "*step-*" ! -name "*.tmp" -printf "%f\n" |
        sort | tail -n 1
}
before=$(newest_checkpoint)
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
# The job that a requeue below puts back in the queue: in a job array, this task alone.
# (The array's own ID, which one of its tasks has as its job ID, names every task.)
this_job=$SLURM_JOB_ID
[[ -z ${SLURM_ARRAY_TASK_ID:-} ]] || this_job=${SLURM_ARRAY_JOB_ID}_$SLURM_ARRAY_TASK_ID
# main.py leaves these marks: when it stops on an error that a person must act on; when
# it finds no scontrol to requeue the job with (in a container, say).
rm -f "$CHECKPOINT_DIR/stopped-on-error" "$CHECKPOINT_DIR/requeue"
status=0
srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" python main.py "$@" ||
    status=$?
# After SIGUSR1, main.py asks for a requeue that it could not make itself.
if [[ $status == 0 && -e $CHECKPOINT_DIR/requeue ]]; then
    ask_slurm scontrol requeue "$this_job" && sleep 600
    echo "error: scontrol requeue failed: resubmit job.sh to resume" >&2
    exit 1
fi
if ((status == 0)); then
    # Preempted with a grace time (GraceTime, the partition's or the QOS's), main.py
    # saved and stopped. Slurm 24.05 and later requeue the job once this script ends;
    # older ones end it COMPLETED, unfinished: there, wait for the grace time to end,
    # when Slurm requeues the job (or cancels it, as its PreemptMode says).
    version=$(scontrol --version) || version=""  # "slurm 23.11.4", "slurm-wlm 23.11.4"
    version=${version##* } && version=${version%%.*}
    if ((${version:-99} < 24)) &&
        [[ $(ask_slurm scontrol show job "$this_job") == *" PreemptTime="[0-9]* ]]
    then
        sleep infinity
    fi
    exit 0
fi

# --- srun failed: a task crashed, or stopped on an error ------------------------------
# A process killed for want of memory, a GPU error, an NCCL timeout: requeue the job to
# resume from its last checkpoint, if this start saved one, at most CRASH_RESTARTS times
# per job. 0: never (`sbatch --export=ALL,CRASH_RESTARTS=0 job.sh`). A failure before
# the first save is most often a setting to fix, and would come again. (A lost node is
# Slurm's own to handle: it ends the job, which --requeue lets it requeue.)
max=${CRASH_RESTARTS:-3}
# Counted in the checkpoint folder, where a requeued start finds them. (On a full disk
# the count may fail: then only the need for a new checkpoint limits the requeues.)
echo "job $SLURM_JOB_ID: srun exited with status $status" >>"$CHECKPOINT_DIR/crashes" ||
    true
crashes=$(grep -c "^job $SLURM_JOB_ID:" "$CHECKPOINT_DIR/crashes" || true)
if [[ -e $CHECKPOINT_DIR/stopped-on-error ]]; then
    why="main.py stopped on an error of its own, above"
elif [[ $(newest_checkpoint) == "$before" ]]; then
    why="before this start saved a checkpoint"
elif ((crashes > max)); then
    why="failure $crashes of this job, over CRASH_RESTARTS=$max"
else
    echo "srun exited with status $status: requeueing the job to resume from its last" \
        "checkpoint (failure $crashes of the $max allowed)" >&2
    # Slurm ends this script within seconds as it requeues the job: the sleep keeps it
    # from going on meanwhile.
    ask_slurm scontrol requeue "$this_job" && sleep 600
    why="scontrol requeue failed"
fi
echo "error: srun exited with status $status, $why: the job is not requeued. Fix the" \
    "cause, then resubmit: the job resumes from its checkpoint in $CHECKPOINT_DIR, if" \
    "it has one." >&2
exit "$status"
