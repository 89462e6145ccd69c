# shellcheck shell=bash
# A cluster without $SCRATCH: the generic site less that
# variable, for the test that a checkpointing job.sh stops before
# srun with a message, instead of failing at its first save.
# shellcheck source=tests/sites/generic/profile.sh
source "$(dirname "${BASH_SOURCE[0]}")/../generic/profile.sh"
unset SCRATCH
