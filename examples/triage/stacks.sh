#!/bin/bash
# Where is each process of a running job? This prints the Python stack of every process
# of the job, on every node, with the node, the rank and the parent process:
#
#     bash stacks.sh <job ID> > stacks.txt
#
# Run it from a login node while the job hangs or crawls, in the environment the job
# uses: it needs py-spy on PATH (pip install py-spy).
set -euo pipefail

given=${1:?"usage: bash stacks.sh <job ID>"}
# The job's own ID (for an array task, not its name 123_4) and its node count. A
# heterogeneous job or a whole array gives several lines: one job at a time, please.
mapfile -t lines < <(squeue -h -j "$given" -t RUNNING -o "%A %D" 2>/dev/null) || true
if [[ ${#lines[@]} -ne 1 ]]; then
    echo "error: $given is not one running job. Give a running job's ID" \
        "(squeue --me)." >&2
    exit 1
fi
read -r job_id nodes <<< "${lines[0]}"
if ! command -v py-spy >/dev/null; then
    echo "error: py-spy is not on PATH. Activate the job's environment, then" \
        "pip install py-spy." >&2
    exit 1
fi

# One more step in the job, one task per node. --overlap lets it share the CPUs that the
# running step holds; without it, the new step waits for that step to end.
# On each node, the job's processes are those whose environment names the job and the
# node. py-spy reads the stack of each Python process among them. --nonblocking reads it
# without pausing the process, and timeout gives up on a process that does not answer.
# --label and sort keep each node's lines together; sed takes the labels off again.
# shellcheck disable=SC2016  # the script in single quotes is expanded on each node
srun --jobid="$job_id" --overlap --nodes="$nodes" --ntasks-per-node=1 --label bash -c '
    found=0
    for proc in /proc/[0-9]*; do
        pid=${proc#/proc/}
        [[ $(readlink "$proc/exe" 2>/dev/null) == *python* ]] || continue
        environ=$(tr "\0" "\n" < "$proc/environ" 2>/dev/null) || continue
        grep -qx "SLURM_JOB_ID=$SLURM_JOB_ID" <<< "$environ" || continue
        grep -qx "SLURMD_NODENAME=$SLURMD_NODENAME" <<< "$environ" || continue
        grep -qx "SLURM_STEP_ID=$SLURM_STEP_ID" <<< "$environ" && continue
        command=$(tr "\0" " " < "$proc/cmdline")
        rank=$(sed -n "s/^RANK=//p" <<< "$environ")  # set by torchrun
        task=$(sed -n "s/^SLURM_PROCID=//p" <<< "$environ")  # set by srun
        if [[ -n $rank ]]; then
            who="rank $rank"
        elif [[ $command == *torchrun* || $command == *torch.distributed.* ]]; then
            who="launcher of task $task"
        else
            who="rank $task"  # srun starts one task per rank
        fi
        parent=$(ps -o ppid= -p "$pid" | tr -d " ")
        echo "=== $(hostname) pid $pid (parent $parent) $who: $command"
        timeout 60 py-spy dump --nonblocking --pid "$pid" || true
        found=$((found + 1))
    done
    if [[ $found -eq 0 ]]; then
        echo "=== $(hostname): no Python process of job $SLURM_JOB_ID"
    fi
' | sort --stable --numeric-sort --key=1,1 | sed 's/^ *[0-9]*: //'
