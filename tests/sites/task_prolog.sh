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
