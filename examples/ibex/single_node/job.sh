#!/bin/bash
#SBATCH --job-name=ibex_single_node
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus=2
#SBATCH --gpus-per-node=2
#SBATCH --constraint=a100
#SBATCH --cpus-per-task=16
#SBATCH --mem=64G
#SBATCH --time=00:10:00

# Stop at the first failing command rather than train on a half-prepared job.
set -e

# The resources Slurm granted, at the top of the output, for when something looks wrong.
# Only a record: if the controller does not answer (a restart, say), the job goes on.
scontrol show job "$SLURM_JOB_ID" || true

# --- Ibex: software environment and data ----------------------------------------------
# A conda environment in your own folder; create it once, on a login node:
#   conda create -y -n dist-pytorch python=3.11
#   conda activate dist-pytorch
#   pip install torch==2.14.1 torchvision==0.29.1
# That torch is built for CUDA 13.0: it needs NVIDIA driver 580 or newer, and GPUs of
# compute capability 7.5 or newer. Hence --constraint=a100: Ibex's V100 (7.0) and P100
# (6.0) nodes cannot run it.
# shellcheck source=/dev/null
source "/ibex/user/$USER/miniconda3/bin/activate" dist-pytorch
export DATA_DIR=/ibex/ai/reference/CV/tinyimagenet

# NCCL_DEBUG=WARN logs NCCL's warnings and errors only. To debug a slow or
# hanging job, set INFO: it logs the network and GPU links NCCL picks at start
# (the troubleshooting page says which lines to read). PYTHONFAULTHANDLER=1
# prints each thread's Python stack when a process dies of a fatal signal,
# such as the abort by which NCCL's watchdog ends a collective that timed out:
# a hang that ends that way shows where. (SIGTERM and SIGKILL print nothing.)
export NCCL_DEBUG=WARN
export PYTHONFAULTHANDLER=1
# The processes get their parallelism from DataLoader workers and the GPU; one OpenMP
# thread each keeps them from crowding the task's CPUs.
export OMP_NUM_THREADS=1
# torchrun starts a process per GPU itself, so it must run once per node. With one srun
# task per GPU instead, each of G tasks would start G processes: G x G in all.
if ((SLURM_NTASKS != SLURM_JOB_NUM_NODES)); then
    echo "error: $SLURM_NTASKS tasks on $SLURM_JOB_NUM_NODES node(s), but torchrun" \
        "must run once per node: use #SBATCH --ntasks-per-node=1" >&2
    exit 1
fi

# The rendezvous: the job's first node, by the name every node resolves, and a port
# derived from the job ID, so that jobs sharing a node use different ports. torchrun's
# c10d rendezvous listens there itself, on whichever node it is.
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
head_node=${nodes[0]}
port=$((10000 + SLURM_JOB_ID % 10000))
echo "Rendezvous at $head_node:$port"

# One torchrun per node, each starting one process per GPU of its node.
# Arguments after `sbatch job.sh` reach main.py, e.g. `sbatch job.sh --epochs 1`.
# --cpus-per-task: each task gets the CPUs per task that the job asked for, for its
# DataLoader workers. Slurm 23.11 and later pass them on to srun unasked; 22.05
# to 23.02 do not.
# --kill-on-bad-exit: if one node's torchrun fails, end the others at once.
# --gpu-bind=none: the task gets every GPU of its node, for all of torchrun's
# processes, even where the job or the site binds GPUs to tasks (which Slurm 25.11
# and later apply to a step of one task per node too).
srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" --gpu-bind=none \
    torchrun \
    --nnodes="$SLURM_JOB_NUM_NODES" \
    --nproc-per-node="$SLURM_GPUS_ON_NODE" \
    --rdzv-backend=c10d \
    --rdzv-endpoint="$head_node:$port" \
    --rdzv-id="$SLURM_JOB_ID" \
    main.py "$@"
