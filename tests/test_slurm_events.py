"""Slurm's own events, made by Slurm on the test cluster: a preemption by a job of a
higher priority, with and without a grace time, and one that cancels; a time limit
that runs out; a node that is lost; a controller that does not answer for a while.

What these tests hold step 4's job.sh and main.py to: whatever Slurm does, the job loses
at most the steps since its last checkpoint, and ends bitwise equal to a twin that was
never interrupted. job.sh is submitted unchanged; the partition, the time limit and the
events come from the cluster and the tests (tests/helpers/slurm_lab.py).
"""

import re
import subprocess
import time
from pathlib import Path

import pytest
from slurm_lab import ENDED, HELD
from smoke import assert_bitwise_equal, newest_checkpoint, unwrapped
from test_failures import (
    EPOCH_END,
    EXACT_LAYOUT,
    EXACT_RANKS,
    EXACT_RUN,
    ONE_TASK_PER_NODE,
    PREEMPTIBLE,
    assert_same_summaries,
    checkpoint_dir,
    checkpoint_of,
    find_rank,
    preempt,
    read,
    start_now,
    submit,
    wait_for_requeue,
    wait_until,
)

pytestmark = pytest.mark.slurm

NAME = "generic/checkpointing"
STOPPED = r"\[\d/4\] Stopped at step (\d+), checkpoint saved"
RESUMED = r"Resumed from \S+ at step (\d+)\b"
FAULTS = str(Path(__file__).parent / "helpers" / "faults")


def stops(output: str) -> list[int]:
    """The step at which each rank stopped and saved."""
    return [int(step) for step in re.findall(STOPPED, output)]


def run_to_the_end(lab, job: str, workdir: Path, timeout: float = 600):
    """Lets the job start at once each time it is requeued, until it ends; returns
    it, and the number of times it was requeued."""
    deadline, restarts = time.monotonic() + timeout, 0
    while (info := lab.job_info(job)).get("JobState") not in ENDED | HELD:
        assert time.monotonic() < deadline, f"job {job} still {info.get('JobState')}"
        if info.get("JobState") == "PENDING" and int(info["Restarts"]) > restarts:
            restarts = int(info["Restarts"])
            start_now(lab, job)
        time.sleep(0.5)
    return lab.wait(job, workdir, timeout=60), restarts


def wait_for_nodes(lab, state: str = "idle", timeout: float = 120):
    """Waits until every node of the cluster is `state` (or more busy: mixed)."""

    def ready():
        out = subprocess.run(
            ["sinfo", "-h", "-N", "-p", "main", "-o", "%N %t"], env=lab.env(),
            capture_output=True, text=True,
        ).stdout.split()  # fmt: skip
        return all(s in (state, "mix", "alloc") for s in out[1::2]) and out

    wait_until(ready, timeout, f"the nodes to be {state}")


# ------------------------------------------------------------
# Preemption


# Slurm 22.05 to 23.11 and 24.05 on differ here: run on 22.05 and 24.11. Not on 26.05,
# for CI's time (docs/testing.md says so).
@pytest.mark.every_version
@pytest.mark.before_slurm("26.05")
def test_a_job_preempted_with_a_grace_time_is_requeued_and_resumes_exactly(
    lab, tmp_path, exact_twin
):
    # Partition `graced`: GraceTime=20. Slurm sends SIGTERM to the job's steps and
    # leaves it 20 s (checked every 30 s) before it ends it. main.py saves and stops
    # at once, and job.sh ends. Slurm 24.05 and later then requeue the job; 22.05 to
    # 23.11 end it COMPLETED, unfinished, unless job.sh waits for the grace time's end,
    # as it does there.
    workdir = tmp_path / "graced"
    job = submit(lab, NAME, *EXACT_RUN, workdir=workdir,
                 options=[*EXACT_LAYOUT, "--partition=graced"])  # fmt: skip
    output = workdir / f"slurm-{job}.out"
    wait_until(lambda: EPOCH_END in read(output), 180, "an epoch of training")
    preempted = time.monotonic()
    preempt(lab, job)
    wait_until(lambda: len(stops(read(output))) == EXACT_RANKS, 60, "every rank's stop")
    # PENDING once the job's processes and epilog have ended: its Restarts count rises
    # while it is still COMPLETING. Ended COMPLETED, unfinished, it fails.
    lab.wait_for_state(job, "PENDING", restarts=1, timeout=120, log=output)
    requeued = time.monotonic() - preempted
    start_now(lab, job)
    resumed = lab.wait(job, workdir, timeout=300)
    uninterrupted, plain = exact_twin()
    assert resumed.ok, resumed.output
    assert uninterrupted.ok, uninterrupted.output
    [step] = set(stops(resumed.output))
    assert re.findall(RESUMED, resumed.output) == [str(step)], resumed.output
    assert_bitwise_equal(checkpoint_of(lab, workdir), checkpoint_of(lab, plain))
    assert_same_summaries(resumed, uninterrupted, restarts=1)
    print(
        f"Slurm {lab.version}: preempted with GraceTime=20 at step {step}, requeued "
        f"{requeued:.0f} s later; final state bitwise equal"
    )


def test_a_save_that_preemption_cuts_short_resumes_from_the_one_before(
    lab, tmp_path, exact_twin
):
    # No grace time: SIGTERM, then SIGKILL KillWait (30 s) later. The save at the stop
    # blocks for 90 s (tests/helpers/faults/), as on storage that stops answering, and
    # is killed half-way: a .tmp file is left, the job is requeued by Slurm, and the
    # next start deletes the .tmp file and resumes from the last whole checkpoint.
    workdir = tmp_path / "cut"
    stall = tmp_path / "stall-now"
    job = submit(
        lab, NAME, *EXACT_RUN, workdir=workdir, options=[*EXACT_LAYOUT, *PREEMPTIBLE],
        PYTHONPATH=FAULTS, STALL_SAVE="step-", STALL_SECONDS="90",
        STALL_SAVE_WHEN=str(stall),
    )  # fmt: skip
    output = workdir / f"slurm-{job}.out"
    folder = checkpoint_dir(lab, workdir)
    wait_until(lambda: "Saved" in read(output), 180, "a save")
    stall.touch()
    preempt(lab, job)
    wait_for_requeue(lab, job, restarts=1, timeout=120)
    leftovers = [p.name for p in folder.glob("*.tmp")]
    newest = newest_checkpoint(folder).name
    assert leftovers, read(output)
    assert "checkpoint saved" not in read(output), read(output)
    stall.unlink()
    start_now(lab, job)
    resumed = lab.wait(job, workdir, timeout=300)
    uninterrupted, plain = exact_twin()
    assert resumed.ok, resumed.output
    text = unwrapped(resumed.output)
    for leftover in leftovers:
        assert f"Deleting {folder}/{leftover}, left by a save that did not end" in text
    step = int(newest.removeprefix("step-").removesuffix(".pt"))
    assert re.findall(RESUMED, text) == [str(step)], text
    assert_bitwise_equal(checkpoint_of(lab, workdir), checkpoint_of(lab, plain))
    assert_same_summaries(resumed, uninterrupted, restarts=1)
    print(f"save cut short at preemption: resumed from step {step}, {leftovers} gone")


def test_a_job_that_preemption_cancels_resumes_when_resubmitted(
    lab, tmp_path, exact_twin
):
    # Partition `cancelled`: PreemptMode=CANCEL. The job saves at the SIGTERM and
    # stops; Slurm ends it PREEMPTED and does not requeue it. Submitted again under
    # the same job name (a new job ID), it resumes from the checkpoint. scancel, a
    # time limit and a failed requeue end a job the same way.
    workdir = tmp_path / "run"
    options = [*EXACT_LAYOUT, "--partition=cancelled"]
    first = submit(lab, NAME, *EXACT_RUN, workdir=workdir, options=options)
    output = workdir / f"slurm-{first}.out"
    wait_until(lambda: EPOCH_END in read(output), 180, "an epoch of training")
    preempt(lab, first)
    cancelled = lab.wait(first, workdir, timeout=120)
    assert cancelled.state == "PREEMPTED", cancelled.output
    assert lab.job_info(first).get("Restarts") == "0"
    [step] = set(stops(cancelled.output))
    assert len(stops(cancelled.output)) == EXACT_RANKS, cancelled.output

    again = submit(lab, NAME, *EXACT_RUN, workdir=workdir, options=options)
    assert again != first
    resubmitted = lab.wait(again, workdir, timeout=300)
    uninterrupted, plain = exact_twin()
    assert resubmitted.ok, resubmitted.output
    assert re.findall(RESUMED, resubmitted.output) == [str(step)], resubmitted.output
    assert_bitwise_equal(checkpoint_of(lab, workdir), checkpoint_of(lab, plain))
    assert_same_summaries(resubmitted, uninterrupted, restarts=0)
    print(f"cancelled by preemption at step {step}, resubmitted as job {again}: equal")


# ------------------------------------------------------------
# The time limit

# Long enough that Slurm's warning comes during training: 2 nodes x 1 task, 8 epochs
# of 16 steps (about a minute beside its twin). --time=3 with job.sh's own
# --signal=USR1@120: Slurm checks every 30 s whether a warning is due, so it comes
# 30 to 60 s after each start (and a few seconds more on a busy machine).
LONG_EXACT_RUN = (*EXACT_RUN[: EXACT_RUN.index("--epochs")], "--epochs", "8",
                  *EXACT_RUN[EXACT_RUN.index("--epochs") + 2 :])  # fmt: skip


def test_a_job_warned_by_its_time_limit_requeues_itself_and_resumes_exactly(
    lab, tmp_path
):
    workdir = tmp_path / "limited"
    job = submit(lab, NAME, *LONG_EXACT_RUN, workdir=workdir,
                 options=[*ONE_TASK_PER_NODE, "--time=3"])  # fmt: skip
    output = workdir / f"slurm-{job}.out"
    # The twin once this job trains: a warning before main.py has started (its imports
    # slowed by the twin's on the test machine's 2 cores) would end it unsaved.
    wait_until(lambda: "epoch 0 step 4 |" in read(output), 120, "training")
    plain = submit(lab, NAME, *LONG_EXACT_RUN, workdir=tmp_path / "plain",
                   options=ONE_TASK_PER_NODE)  # fmt: skip
    limited, restarts = run_to_the_end(lab, job, workdir)
    uninterrupted = lab.wait(plain, tmp_path / "plain", timeout=300)
    assert limited.ok, limited.output
    assert uninterrupted.ok, uninterrupted.output
    text = unwrapped(limited.output)
    steps = re.findall(r"\[0/2\] Stopped at step (\d+), checkpoint saved", text)
    assert restarts >= 1 and len(steps) == restarts, text
    assert text.count("Requeueing job") == restarts, text
    assert re.findall(RESUMED, text) == steps, text
    assert "TIMEOUT" not in text and "DUE TO TIME LIMIT" not in text, text
    assert_bitwise_equal(
        checkpoint_of(lab, workdir), checkpoint_of(lab, tmp_path / "plain")
    )
    assert_same_summaries(limited, uninterrupted, restarts=restarts)
    print(f"--time=3: warned and requeued {restarts} time(s), at steps {steps}: equal")


# ------------------------------------------------------------
# A lost node


def test_a_job_on_a_lost_node_is_requeued_by_slurm_and_resumes_exactly(
    lab, tmp_path, exact_twin
):
    # cn2 fails: every process on it ends at once, slurmd included. The ranks on cn1
    # lose their peers; srun waits for the lost node's tasks. Slurm marks cn2 DOWN once
    # it has not answered for SlurmdTimeout (30 s on the test cluster, 300 s by
    # default), ends the job with a node failure and requeues it (--requeue). cn2
    # comes back (its slurmd starts again), and the job resumes from its newest
    # checkpoint: the steps since it are done again, and nothing else is lost.
    uninterrupted, plain = exact_twin()  # done first: cn2's failure would end it too
    workdir = tmp_path / "run"
    job = submit(lab, NAME, *EXACT_RUN, workdir=workdir, options=EXACT_LAYOUT)
    output = workdir / f"slurm-{job}.out"
    saved = re.compile(r"Saved \S+/step-(\d+)\.pt")
    wait_until(lambda: len(saved.findall(read(output))) >= 2, 180, "two saves")
    lab.crash_node("cn2")
    lost = time.monotonic()
    wait_for_requeue(lab, job, restarts=1, timeout=180)
    requeued = time.monotonic() - lost
    newest = newest_checkpoint(checkpoint_dir(lab, workdir)).name
    lab.start_node("cn2")
    wait_for_nodes(lab)
    # The next start may get SIGTERM on cn2 alone, from a kill that slurmctld kept
    # for the lost node (seen once in 5 runs): main.py saves, and requeues the job.
    resumed, restarts = run_to_the_end(lab, job, workdir)
    assert resumed.ok, resumed.output
    text = unwrapped(resumed.output)
    assert re.search(rf"JOB {job} ON cn1 CANCELLED AT \S+ DUE TO NODE FAILURE", text)
    step = int(newest.removeprefix("step-").removesuffix(".pt"))
    assert re.findall(RESUMED, text)[0] == str(step), text
    assert len(re.findall(RESUMED, text)) == restarts, text
    assert_bitwise_equal(checkpoint_of(lab, workdir), checkpoint_of(lab, plain))
    assert_same_summaries(resumed, uninterrupted, restarts=restarts)
    print(
        f"cn2 lost: requeued by Slurm {requeued:.0f} s later, resumed at step {step}, "
        f"{restarts} start(s) after the first"
    )


def test_a_sigterm_to_the_tasks_alone_requeues_the_job(lab, tmp_path):
    # SIGTERM reaches the tasks while Slurm goes on running the job: a kill that
    # slurmctld kept for a lost node and delivered once it came back, to the job's
    # next start (seen in the test above), or `scancel --signal=TERM`, made here.
    # main.py saves and stops as at any SIGTERM; left there, the job would end
    # COMPLETED, unfinished. Rank 0 sees that the job still runs, and requeues it.
    job = submit(lab, NAME, *EXACT_RUN, workdir=tmp_path, options=ONE_TASK_PER_NODE)
    output = tmp_path / f"slurm-{job}.out"
    wait_until(lambda: "epoch 0 step 4 |" in read(output), 180, "training")
    subprocess.run(["scancel", "--signal=TERM", job], env=lab.env(), check=True)
    wait_for_requeue(lab, job, restarts=1)  # resuming is shown above
    lab.cancel(job)
    text = unwrapped(read(output))
    assert len(re.findall(r"\[0/2\] Stopped at step \d+, checkpoint saved", text)) == 1
    assert "Requeueing job" in text, text


# ------------------------------------------------------------
# A controller that does not answer


def test_a_requeue_waits_for_a_controller_that_does_not_answer(lab, tmp_path):
    # Slurm's controller may not answer for a while (a restart, a failover). Rank 0's
    # `scontrol requeue` after the warning gives up after a MessageTimeout or two (10 s
    # in CI); one failure must not stop the job for good: main.py tries again until the
    # controller answers.
    job = submit(lab, NAME, *EXACT_RUN, workdir=tmp_path, options=ONE_TASK_PER_NODE)
    output = tmp_path / f"slurm-{job}.out"
    wait_until(lambda: "epoch 0 step 4 |" in read(output), 180, "training")
    rank = wait_until(lambda: find_rank(job, 1), 30, "rank 1")
    with lab.controller_away():
        subprocess.run(["kill", "-USR1", str(rank)], check=True)
        wait_until(lambda: "Requeueing job" in read(output), 60, "the requeue")
        time.sleep(30)  # longer than one try of scontrol
    wait_for_requeue(lab, job, restarts=1)  # resuming is shown above
    lab.cancel(job)
    text = unwrapped(read(output))
    assert "failed, so the job will not start again by itself" not in text, text
    assert "stopped on an error of its own" not in text, text
