# shellcheck shell=bash
# A cluster that gives jobs no folder on each node's own disk: the generic site less
# $SLURM_TMPDIR, for the test that the template's job.sh, which unpacks the dataset
# there, stops at once with a message that says which line to set.
# shellcheck source=tests/sites/generic/profile.sh
source "$(dirname "${BASH_SOURCE[0]}")/../generic/profile.sh"
unset SLURM_TMPDIR
