#!/bin/bash
# Where is each process of a running job? This prints the Python stack of every process
# of the job, on every node, with the host and the rank:
#
#     bash stacks.sh <job ID>
#
# Run it from a login node while the job hangs or crawls, in the environment the job
# uses: it needs py-spy on PATH (pip install py-spy).
set -euo pipefail

job_id=${1:?"usage: bash stacks.sh <job ID>"}
nodes=$(squeue --noheader --jobs="$job_id" --states=RUNNING --format=%D) || true
if [[ -z $nodes ]]; then
    echo "error: job $job_id is not running. Give a running job's ID (squeue --me)." >&2
    exit 1
fi
if ! command -v py-spy >/dev/null; then
    echo "error: py-spy is not on PATH. Activate the job's environment, then" \
        "pip install py-spy." >&2
    exit 1
fi

# One more step in the job, one task per node. --overlap lets it share the CPUs that the
# running step holds; without it, the new step waits for that step to end.
# On each node, `scontrol listpids` lists the job's processes (PID, job, step, ...), and
# py-spy reads the stack of each Python process among them without stopping it.
# --label and sort keep each node's lines together; sed takes the labels off again.
# shellcheck disable=SC2016  # the script in single quotes is expanded on each node
srun --jobid="$job_id" --overlap --nodes="$nodes" --ntasks-per-node=1 --label bash -c '
    for pid in $(scontrol listpids "$SLURM_JOB_ID" \
            | awk -v me="$SLURM_STEP_ID" "NR > 1 && \$3 != me { print \$1 }"); do
        [[ $(readlink "/proc/$pid/exe") == *python* ]] || continue
        environ=$(tr "\0" "\n" < "/proc/$pid/environ")
        rank=$(sed -n "s/^RANK=//p" <<< "$environ")  # set by torchrun
        rank=${rank:-$(sed -n "s/^SLURM_PROCID=//p" <<< "$environ")}  # set by srun
        command=$(tr "\0" " " < "/proc/$pid/cmdline")
        echo "=== $(hostname) pid $pid rank $rank: $command"
        py-spy dump --pid "$pid" || true
    done
' | sort --stable --numeric-sort --key=1,1 | sed 's/^ *[0-9]*: //'
