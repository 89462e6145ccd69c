#!/bin/bash
#SBATCH --job-name=mp_spawn
#SBATCH --nodes=1
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
# A folder with train/ and val/, one subfolder of images per class, on storage the
# node reads. main.py reads DATA_DIR; `sbatch job.sh --synthetic-data` needs none.
export DATA_DIR=$SCRATCH/data/imagenet

# The resources Slurm granted, at the top of the output, for when something looks wrong.
# Only a record: if the controller does not answer (a restart, say), the job goes on.
scontrol show job "$SLURM_JOB_ID" || true
export NCCL_DEBUG=WARN
export PYTHONFAULTHANDLER=1
export OMP_NUM_THREADS=1

# One process, on one node, which spawns one process per GPU itself: no srun or
# torchrun. mp.spawn cannot reach other nodes, so this job asks for exactly one.
# Arguments after `sbatch job.sh` reach main.py.
python main.py --nprocs "$SLURM_GPUS_ON_NODE" "$@"
