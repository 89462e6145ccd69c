"""What every checkpoint does alike, one file (DDP) or a folder of shards (FSDP2): its
files are written atomically, and its settings are compared with the run's.

The guide keeps one source of this file, examples/shared/checkpoint_files.py, and
copies it into every example that uses it (`nox -s copies`): edit that one.
"""

import os
from pathlib import Path

import torch


def changes(old: dict, new: dict) -> str:
    """The values that differ between two sets of arguments, as `--name old -> new`.
    An argument that one set lacks counts as None: a new one whose default is None
    changes nothing."""
    return ", ".join(
        f"--{name.replace('_', '-')} {old.get(name)} -> {new.get(name)}"
        for name in sorted(old.keys() | new.keys())
        if old.get(name) != new.get(name)
    )


def save_atomically(state: dict, path: Path):
    """Writes `state` to `path` so that a reader finds the old file or the new."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            # On disk before the rename: a crash of the node cannot leave an empty file.
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed write: no part of a file left behind
        raise
    # A rename within one folder replaces the old file in one step.
    os.replace(tmp, path)
    # The rename is a change to the folder: on disk too, or a crash can undo it.
    folder = os.open(path.parent, os.O_RDONLY)
    os.fsync(folder)
    os.close(folder)
