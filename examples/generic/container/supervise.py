"""Runs a job step, then decides what comes after it: the run is done, the job goes
back in the queue, or it stops for good with the reason. job.sh ends with

    exec python3 supervise.py srun ... python main.py "$@"

It runs on the job's first node, outside any container, with Python's standard
library alone. The rule:

- A start that advanced the run (saved a checkpoint of a later step) is requeued,
  whatever stopped it: a crash, the time limit's warning, a stray SIGTERM.
- A start that did not advance is requeued only RETRIES times in a row (3, or the
  job's RETRIES variable): a failure at a restart (a rendezvous timeout, a bad node)
  is tried again; a setting that fails at every start stops with its reason.
- A preemption, a cancel or a time limit is Slurm's to handle. After a preemption this
  waits until Slurm ends the job, which it then requeues (or cancels, as PreemptMode
  says) without counting it: from Slurm 24.05, a batch script that ends within its
  grace time counts as a failed launch, and 5 of them (MaxBatchRequeue) hold the job.
- An error that a person must act on (main.py's mark) stops the job.

main.py's marks, below, in the checkpoint folder, say why it stopped; each decision
is added to the folder's starts.jsonl.

The guide keeps one source of this file, examples/shared/supervise.py, and
copies it into every example that uses it (`nox -s copies`): edit that one.
"""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# The marks that main.py leaves in the checkpoint folder (stopping.py writes them).
STOP_MARK = "stopped-by-signal"  # the signal it stopped on: SIGUSR1 or SIGTERM
ERROR_MARK = "stopped-on-error"  # an error that a person must act on: the message
DONE_MARK = "training-done"  # training ended without a stop: the run is done
LEDGER = "starts.jsonl"  # one line per start: what stopped it, what came next
# A complete checkpoint's name: step-00001200.pt (one file), or epoch-0001-step-00001200
# (FSDP2's folder of shards). One being written ends in ".tmp".
CHECKPOINT_NAME = re.compile(r"(?:epoch-\d+-)?step-(\d+)(?:\.pt)?")
RETRIES = 3


@dataclass
class Decision:
    action: str  # done, requeue, wait (for Slurm to end the job), end, or stop
    reason: str
    counted: bool = False  # a requeue of a start that did not advance the run


def run_step(command: list[str]) -> int:
    if "CHECKPOINT_DIR" not in os.environ:
        raise SystemExit("error: CHECKPOINT_DIR is not set: job.sh sets it to the "
                         "run's checkpoint folder, for supervise.py.")  # fmt: skip
    folder = Path(os.environ["CHECKPOINT_DIR"])
    before = newest_step(folder)
    for mark in (STOP_MARK, ERROR_MARK, DONE_MARK):
        (folder / mark).unlink(missing_ok=True)  # from an earlier start
    status = subprocess.call(command)
    if status < 0:  # srun itself ended by a signal: the shell's way to say so
        status = 128 - status
    stop, error = read_mark(folder / STOP_MARK), read_mark(folder / ERROR_MARK)
    done = (folder / DONE_MARK).exists()
    finished = (status == 0 or done) and stop is None and error is None
    job = this_job()
    slurm = None if finished else slurm_record(job)  # done: no need to ask
    retries = int(os.environ.get("RETRIES", RETRIES))
    decision = decide(status, stop, error, before, newest_step(folder), slurm,
                      read_ledger(folder), retries, done)  # fmt: skip
    if not finished:  # a staging step that ends well leaves no line
        record(folder, job, status, before, decision)
    return act(decision, job, status, folder)


def decide(status: int, stop: str | None, error: str | None, before: int,
           after: int, slurm: dict | None, history: list[dict], retries: int,
           done: bool = False) -> Decision:  # fmt: skip
    """What comes after a start that srun ended with `status`, from main.py's marks,
    the newest step saved `before` and `after` it, Slurm's record (None: no answer)."""
    if error is not None:
        return Decision("stop", f"main.py stopped on an error of its own: {error}")
    if done and stop is None:  # whatever ended the processes afterwards
        return Decision("done", f"main.py ended its training (srun's status: {status})")
    if status == 0 and stop is None:
        return Decision("done", "the step ended with status 0")
    if slurm is not None and preempted_now(slurm):
        return Decision("wait", "Slurm preempted the job; it ends it once its grace "
                        "time is over, and requeues it (or cancels it, as its "
                        "PreemptMode says)")  # fmt: skip
    if slurm is not None and slurm.get("JobState") != "RUNNING":
        return Decision("end", f"Slurm is ending the job ({slurm.get('JobState')})")
    what = {
        "SIGUSR1": "main.py stopped on the time limit's warning (SIGUSR1)",
        "SIGTERM": "main.py stopped on a SIGTERM that was not Slurm ending the job",
    }.get(stop, f"srun exited with status {status}")
    if after > before:
        return Decision("requeue", f"{what}; this start saved step {after}")
    # The starts in a row, this one included, that saved nothing new.
    # (A preemption between them, which saved nothing either, counts for nothing.)
    tries = 1
    for earlier in reversed(history):
        if earlier.get("after") != after:
            break  # the run advanced since
        tries += earlier.get("counted", False)
    if tries > retries:
        return Decision("stop", f"{what}, and {tries} starts in a row saved no new "
                        f"checkpoint (RETRIES={retries})")  # fmt: skip
    return Decision("requeue", f"{what}, before this start saved a checkpoint (try "
                    f"{tries} of {retries})", counted=True)  # fmt: skip


def act(decision: Decision, job: str, status: int, folder: Path) -> int:
    """Carries out the decision; returns the script's exit status, if it returns."""
    say = f"supervise.py: {decision.reason}:"
    if decision.action in ("done", "end"):
        then = "done" if decision.action == "done" else "Slurm ends it"
        print(f"{say} {then}.", file=sys.stderr)
        return 0 if decision.action == "done" else status
    if decision.action == "wait":
        print(f"{say} waiting for Slurm to end the job.", file=sys.stderr, flush=True)
        # Slurm ends this process too. Ending first, within the grace time, would
        # make Slurm 24.05 and later count a failed launch; older ones would end the
        # job COMPLETED, out of the queue, unfinished.
        while True:
            time.sleep(3600)
    reason = decision.reason
    if decision.action == "requeue":
        print(f"{say} requeueing job {job} to resume from its last checkpoint.",
              file=sys.stderr, flush=True)  # fmt: skip
        if requeue(job):
            time.sleep(600)  # Slurm ends this process within seconds, as it requeues
        reason = f"`scontrol requeue {job}` failed, so the job will not start again"
    print(f"error: {reason}: the job is not requeued. Fix the cause, then resubmit "
          "job.sh with the same job name: the run resumes from its checkpoint in "
          f"{folder}, if it has one.", file=sys.stderr)  # fmt: skip
    return status or 1


def newest_step(folder: Path) -> int:
    """The step of the newest complete checkpoint in `folder`; -1 if there is none."""
    with contextlib.suppress(OSError):
        names = os.listdir(folder)
        steps = [int(m[1]) for n in names if (m := CHECKPOINT_NAME.fullmatch(n))]
        return max(steps, default=-1)
    return -1


def read_mark(path: Path) -> str | None:
    with contextlib.suppress(OSError):
        return path.read_text().strip()
    return None


def write_mark(folder: Path, name: str, text: str):
    """Writes a mark whole; on a full disk, nothing: RETRIES still bounds requeues."""
    tmp = folder / f".{name}.{os.getpid()}.tmp"
    try:
        tmp.write_text(text + "\n")
        tmp.replace(folder / name)
    except OSError:
        tmp.unlink(missing_ok=True)


def read_ledger(folder: Path) -> list[dict]:
    try:
        lines = (folder / LEDGER).read_text().splitlines()
    except OSError:
        return []
    # Less a line that a full disk cut short.
    return [json.loads(line) for line in lines if line.endswith("}")]


def record(folder: Path, job: str, status: int, before: int, decision: Decision):
    start = int(os.environ.get("SLURM_RESTART_COUNT", "0")) + 1
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "job": job, "start": start,
             "status": status, "before": before, "after": newest_step(folder),
             "action": decision.action, "counted": decision.counted,
             "reason": decision.reason}  # fmt: skip
    with contextlib.suppress(OSError), open(folder / LEDGER, "a") as ledger:
        ledger.write(json.dumps(entry) + "\n")


def this_job() -> str:
    """The job to requeue: in an array, this task alone (the array's ID names all)."""
    if (task := os.environ.get("SLURM_ARRAY_TASK_ID")) is not None:
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{task}"
    return os.environ.get("SLURM_JOB_ID", "")


def preempted_now(slurm: dict) -> bool:
    """Whether Slurm preempted the job in this start (ISO 8601 times sort as text)."""
    preempt = slurm.get("PreemptTime", "None")
    return preempt not in ("None", "Unknown") and preempt >= slurm.get("StartTime", "")


def slurm_record(job: str) -> dict | None:
    """Slurm's record of the job (`scontrol show job`), or None if none came."""
    show = scontrol("show", "job", "--oneliner", job)
    if show is None or show.returncode != 0:
        return None
    return dict(item.split("=", 1) for item in show.stdout.split() if "=" in item)


def requeue(job: str) -> bool:
    """Puts the job back in the queue (it needs `#SBATCH --requeue` where that is not
    the default). The requeue ends every process of the job, scontrol among them:
    SIGTERM is success. So is a job no longer running: a try whose answer was lost may
    have requeued it."""
    result = scontrol("requeue", job)
    if result is None or result.returncode in (0, -signal.SIGTERM):
        return result is not None
    show = scontrol("show", "job", "--oneliner", job)
    if show.returncode == -signal.SIGTERM:
        return True  # Slurm ends the job's processes, scontrol among them
    return show.returncode == 0 and "JobState=RUNNING" not in show.stdout


def scontrol(*args: str) -> subprocess.CompletedProcess | None:
    """`scontrol ARGS`, tried again every 5 s while Slurm's controller does not answer
    (a restart, a failover), for 90 s, but never past 15 s before the time limit. None
    where there is no scontrol."""
    if shutil.which("scontrol") is None:
        return None
    end = min(time.time() + 90, int(os.environ.get("SLURM_JOB_END_TIME", 2e9)) - 15)
    while True:
        try:
            result = subprocess.run(["scontrol", *args], capture_output=True, text=True,
                                    timeout=max(end - time.time(), 1))  # fmt: skip
        except subprocess.TimeoutExpired as error:
            result = subprocess.CompletedProcess(error.cmd, 1, "", "no answer in time")
        if said := result.stderr.strip():
            print(f"scontrol {' '.join(args)}: {said}", file=sys.stderr)
        # Slurm 24.11 may say "Unexpected message received" when no answer came in time.
        away = re.search("contact slurm controller|timed out|in time|Unexpected "
                         "message", result.stderr)  # fmt: skip
        if result.returncode <= 0 or not away or time.time() + 5 > end:
            return result
        time.sleep(5)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: python3 supervise.py srun [OPTION...] COMMAND...")
    sys.exit(run_step(sys.argv[1:]))
