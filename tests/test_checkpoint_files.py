"""A process killed while it writes a checkpoint leaves the
previous checkpoint loadable; what a run finds in its folder never makes it start over.

Each checkpointing example's own save function runs in a child process,
the FSDP2 step's too. The state it saves holds an object whose pickling
blocks, so that the process is killed half-way through writing the
file, as a node failure or a SIGKILL at the time limit would.

Then step 4's Checkpoint, in a group of one process in this one: a reader's own
arguments, checkpoints that do not load, leftovers of killed saves, and which
checkpoints a save deletes.
"""

import enum
import errno
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from page_text import page_command
from smoke import EXAMPLES_DIR, load_main

PRELUDE = """
import sys, time
from pathlib import Path
import torch
import torch.distributed as dist
import main
import checkpoint_files

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
        'checkpoint_files.save_atomically({"version": version, "extra": extra}, path)',
        lambda checkpoint: checkpoint["version"],
    ),
    "mila/checkpointing": (
        'checkpoint_files.save_atomically({"version": version, "extra": extra}, path)',
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
    "main.Checkpoint(args, main.MAY_CHANGE_ON_RESUME).save(\n"
    "    model, optimizer, scheduler, main.Progress(steps=version), train_log\n"
    ")\n"
    "dist.destroy_process_group()"
)


# Step 4's Checkpoint; the Mila step's and the template's are the same, byte for byte
# (test_the_checkpointing_programs_stop_and_save_the_same_way, in test_layout.py).
def test_killed_mid_save_keeps_the_newest_checkpoints(tmp_path):
    name = "generic/checkpointing"
    main = load_main(name, "checkpoints.py")
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


# ------------------------------------------------------------
# What a run finds in its checkpoint folder. Step 4's Checkpoint; the Mila step's, the
# container step's and the template's are the same, byte for byte
# (test_the_checkpointing_programs_stop_and_save_the_same_way, in test_layout.py).


class Run:
    """What main() hands to step 4's Checkpoint: a small model, its optimizer and
    schedule; saved at a given step, loaded to learn the step resumed from."""

    def __init__(self, args):
        self.main = load_main("generic/checkpointing")
        self.model = torch.nn.Linear(4, 4)
        self.optimizer = torch.optim.AdamW(self.model.parameters())
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda _: 1)
        self.train_log = self.main.TrainLog(torch.device("cpu"))
        self.checkpoint = self.main.Checkpoint(args, self.main.MAY_CHANGE_ON_RESUME)

    def parts(self):
        return self.model, self.optimizer, self.scheduler

    def save(self, steps: int):
        progress = self.main.Progress(steps=steps)
        self.checkpoint.save(*self.parts(), progress, self.train_log)

    def load(self) -> int:
        progress = self.main.Progress()
        self.checkpoint.load(*self.parts(), progress, self.train_log)
        return progress.steps


def step_4_args(folder: Path, *more: str):
    return load_main("generic/checkpointing").parse_args(
        ["--checkpoint-dir", str(folder), *more]
    )


def names(folder: Path) -> list[str]:
    module = load_main("generic/checkpointing", "checkpoints.py")
    return [p.name for p in module.checkpoints(folder)]


def cut_in_half(path: Path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


class Size(enum.Enum):
    SMALL = "small"


def test_a_readers_own_arguments_of_any_type_resume(process_group, tmp_path):
    # A reader's section adds its own arguments (the template's add_arguments()): a
    # Path, an enum, a tuple. The checkpoint records them as plain values, which
    # torch.load(weights_only=True) loads: recorded as the objects, no checkpoint
    # loaded, and every requeued start trained again from step 0.
    args = step_4_args(tmp_path)
    args.data_file, args.size, args.crop = Path("/data/train.bin"), Size.SMALL, (8, 8)
    Run(args).save(steps=3)
    assert Run(args).load() == 3
    # Another value of one is still another run's.
    args.crop = (4, 4)
    with pytest.raises(SystemExit, match=r"settings \(--crop \[8, 8\] -> \[4, 4\]\)"):
        Run(args).load()


def test_checkpoints_none_of_which_loads_stop_the_run(process_group, tmp_path):
    # Every checkpoint damaged, or unreadable (a setting that no longer loads, storage
    # that fails to read): the run must stop with the folder and the cause, for a
    # person, not start again from step 0 beside them.
    args = step_4_args(tmp_path)
    run = Run(args)
    run.save(steps=4)
    run.save(steps=8)
    for name in names(tmp_path):
        cut_in_half(tmp_path / name)
    with pytest.raises(SystemExit) as stopped:
        Run(args).load()
    assert str(stopped.value).startswith(
        f"error: none of the 2 checkpoints in {tmp_path} loads; the newest, "
        "step-00000008.pt: "
    ), stopped.value
    assert "A run that resumed would start over" in str(stopped.value)
    # Left as they were; the mark tells job.sh not to requeue the job.
    assert names(tmp_path) == ["step-00000004.pt", "step-00000008.pt"]
    assert (tmp_path / "stopped-on-error").exists()


def test_an_unreadable_newest_checkpoint_is_moved_aside_and_leftovers_deleted(
    process_group,
    tmp_path,
):
    # The newest does not load: the run resumes from the one before, and moves it
    # into unreadable/, or it would stay the newest (job.sh reads the newest name to
    # tell whether a start saved). A .tmp file of a save that a kill cut short, a
    # full-size file on a quota'd scratch, is deleted.
    args = step_4_args(tmp_path)
    run = Run(args)
    run.save(steps=4)
    run.save(steps=8)
    cut_in_half(tmp_path / "step-00000008.pt")
    (tmp_path / "step-00000012.pt.tmp").write_bytes(b"cut short")
    assert Run(args).load() == 4
    assert names(tmp_path) == ["step-00000004.pt"]
    assert (tmp_path / "unreadable" / "step-00000008.pt").exists()
    assert not (tmp_path / "step-00000012.pt.tmp").exists()


def test_a_save_never_deletes_a_later_checkpoint(process_group, tmp_path):
    # A run that resumed from an older checkpoint than the newest (a node that listed
    # the folder before the newest showed, on a network file system) saves steps below
    # it. Keeping the newest by step would delete each new save as it is written.
    args = step_4_args(tmp_path, "--keep-checkpoints", "1")
    run = Run(args)
    run.save(steps=10)
    run.save(steps=4)
    run.save(steps=6)
    assert names(tmp_path) == ["step-00000006.pt", "step-00000010.pt"]


# The FSDP2 step records its settings and deletes old checkpoints in its own way.
def test_fsdp2_records_a_readers_own_arguments_as_plain_values(process_group, tmp_path):
    fsdp = load_main("generic/fsdp")
    args = fsdp.parse_args(["--checkpoint-dir", str(tmp_path)])
    args.data_file, args.size, args.crop = Path("/data/train.bin"), Size.SMALL, (8, 8)
    settings = fsdp.Checkpoint(args).settings
    fsdp.save_atomically({"settings": settings}, tmp_path / "progress.pt")
    loaded = torch.load(tmp_path / "progress.pt", weights_only=True)
    assert loaded["settings"] == settings
    assert settings["data_file"] == "/data/train.bin" and settings["crop"] == [8, 8]


def test_a_sharded_save_never_deletes_a_later_checkpoint(process_group, tmp_path):
    fsdp = load_main("generic/fsdp")
    group = dist.new_group(backend="gloo")
    for step in (10, 4, 6):  # the newest 2 kept: 4 and 6 of this run, and 10
        folder = tmp_path / f"epoch-0000-step-{step:08d}"
        fsdp.start_checkpoint(folder, {"weights": torch.zeros(10)}, group).result()
        fsdp.finish_checkpoint(folder, {"step": step}, 2)
    assert [p.name for p in fsdp.checkpoints(tmp_path)] == [
        "epoch-0000-step-00000004", "epoch-0000-step-00000006",
        "epoch-0000-step-00000010",
    ]  # fmt: skip


def test_a_resumed_run_says_which_arguments_changed(process_group, tmp_path, caplog):
    # The arguments that may change on resume (MAY_CHANGE_ON_RESUME) are recorded too,
    # and each change is logged. In the template, --bf16 is one: it follows the GPU,
    # and a requeued job may start on GPUs of another kind, without bf16.
    args = step_4_args(tmp_path, "--num-workers", "2")
    Run(args).save(steps=3)
    args.num_workers = 4
    with caplog.at_level("INFO"):
        assert Run(args).load() == 3
    assert "Changed since step-00000003.pt: --num-workers 2 -> 4" in caplog.text
    template = load_main("generic/template")
    assert "bf16" in template.MAY_CHANGE_ON_RESUME


def test_the_pages_comparison_of_two_checkpoints_tells_equal_from_different(
    process_group, tmp_path
):
    # The generic page's one line that compares a resumed run's checkpoint with an
    # uninterrupted one's: equal checkpoints print "equal"; one weight apart, it fails.
    command = page_command("clusters/generic.md", "python -c 'import sys, torch;")
    program = shlex.split(command)[:3]
    for run in ("a", "b", "c"):
        torch.manual_seed(0)
        Run(step_4_args(tmp_path / run)).save(steps=5)
    changed = torch.load(tmp_path / "c" / "step-00000005.pt", weights_only=True)
    changed["model"]["bias"][0] += 1
    torch.save(changed, tmp_path / "c" / "step-00000005.pt")

    def compare(x: str, y: str) -> subprocess.CompletedProcess:
        files = [str(tmp_path / r / "step-00000005.pt") for r in (x, y)]
        return subprocess.run(
            [sys.executable, *program[1:], *files], capture_output=True, text=True
        )

    same = compare("a", "b")
    assert same.returncode == 0 and same.stdout == "equal\n", same.stderr
    different = compare("a", "c")
    assert different.returncode == 1 and "Tensor-likes are not equal" in (
        different.stderr
    ), different.stderr


def test_storage_that_fails_to_read_is_tried_again_then_stops_the_run(
    process_group, tmp_path, monkeypatch
):
    # EIO or ESTALE (an NFS server away, a file handle gone stale) is the storage's
    # error, not the file's: the newest checkpoint is read again, every 10 s for a
    # minute, not moved aside for an older one; if it still fails, the run stops with
    # the cause. (The sleeps are skipped here.)
    args = step_4_args(tmp_path)
    main = load_main("generic/checkpointing")
    load, failures = torch.load, {"left": 0}

    def flaky(path, *rest, **options):
        if str(path).endswith("step-00000008.pt") and failures["left"]:
            failures["left"] -= 1
            raise OSError(errno.ESTALE, "Stale file handle")
        return load(path, *rest, **options)

    monkeypatch.setattr(main.torch, "load", flaky)
    monkeypatch.setattr(time, "sleep", lambda seconds: None)
    run = Run(args)
    run.save(steps=4)
    run.save(steps=8)
    failures["left"] = 3  # back after three tries
    assert Run(args).load() == 8
    failures["left"] = 100  # away for good
    with pytest.raises(SystemExit, match=r"cannot read \S+/step-00000008\.pt: "):
        Run(args).load()
    assert names(tmp_path) == ["step-00000004.pt", "step-00000008.pt"]
