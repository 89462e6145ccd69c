"""Step 4: checkpoints, so that a run outlives preemption, time limits and crashes.

Over step 3: rank 0 saves a checkpoint atomically every --checkpoint-every minutes,
after every epoch, and when Slurm asks the job to stop (SIGUSR1 before the time limit,
SIGTERM at preemption or `scancel`); the newest two are kept. All ranks stop or save
after the same step. After SIGUSR1 the job requeues itself. A job started again under
the same name resumes exactly from the newest checkpoint, part-way through an epoch.

Try the job before the data is in place:
`sbatch --job-name=trial job.sh --synthetic-data --max-steps 50`.
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
from torchvision import models, transforms
from torchvision.datasets import ImageFolder

from checkpoints import Checkpoint
from devices import end_with_rank, get_device, get_num_workers
from ranks import leave, setup
from resumable_data import ResumableSampler, SeededSamples, start_fork_server
from stopping import Agreement, requeue

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
    checkpoint = Checkpoint(args, MAY_CHANGE_ON_RESUME)
    checkpoint.load(model.module, optimizer, scheduler, progress, train_log)
    # From here on there is progress to lose: on SIGUSR1 or SIGTERM, stop and save.
    with Agreement(args.checkpoint_every) as agreement:
        stopped_by = train(args, model, optimizer, scheduler, loaders, progress,
                           train_log, checkpoint, agreement)  # fmt: skip
    if stopped_by:
        saved = "checkpoint saved" if checkpoint.failures == 0 else "save failed"
        log.warning(f"Stopped at step {progress.steps}, {saved}")
        # SIGUSR1 warns of the time limit: requeue. SIGTERM comes as Slurm ends the
        # job (and requeues it, if it preempts it), but not always: see requeue().
        if place.rank == 0:
            requeue(stopped_by, args.max_restarts, args.checkpoint_dir)
        return
    # One plain line per process to grep from the job's output: the numbers agree.
    summary = {
        "rank": place.rank,
        "world_size": place.world_size,
        "host": socket.gethostname(),
        "finished": progress.epoch == args.epochs,  # False after --max-steps
        **asdict(progress),
        "restarts": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
    }
    print(f"summary: {json.dumps(summary)}", flush=True)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    add = parser.add_argument
    add("--epochs", type=positive, default=90)
    add("--batch-size", type=positive, default=128, help="per process")
    add("--learning-rate", type=float, default=1e-3)
    add("--warmup-steps", type=positive, default=500, help="in optimizer steps")
    add("--weight-decay", type=float, default=0.05)
    add("--seed", type=int, default=0)
    add("--max-steps", type=positive, help="steps in all; a later run goes on")
    add("--log-every", type=positive, default=50, help="steps between log lines")
    add("--model", default="resnet50", help="a torchvision model name")
    add("--image-size", type=positive, default=224)
    # A folder with train/ and val/, one subfolder per class.
    add("--data-dir", type=Path, default=os.environ.get("DATA_DIR"))
    add("--synthetic-data", action="store_true", help="random images of the same shape")
    add("--synthetic-size", type=positive, default=100_000)
    add("--synthetic-classes", type=positive, default=1000)
    add("--num-workers", type=int, help="per process (default: its CPUs, less one)")
    add("--rendezvous-timeout", type=float, default=120, help="seconds for all to join")
    # Storage that outlives the job: job.sh sets CHECKPOINT_DIR.
    folder = os.environ.get("CHECKPOINT_DIR", "checkpoints")
    add("--checkpoint-dir", type=Path, default=folder)
    add("--checkpoint-every", type=float, default=30, help="minutes between saves")
    add("--checkpoint-every-steps", type=positive, help="and every this many steps")
    add("--keep-checkpoints", type=positive, default=2, help="the newest kept")
    add("--max-failed-saves", type=positive, default=3, help="in a row, then stop")
    add("--max-restarts", type=int, default=20, help="the most requeues, against loops")
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
    batches: int = 0  # batches of the epoch under way trained on
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
    if workers > 0:  # with none, no server: it would import torch for nothing
        start_fork_server()
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
    sampler = ResumableSampler(train_set, shuffle=True, seed=args.seed)
    # Each process seeds its own workers: with one seed everywhere, a random
    # augmentation would draw the same numbers in every process.
    train_loader = DataLoader(
        SeededSamples(train_set, args.seed),
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
    warmup = args.warmup_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        done = (step - warmup) / max(total - warmup, 1)
        return 0.5 * (1 + math.cos(math.pi * min(done, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def train(args, model, optimizer, scheduler, loaders, progress, train_log, checkpoint,
          agreement):  # fmt: skip
    """Trains for --epochs, or --max-steps, and validates after every epoch, with a
    checkpoint every --checkpoint-every minutes and at each epoch's end; returns 0, or
    the signal that stopped it before, once the checkpoint is saved."""
    train_loader, valid_loader = loaders
    device = next(model.parameters()).device
    max_steps = math.inf if args.max_steps is None else args.max_steps
    resumed = progress.steps > 0  # and so its DDP's buckets in their first order
    while progress.epoch < args.epochs and (
        progress.steps < max_steps or progress.batches
    ):
        # Without set_epoch, the sampler would shuffle every epoch the same way.
        train_loader.sampler.set_epoch(progress.epoch)
        train_loader.sampler.skip = progress.batches * args.batch_size
        model.train()
        early = False  # whether --max-steps stopped the run part-way through the epoch
        for batch in train_loader:
            if progress.steps >= max_steps:
                early = True
                break
            inputs, target = to_device(batch, device)
            if resumed:
                order_buckets_as_before(model, inputs, target)
                resumed = False
            loss = loss_fn(model(inputs), target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            progress.steps += 1
            progress.batches += 1
            train_log.add(loss)
            if progress.steps % args.log_every == 0:
                log_line(progress, train_log, scheduler)
            # A save every --checkpoint-every minutes: a crash, which sends no signal,
            # loses the steps since the last one only.
            stop, save = agreement.poll()
            if stop or save or checkpoint.due(progress.steps):
                checkpoint.save(model.module, optimizer, scheduler, progress, train_log)
                agreement.saved()
            if stop:
                return stop
        if train_log.steps and not early:  # the steps since the last line
            log_line(progress, train_log, scheduler)
        log.info(f"Epoch {progress.epoch}: validation")
        results = validate(model.module, valid_loader, device, agreement)
        if results is None:  # a stop during validation: the next run validates
            checkpoint.save(model.module, optimizer, scheduler, progress, train_log)
            return agreement.stop
        for name, value in results.items():
            setattr(progress, name, value)
        log.info(
            f"Epoch {progress.epoch}: val loss {progress.val_loss:.3f}, val accuracy "
            f"{progress.val_accuracy:.2%} on {progress.val_samples} samples"
        )
        if early:
            # The epoch is not done: a later run with a higher --max-steps, or none,
            # goes on from this checkpoint, part-way through it, as after a signal.
            checkpoint.save(model.module, optimizer, scheduler, progress, train_log)
            break
        progress.epoch += 1
        progress.batches = 0
        checkpoint.save(model.module, optimizer, scheduler, progress, train_log)
        agreement.saved()
    if progress.epoch < args.epochs:
        log.warning(
            f"Stopped by --max-steps {args.max_steps} after step {progress.steps}, "
            f"with {progress.epoch} of {args.epochs} epochs done: training is not "
            "finished. To go on, run again under the same job name without --max-steps."
        )
    return 0


def order_buckets_as_before(model, inputs, target: Tensor):
    """Makes a resumed run's DDP sum the gradients in the order an uninterrupted run's
    does. DDP's first step sums its buckets in the parameters' order, later steps in the
    order of the first backward pass; with 3 processes or more, the two round apart.
    This backward pass records the second order. What it changes besides (BatchNorm's
    statistics, dropout's random numbers, the gradients) is put back."""
    buffers = [buffer.clone() for buffer in model.module.buffers()]
    device = target.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        loss_fn(model(inputs), target).backward()
    for buffer, saved in zip(model.module.buffers(), buffers, strict=True):
        buffer.copy_(saved)
    model.zero_grad(set_to_none=True)


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
def validate(model: nn.Module, loader: DataLoader, device: torch.device, agreement):
    """The mean loss and accuracy over every validation sample, and their count; or
    None if a rank was told to stop: all check after each batch that all shards have."""
    shard = len(loader.dataset.dataset) // dist.get_world_size()  # the smallest one
    stop_checks = shard // loader.batch_size
    # BatchNorm's running statistics are the one state that DDP leaves different:
    # each process updated them with its own batches. Take rank 0's.
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)
    model.eval()
    # Sums, not means, so that a smaller last batch weighs exactly its size: loss,
    # right predictions and samples, in float64 to keep the counts exact.
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    for i, batch in enumerate(loader):
        inputs, target = to_device(batch, device)
        output = model(inputs)
        n = target.numel()  # samples; tokens, where each token has a target
        sums[0] += loss_fn(output, target).double() * n
        sums[1] += correct(output, target)
        sums[2] += n
        if i < stop_checks and agreement.poll()[0]:
            return None
    # Each process saw its own shard: add the sums up, and every process has them.
    dist.all_reduce(sums)
    loss, right, n = sums.tolist()
    return {"val_loss": loss / n, "val_accuracy": right / n, "val_samples": int(n)}


# The arguments that a resumed run may change: where things are, how often it logs and
# saves, how long it trains. Every other one shapes training, your own arguments
# included: a checkpoint written with another value of one belongs to another run.
MAY_CHANGE_ON_RESUME = {
    "epochs", "max_steps", "log_every", "data_dir", "num_workers", "rendezvous_timeout",
    "checkpoint_dir", "checkpoint_every", "checkpoint_every_steps", "keep_checkpoints",
    "max_failed_saves", "max_restarts",
}  # fmt: skip


if __name__ == "__main__":
    main()
    leave()
