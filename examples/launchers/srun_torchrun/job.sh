#!/bin/bash
#SBATCH --job-name=srun_torchrun
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
#SBATCH --mem=128G
#SBATCH --time=04:00:00
# --- Site-specific #SBATCH lines: remove a "#" to use one -----------------------------
# (values: see "Adapt it to your cluster" in the guide)
##SBATCH --partition=gpu
##SBATCH --account=my-project

# Stop at the first failing command.
set -e

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

# torchrun starts a process per GPU itself, so it must run once
# per node. With a task per GPU, each of G tasks would start G
# processes: G x G in all, and the job would fail or crawl.
if ((SLURM_NTASKS != SLURM_JOB_NUM_NODES)); then
    echo "error: $SLURM_NTASKS tasks on $SLURM_JOB_NUM_NODES node(s), but torchrun" \
        "must run once per node: use #SBATCH --ntasks-per-node=1" >&2
    exit 1
fi
# The rendezvous: the job's first node, by name, on a port derived from the job ID.
# torchrun's c10d rendezvous runs inside the torchrun on that node; --rdzv-id keeps
# other jobs out.
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")

# srun starts one torchrun per node, which starts one process per GPU of its node and
# gives each RANK, LOCAL_RANK and WORLD_SIZE: main.py reads them. Arguments after
# `sbatch job.sh` reach main.py: `sbatch job.sh --synthetic-data --max-steps 50`.
# --cpus-per-task: the task's CPUs, shared by its processes' DataLoader workers. Slurm
# 23.11 and later pass them on to srun unasked; 22.05 to 23.02 do not.
# --kill-on-bad-exit: if one node's torchrun fails, end the others at once.
# --gpu-bind=none: the task gets every GPU of its node, for all of torchrun's
# processes, even where the job or the site binds GPUs to tasks (which Slurm 25.11
# and later apply to a step of one task per node too).
srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" --gpu-bind=none \
    torchrun \
    --nnodes="$SLURM_JOB_NUM_NODES" \
    --nproc-per-node="$SLURM_GPUS_ON_NODE" \
    --rdzv-backend=c10d \
    --rdzv-endpoint="${nodes[0]}:$((10000 + SLURM_JOB_ID % 10000))" \
    --rdzv-id="$SLURM_JOB_ID" \
    main.py "$@"
