"""One main.py for every launcher: torchrun, srun, or plain `python main.py`.

Over srun_tasks, setup() asks find_place() who started the process and reads the
matching variables: torchrun's RANK, LOCAL_RANK and WORLD_SIZE, or srun's SLURM_PROCID,
SLURM_LOCALID and SLURM_NTASKS. With neither, it runs as a single process. Any other
launcher gets an error that names the variables it looked for.
"""

import argparse
import gc
import json
import os
import socket

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--dataset-size", type=int, default=2048)
    args = parser.parse_args()

    local_rank, rank, world_size = setup()
    device = get_device(local_rank)
    print(
        f"[{rank}/{world_size}] Running on {socket.gethostname()}, device {device}",
        flush=True,
    )

    dataset = RegressionDataset(args.dataset_size)
    # The sampler hands each process its own 1/world_size of the samples.
    dataloader = DataLoader(
        dataset, batch_size=args.batch_size, sampler=DistributedSampler(dataset)
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    trainer = Trainer(model, dataloader, optimizer, device)
    losses = trainer.train(args.epochs)

    summary = {
        "rank": rank,
        "world_size": world_size,
        "host": socket.gethostname(),
        "launcher": find_place()[3],
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }
    print(f"summary: {json.dumps(summary)}", flush=True)


def setup():
    """Joins the process group, whoever started this process; returns its place."""
    rank, local_rank, world_size, launcher = find_place()
    backend = "nccl" if use_gpus() else "gloo"
    if launcher == "single process":
        # No other process to meet: an in-memory store instead of an address and a port.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if name not in os.environ:
                raise SystemExit(
                    f"error: {name} is not set: export it before {launcher}."
                )
        dist.init_process_group(backend, rank=rank, world_size=world_size)
    print(f"[{rank}/{world_size}] started by {launcher}", flush=True)
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


TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
SRUN_VARIABLES = (
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NTASKS",
    "SLURM_STEP_NUM_TASKS",
)
OTHER_LAUNCHERS = (
    "OMPI_COMM_WORLD_RANK",
    "PMI_RANK",
    "PMIX_RANK",
    "MV2_COMM_WORLD_RANK",
)


def find_place():
    """This process's rank, local rank and world size, and
    the launcher that set them."""
    env = os.environ
    if all(name in env for name in TORCHRUN_VARIABLES):
        rank, local_rank, world_size = (int(env[name]) for name in TORCHRUN_VARIABLES)
        return rank, local_rank, world_size, "torchrun"
    if all(name in env for name in SRUN_VARIABLES):
        rank, local_rank, world_size = (int(env[name]) for name in SRUN_VARIABLES[:3])
        return rank, local_rank, world_size, "srun"
    # Checked after srun: inside a job, the batch script
    # has SLURM_PROCID too, but no step.
    clues = [name for name in (*TORCHRUN_VARIABLES, *OTHER_LAUNCHERS) if name in env]
    if int(env.get("SLURM_NTASKS", "1")) > 1:
        clues.append(f"SLURM_NTASKS={env['SLURM_NTASKS']} without srun")
    if clues:
        raise SystemExit(
            f"error: cannot tell this process's rank (found {', '.join(clues)}). "
            f"main.py looks for {', '.join(TORCHRUN_VARIABLES)} (torchrun) or "
            f"{', '.join(SRUN_VARIABLES)} (srun), or for none of them (a single "
            "process)."
        )
    return 0, 0, 1, "single process"


class Trainer:
    """Trains a model with DDP: every process runs this, on
    its own share of the data."""

    def __init__(self, model, dataloader, optimizer, device):
        self.device = device
        self.dataloader = dataloader
        self.optimizer = optimizer
        device_ids = [device] if device.type == "cuda" else None
        # DDP copies rank 0's initial weights to all processes, and averages gradients
        # in backward(), so that every copy takes the same step.
        self.model = DistributedDataParallel(model.to(device), device_ids=device_ids)

    def _run_batch(self, x, y):
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def _run_epoch(self, epoch: int) -> float:
        # A new shuffle every epoch: without set_epoch,
        # each epoch repeats the same order.
        self.dataloader.sampler.set_epoch(epoch)
        total = torch.zeros(2, device=self.device)
        for x, y in self.dataloader:
            loss = self._run_batch(x.to(self.device), y.to(self.device))
            total += torch.stack(
                [loss * len(x), torch.tensor(len(x), device=self.device)]
            )
        # The epoch's mean loss over all processes, identical on each of them.
        dist.all_reduce(total)
        return (total[0] / total[1]).item()

    def train(self, max_epochs: int) -> list[float]:
        losses = []
        for epoch in range(max_epochs):
            losses.append(self._run_epoch(epoch))
            if dist.get_rank() == 0:
                print(f"epoch {epoch}: mean loss {losses[-1]:.4f}", flush=True)
        return losses


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
