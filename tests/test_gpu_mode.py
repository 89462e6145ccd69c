"""The smoke runner's GPU-node mode (`nox -s examples -- --gpus`): how it plans each
example's launch for the GPUs of one node, what it checks, and its refusal without a
GPU. The runs themselves need a GPU node; the plans and checks are tested here."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from smoke import EXAMPLES, Run, check_gpu_run, gpu_launch

SMOKE = Path(__file__).resolve().parent / "helpers" / "smoke.py"


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_each_example_gets_a_process_per_gpu_started_as_its_job_sh_starts_it(gpus):
    for name, launch in EXAMPLES.items():
        plan = gpu_launch(launch, gpus)
        assert plan.nodes == 1, name
        assert plan.launcher == launch.launcher, name  # job.sh's own launcher
        assert plan.val_samples == launch.val_samples, name
        # Step 1 uses one GPU. (FSDP2's global batch of 24 divides among 1, 2, 4
        # and 8 processes: it takes every GPU here too.)
        expected = 1 if name.endswith("single_gpu") else gpus
        assert plan.world_size == expected, name
        if launch.launcher == "srun":
            # A task per GPU, as srun --ntasks-per-node gives.
            assert (plan.tasks_per_node, plan.procs_per_task) == (gpus, 1), name
        elif launch.launcher in ("torchrun", "torch.distributed.launch"):
            # One task on the node, its launcher starting a process per GPU.
            assert (plan.tasks_per_node, plan.procs_per_task) == (1, gpus), name
        elif name == "launchers/mp_spawn":
            assert plan.procs_per_task == gpus, name
            nprocs = plan.args[plan.args.index("--nprocs") + 1]
            assert nprocs == str(gpus), name


def test_the_fabric_check_runs_at_its_own_sizes_on_gpus():
    # Up to 1 GiB, a real measure of the node's links, where the CPU run stops at 256K.
    assert "--max-bytes" in EXAMPLES["generic/fabric"].args
    assert gpu_launch(EXAMPLES["generic/fabric"], 8).args == ()


def test_fsdp_takes_only_the_gpus_that_divide_its_global_batch():
    fsdp = EXAMPLES["generic/fsdp"]
    assert "--global-batch-size" in fsdp.args
    # 24 sequences a step: 6 GPUs take 6; 5 and 7 take 4 and 6.
    assert [gpu_launch(fsdp, g).world_size for g in (5, 6, 7)] == [4, 6, 6]


def test_a_plan_needs_a_gpu():
    with pytest.raises(ValueError, match="gpus must be 1 or more"):
        gpu_launch(EXAMPLES["generic/multi_gpu"], 0)


def gpu_run(
    devices: list[str], first_loss=2.0, last_loss=1.0, name="generic/multi_gpu"
) -> Run:
    world = len(devices)
    launch = gpu_launch(EXAMPLES[name], world)
    # Step 1's single process logs without the [rank/world] prefix.
    prefix = "" if world == 1 else "[{rank}/{world}] "
    output = "\n".join(
        f"12:00:00 {prefix.format(rank=rank, world=world)}Running on gpu1, device "
        f"{device}"
        for rank, device in enumerate(devices)
    )
    summary = {"first_loss": first_loss, "last_loss": last_loss, "val_samples": 25}
    summaries = [{"rank": rank, **summary} for rank in range(world)]
    return Run(name, launch, [0] * world, [output], 1.0, summaries)


def test_the_gpu_checks_find_a_shared_gpu_a_cpu_run_and_a_loss_that_did_not_fall():
    assert check_gpu_run(gpu_run(["cuda:0", "cuda:1"])) == []
    assert check_gpu_run(gpu_run(["cuda:0", "cuda:0"])) == [
        "rank 1 ran on cuda:0, not cuda:1"
    ]
    assert check_gpu_run(gpu_run(["cpu", "cuda:1"])) == [
        "rank 0 ran on cpu, not cuda:0"
    ]
    [problem] = check_gpu_run(gpu_run(["cuda:0", "cuda:1"], last_loss=2.5))
    assert problem.startswith("loss did not fall")
    # Step 1, one process: checked too.
    assert check_gpu_run(gpu_run(["cuda:0"], name="generic/single_gpu")) == []
    assert check_gpu_run(gpu_run(["cpu"], name="generic/single_gpu")) == [
        "rank 0 ran on cpu, not cuda:0"
    ]
    run = gpu_run(["cuda:0", "cuda:1"])
    run.outputs = [run.outputs[0].splitlines()[0]]  # rank 1 said nothing
    assert check_gpu_run(run) == ["rank 1 did not say which device it ran on"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without GPUs")
def test_without_a_gpu_the_mode_refuses_with_what_to_do():
    result = subprocess.run(
        [sys.executable, str(SMOKE), "--gpus", "generic/multi_gpu"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1
    assert "error: --gpus runs the examples on this node's GPUs" in result.stderr
    assert (
        "srun --nodes=1 --ntasks=1 --gpus-per-node=4 --cpus-per-task=16 --mem=64G "
        "--pty nox -s examples -- --gpus" in result.stderr
    )
    assert "Running on" not in result.stdout + result.stderr  # nothing was started
