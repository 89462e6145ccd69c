# shellcheck shell=bash
# Any Slurm cluster, as the generic job scripts expect it (see docs/testing.md):
# - $HOME/venvs/ddp: a virtual environment with the examples' dependencies, bind-mounted on
#   every node from tests/sites/generic/venv;
# - $SCRATCH, shared by the nodes and kept between jobs, for checkpoints;
# - no modules, datasets or $SLURM_TMPDIR: the generic smoke runs use synthetic data.
export LAB_MODULES=""
export LAB_CONDA_ENVS=""
export SCRATCH=/tmp/ddp-slurm-lab/scratch
# shellcheck source=tests/sites/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
