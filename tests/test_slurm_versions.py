"""What changed between the Slurm versions of the test
cluster, pinned so the pages can say it.

Each test runs on whichever version the suite was started with (`--slurm-version`) and
checks that version's behaviour; `nox -s tests` runs them on 22.05, 24.11 and 26.05.
The expectations follow Slurm's changelogs (CHANGELOG/slurm-<version>.md in SchedMD's
repository): 23.11 made srun inherit --cpus-per-task again (22.05 to 23.02 did not,
unless told with SRUN_CPUS_PER_TASK), added SLURM_TRES_PER_TASK, and 23.11.4 added
`srun --gres-flags=allow-task-sharing`; 25.11 let --gpu-bind bind a step of one task,
added %r to file name patterns and SubmitLine to `scontrol show job`; 26.05 made
`srun --gres=gpu` and `--gpus-per-node` mutually exclusive and numbers a step's tasks
in the order of topology.conf (the test cluster has one, listing cn2 first). What does
not change is pinned too: the SIGTERM that --kill-on-bad-exit sends first. The testing
page's table lists these and the changes that the test cluster cannot show.
"""

import re
import subprocess
import time
from pathlib import Path

import pytest
from slurm_lab import Lab

pytestmark = [pytest.mark.slurm, pytest.mark.every_version]


def run_job(lab: Lab, tmp_path: Path, options: list[str], body: str):
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n" + body)
    job_id = lab.sbatch(script, site=None, workdir=tmp_path, options=options)
    return lab.wait(job_id, tmp_path, timeout=60)


def steps(output: str) -> dict[str, list[str]]:
    """The lines each step printed, by the step's label:
    `<label> <rest>` -> {label: [rest]}."""
    found: dict[str, list[str]] = {}
    for line in output.splitlines():
        label, _, rest = line.partition(" ")
        if label.startswith("step-"):
            found.setdefault(label, []).append(rest)
    return found


# Each step prints, per task, the CPUs that slurmctld gave the step
# (`scontrol show step`) and the task's SLURM_CPUS_PER_TASK. --exact gives a step just
# the CPUs its tasks ask for, instead of all the job's, so the step's CPUs show its CPUs
# per task (no CPU binding needed).
SHOW_STEP = """
step=$(scontrol show step "$SLURM_JOB_ID.$SLURM_STEP_ID" |
    grep -o "CPUs=[0-9]*" | head -1)
echo "$1 $SLURM_PROCID $step env=$SLURM_CPUS_PER_TASK"
"""
CPU_JOB = """
show=$PWD/show.sh  # the job runs in the test's folder (sbatch --chdir)
srun --exact bash "$show" step-bare
SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK srun --exact bash "$show" step-srun-variable
SRUN_CPUS_PER_TASK=2 srun --exact bash "$show" step-srun-variable-2
srun --exact --cpus-per-task="$SLURM_CPUS_PER_TASK" bash "$show" step-srun-option
# A script that sets its own SLURM_CPUS_PER_TASK (2, where the job asked for 4).
SLURM_CPUS_PER_TASK=2 srun --exact bash "$show" step-own-variable \
    || echo "step-own-variable refused"
"""


def test_cpus_per_task_that_a_bare_srun_step_gets(lab, tmp_path):
    """Job: 2 tasks, --cpus-per-task=4 (8 CPUs). What does each srun step get?"""
    (tmp_path / "show.sh").write_text(SHOW_STEP)
    job = run_job(
        lab, tmp_path, ["--nodes=1", "--ntasks=2", "--cpus-per-task=4"], CPU_JOB
    )
    assert job.ok, job.output
    got = steps(job.output)
    for lines in got.values():
        if lines != ["refused"]:  # both tasks of every step that ran printed
            assert sorted(line.split(" ", 1)[0] for line in lines) == ["0", "1"], (
                job.output
            )
    # Both tasks of a step print the same line but for their rank: keep the rest.
    cpus = {
        label: sorted({line.partition(" ")[2] for line in lines})
        for label, lines in got.items()
    }
    if lab.at_least("23.11"):
        assert cpus["step-bare"] == ["CPUs=8 env=4"], job.output  # inherited again
    else:
        assert cpus["step-bare"] == ["CPUs=2 env=4"], job.output  # one CPU a task
    # What the guide's scripts do, and the older variable:
    # 4 CPUs a task on every version.
    assert cpus["step-srun-option"] == ["CPUs=8 env=4"], job.output
    assert cpus["step-srun-variable"] == ["CPUs=8 env=4"], job.output
    if lab.at_least("23.11"):
        # SRUN_CPUS_PER_TASK is ignored: 2 changes nothing, the job's 4 are inherited.
        assert cpus["step-srun-variable-2"] == ["CPUs=8 env=4"], job.output
    else:
        assert cpus["step-srun-variable-2"] == ["CPUs=4 env=2"], job.output
    if lab.at_least("23.11"):
        # From 23.11, SLURM_TRES_PER_TASK (cpu=4) disagrees
        # with the script's 2: srun stops.
        assert got["step-own-variable"] == ["refused"], job.output
        assert "cpus-per-task set by two different environment variables" in job.output
    else:
        # 22.05 reads no SLURM_CPUS_PER_TASK at all: one CPU a task, as for a bare step.
        assert cpus["step-own-variable"] == ["CPUs=2 env=2"], job.output


def test_tres_per_task_is_set_from_23_11(lab):
    result = subprocess.run(
        ["srun", "--ntasks=1", "--cpus-per-task=2", "bash", "-c",
         'echo "${SLURM_TRES_PER_TASK-unset}"'],
        env=lab.env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ("cpu=2" if lab.at_least("23.11") else "unset")


# Two tasks with a GPU each (--gpus-per-task), and the GPUs that each task is bound to.
GPU_JOB = """
gpus='echo "$0 $SLURM_PROCID gpus=$CUDA_VISIBLE_DEVICES"'
srun bash -c "$gpus" step-bound
tres='echo "step-variables ${SLURM_GPUS_PER_TASK-unset} ${SLURM_TRES_PER_TASK-unset}"'
srun bash -c "$tres"
srun --gres-flags=allow-task-sharing bash -c "$gpus" step-shared ||
    echo "step-shared refused"
"""


def test_gpus_per_task_and_allow_task_sharing(lab, tmp_path):
    """Mila's way of asking for GPUs: --gpus-per-task, with srun's allow-task-sharing.

    The flag lets every task open the job's other GPUs on its node where cgroups confine
    devices, which this cluster does not do; what it can show is which versions accept
    the flag, and that on 24.11 each task stays bound to its own GPU either way.
    """
    options = ["--nodes=1", "--ntasks=2", "--gpus-per-task=rtx8000:1"]
    job = run_job(lab, tmp_path, options, GPU_JOB)
    assert job.ok, job.output
    got = steps(job.output)
    if lab.at_least("23.11"):
        # CUDA_VISIBLE_DEVICES names the task's own GPU, so main.py takes cuda:0.
        assert sorted(got["step-bound"]) == ["0 gpus=0", "1 gpus=1"], job.output
    else:
        # 22.05 on this cluster, which runs no task plugin, leaves it empty: a real
        # 22.05 cluster binds through its task plugin, which this test cannot show.
        assert sorted(got["step-bound"]) == ["0 gpus=", "1 gpus="], job.output
    if lab.at_least("23.11"):
        # SLURM_GPUS_PER_TASK is gone; the request is in SLURM_TRES_PER_TASK.
        assert got["step-variables"] == ["unset gres/gpu:rtx8000=1"] * 2, job.output
    else:
        assert got["step-variables"] == ["rtx8000:1 unset"] * 2, job.output
    if lab.at_least("23.11.4"):
        assert sorted(got["step-shared"]) == ["0 gpus=0", "1 gpus=1"], job.output
    else:
        assert got["step-shared"] == ["refused"], job.output
        assert re.search(r"[Ii]nvalid.*gres-flags", job.output), job.output


def test_sbatch_refuses_allow_task_sharing(lab, tmp_path):
    """The flag is srun's: in an #SBATCH line it stops the
    submission, on every version."""
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH --gres-flags=allow-task-sharing\ntrue\n")
    result = subprocess.run(
        ["sbatch", "--test-only", str(script)],
        env=lab.env(), capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode != 0, result.stderr
    assert "gres-flags" in result.stderr, result.stderr


# A job that asked for 2 GPUs with --gpus-per-node, and steps that ask for GPUs the
# other ways, or bind them.
GPU_STEP_JOB = """
gpus='echo "$0 gpus=$CUDA_VISIBLE_DEVICES"'
srun --ntasks=1 --gpus=1 bash -c "$gpus" step-gpus
srun --ntasks=1 --gres=gpu:1 bash -c "$gpus" step-gres || echo "step-gres refused"
srun --ntasks=1 --gpu-bind=map_gpu:1 bash -c "$gpus" step-bound
# A binding that the site sets for every step, and a step that turns it off.
export SLURM_GPU_BIND=map_gpu:1
srun --ntasks=1 bash -c "$gpus" step-site-bound
srun --ntasks=1 --gpu-bind=none bash -c "$gpus" step-unbound
"""


def test_gpus_that_a_step_asks_for_in_a_gpus_per_node_job(lab, tmp_path):
    """From 26.05, srun refuses --gres=gpu in a job that asked with --gpus-per-node
    (SLURM_GPUS_PER_NODE is in the job's environment); --gpus works on every version,
    though 22.05 gives the step all the job's GPUs on the node. From 25.11, --gpu-bind
    also binds a step of one task per node, as torchrun's is, whether the step or the
    site (SLURM_GPU_BIND) asks: before, Slurm dropped the binding of such a step.
    `--gpu-bind=none` turns a site's binding off on every version."""
    options = ["--nodes=1", "--ntasks=1", "--gpus-per-node=2"]
    job = run_job(lab, tmp_path, options, GPU_STEP_JOB)
    assert job.ok, job.output
    got = steps(job.output)
    assert got["step-gpus"] == ["gpus=0" if lab.at_least("23.11") else "gpus=0,1"], (
        job.output
    )
    if lab.at_least("26.05"):
        assert got["step-gres"] == ["refused"], job.output
        assert "--gpus-per-node and --gres=gpu are mutually exclusive" in job.output
    else:
        assert got["step-gres"] == ["gpus=0"], job.output
    bound = ["gpus=1" if lab.at_least("25.11") else "gpus=0,1"]
    assert got["step-bound"] == bound, job.output
    assert got["step-site-bound"] == bound, job.output
    assert got["step-unbound"] == ["gpus=0,1"], job.output


# Where each task of a two-node step runs, by rank, with srun's default order and with
# --distribution=block, beside the job's first node by name (MASTER_ADDR in job.sh).
TASK_ORDER_JOB = r"""
echo "step-first $(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
echo "step-batch $SLURMD_NODENAME"
task='echo "$0 $SLURM_PROCID $SLURMD_NODENAME node-id=$SLURM_NODEID"'
srun bash -c "$task" step-default | sort -k2n
srun --distribution=block bash -c "$task" step-block | sort -k2n
srun --ntasks=2 --ntasks-per-node=1 bash -c "$task" step-one-per-node | sort -k2n
"""


def test_the_node_that_runs_task_0(lab, tmp_path):
    """The test cluster's topology.conf lists cn2's leaf switch first. From 26.05, srun
    lays out the tasks of a step with more tasks than nodes in that order, so task 0
    runs on cn2, while the job's first node by name, and the batch script's node, are
    cn1; --distribution=block, which the manual says turns the order off, changes
    nothing. A step of one task per node still starts on cn1. Before 26.05, task 0 runs
    on cn1. The first task on the first node by name has SLURM_NODEID=0 on every
    version: every example's setup() serves the rendezvous from it."""
    job = run_job(lab, tmp_path, ["--nodes=2", "--ntasks-per-node=2"], TASK_ORDER_JOB)
    assert job.ok, job.output
    got = steps(job.output)
    assert got["step-first"] == ["cn1"] and got["step-batch"] == ["cn1"], job.output
    by_rank = (
        ["cn2"] * 2 + ["cn1"] * 2
        if lab.at_least("26.05")
        else ["cn1"] * 2 + ["cn2"] * 2
    )
    node_id = {"cn1": 0, "cn2": 1}
    expected = [
        f"{rank} {node} node-id={node_id[node]}" for rank, node in enumerate(by_rank)
    ]
    assert got["step-default"] == expected, job.output
    assert got["step-block"] == expected, job.output
    assert got["step-one-per-node"] == ["0 cn1 node-id=0", "1 cn2 node-id=1"]


# Task 0 fails after a second. Task 1 says whether it got a SIGTERM before it ended,
# and how long after the step's start.
FAILED_TASK_JOB = r"""
start=$SECONDS
srun --kill-on-bad-exit=1 --ntasks=2 bash -c '
if ((SLURM_PROCID == 0)); then sleep 1; exit 3; fi
trap "echo step-other SIGTERM; exit 0" TERM
sleep 60 & wait
'
echo "step-srun exit=$? after=$((SECONDS - start))"
"""


def test_what_the_other_tasks_get_when_one_fails(lab, tmp_path):
    """With srun --kill-on-bad-exit=1, when a task fails, the step's other tasks get
    SIGTERM first, not SIGKILL, on every version (by Slurm's source, SIGKILL follows
    KillWait later): a program that saves a checkpoint on SIGTERM takes it for a stop.
    (26.05's changelog line on SIGCONT, SIGTERM and SIGKILL after a failed task is about
    PMIx and PMI aborts.)"""
    job = run_job(lab, tmp_path, ["--nodes=1", "--ntasks=2"], FAILED_TASK_JOB)
    got = steps(job.output)
    assert got["step-other"] == ["SIGTERM"], job.output
    exit_code, after = (int(part.split("=")[1]) for part in got["step-srun"][0].split())
    assert exit_code == 3, job.output
    assert after < 10, job.output  # at once, not after the task's 60 s


# A job that requeues itself once, at its first start.
REQUEUED_JOB = """
echo "start ${SLURM_RESTART_COUNT:-0}"
if [[ -z ${SLURM_RESTART_COUNT:-} ]]; then
    scontrol requeue "$SLURM_JOB_ID"
    sleep 60
fi
"""


def test_output_file_names_the_start_with_r_from_25_11(lab, tmp_path):
    """`#SBATCH --output=%x-%j-%r.out` gives each start of a requeued job its own log
    from 25.11 (%r, the restart count); before, the name keeps "%r" as it is, and the
    second start writes over the first's log."""
    options = ["--requeue", f"--output={tmp_path}/log-%r.out"]
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n" + REQUEUED_JOB)
    job_id = lab.sbatch(script, site=None, workdir=tmp_path, options=options)

    # Slurm holds a requeued job for about two minutes: let it start again at once.
    lab.wait_for_state(job_id, "PENDING", restarts=1, timeout=60)
    # slurmd refuses to start a job again with a credential made in the second in
    # which it killed the job, or the next ("already killed, do not launch batch job"):
    # seen under 24.11, where the first start ends within milliseconds of its requeue.
    time.sleep(2)
    subprocess.run(
        ["scontrol", "update", f"JobId={job_id}", "StartTime=now"],
        env=lab.env(), check=True,
    )  # fmt: skip
    assert lab.wait(job_id, tmp_path, timeout=60).state == "COMPLETED"
    # Each start's first line (the first start's log may also note the requeue).
    logs = {p.name: p.read_text().split("\n")[0] for p in tmp_path.glob("log-*.out")}
    if lab.at_least("25.11"):
        assert logs == {"log-0.out": "start 0", "log-1.out": "start 1"}
    else:
        assert logs == {"log-%r.out": "start 1"}


def test_what_scontrol_show_job_prints(lab, tmp_path):
    """The record that every job.sh prints at its start: 25.11 added the submit line
    and leaves StdErr empty when stderr goes to the output file; 26.05 shows
    OverSubscribe=NO (before: OK) for a job that shares nodes by default."""
    job = run_job(lab, tmp_path, [], 'scontrol show job "$SLURM_JOB_ID"\n')
    assert job.ok, job.output
    fields = dict(re.findall(r"(\w+)=(\S*)", job.output))
    assert fields["StdOut"] == str(tmp_path / f"slurm-{job.job_id}.out"), job.output
    if lab.at_least("25.11"):
        assert fields["SubmitLine"].endswith("sbatch"), job.output
        assert fields["StdErr"] == "", job.output
    else:
        assert "SubmitLine" not in fields, job.output
        assert fields["StdErr"] == fields["StdOut"], job.output
    assert fields["OverSubscribe"] == ("NO" if lab.at_least("26.05") else "OK")


def test_fewer_tasks_than_nodes(lab, tmp_path):
    """26.05's changelog says a job with fewer tasks than its minimum of nodes is
    rejected; sbatch still takes one, with a warning, and runs it on fewer nodes, as
    before. (The torchrun scripts check tasks against nodes themselves.)"""
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\ntrue\n")
    result = subprocess.run(
        ["sbatch", "--test-only", "--nodes=2", "--ntasks=1", str(script)],
        env=lab.env(), capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "can't run 1 processes on 2 nodes, setting nnodes to 1" in result.stderr


# A limit on open files set in the batch script, as job.sh's `ulimit -n` line sets it.
LIMIT_JOB = r"""
ulimit -Sn 200
srun --ntasks=1 bash -c 'echo "step-limit $(ulimit -Sn)"'
"""


def test_srun_gives_its_tasks_the_batch_scripts_open_file_limit(lab, tmp_path):
    """What the checkpointing job.sh files count on when they raise the limit: srun
    applies the limit of the shell that runs it to its tasks, on every version
    (slurm.conf's PropagateResourceLimits, which the test cluster leaves at its
    default). Lowered here, so that the task's limit cannot be slurmd's own."""
    job = run_job(lab, tmp_path, ["--nodes=1", "--ntasks=1"], LIMIT_JOB)
    assert steps(job.output)["step-limit"] == ["200"], job.output
