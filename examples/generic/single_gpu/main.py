"""Step 1: one GPU. A complete training program, run as a Slurm job.

It trains an image classifier (ResNet-50 by default) on a folder of images, with
DataLoader workers, a learning rate that warms up then decays, and a validation every
epoch. For your own task, replace the section "Your model and data". Beside this file,
devices.py picks the GPU (or the CPU) and the number of DataLoader workers.

Try the job before the data is in place:
`sbatch job.sh --synthetic-data --max-steps 50`.
"""

import argparse
import functools
import json
import logging
import math
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset
from torchvision import models, transforms
from torchvision.datasets import ImageFolder

from devices import check_one_process, end_with_rank, get_device, get_num_workers

log = logging.getLogger(__name__)


# ---- Your model and data: replace these for your own task ----------------------------


def build_model(args, num_classes: int) -> nn.Module:
    """The network to train: any torchvision model, by name."""
    return models.get_model(args.model, num_classes=num_classes)


def make_datasets(args) -> tuple[Dataset, Dataset, int]:
    """The training and validation sets, and the number of classes. Any map-style
    Dataset works whose items to_device() takes apart."""
    if args.synthetic_data:
        size, classes = args.synthetic_size, args.synthetic_classes
        train = SyntheticImages(size, classes, args.image_size, first_seed=0)
        valid = SyntheticImages(max(size // 50, 1), classes, args.image_size, size)
        return train, valid, classes
    check_dataset(args.data_dir)
    size, T = args.image_size, transforms
    tensor = [T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])]
    augment = [T.RandomResizedCrop(size), T.RandomHorizontalFlip()]
    center = [T.Resize(size * 8 // 7), T.CenterCrop(size)]  # 256/224: the usual margin
    train = ImageFolder(args.data_dir / "train", T.Compose(augment + tensor))
    valid = ImageFolder(args.data_dir / "val", T.Compose(center + tensor))
    if train.classes != valid.classes:
        raise SystemExit(
            f"error: {args.data_dir}/train and {args.data_dir}/val have different "
            f"class folders ({len(train.classes)} and {len(valid.classes)}): labels "
            "would not match."
        )
    return train, valid, len(train.classes)


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    """The loss to minimise: a mean over the batch's samples."""
    return F.cross_entropy(output, target)


def to_device(batch, device: torch.device) -> tuple[Tensor, Tensor]:
    """A batch of the loader, as (the model's input, the target), on the device."""
    inputs, target = batch
    # non_blocking: where the batch is in pinned memory, the copy overlaps GPU work.
    return inputs.to(device, non_blocking=True), target.to(device, non_blocking=True)


def correct(output: Tensor, target: Tensor) -> Tensor:
    """The validation metric, summed over the batch: right predictions, one for each
    element of the target (a sample's label, or each token of a sequence)."""
    return output.argmax(-1).eq(target).sum()


class SyntheticImages(Dataset):
    """Random images of the real data's shape after its transforms: 3 x size x size.
    Each class has its own tint, so the loss falls. Image `i` comes from its own seed:
    the same in every epoch and every process."""

    def __init__(self, length: int, classes: int, size: int, first_seed: int):
        self.length, self.classes, self.size = length, classes, size
        self.first_seed = first_seed
        tints = torch.Generator().manual_seed(0)
        self.tints = torch.randn(classes, 3, 1, 1, generator=tints)

    def __len__(self):
        return self.length

    def __getitem__(self, index: int):
        label = index % self.classes
        generator = torch.Generator().manual_seed(self.first_seed + index)
        noise = torch.randn(3, self.size, self.size, generator=generator)
        return 0.5 * noise + self.tints[label], label


def check_dataset(data_dir: Path | None):
    """Stops with a clear message when the dataset is not where main.py looks for it."""
    if data_dir is None:
        raise SystemExit(
            "error: no dataset given: set DATA_DIR in job.sh or pass --data-dir.\n"
            "To try the job without a dataset, add --synthetic-data."
        )
    missing = [sub for sub in ("train", "val") if not (data_dir / sub).is_dir()]
    if missing:
        raise SystemExit(
            f"error: {data_dir} has no {' or '.join(missing)} folder: the dataset must "
            "be train/<class>/<image> and val/<class>/<image>. Check DATA_DIR in "
            "job.sh (and $SCRATCH, say), or pass --data-dir.\nTo try the job without "
            "a dataset, add --synthetic-data."
        )


# ---- Training ------------------------------------------------------------------------


def main():
    args = parse_args()
    check_one_process()  # refuses a launch of several processes: see step 2 for that
    device = get_device(local_rank=0)  # one process: the node's first GPU
    # Plain lines with a time stamp: a batch job's output is a file.
    line = "%(asctime)s %(message)s"
    logging.basicConfig(level=logging.INFO, format=line, datefmt="%H:%M:%S")
    log.info(f"Running on {socket.gethostname()}, device {device}")

    train_set, valid_set, num_classes = make_datasets(args)
    torch.manual_seed(args.seed)
    model = build_model(args, num_classes).to(device)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay
    )
    loaders = make_loaders(args, train_set, valid_set)
    scheduler = make_scheduler(args, optimizer, len(loaders[0]))
    progress, train_log = Progress(), TrainLog(device)
    train(args, model, optimizer, scheduler, loaders, progress, train_log)
    # One plain line to grep from the job's output: the run's outcome at a glance.
    summary = {"host": socket.gethostname(), **asdict(progress)}
    print(f"summary: {json.dumps(summary)}", flush=True)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    add = parser.add_argument
    add("--epochs", type=positive, default=90)
    add("--batch-size", type=positive, default=128)
    add("--learning-rate", type=float, default=1e-3)
    add("--warmup-steps", type=positive, default=500, help="in optimizer steps")
    add("--weight-decay", type=float, default=0.05)
    add("--seed", type=int, default=0)
    add("--max-steps", type=positive, default=None, help="stop after this many")
    add("--log-every", type=positive, default=50, help="steps between log lines")
    add("--model", default="resnet50", help="a torchvision model name")
    add("--image-size", type=positive, default=224)
    # A folder with train/ and val/, one subfolder per class.
    add("--data-dir", type=Path, default=os.environ.get("DATA_DIR"))
    add("--synthetic-data", action="store_true", help="random images of the same shape")
    add("--synthetic-size", type=positive, default=100_000)
    add("--synthetic-classes", type=positive, default=1000)
    add("--num-workers", type=int, help="per process (default: its CPUs, less one)")
    return parser.parse_args(argv)


def positive(text: str) -> int:
    """A whole number above zero, or argparse stops with the reason."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


@dataclass
class Progress:
    """Where training stands, and the numbers the summary reports."""

    epoch: int = 0  # the epoch under way; at the end, the number done
    steps: int = 0  # optimizer steps taken in all
    first_loss: float | None = None  # the mean loss of the first log line
    last_loss: float | None = None  # and of the last
    val_loss: float | None = None  # the last validation's results
    val_accuracy: float | None = None
    val_samples: int | None = None


def make_loaders(args, train_set: Dataset, valid_set: Dataset):
    """The DataLoaders: workers load and transform batches while the GPU computes."""
    workers = get_num_workers() if args.num_workers is None else args.num_workers
    options = {
        "batch_size": args.batch_size,
        "num_workers": workers,
        # Kept from one epoch to the next: new workers would copy the dataset again.
        "persistent_workers": workers > 0,
        # Workers end when this process ends, however it ends.
        "worker_init_fn": functools.partial(end_with_rank, os.getpid()),
    }
    train_loader = DataLoader(
        train_set,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(args.seed),
        **options,
    )
    # A generator of its own seeds the workers: torch's global random state is left to
    # training alone.
    valid_loader = DataLoader(
        valid_set, shuffle=False, generator=torch.Generator(), **options
    )
    if len(train_loader) == 0:
        raise SystemExit(
            f"error: {len(train_set)} training samples make no batch of "
            f"{args.batch_size}. Lower --batch-size."
        )
    return train_loader, valid_loader


def make_scheduler(args, optimizer, steps_per_epoch: int):
    """A learning rate that rises linearly over --warmup-steps, then decays to zero
    along a cosine, by the end of training."""
    total = args.epochs * steps_per_epoch
    total = total if args.max_steps is None else min(total, args.max_steps)
    warmup = args.warmup_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        done = (step - warmup) / max(total - warmup, 1)
        return 0.5 * (1 + math.cos(math.pi * min(done, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def train(args, model, optimizer, scheduler, loaders, progress, train_log):
    """Trains for --epochs, or --max-steps, and validates after every epoch."""
    train_loader, valid_loader = loaders
    device = next(model.parameters()).device
    max_steps = math.inf if args.max_steps is None else args.max_steps
    while progress.epoch < args.epochs and progress.steps < max_steps:
        model.train()
        for batch in train_loader:
            if progress.steps == max_steps:
                break
            inputs, target = to_device(batch, device)
            loss = loss_fn(model(inputs), target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            progress.steps += 1
            train_log.add(loss)
            if progress.steps % args.log_every == 0:
                log_line(progress, train_log, scheduler)
        if train_log.steps:  # the steps since the last line, at the epoch's end
            log_line(progress, train_log, scheduler)
        log.info(f"Epoch {progress.epoch}: validation")
        results = validate(model, valid_loader, device)
        for name, value in results.items():
            setattr(progress, name, value)
        log.info(
            f"Epoch {progress.epoch}: val loss {progress.val_loss:.3f}, val accuracy "
            f"{progress.val_accuracy:.2%} on {progress.val_samples} samples"
        )
        progress.epoch += 1


class TrainLog:
    """The mean loss over the steps since the last log line. The losses stay on the
    device until a line is logged: a .item() at every step would make the CPU wait for
    the GPU each time."""

    def __init__(self, device: torch.device):
        self.total = torch.zeros((), device=device)
        self.steps = 0

    def add(self, loss: Tensor):
        self.total += loss.detach()
        self.steps += 1

    def report(self) -> dict:
        """The numbers since the last report; starts anew."""
        mean = (self.total / self.steps).item()
        self.total.zero_()
        self.steps = 0
        return {"loss": mean}


def log_line(progress: Progress, train_log: TrainLog, scheduler):
    loss = train_log.report()["loss"]
    progress.first_loss = loss if progress.first_loss is None else progress.first_loss
    progress.last_loss = loss
    log.info(
        f"epoch {progress.epoch} step {progress.steps} | loss {loss:.4f} | "
        f"lr {scheduler.get_last_lr()[0]:.2e}"
    )


@torch.no_grad()
def validate(model: nn.Module, loader: DataLoader, device: torch.device) -> dict:
    """The mean loss and accuracy over every validation sample, and their count."""
    model.eval()
    # Sums, not means, so that a smaller last batch weighs exactly its size: loss,
    # right predictions and samples, in float64 to keep the counts exact.
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    for batch in loader:
        inputs, target = to_device(batch, device)
        output = model(inputs)
        n = target.numel()  # samples; tokens, where each token has a target
        sums[0] += loss_fn(output, target).double() * n
        sums[1] += correct(output, target)
        sums[2] += n
    loss, right, n = sums.tolist()
    return {"val_loss": loss / n, "val_accuracy": right / n, "val_samples": int(n)}


if __name__ == "__main__":
    main()
