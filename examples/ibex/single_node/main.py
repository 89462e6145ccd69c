"""DDP image classification on TinyImageNet, one process per GPU, started by torchrun.

The first Ibex step: the GPUs of one node. torchrun, started once per node by srun,
starts one process per GPU and gives each its place in LOCAL_RANK, RANK and WORLD_SIZE.
The data is TinyImageNet (200 classes of 64x64 images) read from its folder with
ImageFolder, and its validation set from the annotations file it comes with.
"""

import argparse
import gc
import json
import logging
import multiprocessing
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import default_loader
from torchvision.models import resnet18

# TinyImageNet's images are ImageNet crops: normalise with
# ImageNet's channel statistics.
TRANSFORM = transforms.Compose(
    [
        transforms.ToTensor(),
        transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    ]
)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.001)
    # The batch size per process: each step trains on batch_size * world_size images.
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--max-steps", type=int, default=None, help="stop after this many steps"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=os.environ.get("DATA_DIR"),
        help="TinyImageNet's folder, with train/ and val/ (default: $DATA_DIR)",
    )
    parser.add_argument(
        "--num-workers",
        type=int,
        default=None,
        help=(
            "DataLoader workers per process "
            "(default: the task's CPUs shared by its processes)"
        ),
    )
    args = parser.parse_args()

    rank, local_rank, world_size = setup()
    is_master = rank == 0
    device = get_device(local_rank)
    logging.basicConfig(level=logging.INFO, format=f"[{rank}/{world_size}] %(message)s")
    logger = logging.getLogger(__name__)
    logger.info(f"Running on {socket.gethostname()}, device {device}")

    train_dataset, valid_dataset = make_datasets(args.data_dir)
    train_sampler = DistributedSampler(train_dataset, shuffle=True, seed=args.seed)
    # Exact validation: each process takes every world_size-th
    # image, with no padding, so that every image counts once.
    # DistributedSampler would repeat some to even out the shards.
    valid_shard = Subset(valid_dataset, range(rank, len(valid_dataset), world_size))
    # DataLoader workers start from a fork server, a clean process, rather than by
    # fork() of this one. The process group's threads enter Python briefly now and then;
    # on Python up to 3.11.9, a fork at such a moment leaves the worker deadlocked
    # before it starts. (It is Python 3.14's default.) The server imports torch once,
    # and its workers start at once.
    multiprocessing.set_start_method("forkserver", force=True)
    multiprocessing.set_forkserver_preload(["torch", "torchvision"])
    num_workers = (
        args.num_workers if args.num_workers is not None else get_num_workers()
    )
    # Each process seeds its own workers: with one seed everywhere, a random
    # augmentation would draw the same numbers in every process.
    train_dataloader = DataLoader(
        train_dataset,
        batch_size=args.batch_size,
        sampler=train_sampler,
        num_workers=num_workers,
        pin_memory=device.type == "cuda",
        generator=torch.Generator().manual_seed(args.seed + rank),
    )
    valid_dataloader = DataLoader(
        valid_shard, batch_size=args.batch_size, num_workers=num_workers
    )
    if is_master:
        logger.info(
            f"{len(train_dataset.classes)} classes, {len(train_dataset)} training and "
            f"{len(valid_dataset)} validation images, {num_workers} DataLoader workers "
            f"per process, effective batch size {args.batch_size * world_size}"
        )

    torch.manual_seed(args.seed)
    model = resnet18(num_classes=len(train_dataset.classes)).to(device)
    model = DistributedDataParallel(
        model, device_ids=[device] if device.type == "cuda" else None
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    step = 0
    first_loss = None
    for epoch in range(args.epochs):
        # Without set_epoch, the sampler would shuffle the
        # data the same way in every epoch.
        train_sampler.set_epoch(epoch)
        model.train()
        for x, y in train_dataloader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits: Tensor = model(x)
            loss = F.cross_entropy(logits, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

            loss, accuracy = reduce_train_metrics(loss, logits, y)
            first_loss = loss.item() if first_loss is None else first_loss
            step += 1
            if is_master and step % 50 == 0:
                logger.info(
                    f"step {step}: loss {loss.item():.3f}, accuracy "
                    f"{accuracy.item():.2%}"
                )
            if step == args.max_steps:
                break
        val_loss, val_accuracy, val_samples = validation_loop(
            model.module, valid_dataloader, device
        )
        if is_master:
            logger.info(
                f"Epoch {epoch}: val loss {val_loss:.3f}, val accuracy "
                f"{val_accuracy:.2%} on {val_samples} images"
            )
        if step == args.max_steps:
            break

    # One plain line per process to grep from the job's
    # output: the numbers should agree.
    summary = {
        "rank": rank,
        "world_size": world_size,
        "host": socket.gethostname(),
        "steps": step,
        "first_loss": first_loss,
        "last_loss": loss.item(),
        "val_loss": val_loss,
        "val_accuracy": val_accuracy,
        "val_samples": val_samples,
    }
    print(f"summary: {json.dumps(summary)}", flush=True)


def setup():
    """Joins the process group, with this process's place
    from the variables torchrun sets."""
    missing = [v for v in ("LOCAL_RANK", "RANK", "WORLD_SIZE") if v not in os.environ]
    if missing:
        raise SystemExit(
            f"error: {', '.join(missing)} not set: start main.py with torchrun, one "
            "torchrun per node (`sbatch job.sh` does), or alone with `torchrun "
            "--nproc-per-node=2 main.py`."
        )
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    # torchrun also set MASTER_ADDR and MASTER_PORT, which
    # env:// reads. NCCL for GPUs, gloo for CPUs.
    dist.init_process_group("nccl" if use_gpus() else "gloo")
    return rank, local_rank, world_size


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


def reduce_train_metrics(loss: Tensor, logits: Tensor, y: Tensor):
    """The loss and accuracy of this step's whole batch,
    across all processes, for logging."""
    n = y.shape[0]
    correct = logits.detach().argmax(-1).eq(y).sum()
    sums = torch.stack(
        [loss.detach() * n, correct.float(), torch.tensor(float(n), device=y.device)]
    )
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    return sums[0] / sums[2], sums[1] / sums[2]


@torch.no_grad()
def validation_loop(model: nn.Module, dataloader: DataLoader, device: torch.device):
    """The mean loss and the accuracy over the whole validation set, and its size."""
    # BatchNorm's running statistics differ between processes: use rank 0's everywhere.
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    for x, y in dataloader:
        x, y = x.to(device), y.to(device)
        logits: Tensor = model(x)
        sums[0] += F.cross_entropy(logits, y, reduction="sum")
        sums[1] += logits.argmax(-1).eq(y).sum()
        sums[2] += y.shape[0]
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    total_loss, correct, n_samples = sums.tolist()
    return total_loss / n_samples, correct / n_samples, int(n_samples)


class TinyImageNetVal(Dataset):
    """TinyImageNet's validation set, read as it ships.

    Its images are not in class folders, which ImageFolder needs, but all
    in val/images/, with each image's class in val/val_annotations.txt:
    file name, class ID (a WordNet ID such as n01443537), then a bounding
    box. The labels follow the training set's class indices.
    """

    def __init__(self, val_dir: Path, class_to_idx: dict[str, int], transform):
        self.transform = transform
        self.samples = []
        for line in (val_dir / "val_annotations.txt").read_text().splitlines():
            file_name, wnid = line.split("\t")[:2]
            self.samples.append((val_dir / "images" / file_name, class_to_idx[wnid]))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index: int):
        path, label = self.samples[index]
        return self.transform(default_loader(path)), label


def make_datasets(data_dir: Path | None):
    """The training set (one folder per class) and the
    validation set (one annotated folder)."""
    if data_dir is None or not (data_dir / "val" / "val_annotations.txt").is_file():
        raise SystemExit(
            f"error: TinyImageNet not found in {data_dir}: expected train/ and "
            "val/val_annotations.txt there. job.sh sets DATA_DIR; pass --data-dir to "
            "override."
        )
    train_dataset = ImageFolder(data_dir / "train", transform=TRANSFORM)
    valid_dataset = TinyImageNetVal(
        data_dir / "val", train_dataset.class_to_idx, TRANSFORM
    )
    return train_dataset, valid_dataset


def get_num_workers() -> int:
    """DataLoader workers: this process's share of its
    task's CPUs, less one for the process."""
    # The CPUs that Slurm bound the task to. Where a site does not bind tasks to CPUs,
    # that is the whole node: keep to what the job asked for as well.
    cpus = len(os.sched_getaffinity(0))
    if "SLURM_CPUS_PER_TASK" in os.environ:
        cpus = min(cpus, int(os.environ["SLURM_CPUS_PER_TASK"]))
    # torchrun's processes share their task's CPUs.
    return max(cpus // int(os.environ.get("LOCAL_WORLD_SIZE", "1")) - 1, 0)


if __name__ == "__main__":
    main()
    # The DDP model sits in reference cycles that keep the process group
    # alive. Collect them now, while Python can still run the group's
    # threads down cleanly: left to the interpreter's exit, gloo's
    # threads abort the process (exit code 134) after a successful run.
    gc.collect()
    dist.destroy_process_group()
