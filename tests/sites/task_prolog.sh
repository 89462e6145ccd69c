#!/bin/bash
# Slurm's TaskProlog: runs before the batch script and before every srun task, on that
# task's node. Each line it prints as `export NAME=value` lands in the task's
# environment. Every job gets what Mila's own prolog gives a job: $SLURM_TMPDIR, a
# folder private to the job on each node's local disk, at the same path on every node
# (the lab mounts each node's own folder at local-disk). The profiles of sites without
# one unset it.
dir="/tmp/ddp-slurm-lab/local-disk/$SLURM_JOB_ID"
mkdir -p "$dir"
echo "export SLURM_TMPDIR=$dir"
# A task that `srun --container-image` starts under pyxis, in an image that sets
# PYTORCH_VERSION (NVIDIA's), gets RANK and LOCAL_RANK from pyxis, and WORLD_SIZE,
# MASTER_PORT and MASTER_ADDR (the step's first node) from enroot's PyTorch hook, where
# the site enabled it. A test asks for them with LAB_PYXIS_PYTORCH=1.
if [[ ${LAB_PYXIS_PYTORCH:-} == 1 && -n ${SLURM_STEP_NODELIST:-} ]]; then
    echo "export RANK=$SLURM_PROCID"
    echo "export LOCAL_RANK=$SLURM_LOCALID"
    echo "export WORLD_SIZE=$SLURM_NTASKS"
    echo "export MASTER_PORT=$((SLURM_JOB_ID % 4536 + 61000))"
    first=$(scontrol show hostnames "$SLURM_STEP_NODELIST" | head -n 1)
    echo "export MASTER_ADDR=$first"
fi
