"""The commands of the pages "Working with a job" and "Adapt it
to your cluster", on the test cluster: each command is taken
from its page, so that page and test cannot drift apart."""

import contextlib
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from page_text import DOCS, page_command
from slurm_lab import NODES
from smoke import EXAMPLES, EXAMPLES_DIR, parse_summaries

pytestmark = pytest.mark.slurm

NAME = "generic/template"
JOB_ID = "12345"  # the job ID that the pages' commands use


def run(lab, line: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", line],
        env=lab.env(),
        capture_output=True,
        text=True,
        timeout=60,
        **kwargs,
    )


@pytest.mark.every_version
def test_sinfo_and_scontrol_show_what_a_job_script_needs(lab):
    result = run(lab, page_command("adapt.md", "sinfo "))
    assert result.returncode == 0, result.stderr
    header, *rows = result.stdout.splitlines()
    assert header.split() == [
        "PARTITION",
        "TIMELIMIT",
        "NODES",
        "GRES",
        "CPUS",
        "MEMORY",
    ]
    # The test cluster's one partition: 2 nodes of 8 GPUs
    # of two types, 32 CPUs, 256000 MB.
    assert rows[0].split() == [
        "main*", "infinite", "2", "gpu:rtx8000:4,gpu:a100:4", "32", "256000"
    ]  # fmt: skip
    result = run(lab, page_command("adapt.md", "scontrol show partition"))
    assert result.returncode == 0, result.stderr
    for field in (
        "PartitionName=main",
        "AllowAccounts=ALL",
        "MaxTime=UNLIMITED",
        "GraceTime=0",
    ):
        assert field in result.stdout


@pytest.mark.every_version
def test_salloc_session_trains_on_every_node_with_labels_and_a_log_per_rank(
    lab, tmp_path
):
    salloc, export, label, per_rank = (
        page_command("jobs.md", "salloc "),
        page_command("jobs.md", "export MASTER_ADDR"),
        page_command("jobs.md", "srun --label "),
        page_command("jobs.md", "srun --output="),
    )
    # The smoke run's arguments follow the page's, and win where both give one.
    smoke = (
        " ".join(EXAMPLES[NAME].args) + " --synthetic-size 160 --synthetic-classes 5"
    )
    # The step's files, main.py and the modules it imports, as a reader copies them.
    for path in (EXAMPLES_DIR / NAME).glob("*.py"):
        (tmp_path / path.name).symlink_to(path)
    python_bin = Path(sys.executable).parent
    # What one types into salloc's shell. `bash -c` rather than
    # salloc's stdin: srun would read the lines that follow it from
    # there, as it reads the terminal's input in a real session.
    typed = "\n".join(["hostname", export, f"{label} {smoke}", f"{per_rank} {smoke}"])
    result = subprocess.run(
        [*salloc.split(), "bash", "-c", typed],
        cwd=tmp_path,
        # The Python with the examples' dependencies first
        # on PATH: "activate your environment".
        env=lab.env(
            "generic", OMP_NUM_THREADS="1", PATH=f"{python_bin}:{lab.env()['PATH']}"
        ),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    # Without LaunchParameters=use_interactive_step, the
    # shell runs where salloc was typed.
    assert lines[0] not in NODES
    # --label: each line of the first run, on stdout (the summaries)
    # and on stderr (the log), starts with the number of the task
    # that printed it. The second run writes to files only.
    summaries = parse_summaries("\n".join(ln[3:] for ln in lines if "summary:" in ln))
    # Ranks 0 and 1, one on each node (which node is first is Slurm's choice).
    nodes = [s["host"] for s in summaries]
    assert [s["rank"] for s in summaries] == [0, 1] and sorted(nodes) == ["cn1", "cn2"]
    for line in lines:
        if "summary:" in line:
            [summary] = parse_summaries(line[3:])
            assert line.startswith(f"{summary['rank']}: summary:"), line
    logged = [ln for ln in result.stderr.splitlines() if re.search(r"\[\d/2\]", ln)]
    assert {ln[:3] for ln in logged} == {"0: ", "1: "}, result.stderr
    for line in logged:
        assert f"[{line[0]}/2]" in line, line
    # --output=rank-%t.log: one file per rank, each with that rank's lines only.
    for rank, node in enumerate(nodes):
        log = (tmp_path / f"rank-{rank}.log").read_text()
        [summary] = parse_summaries(log)
        assert (summary["rank"], summary["host"]) == (rank, node)
        assert f"[{1 - rank}/2]" not in log
    # The trial run's synthetic data, which makes 160 // 50
    # validation images, trains too.
    assert [s["val_samples"] for s in summaries] == [160 // 50] * 2
    assert summaries[0]["last_loss"] < summaries[0]["first_loss"]


@pytest.mark.every_version
def test_squeue_and_scontrol_show_a_running_job(lab, tmp_path):
    job_id = hold_all_cpus(lab, tmp_path)
    try:
        result = run(lab, page_command("jobs.md", "squeue "))
        assert result.returncode == 0, result.stderr
        assert re.search(
            rf"^\s*{job_id}\s+main\s+hold\s+\S+\s+R\s", result.stdout, re.M
        )
        result = run(
            lab, page_command("jobs.md", "scontrol show job").replace(JOB_ID, job_id)
        )
        assert f"JobId={job_id} JobName=hold" in result.stdout
        assert "NodeList=cn[1-2]" in result.stdout
    finally:
        lab.cancel(job_id)


def test_srun_overlap_reaches_every_node_of_a_busy_job_and_its_gpus(lab, tmp_path):
    job_id = hold_all_cpus(lab, tmp_path)
    try:
        line = page_command("jobs.md", "srun --jobid=").replace(JOB_ID, job_id)
        assert line.endswith(" nvidia-smi")
        start = time.monotonic()
        # The test nodes' GPUs are stand-ins that nvidia-smi cannot read: this shows
        # which GPUs the step was given, those of the job on its node.
        shows = """bash -c 'echo "$(hostname) $CUDA_VISIBLE_DEVICES"'"""
        result = run(lab, line.replace("nvidia-smi", shows))
        assert result.returncode == 0, result.stderr
        assert sorted(result.stdout.splitlines()) == ["cn1 0,1", "cn2 0,1"]
        assert time.monotonic() - start < 10
        # Without --overlap, the same step waits for the CPUs that the job's step holds.
        waiting = run(
            lab,
            "timeout 5 "
            + line.replace(" --overlap", "").replace("nvidia-smi", "hostname"),
        )
        assert waiting.returncode == 124, waiting.stdout + waiting.stderr
        assert waiting.stdout == ""
    finally:
        lab.cancel(job_id)


def hold_all_cpus(lab, tmp_path) -> str:
    """A running job whose step holds every CPU and two
    GPUs of each of its two nodes."""
    script = tmp_path / "hold.sh"
    script.write_text(
        "#!/bin/bash\n#SBATCH --job-name=hold --nodes=2 --ntasks-per-node=2 "
        "--cpus-per-task=16\n#SBATCH --gpus-per-node=2\nsrun sleep 120\n"
    )
    job_id = lab.sbatch(script, site="generic", workdir=tmp_path)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        info = lab.job_info(job_id)
        # The step exists once the batch script's srun has started it.
        steps = run(lab, f"squeue --steps --noheader --jobs={job_id}").stdout
        if info.get("JobState") == "RUNNING" and f"{job_id}.0" in steps:
            return job_id
        time.sleep(0.2)
    # Not left to hold the nodes for the tests that follow; the cause said either way.
    with contextlib.suppress(AssertionError):
        lab.cancel(job_id)
    raise AssertionError(f"job {job_id} did not start its step: {info}")


@pytest.mark.every_version
def test_gres_and_gpus_per_node_ask_for_the_same_gpus_and_mem_per_gpu_scales(
    lab, tmp_path
):
    # The adapt page's sizing advice: --gres=gpu:4 and --gpus-per-node=4
    # give a job the same GPUs; --mem-per-gpu gives memory in proportion to them.
    asks = {
        "gres": ["--gres=gpu:4"],
        "gpus-per-node": ["--gpus-per-node=4"],
        "mem-per-gpu": ["--gpus-per-node=4", "--mem-per-gpu=32G"],
    }
    jobs = {}
    for name, options in asks.items():
        jobs[name] = run(
            lab,
            f"sbatch --parsable --nodes=1 --output={tmp_path}/{name}.out "
            f"{' '.join(options)} --wrap='env | sort'",
        ).stdout.strip()
    for name, job_id in jobs.items():
        assert lab.wait(job_id, tmp_path, timeout=60).state == "COMPLETED", name
    info = {name: lab.job_info(job_id) for name, job_id in jobs.items()}
    env = {
        name: dict(
            line.split("=", 1)
            for line in (tmp_path / f"{name}.out").read_text().splitlines()
            if "=" in line
        )
        for name in jobs
    }
    for name in jobs:
        # gres:gpu:4 up to 22.05; gres/gpu:4 in 24.11 and 26.05.
        assert info[name]["TresPerNode"] in {"gres/gpu:4", "gres:gpu:4"}, info[name]
        assert info[name]["TresPerNode"] == info["gres"]["TresPerNode"]
        assert env[name]["SLURM_GPUS_ON_NODE"] == "4"
        assert len(env[name]["CUDA_VISIBLE_DEVICES"].split(",")) == 4
    # Only --gpus-per-node sets SLURM_GPUS_PER_NODE.
    assert "SLURM_GPUS_PER_NODE" not in env["gres"]
    assert env["gpus-per-node"]["SLURM_GPUS_PER_NODE"] == "4"
    # 32 GiB per GPU, so 4 GPUs x 32 GiB on the node. Slurm 22.05 shows no ReqTRES.
    per_gpu = info["mem-per-gpu"]
    assert per_gpu["MemPerTres"] in {"gres/gpu:32768", "gres:gpu:32768"}, per_gpu
    if lab.at_least("24.11"):
        assert "mem=128G" in per_gpu["ReqTRES"], per_gpu


@pytest.mark.every_version
def test_a_waiting_job_can_be_kept_off_a_node(lab, tmp_path):
    # The generic page's command to keep a requeued job, waiting in the queue, off the
    # node that failed it: here, a job held in the queue.
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\nhostname\n")
    job_id = lab.sbatch(script, site="generic", workdir=tmp_path, options=["--hold"])
    command = page_command("clusters/generic.md", "scontrol update JobId=")
    command = command.replace("<job ID>", job_id).replace("<node>", "cn2")
    try:
        result = run(lab, command)
        assert result.returncode == 0, result.stderr
        assert lab.job_info(job_id)["ExcNodeList"] == "cn2"
    finally:
        lab.cancel(job_id)


@pytest.mark.every_version
def test_without_accounting_sacct_says_so_and_debian_ships_no_seff(lab):
    # The test cluster keeps no accounting (AccountingStorageType=accounting_storage/
    # none), as some clusters do not: the page's sacct line, on a job that ran, prints
    # the message that jobs.md quotes.
    page = " ".join((DOCS / "jobs.md").read_text().split())
    [message] = re.findall(r'without accounting, `sacct` says "([^"]+)"', page)
    job = run(lab, "sbatch --parsable --wrap=true")
    assert job.returncode == 0, job.stderr
    line = page_command("jobs.md", "sacct -j").replace(JOB_ID, job.stdout.strip())
    result = run(lab, line)
    assert message in result.stdout + result.stderr, result
    # seff is not among the files of Debian's Slurm packages in the cluster's root
    # (Debian 12, 13 or forky: Slurm 22.05, 24.11 or 26.05), and not on its PATH.
    lists = [
        p
        for p in ((lab.root or Path("/")) / "var/lib/dpkg/info").glob("*.list")
        if p.name.startswith(("slurm", "libslurm"))
    ]
    assert {p.name.split(":")[0].removesuffix(".list") for p in lists} >= {
        "slurm-client",
        "slurmctld",
        "slurmd",
    }
    files = [f for p in lists for f in p.read_text().splitlines()]
    assert "/usr/bin/sacct" in files
    assert not [f for f in files if Path(f).name == "seff"]
    assert run(lab, "command -v seff").returncode != 0
