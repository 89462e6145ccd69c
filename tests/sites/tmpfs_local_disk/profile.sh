# shellcheck shell=bash
# A cluster whose folder on each node for the job, $SLURM_TMPDIR, is in memory (tmpfs):
# the generic site with it in /dev/shm. For the test that the template's job.sh checks
# the dataset against the memory the job asked for, not the size of the folder.
# shellcheck source=tests/sites/generic/profile.sh
source "$(dirname "${BASH_SOURCE[0]}")/../generic/profile.sh"
export SLURM_TMPDIR=/dev/shm/ddp-slurm-lab-$SLURM_JOB_ID
