"""A sweep as a job array, under the real Slurm test cluster: the template's job.sh
submitted with `--array`, its settings taken from the template's own sweep.txt, one
task warned by Slurm of its time limit part-way through, and requeued on its own.

What these tests hold the template to: the tasks run together, each in a folder of its
own, and each ends bitwise equal to the same settings run alone as one plain job.
"""

import re
import subprocess
import sys
import time

import pytest
from slurm_lab import ENDED, HELD
from smoke import EXAMPLES_DIR, assert_bitwise_equal, load_checkpoint
from test_failures import (
    checkpoint_dir,
    read,
    run_name,
    start_now,
    wait_until,
)

pytestmark = pytest.mark.slurm

TEMPLATE = EXAMPLES_DIR / "generic" / "template"
# One process a task, on the site's image folder (cropped and flipped at random, with
# a DataLoader worker): 3 epochs of 65 steps.
ARGS = (
    "--model", "resnet18", "--image-size", "32", "--batch-size", "2", "--epochs", "3",
    "--warmup-steps", "4", "--log-every", "5", "--num-workers", "1",
)  # fmt: skip
# Small enough for three tasks and their three twins to share the two nodes.
ONE_PROCESS = ["--nodes=1", "--ntasks-per-node=1", "--gpus-per-node=1", "--mem=16G"]


def sweep_lines() -> list[list[str]]:
    """The arguments of each task, as job.sh reads sweep.txt."""
    lines = (TEMPLATE / "sweep.txt").read_text().splitlines()
    return [line.split() for line in lines if line.strip() and not line.startswith("#")]


def task_ids(lab, array: str, tasks: int) -> dict[int, str]:
    """Each task's own job ID, once Slurm has started them all."""
    deadline = time.monotonic() + 120
    return {
        task: lab.wait_for_state(
            f"{array}_{task}", "RUNNING", timeout=deadline - time.monotonic()
        )["JobId"]
        for task in range(tasks)
    }


def test_a_sweep_runs_its_tasks_together_each_exactly_as_alone(lab, tmp_path):
    lines = sweep_lines()
    assert len(lines) >= 3, lines
    workdir = tmp_path / "sweep"
    workdir.mkdir()
    name = run_name(workdir)
    array = lab.sbatch(
        TEMPLATE / "job.sh", *ARGS, site="generic", workdir=workdir,
        options=[f"--job-name={name}", f"--array=0-{len(lines) - 1}", *ONE_PROCESS],
        OMP_NUM_THREADS="1",
    )  # fmt: skip
    # No %K: every task runs at once, singleton (job.sh's) or not.
    jobs = task_ids(lab, array, len(lines))
    # The twins: each task's settings as one plain job, never interrupted.
    twins = {}
    for task, settings in enumerate(lines):
        folder = tmp_path / f"alone-{task}"
        folder.mkdir()
        twins[task] = lab.sbatch(
            TEMPLATE / "job.sh", *ARGS, *settings, site="generic", workdir=folder,
            options=[f"--job-name={run_name(folder)}", *ONE_PROCESS],
            OMP_NUM_THREADS="1",
        )  # fmt: skip
    # The task that Slurm started last has the array's own ID as its job ID. Once it
    # trains, its time limit is cut to 2 minutes: Slurm warns it at once (SIGUSR1,
    # job.sh's --signal=USR1@120), and main.py saves and requeues that task alone.
    # Requeued under the array's ID, every task would go back in the queue.
    [warned] = [task for task, job in jobs.items() if job == array]
    output = workdir / f"slurm-{array}.out"
    wait_until(lambda: "epoch 0 step 10 |" in read(output), 180, "training")
    limit(lab, f"{array}_{warned}", "2")
    # Each task watched as <array>_<task>: `scontrol show job <array>` shows them all.
    refs = {task: f"{array}_{task}" for task in jobs}
    restarts = {}
    deadline = time.monotonic() + 600
    while any(
        lab.job_info(r).get("JobState") not in ENDED | HELD for r in refs.values()
    ):
        assert time.monotonic() < deadline, {r: lab.job_info(r) for r in refs.values()}
        for task, ref in refs.items():
            info = lab.job_info(ref)
            if info.get("JobState") == "PENDING" and int(
                info["Restarts"]
            ) > restarts.get(task, 0):
                restarts[task] = int(info["Restarts"])
                limit(lab, ref, "60")  # the rest of the run: no warning
                start_now(lab, ref)
        time.sleep(0.5)
    assert restarts == {warned: 1}, restarts
    folders = set()
    for task, job in jobs.items():
        info, output = lab.job_info(refs[task]), read(workdir / f"slurm-{job}.out")
        assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), output
        alone_dir = tmp_path / f"alone-{task}"
        alone = lab.wait(twins[task], alone_dir, timeout=600)
        assert alone.ok, alone.output
        settings = " ".join(lines[task])
        assert f"Task {task} of array {array}: {settings}" in output
        mine = checkpoint_dir(lab, workdir) / f"task-{task}"
        folders.add(mine)
        ran = load_checkpoint(mine)
        assert ran["arguments"]["checkpoint_dir"] == str(mine)
        assert ran["arguments"]["learning_rate"] == float(lines[task][1])
        assert_bitwise_equal(ran, load_checkpoint(checkpoint_dir(lab, alone_dir)))
        stops = re.findall(r"Stopped at step (\d+), checkpoint saved", output)
        if task == warned:
            assert f"Requeueing job {array}_{task}" in output, output
            assert len(stops) == 1, output
            assert re.search(rf"Resumed from \S+ at step {stops[0]}\b", output), output
        else:
            assert not stops, output
    assert len(folders) == len(lines)
    # The one line that makes a table of the sweep: a row per task, its learning rate.
    table = subprocess.run(
        [sys.executable, "summaries.py",
         *sorted(str(f) for f in folders)],
        cwd=TEMPLATE, capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    assert table[0].split()[:2] == ["run", "learning_rate"], table
    rows = [row.split() for row in table[1:]]
    assert [row[0] for row in rows] == [f"task-{t}" for t in range(len(lines))]
    assert [float(row[1]) for row in rows] == [float(line[1]) for line in lines]
    assert all(row[-1] == "True" for row in rows), table
    print(f"array of {len(lines)} tasks, requeued {restarts}: each equal to its twin")


def limit(lab, job: str, minutes: str):
    """Sets a job's time limit, as its owner may."""
    subprocess.run(
        ["scontrol", "update", f"JobId={job}", f"TimeLimit={minutes}"],
        env=lab.env(), check=True, capture_output=True,
    )  # fmt: skip


def test_an_array_task_without_its_line_of_settings_stops_at_once(lab, tmp_path):
    lines = sweep_lines()
    workdir = tmp_path / "too-many"
    workdir.mkdir()
    array = lab.sbatch(
        TEMPLATE / "job.sh", "--synthetic-data", site="generic", workdir=workdir,
        options=[f"--job-name={run_name(workdir)}", f"--array={len(lines)}",
                 *ONE_PROCESS],
    )  # fmt: skip
    # An array of one task: its job ID is the array's.
    job = lab.wait(array, workdir, timeout=60)
    assert job.state == "FAILED", job.output
    assert (
        f"error: task {len(lines)} has no line in sweep.txt, which has {len(lines)}: "
        f"submit with --array=0-{len(lines) - 1}"
    ) in job.output, job.output
    assert "Running on" not in job.output, job.output
