"""The test cluster's own waiting, without Slurm: what a Slurm test may take for a job's
state (tests/helpers/slurm_lab.py).

A job's state read once, right after another field changed, can be one that Slurm
passes through: a requeued job's Restarts rises while it is still COMPLETING, and a test
that then asserted PENDING failed in CI (Slurm 22.05). A Slurm test that waits for one
job's state waits through Lab.wait_for_state(), held here to a job's records as
`scontrol show job` prints them, one read at a time; the loops that watch a job through
several requeues act on one read each time.
"""

import ast
from pathlib import Path

import pytest
import slurm_lab
from slurm_lab import Lab, StillWaiting


def record(state: str, restarts: int = 0) -> dict[str, str]:
    return {"JobId": "96", "JobState": state, "Restarts": str(restarts)}


def reading(lab: Lab, monkeypatch, *records: dict[str, str] | str) -> list:
    """Makes `lab` read `records` in turn, then the last one again and again; returns
    the list of the reads made. A string is a read that failed: scontrol's stderr."""
    made = []

    def read_job(job_id: str) -> tuple[dict[str, str], str]:
        made.append(records[min(len(made), len(records) - 1)])
        return ({}, made[-1]) if isinstance(made[-1], str) else (dict(made[-1]), "")

    monkeypatch.setattr(lab, "_read_job", read_job)
    return made


def test_a_requeued_job_still_completing_is_waited_for(monkeypatch):
    lab = Lab()
    made = reading(
        lab, monkeypatch, record("RUNNING"), *[record("COMPLETING", 1)] * 3,
        record("PENDING", 1),
    )  # fmt: skip
    assert lab.wait_for_state("96", "PENDING", restarts=1, timeout=10) == record(
        "PENDING", 1
    )
    assert len(made) == 5


def test_the_helper_never_returns_on_completing(monkeypatch):
    lab = Lab()
    reading(lab, monkeypatch, record("COMPLETING", 1))
    told = "still COMPLETING, not PENDING with Restarts=1 after 1 s"
    with pytest.raises(StillWaiting, match=told) as waiting:
        lab.wait_for_state("96", "PENDING", restarts=1, timeout=1)
    assert waiting.value.info["JobState"] == "COMPLETING"


@pytest.mark.parametrize("end", ["COMPLETED", "FAILED", "REQUEUE_HOLD"])
def test_a_job_that_ends_or_is_held_instead_of_requeued_fails_at_once(
    monkeypatch, tmp_path, end
):
    # On 22.05, a job that ends inside its grace time is not requeued: it ends
    # COMPLETED, unfinished. That is the failure, said with the job's output.
    lab = Lab()
    log = tmp_path / "slurm-96.out"
    log.write_text("job.sh: the job is not requeued\n")
    made = reading(lab, monkeypatch, record("COMPLETING"), record(end))
    with pytest.raises(AssertionError, match=f"job 96 is {end}, not PENDING") as error:
        lab.wait_for_state("96", "PENDING", restarts=1, timeout=600, log=log)
    assert "the job is not requeued" in str(error.value)
    assert not isinstance(error.value, StillWaiting) and len(made) == 2


def test_a_requeue_counted_again_is_not_the_one_waited_for(monkeypatch):
    lab = Lab()
    reading(lab, monkeypatch, record("PENDING", 1), record("RUNNING", 1))
    with pytest.raises(StillWaiting, match="not PENDING with Restarts=2"):
        lab.wait_for_state("96", "PENDING", restarts=2, timeout=1)


def test_a_controller_too_busy_to_answer_is_asked_again(monkeypatch):
    lab = Lab()
    busy = "slurm_load_jobs error: Socket timed out on send/recv operation\n"
    made = reading(lab, monkeypatch, busy, busy, record("PENDING", 1))
    assert lab.wait_for_state("96", "PENDING", restarts=1, timeout=10)["JobId"] == "96"
    assert len(made) == 3


def test_a_job_that_slurmctld_no_longer_knows_fails_at_once(monkeypatch):
    lab = Lab()
    reading(lab, monkeypatch, "slurm_load_jobs error: Invalid job id specified\n")
    with pytest.raises(AssertionError, match="job 96 is unknown to slurmctld"):
        lab.wait_for_state("96", "PENDING", timeout=600)


def test_a_job_is_over_once_completing_has_ended(monkeypatch, tmp_path):
    lab = Lab()
    (tmp_path / "slurm-96.out").write_text("done\n")
    made = reading(
        lab, monkeypatch, record("RUNNING"), record("COMPLETING"),
        {**record("COMPLETED"), "ExitCode": "0:0", "NodeList": "cn[1-2]"},
    )  # fmt: skip
    job = lab.wait("96", tmp_path, timeout=10)
    assert (job.state, job.ok, job.output) == ("COMPLETED", True, "done\n")
    assert len(made) == 3


def test_no_test_waits_on_a_job_record_but_through_the_helper():
    # The race's shape: wait_until() on one field of `scontrol show job`, then the state
    # read once more and asserted. A wait on a job's record goes through
    # Lab.wait_for_state() (or Lab.wait, which uses it), whether wait_until is given a
    # lambda or a function of the file.
    found = []
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        functions = {
            node.name: ast.unparse(node)
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef)
        }
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or ast.unparse(node.func) != "wait_until":
                continue
            condition = ast.unparse(node.args[0])
            if "job_info" in functions.get(condition, condition):
                found.append(f"{path.name}:{node.lineno}")
    assert found == [], found


def test_a_cancelled_job_is_waited_for_until_its_cpus_are_free(monkeypatch):
    # scancel returns at once; the job stays COMPLETING, its CPUs taken, until its
    # processes end. A test that cancels a job holding every CPU, and the next test's
    # job then waits for them (CI: "did not start its step", Reason=Resources).
    lab = Lab()
    told = []
    monkeypatch.setattr(
        slurm_lab.subprocess, "run", lambda command, **_: told.append(command)
    )
    made = reading(
        lab, monkeypatch, record("RUNNING"), *[record("COMPLETING")] * 3,
        record("CANCELLED"),
    )  # fmt: skip
    lab.cancel("96")
    assert told == [["scancel", "96"]]
    assert [r["JobState"] for r in made] == [
        "RUNNING", "COMPLETING", "COMPLETING", "COMPLETING", "CANCELLED",
    ]  # fmt: skip
    # A job that slurmctld has forgotten is over: nothing to wait for.
    made = reading(lab, monkeypatch, "slurm_load_jobs error: Invalid job id specified")
    lab.cancel("97")
    assert len(made) == 1
