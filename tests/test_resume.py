"""The checkpointing examples, stopped part-way and started again, end as if never stopped.

These are direct smoke runs, without Slurm: one rank gets SIGTERM during training, all ranks
stop after the same step, and a second run resumes from the checkpoint. The Slurm tests
(test_failures.py) do the same through real requeues.
"""

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from smoke import EXAMPLES, assert_bitwise_equal, numbers, run_example, unwrapped

# Long enough to be stopped in the middle: several steps per epoch, two epochs.
ARGS = {
    "mila/checkpointing": (
        "--synthetic-data", "--synthetic-size", "600", "--batch-size", "16", "--epochs", "2",
    ),
    "generic/checkpointing": ("--epochs", "4", "--dataset-size", "8192", "--batch-size", "8"),
}  # fmt: skip
# A line that each example prints once training has begun.
TRAINING = {"mila/checkpointing": "Train epoch 0:", "generic/checkpointing": "epoch 0: mean loss"}


def stop_one_rank(name: str):
    """Sends SIGTERM to rank 1 and its DataLoader workers once training has begun.

    Slurm signals every process of a step, workers included; the other ranks must learn of the
    stop from rank 1.
    """

    def interrupt(procs, logs: list[Path]):
        deadline = time.monotonic() + 120
        while TRAINING[name] not in logs[0].read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        children = subprocess.run(
            ["pgrep", "-P", str(procs[1].pid)], capture_output=True, text=True
        ).stdout.split()
        for pid in [procs[1].pid, *map(int, children)]:
            os.kill(pid, signal.SIGTERM)

    return interrupt


@pytest.mark.parametrize("name", ARGS)
def test_a_stopped_run_resumes_exactly(tmp_path, name):
    launch = EXAMPLES[name]
    plain = run_example(name, launch, ARGS[name], env={"CHECKPOINT_DIR": str(tmp_path / "plain")})
    assert plain.ok, plain.output
    env = {"CHECKPOINT_DIR": str(tmp_path / "stopped")}
    first = run_example(name, launch, ARGS[name], env=env, while_running=stop_one_rank(name))
    assert first.ok, first.output
    stops = re.findall(r"Stopped at step (\d+), checkpoint saved", unwrapped(first.output))
    assert len(stops) == launch.world_size and len(set(stops)) == 1, first.output
    second = run_example(name, launch, ARGS[name], env=env)
    assert second.ok, second.output
    # (The path may be wrapped by rich; the step number is what matters.)
    assert re.search(rf"Resumed from .+ at step {stops[0]}\b", unwrapped(second.output), re.S)
    assert numbers(second.summaries) == numbers(plain.summaries)
    load = lambda run: torch.load(  # noqa: E731
        tmp_path / run / "checkpoint.pt", map_location="cpu", weights_only=True
    )
    assert_bitwise_equal(load("stopped"), load("plain"))
