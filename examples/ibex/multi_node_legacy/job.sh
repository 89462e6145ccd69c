#!/bin/bash
#SBATCH --job-name=ibex_multi_node_legacy
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus=4
#SBATCH --gpus-per-node=2
#SBATCH --constraint=a100
#SBATCH --cpus-per-task=16
#SBATCH --mem=64G
#SBATCH --time=00:10:00

# The older way to launch, as earlier Ibex documentation showed it: kept to compare with
# ../multi_node/job.sh, which the Ibex page explains. Do not start new work from it.
set -e

scontrol show job "$SLURM_JOB_ID"

# --- Ibex: software environment and data ----------------------------------------------
# The environment of ../multi_node/job.sh, created once, on a login node:
#   conda create -y -n dist-pytorch python=3.11
#   conda activate dist-pytorch
#   pip install torch==2.14.1 torchvision==0.29.1
# That torch is built for CUDA 13.0: it needs NVIDIA driver 580 or newer, and GPUs of
# compute capability 7.5 or newer, such as the A100s asked for above.
# shellcheck source=/dev/null
source "/ibex/user/$USER/miniconda3/bin/activate" dist-pytorch
export DATA_DIR=/ibex/ai/reference/CV/tinyimagenet

export NCCL_DEBUG=WARN
export PYTHONFAULTHANDLER=1
export OMP_NUM_THREADS=1

mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
head_node=${nodes[0]}
# The head node's address: whichever comes second in its list of addresses.
master_ip=$(srun --nodes=1 --ntasks=1 --gpus=1 -w "$head_node" hostname -I |
    cut -d " " -f 2)
# A port that is free on this node at this moment.
master_port=$(python -c 'import socket; s = socket.socket(); s.bind(("", 0))
print(s.getsockname()[1]); s.close()')
echo "Rendezvous at $master_ip:$master_port"

# One srun per node, in the background, each starting the
# deprecated launcher for its node.
# --gpu-bind=none: the task gets every GPU of its node, even where the job or the site
# binds GPUs to tasks (which Slurm 25.11 and later apply to a step of one task too).
for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do
    srun --nodes=1 --ntasks=1 -c "$SLURM_CPUS_PER_TASK" --gpus="$SLURM_GPUS_PER_NODE" \
        --gpu-bind=none -w "${nodes[i]}" \
        python -m torch.distributed.launch --use_env \
        --nproc_per_node="$SLURM_GPUS_ON_NODE" --nnodes="$SLURM_JOB_NUM_NODES" \
        --node_rank="$i" --master_addr="$master_ip" --master_port="$master_port" \
        main.py "$@" &
done
wait
