"""One node, no launcher: the script starts its own
processes with torch.multiprocessing.spawn.

ResNet-50 on CIFAR-10 with augmentation and SGD with momentum.
`python main.py` starts one process per GPU of the node. That is convenient
on a workstation, but mp.spawn can only start processes on the machine it
runs on: for several nodes, use srun or torchrun (see the launchers page).
"""

import argparse
import gc
import json
import multiprocessing
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from torchvision.datasets import CIFAR10
from torchvision.models import resnet50

# Standard CIFAR-10 augmentation, applied to image tensors: random crops of a padded
# image and horizontal flips, then normalisation with the dataset's channel statistics.
AUGMENT = transforms.Compose(
    [
        transforms.RandomCrop(32, padding=4),
        transforms.RandomHorizontalFlip(),
        transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)),
    ]
)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=128, help="per process")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument(
        "--max-steps", type=int, default=None, help="stop after this many steps"
    )
    parser.add_argument("--data-dir", type=Path, default=Path("data"))
    parser.add_argument(
        "--nprocs",
        type=int,
        default=max(torch.cuda.device_count(), 1),
        help="processes to start (default: one per GPU of this node)",
    )
    parser.add_argument(
        "--synthetic-data",
        action="store_true",
        help="train on random images of CIFAR-10's shape instead of the dataset",
    )
    parser.add_argument("--synthetic-size", type=int, default=50_000)
    args = parser.parse_args()
    if not args.synthetic_data:
        check_dataset(args.data_dir)

    # All processes run on this machine: they meet at a store that this process serves
    # on the loopback address. Port 0 lets the kernel pick a free port as the store
    # binds it, and this process holds it until the end: no other job can take it
    # between the choice and the use.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    # mp.spawn calls train(rank, *args) in each new process. If one raises, spawn stops
    # the others and raises here, so a failure ends the job instead of hanging it.
    mp.spawn(train, args=(args.nprocs, store.port, args), nprocs=args.nprocs, join=True)


def train(rank: int, world_size: int, port: int, args):
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    backend = "nccl" if use_gpus() else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    # On one node, the rank is also the local rank: it picks the GPU.
    device = get_device(rank)
    print(
        f"[{rank}/{world_size}] Running on {socket.gethostname()}, device {device}",
        flush=True,
    )

    if args.synthetic_data:
        dataset = SyntheticCIFAR10(args.synthetic_size, transform=AUGMENT)
    else:
        transform = transforms.Compose([transforms.ToTensor(), AUGMENT])
        dataset = CIFAR10(args.data_dir, train=True, transform=transform)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank)
    # DataLoader workers start from a fork server, a clean process, rather than by
    # fork() of this one. The process group's threads enter Python briefly now and then;
    # on Python up to 3.11.9, a fork at such a moment leaves the worker deadlocked
    # before it starts. (It is Python 3.14's default.) The server imports torch once,
    # and its workers start at once.
    multiprocessing.set_start_method("forkserver", force=True)
    multiprocessing.set_forkserver_preload(["torch", "torchvision"])
    # Each process seeds its own workers: with the same seed everywhere, the random
    # crops and flips of every process would follow the same sequence.
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=get_num_workers(world_size),
        pin_memory=device.type == "cuda",
        generator=torch.Generator().manual_seed(rank),
    )

    torch.manual_seed(0)
    model = DistributedDataParallel(
        resnet50(num_classes=10).to(device),
        device_ids=[device] if device.type == "cuda" else None,
    )
    optimizer = torch.optim.SGD(
        model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4
    )

    step, losses = 0, []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            # The mean loss over all processes' samples, for logging;
            # the same on every rank. (A sum then a division: gloo,
            # the CPU backend, has no AVG reduction.)
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss, op=dist.ReduceOp.SUM)
            mean_loss /= world_size
            losses.append(mean_loss.item())
            step += 1
            if rank == 0 and step % 50 == 0:
                print(f"epoch {epoch} step {step}: loss {losses[-1]:.3f}", flush=True)
            if step == args.max_steps:
                break
        if step == args.max_steps:
            break

    summary = {
        "rank": rank,
        "world_size": world_size,
        "host": socket.gethostname(),
        "steps": step,
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }
    print(f"summary: {json.dumps(summary)}", flush=True)
    # The DDP model sits in reference cycles that keep the process group alive. Free it
    # now, while Python can still run the group's threads down cleanly: left to the
    # process's exit, gloo's threads abort it (exit code 134) after a successful run.
    del model
    gc.collect()
    dist.destroy_process_group()


class SyntheticCIFAR10(Dataset):
    """Random 3x32x32 images in 10 classes, each class with
    its own tint: CIFAR-10's shape."""

    def __init__(self, size: int, transform):
        self.size = size
        self.transform = transform
        self.tints = torch.rand(10, 3, 1, 1, generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return self.size

    def __getitem__(self, index: int):
        label = index % 10
        noise = torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(index))
        return self.transform(0.5 * noise + 0.5 * self.tints[label]), label


def check_dataset(data_dir: Path):
    if not (data_dir / "cifar-10-batches-py").is_dir():
        raise SystemExit(
            f"error: CIFAR-10 not found: expected {data_dir}/cifar-10-batches-py (the "
            "unpacked cifar-10-python.tar.gz). Pass --data-dir, or add "
            "--synthetic-data to try the job."
        )


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


def get_num_workers(processes: int) -> int:
    """DataLoader workers: this process's share of the
    job's CPUs, less one for the process."""
    # The CPUs that Slurm bound the job to. Where a site does not bind tasks to CPUs,
    # that is the whole node: keep to what the job asked for as well.
    cpus = len(os.sched_getaffinity(0))
    if "SLURM_CPUS_PER_TASK" in os.environ:
        cpus = min(cpus, int(os.environ["SLURM_CPUS_PER_TASK"]))
    return max(cpus // processes - 1, 0)


if __name__ == "__main__":
    main()
