"""The run's checkpoints (DDP): one file a save, named by its step, with all it takes
to continue exactly. At a start, the newest one that loads is found; files of saves that
did not end are deleted, and a storage that fails to read is told from a damaged file.

The guide keeps one source of this file, examples/shared/checkpoints.py, and
copies it into every example that uses it (`nox -s copies`): edit that one.
"""

import errno
import json
import logging
import math
import re
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from checkpoint_files import changes, save_atomically
from devices import use_gpus
from stopping import stop_for_good

log = logging.getLogger(__name__)


class Checkpoint:
    """The run's checkpoints: files named by their step, each with all it takes to
    continue exactly. The newest --keep-checkpoints are kept. `may_change` names the
    arguments that a resumed run may change (main.py's MAY_CHANGE_ON_RESUME)."""

    def __init__(self, args, may_change: set[str]):
        self.root = args.checkpoint_dir
        self.keep = args.keep_checkpoints
        self.every_steps = args.checkpoint_every_steps
        # Every argument, as plain values (a Path as its text, a tuple as a list):
        # torch.load with weights_only=True, which load() uses, refuses other objects.
        self.arguments = json.loads(json.dumps(vars(args), default=str))
        self.settings = {
            name: value
            for name, value in sorted(self.arguments.items())
            if name not in may_change
        }
        # The other ranks wait in this group while rank 0 reads or writes, for up to an
        # hour: a file system that blocks (Lustre, NFS) may outlast the default group's
        # timeout (10 minutes with NCCL), which would end every rank. Past the hour, the
        # storage counts as gone: every rank fails, and job.sh requeues the job.
        self.group = dist.new_group(backend="gloo", timeout=timedelta(hours=1))
        self.max_failures, self.failures = args.max_failed_saves, 0

    def due(self, steps: int) -> bool:
        """Whether --checkpoint-every-steps asks for a save after `steps` steps."""
        return self.every_steps is not None and steps % self.every_steps == 0

    def save(self, model, optimizer, scheduler, progress, train_log):
        """Writes a checkpoint, with each rank's random state and unlogged losses. If
        the write fails, training goes on from the same state: see failed()."""
        mine = {"cpu_rng": torch.get_rng_state(), "losses": train_log.total.cpu()}
        mine["losses_steps"] = train_log.steps
        if use_gpus():
            mine["cuda_rng"] = torch.cuda.get_rng_state()
        ranks = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, ranks, dst=0)
        error = None
        if dist.get_rank() == 0:
            begin = time.perf_counter()
            state = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "progress": asdict(progress),
                "settings": self.settings,
                "arguments": self.arguments,
                "ranks": ranks,
            }
            path = self.root / CHECKPOINT_FILE.format(steps=progress.steps)
            try:
                save_atomically(state, path)
            except Exception as failure:  # a full disk or quota, storage away a while
                error = f"{path}: {failure}"
                log.warning(f"Could not save {error}")
            else:
                # Only now, with the new one on disk, the oldest go, never a later one.
                # One that cannot be deleted (in use over NFS, say) stays, and the next
                # save tries again.
                for older in checkpoints(self.root, progress.steps)[: -self.keep]:
                    try:
                        older.unlink()
                    except OSError as failure:
                        log.warning(f"Could not delete {older}: {failure}")
                log.info(f"Saved {path} in {time.perf_counter() - begin:.1f} s")
        # No rank goes on, or exits, before the file is complete, or has failed.
        outcome = [error]
        dist.broadcast_object_list(outcome, src=0, group=self.group)
        self.failed(outcome[0])

    def failed(self, error: str | None):
        """Counts the saves that failed in a row. Training goes on after one: the
        checkpoints before it are still there, and the next save tries again. After
        --max-failed-saves of them, stops the job, for a person to look."""
        self.failures = 0 if error is None else self.failures + 1
        if self.failures >= self.max_failures:
            stop_for_good(
                self.root,
                f"error: {self.failures} checkpoints in a row could not be saved, "
                f"the last one to {error}. Free space in {self.root} or fix what the "
                "error names, then resubmit: the run resumes from its last checkpoint.",
            )

    def load(self, model, optimizer, scheduler, progress, train_log):
        """Restores the newest checkpoint, if any, with this rank's own state."""
        # Rank 0 chooses, for all: on a network file system, nodes can list a folder
        # differently for a while.
        chosen = [readable_checkpoint(self.root) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(chosen, src=0, group=self.group)
        if isinstance(path := chosen[0], str):  # checkpoints, none of which loads
            stop_for_good(self.root, path)
        if path is None:
            return
        begin = time.perf_counter()
        # weights_only: tensors and containers, no code run. mmap: tensors are read
        # from the file as they are copied in, with no copy per process first.
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        self.check(state, path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        # What the optimizer keeps as it comes (its step counts; on CPUs, all of it)
        # would stay mapped to the file, which a later save deletes: copy it.
        for values in optimizer.state.values():
            for key, value in values.items():
                if isinstance(value, Tensor) and value.device.type == "cpu":
                    values[key] = value.clone()
        scheduler.load_state_dict(state["scheduler"])
        vars(progress).update(state["progress"])
        mine = state["ranks"][dist.get_rank()]
        torch.set_rng_state(mine["cpu_rng"])
        if use_gpus() and "cuda_rng" in mine:
            torch.cuda.set_rng_state(mine["cuda_rng"])
        train_log.total.copy_(mine["losses"])
        train_log.steps = mine["losses_steps"]
        seconds = time.perf_counter() - begin
        log.info(f"Resumed from {path} at step {progress.steps}, in {seconds:.1f} s")

    def check(self, state: dict, path: Path):
        """Stops with the cause when the checkpoint belongs to another run."""
        written_by, world_size = len(state["ranks"]), dist.get_world_size()
        if written_by != world_size:
            raise SystemExit(
                f"error: {path} was written by {written_by} processes, and this "
                f"job has {world_size}. Resume with the same number of tasks, or give "
                "a new --checkpoint-dir to start over."
            )
        if other := changes(state["settings"], self.settings):
            raise SystemExit(
                f"error: {path} belongs to a run with other settings ({other}). "
                "Resume with the same settings, or start a new run: another "
                f"--job-name, or delete {self.root}."
            )
        # Those that may change, said: some change the numbers, if not the run (in the
        # template, --bf16 on a GPU without bf16).
        if changed := changes(state.get("arguments", self.arguments), self.arguments):
            log.info(f"Changed since {path.name}: {changed}")


# A complete checkpoint's name: step-00001200.pt for step 1200. One being written ends
# in ".tmp". job.sh finds the newest by this name too (tests/test_job_scripts.py).
CHECKPOINT_FILE = "step-{steps:08d}.pt"
CHECKPOINT_NAME = re.compile(r"step-(\d+)\.pt")


def checkpoints(root: Path, last_step: float = math.inf) -> list[Path]:
    """The complete checkpoints in `root`, up to step `last_step`, oldest first."""
    steps = {p: int(m[1]) for p in root.glob("*.pt")
             if (m := CHECKPOINT_NAME.fullmatch(p.name))}  # fmt: skip
    return sorted((p for p in steps if steps[p] <= last_step), key=steps.get)


def readable_checkpoint(root: Path) -> Path | str | None:
    """The newest checkpoint in `root` that loads, or None if there is none. If there
    are some and none loads, or the storage cannot read one, the error instead, for a
    person: starting over would lose them. One that does not load (damaged, or with
    settings that no longer load) is moved into unreadable/, with a warning, for the one
    before it: left, it would stay the newest. Files of saves that a kill cut short
    (.tmp) are deleted."""
    leftovers = root.glob("*.pt.tmp")
    for leftover in (p for p in leftovers if CHECKPOINT_NAME.fullmatch(p.name[:-4])):
        log.warning(f"Deleting {leftover}, left by a save that did not end")
        leftover.unlink(missing_ok=True)
    errors = {}
    for path in reversed(checkpoints(root)):
        try:
            load_index(path)
        except Exception as error:  # a damaged file can raise one of several errors
            if getattr(error, "errno", None) in STORAGE_ERRORS:
                return f"error: cannot read {path}: {error}. Resubmit once it reads."
            errors[path] = error
            continue
        for newer, error in errors.items():
            (aside := root / "unreadable" / newer.name).parent.mkdir(exist_ok=True)
            log.warning(f"Moving {newer} to {aside}: it does not load ({error})")
            newer.rename(aside)
        return path
    if not errors:
        return None
    newest, error = next(iter(errors.items()))
    return (
        f"error: none of the {len(errors)} checkpoints in {root} loads; the newest, "
        f"{newest.name}: {error}\nA run that resumed would start over. Fix the cause, "
        "or move the folder away to start a new run."
    )


# The storage's errors, not the file's: a server away, a file handle gone stale.
STORAGE_ERRORS = {errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.ENOTCONN}


def load_index(path: Path) -> dict:
    """The checkpoint in `path` with its tensors mapped, not read: a check of its index.
    Where the storage fails to read it, tried again every 10 s for a minute."""
    for _ in range(6):
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except OSError as error:
            if error.errno not in STORAGE_ERRORS:
                raise
            log.warning(f"Cannot read {path} ({error}): trying again in 10 s")
            time.sleep(10)
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
