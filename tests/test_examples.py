"""Every example, run in CPU smoke mode as its job.sh
launches it, must train correctly."""

import dataclasses
import re

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
    load_main,
    numbers,
    run_example,
)


def test_every_example_folder_has_a_smoke_run():
    folders = {
        str(p.parent.relative_to(EXAMPLES_DIR)) for p in EXAMPLES_DIR.glob("**/main.py")
    }
    assert folders == set(EXAMPLES), "add new examples to EXAMPLES in tests/smoke.py"


def test_every_process_group_forks_its_workers_from_a_server():
    # A DataLoader worker fork()ed from a process that runs a process group's threads
    # can hang before it starts, on Python up to 3.11.9 (see "Training hangs when
    # validation begins" on the troubleshooting page). Every example with both must
    # start its workers from a server.
    both = [
        path.parent.relative_to(EXAMPLES_DIR)
        for path in sorted(EXAMPLES_DIR.glob("**/main.py"))
        if "init_process_group" in (source := path.read_text())
        and "num_workers=" in source
    ]
    assert len(both) >= 7, both  # Mila's and Ibex's multi-process steps, and mp_spawn
    for folder in both:
        source = (EXAMPLES_DIR / folder / "main.py").read_text()
        assert 'multiprocessing.set_start_method("forkserver", force=True)' in source, (
            folder
        )


@pytest.mark.parametrize("name", EXAMPLES)
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


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize(
    ("name", "field"),
    [("mila/multi_gpu", "tasks_per_node"), ("ibex/single_node", "procs_per_task")],
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
def test_without_slurm_the_error_says_to_use_srun(name):
    run = failed_run(name, Launch("python"), args=EXAMPLES[name].args)
    assert "SLURM_PROCID is not set" in run.output
    assert "srun" in run.output


@pytest.mark.parametrize("name", SRUN_EXAMPLES)
def test_python_run_by_the_batch_script_is_refused(name):
    # The batch script's own environment: SLURM_PROCID=0
    # and the job's task count, but no srun.
    batch_env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"}
    run = failed_run(name, Launch("python"), env=batch_env, args=EXAMPLES[name].args)
    assert "started by the batch script, not by srun" in run.output
    assert "The job has 4 task(s)" in run.output


@pytest.mark.parametrize("name", SRUN_EXAMPLES)
def test_rank_outside_the_task_count_is_refused(name):
    launch = Launch("srun", tasks_per_node=1, args=EXAMPLES[name].args)
    run = failed_run(name, launch, env={"SLURM_PROCID": "3"})
    assert "SLURM_PROCID=3 does not fit SLURM_NTASKS=1" in run.output
    assert "srun" in run.output


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
def test_ibex_without_torchrun_the_error_says_how_to_launch(name):
    run = failed_run(name, Launch("python"), args=EXAMPLES[name].args)
    assert "LOCAL_RANK, RANK, WORLD_SIZE not set" in run.output
    assert "torchrun" in run.output


@pytest.mark.parametrize("name", IBEX_EXAMPLES)
def test_tinyimagenet_validation_labels_follow_the_annotations(name, tmp_path):
    truth = tinyimagenet.make(tmp_path)
    main = load_main(name)
    train, valid = main.make_datasets(tmp_path)
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


@pytest.mark.parametrize(
    "launch", [EXAMPLES["generic/any_launcher"], *dict(MORE_LAUNCHES).values()]
)
def test_one_main_py_runs_under_each_launcher(launch, smoke_run):
    run = smoke_run("generic/any_launcher", launch)
    assert check_run(run) == [], run.output
    expected = {"srun": "srun", "torchrun": "torchrun", "python": "single process"}
    # As many processes as the launcher should start, each knowing who started it.
    assert len(run.summaries) == launch.world_size
    assert {s["launcher"] for s in run.summaries} == {expected[launch.launcher]}


def test_one_main_py_computes_the_same_under_srun_and_torchrun(smoke_run):
    srun = smoke_run("generic/any_launcher")
    torchrun = smoke_run(
        "generic/any_launcher",
        next(launch for _, launch in MORE_LAUNCHES if launch.launcher == "torchrun"),
    )
    by_launcher = [
        [{k: v for k, v in s.items() if k != "launcher"} for s in run.summaries]
        for run in (srun, torchrun)
    ]
    assert srun.launch.world_size == torchrun.launch.world_size == 2
    assert by_launcher[0] == by_launcher[1]


@pytest.mark.parametrize(
    ("env", "found"),
    [
        (
            {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"},
            "OMPI_COMM_WORLD_RANK",
        ),
        ({"RANK": "0"}, "RANK"),
        ({"SLURM_NTASKS": "4", "SLURM_PROCID": "0"}, "SLURM_NTASKS=4 without srun"),
    ],
)
def test_unknown_launcher_names_the_variables_looked_for(env, found):
    run = failed_run(
        "generic/any_launcher", Launch("python"), env=env, args=GENERIC_SMOKE_ARGS
    )
    assert f"cannot tell this process's rank (found {found}" in run.output
    for name in (
        "RANK, LOCAL_RANK, WORLD_SIZE",
        "SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS",
    ):
        assert name in run.output


def test_generic_srun_example_refuses_a_launch_without_srun():
    run = failed_run("generic/srun_tasks", Launch("python"), args=GENERIC_SMOKE_ARGS)
    assert "not started by srun" in run.output and "srun python main.py" in run.output


def test_generic_torchrun_example_refuses_a_launch_without_torchrun():
    run = failed_run("generic/first_ddp", Launch("python"), args=GENERIC_SMOKE_ARGS)
    assert "start this script with torchrun" in run.output


def test_mp_spawn_missing_dataset_names_the_path_and_the_switch(tmp_path):
    run = failed_run(
        "generic/mp_spawn", Launch("python"), args=("--data-dir", str(tmp_path))
    )
    assert f"CIFAR-10 not found: expected {tmp_path}/cifar-10-batches-py" in run.output
    assert "--synthetic-data" in run.output
