"""Stopping when Slurm asks. Slurm sends SIGUSR1 before the time limit (job.sh asks
for it) and SIGTERM at a preemption or a cancel. Before training, the process ends at
once: there is nothing to save yet. Once training runs, the ranks agree between two
steps to stop or to save. Either way the signal is left as a mark in the checkpoint
folder, and supervise.py, after srun, decides what comes next: requeue the job, or
leave it to Slurm.

The guide keeps one source of this file, examples/shared/stopping.py, and
copies it into every example that uses it (`nox -s copies`): edit that one.
"""

import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from supervise import DONE_MARK, ERROR_MARK, STOP_MARK, write_mark

# The signal that asked this process to stop, or 0. Once training runs, the handler
# only notes it: the training loop acts on it between steps, where every rank can stop
# at the same point.
stop_signal = 0
training = False  # set by Agreement
marks = Path("checkpoints")  # the checkpoint folder, where the marks go


def note_stop_signal(signum, frame):
    global stop_signal
    # SIGTERM wins over SIGUSR1: the job is ending anyway.
    stop_signal = max(stop_signal, signum)
    if not training:
        stop_before_training(signum)


def stop_before_training(signum: int):
    """Nothing to save yet: ends the process now. SIGUSR1, the time limit's warning,
    leaves its mark; SIGTERM leaves none, as srun sends it to the other tasks when one
    fails (--kill-on-bad-exit): supervise.py asks Slurm whether it is preempting."""
    if signum == signal.SIGUSR1:
        write_mark(marks, STOP_MARK, signal.Signals(signum).name)
    name = signal.Signals(signum).name
    os.write(2, f"Stopped by {name} before training: nothing to save\n".encode())
    os._exit(128 + signum)


def catch_stop_signals(folder: Path):
    """From the first line of main(): on SIGUSR1 or SIGTERM, stop, and leave the
    signal as a mark in `folder` for supervise.py."""
    global marks
    marks = folder
    signal.signal(signal.SIGUSR1, note_stop_signal)
    signal.signal(signal.SIGTERM, note_stop_signal)
    # A Python handler runs only once the main thread is back in Python. Before
    # training, it may wait in a call that is not: for another rank, in a collective or
    # at the rendezvous, for up to an hour. Python writes each signal's number to this
    # pipe as it arrives, and a thread of its own ends the process then.
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    threading.Thread(target=watch_before_training, args=(read,), daemon=True).start()


def watch_before_training(pipe: int):
    while not training:
        signum = os.read(pipe, 1)[0]
        if signum in (signal.SIGUSR1, signal.SIGTERM) and not training:
            stop_before_training(signum)


class Agreement:
    """What all ranks decide together between two steps: to stop, on a signal that any
    rank got, or to save, once any rank's clock says that a checkpoint is due.

    The flags are CPU tensors, combined over a gloo group of their own, sent at one step
    and read at the next, at the same step on every rank: the GPU never waits for them.
    """

    def __init__(self, save_every_minutes: float):
        global training
        training = True  # from here on there is progress to lose: stop at a step, save
        self.group = dist.new_group(backend="gloo")
        self.save_every = save_every_minutes * 60
        self.sent, self.flags = None, None
        self.stop = 0  # the signal the last decision stopped for, or 0
        self.last_save, self.stale = time.monotonic(), False

    def poll(self) -> tuple[int, bool]:
        """The decision sent at the previous call: the stop signal, or 0, and whether
        to save. Sends this rank's flags for the next."""
        stop, save = 0, False
        if self.sent is not None:
            self.sent.wait()
            stop, save = int(self.flags[0]), bool(self.flags[1]) and not self.stale
        self.stale = False
        due = time.monotonic() - self.last_save >= self.save_every
        self.flags = torch.tensor([stop_signal, due])
        self.sent = dist.all_reduce(
            self.flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True
        )
        self.stop = stop
        return stop, save

    def saved(self):
        """Restarts the clock: all ranks call it after the same save. The flags under
        way were sent before it: their "save" is out of date."""
        self.last_save, self.stale = time.monotonic(), self.sent is not None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        """Waits for the last flags sent: no collective is left under way. A time
        limit's warning from now on asks for nothing: it is ignored. Python puts back
        the default action of a signal it handles as it exits, and SIGUSR1's would end
        a run that has finished, with an error. Training that ended without a stop
        leaves its mark: a SIGTERM as the processes exit (a kill that Slurm kept for a
        lost node, say) must not make supervise.py take the run for a stopped one."""
        if self.sent is not None and exc[0] is None:
            self.sent.wait()
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        if exc[0] is None and not self.stop:
            write_mark(marks, DONE_MARK, "done")


def mark_stop(stopped_by: int, folder: Path):
    """Leaves the signal that stopped training for supervise.py: after SIGUSR1, the time
    limit's warning, it requeues the job; after SIGTERM, it asks Slurm whether it is
    ending the job (a preemption, a cancel) or requeues it (a stray SIGTERM)."""
    write_mark(folder, STOP_MARK, signal.Signals(stopped_by).name)


def stop_for_good(folder: Path, message: str):
    """Ends this process with `message`, an error that a person must act on. Its mark
    in the checkpoint folder tells supervise.py not to requeue the job."""
    write_mark(folder, ERROR_MARK, message)
    raise SystemExit(message)
