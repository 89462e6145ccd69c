# shellcheck shell=bash
# KAUST Ibex, as its jobs see it (see docs/testing.md):
# - /ibex/user/$USER/miniconda3: the user's own conda, whose bin/activate
#   knows the environment dist-pytorch
#   (tests/sites/ibex/miniconda3/bin/activate); Ibex's scripts load no module;
# - /ibex/ai/reference/CV/tinyimagenet: a small synthetic TinyImageNet in the real
#   layout, made by tests/helpers/tinyimagenet.py when the cluster starts;
# - two network interfaces per node, the second standing in for InfiniBand, as on Ibex.
# - no $SLURM_TMPDIR: the cluster's TaskProlog gives every job one, which this removes.
export LAB_MODULES=""
export LAB_CONDA_ENVS=""
unset SLURM_TMPDIR
# shellcheck source=tests/sites/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
