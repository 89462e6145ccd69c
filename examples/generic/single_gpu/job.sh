#!/bin/bash
#SBATCH --job-name=single_gpu
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --mem=32G
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
# PYTHONFAULTHANDLER=1 prints each thread's Python stack when the process dies of a
# fatal signal, such as a segmentation fault. (SIGTERM and SIGKILL print nothing.)
export PYTHONFAULTHANDLER=1
# The process gets its parallelism from DataLoader workers and the GPU; one OpenMP
# thread keeps it from crowding the workers' CPUs.
export OMP_NUM_THREADS=1

# One process, on the job's GPU. Arguments after `sbatch job.sh` reach main.py:
# `sbatch job.sh --synthetic-data --max-steps 50`.
python main.py "$@"
