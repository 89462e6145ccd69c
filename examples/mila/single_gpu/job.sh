#!/bin/bash
#SBATCH --job-name=single_gpu
#SBATCH --gpus-per-node=rtx8000:1
#SBATCH --cpus-per-task=4
#SBATCH --ntasks-per-node=1
#SBATCH --mem=16G
#SBATCH --time=00:15:00

# Stop at the first failing command rather than train on a half-prepared job.
set -e

echo "Date:     $(date)"
echo "Hostname: $(hostname)"

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

# --- Mila: stage the dataset on the node's local disk ---------------------------------
# $SLURM_TMPDIR is fast and private to the job; /network is slow to read in training.
mkdir -p "$SLURM_TMPDIR/data"
cp /network/datasets/cifar10/cifar-10-python.tar.gz "$SLURM_TMPDIR/data/"

# Arguments after `sbatch job.sh` reach main.py:
# `sbatch job.sh --synthetic-data --max-steps 50`.
python main.py "$@"
