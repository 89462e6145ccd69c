"""Lightning: step 3 trained by PyTorch Lightning's Trainer, with its Slurm support.

Over step 3 (examples/generic/multi_node), the training loop becomes a LightningModule
and Lightning's Trainer runs it: backward, the optimizer and scheduler steps, DDP and
validation. The model, data and loss are step 3's. Two parts of step 3 stay, on purpose:

- setup() forms the process group before the Trainer would. Lightning would meet at
  MASTER_ADDR with rank 0 serving there, and on Slurm 26.05 with a topology.conf,
  rank 0 need not run on that node: the job would hang. Lightning uses a group that
  exists.
- the loaders: step 3's sampler, and a validation that counts every sample once
  (Lightning's own sampler would repeat samples to even out the shares).

Lightning's Slurm support (SLURMEnvironment) reads each task's place from srun, and
stops when --ntasks-per-node differs from the Trainer's `devices`. Its own requeue is
off: at SIGUSR1 it saves a checkpoint in the signal handler, wherever each process is,
and a process held in another collective operation never joins the save. Instead, at
SIGUSR1 (job.sh asks for it before the time limit) or SIGTERM, StopAtSignal saves at one
step in every process, as checkpoint-<n>.ckpt, and stops; after SIGUSR1, job.sh requeues
the job. Lightning resumes from that file, restarting the epoch's batches (the page says
what that loses).

Try the job before the data is in place:
`sbatch job.sh --synthetic-data --max-steps 50`.
"""

import argparse
import functools
import json
import logging
import math
import multiprocessing
import os
import signal
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.environments import SLURMEnvironment
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms
from torchvision.datasets import ImageFolder

from devices import end_with_rank, get_device, get_num_workers, use_gpus
from ranks import find_place, leave, setup

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
    # The process group first, met as in step 3: Lightning then uses it.
    place = setup(args.rendezvous_timeout)
    get_device(place.local_rank)  # stops if this process has no GPU of its own
    # Plain lines with a time stamp and the rank: a batch job's output is a file.
    line = f"%(asctime)s [{place.rank}/{place.world_size}] %(message)s"
    logging.basicConfig(level=logging.INFO, format=line, datefmt="%H:%M:%S")

    train_set, valid_set, num_classes = make_datasets(args)
    # DDP copies rank 0's initial weights to all: the seed matters on rank 0 only.
    torch.manual_seed(args.seed)
    model = build_model(args, num_classes)
    loaders = make_loaders(args, train_set, valid_set, place)
    classifier = Classifier(args, model, steps_per_epoch=len(loaders[0]))
    stopper = StopAtSignal(args.checkpoint_dir)
    trainer = make_trainer(args, place, stopper)
    # Lightning's device: the GPU of the local rank, the one get_device() chose.
    device = trainer.strategy.root_device
    log.info(f"Running on {socket.gethostname()}, device {device}")
    # From here on, only rank 0 logs (modules too): all processes hold the same numbers.
    logging.getLogger().setLevel(logging.INFO if place.rank == 0 else logging.WARNING)
    global_batch = args.batch_size * place.world_size
    log.info(f"Global batch: {args.batch_size} x {place.world_size} = {global_batch}")
    # Resumes from the checkpoint of the last stop, if there is one.
    trainer.fit(classifier, *loaders, ckpt_path=stopper.checkpoint())
    if stopper.stopped:
        return  # job.sh requeues the job: the next run resumes from the checkpoint
    # Where --max-steps stops training within an epoch, Lightning skips that epoch's
    # validation. Step 3 validates at the stop: so does this.
    if classifier.validated_at != trainer.global_step:
        trainer.validate(classifier, loaders[1], verbose=False)
    # One plain line per process to grep from the job's output: the numbers agree.
    summary = {
        "rank": place.rank,
        "world_size": place.world_size,
        "host": socket.gethostname(),
        **asdict(classifier.progress),
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
    add("--rendezvous-timeout", type=float, default=120, help="seconds for all to join")
    # StopAtSignal's checkpoints, checkpoint-<n>.ckpt, and Lightning's files. job.sh
    # sets it.
    add("--checkpoint-dir", type=Path, default=os.environ.get("CHECKPOINT_DIR", "."))
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


def make_trainer(args, place, stopper: "StopAtSignal") -> L.Trainer:
    """Lightning's Trainer, for the processes that srun started: one per GPU."""
    nodes = int(os.environ.get("SLURM_NNODES", "1"))
    # The GPUs the job holds on each node; Lightning stops unless --ntasks-per-node is
    # the same. Without GPUs, the tasks per node.
    devices = int(os.environ.get("SLURM_GPUS_ON_NODE", place.world_size // nodes))
    # Lightning's Slurm support, for the place from srun's variables; its requeue off
    # (StopAtSignal does it). Named here, so that it holds whatever the job's name
    # (Lightning ignores Slurm in jobs named "bash" or "interactive").
    under_srun = find_place()[1] == "srun"
    plugins = [SLURMEnvironment(auto_requeue=False)] if under_srun else []
    return L.Trainer(
        accelerator="gpu" if use_gpus() else "cpu",
        devices=devices,
        num_nodes=nodes,
        strategy="ddp",
        plugins=plugins,
        callbacks=[stopper],
        max_epochs=args.epochs,
        max_steps=-1 if args.max_steps is None else args.max_steps,
        # make_loaders() shards the data; Lightning's sampler would pad validation.
        use_distributed_sampler=False,
        default_root_dir=args.checkpoint_dir,
        # No logger, progress bar, checks or checkpoints of its own: the log lines are
        # Classifier's, and the checkpoints StopAtSignal's (add a ModelCheckpoint
        # callback for more).
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )


class StopAtSignal(L.Callback):
    """At SIGUSR1 (job.sh asks for it before the time limit) or SIGTERM (preemption,
    scancel, the time limit itself): a checkpoint that Lightning resumes from, saved at
    one step in every process, then a stop. After SIGUSR1, a `requeue` mark for job.sh,
    which requeues the job; after SIGTERM, Slurm decides."""

    def __init__(self, checkpoint_dir: Path):
        self.checkpoint_dir = checkpoint_dir
        self.signal = 0  # the stop signal received, if any
        self.stopped = False
        self.on_train_start()

    def on_train_start(self, trainer=None, module=None):
        # Again once Lightning has set its own handlers: its SIGTERM handler runs a
        # collective inside the handler, wherever each process is.
        for signum in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(signum, self.note)

    on_validation_start = on_train_start  # for trainer.validate() too

    def note(self, signum, frame):
        self.signal = max(self.signal, signum)  # a flag only: no collective here

    def checkpoint(self) -> Path | None:
        """The newest checkpoint, checkpoint-<n>.ckpt, if any. (Not Lightning's name,
        hpc_ckpt_<n>.ckpt, which its validate() would load in place of the weights.)"""
        found = self.checkpoint_dir.glob("checkpoint-*.ckpt")
        return max(found, key=lambda p: int(p.stem.rpartition("-")[2]), default=None)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        # Whether any process was signalled, and SIGTERM (15) over SIGUSR1 (10): one
        # reduction, at this step in every process. (.item() waits for the GPU, as
        # Lightning already does at every step.)
        received = torch.tensor(float(self.signal), device=module.device)
        dist.all_reduce(received, op=dist.ReduceOp.MAX)
        if received.item() == 0:
            return
        # Written whole under another name first, so that a stop during the save
        # loses nothing.
        last = self.checkpoint()
        number = 1 if last is None else int(last.stem.rpartition("-")[2]) + 1
        path = self.checkpoint_dir / f"checkpoint-{number}.ckpt"
        partial = self.checkpoint_dir / "saving.tmp"
        trainer.save_checkpoint(partial)  # rank 0 writes; every process waits
        if trainer.is_global_zero:
            with open(partial, "rb") as written:
                os.fsync(written.fileno())  # on disk before its name says it is whole
            os.replace(partial, path)
            for old in self.checkpoint_dir.glob("checkpoint-*.ckpt"):
                if old != path:
                    old.unlink()
            if received.item() == signal.SIGUSR1:
                (self.checkpoint_dir / "requeue").touch()
        name = signal.Signals(int(received.item())).name
        log.info(f"Stopped at step {trainer.global_step} ({name}), checkpoint: {path}")
        # Lightning validates at any early stop, unless it is off: no time for that.
        trainer.limit_val_batches = 0
        trainer.should_stop = self.stopped = True


class Classifier(L.LightningModule):
    """Step 3's training, as Lightning's hooks: the loss of a batch, the optimizer and
    its schedule, and validation sums. Lightning calls them in step 3's order."""

    def __init__(self, args, model: nn.Module, steps_per_epoch: int):
        super().__init__()
        self.args, self.model, self.steps_per_epoch = args, model, steps_per_epoch
        self.progress = Progress()
        self.validated_at = None  # the step of the last validation

    def configure_optimizers(self):
        args = self.args
        optimizer = torch.optim.AdamW(
            self.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay
        )
        scheduler = make_scheduler(args, optimizer, self.steps_per_epoch)
        # "step": the learning rate moves at every optimizer step, not every epoch.
        return [optimizer], [{"scheduler": scheduler, "interval": "step"}]

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        return to_device(batch, device)

    def on_fit_start(self):
        self.train_log = TrainLog(self.device)

    def training_step(self, batch, batch_idx):
        inputs, target = batch
        loss = loss_fn(self.model(inputs), target)
        self.train_log.add(loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.progress.steps = self.global_step
        if self.global_step % self.args.log_every == 0:
            log_line(self.progress, self.train_log, self.lr_schedulers())

    def on_validation_epoch_start(self):
        if self.train_log.steps:  # the steps since the last line, at the epoch's end
            log_line(self.progress, self.train_log, self.lr_schedulers())
        log.info(f"Epoch {self.progress.epoch}: validation")
        # BatchNorm's running statistics differ between processes: take rank 0's.
        for buffer in self.model.buffers():
            dist.broadcast(buffer, src=0)
        # Sums over the samples, in float64: loss, right predictions, samples.
        self.sums = torch.zeros(3, dtype=torch.float64, device=self.device)

    def validation_step(self, batch, batch_idx):
        inputs, target = batch
        output = self.model(inputs)
        n = target.numel()  # samples; tokens, where each token has a target
        self.sums[0] += loss_fn(output, target).double() * n
        self.sums[1] += correct(output, target)
        self.sums[2] += n

    def on_validation_epoch_end(self):
        dist.all_reduce(self.sums)  # every process's shard, added up
        loss, right, n = self.sums.tolist()
        progress = self.progress
        progress.val_loss, progress.val_accuracy = loss / n, right / n
        progress.val_samples = int(n)
        self.validated_at = self.global_step
        log.info(
            f"Epoch {progress.epoch}: val loss {progress.val_loss:.3f}, val accuracy "
            f"{progress.val_accuracy:.2%} on {progress.val_samples} samples"
        )

    def on_train_epoch_end(self):
        self.progress.epoch = self.current_epoch + 1

    # The summary's numbers travel with Lightning's checkpoint, for a resumed run.
    def on_save_checkpoint(self, checkpoint: dict):
        checkpoint["progress"] = asdict(self.progress)

    def on_load_checkpoint(self, checkpoint: dict):
        self.progress = Progress(**checkpoint["progress"])


def start_fork_server():
    """Starts the fork server of the DataLoader workers with the stop signals blocked:
    Slurm signals every process of a step, and a worker killed by one would fail this
    process before it could save."""
    stop_signals = {signal.SIGTERM, signal.SIGUSR1}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    try:
        # The fork server needs multiprocessing's resource tracker, whose start unblocks
        # SIGTERM again: start the tracker first, then block once more.
        multiprocessing.resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stop_signals)


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


if __name__ == "__main__":
    main()
    leave()
