"""Unpacks the dataset archive (DATA_ARCHIVE) into DATA_DIR, on this node's own disk:
job.sh runs it as one task per node, before training. It checks first that the dataset
fits: on the disk, and, in a folder in memory (tmpfs), in the memory that the job asked
for. One that does not fit stops the job with the reason: a person must choose another
disk or ask for more memory, so supervise.py does not requeue it.
"""

import os
import shutil
import socket
import subprocess
from pathlib import Path

from supervise import ERROR_MARK, write_mark


def main():
    archive, folder = Path(os.environ["DATA_ARCHIVE"]), Path(os.environ["DATA_DIR"])
    if not os.access(archive, os.R_OK):
        stop(f"error: no dataset archive at {archive}: make it (see DATA_ARCHIVE in "
             "job.sh), or try the job with --synthetic-data")  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    node = socket.gethostname()
    # An uncompressed archive unpacks to its own size, and a little more for the last
    # block of each file: 5 %, to be safe.
    need = archive.stat().st_size * 105 // 100
    free = shutil.disk_usage(folder).free
    if free < need:
        stop(f"error: {node}: {folder} has {free >> 30} GiB free, and the dataset "
             f"needs {need >> 30} GiB: set local_disk in job.sh to a larger disk, or "
             "read the dataset where it is")  # fmt: skip
    # In memory (tmpfs), the dataset counts against the memory that the job asked for
    # on the node, whatever the size of the folder: leave half to training.
    memory = memory_per_node()
    if filesystem(folder) == "tmpfs" and 0 < memory < 2 * need:
        stop(f"error: {node}: {folder} is in memory (tmpfs): the dataset needs "
             f"{need >> 30} GiB of the {memory >> 30} GiB the job asked for per node, "
             "more than half. Ask for more (--mem), or set local_disk in job.sh to a "
             "folder on a disk")  # fmt: skip
    subprocess.run(["tar", "-xf", archive, "-C", folder], check=True)


def memory_per_node() -> int:
    """The memory that the job asked for on this node, in bytes; 0 if it did not say.
    Asked per CPU or per GPU, that memory times the CPUs or GPUs on the node."""
    env = os.environ
    if "SLURM_MEM_PER_NODE" in env:
        megabytes = int(env["SLURM_MEM_PER_NODE"])
    else:
        megabytes = int(env.get("SLURM_MEM_PER_CPU", 0)) * int(
            env.get("SLURM_CPUS_ON_NODE", 0)
        ) + int(env.get("SLURM_MEM_PER_GPU", 0)) * int(env.get("SLURM_GPUS_ON_NODE", 0))
    return megabytes << 20


def filesystem(folder: Path) -> str:
    """The type of the file system that holds `folder`: ext4, xfs, tmpfs, ..."""
    result = subprocess.run(["stat", "-f", "-c", "%T", folder], capture_output=True,
                            text=True, check=True)  # fmt: skip
    return result.stdout.strip()


def stop(message: str):
    """Ends this task with `message`, and tells supervise.py not to requeue the job."""
    write_mark(Path(os.environ["CHECKPOINT_DIR"]), ERROR_MARK, message)
    raise SystemExit(message)


if __name__ == "__main__":
    main()
