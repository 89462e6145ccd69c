"""The launchers page's framework examples, Lightning and Accelerate: they train as
step 3 does. And what Lightning's Slurm support does under the real Slurm test cluster:
its requeue at SIGUSR1, which the example replaces, and what a resumed run repeats; the
SIGTERM it bypasses, at which the example saves; its check of --ntasks-per-node; and the
meeting that hangs where Slurm 26.05 runs rank 0 on another node than the first. And,
for `accelerate launch`, where srun's variables are expanded."""

import math
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import JOB_TIMEOUT
from slurm_lab import Lab
from smoke import (
    EXAMPLES_DIR,
    GENERIC_SMOKE_ARGS,
    check_run,
    numbers,
    parse_summaries,
)
from test_failures import (
    EPOCH_END,
    FAIL_FAST,
    checkpoint_dir,
    read,
    restart_when_requeued,
    submit,
    wait_until,
)
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

STEP_3 = "generic/multi_node"
FRAMEWORKS = ["launchers/lightning", "launchers/accelerate"]
LIGHTNING = "launchers/lightning"
READER = "# ---- Your model and data"
TRAINING = "# ---- Training"
slurm = pytest.mark.slurm

# The Lightning jobs that are stopped: 2 nodes x 1 task, as many GPUs per node (the
# Trainer's `devices`), 3 epochs of 16 steps on the site's image folder, cropped and
# flipped at random by 2 DataLoader workers per rank.
ONE_PER_NODE = ["--ntasks-per-node=1", "--gpus-per-node=1"]
STEPS_PER_EPOCH = 16
STEPS = 40  # two epochs and a half
RUN = (
    "--model", "resnet18", "--image-size", "32", "--warmup-steps", "10",
    "--log-every", "4", "--epochs", "3", "--batch-size", "4", "--num-workers", "2",
)  # fmt: skip


def submit_lightning(lab: Lab, workdir: Path, *args: str, options=ONE_PER_NODE) -> str:
    return submit(
        lab, LIGHTNING, *args, workdir=workdir, site="generic", options=options
    )


def test_the_framework_examples_keep_step_3_s_model_and_data():
    def reader_part(name: str) -> str:
        source = (EXAMPLES_DIR / name / "main.py").read_text()
        return source[source.index(READER) : source.index(TRAINING)]

    for name in FRAMEWORKS:
        assert reader_part(name) == reader_part(STEP_3), name


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_the_framework_trains_as_step_3_does(smoke_run, name):
    mine, step_3 = smoke_run(name), smoke_run(STEP_3)
    assert check_run(mine) == [], mine.output
    # Same weights, batches, augmentations and optimizer: on CPUs with gloo, the same
    # numbers to the last bit. (On GPUs, nondeterministic kernels make two runs of one
    # program differ already.)
    assert numbers(mine.summaries) == numbers(step_3.summaries), mine.output


def test_the_tutorial_s_loader_is_refused():
    # The DDP tutorial series' DataLoader: shuffle=True beside a DistributedSampler.
    data = TensorDataset(torch.arange(8))
    sampler = DistributedSampler(data, num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="sampler option is mutually exclusive"):
        DataLoader(data, batch_size=2, shuffle=True, sampler=sampler)


@slurm
@pytest.mark.timeout(1800)  # it may be the first to wait for the checks' jobs
@pytest.mark.parametrize("name", FRAMEWORKS)
def test_the_framework_job_ends_as_step_3_s_job(jobs, name):
    # The jobs of test_slurm.py: job.sh's 2 nodes x 4 tasks, every rank on its node.
    job, step_3 = jobs(name), jobs(STEP_3)
    assert job.ok and step_3.ok, job.output + step_3.output
    mine = parse_summaries(job.output)
    assert len(mine) == 8 and numbers(mine) == numbers(parse_summaries(step_3.output))


@slurm
def test_lightning_requeued_at_sigusr1_resumes_and_repeats_part_of_an_epoch(
    lab, tmp_path
):
    # --max-steps ends training within the last epoch: main() then validates itself.
    args = (*RUN, "--max-steps", str(STEPS))
    twin = submit_lightning(lab, tmp_path / "twin", *args)
    job = submit_lightning(lab, tmp_path / "warned", *args)
    output = tmp_path / "warned" / f"slurm-{job}.out"
    wait_until(lambda: EPOCH_END in read(output), 120, "an epoch of training")
    time.sleep(random.uniform(0.1, 1.5))  # a random moment within the next epoch
    # What #SBATCH --signal=USR1@120 sends before the time limit, to every task.
    subprocess.run(["scancel", "--signal=USR1", job], env=lab.env(), check=True)
    restart_when_requeued(lab, job, restarts=1)
    warned = lab.wait(job, tmp_path / "warned", timeout=300)
    uninterrupted = lab.wait(twin, tmp_path / "twin", timeout=300)
    assert warned.ok and uninterrupted.ok, warned.output + uninterrupted.output

    # Every process stopped at one step, rank 0 left the mark, job.sh requeued the
    # job, and Lightning resumed from the checkpoint.
    text = warned.output
    saved = checkpoint_dir(lab, tmp_path / "warned") / "checkpoint-1.ckpt"
    [stop] = re.findall(
        rf"Stopped at step (\d+) \(SIGUSR1\), checkpoint: {saved}", text
    )
    stop = int(stop)
    assert f"Restored all states from the checkpoint at {saved}" in text, text
    assert torch.load(saved, weights_only=False)["global_step"] == stop

    # The resumed run took as many steps as the uninterrupted one, and its numbers
    # agree across ranks. But it started the interrupted epoch's batches over, and
    # stopped that epoch at its usual count of steps: the batches done before the stop
    # were trained on twice, as many at the epoch's end not at all.
    mine, theirs = parse_summaries(text), parse_summaries(uninterrupted.output)
    assert len(mine) == len(theirs) == 2, text
    assert agree(mine) and agree(theirs)
    assert mine[0]["steps"] == theirs[0]["steps"] == STEPS
    assert mine[0]["first_loss"] == theirs[0]["first_loss"]  # kept by the checkpoint
    if stop % STEPS_PER_EPOCH:
        assert "resuming from a checkpoint that ended before the epoch ended" in text
        assert mine[0]["last_loss"] != theirs[0]["last_loss"], (mine, theirs)
    print(f"Lightning: stopped at step {stop}, resumed; final {mine[0]} vs {theirs[0]}")


def agree(summaries: list[dict]) -> bool:
    """Every rank reports the same numbers, and a finite loss."""
    same = [
        {k: v for k, v in s.items() if k not in ("rank", "host")} for s in summaries
    ]
    return all(s == same[0] for s in same) and math.isfinite(same[0]["last_loss"])


ALONE = Path(__file__).resolve().parent / "helpers" / "lightning_alone" / "job.sh"


@slurm
def test_at_sigterm_alone_lightning_stops_unsaved_and_the_example_saves(lab, tmp_path):
    # A time limit with no --signal, or preemption: Slurm sends SIGTERM alone (scancel
    # sends it here), and SIGKILL KillWait seconds later. Lightning's own Slurm
    # support, on by default, saves nothing and does not requeue the job. Its handler
    # first broadcasts from rank 0, in every process, wherever each one stands. Where
    # they meet, each logs that it bypasses the SIGTERM. Where one stands in another
    # collective (DDP's), both may wait until the group's timeout (30 s here) and
    # fail, or one fails when the other exits: seen here, in CI and by hand. The
    # example saves, and leaves the requeue to Slurm.
    options = ["--nodes=2", *ONE_PER_NODE]
    folder = tmp_path / "alone"
    folder.mkdir()
    alone = lab.sbatch(
        ALONE, "30", "1000000", str(folder), site="generic", workdir=folder,
        options=options,
    )  # fmt: skip
    example = submit_lightning(lab, tmp_path / "example", *RUN)
    started = "SLURM auto-requeueing enabled"
    log = folder / f"slurm-{alone}.out"
    # Both processes' handlers are in place: a SIGTERM before would kill at once.
    wait_until(lambda: read(log).count(started) == 2, 120, "Lightning's start")
    output = tmp_path / "example" / f"slurm-{example}.out"
    wait_until(lambda: EPOCH_END in read(output), 120, "an epoch of training")
    for job in (alone, example):
        subprocess.run(["scancel", "--signal=TERM", job], env=lab.env(), check=True)
    # Room for two of the group's timeouts: a handler may wait in one, then another.
    stopped = lab.wait(alone, folder, timeout=2 * FAIL_FAST)
    # It ended by itself: lab.wait returns a job still running after its timeout too.
    assert stopped.state in ("COMPLETED", "FAILED"), stopped.output
    # The SIGTERM reached Lightning's handler, which logs with the local rank: 0 on
    # each node. (A process blocked in a collective may be killed by srun before its
    # handler runs, once the other has failed.)
    assert "[rank: 0] Received SIGTERM: 15" in stopped.output, stopped.output
    assert "trained:" not in stopped.output, stopped.output
    assert not list(folder.glob("hpc_ckpt_*")), stopped.output
    done = lab.wait(example, tmp_path / "example", timeout=FAIL_FAST)
    saved = checkpoint_dir(lab, tmp_path / "example") / "checkpoint-1.ckpt"
    assert re.search(
        rf"Stopped at step \d+ \(SIGTERM\), checkpoint: {saved}", done.output
    )
    assert saved.exists() and not parse_summaries(done.output), done.output
    assert not (saved.parent / "requeue").exists(), done.output
    for job in (alone, example):
        assert lab.job_info(job).get("Restarts") == "0", job
    bypassed = "Bypassing SIGTERM" in stopped.output
    print(f"Lightning alone: {'Bypassing SIGTERM' if bypassed else 'no bypass line'}, "
          f"ended {stopped.state}; the example saved at SIGTERM")  # fmt: skip


@slurm
def test_lightning_stops_when_tasks_per_node_differ_from_gpus_per_node(lab, tmp_path):
    start = time.monotonic()
    options = ["--ntasks-per-node=2"]  # job.sh's 4 GPUs per node kept
    job = submit_lightning(lab, tmp_path, *GENERIC_SMOKE_ARGS, options=options)
    done = lab.wait(job, tmp_path, timeout=FAIL_FAST)
    assert done.state == "FAILED", done.output
    assert time.monotonic() - start < FAIL_FAST
    message = (
        "You set `devices=4` in Lightning, but the number of tasks per node "
        "configured in SLURM `--ntasks-per-node=2` does not match"
    )
    assert message in re.sub(r"\s+", " ", done.output), done.output


@slurm
@pytest.mark.every_version
@pytest.mark.since_slurm("26.05")
def test_lightning_meets_where_slurm_26_05_runs_rank_0_on_another_node(lab, tmp_path):
    # 2 nodes x 2 tasks: on 26.05, with the test cluster's topology.conf, rank 0 runs
    # on cn2 (test_slurm_versions.py: test_the_node_that_runs_task_0).
    # Lightning alone: rank 0 waits for the others on cn2, and they look for it at
    # MASTER_ADDR, cn1. Given 10 s to meet, it fails; by default it would wait 30 min.
    layout = ["--nodes=2", "--ntasks-per-node=2", "--gpus-per-node=2"]
    (tmp_path / "alone").mkdir()
    alone = lab.sbatch(
        ALONE, "10", "2", str(tmp_path / "alone"), site="generic",
        workdir=tmp_path / "alone", options=layout,
    )  # fmt: skip
    example = submit_lightning(
        lab, tmp_path / "example", *GENERIC_SMOKE_ARGS, options=layout
    )
    hung = lab.wait(alone, tmp_path / "alone", timeout=120)
    assert hung.state == "FAILED" and "trained:" not in hung.output, hung.output
    timed_out = "socket has timed out after 10000ms while trying to connect to (cn1,"
    assert timed_out in hung.output, hung.output
    # The example forms the group first, served by the first task of the first node,
    # and Lightning uses it: every rank trains, rank 0 on cn2.
    done = lab.wait(example, tmp_path / "example", timeout=150)
    assert done.ok, done.output
    hosts = {s["rank"]: s["host"] for s in parse_summaries(done.output)}
    assert len(hosts) == 4 and hosts[0] == "cn2", done.output


@slurm
def test_srun_expands_the_node_id_in_the_task_only_when_quoted(lab, tmp_path):
    # `srun accelerate launch --machine_rank $SLURM_NODEID ...` in the batch script
    # expands it there, once, on the first node: every node gets 0. In single quotes,
    # each task's own shell expands it.
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        "srun bash -c 'echo \"task $SLURM_NODEID\"'\n"
        'srun echo "batch $SLURM_NODEID"\n'
    )
    options = ["--nodes=2", "--ntasks-per-node=1"]
    job = lab.sbatch(script, site=None, workdir=tmp_path, options=options)
    done = lab.wait(job, tmp_path, timeout=FAIL_FAST)
    assert done.ok, done.output
    lines = done.output.split()
    assert sorted(re.findall(r"task \d", done.output)) == ["task 0", "task 1"], lines
    assert re.findall(r"batch \d", done.output) == ["batch 0", "batch 0"], lines


PROBE = """import os, socket
import torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.ones(1)
dist.all_reduce(total)
machine = os.environ["GROUP_RANK"]
print(f"rank {dist.get_rank()} of {dist.get_world_size()}, machine {machine}"
      f" on {socket.gethostname()}: sum {total.item():.0f}", flush=True)
dist.destroy_process_group()
"""


# `accelerate launch` of the probe: 2 machines of 2 processes, at the first node.
LAUNCH = (
    f"{Path(sys.executable).parent / 'accelerate'} launch --multi_gpu --num_machines 2 "
    "--num_processes 4 --machine_rank $SLURM_NODEID --main_process_ip $MASTER_ADDR "
    "--main_process_port 29531 probe.py"
)


def accelerate_job(lab, tmp_path: Path, srun_line: str):
    """A job of a task on each of 2 nodes that runs `srun_line`, the probe beside it."""
    (tmp_path / "probe.py").write_text(PROBE)
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -1)\n'
        "export MASTER_ADDR\n"
        f"export OMP_NUM_THREADS=1\n{srun_line}\n"
    )
    options = ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=2"]
    job = lab.sbatch(script, site=None, workdir=tmp_path, options=options)
    return lab.wait(job, tmp_path, timeout=JOB_TIMEOUT)


@slurm
def test_accelerate_launch_once_per_node_gives_each_node_its_rank(lab, tmp_path):
    # The launchers page's recipe for keeping `accelerate launch`: one task per node,
    # the four settings, and each task's own $SLURM_NODEID, in single quotes. On CPUs:
    # a small program that joins the group over gloo and sums a one from every rank.
    done = accelerate_job(lab, tmp_path, f"srun bash -c '{LAUNCH}'")
    assert done.ok, done.output
    seen = re.findall(r"rank (\d) of 4, machine (\d) on (cn\d): sum 4", done.output)
    assert sorted(int(rank) for rank, _, _ in seen) == [0, 1, 2, 3], done.output
    # Two processes a machine, each machine on its own node.
    machines = {machine: host for _, machine, host in seen}
    assert sorted(machines) == ["0", "1"] and len(set(machines.values())) == 2, seen


@slurm
def test_accelerate_launch_with_the_batch_scripts_node_id_hangs(lab, tmp_path):
    # The troubleshooting page's symptom: $SLURM_NODEID in double quotes is the batch
    # script's, 0 on every node. Both nodes claim machine 0, and no group forms: in
    # twice the time the quoted form takes to train, no rank has summed anything.
    echo = "echo machine $SLURM_NODEID on \\$(hostname)"
    line = f'srun bash -c "{echo}; timeout 20 {LAUNCH}"'
    done = accelerate_job(lab, tmp_path, line)
    assert sorted(re.findall(r"machine (\d) on (cn\d)", done.output)) == [
        ("0", "cn1"),
        ("0", "cn2"),
    ], done.output
    # Killed by the timeout (status 124) on both nodes: no error of its own, no sum.
    assert not done.ok and "sum 4" not in done.output, done.output
    assert len(re.findall(r"task \d: Exited with exit code 124", done.output)) == 2, (
        done.output
    )


# ------------------------------------------------------------
# Why the example's checkpoints are not named hpc_ckpt_<n>.ckpt


@pytest.mark.parametrize("name", ["hpc_ckpt_1.ckpt", "checkpoint-1.ckpt"])
def test_under_slurm_lightnings_validate_loads_an_hpc_ckpt_in_place_of_the_weights(
    tmp_path, monkeypatch, name
):
    # A requeued job under Slurm, as Lightning sees it: the variables of a task, and
    # in the trainer's folder a checkpoint of other weights, under Lightning's own
    # name or under the example's. validate() without ckpt_path loads Lightning's.
    import lightning as L

    for variable, value in {
        "SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_ID": "7",
        "SLURM_JOB_NAME": "classifier", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0", "SLURM_NNODES": "1",
    }.items():  # fmt: skip
        monkeypatch.setenv(variable, value)

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def validation_step(self, batch, index):
            return self.layer(batch[0]).sum()

    saved = Model()
    torch.nn.init.constant_(saved.layer.weight, 7.0)
    trainer = L.Trainer(
        default_root_dir=tmp_path, accelerator="cpu", devices=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.strategy.connect(saved)
    trainer.save_checkpoint(tmp_path / name)
    model = Model()
    torch.nn.init.constant_(model.layer.weight, 1.0)
    loader = DataLoader(TensorDataset(torch.ones(4, 2)), batch_size=2)
    trainer = L.Trainer(
        default_root_dir=tmp_path, accelerator="cpu", devices=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.validate(model, loader, verbose=False)
    loaded = float(model.layer.weight[0, 0])
    # Lightning's name: the checkpoint's weights replaced the model's own.
    assert loaded == (7.0 if name.startswith("hpc_ckpt") else 1.0)
