"""Multi-node training that survives preemption and time
limits: checkpoints and requeue.

Over multi_node:
- rank 0 writes a checkpoint atomically at the end of every epoch and whenever the job
  is told to stop. It holds all that is needed to continue exactly: model, optimizer,
  epoch, step, the numbers the summary reports, and each rank's random state;
- a job that starts again, requeued or resubmitted under the same job name, resumes from
  the latest checkpoint, part-way through an epoch if need be;
- on SIGUSR1, which job.sh asks Slurm to send before the time limit, or SIGTERM
  (preemption, `scancel`, `scontrol requeue`), all ranks stop at the same step, or
  validation batch, and rank 0 saves. After SIGUSR1, rank 0 also puts the job back in
  the queue, unless the job would loop (--max-restarts);
- the DataLoader workers' fork server starts with both signals blocked, so that Slurm's
  signals do not kill the workers, and reach the training processes alone.

Try the job before staging any data, as a run of its own name:
`sbatch --job-name=trial job.sh --synthetic-data --max-steps 50`.
"""

import argparse
import gc
import itertools
import json
import logging
import math
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import signal
import socket
import subprocess
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

# The signal that asked this process to stop, or 0. Signal handlers only note it: the
# training loop acts on it between steps, where every rank can stop at the same point.
stop_signal = 0


def note_stop_signal(signum, frame):
    global stop_signal
    # SIGTERM wins over SIGUSR1: the job is ending anyway, and a requeue would fail.
    stop_signal = max(stop_signal, signum)


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
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=Path(os.environ.get("CHECKPOINT_DIR", "checkpoints")),
        help=(
            "shared storage that outlives the job "
            "(default: $CHECKPOINT_DIR, set by job.sh)"
        ),
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=20,
        help="requeue the job at most this often: a guard against a job that loops",
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
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay
    )
    # Where this run starts: the latest checkpoint's position, or the beginning.
    checkpoint_path = args.checkpoint_dir / "checkpoint.pt"
    # The settings that shape training. A checkpoint written
    # with others belongs to another run, a trial run on
    # synthetic data, say: resuming from it would mix the two.
    settings = {
        name: getattr(args, name)
        for name in (
            "synthetic_data", "synthetic_size", "batch_size", "learning_rate",
            "weight_decay", "seed",
        )
    }  # fmt: skip
    # Besides the position, the progress holds what the
    # summary reports, kept across restarts.
    progress = {
        "epoch": 0,
        "step": 0,
        "epoch_step": 0,
        "first_loss": None,
        "last_loss": None,
        "val": [None, None, None],
    }
    if checkpoint_path.exists():
        progress = load_checkpoint(
            checkpoint_path, model, optimizer, rank, world_size, settings
        )
        logger.info(f"Resumed from {checkpoint_path} at step {progress['step']}")
    # DDP averages the gradients across processes during backward(),
    # so every copy of the model takes the same optimizer step. Keep
    # `model.module`, the plain model, for evaluation.
    model = DistributedDataParallel(
        model, device_ids=[device] if device.type == "cuda" else None
    )

    train_dataset, valid_dataset = make_datasets(
        args.data_dir, args.synthetic_data, args.synthetic_size, prepare=local_rank == 0
    )
    # Each process trains on its own 1/world_size of the data; the
    # sampler shuffles, not the loader. It pads with repeated
    # samples so that every process runs the same number of steps.
    train_sampler = ResumableSampler(train_dataset, shuffle=True, seed=args.seed)
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
    start_fork_server()
    num_workers = get_num_workers()
    # A DataLoader draws a seed for its workers at the start of every epoch. From a
    # generator of its own, not torch's global one, it leaves the global random state to
    # training, so that the copy of it in a checkpoint continues exactly.
    loader_generator = torch.Generator()
    train_dataloader = DataLoader(
        train_dataset,
        batch_size=args.batch_size,
        num_workers=num_workers,
        sampler=train_sampler,
        generator=loader_generator,
    )
    # Validation draws its workers' seed from a generator of
    # its own too: a validation that was cut short and runs
    # again must not draw twice from the global random state.
    valid_dataloader = DataLoader(
        valid_shard,
        batch_size=args.batch_size,
        num_workers=num_workers,
        shuffle=False,
        generator=torch.Generator(),
    )
    # The full batches that every shard has: after each of
    # them, all ranks can check together whether to stop.
    stop_checks = len(valid_dataset) // world_size // args.batch_size
    if is_master:
        logger.info(f"Effective batch size: {args.batch_size * world_size}")

    # From here on there is progress to lose: on either signal, stop after the current
    # step and save. Until now, Python's default, to end at once, lost nothing, and it
    # also ends a process stuck in the rendezvous, which a handler could not interrupt.
    signal.signal(signal.SIGUSR1, note_stop_signal)
    signal.signal(signal.SIGTERM, note_stop_signal)
    step, epoch_step = progress["step"], progress["epoch_step"]
    first_loss, last_loss = progress["first_loss"], progress["last_loss"]
    val_loss, val_accuracy, val_samples = progress["val"]
    max_steps = math.inf if args.max_steps is None else args.max_steps
    for epoch in range(progress["epoch"], args.epochs):
        # Done, unless a stop cut the last epoch's validation short.
        if step >= max_steps and epoch_step == 0:
            break
        # Without set_epoch, the sampler would shuffle the
        # data the same way in every epoch.
        train_sampler.set_epoch(epoch)
        # Like set_epoch: the same worker seeds for an epoch,
        # however often the job restarted. Each process has its own,
        # so that random augmentations differ between processes.
        loader_generator.manual_seed((args.seed + epoch) * world_size + rank)
        # A resumed epoch skips the batches its interrupted run already trained on.
        train_sampler.skip = epoch_step * args.batch_size
        # train() matters for BatchNorm, which ResNet-18
        # uses: batch statistics while training.
        model.train()
        progress_bar = tqdm(
            total=len(train_dataloader),
            desc=f"Train epoch {epoch}",
            disable=not is_master,
        )
        signum = 0
        for x, y in train_dataloader:
            # At max_steps, training is over: only this
            # epoch's validation and checkpoint remain.
            if step >= max_steps:
                break
            x, y = x.to(device), y.to(device)
            logits: Tensor = model(x)
            loss = F.cross_entropy(logits, y)

            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

            loss, accuracy = reduce_train_metrics(loss, logits, y)
            last_loss = loss.item()
            first_loss = last_loss if first_loss is None else first_loss
            progress_bar.update(1)
            progress_bar.set_postfix(loss=last_loss, accuracy=accuracy.item())
            step += 1
            epoch_step += 1
            signum = agree_to_stop(device)
            if signum:
                break
        progress_bar.close()

        if not signum:
            if is_master:
                logger.info(f"Validating epoch {epoch}")
            # Validation may outlast the time that Slurm gives between its signal and
            # the end of the job: it looks for a stop signal after its batches too.
            results = validation_loop(
                model.module, valid_dataloader, device, stop_checks
            )
            if results is None:
                signum = agree_to_stop(device)
                logger.info(
                    f"Validation of epoch {epoch} stopped: the next run does it again"
                )
            else:
                val_loss, val_accuracy, val_samples = results
                # Every process holds the same numbers now;
                # one line in the log is enough.
                if is_master:
                    logger.info(
                        f"Epoch {epoch}: val loss {val_loss:.3f}, val accuracy "
                        f"{val_accuracy:.2%} on {val_samples} samples"
                    )
        if signum:
            # The next run starts where this one stopped: after the epoch's last
            # training step, before its validation, if that is where the stop came.
            progress = {
                "epoch": epoch,
                "step": step,
                "epoch_step": epoch_step,
                "first_loss": first_loss,
                "last_loss": last_loss,
                "val": [val_loss, val_accuracy, val_samples],
            }
            save_checkpoint(
                checkpoint_path, model.module, optimizer, progress, settings
            )
            logger.info(f"Stopped at step {step}, checkpoint saved")
            if signum == signal.SIGUSR1 and is_master:
                requeue(args.max_restarts)
            return
        # The next run starts with the next epoch.
        epoch_step = 0
        progress = {
            "epoch": epoch + 1,
            "step": step,
            "epoch_step": 0,
            "first_loss": first_loss,
            "last_loss": last_loss,
            "val": [val_loss, val_accuracy, val_samples],
        }
        save_checkpoint(checkpoint_path, model.module, optimizer, progress, settings)

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
        "restarts": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
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


def start_fork_server():
    """Starts the process that DataLoader workers are
    forked from, with the stop signals blocked.

    Slurm signals every process of a job step, and a worker that died of
    SIGTERM or SIGUSR1 would fail this process at its next batch, before
    it could save. Blocked signals stay blocked in the fork server and in
    every worker it forks, so that only this process acts on them. Here
    they only wait the few milliseconds that starting the server takes.
    """
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


def agree_to_stop(device: torch.device) -> int:
    """The stop signal that any rank received, or 0. All ranks get the same answer."""
    flag = torch.tensor([stop_signal], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag)


def save_checkpoint(
    path: Path, model: nn.Module, optimizer, progress: dict, settings: dict
):
    """Writes a checkpoint from rank 0, with every rank's
    random state in it. All ranks call it."""
    # Each process has its own random state: gather them all.
    mine = {"cpu_rng": torch.get_rng_state()}
    if use_gpus():
        mine["cuda_rng"] = torch.cuda.get_rng_state()
    ranks = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, ranks, dst=0)
    if dist.get_rank() == 0:
        checkpoint = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "progress": progress,
            "settings": settings,
            "ranks": ranks,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            torch.save(checkpoint, f)
            # On disk before the rename, so that a crash of
            # the node cannot leave an empty file.
            f.flush()
            os.fsync(f.fileno())
        # A rename within one folder replaces the old file in one step: a reader finds
        # the old checkpoint or the new one, never a mix.
        os.replace(tmp, path)
        # The rename is a change to the folder: on disk too, or a crash can undo it.
        sync_folder(path.parent)
    # No rank goes on, or exits, before the file is complete.
    dist.barrier()


def sync_folder(folder: Path):
    """Writes a folder's entries, such as a rename in it, to disk."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(
    path: Path, model: nn.Module, optimizer, rank: int, world_size: int, settings: dict
):
    """Restores the model, the optimizer and this rank's
    random state; returns the progress."""
    # weights_only: load tensors and plain containers only. A
    # full unpickler would run whatever code the file names.
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    if len(checkpoint["ranks"]) != world_size:
        raise SystemExit(
            f"error: {path} was written by {len(checkpoint['ranks'])} processes, and "
            f"this job has {world_size}. Resume with the same number of tasks, or give "
            "a new --checkpoint-dir to start over."
        )
    if checkpoint["settings"] != settings:
        changes = ", ".join(
            f"--{name.replace('_', '-')} {checkpoint['settings'][name]} -> {value}"
            for name, value in settings.items()
            if checkpoint["settings"][name] != value
        )
        raise SystemExit(
            f"error: {path} belongs to a run with other settings ({changes}). Resume "
            "with the same settings, or start a new run: another --job-name, or delete "
            f"{path.parent}."
        )
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    mine = checkpoint["ranks"][rank]
    torch.set_rng_state(mine["cpu_rng"])
    if use_gpus() and "cuda_rng" in mine:
        torch.cuda.set_rng_state(mine["cuda_rng"])
    return checkpoint["progress"]


def requeue(max_restarts: int):
    """Puts this job back in the queue: Slurm ends it now and starts it again later.

    Refuses after `max_restarts`: a job that cannot finish
    would otherwise loop for good.
    """
    job_id = os.environ["SLURM_JOB_ID"]
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    resubmit = "Resubmit job.sh with the same job name: it resumes from the checkpoint."
    if restarts >= max_restarts:
        raise SystemExit(
            f"error: job {job_id} is not requeued: it has started {restarts + 1} "
            f"times, and --max-restarts is {max_restarts}. {resubmit}"
        )
    logging.getLogger(__name__).info(f"Requeueing job {job_id}")
    # Needs `#SBATCH --requeue` on clusters whose default is not to requeue.
    result = subprocess.run(["scontrol", "requeue", job_id])
    # The requeue ends every process of the job, scontrol
    # included: its SIGTERM means success.
    if result.returncode not in (0, -signal.SIGTERM):
        raise SystemExit(
            f"error: `scontrol requeue {job_id}` failed, so the job will not start "
            f"again by itself. {resubmit}"
        )


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
def validation_loop(
    model: nn.Module, dataloader: DataLoader, device: torch.device, stop_checks
):
    """Returns the mean loss and the accuracy over every
    validation sample, and their count.

    Returns None instead if a rank was told to stop, which all ranks check together
    after each of the first `stop_checks` batches.
    """
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
    for i, (x, y) in enumerate(dataloader):
        x, y = x.to(device), y.to(device)
        logits: Tensor = model(x)
        sums[0] += F.cross_entropy(logits, y, reduction="sum")
        sums[1] += logits.argmax(-1).eq(y).sum()
        sums[2] += y.shape[0]
        if i < stop_checks and agree_to_stop(device):
            return None
    # Each process saw its own shard: add the sums up, and
    # every process gets the totals.
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    total_loss, correct, n_samples = sums.tolist()
    return total_loss / n_samples, correct / n_samples, int(n_samples)


class ResumableSampler(DistributedSampler):
    """A DistributedSampler that can start an epoch
    part-way, after the samples already used.

    For a given epoch it yields the same order as ever, so a resumed epoch sees exactly
    the batches that the interrupted one had left.
    """

    skip = 0

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self):
        # Zero for an epoch whose training was over when the job stopped.
        return max(self.num_samples - self.skip, 0)


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

    Only the process with `prepare` set on each node unpacks the dataset into that
    node's $SLURM_TMPDIR; the others wait at a barrier.
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
