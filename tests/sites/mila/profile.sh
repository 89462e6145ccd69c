# shellcheck shell=bash
# Mila, as its jobs see it (see docs/testing.md):
# - modules: anaconda/3, which provides `conda`; the examples need no other;
# - a conda environment named `pytorch`;
# - /network/datasets, bind-mounted on every node from
#   tests/sites/mila/datasets: an empty placeholder for the
#   CIFAR-10 archive, enough for job.sh's copy, as smoke runs use
#   --synthetic-data (the real archive has a checksum that no stand-in passes);
# - $SLURM_TMPDIR, per job and node, from the cluster's TaskProlog;
# - $SCRATCH, shared by the nodes and kept between jobs, for checkpoints.
export LAB_MODULES="anaconda/3"
export LAB_CONDA_ENVS="pytorch"
export SCRATCH=/tmp/ddp-slurm-lab/scratch
# shellcheck source=tests/sites/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
conda() {
    if [[ :${LOADEDMODULES:-}: != *:anaconda/3:* ]]; then
        echo "conda: command not found (on Mila, \`module load anaconda/3\` first)" >&2
        return 127
    fi
    lab_conda "$@"
}
