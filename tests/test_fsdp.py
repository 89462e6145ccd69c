"""The FSDP2 example: right against a single process,
sharded, and resumable on any world size.

Direct runs without Slurm, on CPUs with gloo, as in smoke.py. test_failures.py stops and
requeues the example under the real Slurm test cluster.
"""

import csv
import dataclasses
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from smoke import (
    EXAMPLES,
    Launch,
    assert_bitwise_equal,
    base_env,
    check_run,
    decode_records,
    free_port,
    load_main,
    load_sharded_checkpoint,
    numbers,
    run_example,
    srun_env,
    wait_all,
)

NAME = "generic/fsdp"
TESTS = Path(__file__).resolve().parent
ARGS = EXAMPLES[NAME].args
# fsdp_steps.py runs the example from a module that DataLoader workers cannot import.
ONE_EPOCH = (*ARGS, "--epochs", "1", "--num-workers", "0")


def layout(world_size: int) -> Launch:
    return dataclasses.replace(EXAMPLES[NAME], nodes=world_size)


def record_steps(world_size: int, tmp_path: Path, **env) -> list[dict]:
    """Runs an epoch of the example on `world_size` ranks;
    returns each step's full state."""
    launch, port = layout(world_size), free_port()
    out = tmp_path / f"steps-{world_size}.pt"
    procs, logs = [], [tmp_path / f"rank{rank}.log" for rank in range(world_size)]
    for rank, log in enumerate(logs):
        proc_env = {**base_env(), **srun_env(rank, launch, tmp_path, port), **env}
        proc_env["CHECKPOINT_DIR"] = str(tmp_path / f"checkpoints-{world_size}")
        with log.open("w") as output:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(TESTS / "helpers" / "fsdp_steps.py"),
                        str(out),
                        *ONE_EPOCH,
                    ],
                    cwd=tmp_path,
                    env=proc_env,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                )
            )
    codes = wait_all(procs, timeout=180)
    assert codes == [0] * world_size, "\n".join(log.read_text() for log in logs)
    return torch.load(out, weights_only=True)


def largest_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """The reference: the same model with the same initial weights, without FSDP2."""
    return record_steps(1, tmp_path_factory.mktemp("single"), FSDP_REFERENCE="1")


@pytest.mark.parametrize("world_size", [2, 3])
def test_gradients_and_weights_match_a_single_process(
    tmp_path, single_process, world_size
):
    # The same global batches on 1 and on N processes: FSDP2 must give the same mean
    # gradient, and so the same weights, up to the order in which float32 sums are
    # added. Measured: up to 3.0e-8 for gradients, and 5.9e-7 for weights. Adam
    # makes the weights' the larger: it divides each gradient by its own size, so where
    # one is near its eps (1e-8), a rounding difference of 1e-11 in it moves that weight
    # by up to 1e-6 a step. A step moves weights by about 1e-3.
    sharded = record_steps(world_size, tmp_path)
    assert len(sharded) == len(single_process) == 8
    worst = {"gradients": 0.0, "weights": 0.0}
    for step, (mine, reference) in enumerate(zip(sharded, single_process, strict=True)):
        scale = max(g.abs().max().item() for g in reference["grads"].values())
        assert scale > 1e-4, "gradients vanished: the comparison would prove nothing"
        grads = largest_difference(mine["grads"], reference["grads"])
        params = largest_difference(mine["params"], reference["params"])
        assert grads <= 1e-5 * scale, (
            f"step {step + 1}: gradients differ by {grads:.2e}"
        )
        assert params <= 1e-5, f"step {step + 1}: weights differ by {params:.2e}"
        worst = {
            "gradients": max(worst["gradients"], grads),
            "weights": max(worst["weights"], params),
        }
    print(f"{world_size} processes, largest differences: {worst}")


def test_gradients_summed_instead_of_averaged_are_caught(tmp_path, single_process):
    # The bug class of pytorch#162338, where gloo summed what FSDP2
    # asked it to average. AdamW hides it in the weights (its steps
    # hardly depend on the gradient's scale), so the test above compares
    # the gradients themselves: they must come out twice too large here.
    summed = record_steps(2, tmp_path, FSDP_AVG_AS_SUM="1")
    first, reference = summed[0]["grads"], single_process[0]["grads"]
    for name in reference:
        torch.testing.assert_close(
            first[name], 2 * reference[name], rtol=1e-5, atol=1e-8
        )
    with pytest.raises(AssertionError):
        torch.testing.assert_close(first, reference, rtol=1e-5, atol=1e-8)


# Long enough to be stopped in the middle: 2 epochs of 30 steps, the loss logged every
# step. The stop comes after one of the first 15, well before the end. Micro-batches of
# 4 sequences: 3 per step on 2 processes, 2 on 3. A checkpoint every 5 steps, written in
# the background.
LONG_ARGS = (*ARGS, "--synthetic-size", "360", "--log-every", "1",
             "--micro-batch-size", "4", "--checkpoint-every-steps", "5")  # fmt: skip


def step_losses(output: str) -> dict[int, float]:
    return {
        int(step): float(loss)
        for step, loss in re.findall(r"epoch \d+ step (\d+) \| loss (\S+) \|", output)
    }


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """A whole run on 2 processes, and the folder of its checkpoints."""
    checkpoints = tmp_path_factory.mktemp("plain")
    run = run_example(
        NAME, layout(2), LONG_ARGS, env={"CHECKPOINT_DIR": str(checkpoints)}
    )
    assert run.ok, run.output
    return run, checkpoints


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    """A run on 3 processes stopped at a random step, then resumed on 2, as a job that
    lost a node: the step, the resumed run, and the folder of its checkpoints."""
    checkpoints = tmp_path_factory.mktemp("resharded")
    env = {"CHECKPOINT_DIR": str(checkpoints)}
    stopped = run_example(
        NAME, layout(3), LONG_ARGS, env=env, while_running=stop_after_a_random_step
    )
    assert stopped.ok, stopped.output
    assert "Global batch: 4 x 2 micro-batches x 3 processes = 24" in stopped.output
    stops = re.findall(r"Stopped at step (\d+), checkpoint saved", stopped.output)
    assert len(stops) == 3 and len(set(stops)) == 1, stopped.output
    resumed = run_example(NAME, layout(2), LONG_ARGS, env=env)
    assert "Global batch: 4 x 3 micro-batches x 2 processes = 24" in resumed.output
    assert resumed.ok, resumed.output
    return int(stops[0]), resumed, checkpoints


def stop_after_a_random_step(procs, logs: list[Path]):
    """SIGTERM to rank 1 once rank 0 has logged a step
    drawn at random, as preemption does."""
    step = random.randint(3, 15)
    deadline = time.monotonic() + 120
    while f" step {step} |" not in logs[0].read_text() and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(procs[1].pid, signal.SIGTERM)


def test_each_rank_holds_its_share_of_the_model_and_optimizer(uninterrupted, resharded):
    total = sum(p.numel() for p in full_model().parameters())
    for run in (uninterrupted[0], resharded[1]):
        world_size = run.launch.world_size
        shards = sorted(decode_records(run.output, "shards: "), key=lambda s: s["rank"])
        assert [s["rank"] for s in shards] == list(range(world_size)), run.output
        # Counted from each rank's own shards: together the
        # whole model, each about 1/N of it.
        assert sum(s["parameters"] for s in shards) == total
        for s in shards:
            assert (
                abs(s["parameters"] - total / world_size) <= 0.05 * total / world_size
            ), s
            # AdamW's two moments, sharded like the parameters.
            assert s["optimizer_state"] == 2 * s["parameters"], s


def full_model():
    fsdp = load_main(NAME)
    args = fsdp.parse_args(list(ARGS))
    with torch.device("meta"):
        return fsdp.TinyLM(
            args.vocab_size, args.seq_len, args.dim, args.heads, args.layers
        )


def test_a_checkpoint_of_3_processes_resumes_on_2(uninterrupted, resharded):
    # DCP reshards on loading, and the global batches do not depend on
    # the number of processes: training goes on as on 2 processes, up
    # to the order of float32 sums. (Exact resumption on the same
    # number of processes is tested under Slurm, in test_failures.py.) The log's losses
    # have 4 decimals; the summaries' last loss and validation are whole floats.
    plain, plain_checkpoints = uninterrupted
    step, resumed, checkpoints = resharded
    assert f"at step {step}, resharded from 3 processes" in resumed.output, (
        resumed.output
    )
    expected, got = step_losses(plain.output), step_losses(resumed.output)
    assert sorted(got) == list(range(step + 1, max(expected) + 1))
    worst = max(abs(got[s] - expected[s]) for s in got)
    assert worst <= 2e-4, f"losses after resharding differ by up to {worst:.2e}"
    mine, theirs = resumed.summaries[0], plain.summaries[0]
    for key in ("last_loss", "val_loss", "val_accuracy"):
        assert mine[key] == pytest.approx(theirs[key], abs=1e-5), key
    assert mine["val_samples"] == theirs["val_samples"] == 36
    mine = load_sharded_checkpoint(checkpoints)
    theirs = load_sharded_checkpoint(plain_checkpoints)
    weights = max(
        (mine["model"][k] - theirs["model"][k]).abs().max().item()
        for k in mine["model"]
    )
    assert weights <= 1e-5, f"weights differ by {weights:.2e}"
    print(f"3 -> 2 at step {step}: losses within {worst:.1e}, weights {weights:.1e}")


def test_a_killed_run_resumes_from_its_newest_checkpoint(tmp_path, uninterrupted):
    # SIGKILL to every rank, as a node crash or an OOM kill ends a job: no signal to
    # catch, no save at the end. Killed at an unplanned step once a checkpoint written
    # in the background is complete, the run resumes from the newest one, and ends
    # bitwise equal to the uninterrupted run, which saved at the same steps.
    def kill_every_rank(procs, logs: list[Path]):
        deadline = time.monotonic() + 120
        while "Saved " not in logs[0].read_text() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(random.uniform(0.0, 0.5))
        for proc in procs:
            proc.send_signal(signal.SIGKILL)

    env = {"CHECKPOINT_DIR": str(tmp_path)}
    killed = run_example(
        NAME, layout(2), LONG_ARGS, env=env, while_running=kill_every_rank
    )
    assert killed.returncodes == [-signal.SIGKILL] * 2, killed.output
    assert "checkpoint saved" not in killed.output
    newest = load_main(NAME).readable_checkpoint(tmp_path)
    step = int(newest.name.split("-")[-1])
    assert step > 0 and step % 5 == 0, newest
    resumed = run_example(NAME, layout(2), LONG_ARGS, env=env)
    assert resumed.ok, resumed.output
    assert f"Resumed from {newest} at step {step}, in " in resumed.output
    plain, plain_checkpoints = uninterrupted
    assert_bitwise_equal(
        load_sharded_checkpoint(tmp_path), load_sharded_checkpoint(plain_checkpoints)
    )
    assert numbers(resumed.summaries) == numbers(plain.summaries)
    print(f"killed after the checkpoint of step {step}: final state bitwise equal")


# Makes the sync of a checkpoint file fail with ENOSPC, as a full disk or quota does
# (tests/helpers/faults/sitecustomize.py).
FAULTS = {"PYTHONPATH": str(Path(__file__).parent / "helpers" / "faults")}


def test_a_background_save_that_fails_is_logged_and_the_next_one_saves(
    tmp_path, uninterrupted
):
    # The save of step 10, written in the background, fails on every rank. Each logs
    # its cause; training goes on; the save of step 15 is made; the run ends bitwise
    # equal to one whose saves all worked, and leaves no part of the failed one.
    env = {**FAULTS, "FAIL_SAVE": "step-00000010", "CHECKPOINT_DIR": str(tmp_path)}
    run = run_example(NAME, layout(2), LONG_ARGS, env=env)
    assert run.ok, run.output
    for rank in (0, 1):
        assert re.search(
            rf"\[{rank}/2\] Could not save \S+step-00000010: .*No space left on device",
            run.output,
        ), run.output
    saved = re.findall(r"Saved \S+-step-(\d+)", run.output)
    assert "00000010" not in saved and "00000015" in saved, saved
    assert not list(tmp_path.glob("*.tmp")), "a failed save left a folder behind"
    plain, plain_checkpoints = uninterrupted
    assert numbers(run.summaries) == numbers(plain.summaries)
    assert_bitwise_equal(
        load_sharded_checkpoint(tmp_path), load_sharded_checkpoint(plain_checkpoints)
    )


def test_a_save_replaces_a_damaged_checkpoint_of_its_name(tmp_path):
    # A run saves at steps 5 and 10, then the checkpoint of step 10 loses a file. The
    # next run passes over it, resumes from step 5, and saves step 10 again: the new
    # save must replace the damaged folder, not be dropped for it.
    env = {"CHECKPOINT_DIR": str(tmp_path)}
    args = (*LONG_ARGS, "--max-steps", "10")
    first = run_example(NAME, layout(2), args, env=env)
    assert first.ok, first.output
    damaged = load_main(NAME).readable_checkpoint(tmp_path)
    assert damaged.name.endswith("step-00000010"), damaged
    (damaged / "__1_0.distcp").unlink()
    again = run_example(NAME, layout(2), args, env=env)
    assert again.ok, again.output
    assert f"Passing over {damaged}, which lacks __1_0.distcp" in again.output
    assert "at step 5" in again.output
    assert f"Replacing {damaged}, which lacks __1_0.distcp" in again.output
    assert load_main(NAME).missing_files(damaged) == []


def test_a_trial_with_max_steps_is_continued_by_the_real_run(tmp_path, uninterrupted):
    # --max-steps stops part-way, as a signal would, and says so; a run without it in
    # the same folder goes on to the end, bitwise as the uninterrupted run.
    env = {"CHECKPOINT_DIR": str(tmp_path)}
    trial = run_example(NAME, layout(2), (*LONG_ARGS, "--max-steps", "7"), env=env)
    assert trial.ok, trial.output
    assert "Stopped by --max-steps 7 after step 7, with 0 of 2 epochs done" in (
        trial.output
    )
    assert [s["finished"] for s in trial.summaries] == [False, False]
    real = run_example(NAME, layout(2), LONG_ARGS, env=env)
    assert real.ok, real.output
    assert re.search(r"Resumed from \S+ at step 7, in ", real.output), real.output
    plain, plain_checkpoints = uninterrupted
    assert_bitwise_equal(
        load_sharded_checkpoint(tmp_path), load_sharded_checkpoint(plain_checkpoints)
    )
    assert numbers(real.summaries) == numbers(plain.summaries)


def run_fails(
    tmp_path: Path, *args: str, world_size: int = 2, checkpoints: Path | None = None
):
    """Runs the example, which must fail on every rank
    without training; returns its output."""
    env = {"CHECKPOINT_DIR": str(checkpoints or tmp_path / "checkpoints")}
    run = run_example(NAME, layout(world_size), (*ARGS, *args), env=env, timeout=60)
    assert all(code != 0 for code in run.returncodes), run.output
    assert " step 1 |" not in run.output and not run.summaries, run.output
    return re.sub(r"\s+", " ", run.output)


@pytest.mark.parametrize(
    ("args", "world_size", "message"),
    [
        (("--dim", "30", "--heads", "4"), 2, "--dim 30 does not divide into --heads 4"),
        (
            ("--global-batch-size", "13"),
            2,
            "--global-batch-size 13 does not divide among 2 processes. Choose a "
            "multiple of 2",
        ),
        (("--global-batch-size", "200"), 2, "is more than the 192 sequences"),
        (
            ("--global-batch-size", "12", "--micro-batch-size", "4"),
            2,
            "--micro-batch-size 4 does not divide the 6 sequences that each of 2 "
            "processes takes of --global-batch-size 12. Choose a divisor of 6.",
        ),
        (("--synthetic-size", "10"), 2, "--global-batch-size 24 is more than the 10"),
    ],
)
def test_a_model_or_batch_that_does_not_divide_stops_with_the_cause(
    tmp_path, args, world_size, message
):
    assert message in run_fails(tmp_path, *args, world_size=world_size)


def test_a_checkpoint_of_another_model_is_refused(tmp_path, uninterrupted):
    _, checkpoints = uninterrupted
    copy = tmp_path / "copy"
    shutil.copytree(checkpoints, copy)
    output = run_fails(
        tmp_path, "--synthetic-size", "360", "--layers", "3", checkpoints=copy
    )
    assert "belongs to a run with other settings (--layers 2 -> 3)" in output


def test_a_checkpoint_missing_a_shard_is_refused(tmp_path, uninterrupted):
    # What a checkpoint folder on a node's own disk looks like from the first node: the
    # shard files of the other nodes' ranks are not there.
    _, checkpoints = uninterrupted
    copy = tmp_path / "copy"
    shutil.copytree(checkpoints, copy)
    for kept in copy.iterdir():  # every checkpoint kept
        (kept / "__1_0.distcp").unlink()
    folder = max(copy.iterdir())  # the newest, which the error names
    output = run_fails(tmp_path, "--synthetic-size", "360", checkpoints=copy)
    assert f"the checkpoint {folder} lacks __1_0.distcp" in output
    assert "storage that every node sees" in output


def test_trains_on_files_of_token_ids(tmp_path):
    # The same counting sequences as the synthetic data, written as nanoGPT's scripts
    # write token ids: uint16, one after the other, in train.bin and val.bin.
    tokens = (torch.arange(96 * 17) * 3 % 64).to(torch.int16).numpy().astype("uint16")
    data = tmp_path / "tokens"
    data.mkdir()
    tokens.tofile(data / "train.bin")
    tokens[: 9 * 16 + 1].tofile(data / "val.bin")  # 9 sequences of 16 + 1 tokens
    args = [a for a in ARGS if a != "--synthetic-data"]
    env = {"CHECKPOINT_DIR": str(tmp_path / "checkpoints"), "DATA_DIR": str(data)}
    launch = dataclasses.replace(layout(2), val_samples=9)
    run = run_example(NAME, launch, tuple(args), env=env)
    assert check_run(run) == [], run.output
    assert run.summaries[0]["last_loss"] < run.summaries[0]["first_loss"]
    # A single token id past the vocabulary stops every
    # rank before training, with both numbers.
    tokens[1000] = 64
    tokens.tofile(data / "train.bin")
    env["CHECKPOINT_DIR"] = str(tmp_path / "again")
    run = run_example(NAME, layout(2), tuple(args), env=env, timeout=60)
    assert all(code != 0 for code in run.returncodes), run.output
    output = re.sub(r"\s+", " ", run.output)
    assert output.count("holds token id 64, and --vocab-size is 64") == 2, output
    # A folder without the files says what it must hold.
    (data / "val.bin").unlink()
    run = run_example(NAME, layout(2), tuple(args), env=env, timeout=60)
    output = re.sub(r"\s+", " ", run.output)
    assert output.count(f"error: {data} has no val.bin") == 2, output
    assert "train.bin and val.bin (nanoGPT's format)" in output


def test_validation_runs_as_many_forwards_on_every_rank():
    # 13 validation sequences over 3 processes, 4 a batch: shards of 5, 4 and 4, so
    # rank 0 has 2 batches and the others 1. Every forward gathers from all ranks: the
    # others must run one more, uncounted, or rank 0 waits for them forever.
    launch = dataclasses.replace(layout(3), val_samples=13)
    args = (*ARGS, "--synthetic-size", "130", "--global-batch-size", "12")
    run = run_example(NAME, launch, args, timeout=120)
    assert check_run(run) == [], run.output


def test_weights_are_drawn_per_kind_and_buffers_refused():
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    fsdp = load_main(NAME)
    with pytest.raises(SystemExit, match=r"has buffers \(running_mean, running_var"):
        fsdp.init_weights(nn.BatchNorm1d(4), seed=0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))
        fully_shard(model)
        model.to_empty(device="cpu")
        fsdp.init_weights(model, seed=0)
        linear, norm = (module for module in model)
        assert torch.equal(linear.bias.full_tensor(), torch.zeros(64))
        assert torch.equal(norm.weight.full_tensor(), torch.ones(64))
        assert torch.equal(norm.bias.full_tensor(), torch.zeros(64))
        assert linear.weight.full_tensor().std().item() == pytest.approx(0.02, rel=0.1)
    finally:
        dist.destroy_process_group()


def test_benchmark_times_the_sharded_step_on_every_rank():
    run = run_example(NAME, layout(2), (*ARGS, "--benchmark", "2"), timeout=120)
    assert run.ok, run.output
    records = sorted(decode_records(run.output, "benchmark: "), key=lambda r: r["rank"])
    assert [r["rank"] for r in records] == [0, 1], run.output
    for record in records:
        # Each rank's share of the global batch of 24, sequences of 16 tokens.
        assert record["batch_size"] == 12 and record["seq_len"] == 16
        assert record["input_samples_per_s"] > 0 and record["step_samples_per_s"] > 0


def test_the_memory_table_on_the_page_is_what_the_script_measures():
    table = TESTS.parent / "docs" / "fsdp-memory.csv"
    result = subprocess.run(
        [sys.executable, str(TESTS.parent / "docs" / "snippets" / "fsdp_memory.py")],
        env=base_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout == table.read_text(), (
        "run the script again, into docs/fsdp-memory.csv"
    )
    rows = {(r["Processes"], r["Strategy"]): r for r in csv.DictReader(table.open())}

    def total(processes, strategy):
        return float(rows[processes, strategy]["Total (MiB)"])

    for processes in ("1", "2", "4"):
        # DDP holds everything everywhere; FSDP2 splits it,
        # to within a shard's rounding.
        assert total(processes, "DDP") == total("1", "DDP")
        assert (
            abs(total(processes, "FSDP2") - total("1", "DDP") / int(processes)) <= 0.2
        )


RESET_ON_SHARDS = """import sys
import torch, torch.distributed as dist, torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

def run(rank, store, out):
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2
    )
    with torch.device("meta"):
        layer = torch.nn.Linear(4, 8)
    fully_shard(layer, mesh=init_device_mesh("cpu", (2,)))
    layer.to_empty(device="cpu")
    torch.manual_seed(0)
    layer.reset_parameters()
    weight = layer.weight.full_tensor()
    if rank == 0:
        torch.save(weight, out)
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1], sys.argv[2]), nprocs=2)
"""


def test_a_modules_own_reset_parameters_repeats_its_shards_on_cpus(tmp_path):
    # fsdp.md: why init_weights() draws whole parameters. A Linear's own
    # reset_parameters() on 2 CPU shards draws the same values on each: the 8 x 4
    # weight is its first 4 rows twice.
    script = tmp_path / "reset.py"
    script.write_text(RESET_ON_SHARDS)
    out = tmp_path / "weight.pt"
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "store"), str(out)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    weight = torch.load(out)
    assert torch.equal(weight[:4], weight[4:]) and not torch.equal(weight[0], weight[1])
