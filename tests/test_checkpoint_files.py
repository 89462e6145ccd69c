"""A process killed while it writes a checkpoint leaves the
previous checkpoint loadable.

Each checkpointing example's own save function runs in a child process,
the FSDP2 step's too. The state it saves holds an object whose pickling
blocks, so that the process is killed half-way through writing the
file, as a node failure or a SIGKILL at the time limit would.
"""

import signal
import subprocess
import sys

import pytest
import torch
from smoke import EXAMPLES_DIR, load_main

PRELUDE = """
import sys, time
from pathlib import Path
import torch
import torch.distributed as dist
import main

class Stall:
    def __reduce__(self):
        print("writing", flush=True)
        time.sleep(300)

path, version, stall = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "stall"
extra = Stall() if stall else None
"""
# How each example saves, given the checkpoint `path`, a `version` number and an `extra`
# object to put in the state; and where the version is in what torch.load returns.
SAVES = {
    "generic/checkpointing": (
        'main.save_atomically({"version": version, "extra": extra}, path)',
        lambda checkpoint: checkpoint["version"],
    ),
    "mila/checkpointing": (
        'main.save_atomically({"version": version, "extra": extra}, path)',
        lambda checkpoint: checkpoint["version"],
    ),
}
NAIVE = 'torch.save({"version": version, "extra": extra}, path)'


def save(name: str, code: str, path, version: int, stall: bool = False):
    """Runs a save in a child process; if `stall`, kills it
    half-way and returns when it died."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            PRELUDE + code,
            str(path),
            str(version),
            "stall" * stall,
        ],
        cwd=EXAMPLES_DIR / name,
        stdout=subprocess.PIPE,
        text=True,
    )
    if stall:
        assert proc.stdout.readline().strip() == "writing"
        proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=120) == (-signal.SIGKILL if stall else 0)


@pytest.mark.parametrize("name", SAVES)
def test_killed_mid_save_leaves_the_previous_checkpoint(tmp_path, name):
    code, version_of = SAVES[name]
    path = tmp_path / "checkpoint.pt"
    save(name, code, path, version=1)
    save(name, code, path, version=2, stall=True)
    # The half-written file is there, under another name;
    # the checkpoint is the old one, whole.
    assert (tmp_path / "checkpoint.pt.tmp").exists()
    assert version_of(torch.load(path, weights_only=True)) == 1
    # And the next save goes through, over the leftover.
    save(name, code, path, version=3)
    assert version_of(torch.load(path, weights_only=True)) == 3


# Each DDP checkpointing program's own Checkpoint.save, in a group of one process: a
# model whose weights are `version`, saved as step `version` into the folder `path`,
# the newest 2 kept. The object that stalls is in the scheduler's state.
CHECKPOINT_SAVE = (
    "import types\n"
    'dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)\n'
    'args = main.parse_args(["--checkpoint-dir", str(path), "--keep-checkpoints"]\n'
    '                       + ["2"])\n'
    "model = torch.nn.Linear(4, 4)\n"
    "torch.nn.init.constant_(model.weight, version)\n"
    "optimizer = torch.optim.AdamW(model.parameters())\n"
    "scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)\n"
    "scheduler.extra = extra\n"
    "train_log = types.SimpleNamespace(total=torch.zeros(()), steps=0)\n"
    "main.Checkpoint(args).save(\n"
    "    model, optimizer, scheduler, main.Progress(steps=version), train_log\n"
    ")\n"
    "dist.destroy_process_group()"
)


# Step 4's Checkpoint; the Mila step's and the template's are the same, byte for byte
# (test_the_checkpointing_programs_stop_and_save_the_same_way, in test_layout.py).
def test_killed_mid_save_keeps_the_newest_checkpoints(tmp_path):
    name = "generic/checkpointing"
    main = load_main(name)
    for version in (1, 2):
        save(name, CHECKPOINT_SAVE, tmp_path, version)
    save(name, CHECKPOINT_SAVE, tmp_path, 3, stall=True)
    # The killed save left its .tmp file; the two before are whole, the newest is 2.
    assert (tmp_path / "step-00000003.pt.tmp").exists()
    assert [p.name for p in main.checkpoints(tmp_path)] == [
        "step-00000001.pt", "step-00000002.pt",
    ]  # fmt: skip
    newest = torch.load(main.readable_checkpoint(tmp_path), weights_only=True)
    assert torch.equal(newest["model"]["weight"], torch.full((4, 4), 2.0))
    # The next save replaces the leftover and deletes the oldest: two are kept.
    save(name, CHECKPOINT_SAVE, tmp_path, 4)
    assert [p.name for p in main.checkpoints(tmp_path)] == [
        "step-00000002.pt", "step-00000004.pt",
    ]  # fmt: skip
    # A newest checkpoint damaged on disk (cut in half) gives way to the one before.
    damaged = tmp_path / "step-00000004.pt"
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    assert main.readable_checkpoint(tmp_path) == tmp_path / "step-00000002.pt"


# The FSDP2 step writes a folder, with a shard per rank, under a temporary name, and
# renames it once complete; here, in a group of one process, a folder per version under
# `path`, the newest 2 kept. The object that stalls is in progress.pt, which rank 0
# writes last, once the shards are on disk.
SHARDED_SAVE = (
    'dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)\n'
    'group = dist.new_group(backend="gloo")\n'
    'state = {"weights": torch.full((1000,), float(version))}\n'
    'folder = path / f"epoch-0000-step-{version:08d}"\n'
    "main.start_checkpoint(folder, state, group).result()\n"
    'main.finish_checkpoint(folder, {"version": version, "extra": extra}, 2)\n'
    "dist.destroy_process_group()"
)


def sharded_weights(folder) -> torch.Tensor:
    import torch.distributed.checkpoint as dcp

    state = {"weights": torch.zeros(1000)}
    dcp.load(state, checkpoint_id=folder, no_dist=True)
    return state["weights"]


# Reading a checkpoint without a process group is what sharded_weights means to do.
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_killed_mid_save_leaves_the_previous_sharded_checkpoint(tmp_path):
    name = "generic/fsdp"
    fsdp = load_main(name)
    save(name, SHARDED_SAVE, tmp_path, version=1)
    save(name, SHARDED_SAVE, tmp_path, version=2)
    save(name, SHARDED_SAVE, tmp_path, version=3, stall=True)
    # The half-written checkpoint is there, under its temporary name; the newest
    # complete one is the one before, whole, and the one before it is kept too.
    assert (tmp_path / "epoch-0000-step-00000003.tmp").is_dir()
    assert [p.name for p in fsdp.checkpoints(tmp_path)] == [
        "epoch-0000-step-00000001", "epoch-0000-step-00000002",
    ]  # fmt: skip
    latest = fsdp.readable_checkpoint(tmp_path)
    fsdp.check_complete(latest)
    assert torch.equal(sharded_weights(latest), torch.full((1000,), 2.0))
    # The next save goes through, clears what the killed one left, and deletes the
    # oldest: two are kept.
    save(name, SHARDED_SAVE, tmp_path, version=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "epoch-0000-step-00000002", "epoch-0000-step-00000004",
    ]  # fmt: skip
    assert torch.equal(
        sharded_weights(fsdp.readable_checkpoint(tmp_path)), torch.full((1000,), 4.0)
    )
    # A newest checkpoint that lacks a shard is passed over for the one before.
    (tmp_path / "epoch-0000-step-00000004" / "__0_0.distcp").unlink()
    assert fsdp.readable_checkpoint(tmp_path) == tmp_path / "epoch-0000-step-00000002"


def test_killed_mid_save_in_place_loses_the_checkpoint(tmp_path):
    # The symptom that the atomic save prevents: torch.save
    # straight to the checkpoint's path.
    path = tmp_path / "checkpoint.pt"
    save("generic/checkpointing", NAIVE, path, version=1)
    save("generic/checkpointing", NAIVE, path, version=2, stall=True)
    # An empty or truncated file, depending on where the kill landed.
    with pytest.raises((EOFError, RuntimeError)):
        torch.load(path, weights_only=True)


# Records the calls that make a save durable, in order:
# fsync of a file or of a folder, rename.
TRACE = """
import os
_fsync, _replace = os.fsync, os.replace

def fsync(fd):
    print("fsync", os.readlink(f"/proc/self/fd/{fd}"), flush=True)
    _fsync(fd)

def replace(src, dst):
    print("replace", os.fspath(dst), flush=True)
    _replace(src, dst)

os.fsync, os.replace = fsync, replace
"""


@pytest.mark.parametrize("name", SAVES)
def test_the_rename_is_synced_to_disk(tmp_path, name):
    # A rename is a change to the folder, not to the file: until the folder is synced, a
    # crash of the node can leave the old checkpoint, or none, where the new one was.
    code, _ = SAVES[name]
    path = tmp_path / "checkpoint.pt"
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + TRACE + code, str(path), "1", ""],
        cwd=EXAMPLES_DIR / name,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    calls = [
        line
        for line in proc.stdout.splitlines()
        if line.startswith(("fsync", "replace"))
    ]
    assert calls == [
        f"fsync {path}.tmp",
        f"replace {path}",
        f"fsync {tmp_path}",
    ], proc.stdout
