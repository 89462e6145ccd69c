"""srun_tasks, made to survive preemption and time limits:
checkpoints, resumption, requeue.

Over srun_tasks:
- rank 0 writes a checkpoint atomically at the end of every epoch and whenever the job
  is told to stop. It holds all that is needed to continue exactly: model, optimizer,
  epoch, step, and each rank's random state and partial epoch sums;
- a job that starts again, requeued or resubmitted under
  the same job name, resumes from the latest checkpoint;
- on SIGUSR1, which job.sh asks Slurm to send before the time limit, or
  SIGTERM (preemption, `scancel`, `scontrol requeue`), all ranks stop at
  the same step and rank 0 saves. After SIGUSR1, rank 0 also puts the
  job back in the queue, unless the job would loop (--max-restarts);
- setup() fails fast, with the cause, when the rendezvous
  port is taken or the first node never answers.
"""

import argparse
import gc
import itertools
import json
import os
import signal
import socket
import subprocess
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

# The signal that asked this process to stop, or 0. Signal handlers only note it: the
# training loop acts on it between steps, where every rank can stop at the same point.
stop_signal = 0


def note_stop_signal(signum, frame):
    global stop_signal
    # SIGTERM wins over SIGUSR1: the job is ending anyway, and a requeue would fail.
    stop_signal = max(stop_signal, signum)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--dataset-size", type=int, default=2048)
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=Path(os.environ.get("CHECKPOINT_DIR", "checkpoints")),
        help=(
            "shared storage that outlives the job "
            "(default: $CHECKPOINT_DIR, set by job.sh)"
        ),
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=20,
        help="requeue the job at most this often: a guard against a job that loops",
    )
    parser.add_argument(
        "--rendezvous-timeout",
        type=float,
        default=120,
        help="seconds to wait for every process to join before giving up",
    )
    args = parser.parse_args()

    local_rank, rank, world_size = setup(args.rendezvous_timeout)
    device = get_device(local_rank)
    print(
        f"[{rank}/{world_size}] Running on {socket.gethostname()}, device {device}",
        flush=True,
    )

    dataset = RegressionDataset(args.dataset_size)
    sampler = ResumableSampler(dataset)
    # A DataLoader draws a seed for its workers at the start of every epoch. From a
    # generator of its own, not torch's global one, it leaves the global random state to
    # training, so that the copy of it in a checkpoint continues exactly.
    dataloader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        generator=torch.Generator(),
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 1)
    # Momentum gives the optimizer a state of its own,
    # which the checkpoint must hold too.
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # The settings that shape training: a checkpoint
    # written with others belongs to another run.
    settings = {
        "dataset_size": args.dataset_size,
        "batch_size": args.batch_size,
        "lr": args.lr,
    }
    trainer = Trainer(
        model,
        dataloader,
        optimizer,
        device,
        args.checkpoint_dir / "checkpoint.pt",
        settings,
    )
    trainer.resume()
    # From here on there is progress to lose: on either signal, stop after the current
    # step and save. Until now, Python's default, to end at once, lost nothing, and it
    # also ends a process stuck in the rendezvous, which a handler could not interrupt.
    signal.signal(signal.SIGUSR1, note_stop_signal)
    signal.signal(signal.SIGTERM, note_stop_signal)
    stopped_by = trainer.train(args.epochs)
    if stopped_by:
        print(
            f"[{rank}/{world_size}] Stopped at step {trainer.step}, checkpoint saved",
            flush=True,
        )
        # SIGUSR1 warns of the time limit, at which the job would
        # end for good: requeue it. After SIGTERM, Slurm is ending
        # the job already, and requeues it if it preempted it.
        if stopped_by == signal.SIGUSR1 and rank == 0:
            requeue(args.max_restarts)
        return

    summary = {
        "rank": rank,
        "world_size": world_size,
        "host": socket.gethostname(),
        "steps": trainer.step,
        "first_loss": trainer.losses[0],
        "last_loss": trainer.losses[-1],
        "restarts": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
    }
    print(f"summary: {json.dumps(summary)}", flush=True)


def setup(rendezvous_timeout: float):
    """Joins the process group as the task srun started;
    returns local rank, rank, world size."""
    if "SLURM_STEP_NUM_TASKS" not in os.environ:
        # Without srun (in the batch script, say), only one process would start, and it
        # would wait for the others forever.
        raise SystemExit(
            "error: not started by srun: SLURM_STEP_NUM_TASKS is not set. Start one "
            "process per task with `srun python main.py` (job.sh does)."
        )
    rank = int(os.environ["SLURM_PROCID"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    world_size = int(os.environ["SLURM_NTASKS"])
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    # The store where the processes meet, made here rather than by init_process_group so
    # that joining has its own short timeout: the group's timeout also bounds every
    # collective, and its default is 10 minutes of silence for NCCL and 30 for gloo.
    try:
        store = dist.TCPStore(
            address,
            port,
            world_size,
            is_master=rank == 0,
            timeout=timedelta(seconds=rendezvous_timeout),
        )
    except dist.DistError as error:
        if "EADDRINUSE" in str(error):
            raise SystemExit(
                f"error: rank 0 cannot listen on port {port} of "
                f"{socket.gethostname()}: another process holds it. job.sh derives "
                "MASTER_PORT from the job ID; a port fixed by hand collides with other "
                "jobs on the node. Pick another, from 10000-19999."
            ) from None
        raise SystemExit(
            f"error: rank {rank} on {socket.gethostname()} waited "
            f"{rendezvous_timeout:.0f} s for the rendezvous at {address}:{port}, and "
            f"not all {world_size} processes joined. Rank 0 must run on MASTER_ADDR "
            "(the job's first node): check that the node is up, that its task started, "
            f"and that MASTER_ADDR names it.\n({type(error).__name__}: "
            f"{str(error).splitlines()[0]})"
        ) from None
    backend = "nccl" if use_gpus() else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    return local_rank, rank, world_size


def use_gpus() -> bool:
    """True to train on GPUs with NCCL, False to train on CPUs with gloo.

    A task that Slurm gave GPUs must use them: when CUDA does not
    work there, stop at once rather than train on CPUs for hours.
    TRAIN_ON_CPU=1 asks for CPUs on purpose, as the smoke tests do.
    """
    if os.environ.get("TRAIN_ON_CPU") == "1":
        return False
    if torch.cuda.is_available():
        return True
    gpus = os.environ.get("SLURM_GPUS_ON_NODE", "0")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if gpus not in ("", "0") or visible not in ("", "-1", "NoDevFiles"):
        raise SystemExit(
            f"error: this task was given GPUs (SLURM_GPUS_ON_NODE={gpus}, "
            f"CUDA_VISIBLE_DEVICES={visible}), but torch {torch.__version__} cannot "
            "use them. Likely causes: a torch build without CUDA; an NVIDIA driver "
            "older than the build needs (compare `nvidia-smi` with CUDA "
            f"{torch.version.cuda}); a container started without its GPUs (apptainer "
            "--nv). To train on CPUs anyway, set TRAIN_ON_CPU=1."
        )
    return False


def get_device(local_rank: int) -> torch.device:
    """This process's GPU, made its current device; or the
    CPU when not training on GPUs.

    Slurm may show a task every GPU of its node, or only its own
    (--gpu-bind, often with --gpus-per-task, or a MIG slice). One rule
    fits both: a process that sees one GPU takes it, and a process that
    sees several takes the one at its local rank, its place on its node.
    """
    if not use_gpus():
        return torch.device("cpu")
    visible = torch.cuda.device_count()
    index = 0 if visible == 1 else local_rank
    if index >= visible:
        raise SystemExit(
            f"error: the process of local rank {local_rank} sees {visible} GPUs, none "
            "of them its own. Ask for a GPU per process: as many GPUs per node as "
            "processes per node."
        )
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return device


class ResumableSampler(DistributedSampler):
    """A DistributedSampler that can start an epoch
    part-way, after the samples already used.

    For a given epoch it yields the same order as ever, so a resumed epoch sees exactly
    the batches that the interrupted one had left.
    """

    skip = 0

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self):
        return max(self.num_samples - self.skip, 0)


class Trainer:
    """Trains a model with DDP, and saves and restores
    everything needed to continue exactly."""

    def __init__(
        self, model, dataloader, optimizer, device, checkpoint_path: Path, settings
    ):
        self.device = device
        self.settings = settings
        self.dataloader = dataloader
        self.optimizer = optimizer
        self.checkpoint_path = checkpoint_path
        self.model = model.to(device)
        self.epoch = 0
        self.step = 0  # steps taken in all
        self.epoch_step = 0  # steps taken in this epoch
        self.losses = []  # the mean loss of each finished epoch
        # This process's sums for the epoch so far: summed loss and sample count.
        self.epoch_sums = torch.zeros(2, device=device)
        self.ddp_model = None

    def resume(self):
        """Loads the latest checkpoint, if there is one, then wraps the model in DDP."""
        rank, world_size = dist.get_rank(), dist.get_world_size()
        if self.checkpoint_path.exists():
            # weights_only: load tensors and plain containers only. A full unpickler
            # would run whatever code the file names.
            checkpoint = torch.load(
                self.checkpoint_path, map_location="cpu", weights_only=True
            )
            if len(checkpoint["ranks"]) != world_size:
                raise SystemExit(
                    f"error: {self.checkpoint_path} was written by "
                    f"{len(checkpoint['ranks'])} processes, and this job has "
                    f"{world_size}. Resume with the same number of tasks, or give a "
                    "new --checkpoint-dir to start over."
                )
            if checkpoint["settings"] != self.settings:
                changes = ", ".join(
                    f"--{name.replace('_', '-')} {checkpoint['settings'][name]} -> "
                    f"{value}"
                    for name, value in self.settings.items()
                    if checkpoint["settings"][name] != value
                )
                raise SystemExit(
                    f"error: {self.checkpoint_path} belongs to a run with other "
                    f"settings ({changes}). Resume with the same settings, or start a "
                    "new run: another --job-name, or delete "
                    f"{self.checkpoint_path.parent}."
                )
            self.model.load_state_dict(checkpoint["model"])
            self.optimizer.load_state_dict(checkpoint["optimizer"])
            self.epoch, self.step = checkpoint["epoch"], checkpoint["step"]
            self.epoch_step, self.losses = (
                checkpoint["epoch_step"],
                checkpoint["losses"],
            )
            mine = checkpoint["ranks"][rank]
            self.epoch_sums = mine["epoch_sums"].to(self.device)
            torch.set_rng_state(mine["cpu_rng"])
            if self.device.type == "cuda" and "cuda_rng" in mine:
                torch.cuda.set_rng_state(mine["cuda_rng"])
            if rank == 0:
                print(
                    f"Resumed from {self.checkpoint_path} at step {self.step}",
                    flush=True,
                )
        # DDP copies rank 0's weights to all processes, and averages gradients in
        # backward(), so that every copy takes the same step.
        device_ids = [self.device] if self.device.type == "cuda" else None
        self.ddp_model = DistributedDataParallel(self.model, device_ids=device_ids)

    def save(self):
        """Writes a checkpoint from rank 0, with every
        rank's own state in it. All ranks call it."""
        # The random state and the partial sums differ
        # between processes: gather them all.
        mine = {"epoch_sums": self.epoch_sums.cpu(), "cpu_rng": torch.get_rng_state()}
        if self.device.type == "cuda":
            mine["cuda_rng"] = torch.cuda.get_rng_state()
        ranks = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, ranks, dst=0)
        if dist.get_rank() == 0:
            checkpoint = {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "epoch": self.epoch,
                "step": self.step,
                "epoch_step": self.epoch_step,
                "losses": self.losses,
                "settings": self.settings,
                "ranks": ranks,
            }
            save_atomically(checkpoint, self.checkpoint_path)
        # No rank goes on, or exits, before the file is complete.
        dist.barrier()

    def agree_to_stop(self) -> int:
        """The stop signal that any rank received, or 0.
        All ranks get the same answer."""
        flag = torch.tensor([stop_signal], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag)

    def _run_batch(self, x, y):
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.ddp_model(x), y)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def train(self, max_epochs: int) -> int:
        """Trains until max_epochs; returns 0, or the
        signal that stopped training before."""
        sampler = self.dataloader.sampler
        while self.epoch < max_epochs:
            sampler.set_epoch(self.epoch)
            # Like set_epoch: the same worker seeds for an epoch,
            # however often the job restarted. Each process has its own,
            # so that random augmentations differ between processes.
            rank, world_size = dist.get_rank(), dist.get_world_size()
            self.dataloader.generator.manual_seed(self.epoch * world_size + rank)
            # A resumed epoch skips the batches its interrupted run already trained on.
            sampler.skip = self.epoch_step * self.dataloader.batch_size
            for x, y in self.dataloader:
                loss = self._run_batch(x.to(self.device), y.to(self.device))
                self.epoch_sums += torch.stack(
                    [loss * len(x), torch.tensor(len(x), device=self.device)]
                )
                self.step += 1
                self.epoch_step += 1
                signum = self.agree_to_stop()
                if signum:
                    self.save()
                    return signum
            # The epoch's mean loss over all processes, identical on each of them.
            totals = self.epoch_sums.clone()
            dist.all_reduce(totals)
            self.losses.append((totals[0] / totals[1]).item())
            if dist.get_rank() == 0:
                print(
                    f"epoch {self.epoch}: mean loss {self.losses[-1]:.4f}", flush=True
                )
            self.epoch += 1
            self.epoch_step = 0
            self.epoch_sums.zero_()
            self.save()
        return 0


def save_atomically(state: dict, path: Path):
    """Writes `state` to `path` so that a reader finds the
    old file or the new, never a mix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        # On disk before the rename, so that a crash of the
        # node cannot leave an empty file.
        f.flush()
        os.fsync(f.fileno())
    # A rename within one folder replaces the old file in one step.
    os.replace(tmp, path)
    # The rename is a change to the folder: on disk too, or a crash can undo it.
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def requeue(max_restarts: int):
    """Puts this job back in the queue: Slurm ends it now and starts it again later.

    Refuses after `max_restarts`: a job that cannot finish
    would otherwise loop for good.
    """
    job_id = os.environ["SLURM_JOB_ID"]
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    resubmit = "Resubmit job.sh with the same job name: it resumes from the checkpoint."
    if restarts >= max_restarts:
        raise SystemExit(
            f"error: job {job_id} is not requeued: it has started {restarts + 1} "
            f"times, and --max-restarts is {max_restarts}. {resubmit}"
        )
    print(f"Requeueing job {job_id}", flush=True)
    # Needs `#SBATCH --requeue` on clusters whose default is not to requeue.
    result = subprocess.run(["scontrol", "requeue", job_id])
    # The requeue ends every process of the job, scontrol
    # included: its SIGTERM means success.
    if result.returncode not in (0, -signal.SIGTERM):
        raise SystemExit(
            f"error: `scontrol requeue {job_id}` failed, so the job will not start "
            f"again by itself. {resubmit}"
        )


class RegressionDataset(Dataset):
    """Random inputs of 20 features; each target is a fixed
    linear function of them, plus noise."""

    def __init__(self, size: int):
        generator = torch.Generator().manual_seed(0)  # the same data in every process
        self.x = torch.rand(size, 20, generator=generator)
        weights = torch.randn(20, 1, generator=generator)
        self.y = self.x @ weights + 0.01 * torch.randn(size, 1, generator=generator)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]


if __name__ == "__main__":
    main()
    # The DDP model sits in reference cycles that keep the process group
    # alive. Collect them now, while Python can still run the group's
    # threads down cleanly: left to the interpreter's exit, gloo's
    # threads abort the process (exit code 134) after a successful run.
    gc.collect()
    dist.destroy_process_group()
