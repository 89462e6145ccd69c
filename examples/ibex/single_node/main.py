"""DDP image classification on TinyImageNet, one process per GPU, started by torchrun.

The first Ibex step: the GPUs of one node. torchrun, started once per node by srun,
starts one process per GPU and gives each its place in LOCAL_RANK, RANK and WORLD_SIZE,
which setup() reads. The data is TinyImageNet (200 classes of 64x64 images) read from
its folder with ImageFolder, and its validation set from the annotations file it
comes with.
"""

import argparse
import functools
import json
import logging
import math
import multiprocessing
import os
import socket
from dataclasses import asdict, dataclass
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

from devices import end_with_rank, get_device, get_num_workers
from ranks import leave, setup

log = logging.getLogger(__name__)


# ---- Your model and data: replace these for your own task ----------------------------


def build_model(args, num_classes: int) -> nn.Module:
    """The network to train: ResNet-18."""
    return resnet18(num_classes=num_classes)


def make_datasets(args) -> tuple[Dataset, Dataset, int]:
    """TinyImageNet's training set (one folder per class), its validation set (one
    annotated folder), and the number of classes."""
    if args.synthetic_data:
        train = SyntheticImages(args.synthetic_size, 200, 64, first_seed=0)
        valid = SyntheticImages(
            max(args.synthetic_size // 50, 1), 200, 64, first_seed=-1
        )
        return train, valid, 200
    data_dir = args.data_dir
    if data_dir is None or not (data_dir / "val" / "val_annotations.txt").is_file():
        raise SystemExit(
            f"error: TinyImageNet not found in {data_dir}: expected train/ and "
            "val/val_annotations.txt there. job.sh sets DATA_DIR; pass --data-dir to "
            "override.\nTo try the job without the dataset, add --synthetic-data."
        )
    # TinyImageNet's images are ImageNet crops: normalise with ImageNet's statistics.
    transform = transforms.Compose(
        [
            transforms.ToTensor(),
            transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
        ]
    )
    train = ImageFolder(data_dir / "train", transform=transform)
    valid = TinyImageNetVal(data_dir / "val", train.class_to_idx, transform)
    return train, valid, len(train.classes)


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    """The loss to minimise: a mean over the batch's samples."""
    return F.cross_entropy(output, target)


def to_device(batch, device: torch.device) -> tuple[Tensor, Tensor]:
    """A batch of the loader, as (the model's input, the target), on the device."""
    inputs, target = batch
    return inputs.to(device, non_blocking=True), target.to(device, non_blocking=True)


def correct(output: Tensor, target: Tensor) -> Tensor:
    """The validation metric, summed over the batch: right predictions, one for each
    element of the target (a sample's label, or each token of a sequence)."""
    return output.argmax(-1).eq(target).sum()


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


class SyntheticImages(Dataset):
    """Random images of TinyImageNet's shape after its transforms: 3 x 64 x 64.

    Each class has its own tint, so the loss falls as in a real run. Image `i` comes
    from its own seed: the same in every epoch and every process.
    """

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


# ---- Training ------------------------------------------------------------------------


def main():
    args = parse_args()
    place = setup(args.rendezvous_timeout)
    device = get_device(place.local_rank)
    # Plain lines with a time stamp and the rank: a batch job's output is a file.
    line = f"%(asctime)s [{place.rank}/{place.world_size}] %(message)s"
    logging.basicConfig(level=logging.INFO, format=line, datefmt="%H:%M:%S")
    log.info(f"Running on {socket.gethostname()}, device {device}")
    # From here on, only rank 0 logs (modules too): all processes hold the same numbers.
    logging.getLogger().setLevel(logging.INFO if place.rank == 0 else logging.WARNING)

    train_set, valid_set, num_classes = make_datasets(args)
    # DDP copies rank 0's initial weights to all: the seed matters on rank 0 only.
    torch.manual_seed(args.seed)
    model = build_model(args, num_classes).to(device)
    # DDP averages the gradients over the processes in backward(), so that every copy
    # of the model takes the same step. `model.module` is the model inside.
    model = DistributedDataParallel(
        model, device_ids=[device] if device.type == "cuda" else None
    )
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay
    )
    loaders = make_loaders(args, train_set, valid_set, place)
    scheduler = make_scheduler(args, optimizer, len(loaders[0]))
    global_batch = args.batch_size * place.world_size
    log.info(f"Global batch: {args.batch_size} x {place.world_size} = {global_batch}")
    progress, train_log = Progress(), TrainLog(device)
    train(args, model, optimizer, scheduler, loaders, progress, train_log)
    # One plain line per process to grep from the job's output: the numbers agree.
    summary = {
        "rank": place.rank,
        "world_size": place.world_size,
        "host": socket.gethostname(),
        **asdict(progress),
    }
    print(f"summary: {json.dumps(summary)}", flush=True)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    add = parser.add_argument
    add("--epochs", type=positive, default=10)
    add("--batch-size", type=positive, default=64, help="per process")
    add("--learning-rate", type=float, default=1e-3)
    add("--warmup-steps", type=positive, default=100, help="in optimizer steps")
    add("--weight-decay", type=float, default=0.05)
    add("--seed", type=int, default=0)
    add("--max-steps", type=positive, default=None, help="stop after this many")
    add("--log-every", type=positive, default=50, help="steps between log lines")
    # TinyImageNet's folder, with train/ and val/.
    add("--data-dir", type=Path, default=os.environ.get("DATA_DIR"))
    add(
        "--synthetic-data",
        action="store_true",
        help="TinyImageNet-shaped random images",
    )
    add("--synthetic-size", type=positive, default=100_000)
    add("--num-workers", type=int, help="per process (default: its CPUs, less one)")
    add("--rendezvous-timeout", type=float, default=120, help="seconds for all to join")
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


def make_loaders(args, train_set: Dataset, valid_set: Dataset, place):
    """The DataLoaders: workers load and transform batches while the GPU computes."""
    # Workers start from a fork server, a clean process, not by fork() of this one,
    # whose process group runs threads. On Python up to 3.11.9, a fork while one of
    # them holds the interpreter's lock leaves the worker deadlocked (gh-112275).
    # The server imports torch once; its workers start at once.
    multiprocessing.set_start_method("forkserver", force=True)
    multiprocessing.set_forkserver_preload(["torch", "torchvision"])
    workers = get_num_workers() if args.num_workers is None else args.num_workers
    options = {
        "batch_size": args.batch_size,
        "num_workers": workers,
        # Kept from one epoch to the next: new workers would copy the dataset again.
        "persistent_workers": workers > 0,
        # Workers end when this process ends, however it ends.
        "worker_init_fn": functools.partial(end_with_rank, os.getpid()),
    }
    # Each process trains on its own 1/world_size of every epoch, shuffled by the
    # sampler. It pads the shares with repeated samples to make them equal.
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    # Each process seeds its own workers: with one seed everywhere, a random
    # augmentation would draw the same numbers in every process.
    train_loader = DataLoader(
        train_set,
        sampler=sampler,
        drop_last=True,
        generator=torch.Generator().manual_seed(args.seed + place.rank),
        **options,
    )
    # Validation counts each sample once: every world_size-th
    # sample, from the rank on, with no padding.
    shard = range(place.rank, len(valid_set), place.world_size)
    # A generator of its own seeds the workers: torch's global random state is left to
    # training alone.
    valid_loader = DataLoader(
        Subset(valid_set, shard), shuffle=False, generator=torch.Generator(), **options
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
        # Without set_epoch, the sampler would shuffle every epoch the same way.
        train_loader.sampler.set_epoch(progress.epoch)
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
        results = validate(model.module, valid_loader, device)
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
        """The numbers since the last report, over all processes; starts anew."""
        mean = self.total / self.steps
        dist.all_reduce(mean)  # a sum over the processes: every one gets it
        mean = mean.item() / dist.get_world_size()
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
    # BatchNorm's running statistics are the one state that DDP leaves different:
    # each process updated them with its own batches. Take rank 0's.
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)
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
    # Each process saw its own shard: add the sums up, and every process has them.
    dist.all_reduce(sums)
    loss, right, n = sums.tolist()
    return {"val_loss": loss / n, "val_accuracy": right / n, "val_samples": int(n)}


if __name__ == "__main__":
    main()
    leave()
