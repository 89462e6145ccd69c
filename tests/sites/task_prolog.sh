#!/bin/bash
# Slurm's TaskProlog: runs before the batch script and before every srun task, on that
# task's node. Each line it prints as `export NAME=value` lands in the task's
# environment. Sites whose profile sets LAB_TMPDIR=1 get what Mila's own prolog gives a
# job: $SLURM_TMPDIR, a folder private to the job on each node's local disk.
if [[ ${LAB_TMPDIR:-} == 1 ]]; then
    dir="/tmp/ddp-slurm-lab/tmp/$SLURM_JOB_ID/$SLURMD_NODENAME"
    mkdir -p "$dir"
    echo "export SLURM_TMPDIR=$dir"
fi
