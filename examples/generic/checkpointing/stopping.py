"""Stopping when Slurm asks, and coming back. Slurm sends SIGUSR1 before the time
limit (job.sh asks for it) and SIGTERM at a preemption or a cancel: the ranks agree
between two steps to stop or to save, and the job goes back in the queue with `scontrol
requeue`. A stop that a person must look at leaves a mark: job.sh does not requeue.

The guide keeps one source of this file, examples/shared/stopping.py, and
copies it into every example that uses it (`nox -s copies`): edit that one.
"""

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# The marks that main.py leaves for job.sh in the checkpoint folder. job.sh reads them
# by these names (tests/test_job_scripts.py holds the two sides to one spelling).
STOPPED_MARK = "stopped-on-error"  # an error that a person must act on: no requeue
REQUEUE_MARK = "requeue"  # no scontrol here (in a container): job.sh requeues the job


# The signal that asked this process to stop, or 0. The handler only notes it: the
# training loop acts on it between steps, where every rank can stop at the same point.
stop_signal = 0


def note_stop_signal(signum, frame):
    global stop_signal
    # SIGTERM wins over SIGUSR1: the job is ending anyway, and a requeue would fail.
    stop_signal = max(stop_signal, signum)


def catch_stop_signals():
    """From here on there is progress to lose: on SIGUSR1 or SIGTERM, stop and save."""
    signal.signal(signal.SIGUSR1, note_stop_signal)
    signal.signal(signal.SIGTERM, note_stop_signal)


class Agreement:
    """What all ranks decide together between two steps: to stop, on a signal that any
    rank got, or to save, once any rank's clock says that a checkpoint is due.

    The flags are CPU tensors, combined over a gloo group of their own, sent at one step
    and read at the next, at the same step on every rank: the GPU never waits for them.
    """

    def __init__(self, save_every_minutes: float):
        catch_stop_signals()
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
        a run that has finished, with an error."""
        if self.sent is not None and exc[0] is None:
            self.sent.wait()
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def requeue(stopped_by: int, max_restarts: int, folder: Path):
    """Puts this job back in the queue after a stop: Slurm ends it now and starts it
    again later. After SIGUSR1, the warning of the time limit, always. After SIGTERM,
    only if Slurm is not ending the job: SIGTERM comes with a preemption (which Slurm
    requeues), a time limit or `scancel`, but also to the tasks alone (a stale kill of
    a lost node's, `scancel --signal=TERM`), and then the job would end COMPLETED,
    unfinished. Not after `max_restarts`: a job that cannot finish would loop for good.
    """
    if (job_id := os.environ.get("SLURM_JOB_ID")) is None:
        return  # not a Slurm job
    # In a job array, this task alone: the array's own ID, which one of its tasks has
    # as its job ID, would requeue every task.
    if (task := os.environ.get("SLURM_ARRAY_TASK_ID")) is not None:
        job_id = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{task}"
    if stopped_by == signal.SIGTERM and slurm_ends(job_id) is not False:
        return  # Slurm ends it (or may: no answer)
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    resubmit = "Resubmit job.sh with the same job name: it resumes from the checkpoint."
    if restarts >= max_restarts:
        stop_for_good(
            folder,
            f"error: job {job_id} is not requeued: it has started {restarts + 1} "
            f"times, and --max-restarts is {max_restarts}. {resubmit}",
        )
    if shutil.which("scontrol") is None:  # in a container, say: job.sh requeues
        log.info(f"No scontrol here: asking job.sh to requeue job {job_id}")
        (folder / REQUEUE_MARK).touch()
        return
    log.info(f"Requeueing job {job_id}")
    # Needs `#SBATCH --requeue` on clusters whose default is not to requeue. The requeue
    # ends every process of the job, scontrol included: SIGTERM is success. So is a job
    # no longer running: a try whose answer was lost may have requeued it.
    result = scontrol("requeue", job_id)
    if result.returncode not in (0, -signal.SIGTERM) and slurm_ends(job_id) is not True:
        stop_for_good(
            folder,
            f"error: `scontrol requeue {job_id}` failed, so the job will not start "
            f"again by itself. {resubmit}",
        )


def slurm_ends(job_id: str) -> bool | None:
    """Whether Slurm is ending the job: no longer running (cancelled, timed out,
    requeued), or preempted, in its grace time, or its SIGTERM ended scontrol; None
    where no scontrol answers."""
    show = scontrol("show", "job", "--oneliner", job_id)
    if show is not None and show.returncode == -signal.SIGTERM:
        return True  # Slurm ends the job's processes, scontrol among them
    if show is None or show.returncode != 0:
        return None
    job = dict(item.split("=", 1) for item in show.stdout.split() if "=" in item)
    # PreemptTime is only shown where preemption is on.
    return job.get("JobState") != "RUNNING" or job.get("PreemptTime", "None") != "None"


def scontrol(*args: str) -> subprocess.CompletedProcess | None:
    """`scontrol ARGS`, tried again every 5 s while Slurm's controller does not answer
    (a restart, a failover), for 90 s, but never past 15 s before the time limit. None
    where there is no scontrol (in a container)."""
    if shutil.which("scontrol") is None:
        return None
    end = min(time.time() + 90, int(os.environ.get("SLURM_JOB_END_TIME", 2e9)) - 15)
    while True:
        try:
            result = subprocess.run(["scontrol", *args], capture_output=True, text=True,
                                    timeout=max(end - time.time(), 1))  # fmt: skip
        except subprocess.TimeoutExpired as error:
            result = subprocess.CompletedProcess(error.cmd, 1, "", "no answer in time")
        if result.stderr.strip():
            log.warning(f"scontrol {' '.join(args)}: {result.stderr.strip()}")
        # Slurm 24.11 may say "Unexpected message received" when no answer came in time.
        away = re.search(
            "contact slurm controller|timed out|in time|Unexpected message",
            result.stderr,
        )
        if result.returncode <= 0 or not away or time.time() + 5 > end:
            return result
        time.sleep(5)


def stop_for_good(folder: Path, message: str):
    """Ends this process with `message`, an error that a person must act on. Its mark
    in the checkpoint folder tells job.sh not to requeue the job."""
    # On a full disk, say, the mark may fail: job.sh's limit on requeues still holds.
    with contextlib.suppress(OSError):
        (folder / STOPPED_MARK).touch()
    raise SystemExit(message)
