"""The test cluster's own waiting, without Slurm: what a Slurm test may take for a job's
state (tests/helpers/slurm_lab.py).

A job's state read once, right after another field changed, can be one that Slurm
passes through: on 22.05 a requeued job's Restarts rises while it is still COMPLETING,
and a test that asserted PENDING then failed in CI. Every Slurm test waits through
Lab.wait_for_state(), which is held here to a job's records as `scontrol show job`
prints them, one read at a time.
"""

import pytest
from slurm_lab import Lab, StillWaiting


def record(state: str, restarts: int = 0) -> dict[str, str]:
    return {"JobId": "96", "JobState": state, "Restarts": str(restarts)}


def reading(lab: Lab, monkeypatch, *records: dict[str, str]) -> list:
    """Makes `lab` read `records` in turn, then the last one again and again; returns
    the list of the reads made."""
    made = []

    def job_info(job_id: str) -> dict[str, str]:
        made.append(records[min(len(made), len(records) - 1)])
        return dict(made[-1])

    monkeypatch.setattr(lab, "job_info", job_info)
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
    with pytest.raises(StillWaiting, match="still COMPLETING after 1 s") as waiting:
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
