"""A realistic program to adapt: an image classifier, fast on one GPU before many.

This is the Mila page's multi-node program (examples/mila/multi_node), made to fit any
cluster and any image dataset, with what a long run on GPUs needs:

- the data: any folder with train/ and val/, one subfolder of images
  per class, as torchvision's ImageFolder reads them;
  `--synthetic-data` trains on random images of the same shape instead;
- any launcher: srun, torchrun, or `python main.py` alone; under srun, RANK, LOCAL_RANK
  and WORLD_SIZE are set from srun's variables, for libraries that read them;
- bf16 autocast on GPUs that support it (compute capability 8.0 and newer);
  channels_last and cuDNN's autotuner on GPUs; CPUs train in fp32 as before;
- pinned memory, copies that do not block, and DataLoader workers kept across epochs;
- gradient accumulation, with DDP's no_sync() on every micro-batch but the last;
- a learning rate that warms up linearly, then decays along a cosine;
- a log line every --log-every steps: loss, learning rate,
  samples/s per process and in total, and the share of time
  spent waiting for data, with no wait for the GPU in between;
- `--benchmark N`: samples/s of the input pipeline alone and of the training step alone,
  on a batch already on the GPU (the ceiling), instead of training.

For your own model and data, change build_model() and make_datasets(); the rest stays.
Try the job before staging any data with
`sbatch job.sh --synthetic-data --max-steps 200`.
"""

import argparse
import contextlib
import gc
import json
import logging
import math
import multiprocessing
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms
from torchvision.datasets import ImageFolder

logger = logging.getLogger(__name__)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=positive, default=90)
    # The batch size per process and micro-batch: each optimizer step trains on
    # batch_size * accumulation_steps * world_size samples in all.
    parser.add_argument("--batch-size", type=positive, default=128)
    parser.add_argument("--accumulation-steps", type=positive, default=1)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument(
        "--warmup-steps", type=positive, default=500, help="in optimizer steps"
    )
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-steps", type=positive, default=None, help="stop after this many"
    )
    parser.add_argument(
        "--log-every", type=positive, default=50, help="steps between log lines"
    )
    parser.add_argument("--model", default="resnet50", help="a torchvision model name")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=os.environ.get("DATA_DIR"),
        help=(
            "a folder with train/ and val/, one subfolder per class "
            "(default: $DATA_DIR)"
        ),
    )
    parser.add_argument(
        "--synthetic-data",
        action="store_true",
        help="train on random images of the same shape instead of the dataset",
    )
    parser.add_argument("--synthetic-size", type=int, default=100_000)
    parser.add_argument("--synthetic-classes", type=int, default=1000)
    # Speed settings. Each can be turned off, to measure what it buys (--benchmark).
    parser.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bf16 autocast (default: on GPUs of compute capability 8.0 and newer)",
    )
    parser.add_argument(
        "--channels-last", action=argparse.BooleanOptionalAction, default=True
    )
    parser.add_argument(
        "--cudnn-benchmark", action=argparse.BooleanOptionalAction, default=True
    )
    parser.add_argument(
        "--pin-memory", action=argparse.BooleanOptionalAction, default=True
    )
    parser.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=False
    )
    parser.add_argument(
        "--num-workers",
        type=int,
        default=None,
        help="per process (default: its CPUs, less one)",
    )
    parser.add_argument(
        "--benchmark",
        type=positive,
        metavar="N",
        default=None,
        help=(
            "time N batches of the input pipeline, then N training steps, "
            "instead of training"
        ),
    )
    args = parser.parse_args()

    rank, local_rank, world_size = setup()
    is_master = rank == 0
    device = get_device(local_rank)

    # A batch job's output is a file: plain lines with a
    # time stamp read better there than a progress bar.
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s [{rank}/{world_size}] %(message)s",
        datefmt="%H:%M:%S",
    )
    logger.info(
        f"Running on {socket.gethostname()}, device {device}; "
        f"RANK={os.environ['RANK']} LOCAL_RANK={os.environ['LOCAL_RANK']} "
        f"WORLD_SIZE={os.environ['WORLD_SIZE']}"
    )
    speed = speed_settings(args, device)
    if is_master:
        logger.info(f"Speed settings: {json.dumps(speed)}")

    train_dataset, valid_dataset, num_classes = make_datasets(args)
    # DDP copies rank 0's initial weights to every process,
    # so the seed matters on rank 0 only.
    torch.manual_seed(args.seed)
    model = build_model(args.model, num_classes).to(
        device, memory_format=memory_format(speed)
    )
    model = DistributedDataParallel(
        model, device_ids=[device] if device.type == "cuda" else None
    )
    # torch.compile traces the DDP model, and splits its graph where
    # DDP's gradient buckets end, so that communication still overlaps
    # the backward pass. The first steps are slow: compiling.
    train_model = torch.compile(model) if speed["compile"] else model
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay
    )

    train_sampler = DistributedSampler(train_dataset, shuffle=True, seed=args.seed)
    # Validation counts each sample once: every world_size-th sample, with no padding.
    valid_shard = Subset(valid_dataset, range(rank, len(valid_dataset), world_size))
    # DataLoader workers start from a fork server, a clean process, rather than by
    # fork() of this one. The process group's threads enter Python briefly now and then;
    # on Python up to 3.11.9, a fork at such a moment leaves the worker deadlocked
    # before it starts. (It is Python 3.14's default.) The server imports torch once,
    # and its workers start at once.
    multiprocessing.set_start_method("forkserver", force=True)
    multiprocessing.set_forkserver_preload(["torch", "torchvision"])
    loader_options = {
        "batch_size": args.batch_size,
        "num_workers": speed["num_workers"],
        # Pinned (page-locked) host memory lets a copy to the GPU run without blocking
        # this process, which can then prepare the next step while the copy runs.
        "pin_memory": speed["pin_memory"],
        # Workers that stay from one epoch to the next keep their copy of the dataset:
        # no new ones start, each copying it again, at every epoch.
        "persistent_workers": speed["num_workers"] > 0,
    }
    # Each process seeds its own workers: with one seed everywhere, a random
    # augmentation would draw the same numbers in every process.
    train_dataloader = DataLoader(
        train_dataset,
        sampler=train_sampler,
        drop_last=True,
        generator=torch.Generator().manual_seed(args.seed + rank),
        **loader_options,
    )
    valid_dataloader = DataLoader(valid_shard, shuffle=False, **loader_options)

    if args.benchmark is not None:
        record = benchmark(
            train_model, optimizer, train_dataloader, device, speed, args.benchmark
        )
        record.update(rank=rank, world_size=world_size, model=args.model)
        record.update(image_size=args.image_size, batch_size=args.batch_size)
        print(f"benchmark: {json.dumps(record)}", flush=True)
        return

    steps_per_epoch = len(train_dataloader) // args.accumulation_steps
    if steps_per_epoch == 0:
        raise SystemExit(
            f"error: {len(train_dataset)} training samples make no optimizer step of "
            f"{args.batch_size} x {args.accumulation_steps} per process, x "
            f"{world_size} processes. Lower --batch-size or --accumulation-steps."
        )
    total_steps = args.epochs * steps_per_epoch
    if args.max_steps is not None:
        total_steps = min(total_steps, args.max_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_then_cosine(args.warmup_steps, total_steps)
    )
    if is_master:
        logger.info(
            f"Global batch: {args.batch_size} x {args.accumulation_steps} accumulation "
            f"steps x {world_size} processes = "
            f"{args.batch_size * args.accumulation_steps * world_size}; "
            f"{steps_per_epoch} steps per epoch, {total_steps} in all"
        )

    step = 0
    meter = ThroughputMeter(device)
    first_loss = last_loss = None
    for epoch in range(args.epochs):
        # Without set_epoch, the sampler would shuffle the
        # data the same way in every epoch.
        train_sampler.set_epoch(epoch)
        model.train()
        batches = iter(train_dataloader)
        for _ in range(steps_per_epoch):
            micro_batches = []
            for _ in range(args.accumulation_steps):
                with meter.waiting_for_data():
                    micro_batches.append(next(batches))
            loss = accumulate_gradients(
                model, train_model, micro_batches, device, speed
            )
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            meter.add(loss, samples=args.batch_size * args.accumulation_steps)
            end_of_epoch = step == total_steps or step % steps_per_epoch == 0
            if step % args.log_every == 0 or end_of_epoch:
                report = meter.report(world_size)
                first_loss = report["loss"] if first_loss is None else first_loss
                last_loss = report["loss"]
                if is_master:
                    logger.info(
                        f"epoch {epoch} step {step}/{total_steps} | loss "
                        f"{report['loss']:.4f} | lr {scheduler.get_last_lr()[0]:.2e} | "
                        f"{report['samples_per_s']:.1f} samples/s per process, "
                        f"{report['total_samples_per_s']:.1f} in total | waiting for "
                        f"data {report['data_wait']:.0%}"
                    )
            if step == total_steps:
                break

        logger.info(f"Epoch {epoch}: validation")
        val_loss, val_accuracy, val_samples = validation_loop(
            model.module, valid_dataloader, device, speed
        )
        if is_master:
            logger.info(
                f"Epoch {epoch}: val loss {val_loss:.3f}, val accuracy "
                f"{val_accuracy:.2%} on {val_samples} samples"
            )
        if step == total_steps:
            break
        # The next log line counts training only, not this validation.
        meter.start()

    # One plain line per process to grep from the job's
    # output: the numbers should agree.
    summary = {
        "rank": rank,
        "world_size": world_size,
        "host": socket.gethostname(),
        "steps": step,
        "first_loss": first_loss,
        "last_loss": last_loss,
        "val_loss": val_loss,
        "val_accuracy": val_accuracy,
        "val_samples": val_samples,
    }
    print(f"summary: {json.dumps(summary)}", flush=True)


def positive(text: str) -> int:
    """An argument that must be a whole number above zero,
    or argparse stops with the reason."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


def build_model(name: str, num_classes: int) -> nn.Module:
    """The network to train. Replace this function for your own model."""
    return models.get_model(name, num_classes=num_classes)


def make_datasets(args):
    """The training and validation sets, and the number of classes.

    Replace this function for your own data: any map-style
    Dataset of (input, label) works.
    """
    if args.synthetic_data:
        size, classes = args.synthetic_size, args.synthetic_classes
        train = SyntheticImages(size, classes, args.image_size, first_seed=0)
        valid = SyntheticImages(
            max(size // 50, 1), classes, args.image_size, first_seed=size
        )
        return train, valid, classes
    # Every process checks, so that all of them stop with the message.
    check_dataset(args.data_dir)
    normalize = transforms.Normalize(
        mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]
    )
    train = ImageFolder(
        args.data_dir / "train",
        transforms.Compose(
            [
                transforms.RandomResizedCrop(args.image_size),
                transforms.RandomHorizontalFlip(),
                transforms.ToTensor(),
                normalize,
            ]
        ),
    )
    valid = ImageFolder(
        args.data_dir / "val",
        transforms.Compose(
            [
                # 256/224: the usual margin cropped away
                # around the centre for evaluation.
                transforms.Resize(args.image_size * 8 // 7),
                transforms.CenterCrop(args.image_size),
                transforms.ToTensor(),
                normalize,
            ]
        ),
    )
    if train.classes != valid.classes:
        raise SystemExit(
            f"error: {args.data_dir}/train and {args.data_dir}/val have different "
            f"class folders ({len(train.classes)} and {len(valid.classes)}): labels "
            "would not match."
        )
    return train, valid, len(train.classes)


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
            f"error: {data_dir} has no {' or '.join(missing)} folder. The dataset must "
            "be laid out as train/<class>/<image> and val/<class>/<image>; check "
            "DATA_DIR in job.sh (and the variables it is made of, such as $SCRATCH), "
            "or pass --data-dir.\nTo try the job without a dataset, add "
            "--synthetic-data."
        )


class SyntheticImages(Dataset):
    """Random images of the real data's shape after
    transforms: 3 x size x size, normalized.

    Each class has its own tint, so the loss falls as in a real run. Image `i` comes
    from its own seed: the same in every epoch and every process.
    """

    def __init__(self, length: int, classes: int, size: int, first_seed: int):
        self.length, self.classes, self.size, self.first_seed = (
            length,
            classes,
            size,
            first_seed,
        )
        self.tints = torch.randn(
            classes, 3, 1, 1, generator=torch.Generator().manual_seed(0)
        )

    def __len__(self):
        return self.length

    def __getitem__(self, index: int):
        label = index % self.classes
        generator = torch.Generator().manual_seed(self.first_seed + index)
        noise = torch.randn(3, self.size, self.size, generator=generator)
        return 0.5 * noise + self.tints[label], label


def speed_settings(args, device: torch.device) -> dict:
    """The speed settings that apply on this device; GPU-only ones stay off on CPUs."""
    cuda = device.type == "cuda"
    bf16_ok = cuda and torch.cuda.get_device_capability(device) >= (8, 0)
    if args.bf16 and not bf16_ok:
        raise SystemExit(
            "error: --bf16 asks for bf16 autocast, which needs a GPU of compute "
            "capability 8.0 or newer (A100, H100, RTX 30xx and later); this process "
            f"has {device}"
            + (f" ({torch.cuda.get_device_name(device)})" if cuda else "")
            + ". Leave it out to train in fp32."
        )
    # Convolutions on recent GPUs run fastest with channels last in memory (NHWC).
    channels_last = cuda and args.channels_last
    # cuDNN times several algorithms for each new input shape, then keeps the fastest.
    # With fixed image sizes, that costs a few slow steps at the start only.
    torch.backends.cudnn.benchmark = cuda and args.cudnn_benchmark
    return {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "bf16": bf16_ok if args.bf16 is None else args.bf16,
        "channels_last": channels_last,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "pin_memory": cuda and args.pin_memory,
        "compile": args.compile,
        "num_workers": get_num_workers()
        if args.num_workers is None
        else args.num_workers,
    }


def memory_format(speed: dict) -> torch.memory_format:
    return torch.channels_last if speed["channels_last"] else torch.contiguous_format


def to_device(batch, device: torch.device, speed: dict) -> tuple[Tensor, Tensor]:
    x, y = batch
    # non_blocking: from pinned memory the copy runs alongside the work already queued.
    x = x.to(device, non_blocking=True, memory_format=memory_format(speed))
    return x, y.to(device, non_blocking=True)


def accumulate_gradients(
    model: DistributedDataParallel, train_model: nn.Module, micro_batches, device, speed
) -> Tensor:
    """Forward and backward over each micro-batch; returns
    their mean loss, on the device.

    The gradients add up across micro-batches. DDP averages
    them across processes during the backward pass of the last
    micro-batch only: inside no_sync() it keeps them local.
    """
    total = torch.zeros((), device=device)
    for i, batch in enumerate(micro_batches):
        x, y = to_device(batch, device, speed)
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            # Autocast covers the forward pass; backward
            # runs in the forward's precisions.
            with torch.autocast(
                device.type, dtype=torch.bfloat16, enabled=speed["bf16"]
            ):
                loss = F.cross_entropy(train_model(x), y)
            # Each micro-batch weighs 1/n, so the sum is the mean over the whole batch.
            (loss / len(micro_batches)).backward()
        total += loss.detach()
    return total / len(micro_batches)


def warmup_then_cosine(warmup_steps: int, total_steps: int):
    """The learning rate's factor at each step: a linear
    rise, then a cosine decay to zero."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(total_steps - warmup_steps, 1)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return factor


class ThroughputMeter:
    """Sums what the log reports between two log lines, without waiting for the GPU.

    The losses stay on the GPU until report(): a .item() on every step would make this
    process wait for the GPU each time, instead of queuing the next step's work.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.start()

    def start(self):
        self.loss_sum = torch.zeros((), device=self.device)
        self.steps = self.samples = 0
        self.data_wait = 0.0
        self.started = time.perf_counter()

    @contextlib.contextmanager
    def waiting_for_data(self):
        begin = time.perf_counter()
        yield
        self.data_wait += time.perf_counter() - begin

    def add(self, loss: Tensor, samples: int):
        self.loss_sum += loss
        self.steps += 1
        self.samples += samples

    def report(self, world_size: int) -> dict:
        """Means over the steps since the last report and
        over all processes; starts anew."""
        # The GPU may still run steps that this process
        # queued: the time counts until they end.
        synchronize(self.device)
        elapsed = time.perf_counter() - self.started
        # One all_reduce for everything, once per report.
        sums = torch.tensor(
            [0.0, self.samples / elapsed, self.data_wait / elapsed], device=self.device
        )
        sums[0] = self.loss_sum / self.steps
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        loss, total_rate, data_wait = sums.tolist()
        self.start()
        return {
            "loss": loss / world_size,
            "samples_per_s": total_rate / world_size,
            "total_samples_per_s": total_rate,
            "data_wait": data_wait / world_size,
        }


def benchmark(train_model, optimizer, dataloader, device, speed: dict, n: int) -> dict:
    """Samples/s of the input pipeline alone, then of the training step alone.

    The first is what the DataLoader delivers to the GPU, with no training; the second
    trains on one batch already on the GPU, again and again: the ceiling, which no input
    pipeline can beat. Training runs at about the smaller of the two.
    """
    # Untimed: the workers start, and the batches they prefetch (two each) are taken, so
    # that the timed ones are those the workers make while they are timed.
    untimed = max(2 * dataloader.num_workers, 1)
    if len(dataloader) < untimed + n:
        raise SystemExit(
            f"error: --benchmark {n} times {n} batches after {untimed} untimed ones, "
            f"but the training set has {len(dataloader)} batches of "
            f"{dataloader.batch_size}. Ask for fewer."
        )
    batches = iter(dataloader)
    for _ in range(untimed):
        x, y = to_device(next(batches), device, speed)
    synchronize(device)
    begin = time.perf_counter()
    for _ in range(n):
        to_device(next(batches), device, speed)
    synchronize(device)
    input_rate = n * dataloader.batch_size / (time.perf_counter() - begin)
    del batches

    train_model.train()

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=speed["bf16"]):
            loss = F.cross_entropy(train_model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # Untimed: cuDNN's autotuner and torch.compile do their work in the first steps.
    for _ in range(3):
        step()
    synchronize(device)
    begin = time.perf_counter()
    for _ in range(n):
        step()
    synchronize(device)
    step_rate = n * dataloader.batch_size / (time.perf_counter() - begin)
    record = dict(speed)
    record.update(input_samples_per_s=input_rate, step_samples_per_s=step_rate)
    if device.type == "cuda":
        record["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return record


def synchronize(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def setup():
    """Joins the process group, whoever started this process; returns its place.

    Under srun, RANK, LOCAL_RANK and WORLD_SIZE are set from srun's
    variables, as torchrun sets them: libraries that read them
    (Accelerate, the Hugging Face Trainer) then find their place.
    """
    rank, local_rank, world_size, launcher = find_place()
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size)
    )
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
        # env:// reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT.
        dist.init_process_group(backend, init_method="env://")
    return rank, local_rank, world_size


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
def validation_loop(
    model: nn.Module, dataloader: DataLoader, device: torch.device, speed: dict
):
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
    for batch in dataloader:
        x, y = to_device(batch, device, speed)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=speed["bf16"]):
            logits: Tensor = model(x)
        sums[0] += F.cross_entropy(logits.float(), y, reduction="sum")
        sums[1] += logits.argmax(-1).eq(y).sum()
        sums[2] += y.shape[0]
    # Each process saw its own shard: add the sums up, and
    # every process gets the totals.
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    total_loss, correct, n_samples = sums.tolist()
    return total_loss / n_samples, correct / n_samples, int(n_samples)


def get_num_workers() -> int:
    """DataLoader workers: this process's share of its
    task's CPUs, less one for the process."""
    # The CPUs that Slurm bound the task to. Where a site does not
    # bind tasks to CPUs, that is the whole node: keep to what the
    # job asked for as well. (macOS has no affinity: all its CPUs.)
    affinity = getattr(os, "sched_getaffinity", None)
    cpus = len(affinity(0)) if affinity else (os.cpu_count() or 1)
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
