"""Single-GPU training: ResNet-18 on CIFAR-10, the first step of the Mila progression.

Everything here is plain PyTorch. The next steps, multi_gpu and multi_node, change only
what distributed training needs, so their pages show them as diffs against this file.

Try the job before staging any data with
`sbatch job.sh --synthetic-data --max-steps 50`.
"""

import argparse
import json
import logging
import os
import socket
from pathlib import Path

import rich.logging
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, random_split
from torchvision import transforms
from torchvision.datasets import CIFAR10
from torchvision.models import resnet18
from tqdm import tqdm


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--weight-decay", type=float, default=1e-4)
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

    # The GPU that Slurm gave the job, or the CPU: the same
    # file runs in a CPU smoke test.
    device = get_device(local_rank=0)

    logging.basicConfig(
        level=logging.INFO,
        format="%(message)s",
        handlers=[rich.logging.RichHandler(markup=True)],
    )
    logger = logging.getLogger(__name__)
    logger.info(f"Running on {socket.gethostname()}, device {device}")

    torch.manual_seed(args.seed)
    model = resnet18(num_classes=10).to(device)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay
    )

    train_dataset, valid_dataset = make_datasets(
        args.data_dir, args.synthetic_data, args.synthetic_size
    )
    num_workers = get_num_workers()
    train_dataloader = DataLoader(
        train_dataset, batch_size=args.batch_size, num_workers=num_workers, shuffle=True
    )
    valid_dataloader = DataLoader(
        valid_dataset,
        batch_size=args.batch_size,
        num_workers=num_workers,
        shuffle=False,
    )

    step = 0
    first_loss = None
    for epoch in range(args.epochs):
        # train() matters for BatchNorm, which ResNet-18
        # uses: batch statistics while training.
        model.train()
        progress_bar = tqdm(total=len(train_dataloader), desc=f"Train epoch {epoch}")
        for x, y in train_dataloader:
            x, y = x.to(device), y.to(device)
            logits: Tensor = model(x)
            loss = F.cross_entropy(logits, y)

            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

            accuracy = logits.detach().argmax(-1).eq(y).float().mean()
            first_loss = loss.item() if first_loss is None else first_loss
            progress_bar.update(1)
            progress_bar.set_postfix(loss=loss.item(), accuracy=accuracy.item())
            step += 1
            if step == args.max_steps:
                break
        progress_bar.close()

        val_loss, val_accuracy, val_samples = validation_loop(
            model, valid_dataloader, device
        )
        logger.info(
            f"Epoch {epoch}: val loss {val_loss:.3f}, val accuracy {val_accuracy:.2%} "
            f"on {val_samples} samples"
        )
        if step == args.max_steps:
            break

    # One plain line to grep from the job's output: the run's outcome at a glance.
    summary = {
        "steps": step,
        "first_loss": first_loss,
        "last_loss": loss.item(),
        "val_loss": val_loss,
        "val_accuracy": val_accuracy,
        "val_samples": val_samples,
    }
    print(f"summary: {json.dumps(summary)}", flush=True)


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


@torch.no_grad()
def validation_loop(model: nn.Module, dataloader: DataLoader, device: torch.device):
    """Returns the mean loss and the accuracy over every
    validation sample, and their count."""
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
    data_dir: Path, synthetic: bool, synthetic_size: int, val_fraction=0.1
):
    """Returns the training and validation splits, held out
    from CIFAR-10's training set."""
    if synthetic:
        dataset = SyntheticCIFAR10(synthetic_size)
    else:
        check_dataset(data_dir)
        # The archive is already staged: torchvision checks its checksum and unpacks it.
        dataset = CIFAR10(
            root=data_dir, train=True, transform=transforms.ToTensor(), download=True
        )
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
