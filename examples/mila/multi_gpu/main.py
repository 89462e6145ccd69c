"""Multi-GPU training on one node: one process per GPU, started by srun, with DDP.

Over single_gpu, this adds: the process group, set up from the variables srun
gives each task; DistributedDataParallel; a DistributedSampler for training;
metrics reduced across processes; a validation that counts every sample
exactly once, whatever the number of processes; and DataLoader workers
started from a fork server, which a process with a process group needs.

Try the job before staging any data with
`sbatch job.sh --synthetic-data --max-steps 50`.
"""

import argparse
import gc
import json
import logging
import multiprocessing
import os
import socket
from pathlib import Path

import rich.logging
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Subset, random_split
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from torchvision.datasets import CIFAR10
from torchvision.models import resnet18
from tqdm import tqdm


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--weight-decay", type=float, default=1e-4)
    # The batch size per process: each step trains on
    # batch_size * world_size samples in all.
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="stop after this many training steps",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=Path(os.environ.get("SLURM_TMPDIR", ".")) / "data",
        help="where job.sh staged cifar-10-python.tar.gz (default: $SLURM_TMPDIR/data)",
    )
    parser.add_argument(
        "--synthetic-data",
        action="store_true",
        help="train on random images of CIFAR-10's shape instead of the dataset",
    )
    parser.add_argument(
        "--synthetic-size",
        type=int,
        default=50_000,
        help="number of synthetic images (CIFAR-10's training set has 50,000)",
    )
    args = parser.parse_args()

    rank, local_rank, world_size = setup()
    is_master = rank == 0
    device = get_device(local_rank)

    logging.basicConfig(
        level=logging.INFO,
        format=f"[{rank}/{world_size}] %(message)s",
        handlers=[rich.logging.RichHandler(markup=True)],
    )
    logger = logging.getLogger(__name__)
    logger.info(f"Running on {socket.gethostname()}, device {device}")

    # DDP copies rank 0's initial weights to every process,
    # so the seed matters on rank 0 only.
    torch.manual_seed(args.seed)
    model = resnet18(num_classes=10).to(device)
    # DDP averages the gradients across processes during backward(),
    # so every copy of the model takes the same optimizer step. Keep
    # `model.module`, the plain model, for evaluation.
    model = DistributedDataParallel(
        model, device_ids=[device] if device.type == "cuda" else None
    )
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay
    )

    train_dataset, valid_dataset = make_datasets(
        args.data_dir, args.synthetic_data, args.synthetic_size, prepare=is_master
    )
    # Each process trains on its own 1/world_size of the data; the
    # sampler shuffles, not the loader. It pads with repeated
    # samples so that every process runs the same number of steps.
    train_sampler = DistributedSampler(train_dataset, shuffle=True, seed=args.seed)
    # Validation must not count padded samples twice: each process
    # takes every world_size-th sample, with no padding. The
    # shards may differ in size by one, which validation allows.
    valid_shard = Subset(valid_dataset, range(rank, len(valid_dataset), world_size))
    # DataLoader workers start from a fork server, a clean process, rather than by
    # fork() of this one. The process group's threads enter Python briefly now and then;
    # on Python up to 3.11.9, a fork at such a moment leaves the worker deadlocked
    # before it starts. (It is Python 3.14's default.) The server imports torch once,
    # and its workers start at once.
    multiprocessing.set_start_method("forkserver", force=True)
    multiprocessing.set_forkserver_preload(["torch", "torchvision"])
    num_workers = get_num_workers()
    # Each process seeds its own workers: with one seed everywhere, a random
    # augmentation would draw the same numbers in every process.
    train_dataloader = DataLoader(
        train_dataset,
        batch_size=args.batch_size,
        num_workers=num_workers,
        sampler=train_sampler,
        generator=torch.Generator().manual_seed(args.seed + rank),
    )
    valid_dataloader = DataLoader(
        valid_shard, batch_size=args.batch_size, num_workers=num_workers, shuffle=False
    )
    if is_master:
        logger.info(f"Effective batch size: {args.batch_size * world_size}")

    step = 0
    first_loss = None
    for epoch in range(args.epochs):
        # Without set_epoch, the sampler would shuffle the
        # data the same way in every epoch.
        train_sampler.set_epoch(epoch)
        # train() matters for BatchNorm, which ResNet-18
        # uses: batch statistics while training.
        model.train()
        progress_bar = tqdm(
            total=len(train_dataloader),
            desc=f"Train epoch {epoch}",
            disable=not is_master,
        )
        for x, y in train_dataloader:
            x, y = x.to(device), y.to(device)
            logits: Tensor = model(x)
            loss = F.cross_entropy(logits, y)

            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

            loss, accuracy = reduce_train_metrics(loss, logits, y)
            first_loss = loss.item() if first_loss is None else first_loss
            progress_bar.update(1)
            progress_bar.set_postfix(loss=loss.item(), accuracy=accuracy.item())
            step += 1
            if step == args.max_steps:
                break
        progress_bar.close()

        val_loss, val_accuracy, val_samples = validation_loop(
            model.module, valid_dataloader, device
        )
        # Every process holds the same numbers now; one line in the log is enough.
        if is_master:
            logger.info(
                f"Epoch {epoch}: val loss {val_loss:.3f}, val accuracy "
                f"{val_accuracy:.2%} on {val_samples} samples"
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
    """Joins the process group, with this task's rank from
    the variables that srun sets."""
    launch_help = (
        "Start one process per task with srun: `sbatch job.sh`, or `srun python "
        "main.py` inside an allocation."
    )
    if "SLURM_PROCID" not in os.environ:
        raise SystemExit(
            f"error: SLURM_PROCID is not set: this is not a Slurm task.\n{launch_help}"
        )
    if "SLURM_STEP_NUM_TASKS" not in os.environ:
        # The batch script itself has SLURM_PROCID=0: without srun, this process would
        # wait forever for the other tasks of the job.
        raise SystemExit(
            "error: main.py was started by the batch script, not by srun. The job has "
            f"{os.environ.get('SLURM_NTASKS', '1')} task(s); without srun only this "
            f"process runs, and it would wait forever for the others.\n{launch_help}"
        )
    rank = int(os.environ["SLURM_PROCID"])
    world_size = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    if not 0 <= rank < world_size:
        raise SystemExit(
            f"error: SLURM_PROCID={rank} does not fit SLURM_NTASKS={world_size}: these "
            f"variables were set or changed by hand.\n{launch_help}"
        )
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise SystemExit(
                f"error: {name} is not set. job.sh exports MASTER_ADDR and MASTER_PORT "
                "before srun; export them too when you launch by hand."
            )
    # NCCL for GPUs; gloo runs the same program on CPUs.
    backend = "nccl" if use_gpus() else "gloo"
    # env:// reads MASTER_ADDR and MASTER_PORT, which job.sh exported for every task.
    dist.init_process_group(
        backend, init_method="env://", rank=rank, world_size=world_size
    )
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
    # One all_reduce of three sums instead of three
    # collectives. Every process gets the result.
    sums = torch.stack(
        [loss.detach() * n, correct.float(), torch.tensor(float(n), device=y.device)]
    )
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    return sums[0] / sums[2], sums[1] / sums[2]


@torch.no_grad()
def validation_loop(model: nn.Module, dataloader: DataLoader, device: torch.device):
    """Returns the mean loss and the accuracy over every
    validation sample, and their count."""
    # BatchNorm's running statistics are the one state that DDP
    # leaves different: each process updated them with its own last
    # batch. Take rank 0's, so that every shard sees one model.
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)
    model.eval()
    # Sums, not means, so that a smaller last batch weighs
    # exactly its size: the summed loss, the correct predictions
    # and the sample count, in float64 to keep the counts exact.
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    for x, y in dataloader:
        x, y = x.to(device), y.to(device)
        logits: Tensor = model(x)
        sums[0] += F.cross_entropy(logits, y, reduction="sum")
        sums[1] += logits.argmax(-1).eq(y).sum()
        sums[2] += y.shape[0]
    # Each process saw its own shard: add the sums up, and
    # every process gets the totals.
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    total_loss, correct, n_samples = sums.tolist()
    return total_loss / n_samples, correct / n_samples, int(n_samples)


class SyntheticCIFAR10(Dataset):
    """Random 3x32x32 images in 10 classes: CIFAR-10's
    shape after ToTensor, with no file to stage.

    Each class has its own colour tint, so the model can learn
    something and the loss falls as in a real run. Image `i` comes
    from its own seed: the same in every epoch and every process.
    """

    def __init__(self, size: int):
        self.size = size
        self.tints = torch.rand(10, 3, 1, 1, generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return self.size

    def __getitem__(self, index: int):
        label = index % 10
        noise = torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(index))
        return 0.5 * noise + 0.5 * self.tints[label], label


def make_datasets(
    data_dir: Path,
    synthetic: bool,
    synthetic_size: int,
    prepare: bool,
    val_fraction=0.1,
):
    """Returns the training and validation splits, held out
    from CIFAR-10's training set.

    Only the process with `prepare` set unpacks the
    dataset; the others wait at a barrier.
    """
    if synthetic:
        dataset = SyntheticCIFAR10(synthetic_size)
    else:
        # Every process checks, so that all of them stop with the message: none waits
        # forever at the barrier for a process that has already failed.
        check_dataset(data_dir)
        if prepare:
            # The archive is already staged: torchvision
            # checks its checksum and unpacks it.
            CIFAR10(root=data_dir, train=True, download=True)
        dist.barrier()
        dataset = CIFAR10(root=data_dir, train=True, transform=transforms.ToTensor())
    n_valid = int(val_fraction * len(dataset))
    # A fixed seed keeps the same split in every run, so
    # validation numbers stay comparable.
    return random_split(
        dataset,
        [len(dataset) - n_valid, n_valid],
        generator=torch.Generator().manual_seed(42),
    )


def check_dataset(data_dir: Path):
    """Stops with a clear message when the dataset was not
    staged, instead of trying a download."""
    archive = data_dir / "cifar-10-python.tar.gz"
    if not archive.is_file() and not (data_dir / "cifar-10-batches-py").is_dir():
        raise SystemExit(
            f"error: CIFAR-10 not found: expected {archive}.\njob.sh copies it there "
            "from /network/datasets/cifar10; check that step, or pass --data-dir.\nTo "
            "try the job without the dataset, add --synthetic-data."
        )


def get_num_workers() -> int:
    """DataLoader workers: one per CPU this process may run
    on, less one for the process itself."""
    # The CPUs that Slurm bound the task to. Where a site does not bind tasks to CPUs,
    # that is the whole node: keep to what the job asked for as well.
    cpus = len(os.sched_getaffinity(0))
    if "SLURM_CPUS_PER_TASK" in os.environ:
        cpus = min(cpus, int(os.environ["SLURM_CPUS_PER_TASK"]))
    return max(cpus - 1, 0)


if __name__ == "__main__":
    main()
    # The DDP model sits in reference cycles that keep the process group
    # alive. Collect them now, while Python can still run the group's
    # threads down cleanly: left to the interpreter's exit, gloo's
    # threads abort the process (exit code 134) after a successful run.
    gc.collect()
    dist.destroy_process_group()
