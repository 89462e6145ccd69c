"""The generic template (step 5): accumulation, warm-up, the throughput log, the
variables it sets for libraries, its benchmark, the laptop command of the home page,
its speed settings, and a model of another kind swapped in through its reader's part."""

import argparse
import difflib
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import bench
import numpy as np
import pytest
import tinyimagenet
import torch
from other_model import (
    section,
    write_language_model_template,
    write_token_files,
)
from page_text import DOCS, page_command
from smoke import (
    EXAMPLES_DIR,
    assert_bitwise_equal,
    base_env,
    check_run,
    decode_records,
    load_checkpoint,
    load_main,
    parse_summaries,
)

NAME = "generic/template"
ROOT = EXAMPLES_DIR.parent


@pytest.fixture(scope="module")
def example():
    return load_main(NAME)


def test_accumulated_micro_batches_give_the_whole_batchs_gradients_with_one_all_reduce(
    example, process_group
):
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
    log = example.TrainLog(torch.device("cpu"), samples_per_step=8)

    def gradients(micro_batches):
        all_reduces.clear()
        net.zero_grad(set_to_none=True)
        args = argparse.Namespace(
            accumulation_steps=len(micro_batches), bf16=False, channels_last=False
        )
        loss = example.accumulate_gradients(model, iter(micro_batches), args, log)
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


def scheduled_rates(example, args, steps_per_epoch: int, steps: int) -> list[float]:
    """The learning rate of each of the first `steps` steps under make_scheduler(), for
    a base rate of 1."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = example.make_scheduler(args, optimizer, steps_per_epoch)
    rates = []
    for _ in range(steps):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return rates


def test_learning_rate_warms_up_linearly_then_decays_to_zero(example):

    args = example.parse_args(["--warmup-steps", "4", "--epochs", "3"])
    factors = scheduled_rates(example, args, steps_per_epoch=4, steps=13)
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    decay = factors[4:]
    assert decay[0] == 1.0 and decay[-1] == pytest.approx(0.0, abs=1e-12)
    assert all(a > b for a, b in zip(decay, decay[1:], strict=False))
    assert decay[4] == pytest.approx(0.5)  # halfway through the decay


def test_a_run_in_steps_decays_over_its_steps_to_the_floor(example):
    # --train-steps sets the schedule's length, whatever an epoch holds; the decay
    # ends at --min-learning-rate and stays there.
    args = example.parse_args(
        ["--train-steps", "12", "--warmup-steps", "2", "--learning-rate", "1.0",
         "--min-learning-rate", "0.1"]
    )  # fmt: skip
    rates = scheduled_rates(example, args, steps_per_epoch=1000, steps=15)
    assert rates[:3] == [0.5, 1.0, 1.0]
    decay = rates[2:13]  # from the end of the warm-up to step 12
    assert all(a > b for a, b in zip(decay, decay[1:], strict=False)), rates
    assert rates[7] == pytest.approx(0.1 + 0.9 * 0.5)  # halfway: halfway to the floor
    assert rates[12:] == pytest.approx([0.1] * 3), rates
    # A floor above the rate itself is refused, with the reason.
    high = example.parse_args(
        ["--learning-rate", "1e-4", "--min-learning-rate", "1e-3"]
    )
    with pytest.raises(SystemExit, match="must be from 0 to --learning-rate"):
        scheduled_rates(example, high, steps_per_epoch=10, steps=1)


def test_bf16_is_refused_where_it_cannot_run(example):

    args = example.parse_args(["--bf16"])
    with pytest.raises(SystemExit, match="needs a GPU of compute capability 8.0"):
        example.speed_settings(args, torch.device("cpu"))
    # Unasked, a CPU trains as before: fp32, and no GPU-only setting.
    args = example.parse_args([])
    speed = example.speed_settings(args, torch.device("cpu"))
    assert not any(
        speed[k] for k in ("bf16", "channels_last", "cudnn_benchmark", "pin_memory")
    )
    # Asked for, channels_last applies on a CPU too, to 4-D inputs only.
    args = example.parse_args(["--channels-last"])
    example.speed_settings(args, torch.device("cpu"))
    image, sequence = torch.zeros(2, 3, 4, 4), torch.zeros(2, 5, 3)
    assert example.memory_layout(image, args).is_contiguous(
        memory_format=torch.channels_last
    )
    assert example.memory_layout(sequence, args) is sequence


def test_setup_sets_the_variables_that_libraries_read(example, monkeypatch):
    # Under srun, RANK, LOCAL_RANK and WORLD_SIZE, as torchrun would set them, for
    # Accelerate and the Hugging Face Trainer.
    import torch.distributed as dist
    from smoke import free_port

    srun = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
            "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
            "TRAIN_ON_CPU": "1"}  # fmt: skip
    # setup() writes to os.environ: give it a copy, or RANK, LOCAL_RANK and WORLD_SIZE
    # would stay set in this process for the tests after this one, and reach their
    # jobs (sbatch passes its environment on), whose every task would then take itself
    # for rank 0 of 1.
    monkeypatch.setattr(os, "environ", os.environ.copy())
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in srun.items():
        monkeypatch.setenv(name, value)
    place = example.setup()
    try:
        assert place == (0, 0, 1)  # rank, local rank, world size
        assert [
            example.os.environ[n] for n in ("RANK", "LOCAL_RANK", "WORLD_SIZE")
        ] == ["0", "0", "1"]
    finally:
        dist.destroy_process_group()


def test_the_throughput_log_reports_every_few_steps(smoke_run):
    run = smoke_run(NAME)
    assert check_run(run) == [], run.output
    # --log-every 2 over 6 steps, on rank 0 only.
    log = re.findall(
        r"\[(\d)/2\] epoch 0 step (\d) \| loss ([\d.]+) \| lr \S+ \| "
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
    assert "Global batch: 8 x 2 = 16" in run.output
    # The summary's losses are those of the first and last log lines.
    summary = run.summaries[0]
    assert f"{summary['first_loss']:.4f}" == log[0][2]
    assert f"{summary['last_loss']:.4f}" == log[-1][2]


def test_the_laptop_command_of_the_home_page_trains(tmp_path):
    # The one line the home page gives for a first try, run
    # as it is, with no GPU and no launcher.
    index = (ROOT / "docs" / "index.md").read_text()
    [command] = re.findall(r"^python main\.py --synthetic-data .*$", index, re.M)
    env = base_env()
    del env["TRAIN_ON_CPU"]  # a laptop without a GPU trains on its CPU unasked
    # In a copy of the folder, as a reader has it: the run writes its checkpoints there.
    shutil.copytree(EXAMPLES_DIR / NAME, tmp_path / "template")
    result = subprocess.run(
        [sys.executable, *command.split()[1:]],
        cwd=tmp_path / "template",
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


def test_the_adapt_pages_laptop_lines_stop_and_resume(tmp_path):
    # The adapt page's two lines, run as written with bash, in a copy of the template's
    # folder: 4 processes under torchrun, stopped by the kill line, then started again.
    train = page_command("adapt.md", "OMP_NUM_THREADS=1 torchrun")
    stop = page_command("adapt.md", "kill -TERM")
    env = base_env()
    del env["TRAIN_ON_CPU"]  # a laptop without a GPU trains on its CPU unasked
    # The reader's environment is active: torchrun is on the PATH.
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    folder = tmp_path / "template"
    shutil.copytree(EXAMPLES_DIR / NAME, folder)
    log = tmp_path / "first.log"
    with open(log, "w") as out:
        first = subprocess.Popen(
            ["bash", "-c", train], cwd=folder, env=env, stdout=out, stderr=out
        )
        try:
            deadline = time.monotonic() + 180
            while "step 5 |" not in log.read_text():
                assert first.poll() is None and time.monotonic() < deadline, (
                    log.read_text()
                )
                time.sleep(0.1)
            subprocess.run(["bash", "-c", stop], cwd=folder, env=env, check=True)
            first.wait(timeout=60)
        finally:
            first.kill()
    stopped = log.read_text()
    assert len(re.findall(r"\[(\d)/4\] Stopped at step (\d+)", stopped)) == 4, stopped
    assert "summary:" not in stopped, stopped
    # What the page tells the reader to expect of torchrun itself, read from the page:
    # its exit status, and the last line of its traceback.
    page = " ".join((DOCS / "adapt.md").read_text().split())
    said = re.search(
        r"torchrun itself ends with exit status (\d+) and a traceback that ends in "
        r"`(SignalException: Process) … (got signal: \d+)`",
        page,
    )
    assert said, "adapt.md no longer says how torchrun ends"
    assert first.returncode == int(said[1]), stopped
    assert re.search(rf"{said[2]} \d+ {said[3]}\s*$", stopped), stopped
    again = subprocess.run(
        ["bash", "-c", train], cwd=folder, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    output = again.stdout + again.stderr
    assert again.returncode == 0, output
    assert re.search(r"Resumed from \S+ at step \d+", output), output
    # The 4 processes print at once: a line may hold more than one summary.
    summaries = parse_summaries(output)
    assert sorted(s["rank"] for s in summaries) == [0, 1, 2, 3], output
    # 320 images, 4 processes of 8: 10 steps an epoch, 2 epochs.
    assert all(s["finished"] and s["steps"] == 20 for s in summaries), summaries


def handed_records(output: str) -> list[tuple]:
    """What hand_on() got, as the copy below prints it: kind, step and the numbers
    that do not depend on time."""
    timed = {"samples_per_s", "total_samples_per_s", "data_wait"}
    records = decode_records(output, "handed: ")
    return [
        (r.pop("kind"), r.pop("step"), {k: v for k, v in r.items() if k not in timed})
        for r in records
    ]


def test_a_run_in_steps_stopped_in_a_mid_epoch_validation_resumes_exactly(tmp_path):
    # A run of --train-steps 12 that validates every 6 steps, far from any epoch's end,
    # on 2 processes under torchrun with a DataLoader worker each, and hand_on() made
    # to print what it gets, as a reader's own code would take it. SIGTERM to torchrun
    # (which passes it on) once the validation of step 6 has begun: the run saves and
    # stops; run again, it validates step 6 first, then goes on. Its records and its
    # final checkpoint are the uninterrupted run's.
    folder = tmp_path / "template"
    shutil.copytree(EXAMPLES_DIR / NAME, folder)
    main = folder / "main.py"
    source = main.read_text()
    # The body that a reader writes under hand_on()'s docstring.
    hook = re.search(r'\ndef hand_on\(.*?""".*?"""\n', source, re.S)
    assert hook, "main.py has no hand_on() with a docstring"
    main.write_text(source.replace(hook[0], hook[0] + (
        '    print("handed: " + json.dumps({"kind": kind, "step": step, **numbers}), '
        "flush=True)\n"
    )))  # fmt: skip
    # 800 validation images of 64 px: a validation of a second or two, long enough
    # for the signal to land in it.
    args = [
        "--synthetic-data", "--synthetic-size", "40000", "--synthetic-classes", "10",
        "--model", "resnet18", "--image-size", "64", "--batch-size", "8",
        "--train-steps", "12", "--eval-every", "6", "--warmup-steps", "2",
        "--log-every", "3", "--num-workers", "1", "--min-learning-rate", "1e-4",
    ]  # fmt: skip
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node=2", "main.py", *args]  # fmt: skip

    def run(name: str, **popen) -> subprocess.Popen:
        env = {**base_env(), "CHECKPOINT_DIR": str(tmp_path / name)}
        return subprocess.Popen(torchrun, cwd=folder, env=env, **popen)

    plain = run("plain", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    plain_output = plain.communicate(timeout=300)[0]
    assert plain.returncode == 0, plain_output
    log = tmp_path / "stopped.log"
    with open(log, "w") as out:
        first = run("stopped", stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 180
            while "Epoch 0, step 6: validation" not in log.read_text():
                assert first.poll() is None and time.monotonic() < deadline, (
                    log.read_text()
                )
                time.sleep(0.02)
            first.send_signal(signal.SIGTERM)
            first.wait(timeout=60)
        finally:
            first.kill()
    stopped = log.read_text()
    assert stopped.count("Stopped at step 6, checkpoint saved") == 2, stopped
    assert "Step 6: val loss" not in stopped, stopped
    second = run("stopped", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    resumed = second.communicate(timeout=300)[0]
    assert second.returncode == 0, resumed
    assert re.search(r"Resumed from \S+ at step 6\b", resumed), resumed
    # The validation that the stop cut short comes first, then training goes on.
    assert resumed.index("Step 6: val loss") < resumed.index("step 9 |"), resumed
    whole = handed_records(plain_output)
    assert [(kind, step) for kind, step, _ in whole] == [
        ("train", 3), ("train", 6), ("val", 6), ("train", 9), ("train", 12),
        ("val", 12),
    ]  # fmt: skip
    assert handed_records(stopped) + handed_records(resumed) == whole
    # The 2 processes share a stdout: a line may hold both summaries.
    summaries = parse_summaries(resumed)
    assert [s["finished"] and s["steps"] == 12 for s in summaries] == [True, True]
    assert_bitwise_equal(
        load_checkpoint(tmp_path / "stopped"), load_checkpoint(tmp_path / "plain")
    )


def test_benchmark_reports_both_rates_for_each_row(tmp_path):
    tinyimagenet.make_folders(tmp_path / "images")
    csv_file = tmp_path / "bench.csv"
    # Two CPUs for the process, whatever this machine has: one DataLoader worker.
    env = {**base_env(), "SLURM_CPUS_PER_TASK": "2"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "tools" / "bench.py"), "--steps", "3",
         "--csv", str(csv_file), "--", "--model", "resnet18", "--image-size", "32",
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
    # Every option the rows pass is one that main.py takes.
    example = load_main(NAME)
    for _, args, _ in rows:
        example.parse_args(args)


def test_the_language_model_section_is_all_a_reader_changes(tmp_path):
    folder = write_language_model_template(tmp_path / "lm")
    old = (EXAMPLES_DIR / NAME / "main.py").read_text().splitlines()
    new = (folder / "main.py").read_text().splitlines()
    changed = [line[2:] for line in difflib.ndiff(old, new) if line[:2] in ("- ", "+ ")]
    image_section = section((EXAMPLES_DIR / NAME / "main.py").read_text())
    lm_section = section((EXAMPLES_DIR / NAME / "language_model.py").read_text())
    outside = [
        line
        for line in changed
        if line.strip() and line not in image_section and line not in lm_section
    ]
    assert outside == ["import numpy as np"], outside


def test_a_dataloader_worker_gets_the_token_files_path_not_its_tokens(
    tmp_path, process_group
):
    # Under the fork server, each worker gets the dataset pickled: a pickled np.memmap
    # is a copy of the whole file, in every worker of every rank.
    section = load_main(NAME, file="language_model.py")
    data = write_token_files(tmp_path, train_sequences=20_000, val_sequences=1)
    dataset = section.TokenFile(data / "train.bin", 17, 64, "uint16")
    size = (data / "train.bin").stat().st_size
    pickled = pickle.dumps(dataset)
    assert size > 600_000 and len(pickled) < 1_000, (size, len(pickled))
    copy = pickle.loads(pickled)
    assert len(copy) == len(dataset) == 20_000
    assert torch.equal(copy[123], dataset[123])


# The template's language model section, and the FSDP2 step, read token files alike.
def token_files_args(name: str, folder: Path, *more: str):
    common = ["--seq-len", "16", "--data-dir", str(folder), *more]
    if name == "generic/fsdp":
        return load_main(name), load_main(name).parse_args(common)
    section = load_main(NAME, file="language_model.py")
    parser = argparse.ArgumentParser()
    section.add_arguments(parser)
    return section, parser.parse_args(common)


@pytest.mark.parametrize("name", [NAME, "generic/fsdp"])
def test_token_files_are_read_with_the_vocabularys_integer_type(
    tmp_path, process_group, name
):
    # Llama 3's vocabulary, 128,256 ids, needs files of uint32. Read as uint16, each id
    # would be two other tokens, all within the vocabulary: training would go on, on
    # garbage, without a word.
    ids = np.arange(100_000, 100_000 + 40 * 16 + 1, dtype=np.uint32)
    for split in ("train.bin", "val.bin"):
        ids.tofile(tmp_path / split)
    module, args = token_files_args(name, tmp_path, "--vocab-size", "128256")
    train, _, classes = module.make_datasets(args)
    assert classes == 128_256 and len(train) == 40
    assert torch.equal(train[1], torch.from_numpy(ids[16:33].astype(np.int64)))
    # GPT-2's 50,304 fit uint16, nanoGPT's files; a type too small is refused, and so is
    # a file of uint32 ids that fit uint16 too, read as uint16.
    assert module.token_dtype(50_304, None) == "uint16"
    (ids - 60_000).tofile(tmp_path / "train.bin")
    _, args = token_files_args(name, tmp_path, "--vocab-size", "50304")
    with pytest.raises(SystemExit, match="as in a file of uint32 ids read as uint16"):
        module.make_datasets(args)
    _, args = token_files_args(name, tmp_path, "--vocab-size", "128256",
                               "--token-dtype", "uint16")  # fmt: skip
    with pytest.raises(SystemExit, match="ids up to 128255, more than --token-dtype"):
        module.make_datasets(args)


def peak_gib(section, args, bf16: bool) -> float:
    """The most memory that the tensors of one training step of the section's model hold
    at once, in GiB: counted on fake tensors (torch's MemTracker), so no memory is used
    and nothing is computed. CUDA's own workspaces and cache come on top on a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    with FakeTensorMode():
        model = section.build_model(args, args.vocab_size)
        optimizer = torch.optim.AdamW(model.parameters())
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        with tracker:
            tokens = torch.randint(args.vocab_size, (args.batch_size, args.seq_len + 1))
            inputs, target = section.to_device(tokens, torch.device("cpu"))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = section.loss_fn(model(inputs), target)
            loss.backward()
            optimizer.step()
        peak = tracker.get_tracker_snapshot("peak")
    return max(device["Total"] for device in peak.values()) / 2**30


def test_the_language_models_default_batch_fits_a_24_gb_gpu():
    # The section's defaults: a GPT-2-sized model (124 million parameters) on 1,024
    # tokens a sequence, 8 sequences a step. Counted, under 12 GiB in bf16 and in
    # float32 (GPUs without bf16): room on a GPU of 24 GB. The image section's
    # default, 128, would need more than an 80 GB GPU has.
    section = load_main(NAME, file="language_model.py")
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=128)  # as main.py adds it
    section.add_arguments(parser)
    args = parser.parse_args([])
    assert args.batch_size == 8
    for bf16 in (True, False):
        assert peak_gib(section, args, bf16) < 12
    args.batch_size = 128
    assert peak_gib(section, args, bf16=True) > 80


def test_the_variables_that_setup_sets_do_not_outlive_their_test():
    # Runs after the test above (pytest keeps the file's order).
    assert not {"RANK", "LOCAL_RANK", "WORLD_SIZE"} & set(os.environ)
