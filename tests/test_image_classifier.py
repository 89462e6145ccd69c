"""The generic image_classifier example: accumulation, warm-up,
the throughput log, the variables it sets for libraries, its
benchmark, the laptop command of the home page, and its errors."""

import argparse
import dataclasses
import re
import subprocess
import sys

import bench
import pytest
import tinyimagenet
from smoke import EXAMPLES, EXAMPLES_DIR, base_env, check_run, load_main, run_example

NAME = "generic/image_classifier"
ROOT = EXAMPLES_DIR.parent


@pytest.fixture(scope="module")
def example():
    return load_main(NAME)


@pytest.fixture
def process_group():
    """A one-process gloo group in this process, for the functions that DDP needs."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_accumulated_micro_batches_give_the_whole_batchs_gradients_with_one_all_reduce(
    example, process_group
):
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    # No BatchNorm or dropout, whose results depend on how a batch is split.
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Flatten(), nn.Linear(3 * 8 * 8, 16), nn.ReLU(), nn.Linear(16, 5)
    )
    model = DistributedDataParallel(net)
    all_reduces = []

    def count_and_pass(state, bucket):
        # DDP's own all_reduce, on one process, leaves the gradients as they are.
        all_reduces.append(bucket.index())
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    model.register_comm_hook(None, count_and_pass)
    x, y = torch.randn(8, 3, 8, 8), torch.arange(8) % 5
    cpu = torch.device("cpu")
    speed = {"bf16": False, "channels_last": False}

    def gradients(micro_batches):
        all_reduces.clear()
        net.zero_grad(set_to_none=True)
        loss = example.accumulate_gradients(model, model, micro_batches, cpu, speed)
        return loss, [p.grad.clone() for p in net.parameters()], len(all_reduces)

    whole_loss, whole, whole_reduces = gradients([(x, y)])
    parts = [(x[i : i + 2], y[i : i + 2]) for i in range(0, 8, 2)]
    split_loss, split, split_reduces = gradients(parts)
    assert torch.allclose(split_loss, whole_loss, atol=1e-6)
    for a, b in zip(split, whole, strict=True):
        assert torch.allclose(a, b, atol=1e-6), (a - b).abs().max()
    # Four micro-batches cost no more communication than
    # one: no_sync() on all but the last.
    assert whole_reduces >= 1
    assert split_reduces == whole_reduces


def test_learning_rate_warms_up_linearly_then_decays_to_zero(example):
    factor = example.warmup_then_cosine(warmup_steps=4, total_steps=12)
    assert [factor(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    decay = [factor(s) for s in range(4, 13)]
    assert decay[0] == 1.0 and decay[-1] == pytest.approx(0.0, abs=1e-12)
    assert all(a > b for a, b in zip(decay, decay[1:], strict=False))
    assert decay[4] == pytest.approx(0.5)  # halfway through the decay


def test_bf16_is_refused_where_it_cannot_run(example):
    import torch

    args = argparse.Namespace(
        bf16=True, channels_last=True, cudnn_benchmark=True, pin_memory=True,
        compile=False, num_workers=0,
    )  # fmt: skip
    with pytest.raises(SystemExit, match="needs a GPU of compute capability 8.0"):
        example.speed_settings(args, torch.device("cpu"))
    # Unasked, a CPU trains as before: fp32, and no GPU-only setting.
    unasked = argparse.Namespace(**{**vars(args), "bf16": None})
    speed = example.speed_settings(unasked, torch.device("cpu"))
    assert not any(
        speed[k] for k in ("bf16", "channels_last", "cudnn_benchmark", "pin_memory")
    )


def test_every_rank_logs_the_variables_set_for_libraries(smoke_run):
    # job.sh's layout, two nodes of four tasks (the direct run that test_slurm.py
    # compares the job with): srun's SLURM_PROCID, SLURM_LOCALID and SLURM_NTASKS, as
    # RANK, LOCAL_RANK and WORLD_SIZE.
    launch = dataclasses.replace(EXAMPLES[NAME], nodes=2, tasks_per_node=4)
    run = smoke_run(NAME, launch, env={"SLURM_CPUS_PER_TASK": "8"})
    assert check_run(run) == [], run.output
    for rank in range(8):
        line = f"[{rank}/8] Running on "
        expected = f"RANK={rank} LOCAL_RANK={rank % 4} WORLD_SIZE=8"
        assert any(
            line in ln and ln.endswith(expected) for ln in run.output.splitlines()
        ), rank


def test_the_throughput_log_reports_every_few_steps(smoke_run):
    run = smoke_run(NAME)
    assert check_run(run) == [], run.output
    # --log-every 2 over 6 steps, on rank 0 only.
    log = re.findall(
        r"\[(\d)/2\] epoch 0 step (\d)/6 \| loss ([\d.]+) \| lr \S+ \| "
        r"([\d.]+) samples/s per process, ([\d.]+) in total \| "
        r"waiting for data (\d+)%",
        run.output,
    )
    assert [(rank, step) for rank, step, *_ in log] == [
        ("0", "2"),
        ("0", "4"),
        ("0", "6"),
    ]
    for _, _, _, per_process, total, waiting in log:
        assert float(per_process) > 0 and float(total) > 0
        assert 0 <= int(waiting) <= 100
    assert "Global batch: 4 x 2 accumulation steps x 2 processes = 16" in run.output
    # The summary's losses are those of the first and last log lines.
    summary = run.summaries[0]
    assert f"{summary['first_loss']:.4f}" == log[0][2]
    assert f"{summary['last_loss']:.4f}" == log[-1][2]


def test_a_missing_dataset_stops_every_rank_with_the_fix(tmp_path):
    (tmp_path / "train").mkdir()
    launch = dataclasses.replace(EXAMPLES[NAME], dataset=None)
    run = run_example(NAME, launch, env={"DATA_DIR": str(tmp_path)}, timeout=90)
    assert run.returncodes == [1, 1], run.output
    assert run.output.count(f"error: {tmp_path} has no val folder") == 2, run.output
    assert "train/<class>/<image> and val/<class>/<image>" in run.output
    assert "--synthetic-data" in run.output
    assert run.elapsed < 60


def test_the_laptop_command_of_the_home_page_trains(tmp_path):
    # The one line the home page gives for a first try, run
    # as it is, with no GPU and no launcher.
    index = (ROOT / "docs" / "index.md").read_text()
    [command] = re.findall(r"^python main\.py --synthetic-data .*$", index, re.M)
    env = base_env()
    del env["TRAIN_ON_CPU"]  # a laptop without a GPU trains on its CPU unasked
    result = subprocess.run(
        [sys.executable, *command.split()[1:]],
        cwd=EXAMPLES_DIR / NAME,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    [summary] = re.findall(r"^summary: .*$", result.stdout, re.M)
    assert '"world_size": 1' in summary
    losses = re.findall(r"\| loss ([\d.]+) \|", result.stderr)
    assert len(losses) >= 2 and float(losses[-1]) < float(losses[0]), result.stderr


def test_benchmark_reports_both_rates_for_each_row(tmp_path):
    tinyimagenet.make_folders(tmp_path / "images")
    csv_file = tmp_path / "bench.csv"
    # Two CPUs for the process, whatever this machine has: one DataLoader worker.
    env = {**base_env(), "SLURM_CPUS_PER_TASK": "2"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "bench.py"), "--steps", "3", "--csv",
         str(csv_file), "--", "--model", "resnet18", "--image-size", "32",
         "--batch-size", "8", "--data-dir", str(tmp_path / "images")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert re.match(
        r"resnet18, 32 px, batch 8, cpu, torch \S+, CUDA \S+; no GPU", lines[0]
    )
    assert "no GPU: the GPU-only rows are left out" in lines[0]
    assert (
        lines[1]
        == "| setting | num_workers | input_samples_per_s | step_samples_per_s |"
    )
    rows = [line.strip("| ").split(" | ") for line in lines[3:]]
    # Without a GPU: everything off, then DataLoader
    # workers; each rate a positive number.
    assert [row[0] for row in rows] == ["everything off", "+ DataLoader workers"]
    assert [row[1] for row in rows] == ["0", "1"]
    for row in rows:
        assert float(row[2]) > 0 and float(row[3]) > 0
    assert csv_file.read_text().startswith("setting,")


def test_benchmark_rows_turn_on_one_setting_each():
    rows = bench.rows()
    assert len(rows) == len(bench.SETTINGS) + 1
    assert rows[0][1] == [arg for _, off, _, _ in bench.SETTINGS for arg in off]
    assert rows[-1][1] == ["--bf16", "--compile"]
    # Every option the rows pass is one that main.py takes
    # (the CPU run above uses two rows).
    source = (EXAMPLES_DIR / NAME / "main.py").read_text()
    for _, args, _ in rows:
        for arg in args:
            if arg.startswith("--"):
                assert f'"{arg.replace("--no-", "--")}"' in source, arg
