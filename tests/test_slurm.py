"""Every job.sh, submitted unchanged to a real Slurm
cluster, must run as on the real site.

The cluster (slurm_lab.py) has two nodes with their own hostnames and IPs; each example
is submitted with its site's profile (tests/sites/<cluster>/) and its smoke-run
arguments, by its ReFrame check (checks/examples.py, run by the `jobs` fixture). A new
job.sh under examples/ is picked up here with no edit.
"""

import ast
import csv
import dataclasses
import os
import re
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import slurm_lab
from slurm_lab import NODES, Lab, LabUnavailable, check_can_start, make_root
from smoke import (
    EXAMPLES,
    EXAMPLES_DIR,
    Launch,
    check_run,
    numbers,
    parse_summaries,
    site_of,
)

pytestmark = pytest.mark.slurm

DOCS = Path(__file__).resolve().parent.parent / "docs"
JOB_SCRIPTS = sorted(EXAMPLES_DIR.glob("**/job.sh"))
NAMES = [str(p.parent.relative_to(EXAMPLES_DIR)) for p in JOB_SCRIPTS]


def sbatch_options(script: Path) -> dict[str, str]:
    """The script's `#SBATCH --name=value` lines, as a dict."""
    options = {}
    for match in re.finditer(
        r"^#SBATCH\s+--([\w-]+)(?:[=\s]+(\S+))?", script.read_text(), re.M
    ):
        options[match[1]] = match[2] or ""
    return options


def job_layout(name: str) -> Launch:
    """The example's smoke launch, scaled to what its
    job.sh asks for: same nodes and ranks."""
    options = sbatch_options(EXAMPLES_DIR / name / "job.sh")
    launch = EXAMPLES[name]
    nodes = int(options.get("nodes", "1"))
    if launch.launcher == "python":
        return launch
    if launch.launcher == "srun":
        return dataclasses.replace(
            launch, nodes=nodes, tasks_per_node=int(options["ntasks-per-node"])
        )
    # torchrun and the old launcher start a process per GPU
    # in each (single) task of a node.
    gpus_per_node = int(options["gpus-per-node"].split(":")[-1])
    return dataclasses.replace(
        launch, nodes=nodes, tasks_per_node=1, procs_per_task=gpus_per_node
    )


@pytest.mark.every_version
@pytest.mark.parametrize("name", NAMES)
def test_sbatch_test_only_accepts_the_script(lab, name):
    script = EXAMPLES_DIR / name / "job.sh"
    result = subprocess.run(
        ["sbatch", "--test-only", str(script)],
        cwd=script.parent,
        env=lab.env(site_of(name)),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert "to start at" in result.stderr


# Each job.sh runs to completion on Slurm 24.11. On the other versions, a few do: one
# of each site, and one of each way of starting the processes (a test below says so).
# The versions differ in how Slurm starts and places the processes, which depends on the
# launcher, and the sites in what their job.sh files ask of Slurm, which
# sbatch --test-only checks for every job.sh on every version. (About 5 minutes of CI
# less than all.) The others that have a step's lines are held to them by a test
# below: step 4's and FSDP2's are the template's, less its copy of the dataset to each
# node; the fabric check's are step 3's.
EVERY_VERSION_RUNS = [
    "generic/template", "mila/checkpointing", "ibex/multi_node",
    "ibex/multi_node_legacy", "launchers/mp_spawn",
]  # fmt: skip
LIKE_A_STEP = {
    "generic/checkpointing": "generic/template",
    "generic/fsdp": "generic/template",
    "generic/fabric": "generic/multi_node",
}
every_version = pytest.mark.every_version
# Mila runs Slurm 23.11.4 or later: its scripts run to completion from 24.11 on, and go
# through sbatch --test-only on 22.05 too.
SINCE = {"mila": pytest.mark.since_slurm("23.11")}


def completion_marks(name: str) -> tuple:
    if name == "generic/container":  # needs Apptainer: 26.05 (tests/test_containers.py)
        return (pytest.mark.apptainer, every_version)
    if name not in EVERY_VERSION_RUNS:
        return ()
    site = name.split("/")[0]
    return (every_version, SINCE[site]) if site in SINCE else (every_version,)


def test_every_site_and_launcher_completes_on_every_version():
    assert {site_of(name) for name in EVERY_VERSION_RUNS} == set(map(site_of, NAMES))
    launchers = {EXAMPLES[name].launcher for name in NAMES}
    assert {EXAMPLES[name].launcher for name in EVERY_VERSION_RUNS} == launchers
    assert set(EVERY_VERSION_RUNS) <= set(NAMES)


# The first test to read a job waits for the one reframe run that submits them all.
JOBS_TIMEOUT = pytest.mark.timeout(1800)


# Step 4's and FSDP2's job.sh, which have the template's Slurm lines (the test below),
# run to completion in the tests of failures and of Slurm's events instead, at their
# own layouts (2 nodes x 2 or 1 tasks): each behaviour runs once.
COMPLETED_ELSEWHERE = ["generic/checkpointing", "generic/fsdp"]


@JOBS_TIMEOUT
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=completion_marks(name))
        for name in NAMES
        if name not in COMPLETED_ELSEWHERE
    ],
)
def test_job_completes_with_every_rank_on_its_node(lab, jobs, name):
    assert name in EXAMPLES, f"{name}: add it to EXAMPLES in tests/helpers/smoke.py"
    job = jobs(name)
    report = (
        f"job {job.job_id}: {job.state} {job.exit_code} in {job.elapsed:.0f} s\n"
        f"{job.output}"
    )
    assert job.ok, report
    # Its ReFrame check (checks/examples.py) passed too: sanity and speed.
    assert job.check == "pass", report + job.check

    layout = job_layout(name)
    hosts = subprocess.run(
        ["scontrol", "show", "hostnames", job.node_list],
        env=lab.env(),
        capture_output=True,
        text=True,
    ).stdout.split()
    assert len(hosts) == layout.nodes, report
    assert set(hosts) <= set(NODES)

    summaries = parse_summaries(job.output)
    per_node = layout.tasks_per_node * layout.procs_per_task
    assert [s.get("rank", 0) for s in summaries] == list(range(layout.world_size)), (
        report
    )
    # Each node runs its share of the ranks, and every node of the job takes part.
    placed = Counter(s.get("host", hosts[0]) for s in summaries)
    assert placed == dict.fromkeys(hosts, per_node), report
    if layout.launcher == "srun":
        # srun numbers tasks node by node: rank r shares the node of the first rank of
        # its block, r // tasks_per_node. Which node comes first is the order of the
        # nodes' names, or from Slurm 26.05 that of the topology (cn2 on the test
        # cluster: test_the_node_that_runs_task_0).
        host = {s["rank"]: s["host"] for s in summaries}
        for s in summaries:
            assert s["host"] == host[s["rank"] // per_node * per_node], report


def slurm_lines(name: str) -> list[str]:
    """What Slurm reads and runs in a job.sh, but for the lines that differ between
    steps without changing how Slurm runs them: the job name, the time limit, the
    dataset's place, how much NCCL logs, and the template's own sections: the copy of
    the dataset to each node, and the sweep, which acts in a job array only (each up to
    the next blank line)."""
    text = (EXAMPLES_DIR / name / "job.sh").read_text()
    own = r"# --- (Copy the dataset|A sweep)\b.*?\n\n"
    text = re.sub(own, "", text, flags=re.DOTALL)
    return [
        line
        for line in text.splitlines()
        if line.strip()
        and (line.startswith("#SBATCH") or not line.lstrip().startswith("#"))
        and not re.match(
            r"#SBATCH --(job-name|time)=|export (DATA_DIR|DATA_ARCHIVE|NCCL_DEBUG)="
            r"|local_disk=",
            line,
        )
    ]


@pytest.mark.parametrize(("name", "step"), LIKE_A_STEP.items())
def test_job_scripts_completed_on_one_version_only_are_like_a_step(name, step):
    assert slurm_lines(name) == slurm_lines(step)
    assert slurm_lines("generic/checkpointing") != slurm_lines("generic/multi_node")
    # The template's copy of the dataset, an srun step of its own, is what is left out.
    template = (EXAMPLES_DIR / "generic/template/job.sh").read_text()
    assert "srun --ntasks-per-node=1" in template
    assert not any("--ntasks-per-node=1" in s for s in slurm_lines("generic/template"))


@every_version
@pytest.mark.parametrize("name", ["generic/template"])
def test_the_template_unpacks_the_dataset_on_every_node(lab, jobs, name):
    job = jobs(name)
    assert job.ok, job.output
    # Training read the copy on the node's disk ($SLURM_TMPDIR, from the TaskProlog).
    unpacked = f"{lab.state}/local-disk/{job.job_id}/dataset"
    assert re.search(
        rf"Unpacked the dataset in {unpacked} on every node in \d+ s", job.output
    ), job.output
    # Each node has its own local disk (slurm_lab.py): both hold a full copy.
    shared = lab.state / "scratch" / "data" / "imagenet"
    images = sorted(p.relative_to(shared) for p in shared.rglob("*") if p.is_file())
    assert images
    for node in NODES:
        copy = lab.state / "nodes" / node / "local-disk" / job.job_id / "dataset"
        copied = [p.relative_to(copy) for p in copy.rglob("*") if p.is_file()]
        assert sorted(copied) == images, node


# The direct launches (smoke.py) stand in for Slurm in the other tests: they must
# compute what Slurm's launch computes. Checked once per site profile, which sets what
# the site gives its jobs, and once per launcher, which sets the variables and CPUs of
# each process; mp.spawn starts its processes itself. (A direct run at job.sh's 8
# processes takes half a minute on 2 cores: Mila's is its single-process step, whose
# site is the same.)
COMPARED = [
    "generic/template", "mila/single_gpu", "ibex/multi_node", "ibex/multi_node_legacy",
    "launchers/mp_spawn",
]  # fmt: skip


def test_every_site_and_launcher_is_compared_with_a_direct_run():
    assert {site_of(name) for name in COMPARED} == set(map(site_of, NAMES))
    launchers = {EXAMPLES[name].launcher for name in NAMES}
    assert {EXAMPLES[name].launcher for name in COMPARED} == launchers


@JOBS_TIMEOUT
@pytest.mark.parametrize("name", COMPARED)
def test_job_results_match_the_direct_smoke_run(jobs, smoke_run, name):
    job = jobs(name)
    assert job.ok, job.output
    # The same layout as the job, launched directly: same ranks
    # and CPUs (which set the number of DataLoader workers, and
    # so how random augmentations are drawn), same numbers.
    launch = job_layout(name)
    cpus = sbatch_options(EXAMPLES_DIR / name / "job.sh").get("cpus-per-task", "1")
    direct = smoke_run(name, launch, env={"SLURM_CPUS_PER_TASK": cpus})
    assert check_run(direct) == [], direct.output
    assert numbers(parse_summaries(job.output)) == numbers(direct.summaries), job.output


@pytest.mark.every_version
def test_nodes_have_their_own_hostname_and_address(lab):
    """What the scripts rely on: per-node names and IPs, and TCP between the nodes."""
    script = (
        'echo "$(hostname) $(hostname -I)"; '
        "python3 -c \"import socket; socket.create_connection(('cn1', 6818), "
        'timeout=5)" && echo reached-cn1'
    )
    result = subprocess.run(
        ["srun", "--nodes=2", "--ntasks-per-node=1", "--label", "bash", "-c", script],
        env=lab.env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    lines = sorted(result.stdout.splitlines())
    # Each task, labelled 0 or 1, on a node of its own, with that node's name and IP.
    nodes = [line.split()[:3] for line in lines if "reached" not in line]
    assert sorted(label for label, *_ in nodes) == ["0:", "1:"], lines
    assert sorted((name, address) for _, name, address in nodes) == sorted(
        NODES.items()
    ), lines
    assert sum("reached-cn1" in line for line in lines) == 2, lines


@pytest.mark.every_version
def test_variable_table_matches_the_cluster(lab):
    """The concepts page's table of Slurm variables holds what a real task sees.

    Run on each version: a row is set from the version its "Set by" column names, and
    holds the value shown on each version of the test cluster that sets it.
    """
    table = csv.DictReader((DOCS / "slurm-variables.csv").open())
    example = "Task 3 of 2 nodes × 2 tasks sees"
    result = subprocess.run(
        ["srun", "--nodes=2", "--ntasks-per-node=2", "--cpus-per-task=2",
         "--gpus-per-node=2", "--label", "env"],
        env=lab.env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    task3 = dict(
        line[len("3: ") :].split("=", 1)
        for line in result.stdout.splitlines()
        if line.startswith("3: ") and "=" in line
    )
    rows = list(table)
    assert len(rows) >= 10
    # From 26.05, srun numbers the tasks in the order of the test cluster's
    # topology.conf, which lists cn2's switch first: task 3 runs on cn1, the first node
    # by name. The concepts page says so.
    moved = (
        {"SLURM_NODEID": "0", "SLURMD_NODENAME": "cn1"} if lab.at_least("26.05") else {}
    )
    for row in rows:
        name, since = row["Slurm variable"], row["Set by"]
        if since == "every version":
            expected = True
        else:
            first = re.fullmatch(r"(\d+\.\d+) and later", since)
            assert first, f"{name}: 'Set by' says {since!r}"
            expected = lab.at_least(first[1])
        assert (name in task3) == expected, (
            f"{name}: set={name in task3} on {lab.version}"
        )
        if expected and row[example] != "(varies)":
            assert task3[name] == moved.get(name, row[example]), name


def restarts(function: ast.FunctionDef) -> bool:
    """Whether `function` starts or stops a test cluster: calls X.up() or X.down()."""
    return any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("up", "down")
        for node in ast.walk(function)
    )


def test_every_test_that_restarts_the_cluster_is_marked_to_run_last():
    # Unmarked, such a test removed the files of the jobs that later tests read (the
    # twin's checkpoints): CI failed so.
    for path in Path(__file__).parent.glob("test_*.py"):
        tree = ast.parse(path.read_text())
        module_marked = "restarts_lab" in ast.unparse(
            next((n for n in tree.body if isinstance(n, ast.Assign)
                  and "pytestmark" in ast.unparse(n.targets[0])), ast.Pass())
        )  # fmt: skip
        for function in ast.walk(tree):
            if isinstance(function, ast.FunctionDef) and restarts(function):
                marks = " ".join(map(ast.unparse, function.decorator_list))
                assert module_marked or "restarts_lab" in marks, (
                    f"{path.name}: {function.name} restarts the test cluster; mark it "
                    "@pytest.mark.restarts_lab"
                )


@pytest.mark.restarts_lab
def test_starting_again_over_a_running_cluster_works(lab):
    # What a crashed run leaves behind is a running
    # cluster: `up` must clear it and start anew. Its files go with it: this runs last.
    lab.up()
    result = subprocess.run(
        ["srun", "--nodes=2", "hostname"], env=lab.env(), capture_output=True, text=True
    )
    assert sorted(result.stdout.split()) == ["cn1", "cn2"], result.stderr


def test_site_profile_rejects_a_module_the_site_lacks(lab, tmp_path):
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\nmodule load cuda/99.9\n")
    job = lab.wait(
        lab.sbatch(script, site="mila", workdir=tmp_path), tmp_path, timeout=60
    )
    assert not job.ok
    assert 'unknown module "cuda/99.9"' in job.output


@pytest.mark.parametrize(
    "name", [n for n in NAMES if EXAMPLES[n].launcher == "torchrun"]
)
def test_torchrun_script_refuses_one_task_per_gpu(lab, tmp_path, name):
    # The classic mistake: a task per GPU, each starting
    # torchrun, which starts a process per GPU: G x G processes.
    # The guard in job.sh must stop the job before any starts. (Two tasks of 16 CPUs
    # fit the test cluster's 32-CPU nodes; job.sh's one task takes up to 32.)
    script = EXAMPLES_DIR / name / "job.sh"
    job_id = lab.sbatch(
        script, *EXAMPLES[name].args, site=site_of(name), workdir=tmp_path,
        options=["--ntasks-per-node=2", "--cpus-per-task=16"],
    )  # fmt: skip
    job = lab.wait(job_id, tmp_path, timeout=60)
    assert not job.ok, job.output
    assert "torchrun must run once per node" in job.output
    assert "summary:" not in job.output and "Running on" not in job.output


@pytest.mark.parametrize(
    ("euid", "which", "expected"),
    [
        (1000, "/usr/bin/x", "needs root"),
        (0, None, "missing and there is no apt-get"),
    ],
)
def test_cluster_says_why_it_cannot_start(monkeypatch, euid, which, expected):
    monkeypatch.setattr(os, "geteuid", lambda: euid)
    monkeypatch.setattr("shutil.which", lambda name: which)
    with pytest.raises(LabUnavailable, match=expected):
        check_can_start()


def test_cluster_names_the_versions_it_has():
    with pytest.raises(
        LabUnavailable,
        match="no Slurm 21.08 here; the test cluster runs 22.05, 24.11 or 26.05",
    ):
        Lab(version="21.08")


def test_cluster_says_when_its_slurm_is_another_version(monkeypatch):
    # Debian 13's own slurmd on the host, say, where 22.05 was asked for.
    monkeypatch.setattr(slurm_lab, "_run", lambda cmd, **kw: "slurm-wlm 24.11.5\n")
    with pytest.raises(
        LabUnavailable, match="the Slurm of this machine is 24.11.5, not 22.05"
    ):
        Lab(version="22.05")._check_version()


def test_a_root_that_cannot_be_made_says_why_and_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(slurm_lab, "ROOTS", tmp_path)

    def debootstrap_fails(cmd, **kwargs):
        target = next(Path(arg) for arg in cmd if arg.endswith(".partial"))
        (target / "etc").mkdir(parents=True)  # half made, where debootstrap was told to
        return subprocess.CompletedProcess(cmd, 1, "", "E: Failed getting release file")

    monkeypatch.setattr(subprocess, "run", debootstrap_fails)
    with pytest.raises(LabUnavailable, match="debootstrap of Debian trixie failed"):
        make_root("trixie")
    # No root that a later run would take for a whole one, and no half-made one either.
    assert list(tmp_path.iterdir()) == []


def test_a_suite_newer_than_debootstrap_is_made_as_sid_is(monkeypatch, tmp_path):
    """Debian 12's debootstrap has no script for forky, which is made with sid's."""
    monkeypatch.setattr(slurm_lab, "ROOTS", tmp_path / "roots")
    scripts = tmp_path / "scripts"  # as Debian 12's debootstrap has them
    scripts.mkdir()
    for name in ["bookworm", "trixie", "sid"]:
        (scripts / name).touch()
    monkeypatch.setattr(slurm_lab, "DEBOOTSTRAP_SCRIPTS", scripts)
    made = []

    def debootstrap(cmd, **kwargs):
        made.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "stop here")

    monkeypatch.setattr(subprocess, "run", debootstrap)
    for suite in ["trixie", "forky"]:
        with pytest.raises(LabUnavailable):
            make_root(suite)
    assert made[0][-4:] == [
        "trixie", str(tmp_path / "roots" / "debian-trixie.partial"),
        "http://deb.debian.org/debian", str(scripts / "trixie"),
    ]  # fmt: skip
    assert made[1][-1] == str(scripts / "sid")
