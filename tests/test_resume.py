"""The checkpointing examples, stopped part-way and started
again, end as if never stopped.

These are direct smoke runs, without Slurm: one rank gets SIGTERM during training, all
ranks stop after the same step, and a second run resumes from the checkpoint. The Slurm
tests (test_failures.py) do the same through real requeues.
"""

import contextlib
import dataclasses
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from smoke import (
    EXAMPLES,
    EXAMPLES_DIR,
    assert_bitwise_equal,
    decode_records,
    descendants,
    load_checkpoint,
    load_main,
    newest_checkpoint,
    numbers,
    run_example,
    unwrapped,
)

# Long enough to be stopped in the middle: several steps per epoch, two epochs.
ARGS = {
    "mila/checkpointing": (
        "--synthetic-data", "--synthetic-size", "600", "--batch-size", "16",
        "--epochs", "2", "--warmup-steps", "10", "--log-every", "5",
    ),
    "generic/checkpointing": (
        "--synthetic-data", "--synthetic-size", "1200", "--synthetic-classes", "10",
        "--model", "resnet18", "--image-size", "32", "--batch-size", "8",
        "--epochs", "2", "--warmup-steps", "10", "--log-every", "5",
    ),
    # The template: on an image folder (smoke.py's, 130 training images) with its random
    # crops and flips, 2 DataLoader workers per rank, accumulation and the learning
    # rate's warm-up and decay, all of which a resumed run must pick up where they were.
    "generic/template": (
        "--model", "resnet18", "--image-size", "32", "--batch-size", "2",
        "--accumulation-steps", "2", "--epochs", "2", "--warmup-steps", "10",
        "--log-every", "5", "--num-workers", "2",
    ),
    # FSDP2: a transformer, sharded, with micro-batches.
    "generic/fsdp": (*EXAMPLES["generic/fsdp"].args, "--micro-batch-size", "6"),
}  # fmt: skip
# A line that each example prints once training has begun.
TRAINING = {
    "mila/checkpointing": "epoch 0 step 5 |",
    "generic/checkpointing": "epoch 0 step 5 |",
    "generic/template": "epoch 0 step 5 |",
}


def signal_if_alive(pid: int, signum: int):
    # A worker may end between the scan of /proc and the signal.
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def wait_for_training(name: str, logs: list[Path]):
    deadline = time.monotonic() + 120
    while TRAINING[name] not in logs[0].read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)


def test_a_trial_with_max_steps_leaves_the_real_run_to_train_in_full(tmp_path):
    # A trial and then the real run in one folder, as a reader may do against the adapt
    # page's advice: the trial stops part-way through the first epoch and says so; the
    # real run goes on from its checkpoint, with new DataLoader workers, to the end,
    # and ends bitwise equal to a real run alone.
    name, launch = "generic/template", EXAMPLES["generic/template"]
    args = ARGS[name]
    alone = run_example(name, launch, args, env={"CHECKPOINT_DIR": str(tmp_path / "a")})
    assert alone.ok and alone.summaries[0]["finished"], alone.output
    env = {"CHECKPOINT_DIR": str(tmp_path / "b")}
    trial = run_example(name, launch, (*args, "--max-steps", "3"), env=env)
    assert trial.ok, trial.output
    assert "Stopped by --max-steps 3 after step 3, with 0 of 2 epochs done" in (
        unwrapped(trial.output)
    )
    assert [s["finished"] for s in trial.summaries] == [False, False]
    assert trial.summaries[0]["steps"] == 3 and trial.summaries[0]["epoch"] == 0
    real = run_example(name, launch, args, env=env)
    assert real.ok, real.output
    assert re.search(r"Resumed from .+ at step 3\b", unwrapped(real.output), re.S)
    assert numbers(real.summaries) == numbers(alone.summaries)
    assert_bitwise_equal(
        load_checkpoint(tmp_path / "b"), load_checkpoint(tmp_path / "a")
    )


def test_a_time_limit_warning_after_training_does_not_end_the_process(tmp_path):
    # Slurm's SIGUSR1 may come as a finished run exits. Python puts back the default
    # action of the signals it handles before it clears its modules, and SIGUSR1's
    # ends the process (status 138: job.sh would take it for a crash). After the
    # stop agreement, the warning is ignored. Here the exit is slowed down by one
    # object's __del__, and the signal comes during it.
    script = tmp_path / "finished.py"
    script.write_text(
        "import os, subprocess, sys, time\n"
        "import torch.distributed as dist\n"
        f"sys.path.insert(0, {str(EXAMPLES_DIR / 'generic' / 'checkpointing')!r})\n"
        "from stopping import Agreement\n"
        "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0,"
        " world_size=1)\n"
        "with Agreement(30) as agreement:\n"
        "    agreement.poll()\n"
        "dist.destroy_process_group()\n"
        "class SlowExit:\n"
        "    def __del__(self):\n"
        "        time.sleep(1.5)\n"
        "slow = SlowExit()\n"
        "subprocess.Popen(['sh', '-c', f'sleep 0.5; kill -USR1 {os.getpid()}'])\n"
        "print('trained', flush=True)\n"
    )
    run = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert "trained" in run.stdout, run.stderr
    assert run.returncode == 0, (run.returncode, run.stderr)


# What a stand-in scontrol is asked at each call, in turn, and what it does (a line of
# shell each).
REQUEUE, SHOW = "requeue 96", "show job --oneliner 96"
LOST_ANSWER = (
    "echo 'slurm_requeue error: Unexpected message received for job 96' >&2; exit 1"
)
ENDED_BY_THE_REQUEUE = "kill -TERM $$; exit 1"
ALREADY_ENDING = (
    "echo 'slurm_requeue error: Job/step already completing or completed' >&2; exit 1"
)
REFUSED = "echo 'Requested operation is presently disabled for job 96' >&2; exit 1"
RUNNING = "echo 'JobId=96 JobState=RUNNING Restarts=0 PreemptTime=None'"


@pytest.mark.parametrize(
    "calls, seconds_left, stops_for_good",
    [
        # Seen in CI (24.11, the controller stopped for 30 s): the requeue's answer is
        # lost after 10 s; once back, the controller requeues the job, and its SIGTERM
        # ends the call that asks again. The job starts again: no error, no mark.
        ([(REQUEUE, LOST_ANSWER), (REQUEUE, ENDED_BY_THE_REQUEUE)], 3600, False),
        ([(REQUEUE, LOST_ANSWER), (REQUEUE, LOST_ANSWER), (REQUEUE, "exit 0")], 3600,
         False),
        # Too close to the time limit to ask again: the job's state is asked instead,
        # and the requeue's SIGTERM ends that call.
        ([(REQUEUE, LOST_ANSWER), (SHOW, ENDED_BY_THE_REQUEUE)], 19, False),
        # A preemption ends the job as it is requeued: ended, not refused.
        ([(REQUEUE, ALREADY_ENDING), (SHOW, ENDED_BY_THE_REQUEUE)], 3600, False),
        # A refusal of a job still running is for a person: the mark, the message.
        ([(REQUEUE, REFUSED), (SHOW, RUNNING)], 3600, True),
    ],
)  # fmt: skip
def test_a_requeue_whose_answer_is_lost_or_late_is_not_taken_for_a_refusal(
    tmp_path, monkeypatch, calls, seconds_left, stops_for_good
):
    stopping = load_main("generic/checkpointing", "stopping.py")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    answers, asked = tmp_path / "answers", tmp_path / "asked"
    answers.write_text("".join(answer + "\n" for _, answer in calls))
    scontrol = bin_dir / "scontrol"
    # Call N takes line N of the answers; a call beyond them fails plainly.
    scontrol.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {shlex.quote(str(asked))}\n'
        f"n=$(wc -l < {shlex.quote(str(asked))})\n"
        f'eval "$(sed -n "${{n}}p" {shlex.quote(str(answers))})"\n'
        "exit 99\n"
    )
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "96")
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(int(time.time()) + seconds_left))
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    # No waiting between tries.
    clock = types.SimpleNamespace(time=time.time, sleep=lambda seconds: None)
    monkeypatch.setattr(stopping, "time", clock)
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    with contextlib.ExitStack() as stack:
        if stops_for_good:
            stack.enter_context(pytest.raises(SystemExit, match="failed, so the job"))
        stopping.requeue(signal.SIGUSR1, max_restarts=3, folder=folder)
    assert asked.read_text().splitlines() == [call for call, _ in calls]
    assert (folder / stopping.STOPPED_MARK).exists() == stops_for_good


def test_dataloader_workers_leave_the_stop_signals_to_their_rank(tmp_path):
    # Slurm's SIGTERM and SIGUSR1 reach the fork server and the workers
    # too. If they died of them, their rank would fail as it waited for
    # its next batch, before it could save. Here only the processes
    # under rank 1 are signalled, so training must go on to the end.
    name = "mila/checkpointing"
    signalled = []

    def signal_workers(procs, logs: list[Path]):
        wait_for_training(name, logs)
        # The fork server, its resource tracker, and a worker, signalled as soon as one
        # scan finds all three: a worker exists only while its loader is iterated.
        deadline = time.monotonic() + 60
        found = []
        while len(found) < 3 and time.monotonic() < deadline:
            found = descendants(procs[1].pid)
        signalled.extend(found)
        for pid in signalled:
            signal_if_alive(pid, signal.SIGTERM)
            signal_if_alive(pid, signal.SIGUSR1)

    run = run_example(
        name, EXAMPLES[name], ARGS[name], env={"CHECKPOINT_DIR": str(tmp_path)},
        while_running=signal_workers,
    )  # fmt: skip
    assert len(signalled) >= 3, signalled
    assert run.ok, run.output
    assert "Stopped at step" not in run.output
    assert len(run.summaries) == EXAMPLES[name].world_size


def test_a_stop_during_validation_saves_at_once_and_validates_on_resumption(tmp_path):
    # Validation, like training, must give way to a stop signal: if it
    # ran to its end, a job warned shortly before its end would be
    # killed before it saved. A short training run (3 steps) and a long
    # validation (500 images per rank), signalled once training is over.
    name = "mila/checkpointing"
    launch = EXAMPLES[name]
    args = (
        "--synthetic-data", "--synthetic-size", "10000", "--batch-size", "16",
        "--epochs", "1", "--max-steps", "3",
    )  # fmt: skip
    plain = run_example(
        name, launch, args, env={"CHECKPOINT_DIR": str(tmp_path / "plain")}
    )
    assert plain.ok, plain.output

    def stop_in_validation(procs, logs: list[Path]):
        # Rank 0 logs this after the last training step's check for a stop, which rank 1
        # has joined: a signal from now on can only be noticed during validation.
        deadline = time.monotonic() + 120
        while (
            "Epoch 0: validation" not in logs[0].read_text()
            and time.monotonic() < deadline
        ):
            time.sleep(0.02)
        for pid in [procs[1].pid, *descendants(procs[1].pid)]:
            signal_if_alive(pid, signal.SIGTERM)

    env = {"CHECKPOINT_DIR": str(tmp_path / "stopped")}
    first = run_example(name, launch, args, env=env, while_running=stop_in_validation)
    assert first.ok, first.output
    text = unwrapped(first.output)
    assert "Epoch 0: val loss" not in text and "summary:" not in text
    assert text.count("Stopped at step 3, checkpoint saved") == 2, first.output

    second = run_example(name, launch, args, env=env)
    assert second.ok, second.output
    assert re.search(r"Resumed from .+ at step 3\b", unwrapped(second.output), re.S)
    assert "Epoch 0: val loss" in unwrapped(second.output)
    assert numbers(second.summaries) == numbers(plain.summaries)
    assert_bitwise_equal(
        load_checkpoint(tmp_path / "stopped"), load_checkpoint(tmp_path / "plain")
    )


# Step 4's; the Mila step's Checkpoint and requeue() are the same, byte for byte
# (test_the_checkpointing_programs_stop_and_save_the_same_way, in test_layout.py).
@pytest.mark.parametrize("name", ["generic/checkpointing"])
def test_a_job_that_restarted_too_often_is_not_requeued(tmp_path, name):
    # The warning before the time limit makes rank 0 requeue the job.
    # A job that loops, say because its data makes every run fail the
    # same way, must end for good at some point: --max-restarts.
    launch = EXAMPLES[name]
    env = {"CHECKPOINT_DIR": str(tmp_path), "SLURM_RESTART_COUNT": "3"}

    def warn_one_rank(procs, logs: list[Path]):
        wait_for_training(name, logs)
        os.kill(procs[1].pid, signal.SIGUSR1)

    args = (*ARGS[name], "--max-restarts", "3")
    run = run_example(name, launch, args, env=env, while_running=warn_one_rank)
    assert run.returncodes[0] != 0 and run.returncodes[1] == 0, run.output
    text = unwrapped(run.output)
    assert re.search(
        r"is not requeued: it has started 4 times, and\s+--max-restarts is 3", text
    )
    assert "Resubmit job.sh with the same job name" in text
    assert "Requeueing job" not in text
    assert (tmp_path / "stopped-on-error").exists()  # for job.sh: no requeue either
    # It stopped as any warned job does, with the checkpoint saved.
    assert text.count("checkpoint saved") == launch.world_size, run.output
    assert newest_checkpoint(tmp_path).exists()


# Step 4's; the Mila step's Checkpoint and requeue() are the same, byte for byte
# (test_the_checkpointing_programs_stop_and_save_the_same_way, in test_layout.py).
@pytest.mark.parametrize("name", ["generic/checkpointing"])
def test_a_run_with_other_settings_does_not_resume_from_the_checkpoint(tmp_path, name):
    # A trial run, or a run with another batch size, leaves a checkpoint in the run's
    # folder. A job with other settings must not carry on from it as if it were its own.
    launch = EXAMPLES[name]
    env = {"CHECKPOINT_DIR": str(tmp_path)}
    first = run_example(name, launch, env=env)
    assert first.ok, first.output
    other = run_example(name, launch, (*launch.args, "--batch-size", "12"), env=env)
    assert not other.ok and not other.summaries, other.output
    text = unwrapped(other.output)
    assert re.search(
        r"belongs to a run with other settings \(--batch-size \d+ -> 12\)", text
    )
    assert "another --job-name, or delete" in text


# Counts each process's calls of torch.distributed's collectives, by group
# (tests/helpers/collectives/sitecustomize.py).
COUNTING = {"PYTHONPATH": str(Path(__file__).parent / "helpers" / "collectives")}


def collectives(output: str) -> list[dict]:
    # Processes that share a stdout may print on one line.
    return decode_records(unwrapped(output), "collectives: ")


# Step 4 and FSDP2; the Mila step and the template agree the same way, byte for byte
# (test_the_checkpointing_programs_stop_and_save_the_same_way, in test_layout.py).
@pytest.mark.parametrize("name", ["generic/checkpointing", "generic/fsdp"])
def test_the_stop_agreement_adds_no_collective_to_the_default_group(tmp_path, name):
    # On GPUs the default group is NCCL's, and its collectives on GPU tensors: one per
    # step, read back on the CPU, would make the CPU wait for the GPU at every step.
    # Twice the steps, stopped by --max-steps part-way through one epoch, with no log
    # line: the same count of collectives on the default group, and one more of the
    # agreement's own, CPU-only group per step.
    launch, counted = EXAMPLES[name], {}
    for steps in (3, 6):  # both part-way through the epoch
        args = (*ARGS[name], "--epochs", "1", "--max-steps", str(steps),
                "--log-every", "100")  # fmt: skip
        env = {**COUNTING, "CHECKPOINT_DIR": str(tmp_path / str(steps))}
        run = run_example(name, launch, args, env=env)
        assert run.ok, run.output
        counted[steps] = sorted(collectives(run.output), key=lambda r: r["rank"])
        assert [r["rank"] for r in counted[steps]] == list(range(launch.world_size))
    for fewer, more in zip(counted[3], counted[6], strict=True):
        default = {k: v for k, v in fewer.items() if k.startswith("default:")}
        assert default == {k: v for k, v in more.items() if k.startswith("default:")}
        assert more["own:all_reduce"] - fewer["own:all_reduce"] == 6 - 3
        assert fewer["own_devices"] == more["own_devices"] == ["cpu"]


def test_a_save_that_the_clock_asks_for_is_made_once(tmp_path):
    # --checkpoint-every so short that a save is due after every step. The ranks read
    # their flags one step late, so the flags sent just before a save still ask for one:
    # they must not make a second save at the next step. Saves come every other step.
    name = "generic/checkpointing"
    args = (*ARGS[name], "--epochs", "1", "--max-steps", "12",
            "--checkpoint-every", "1e-9")  # fmt: skip
    run = run_example(name, EXAMPLES[name], args, env={"CHECKPOINT_DIR": str(tmp_path)})
    assert run.ok, run.output
    saved = re.findall(r"Saved \S+/step-(\d+)\.pt", unwrapped(run.output))
    # The last save is --max-steps's, after the periodic one of step 12.
    assert [int(step) for step in saved] == [2, 4, 6, 8, 10, 12, 12], run.output


# Makes the sync of a checkpoint file fail with ENOSPC, as a full disk or quota does
# (tests/helpers/faults/sitecustomize.py): FAIL_SAVE names the files, FAIL_SAVE_TIMES
# how often.
FAULTS = {"PYTHONPATH": str(Path(__file__).parent / "helpers" / "faults")}
# Step 4, 2 processes, saving every 4 steps and at the end of 2 epochs of 12 steps.
SAVING = (
    "--synthetic-data", "--synthetic-size", "200", "--synthetic-classes", "4",
    "--model", "resnet18", "--image-size", "16", "--batch-size", "8", "--epochs", "2",
    "--warmup-steps", "4", "--log-every", "4", "--checkpoint-every-steps", "4",
)  # fmt: skip


def test_a_save_that_fails_is_logged_and_the_next_one_saves(tmp_path):
    # Step 4's saves, which rank 0 makes while the others wait (the Mila step's and
    # the template's are the same, byte for byte): the save of step 8 fails once. The
    # failure is logged with its cause, training goes on, the save of step 12 is made,
    # and the run ends as one whose saves all worked.
    name = "generic/checkpointing"
    plain = run_example(
        name, EXAMPLES[name], SAVING, env={"CHECKPOINT_DIR": str(tmp_path / "plain")}
    )
    assert plain.ok, plain.output
    env = {**FAULTS, "FAIL_SAVE": "step-00000008", "CHECKPOINT_DIR": str(tmp_path)}
    run = run_example(name, EXAMPLES[name], SAVING, env=env)
    assert run.ok, run.output
    text = unwrapped(run.output)
    assert re.search(
        r"\[0/2\] Could not save \S+/step-00000008\.pt: \[Errno 28\] No space left",
        text,
    ), text
    saved = [int(step) for step in re.findall(r"Saved \S+/step-(\d+)\.pt", text)]
    assert 8 not in saved and 12 in saved, saved
    assert not list(tmp_path.glob("*.tmp")), "a failed save left a file behind"
    assert numbers(run.summaries) == numbers(plain.summaries)
    assert_bitwise_equal(load_checkpoint(tmp_path), load_checkpoint(tmp_path / "plain"))


def test_saves_that_keep_failing_stop_the_job_and_keep_the_checkpoints(tmp_path):
    # A disk that stays full from step 8 on: after --max-failed-saves failures in a
    # row (steps 8 and 12), every rank stops with the folder and the cause. The
    # checkpoint saved before is still there and loads.
    name = "generic/checkpointing"
    env = {**FAULTS, "FAIL_SAVE": r"step-0000000[89]|step-000000[1-9]",
           "FAIL_SAVE_TIMES": "all", "CHECKPOINT_DIR": str(tmp_path)}  # fmt: skip
    args = (*SAVING, "--max-failed-saves", "2")
    run = run_example(name, EXAMPLES[name], args, env=env)
    assert run.returncodes == [1, 1], run.output
    assert not run.summaries
    text = unwrapped(run.output)
    assert text.count(
        f"error: 2 checkpoints in a row could not be saved, the last one to "
        f"{tmp_path}/step-00000012.pt: [Errno 28] No space left on device. Free space "
        f"in {tmp_path}"
    ) == 2, text  # fmt: skip
    assert newest_checkpoint(tmp_path).name == "step-00000004.pt"
    assert load_checkpoint(tmp_path)["progress"]["steps"] == 4
    # The mark by which job.sh knows not to requeue the job.
    assert (tmp_path / "stopped-on-error").exists()


# Where each example's save blocks, what it logs when the save is done, and the steps
# of the whole run. FSDP2: rank 1's shard of step 4, which every rank waits for
# before the next save.
STALLS = {
    "generic/checkpointing": (
        SAVING,
        "step-00000008",
        r"Saved \S+/step-00000008\.pt in 1[2-9]\.\d s",
        24,
    ),
    "generic/fsdp": (
        (*EXAMPLES["generic/fsdp"].args, "--checkpoint-every-steps", "4"),
        r"step-00000004\.tmp/__1_",
        r"Saved \S+/epoch-0000-step-00000004 in 1[2-9]\.\d s",
        16,
    ),
}


@pytest.mark.parametrize("name", STALLS)
def test_a_save_that_blocks_longer_than_the_collective_timeout_is_waited_for(
    tmp_path, name
):
    # The ranks wait for a save to be complete. Storage that blocks instead of failing
    # (a Lustre or hard-mounted NFS server away) may outlast the default group's
    # timeout: 10 minutes with NCCL, 5 s here (COLLECTIVE_TIMEOUT). A write blocks for
    # 12 s: the others must wait for it, not fail, and the run goes on to its end.
    args, stalled, saved, steps = STALLS[name]
    env = {**FAULTS, "STALL_SAVE": stalled, "STALL_SECONDS": "12",
           "COLLECTIVE_TIMEOUT": "5", "CHECKPOINT_DIR": str(tmp_path)}  # fmt: skip
    run = run_example(name, EXAMPLES[name], args, env=env)
    assert run.ok, run.output
    assert re.search(saved, unwrapped(run.output)), run.output
    assert [s["steps"] for s in run.summaries] == [steps, steps], run.output


# Every process of a job holds sockets to its peers (gloo's, under
# TORCH_GLOO_LAZY_INIT=1, only to those it exchanges data with) and to the rendezvous.
SIXTEEN = dataclasses.replace(
    EXAMPLES["generic/checkpointing"], launcher="torchrun", nodes=1, procs_per_task=16,
    dataset=None,
)  # fmt: skip
TINY = (
    "--synthetic-data", "--synthetic-size", "64", "--synthetic-classes", "4",
    "--model", "resnet18", "--image-size", "8", "--batch-size", "2", "--epochs", "1",
    "--max-steps", "1", "--warmup-steps", "1", "--log-every", "1", "--num-workers", "0",
)  # fmt: skip
# An open-file limit that 16 processes, each connected to every other by their gloo
# groups (the main one on CPUs, the stop agreement's, the saves'), run out of.
LOW_LIMIT = 40


@pytest.mark.timeout(600)
def test_sixteen_processes_run_within_a_low_open_file_limit(tmp_path):
    name = "generic/checkpointing"
    env = {**COUNTING, "CHECKPOINT_DIR": str(tmp_path)}
    # torchrun and its 16 processes get the limit; the test's own process, which holds
    # the test cluster's files among others when it runs, does not.
    run = run_example(
        name, SIXTEEN, TINY, env=env, timeout=500, open_file_limit=LOW_LIMIT
    )
    assert run.ok, run.output
    assert len(run.summaries) == 16, run.output
    held = {record["rank"]: record["sockets"] for record in collectives(run.output)}
    assert sorted(held) == list(range(16)), held
    # Connected to all, a process would hold 15 sockets in each of its three gloo groups
    # (the main one, the stop agreement's, the saves'). Rank 0 gathers every rank's
    # random state at a save, so it may hold one per peer in the main group; the others
    # exchange data with a few peers only: fewer than the 15 of one group connected to
    # all and the stop agreement's two neighbours in its ring.
    assert held[0] < 2 * 15, held
    assert max(held[rank] for rank in range(1, 16)) < 15 + 2, held
    print(f"sockets per process at 16 processes, by rank: {held}")
