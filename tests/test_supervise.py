"""supervise.py, the one place that decides what comes after srun: each decision, its
budget, its file protocol with main.py, and its calls to scontrol, without Slurm (a
script stands in for scontrol). The Slurm tests (test_slurm_events.py,
test_failures.py) show the same decisions under real events.
"""

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from smoke import EXAMPLES_DIR, load_main

supervise = load_main("generic/checkpointing", "supervise.py")

RUNNING = {"JobState": "RUNNING", "StartTime": "2026-12-07T10:00:00"}
PREEMPTED = {**RUNNING, "PreemptTime": "2026-12-07T10:05:00"}


def decide(status=1, stop=None, error=None, before=10, after=10, slurm=RUNNING,
           history=(), retries=3, done=False):  # fmt: skip
    return supervise.decide(status, stop, error, before, after, slurm, list(history),
                            retries, done)  # fmt: skip


def counted(after: int) -> dict:
    """A ledger line of a start that saved nothing new, requeued within the budget."""
    return {"after": after, "action": "requeue", "counted": True}


def test_a_run_that_ends_well_is_done():
    assert decide(status=0, slurm=None).action == "done"


def test_a_run_whose_training_ended_is_done_whatever_ended_its_processes():
    # A SIGTERM as the processes exit after training (a kill that Slurm kept for a lost
    # node, delivered late: seen in CI) ends srun with 143; the run is still done.
    decision = decide(status=143, before=10, after=32, done=True)
    assert decision.action == "done" and "srun's status: 143" in decision.reason


def test_an_error_for_a_person_stops_whatever_else_is_true():
    # Even in a start that advanced, or one that Slurm preempted.
    for slurm in (RUNNING, PREEMPTED):
        decision = decide(
            status=1, error="error: the disk is full", after=20, slurm=slurm
        )
        assert decision.action == "stop"
        assert "main.py stopped on an error of its own: error: the disk is full" in (
            decision.reason
        )


@pytest.mark.parametrize(
    "status, stop", [(0, "SIGTERM"), (143, None), (143, "SIGTERM")]
)
def test_a_preempted_job_is_left_to_slurm_whatever_state_main_py_ended_in(status, stop):
    # Saved and stopped (0), or killed before it could mark anything (143, during its
    # imports): Slurm ends the job at the end of its grace time and requeues it.
    decision = decide(status=status, stop=stop, slurm=PREEMPTED, after=10, before=10)
    assert decision.action == "wait"
    assert not decision.counted


def test_a_preemption_of_an_earlier_start_does_not_count_for_this_one():
    # A PreemptTime older than this start's StartTime: this start's crash is a crash.
    slurm = {**RUNNING, "PreemptTime": "2026-12-07T09:00:00"}
    assert decide(status=1, slurm=slurm).action == "requeue"


@pytest.mark.parametrize("state", ["CANCELLED", "TIMEOUT", "COMPLETING", "PENDING"])
def test_a_job_that_slurm_is_ending_is_left_to_slurm(state):
    decision = decide(status=0, stop="SIGTERM", slurm={**RUNNING, "JobState": state})
    assert decision.action == "end"
    assert state in decision.reason


@pytest.mark.parametrize("status, stop, said", [
    (1, None, "srun exited with status 1"),
    (0, "SIGUSR1", "time limit's warning (SIGUSR1)"),
    (0, "SIGTERM", "a SIGTERM that was not Slurm ending the job"),
])  # fmt: skip
def test_a_start_that_advanced_the_run_is_requeued_outside_the_budget(
    status, stop, said
):
    # Even after as many fruitless starts as the budget allows, at another step.
    history = [counted(4)] * 3
    decision = decide(status=status, stop=stop, before=4, after=8, history=history)
    assert decision.action == "requeue" and not decision.counted
    assert said in decision.reason and "this start saved step 8" in decision.reason


def test_starts_that_save_nothing_new_are_retried_within_the_budget_then_stop():
    # A setting that fails at every start: tries 1, 2 and 3 requeue; the 4th stops.
    history = []
    for tries in (1, 2, 3):
        decision = decide(status=1, before=12, after=12, history=history)
        assert decision.action == "requeue" and decision.counted
        assert f"try {tries} of 3" in decision.reason
        history.append(counted(12))
    decision = decide(status=1, before=12, after=12, history=history)
    assert decision.action == "stop"
    assert "4 starts in a row saved no new checkpoint (RETRIES=3)" in decision.reason


def test_a_stop_during_start_up_on_the_time_limits_warning_is_requeued_and_counted():
    decision = decide(status=138, stop="SIGUSR1", before=12, after=12)
    assert decision.action == "requeue" and decision.counted
    assert "SIGUSR1" in decision.reason


def test_the_budget_starts_again_once_the_run_advances():
    # Two fruitless starts at step 12, one that saved step 16, then a fruitless one.
    history = [counted(12), counted(12), {"after": 16, "counted": False}]
    decision = decide(status=1, before=16, after=16, history=history)
    assert decision.counted and "try 1 of 3" in decision.reason


def test_a_preemption_between_fruitless_starts_neither_counts_nor_resets_the_budget():
    history = [counted(12), {"after": 12, "action": "wait", "counted": False}]
    assert "try 2 of 3" in decide(before=12, after=12, history=history).reason


def test_retries_0_stops_at_the_first_fruitless_start():
    assert decide(before=3, after=3, retries=0).action == "stop"


def test_no_answer_from_slurm_still_requeues():
    # The requeue then tries scontrol again, and says if it fails.
    assert decide(status=1, slurm=None, before=1, after=2).action == "requeue"


# ---- The file protocol: main.py's checkpoints and marks, as supervise.py reads them --


def test_supervise_reads_the_checkpoint_names_that_the_examples_write(tmp_path):
    checkpoints = load_main("generic/checkpointing", "checkpoints.py")
    fsdp = load_main("generic/fsdp")
    names = [checkpoints.CHECKPOINT_FILE.format(steps=s) for s in (9, 10, 1200)]
    folders = [f"epoch-{e:04d}-step-{s:08d}" for e, s in ((0, 9), (0, 10), (1, 1200))]
    assert all(checkpoints.CHECKPOINT_NAME.fullmatch(n) for n in names)
    assert all(fsdp.CHECKPOINT_NAME.fullmatch(n) for n in folders)
    for written in (names, folders):
        folder = tmp_path / written[0]
        folder.mkdir()
        assert supervise.newest_step(folder) == -1
        for name in written:
            (folder / name).touch()
        # A save under way (.tmp) and other files are not checkpoints.
        (folder / (written[-1].replace("1200", "1300") + ".tmp")).touch()
        for other in ("starts.jsonl", "stopped-by-signal", "unreadable"):
            (folder / other).touch()
        assert supervise.newest_step(folder) == 1200
    assert supervise.newest_step(tmp_path / "missing") == -1


def test_each_copy_of_supervise_py_is_the_one_that_stopping_py_imports():
    # The marks that stopping.py writes are the names supervise.py reads: one module.
    for stopping in EXAMPLES_DIR.glob("*/*/stopping.py"):
        assert (stopping.parent / "supervise.py").exists(), stopping.parent
        assert "from supervise import DONE_MARK, ERROR_MARK, STOP_MARK" in (
            stopping.read_text()
        )


# ---- supervise.py run as job.sh runs it, with a stand-in for scontrol --------------


def fake_scontrol(tmp_path: Path, answers: list[str]) -> tuple[dict, Path]:
    """A scontrol that answers call N with line N of `answers` (a shell command); the
    calls it got are in the returned file. The environment to run supervise.py with."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    asked, lines = tmp_path / "asked", tmp_path / "answers"
    lines.write_text("".join(answer + "\n" for answer in answers))
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {shlex.quote(str(asked))}\n'
        f"n=$(wc -l < {shlex.quote(str(asked))})\n"
        f'eval "$(sed -n "${{n}}p" {shlex.quote(str(lines))})"\n'
        "exit 99\n"
    )
    scontrol.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env |= {"PATH": f"{bin_dir}:{env['PATH']}", "SLURM_JOB_ID": "96",
            "CHECKPOINT_DIR": str(tmp_path / "checkpoints")}  # fmt: skip
    (tmp_path / "checkpoints").mkdir(exist_ok=True)
    return env, asked


SHOW_RUNNING = "echo 'JobId=96 JobState=RUNNING StartTime=2026-12-07T10:00:00'"
# Slurm's requeue ends every process of the job: scontrol, and supervise.py above it.
REQUEUED = "kill -TERM $PPID $$"


def run_supervise(env: dict, step: str, timeout=60) -> subprocess.CompletedProcess:
    script = EXAMPLES_DIR / "generic/checkpointing/supervise.py"
    return subprocess.run([sys.executable, str(script), "sh", "-c", step], env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def test_a_crash_after_a_save_is_requeued_and_written_down(tmp_path):
    env, asked = fake_scontrol(tmp_path, [SHOW_RUNNING, REQUEUED])
    folder = Path(env["CHECKPOINT_DIR"])
    (folder / "step-00000004.pt").touch()
    # The step saves step 8, then a rank fails.
    result = run_supervise(env, f"touch {folder}/step-00000008.pt; exit 1")
    assert result.returncode == -signal.SIGTERM, result.stderr
    assert asked.read_text().splitlines() == ["show job --oneliner 96", "requeue 96"]
    assert "srun exited with status 1; this start saved step 8: requeueing job 96" in (
        result.stderr
    )
    [entry] = [json.loads(line) for line in (folder / "starts.jsonl").open()]
    assert entry["before"] == 4 and entry["after"] == 8 and entry["status"] == 1
    assert entry["action"] == "requeue" and not entry["counted"]


def test_a_step_killed_after_its_training_ended_is_not_requeued(tmp_path):
    env, asked = fake_scontrol(tmp_path, [SHOW_RUNNING, REQUEUED])
    folder = Path(env["CHECKPOINT_DIR"])
    result = run_supervise(env, f"echo done > {folder}/training-done; exit 143")
    assert result.returncode == 0, result.stderr
    assert "main.py ended its training (srun's status: 143): done." in result.stderr
    assert not asked.exists()


def test_marks_of_an_earlier_start_are_cleared_before_the_step(tmp_path):
    # A stop mark left by the start before must not make a finished step look stopped.
    env, asked = fake_scontrol(tmp_path, [])
    folder = Path(env["CHECKPOINT_DIR"])
    (folder / supervise.STOP_MARK).write_text("SIGTERM\n")
    (folder / supervise.ERROR_MARK).write_text("error: old\n")
    (folder / supervise.DONE_MARK).write_text("done\n")
    result = run_supervise(env, "exit 0")
    assert result.returncode == 0, result.stderr
    assert not asked.exists()  # a finished run asks Slurm nothing
    assert not (folder / "starts.jsonl").exists()
    # A crash of this start is not taken for the old start's end of training.
    env, asked = fake_scontrol(tmp_path, [SHOW_RUNNING, REQUEUED])
    (folder / supervise.DONE_MARK).write_text("done\n")
    result = run_supervise(env, "exit 1")
    assert "srun exited with status 1" in result.stderr, result.stderr


def test_a_mark_from_main_py_reaches_supervise_py(tmp_path):
    # The time limit's warning: stopping.py's mark, then the requeue.
    env, asked = fake_scontrol(tmp_path, [SHOW_RUNNING, REQUEUED])
    folder = env["CHECKPOINT_DIR"]
    stopping = EXAMPLES_DIR / "generic/checkpointing"
    mark = (
        f"cd {shlex.quote(str(stopping))} && {shlex.quote(sys.executable)} -c "
        f"'import signal, stopping; from pathlib import Path; "
        f'stopping.mark_stop(signal.SIGUSR1, Path("{folder}"))\''
    )
    result = run_supervise(env, mark)
    assert "main.py stopped on the time limit's warning (SIGUSR1)" in result.stderr
    assert asked.read_text().splitlines()[-1] == "requeue 96"


def test_a_refused_requeue_stops_with_the_way_on(tmp_path):
    refused = "echo 'Requested operation is presently disabled for job 96' >&2; exit 1"
    env, asked = fake_scontrol(tmp_path, [SHOW_RUNNING, refused, SHOW_RUNNING])
    result = run_supervise(env, "exit 1")
    assert result.returncode == 1, result.stderr
    assert "error: `scontrol requeue 96` failed, so the job will not start again" in (
        result.stderr
    )
    assert "resubmit job.sh with the same job name" in result.stderr


def test_a_job_array_task_requeues_itself_alone(tmp_path):
    env, asked = fake_scontrol(tmp_path, [SHOW_RUNNING, REQUEUED])
    env |= {
        "SLURM_JOB_ID": "97",
        "SLURM_ARRAY_JOB_ID": "90",
        "SLURM_ARRAY_TASK_ID": "7",
    }
    run_supervise(env, "exit 1")
    assert asked.read_text().splitlines() == [
        "show job --oneliner 90_7",
        "requeue 90_7",
    ]


def test_without_checkpoint_dir_it_says_what_job_sh_must_set(tmp_path):
    env, _ = fake_scontrol(tmp_path, [])
    del env["CHECKPOINT_DIR"]
    result = run_supervise(env, "exit 0")
    assert result.returncode == 1
    assert "error: CHECKPOINT_DIR is not set" in result.stderr


LOST_ANSWER = (
    "echo 'slurm_requeue error: Unexpected message received for job 96' >&2; exit 1"
)
ENDED_BY_THE_REQUEUE = "kill -TERM $$; exit 1"
ALREADY_ENDING = (
    "echo 'slurm_requeue error: Job/step already completing or completed' >&2; exit 1"
)
REFUSED = "echo 'Requested operation is presently disabled for job 96' >&2; exit 1"
RUNNING_NOW = "echo 'JobId=96 JobState=RUNNING Restarts=0 PreemptTime=None'"
REQUEUE, SHOW = "requeue 96", "show job --oneliner 96"


@pytest.mark.parametrize(
    "calls, seconds_left, requeued",
    [
        # Seen in CI (24.11, the controller stopped for 30 s): the requeue's answer is
        # lost after 10 s; once back, the controller requeues the job, and its SIGTERM
        # ends the call that asks again. The job starts again.
        ([(REQUEUE, LOST_ANSWER), (REQUEUE, ENDED_BY_THE_REQUEUE)], 3600, True),
        ([(REQUEUE, LOST_ANSWER), (REQUEUE, LOST_ANSWER), (REQUEUE, "exit 0")], 3600,
         True),
        # Too close to the time limit to ask again: the job's state is asked instead,
        # and the requeue's SIGTERM ends that call.
        ([(REQUEUE, LOST_ANSWER), (SHOW, ENDED_BY_THE_REQUEUE)], 19, True),
        # A preemption ends the job as it is requeued: ended, not refused.
        ([(REQUEUE, ALREADY_ENDING), (SHOW, ENDED_BY_THE_REQUEUE)], 3600, True),
        # A refusal of a job still running is for a person.
        ([(REQUEUE, REFUSED), (SHOW, RUNNING_NOW)], 3600, False),
    ],
)  # fmt: skip
def test_a_requeue_whose_answer_is_lost_or_late_is_not_taken_for_a_refusal(
    tmp_path, monkeypatch, calls, seconds_left, requeued
):
    env, asked = fake_scontrol(tmp_path, [answer for _, answer in calls])
    for name in ("PATH", "SLURM_JOB_ID"):
        monkeypatch.setenv(name, env[name])
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(int(time.time()) + seconds_left))
    # No waiting between tries.
    clock = types.SimpleNamespace(time=time.time, sleep=lambda seconds: None)
    monkeypatch.setattr(supervise, "time", clock)
    assert supervise.requeue("96") == requeued
    assert asked.read_text().splitlines() == [call for call, _ in calls]
