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
# SIGUSR1 to every task 120 s before the time limit: time to
# save a checkpoint and requeue. Without `B:`, Slurm signals
# the tasks that srun started, which is where Python runs.
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

# --- Site-specific: the container image, and where the dataset lives ------------------
# main.py runs inside an image built from NVIDIA's PyTorch image, which has torch and
# torchvision. Build it once, on a login node: the top of pytorch.def says how.
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
if ! command -v apptainer >/dev/null; then
    echo "error: no apptainer command on $(hostname): load its module" \
        "(\`module load apptainer\` on many sites), or ask your site" >&2
    exit 1
fi
# IMAGE picks another image: `sbatch --export=ALL,IMAGE=$PWD/other.sif job.sh`.
image=${IMAGE:-$storage/images/pytorch-25.12.sif}
if [[ ! -e $image ]]; then
    echo "error: no container image at $image: build it with" \
        "\`apptainer build $image pytorch.def\`, or set IMAGE to yours" >&2
    exit 1
fi
# Inside, the container sees its image and the host folders that Apptainer binds: by
# default your home, /tmp and the folder you submitted from; then those in
# APPTAINER_BIND, at the same paths. Bind the storage, and the job's local folder where
# the site gives one; binds set before sbatch, or by a site's module, are kept.
binds=${APPTAINER_BIND:-${SINGULARITY_BIND:-}}
binds=${binds:+$binds,}$storage${SLURM_TMPDIR:+,$SLURM_TMPDIR}
export APPTAINER_BIND=$binds
# Fail now if a folder of the job is missing inside, not when main.py first needs it.
folders=("$CHECKPOINT_DIR")
[[ -d $DATA_DIR ]] && folders+=("$DATA_DIR")
# shellcheck disable=SC2016 # $f expands in the container's shell
list_missing='for f; do [ -d "$f" ] || echo "$f"; done'
if ! missing=$(apptainer exec "$image" sh -c "$list_missing" sh "${folders[@]}"); then
    echo "error: apptainer could not start $image (its error is above). Check that" \
        "every folder in APPTAINER_BIND exists on $(hostname):" \
        "APPTAINER_BIND=$APPTAINER_BIND" >&2
    exit 1
fi
if [[ -n $missing ]]; then
    echo "error: the container cannot see ${missing//$'\n'/, }: bind it, or a folder" \
        "above it, with APPTAINER_BIND before sbatch (now: $APPTAINER_BIND)" >&2
    exit 1
fi
# Packages that `pip install --user` put in your home would load before the image's.
export PYTHONNOUSERSITE=1

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
# Each task runs `apptainer exec`, which starts main.py in the image. --nv brings the
# node's NVIDIA driver libraries into the container: without them, CUDA finds no GPU.
status=0
srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" \
    apptainer exec --nv "$image" python main.py "$@" || status=$?
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
