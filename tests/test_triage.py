"""The troubleshooting page's triage of a hung job, on the test cluster: its commands
are taken from the page and run against a job that hangs on purpose
(tests/helpers/hang/)."""

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from page_text import page_command
from slurm_lab import NODES, Lab, job_processes
from smoke import EXAMPLES_DIR

pytestmark = pytest.mark.slurm

HANG = Path(__file__).resolve().parent / "helpers" / "hang" / "job.sh"
JOB_ID = "12345"  # the job ID in the page's commands
STACK = re.compile(r"^=== (\S+) pid (\d+) \(parent \d+\) rank (\d+): (.*)$", re.M)


def user_env(lab: Lab, **extra: str) -> dict[str, str]:
    """A login shell's environment with the job's Python environment activated."""
    python_bin = Path(sys.executable).parent
    return lab.env(PATH=f"{python_bin}:{lab.env()['PATH']}", **extra)


def wait_for(lab: Lab, job_id: str, out: Path, text: str, count: int) -> str:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        output = out.read_text() if out.exists() else ""
        if output.count(text) >= count:
            return output
        state = lab.job_info(job_id).get("JobState")
        assert state in {"PENDING", "RUNNING", "CONFIGURING"}, f"{state}:\n{output}"
        time.sleep(0.5)
    raise AssertionError(f"{count} x {text!r} not seen in 90 s:\n{output}")


def test_stacks_of_every_rank_show_which_one_is_stuck(lab, tmp_path):
    heartbeat = tmp_path / "heartbeat"
    job_id = lab.sbatch(
        HANG, "--stuck", "--heartbeat", str(heartbeat), site="generic",
        workdir=tmp_path, OMP_NUM_THREADS="1",
    )  # fmt: skip
    try:
        output = wait_for(lab, job_id, tmp_path / f"slurm-{job_id}.out", "ready", 4)
        placed = dict(re.findall(r"^rank (\d+) on (\S+): ready", output, re.M))
        # As the page says: the script copied to the cluster, run with the job's ID.
        shutil.copy(EXAMPLES_DIR / "triage" / "stacks.sh", tmp_path)
        line = page_command("troubleshooting.md", "bash stacks.sh").replace(
            JOB_ID, job_id
        )
        result = subprocess.run(
            ["bash", "-c", line], cwd=tmp_path, env=user_env(lab),
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        report = (tmp_path / "stacks.txt").read_text()
        assert result.returncode == 0, report + result.stderr
        stacks = {}
        for block in re.split(r"(?m)^(?====)", report):
            header = STACK.match(block)
            if header and "main.py" in header.group(4):
                host, pid, rank, _ = header.groups()
                # Each process's stack whole, under its own header.
                assert f"Process {pid}: " in block, report
                # Every process of every rank, on the node that Slurm placed it on.
                assert placed[rank] == host, (rank, host, placed)
                stacks.setdefault(int(rank), []).append(block)
        assert sorted(stacks) == [0, 1, 2, 3], report + result.stderr
        # The odd one out: rank 1 is stuck elsewhere; the others wait in the collective.
        assert all("load_batch" in b for b in stacks[1]), stacks[1]
        for rank in (0, 2, 3):
            assert any("all_reduce" in b for b in stacks[rank]), stacks[rank]
            assert not any("load_batch" in b for b in stacks[rank])
        # Reading the stacks stopped nothing: the stuck rank still counts, and no
        # process of the job is left stopped (state T).
        beats = int(heartbeat.read_text())
        time.sleep(1)
        assert int(heartbeat.read_text()) > beats
        for pid, cmdline, _ in job_processes(job_id):
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            assert state != "T", (pid, cmdline)
        assert lab.job_info(job_id)["JobState"] == "RUNNING"
    finally:
        lab.cancel(job_id)


def test_stacks_of_a_job_that_is_not_running_say_so(lab, tmp_path):
    shutil.copy(EXAMPLES_DIR / "triage" / "stacks.sh", tmp_path)
    line = page_command("troubleshooting.md", "bash stacks.sh").replace(
        JOB_ID, "999999"
    )
    result = subprocess.run(
        ["bash", "-c", line], cwd=tmp_path, env=user_env(lab),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1
    assert "999999 is not one running job" in result.stderr


def test_detail_debug_names_ranks_that_call_different_collectives(lab, tmp_path):
    # The page's line, as job.sh would run it before srun.
    name, value = page_command("troubleshooting.md", "export TORCH_DISTRIBUTED_DEBUG=")[
        7:
    ].split("=")
    start = time.monotonic()
    job_id = lab.sbatch(
        HANG, "--mismatch", site="generic", workdir=tmp_path, OMP_NUM_THREADS="1",
        **{name: value},
    )  # fmt: skip
    job = lab.wait(job_id, tmp_path, timeout=120)
    assert job.state == "FAILED", job.output
    # Long before gloo's own timeout, 30 minutes.
    assert time.monotonic() - start < 90, job.output
    # Which rank ran which collective, both in the message.
    assert re.search(
        r"Detected mismatch between collectives on ranks\. Rank \d is running "
        r"collective: CollectiveFingerPrint\(SequenceNumber=1, OpType=(ALLREDUCE|"
        r"BROADCAST).*but Rank \d is running collective: CollectiveFingerPrint\("
        r"SequenceNumber=1, OpType=(?!\1)(ALLREDUCE|BROADCAST)",
        job.output,
    ), job.output
    assert set(NODES) >= set(re.findall(r"on (cn\d): ready", job.output))


def sbatch(lab: Lab, tmp_path: Path, *options: str) -> str:
    result = subprocess.run(
        ["sbatch", "--parsable", f"--output={tmp_path}/slurm-%j.out", *options],
        env=lab.env(), capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_squeue_says_why_each_job_is_pending(lab, tmp_path):
    failed = sbatch(lab, tmp_path, "--wrap=exit 1")
    assert lab.wait(failed, tmp_path, timeout=30).state == "FAILED"
    # Both nodes, whole, until the test cancels it; then a job for each reason.
    busy = sbatch(lab, tmp_path, "--nodes=2", "--exclusive", "--wrap=sleep 600")
    pending = {
        sbatch(lab, tmp_path, "--nodes=1", "--wrap=true"): "Resources",
        sbatch(lab, tmp_path, f"--dependency=afterok:{busy}", "--wrap=true"): (
            "Dependency"
        ),
        sbatch(lab, tmp_path, f"--dependency=afterok:{failed}", "--wrap=true"): (
            "DependencyNeverSatisfied"
        ),
        sbatch(lab, tmp_path, "--begin=now+1hour", "--wrap=true"): "BeginTime",
        sbatch(lab, tmp_path, "--hold", "--wrap=true"): "JobHeldUser",
    }
    try:
        squeue = page_command("troubleshooting.md", "squeue --me")
        deadline = time.monotonic() + 90
        while True:
            result = subprocess.run(
                ["bash", "-c", squeue], env=lab.env(), capture_output=True, text=True
            )
            assert result.returncode == 0, result.stderr
            # JOBID PARTITION NAME USER ST TIME NODES NODELIST(REASON)
            rows = {r.split()[0]: r.split() for r in result.stdout.splitlines()[1:]}
            reasons = {job: rows[job][-1].strip("()") for job in pending}
            if reasons == pending or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert reasons == pending, result.stdout
        assert all(rows[job][4] == "PD" for job in pending), result.stdout
        assert rows[busy][4] == "R", result.stdout
        # The page's way to see one job's reason, and what it waits for.
        job = next(j for j, r in pending.items() if r == "DependencyNeverSatisfied")
        show = page_command("troubleshooting.md", "scontrol show job 12345").replace(
            JOB_ID, job
        )
        result = subprocess.run(
            ["bash", "-c", show], env=lab.env(), capture_output=True, text=True
        )
        assert "Reason=DependencyNeverSatisfied" in result.stdout, result.stdout
        assert f"Dependency=afterok:{failed}(failed)" in result.stdout, result.stdout
    finally:
        lab.cancel(busy, *pending)
