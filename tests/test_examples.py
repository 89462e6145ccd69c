"""Every example, run in CPU smoke mode as its job.sh launches it, must train correctly."""

import dataclasses
import re

import pytest
from smoke import EXAMPLES, EXAMPLES_DIR, MILA_VAL_SAMPLES, Launch, check_run, run_example


def test_every_example_folder_has_a_smoke_run():
    folders = {str(p.parent.relative_to(EXAMPLES_DIR)) for p in EXAMPLES_DIR.glob("**/main.py")}
    assert folders == set(EXAMPLES), "add new examples to EXAMPLES in tests/smoke.py"


@pytest.mark.parametrize("name", EXAMPLES)
def test_smoke_run_trains_on_every_rank(name, smoke_run):
    run = smoke_run(name)
    assert check_run(run) == [], run.output
    world_size = run.launch.world_size
    if world_size > 1:
        for rank, output in enumerate(run.outputs):
            assert f"[{rank}/{world_size}] Running on" in output, output
    for summary in run.summaries:
        assert summary["steps"] == 4
        # A few steps on the synthetic set, whose classes differ in tint, must lower the loss.
        assert summary["last_loss"] < summary["first_loss"], summary


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_validation_counts_every_sample_exactly_once(world_size, smoke_run):
    launch = dataclasses.replace(EXAMPLES["mila/multi_gpu"], tasks_per_node=world_size)
    run = smoke_run("mila/multi_gpu", launch)
    assert check_run(run) == [], run.output
    assert [s["val_samples"] for s in run.summaries] == [MILA_VAL_SAMPLES] * world_size


def test_multi_node_computes_what_one_node_computes(smoke_run):
    # Same number of processes, same code path for training: the numbers must be identical.
    one_node = smoke_run("mila/multi_gpu").summaries[0]
    two_nodes = smoke_run("mila/multi_node").summaries[0]
    ignore = {"host"}
    assert {k: v for k, v in one_node.items() if k not in ignore} == {
        k: v for k, v in two_nodes.items() if k not in ignore
    }


SRUN_EXAMPLES = [name for name, launch in EXAMPLES.items() if launch.launcher == "srun"]


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
    # The batch script's own environment: SLURM_PROCID=0 and the job's task count, but no srun.
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


@pytest.mark.parametrize("name", EXAMPLES)
def test_missing_dataset_names_the_path_and_the_switch(name):
    launch = EXAMPLES[name]
    # Every rank must stop with the message: none may wait at a barrier for the others.
    run = failed_run(name, launch, args=("--max-steps", "1"))
    for output in run.outputs:
        assert re.search(r"CIFAR-10 not found: expected \S+/cifar-10-python\.tar\.gz", output)
        assert "--synthetic-data" in output
