# shellcheck shell=bash
# Any Slurm cluster, as the generic job scripts expect it (see docs/testing.md):
# - $HOME/venvs/ddp: a virtual environment with the examples' dependencies, bind-mounted
#   on every node from tests/sites/generic/venv;
# - $SCRATCH, shared by the nodes and kept between jobs, for checkpoints, and
#   with data/imagenet: a small image folder made by tests/helpers/tinyimagenet.py
#   when the cluster starts, in ImageNet's train/<class>/ and val/<class>/
#   layout, for the image_classifier example, and imagenet.tar, an archive of it
#   that the template copies to each node;
# - $SLURM_TMPDIR, per job and node, from the cluster's TaskProlog: a folder on
#   each node's own disk, as Mila and the Alliance give (sites whose Slurm gives every
#   job its own /tmp are alike), for the template's copy of the dataset;
# - no modules.
export LAB_MODULES=""
export LAB_CONDA_ENVS=""
export SCRATCH=/tmp/ddp-slurm-lab/scratch
# Apptainer (the container example, on Slurm 26.05): in user-namespace mode, since its
# privileged mode needs capabilities that this machine does not grant, even to root.
# Its default binds stay, /tmp among them.
export APPTAINER_USERNS=1
# shellcheck source=tests/sites/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
