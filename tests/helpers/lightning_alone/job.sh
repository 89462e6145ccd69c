#!/bin/bash
# tests/test_frameworks.py: Lightning forms the process group itself (main.py), as its
# documentation has it, with no MASTER_ADDR of ours: Lightning sets it to the job's
# first node. Arguments: main.py's.
set -e
# shellcheck source=/dev/null
source "$HOME/venvs/ddp/bin/activate"
export OMP_NUM_THREADS=1
srun --kill-on-bad-exit=1 python main.py "$@"
