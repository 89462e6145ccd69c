"""Preemption, dying ranks and bad launches, under the real Slurm test cluster.

What these tests hold the examples to: a preempted job resumes exactly where it stopped,
and a job that cannot go on ends within a minute, with a message that names the cause,
instead of hanging until its time limit.
"""

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from other_model import MODEL_ARGS, write_language_model_template, write_token_files
from page_text import DOCS
from slurm_lab import Lab, job_processes
from smoke import (
    EXAMPLES,
    EXAMPLES_DIR,
    assert_bitwise_equal,
    load_checkpoint,
    load_sharded_checkpoint,
    newest_checkpoint,
    numbers,
    parse_summaries,
    unwrapped,
)
from test_examples import WORKER

pytestmark = pytest.mark.slurm

FAIL_FAST = (
    60  # seconds: the longest a failing job may take to end, from submission or kill
)
# A long enough run of the generic checkpointing example to interrupt it three times:
# 5 epochs of ResNet-18 on small synthetic images, 32 steps each per rank when the job
# runs one task per node.
SMALL_MODEL = (
    "--synthetic-data", "--synthetic-classes", "10", "--model", "resnet18",
    "--image-size", "32", "--warmup-steps", "10", "--log-every", "8",
)  # fmt: skip
LONG_RUN = (
    *SMALL_MODEL,
    "--epochs",
    "5",
    "--synthetic-size",
    "1024",
    "--batch-size",
    "8",
)
# Periodic checkpoints every 10 steps, as --checkpoint-every would make every few
# minutes: the crash test's job resumes from one.
CHECKPOINT_EVERY_STEPS = 10
# The exact runs read the site's image folder (130 training images of 64 px, 5 classes:
# 8 steps an epoch on 4 ranks), cropped and flipped at random, with 2 DataLoader workers
# per rank, as a reader's real data would be: a resumed run starts new workers, whose
# random draws must not differ.
EXACT_RUN = (
    "--model", "resnet18", "--image-size", "32", "--warmup-steps", "10",
    "--log-every", "4", "--epochs", "4", "--batch-size", "4", "--num-workers", "2",
    "--checkpoint-every-steps", str(CHECKPOINT_EVERY_STEPS),
)  # fmt: skip
EPOCH_END = "val loss"  # what each example logs once an epoch is over
ONE_TASK_PER_NODE = ["--ntasks-per-node=1"]
# The exact runs of step 4: 2 nodes x 2 tasks. With 3 ranks or more, a resumed DDP run
# sums its first step's gradients in the order of an uninterrupted run only thanks to
# order_buckets_as_before() (see the troubleshooting page, and test_concepts.py).
EXACT_LAYOUT = ["--ntasks-per-node=2"]
EXACT_RANKS = 4


def submit(
    lab: Lab, name: str, *args: str, workdir: Path, options=(), site=None, **env
) -> str:
    """Submits the example's job.sh, named after `workdir`:
    the run, whose checkpoints it keeps."""
    workdir.mkdir(parents=True, exist_ok=True)
    script = EXAMPLES_DIR / name / "job.sh"
    options = [f"--job-name={run_name(workdir)}", *options]
    return lab.sbatch(
        script, *args, site=site or name.split("/")[0], workdir=workdir,
        options=options, OMP_NUM_THREADS="1", **env,
    )  # fmt: skip


def run_name(workdir: Path) -> str:
    """A job name of its own for each test and run: the pytest folder, and the run's."""
    return "-".join(workdir.relative_to(workdir.parents[2]).parts)


def wait_until(condition: Callable[[], object], timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := condition():
            return result
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def find_rank(job_id: str, rank: int) -> int | None:
    """The PID of the main.py process of `rank` in job `job_id`."""
    for pid, cmdline, environ in job_processes(job_id):
        if "main.py" in cmdline and f"SLURM_PROCID={rank}" in environ:
            return pid
    return None


def checkpoint_dir(lab: Lab, workdir: Path) -> Path:
    """job.sh's CHECKPOINT_DIR for the run of `workdir`: $SCRATCH/checkpoints/<job
    name>."""
    return lab.state / "scratch" / "checkpoints" / run_name(workdir)


def checkpoint_of(lab: Lab, workdir: Path) -> dict:
    """The checkpoint that job.sh's CHECKPOINT_DIR holds."""
    return load_checkpoint(checkpoint_dir(lab, workdir))


# ------------------------------------------------------------
# Preemption and requeue

# The test cluster's partitions whose jobs a job of `main` preempts (slurm_lab.py):
# requeued at once, after a grace time, or cancelled.
PREEMPTIBLE = ["--partition=preemptible"]


def preempt(lab: Lab, job: str, node: str = "cn2") -> str:
    """Submits a job of the high-priority partition, `main`, that needs more of the
    node's CPUs than are free: Slurm preempts `job`, which holds them, to start it.
    Only the preemptible partitions' jobs may go. Returns its job ID."""
    info = subprocess.run(
        ["scontrol", "show", "node", "-o", node], env=lab.env(),
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    fields = dict(item.split("=", 1) for item in info.split() if "=" in item)
    assert job in lab.job_info(job).get("JobId", ""), job
    needed = int(fields["CPUTot"]) - int(fields["CPUAlloc"]) + 1
    script = lab.state / "preemptor.sh"
    script.write_text("#!/bin/bash\nsleep 2\n")
    return lab.sbatch(
        script, site="generic", workdir=lab.state,
        options=["--partition=main", f"--nodelist={node}", "--ntasks=1",
                 f"--cpus-per-task={needed}"],
    )  # fmt: skip


def restart_when_requeued(lab: Lab, job: str, restarts: int):
    """Waits for the job to be back in the queue, then lets it start at once.

    Slurm holds a requeued job for about two minutes before it may start again.
    """
    wait_for_requeue(lab, job, restarts)
    start_now(lab, job)


def wait_for_requeue(lab: Lab, job: str, restarts: int, timeout: float = FAIL_FAST):
    """Waits until the job is back in the queue, for the `restarts`-th time; fails at
    once if it ends instead."""
    lab.wait_for_state(job, "PENDING", restarts=restarts, timeout=timeout)


def start_now(lab: Lab, job: str):
    """Lets a requeued job start at once, and again until it has started: a requeue
    that completes just after the first `StartTime=now` sets its own later start.

    Not within the second of the requeue: slurmd refuses a start whose credential is
    as old as the revocation of the last one ("Job credential revoked"), and the job
    then ends FAILED."""
    time.sleep(2)
    deadline = time.monotonic() + FAIL_FAST
    while lab.job_info(job).get("JobState") == "PENDING":
        assert time.monotonic() < deadline, f"job {job} did not start"
        # Refused once the job is running: not checked.
        subprocess.run(
            ["scontrol", "update", f"JobId={job}", "StartTime=now"],
            env=lab.env(), capture_output=True,
        )  # fmt: skip
        time.sleep(0.5)


def assert_same_summaries(resumed, uninterrupted, restarts: int) -> list[dict]:
    """The ranks of a resumed job report what its uninterrupted twin's do, but for the
    restart count; returns the resumed job's summaries."""
    mine, theirs = (
        parse_summaries(resumed.output),
        parse_summaries(uninterrupted.output),
    )
    assert len(mine) == len(theirs) > 1, resumed.output
    assert [s.pop("restarts") for s in mine] == [restarts] * len(mine)
    assert [s.pop("restarts") for s in theirs] == [0] * len(mine)
    assert numbers(mine) == numbers(theirs)
    return mine


def test_a_preempted_mila_job_resumes_exactly(lab, tmp_path):
    # The Mila step has DataLoader workers, which Slurm signals
    # too: they must not die of SIGTERM and fail their rank before
    # it saves. 2 nodes x 1 task: short, and exact (above).
    name = "mila/checkpointing"
    args = (
        "--synthetic-data", "--synthetic-size", "600", "--batch-size", "16",
        "--epochs", "2", "--warmup-steps", "10", "--log-every", "5",
    )  # fmt: skip
    options = ONE_TASK_PER_NODE
    plain = submit(lab, name, *args, workdir=tmp_path / "plain", options=options)
    job = submit(lab, name, *args, workdir=tmp_path / "preempted",
                 options=[*options, *PREEMPTIBLE])  # fmt: skip
    output = tmp_path / "preempted" / f"slurm-{job}.out"
    wait_until(lambda: "epoch 0 step 5 |" in read(output), 180, "training")
    time.sleep(random.uniform(0.5, 2.0))
    preempt(lab, job)
    restart_when_requeued(lab, job, 1)
    preempted = lab.wait(job, tmp_path / "preempted", timeout=300)
    uninterrupted = lab.wait(plain, tmp_path / "plain", timeout=300)
    assert uninterrupted.ok, uninterrupted.output
    assert preempted.ok, preempted.output
    text = unwrapped(preempted.output)
    stops = re.findall(r"Stopped at step (\d+), checkpoint saved", text)
    assert len(stops) == 2 and len(set(stops)) == 1, preempted.output
    assert re.search(rf"Resumed from .+ at step {stops[0]}\b", text, re.S), (
        preempted.output
    )
    assert "killed by signal" not in text and "exited unexpectedly" not in text
    assert_bitwise_equal(
        checkpoint_of(lab, tmp_path / "preempted"),
        checkpoint_of(lab, tmp_path / "plain"),
    )
    mine = assert_same_summaries(preempted, uninterrupted, restarts=1)
    print(
        f"mila: preempted at step {stops[0]} of {mine[0]['steps']}: final state "
        "bitwise equal"
    )


# The template's two sections, each on its own data: the image folder (cropped and
# flipped at random; 8 steps an epoch on 4 ranks), for 2 epochs; and token files, for
# 60 steps (an epoch and a half) with a validation every 15, as a language model is
# trained. Validation counts the 25 images, or each of the 13 x 16 validation tokens,
# once.
TEMPLATE_RUNS = {
    "images": (
        ("--model", "resnet18", "--image-size", "32", "--batch-size", "2",
         "--epochs", "2"), 25,
    ),
    "language_model": (
        (*MODEL_ARGS, "--batch-size", "4", "--train-steps", "60", "--eval-every", "15",
         "--min-learning-rate", "1e-5"), 13 * 16,
    ),
}  # fmt: skip


@pytest.mark.parametrize("section", TEMPLATE_RUNS)
def test_the_template_requeued_resumes_exactly(lab, tmp_path, section):
    # The template submitted from its folder with its own job.sh: with its image
    # section, as it is; with the language model's section in place of it, as a reader
    # makes it (other_model.py), on token files. 2 nodes x 2 tasks, 2 DataLoader workers
    # each, accumulation. Preempted part-way through training, and requeued by Slurm,
    # the job must end bitwise equal to the same job uninterrupted.
    own_args, val_samples = TEMPLATE_RUNS[section]
    folder = EXAMPLES_DIR / "generic" / "template"
    data = {}  # the site's image archive
    if section == "language_model":
        folder = write_language_model_template(tmp_path / "language_model")
        # 40 steps an epoch: a step takes milliseconds, and the requeue must come
        # before the end. The token files in an archive of their own, which job.sh
        # copies to each node as it does the images (DATA_ARCHIVE).
        tokens = write_token_files(tmp_path / "tokens", 1360, val_sequences=13)
        with tarfile.open(tmp_path / "tokens.tar", "w") as archive:
            for name in ("train.bin", "val.bin"):
                archive.add(tokens / name, arcname=name)
        data = {"DATA_ARCHIVE": str(tmp_path / "tokens.tar")}
    args = (
        *own_args, "--accumulation-steps", "2", "--warmup-steps", "4",
        "--log-every", "5", "--num-workers", "2",
    )  # fmt: skip

    def submit_template(workdir: Path, *partition: str) -> str:
        workdir.mkdir()
        return lab.sbatch(
            folder / "job.sh", *args, site="generic", workdir=workdir,
            options=[f"--job-name={run_name(workdir)}", *EXACT_LAYOUT, *partition],
            OMP_NUM_THREADS="1", **data,
        )  # fmt: skip

    plain = submit_template(tmp_path / "plain")
    job = submit_template(tmp_path / "requeued", *PREEMPTIBLE)
    output = tmp_path / "requeued" / f"slurm-{job}.out"
    wait_until(lambda: "epoch 0 step 5 |" in read(output), 180, "training")
    time.sleep(random.uniform(0.1, 1.0))
    preempt(lab, job)
    restart_when_requeued(lab, job, 1)
    requeued = lab.wait(job, tmp_path / "requeued", timeout=300)
    uninterrupted = lab.wait(plain, tmp_path / "plain", timeout=300)
    assert uninterrupted.ok, uninterrupted.output
    assert requeued.ok, requeued.output
    stops = re.findall(
        r"\[\d/4\] Stopped at step (\d+), checkpoint saved", requeued.output
    )
    assert len(stops) == EXACT_RANKS and len(set(stops)) == 1, requeued.output
    assert re.search(rf"Resumed from \S+ at step {stops[0]}\b", requeued.output)
    assert_bitwise_equal(
        checkpoint_of(lab, tmp_path / "requeued"),
        checkpoint_of(lab, tmp_path / "plain"),
    )
    mine = assert_same_summaries(requeued, uninterrupted, restarts=1)
    summary = mine[0]
    assert summary["finished"] and summary["last_loss"] < summary["first_loss"], mine
    assert all(s["val_samples"] == val_samples for s in mine), mine
    assert "Unpacked the dataset in" in requeued.output, requeued.output
    if section == "language_model":
        # Validated every 15 steps and at the epoch's end, each time once, the stop and
        # requeue notwithstanding.
        validated = [int(s) for s in re.findall(r"Step (\d+): val", requeued.output)]
        assert validated == sorted(set(validated)), requeued.output
        assert [s for s in validated if s % 15 == 0] == [15, 30, 45, 60], validated
        assert len(validated) == 5 and summary["steps"] == 60, (validated, mine)
    right = summary["val_accuracy"] * val_samples  # a share of tokens, or of images
    assert abs(right - round(right)) < 1e-6, mine
    print(f"{section}: requeued at step {stops[0]}: final state bitwise equal")


def test_a_warned_fsdp_job_requeues_itself_and_resumes_exactly(lab, tmp_path):
    # The FSDP2 step: every rank saves its own shard of the checkpoint,
    # into a folder that rank 0 renames when complete; the requeued job
    # loads the shards back. Warned with SIGUSR1, as --signal=USR1@120
    # warns before the time limit, rank 0 requeues the job itself.
    name = "generic/fsdp"
    # 2 epochs of 30 steps, stopped after one of the first 15: well before the end;
    # micro-batches of 6, and a checkpoint written in the background every 4 steps.
    args = (*EXAMPLES[name].args, "--synthetic-size", "360", "--log-every", "1",
            "--micro-batch-size", "6", "--checkpoint-every-steps", "4")  # fmt: skip
    options = ONE_TASK_PER_NODE
    plain = submit(lab, name, *args, workdir=tmp_path / "plain", options=options)
    job = submit(lab, name, *args, workdir=tmp_path / "warned", options=options)
    output = tmp_path / "warned" / f"slurm-{job}.out"
    step = random.randint(3, 15)
    wait_until(lambda: f" step {step} |" in read(output), 180, f"training step {step}")
    subprocess.run(["scancel", "--signal=USR1", job], env=lab.env(), check=True)
    restart_when_requeued(lab, job, 1)
    warned = lab.wait(job, tmp_path / "warned", timeout=300)
    uninterrupted = lab.wait(plain, tmp_path / "plain", timeout=300)
    assert uninterrupted.ok, uninterrupted.output
    assert warned.ok, warned.output
    stops = re.findall(
        r"\[\d/2\] Stopped at step (\d+), checkpoint saved", warned.output
    )
    assert len(stops) == 2 and len(set(stops)) == 1, warned.output
    assert "Requeueing job" in warned.output
    assert re.search(rf"Resumed from \S+ at step {stops[0]}, in ", warned.output), (
        warned.output
    )
    scratch = lab.state / "scratch" / "checkpoints"
    assert_bitwise_equal(
        load_sharded_checkpoint(scratch / run_name(tmp_path / "warned")),
        load_sharded_checkpoint(scratch / run_name(tmp_path / "plain")),
    )
    mine = assert_same_summaries(warned, uninterrupted, restarts=1)
    print(
        f"fsdp: warned at step {stops[0]} of {mine[0]['steps']}: final state bitwise "
        "equal"
    )


def kill_a_rank_after_a_save(lab: Lab, job: str, output: Path, saves: int) -> int:
    """SIGKILL to rank 1 at an unplanned step once the job's output holds `saves`
    saves, as an out-of-memory kill or a GPU error ends a process: no signal to catch,
    nothing saved at the end. Returns the step of the newest checkpoint."""
    saved = re.compile(r"Saved \S+/step-(\d+)\.pt")
    wait_until(
        lambda: len(saved.findall(read(output))) >= saves, 120, f"save number {saves}"
    )
    time.sleep(random.uniform(0.1, 1.5))
    os.kill(wait_until(lambda: find_rank(job, 1), 30, "rank 1"), signal.SIGKILL)
    return max(int(step) for step in saved.findall(read(output)))


@pytest.mark.every_version
@pytest.mark.since_slurm("24.11")
def test_a_crashed_job_requeues_itself_and_resumes_exactly(lab, tmp_path, exact_twin):
    # One rank killed once a periodic checkpoint is on disk: srun fails, and job.sh
    # puts the job back in the queue. It resumes from the newest checkpoint and ends
    # bitwise equal to the twin, which saved at the same steps uninterrupted.
    name = "generic/checkpointing"
    workdir = tmp_path / "run"
    job = submit(lab, name, *EXACT_RUN, workdir=workdir, options=EXACT_LAYOUT)
    output = workdir / f"slurm-{job}.out"
    kill_a_rank_after_a_save(lab, job, output, saves=1)
    wait_for_requeue(lab, job, restarts=1)
    crashed = read(output)
    assert "requeueing the job to resume from its last checkpoint (failure 1 of the 3" \
        in unwrapped(crashed), crashed  # fmt: skip
    assert "checkpoint saved" not in crashed, crashed
    # The newest on disk: a periodic checkpoint, or the one at an epoch's end if the
    # kill came after it (read from the folder: a kill can come between a save's rename
    # and its log line).
    folder = checkpoint_dir(lab, workdir)
    newest = int(newest_checkpoint(folder).stem.removeprefix("step-"))
    start_now(lab, job)
    resumed = lab.wait(job, workdir, timeout=300)
    uninterrupted, plain = exact_twin()
    assert resumed.ok, resumed.output
    assert uninterrupted.ok, uninterrupted.output
    assert re.search(rf"Resumed from \S+ at step {newest}\b", resumed.output)
    assert_bitwise_equal(checkpoint_of(lab, workdir), checkpoint_of(lab, plain))
    # Under load, the resumed start was itself stopped by a signal 30-34 s in, in 2 of
    # 3 runs with another test worker busy (never alone): it saved, requeued itself and
    # ended exact, one restart more. Each such requeue says so; the sender is not yet
    # known (issue 46's closing note).
    again = resumed.output.count("] Requeueing job")
    assert_same_summaries(resumed, uninterrupted, restarts=1 + again)
    print(f"killed after the checkpoint of step {newest}: requeued, final state equal")


def test_a_job_that_crashes_every_time_stops_at_its_budget(lab, tmp_path):
    # CRASH_RESTARTS=1: the first crash after a checkpoint requeues the job; the second
    # ends it FAILED, with the count and the way on. job.sh's count, whatever the
    # layout: one task per node.
    name = "generic/checkpointing"
    job = submit(lab, name, *LONG_RUN, "--checkpoint-every-steps", "4",
                 workdir=tmp_path, options=ONE_TASK_PER_NODE,
                 CRASH_RESTARTS="1")  # fmt: skip
    output = tmp_path / f"slurm-{job}.out"
    kill_a_rank_after_a_save(lab, job, output, saves=1)
    restart_when_requeued(lab, job, restarts=1)
    wait_until(lambda: "Resumed from" in read(output), 120, "the second run")
    # The first run may have saved more than once before its kill: a save of this one.
    first_run = len(re.findall(r"Saved \S+/step-\d+\.pt", read(output)))
    kill_a_rank_after_a_save(lab, job, output, saves=first_run + 1)
    ended = lab.wait(job, tmp_path, timeout=FAIL_FAST)
    assert ended.state == "FAILED", ended.output
    assert lab.job_info(job).get("Restarts") == "1"
    folder = checkpoint_dir(lab, tmp_path)
    assert (
        "failure 2 of this job, over CRASH_RESTARTS=1: the job is not requeued. Fix "
        f"the cause, then resubmit: the job resumes from its checkpoint in {folder}"
    ) in unwrapped(ended.output), ended.output


def test_a_job_that_stops_on_its_own_error_is_not_requeued(lab, tmp_path):
    # Every save from step 8 on fails, as on a full disk (tests/helpers/faults/): after
    # 2 in a row, main.py stops every rank with the cause. A person must act, so job.sh
    # must not requeue the job, although this start saved a checkpoint (step 4). One
    # task per node: the stop is every rank's, whatever their number.
    name = "generic/checkpointing"
    faults = str(Path(__file__).parent / "helpers" / "faults")
    job_id = submit(
        lab, name, *LONG_RUN, "--checkpoint-every-steps", "4", "--max-failed-saves",
        "2", workdir=tmp_path, options=ONE_TASK_PER_NODE, PYTHONPATH=faults,
        FAIL_SAVE=r"step-0000000[89]|step-000000[1-9]", FAIL_SAVE_TIMES="all",
    )  # fmt: skip
    job = lab.wait(job_id, tmp_path, timeout=120)
    assert job.state == "FAILED", job.output
    text = unwrapped(job.output)
    assert "error: 2 checkpoints in a row could not be saved" in text, text
    assert "main.py stopped on an error of its own, above: the job is not requeued" in (
        text
    )
    assert lab.job_info(job_id).get("Restarts") == "0"


# ------------------------------------------------------------
# A rank dies


def test_a_killed_rank_ends_the_whole_job_at_once(lab, tmp_path):
    # A rank that dies must end the job, with the dead task named, not
    # leave it hanging. srun --kill-on-bad-exit=1 sees to it for any
    # backend. (gloo, which the CPU runs use, also notices the closed
    # connections by itself; NCCL often waits until its timeout.)
    job_id = submit(lab, "generic/checkpointing", *LONG_RUN, workdir=tmp_path)
    output = tmp_path / f"slurm-{job_id}.out"
    # Killed in the middle of an epoch, with DataLoader workers running.
    wait_until(lambda: "epoch 0 step 8 |" in read(output), 120, "training")
    os.kill(wait_until(lambda: find_rank(job_id, rank=1), 30, "rank 1"), signal.SIGKILL)
    killed = time.monotonic()
    job = lab.wait(job_id, tmp_path, timeout=120)
    took = time.monotonic() - killed
    assert took < FAIL_FAST, job.output
    assert job.state == "FAILED" and job.exit_code != "0:0", job.output
    # On cn1, or from Slurm 26.05 on cn2 (the order of the test cluster's topology).
    assert re.search(r"cn\d: task 1: Killed", job.output), job.output
    # The other ranks failed in their next collective and exited by themselves: none
    # waited for Slurm's SIGKILL, KillWait (30 s) after srun ended the step.
    assert re.findall(r"tasks? (\S+): Killed", job.output) == ["1"], job.output
    # The job had the ranks that launchers.md says a killed rank ends.
    ranks = re.search(r"Global batch: \d+ x (\d+) =", job.output)[1]
    said = re.search(
        r"a killed rank ends an? (\d+)-rank job",
        " ".join((DOCS / "launchers.md").read_text().split()),
    )
    assert said and said[1] == ranks, f"launchers.md: {said and said[0]}, ranks {ranks}"
    # Killed before the run's first checkpoint: job.sh does not requeue it.
    assert "before this start saved a checkpoint: the job is not requeued" in unwrapped(
        job.output
    ), job.output
    print(f"rank 1 killed: the job ended in {took:.1f} s")


# ------------------------------------------------------------
# Bad launches: each ends the job within a minute, with the cause and the fix


def timed_job(lab: Lab, job_id: str, workdir: Path, what: str):
    start = time.monotonic()
    job = lab.wait(job_id, workdir, timeout=2 * FAIL_FAST)
    took = time.monotonic() - start
    assert job.state == "FAILED", job.output
    assert took < FAIL_FAST, f"took {took:.0f} s\n{job.output}"
    assert "summary:" not in job.output
    print(f"{what}: failed in {took:.1f} s")
    return job


# How each site's scripts make torch importable, for the
# hand-written wrong scripts below.
SITE_SETUP = {
    "generic": 'source "$HOME/venvs/ddp/bin/activate"',
    "mila": "module load anaconda/3 && conda activate pytorch",
}


@pytest.mark.parametrize(
    ("name", "args", "message"),
    [
        (
            "generic/checkpointing",
            "--synthetic-data --epochs 1",
            "main.py was started by the batch script, not by srun",
        ),
        (
            "mila/checkpointing",
            "--synthetic-data --epochs 1",
            "main.py was started by the batch script, not by srun",
        ),
    ],
)
def test_python_without_srun_fails_fast(lab, tmp_path, name, args, message):
    # The classic hang: `python main.py` in a job of 4 tasks starts one process, which
    # would wait forever for the other three.
    site = name.split("/")[0]
    script = tmp_path / "wrong.sh"
    script.write_text(
        f"#!/bin/bash\n{SITE_SETUP[site]}\ncd {EXAMPLES_DIR / name}\npython main.py "
        f"{args}\n"
    )
    options = ["--nodes=2", "--ntasks-per-node=2"]
    job_id = lab.sbatch(script, site=site, workdir=tmp_path, options=options)
    job = timed_job(lab, job_id, tmp_path, f"{name}: python without srun")
    assert message in job.output


def test_resuming_with_another_task_count_fails_fast(lab, tmp_path, exact_twin):
    name = "generic/checkpointing"
    # The checkpoints of the twin of the exact runs, 2 nodes x 2 tasks, with 2 tasks.
    _, plain = exact_twin()
    job_id = submit(
        lab, name, *EXACT_RUN, "--checkpoint-dir", str(checkpoint_dir(lab, plain)),
        workdir=tmp_path, options=ONE_TASK_PER_NODE,
    )  # fmt: skip
    job = timed_job(lab, job_id, tmp_path, "resume with 2 tasks from 4")
    assert "was written by 4 processes, and this job has 2" in job.output


def test_master_port_in_use_fails_fast(lab, tmp_path):
    name = "generic/checkpointing"
    job_id = submit(lab, name, *LONG_RUN, workdir=tmp_path, options=["--hold"])
    port = 10000 + int(job_id) % 10000  # as job.sh derives it
    # Another process holds the port on the job's first node, cn1.
    holder = subprocess.Popen(
        ["ip", "netns", "exec", "ddplab-cn1", "python3", "-c",
         "import socket, sys, time; s = socket.socket(); "
         f"s.bind(('0.0.0.0', {port})); s.listen(); "
         "print('bound', flush=True); time.sleep(300)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "bound"
        subprocess.run(["scontrol", "release", job_id], env=lab.env(), check=True)
        job = timed_job(lab, job_id, tmp_path, "MASTER_PORT in use")
    finally:
        holder.kill()
        holder.wait()
    # The first task on cn1 serves the rendezvous: rank 0, but for Slurm 26.05's
    # order of tasks (tests/helpers/slurm_lab.py, topology.conf).
    assert re.search(
        rf"rank \d+ cannot listen on port {port} of cn1: another process holds it",
        job.output,
    ), job.output


def test_a_head_node_that_never_comes_up_fails_fast(lab, tmp_path):
    # MASTER_ADDR names cn1, but every task runs on cn2: nothing will ever listen on
    # cn1, as when the first node is down or its task never started. The rendezvous
    # gives up after the short timeout that main.py sets, instead of torch's 30 minutes.
    name = "generic/checkpointing"
    script = tmp_path / "wrong.sh"
    script.write_text(
        f"#!/bin/bash\n{SITE_SETUP['generic']}\ncd {EXAMPLES_DIR / name}\n"
        "export MASTER_ADDR=cn1 MASTER_PORT=$((10000 + SLURM_JOB_ID % 10000))\n"
        "srun --kill-on-bad-exit=1 --nodes=1 --relative=1 --ntasks=2 "
        "python main.py --rendezvous-timeout 15\n"
    )
    job_id = lab.sbatch(
        script, site="generic", workdir=tmp_path,
        options=["--nodes=2", "--ntasks-per-node=2"], OMP_NUM_THREADS="1",
    )  # fmt: skip
    job = timed_job(lab, job_id, tmp_path, "head node never up")
    assert re.search(r"waited 15 s for the rendezvous at cn1:\d+", job.output), (
        job.output
    )


@pytest.mark.parametrize(
    ("name", "site", "message"),
    [
        # Without $SCRATCH the checkpoints would go to /checkpoints, which a user
        # cannot write to: rank 0 would die at its first save, an epoch into the job.
        (
            "generic/checkpointing", "no_scratch",
            "SCRATCH: is not set: set it, or this line, to shared storage outliving "
            "jobs",
        ),
        # The template unpacks its dataset in a folder on each node's own disk, which
        # the site names ($SLURM_TMPDIR by default): without it, not in a folder that
        # every job shares.
        (
            "generic/template", "no_local_disk",
            "error: SLURM_TMPDIR is not set: set local_disk in job.sh to a folder on "
            "each node's own disk",
        ),
    ],
)  # fmt: skip
def test_a_site_without_what_job_sh_needs_stops_before_srun(
    lab, tmp_path, name, site, message
):
    job_id = submit(lab, name, *EXAMPLES[name].args, workdir=tmp_path, site=site)
    job = timed_job(lab, job_id, tmp_path, f"the {site} site")
    assert message in job.output
    assert "Unpacked" not in job.output
    assert "Running on" not in job.output


def test_the_template_without_its_dataset_archive_stops_before_srun(lab, tmp_path):
    # A user who has not packed the dataset yet: a real run stops before any srun, with
    # the archive's path and the two ways on; a trial on synthetic data needs neither
    # the archive nor a folder on the nodes' disks, and trains.
    name = "generic/template"
    archive = lab.state / "scratch" / "data" / "imagenet.tar"
    hidden = archive.with_name("imagenet.tar.away")
    trial = ("--synthetic-data", "--synthetic-size", "64", "--synthetic-classes", "4")
    archive.rename(hidden)
    try:
        job_id = submit(lab, name, *EXAMPLES[name].args, workdir=tmp_path / "real")
        job = timed_job(lab, job_id, tmp_path / "real", "no dataset archive")
        trial_id = submit(
            lab, name, *EXAMPLES[name].args, *trial, workdir=tmp_path / "trial",
            site="no_local_disk", options=ONE_TASK_PER_NODE,
        )  # fmt: skip
        tried = lab.wait(trial_id, tmp_path / "trial", timeout=300)
    finally:
        hidden.rename(archive)
    assert f"error: no dataset archive at {archive}: make it" in job.output
    assert "--synthetic-data" in job.output
    assert "Running on" not in job.output
    assert tried.ok, tried.output
    assert "Unpacked" not in tried.output
    assert len(parse_summaries(tried.output)) == 2, tried.output


# An archive larger than the nodes' free space (a sparse file, which takes no room):
# each node checks its own disk, and the job stops before tar fills it. And one that
# fits a folder in memory (tmpfs; the site's $SLURM_TMPDIR in /dev/shm), but would take
# more than half the memory the job asked for: the memory, not the folder's size, is
# what the dataset takes there.
TOO_LARGE = {
    "disk": (
        4 << 40, "generic", [],
        r"error: {node}: \S+/dataset has \d+ GiB free, and the dataset needs 4300 "
        r"GiB: set local_disk in job.sh to a larger disk",
    ),
    "memory": (
        6 << 30, "tmpfs_local_disk", ["--mem=8G"],
        r"error: {node}: /dev/shm/\S+/dataset is in memory \(tmpfs\): the dataset "
        r"needs 6 GiB of the 8 GiB the job asked for per node, more than half",
    ),
}  # fmt: skip


@pytest.mark.parametrize("where", TOO_LARGE)
def test_the_template_stops_before_unpacking_a_dataset_that_does_not_fit(
    lab, tmp_path, where
):
    size, site, options, message = TOO_LARGE[where]
    name = "generic/template"
    archive = lab.state / "scratch" / "data" / "imagenet.tar"
    hidden = archive.with_name("imagenet.tar.away")
    archive.rename(hidden)
    try:
        with open(archive, "wb") as f:
            f.truncate(size)
        job_id = submit(lab, name, *EXAMPLES[name].args, workdir=tmp_path, site=site,
                        options=options)  # fmt: skip
        job = timed_job(lab, job_id, tmp_path, f"too small a {where}")
    finally:
        archive.unlink(missing_ok=True)
        hidden.rename(archive)
        for folder in Path("/dev/shm").glob("ddp-slurm-lab-*"):
            shutil.rmtree(folder)
    for node in ("cn1", "cn2"):
        assert re.search(message.format(node=node), unwrapped(job.output)), job.output
    assert "Running on" not in job.output


def test_a_job_given_gpus_that_cuda_cannot_use_fails_fast(lab, tmp_path):
    # The lab's GPUs are stand-ins, as unusable to CUDA as GPUs
    # behind a too-old driver. Without TRAIN_ON_CPU=1, which the
    # site profiles set, the job must stop, not train on CPUs.
    job_id = submit(
        lab, "generic/multi_gpu", *EXAMPLES["generic/multi_gpu"].args,
        workdir=tmp_path, TRAIN_ON_CPU="",
    )  # fmt: skip
    job = timed_job(lab, job_id, tmp_path, "GPUs that CUDA cannot use")
    # job.sh asks for 4 GPUs per node.
    assert re.search(
        r"was given GPUs \(SLURM_GPUS_ON_NODE=4, CUDA_VISIBLE_DEVICES=\S+\)", job.output
    )
    assert "Running on" not in job.output


def test_without_kill_on_bad_exit_srun_reports_the_failed_task_and_waits(lab, tmp_path):
    # launchers.md: by default, srun reports the failed task and waits for the others.
    # Task 1 fails at once; task 0 ends on its own 5 s later, and srun waited for it.
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        "srun --ntasks=2 bash -c "
        "'if [ $SLURM_PROCID = 1 ]; then exit 3; fi; sleep 5; echo task 0 finished'\n"
        'echo "srun exit status: $?"\n'
    )
    job = lab.sbatch(script, site=None, workdir=tmp_path, options=["--ntasks=2"])
    done = lab.wait(job, tmp_path, timeout=FAIL_FAST)
    assert re.search(r"task 1: Exited with exit code 3", done.output), done.output
    assert "task 0 finished" in done.output, done.output
    assert "srun exit status: 3" in done.output, done.output


def test_kill_on_bad_exit_stops_the_other_nodes_torchrun(lab, tmp_path):
    # launchers.md: srun starting torchrun once per node; the last rank, on the second
    # node, fails. Its torchrun ends with an error, and --kill-on-bad-exit=1 stops the
    # first node's torchrun at once, which passes the SIGTERM on to its workers.
    (tmp_path / "worker.py").write_text(WORKER)
    torchrun = Path(sys.executable).parent / "torchrun"
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -1)\n'
        f"srun --kill-on-bad-exit=1 {torchrun} --nnodes=2 --nproc-per-node=2 "
        "--rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:29541 "
        "--rdzv-id=$SLURM_JOB_ID worker.py fail\n"
    )
    options = ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=2"]
    job = lab.sbatch(script, site=None, workdir=tmp_path, options=options)
    done = lab.wait(job, tmp_path, timeout=FAIL_FAST)
    assert done.state == "FAILED", done.output
    # Every worker started; the ones of the node whose torchrun srun stopped saved.
    assert sorted(p.name for p in tmp_path.glob("ready-*")) == [
        f"ready-{rank}" for rank in range(4)
    ], done.output
    saved = sorted(p.name for p in tmp_path.glob("saved-SIGTERM-*"))
    print(saved, done.elapsed)
    assert len(saved) == 3, (saved, done.output)
    assert re.search(r"task [01]: Exited with exit code 1", done.output), done.output


def test_sigusr1_to_a_batch_shell_without_a_trap_ends_the_job(lab, tmp_path):
    # launchers.md and the Mila page: what --signal=B:USR1@... does to a job.sh with no
    # trap. The signal is sent as B: sends it, to the batch shell alone (scancel -b):
    # bash dies of it, and Slurm ends the step that trains, long before its end.
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        "srun bash -c 'touch started; sleep 60; echo training finished'\n"
        'echo "the batch script went on"\n'
    )
    job = lab.sbatch(script, site=None, workdir=tmp_path, options=["--ntasks=1"])
    wait_until(lambda: (script.parent / "started").exists(), 60, "the step")
    subprocess.run(
        ["scancel", "--batch", "--signal=USR1", job], env=lab.env(), check=True
    )
    done = lab.wait(job, tmp_path, timeout=FAIL_FAST)
    assert done.state in {"FAILED", "CANCELLED"} and done.elapsed < 40, done
    assert "training finished" not in done.output, done.output
    assert "the batch script went on" not in done.output, done.output
    assert lab.job_info(job).get("ExitCode", "").endswith(":10"), lab.job_info(job)
