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
# SIGUSR1 to every task 120 s before the time limit: time to
# save a checkpoint and requeue. Without `B:`, Slurm signals
# the tasks that srun started, which is where Python runs.
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
# quotes make $SLURM_TMPDIR expand on that node, not here.
# shellcheck disable=SC2016
srun --ntasks-per-node=1 --ntasks="$SLURM_JOB_NUM_NODES" bash -c \
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
