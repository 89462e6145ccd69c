"""Every example, run in CPU smoke mode as its job.sh
launches it, must train correctly."""

import contextlib
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tinyimagenet
from smoke import (
    EXAMPLES,
    EXAMPLES_DIR,
    GENERIC_SMOKE_ARGS,
    MORE_LAUNCHES,
    Launch,
    base_env,
    check_run,
    descendants,
    load_main,
    numbers,
    parse_summaries,
    run_example,
)


# The container example runs step 4's main.py, byte for byte: smoke-run once.
@pytest.mark.parametrize(
    "name",
    [n for n, run in EXAMPLES.items() if run.trains and n != "generic/container"],
)
def test_smoke_run_trains_on_every_rank(name, smoke_run):
    run = smoke_run(name)
    assert check_run(run) == [], run.output
    world_size = run.launch.world_size
    if world_size > 1:
        for rank in range(world_size):
            assert f"[{rank}/{world_size}] Running on" in run.output, run.output
    for summary in run.summaries:
        if "--max-steps" in run.launch.args:
            max_steps = run.launch.args[run.launch.args.index("--max-steps") + 1]
            assert summary["steps"] == int(max_steps)
        # A few steps on synthetic classes that differ in colour must lower the loss.
        assert summary["last_loss"] < summary["first_loss"], summary


# One process: every smoke run of a single-process step counts every sample (check_run).
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(
    ("name", "field"),
    [
        ("mila/multi_gpu", "tasks_per_node"),
        ("ibex/single_node", "procs_per_task"),
        ("generic/multi_gpu", "tasks_per_node"),
    ],
)
def test_validation_counts_every_sample_exactly_once(
    name, field, world_size, smoke_run
):
    launch = dataclasses.replace(EXAMPLES[name], **{field: world_size})
    run = smoke_run(name, launch)
    assert check_run(run) == [], run.output
    assert [s["val_samples"] for s in run.summaries] == [
        launch.val_samples
    ] * world_size


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ("mila/multi_gpu", "mila/multi_node"),
        ("ibex/single_node", "ibex/multi_node"),
        ("ibex/multi_node", "ibex/multi_node_legacy"),
        ("generic/multi_gpu", "generic/multi_node"),
        ("generic/multi_node", "launchers/srun_torchrun"),
    ],
)
def test_same_process_count_gives_the_same_numbers(one, other, smoke_run):
    # One node or two, torchrun or the old launcher: with as many processes, training
    # takes the same steps on the same data, and must end with identical numbers.
    assert smoke_run(one).launch.world_size == smoke_run(other).launch.world_size
    assert numbers(smoke_run(one).summaries) == numbers(smoke_run(other).summaries)


def test_smoke_runs_inherit_no_slurm_variables(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    monkeypatch.setenv("RANK", "3")
    env = base_env()
    assert "SLURM_JOB_ID" not in env and "RANK" not in env
    assert env["OMP_NUM_THREADS"] == "1"


def test_summaries_that_share_a_line_are_each_read_whole():
    # Under PYTHONUNBUFFERED=1 (smoke mode), print() writes its text and its newline
    # apart: two processes on one stdout can put two summaries on a line (seen in CI).
    line = 'summary: {"rank": 1, "x": [1]}summary: {"rank": 0, "x": [2]}\n\n'
    assert parse_summaries("x\n" + line) == [
        {"rank": 0, "x": [2]},
        {"rank": 1, "x": [1]},
    ]


# The Mila examples share one setup() and its messages; the
# generic ones are tested below.
SRUN_EXAMPLES = [
    n for n, launch in EXAMPLES.items() if launch.launcher == "srun" and "mila" in n
]


def failed_run(name, launch, env=None, args=None):
    run = run_example(name, launch, args=args, env=env, timeout=90)
    assert not run.ok, run.output
    # Fails fast: the processes exit by themselves, none is left waiting for the others.
    assert run.elapsed < 60, run.output
    return run


@pytest.mark.parametrize("name", SRUN_EXAMPLES)
def test_python_run_by_the_batch_script_is_refused(name):
    # The batch script's own environment: SLURM_PROCID=0
    # and the job's task count, but no srun.
    batch_env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"}
    run = failed_run(name, Launch("python"), env=batch_env, args=EXAMPLES[name].args)
    assert "started by the batch script, not by srun" in run.output
    assert "The job has 4 task(s)" in run.output


@pytest.mark.parametrize("name", ["generic/single_gpu", "mila/single_gpu"])
@pytest.mark.parametrize(
    ("launch", "variable"),
    [
        (Launch("srun", tasks_per_node=2), "SLURM_STEP_NUM_TASKS"),
        (Launch("torchrun", procs_per_task=2), "WORLD_SIZE"),
    ],
)
def test_step_one_refuses_to_run_as_several_processes(name, launch, variable):
    # Step 1 joins no process group: started twice, each process would train alone,
    # both on the node's first GPU. Every process stops at once, and says why.
    launch = dataclasses.replace(launch, args=EXAMPLES[name].args)
    run = failed_run(name, launch)
    assert run.output.count(f"started as one of 2 ({variable})") == 2, run.output
    assert not run.summaries


@pytest.mark.parametrize("name", SRUN_EXAMPLES)
def test_rank_outside_the_task_count_is_refused(name):
    launch = Launch("srun", tasks_per_node=1, args=EXAMPLES[name].args)
    run = failed_run(name, launch, env={"SLURM_PROCID": "3"})
    assert "rank 3 does not fit a world of 1: srun's variables" in run.output


MILA_EXAMPLES = [name for name in EXAMPLES if name.startswith("mila/")]
IBEX_EXAMPLES = [name for name in EXAMPLES if name.startswith("ibex/")]


@pytest.mark.parametrize("name", MILA_EXAMPLES)
def test_missing_dataset_names_the_path_and_the_switch(name):
    launch = EXAMPLES[name]
    # Every rank must stop with the message: none may wait at a barrier for the others.
    run = failed_run(name, launch, args=("--max-steps", "1"))
    for output in run.outputs:
        assert re.search(
            r"CIFAR-10 not found: expected \S+/cifar-10-python\.tar\.gz", output
        )
        assert "--synthetic-data" in output


@pytest.mark.parametrize("name", IBEX_EXAMPLES)
def test_ibex_missing_dataset_names_the_folder_and_data_dir(name):
    run = failed_run(
        name, EXAMPLES[name], env={"DATA_DIR": "/nonexistent/tinyimagenet"}
    )
    assert "TinyImageNet not found in /nonexistent/tinyimagenet" in run.output
    assert "DATA_DIR" in run.output


@pytest.mark.parametrize("name", IBEX_EXAMPLES)
def test_tinyimagenet_validation_labels_follow_the_annotations(name, tmp_path):
    truth = tinyimagenet.make(tmp_path)
    main = load_main(name)
    train, valid, classes = main.make_datasets(
        main.parse_args(["--data-dir", str(tmp_path)])
    )
    assert classes == len(train.classes)
    assert len(valid) == len(truth)
    # A file listed under class k in val_annotations.txt gets label k, the index that
    # the training set's ImageFolder gave class k.
    for path, label in valid.samples:
        assert train.classes[label] == truth[path.name]
    # The labels come from the file, not from the order of
    # the files: they are interleaved.
    labels = [label for _, label in valid.samples]
    assert labels != sorted(labels)
    image, label = valid[0]
    assert tuple(image.shape) == (3, 64, 64)


@pytest.mark.parametrize("launch", [EXAMPLES["generic/multi_node"],
                                    *dict(MORE_LAUNCHES).values()])  # fmt: skip
def test_one_main_py_runs_under_each_launcher(launch, smoke_run):
    # srun, torchrun, or none: setup() finds the process's place from the variables.
    run = smoke_run("generic/multi_node", launch)
    assert check_run(run) == [], run.output
    assert len(run.summaries) == launch.world_size


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"},
            "cannot tell this process's rank (found OMPI_COMM_WORLD_RANK)",
        ),
        ({"RANK": "0"}, "cannot tell this process's rank (found RANK)"),
        (
            {"SLURM_NTASKS": "4", "SLURM_PROCID": "0"},
            "main.py was started by the batch script, not by srun. The job has 4",
        ),
    ],
)
def test_an_unknown_launch_names_the_variables_looked_for(env, message):
    run = failed_run(
        "generic/multi_node", Launch("python"), env=env, args=GENERIC_SMOKE_ARGS
    )
    assert message in " ".join(run.output.split()), run.output
    if "rank" in message:
        for names in (
            "RANK, LOCAL_RANK, WORLD_SIZE",
            "SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS",
        ):
            assert names in " ".join(run.output.split())


def test_a_rank_outside_the_world_is_refused():
    launch = dataclasses.replace(EXAMPLES["generic/multi_gpu"], tasks_per_node=1)
    run = failed_run("generic/multi_gpu", launch, env={"SLURM_PROCID": "3"})
    assert "rank 3 does not fit a world of 1: srun's variables" in run.output


GENERIC_DATA = [name for name in EXAMPLES if EXAMPLES[name].dataset == "imagefolder"]


@pytest.mark.parametrize("name", GENERIC_DATA)
def test_a_missing_dataset_stops_every_rank_with_the_fix(tmp_path, name):
    (tmp_path / "train").mkdir()
    launch = dataclasses.replace(EXAMPLES[name], dataset=None)
    run = failed_run(name, launch, env={"DATA_DIR": str(tmp_path)})
    # Every rank stops with it; under mp.spawn, the parent ends the others.
    expected = launch.world_size if launch.launcher != "python" else 1
    assert run.output.count(f"error: {tmp_path} has no val folder") >= expected
    assert "train/<class>/<image> and val/<class>/<image>" in run.output
    assert "--synthetic-data" in run.output


def alive(pid: int) -> bool:
    """Running, not ended: a zombie (an ended process that no parent has reaped
    yet) counts as ended."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for_step_2(log: Path):
    """Waits until rank 0's log shows step 2: the ranks train, workers running."""
    deadline = time.monotonic() + 120
    while " step 2 |" not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)


@pytest.mark.parametrize("name", ["generic/multi_gpu", "generic/template"])
def test_a_killed_rank_leaves_no_dataloader_worker_behind(name):
    # DataLoader workers started from a fork server are the server's children. When a
    # rank dies of SIGKILL (the OOM killer, say), they must end too: left behind, they
    # hold the task's output open, and a Slurm whose process tracking lost them waits
    # for them before it can end the step.
    workers = {}

    def kill_rank_1(procs, logs):
        wait_for_step_2(logs[0])
        workers.update(
            {pid: "below rank 1" for pid in descendants(procs[1].pid) if alive(pid)}
        )
        procs[1].kill()
        procs[1].wait()  # reaped, as slurmstepd reaps its tasks

    launch = dataclasses.replace(EXAMPLES[name], nodes=1, tasks_per_node=2)
    args = (*launch.args, "--max-steps", "400", "--epochs", "50")
    run = run_example(name, launch, args, while_running=kill_rank_1, timeout=60)
    # Rank 0 fails in its next collective and exits with an error, by itself: not
    # killed by the launcher (-9), which would mean that its exit waited for its own
    # workers, as it did in the checkpointing steps, whose workers block SIGTERM.
    assert run.returncodes == [1, -signal.SIGKILL], run.output
    # Rank 1 had a fork server, a resource tracker and a DataLoader worker.
    assert len(workers) >= 3, workers
    deadline = time.monotonic() + 15
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in workers if alive(pid)]
    assert not left, f"still running 15 s after rank 1 was killed: {left}"


def test_with_no_dataloader_workers_no_fork_server_starts():
    # The workers' fork server imports torch: a process of its own, with its memory, for
    # each rank. With --num-workers 0 (what torchrun's processes get by default on a
    # node with no more CPUs than processes), there are no workers, and no server.
    children = {}

    def look(procs, logs):
        wait_for_step_2(logs[0])
        for rank, proc in enumerate(procs):
            children[rank] = [
                Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                for pid in descendants(proc.pid)
                if alive(pid)
            ]
            # Still training as it was looked at: no child because it had ended counts
            # for nothing.
            assert proc.poll() is None, logs[rank].read_text()

    name = "generic/checkpointing"
    launch = dataclasses.replace(EXAMPLES[name], nodes=1, tasks_per_node=2)
    args = (*launch.args, "--num-workers", "0", "--max-steps", "20")
    run = run_example(name, launch, args, while_running=look, timeout=60)
    assert run.ok, run.output
    # Neither a fork server nor the resource tracker it needs: no child at all.
    assert children == {0: [], 1: []}, children


# What a task started by srun under pyxis has, with an image that sets PYTORCH_VERSION:
# srun's variables, pyxis's RANK and LOCAL_RANK, copied from them, and WORLD_SIZE from
# enroot's PyTorch hook (docs/containers.md). Only where they agree are they srun's.
SRUN_TASK = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8",
             "SLURM_STEP_NUM_TASKS": "8"}  # fmt: skip
PYXIS = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8"}


@pytest.mark.parametrize(
    ("env", "launcher"),
    [
        ({**SRUN_TASK, **PYXIS}, "srun"),
        # torchrun started by srun: torchrun's own numbers, whatever srun's are.
        ({**SRUN_TASK, **PYXIS, "TORCHELASTIC_RUN_ID": "1"}, "torchrun"),
        (PYXIS, "torchrun"),  # set by hand, or by another launcher
        # A launcher's own numbers under srun, as mp.spawn's children in one task.
        (
            {**SRUN_TASK, **PYXIS, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"},
            "torchrun",
        ),
    ],
)
def test_numbers_that_pyxis_copied_from_srun_are_read_as_srun_s(
    monkeypatch, env, launcher
):
    ranks = load_main("generic/multi_node", "ranks.py")
    for name in [*SRUN_TASK, *PYXIS, "TORCHELASTIC_RUN_ID"]:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    place, found = ranks.find_place()
    assert (found, place) == (launcher, ranks.Place(5, 1, 8))


# One folder of each kind: one process; srun and step 4's modules; torchrun; Lightning;
# FSDP2.
@pytest.mark.parametrize(
    "name",
    ["generic/single_gpu", "generic/checkpointing", "ibex/single_node",
     "launchers/lightning", "generic/fsdp"],
)  # fmt: skip
def test_a_folder_copied_out_of_the_guide_runs_alone(name, tmp_path):
    # A reader copies one folder: main.py must find everything it imports beside it,
    # nothing in the rest of the repository.
    folder = tmp_path / "copied"
    shutil.copytree(EXAMPLES_DIR / name, folder, ignore=shutil.ignore_patterns("__*"))
    run = run_example(name, folder=folder)
    assert run.summaries and check_run(run) == [], run.output


# ------------------------------------------------------------
# What torchrun does with a failed worker and with signals (the launchers page)

WORKER = """import os, signal, sys, time
rank = int(os.environ["RANK"])
def stop(sig, frame):
    time.sleep(1)  # a save
    open(f"saved-{signal.Signals(sig).name}-{rank}", "w").close()
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGUSR1, stop)
open(f"ready-{rank}", "w").write(str(os.getpid()))
if sys.argv[1:] == ["fail"] and rank == int(os.environ["WORLD_SIZE"]) - 1:
    sys.exit(3)
time.sleep(120)
"""


def torchrun(tmp_path: Path, *args: str) -> subprocess.Popen:
    """torchrun of 2 workers, its output in out.txt: a file, not a pipe, which workers
    left behind would hold open."""
    (tmp_path / "worker.py").write_text(WORKER)
    command = [str(Path(sys.executable).parent / "torchrun"), "--standalone"]
    with open(tmp_path / "out.txt", "w") as out:
        return subprocess.Popen(
            [*command, "--nproc-per-node=2", *args],
            cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip


def test_torchrun_stops_its_other_workers_and_fails_when_one_fails(tmp_path):
    # With --max-restarts at its default, 0: no restart, SIGTERM to the others, and
    # torchrun ends with an error that names the failed rank.
    run = torchrun(tmp_path, "worker.py", "fail")
    run.wait(timeout=120)
    output = (tmp_path / "out.txt").read_text()
    assert run.returncode == 1, output
    assert (tmp_path / "saved-SIGTERM-0").exists(), output
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s+exitcode\s*: 3", output), output


@pytest.mark.parametrize("handled", [True, False], ids=["handled", "default"])
def test_torchrun_waits_for_its_workers_at_sigusr1_only_when_told_to(tmp_path, handled):
    # SIGUSR1 is not among the signals torchrun handles: by default it ends torchrun at
    # once (128 + 10), and its workers never hear of it. Added to --signals-to-handle,
    # it reaches the workers, and torchrun ends after their save.
    flag = (
        ["--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"] if handled else []
    )
    run = torchrun(tmp_path, *flag, "worker.py")
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready-{r}").exists() for r in (0, 1)):
            assert run.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        run.send_signal(signal.SIGUSR1)
        run.wait(timeout=120)
        output = (tmp_path / "out.txt").read_text()
        saved = sorted(p.name for p in tmp_path.glob("saved-*"))
        if handled:
            assert saved == ["saved-SIGUSR1-0", "saved-SIGUSR1-1"], output
            assert "SignalException" in output and run.returncode == 1, output
        else:
            assert saved == [] and run.returncode == -signal.SIGUSR1, output
    finally:
        run.kill()
        for ready in tmp_path.glob("ready-*"):  # the default case's orphans
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(ready.read_text()), signal.SIGKILL)


def ignore_stop_signals(worker_id: int) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


@pytest.mark.parametrize("ignored", [True, False], ids=["ignored", "default"])
def test_workers_that_ignore_the_stop_signals_outlive_sigterm(ignored):
    # troubleshooting.md: with the fork start method, a worker_init_fn that ignores
    # SIGTERM and SIGUSR1 keeps Slurm's signals away from the workers, but then
    # SIGTERM cannot end them either. Without it, SIGTERM ends a worker.
    import torch
    from torch.utils.data import DataLoader

    loader = DataLoader(
        torch.arange(8), num_workers=1, multiprocessing_context="fork",
        worker_init_fn=ignore_stop_signals if ignored else None,
    )  # fmt: skip
    batches = iter(loader)
    next(batches)
    [worker] = batches._workers
    os.kill(worker.pid, signal.SIGTERM)
    worker.join(2)
    alive = worker.is_alive()
    # The loader's own shutdown sends SIGTERM too, in vain where it is ignored.
    batches._shutdown_workers()
    if worker.is_alive():
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
    assert alive == ignored
