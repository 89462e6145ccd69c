#!/bin/bash
#SBATCH --job-name=mp_spawn
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=2
#SBATCH --cpus-per-task=8
#SBATCH --mem=32G
#SBATCH --time=00:20:00

# Stop at the first failing command.
set -e

# --- Site-specific: make torch importable, and say where CIFAR-10 is unpacked ---------
# This is a virtual environment; create it once, on a login node:
#   python3 -m venv ~/venvs/ddp
#   ~/venvs/ddp/bin/pip install torch==2.14.1 torchvision==0.29.1
# That torch is built for CUDA 13.0: it needs NVIDIA driver 580 or newer, and GPUs of
# compute capability 7.5 (Turing) or newer.
# shellcheck source=/dev/null
source "$HOME/venvs/ddp/bin/activate"
DATA_DIR=$HOME/datasets/cifar10

# One process, on one node, which spawns one process per GPU itself: no srun or
# torchrun. mp.spawn cannot reach other nodes, so this job asks for exactly one.
python main.py --data-dir "$DATA_DIR" "$@"
