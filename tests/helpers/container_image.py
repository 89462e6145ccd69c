"""The test cluster's stand-in for an NGC PyTorch image: an Apptainer sandbox (a folder
image) made of hard links in 1 to 3 s (104,000 files), so it needs no cache.

It holds what such an image holds, and lacks what it lacks:
- the node root's Debian, less Slurm's commands and munge (NGC images have none: no
  scontrol, no srun inside);
- the test suite's Python (in /opt/python) and its virtual environment with the pinned
  torch (in /opt/venv), first on PATH through the image's environment file, as a
  definition file's %environment sets it;
- PYTORCH_VERSION in its environment, as NVIDIA's PyTorch images set it (pyxis and
  enroot's PyTorch hook look for it).

Hard links need the root, the Python and the image on one file system; they are here
(/var/cache, /root, /work and /tmp).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

SLURM_FILES = [
    "usr/bin/srun", "usr/bin/sbatch", "usr/bin/salloc", "usr/bin/scontrol",
    "usr/bin/squeue", "usr/bin/scancel", "usr/bin/sinfo", "usr/bin/sacct",
    "usr/bin/sstat", "usr/sbin/slurmd", "usr/sbin/slurmctld", "usr/sbin/munged",
]  # fmt: skip


def make(root: Path, image: Path) -> Path:
    """Makes the sandbox image at `image` from the node root `root`."""
    shutil.rmtree(image, ignore_errors=True)
    image.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-al", str(root), str(image)], check=True)
    for name in SLURM_FILES:
        (image / name).unlink(missing_ok=True)
    # The Python, in /opt/python, and the virtual environment with the pinned torch, in
    # /opt/venv. Hard links share their files with the originals: files to change are
    # removed first, then written anew.
    base, venv = Path(sys.base_prefix).resolve(), Path(sys.prefix)
    subprocess.run(["cp", "-al", str(base), str(image / "opt/python")], check=True)
    subprocess.run(["cp", "-al", str(venv), str(image / "opt/venv")], check=True)
    interpreter = Path(sys.executable).resolve().name  # python3.11
    for link in (image / "opt/venv/bin").glob("python*"):
        link.unlink()
        link.symlink_to(f"/opt/python/bin/{interpreter}")
    config = image / "opt/venv/pyvenv.cfg"
    lines = config.read_text().splitlines()
    config.unlink()
    config.write_text(
        "".join(
            "home = /opt/python/bin\n" if line.startswith("home") else f"{line}\n"
            for line in lines
        )
    )
    env = image / ".singularity.d" / "env"
    env.mkdir(parents=True, exist_ok=True)
    (env / "90-environment.sh").write_text(
        "export PATH=/opt/venv/bin:$PATH\n"
        f"export PYTORCH_VERSION={version('torch').split('+')[0]}\n"
    )
    return image


if __name__ == "__main__":
    make(Path(sys.argv[1]), Path(sys.argv[2]))
