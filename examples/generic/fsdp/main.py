"""checkpointing, for a model too large for DDP: FSDP2 shards it over all processes.

Over checkpointing:
- the model is a small decoder-only transformer language model, its sizes set by flags,
  trained on synthetic token sequences or on a file of token ids (--data-file);
- fully_shard() splits each block, then the rest of the model, over all processes. Each
  keeps 1/world_size of the parameters, gradients and optimizer state, and gathers one
  block's parameters at a time to compute with;
- the model is created on the meta device, without memory, and filled in one parameter
  at a time: no process ever holds the whole model;
- on GPUs of compute capability 8.0 or newer, the model computes
  in bf16, while the optimizer keeps float32 weights and gradients
  are reduced in float32. On CPUs, with gloo, all is float32;
- --global-batch-size fixes the batch of a step over all
  processes, so that every number of processes trains on the same
  batches: a checkpoint can resume on another number of processes;
- a checkpoint is a folder that every rank writes its own
  shard to (torch.distributed.checkpoint). It is written
  under a temporary name and renamed when complete.
"""

import argparse
import gc
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import distribute_tensor
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

# The signal that asked this process to stop, or 0. Signal handlers only note it: the
# training loop acts on it between steps, where every rank can stop at the same point.
stop_signal = 0


def note_stop_signal(signum, frame):
    global stop_signal
    # SIGTERM wins over SIGUSR1: the job is ending anyway, and a requeue would fail.
    stop_signal = max(stop_signal, signum)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument(
        "--global-batch-size",
        type=int,
        default=32,
        help="sequences per step over all processes; each process takes its share",
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--dataset-size", type=int, default=8192, help="synthetic sequences"
    )
    parser.add_argument(
        "--data-file",
        type=Path,
        help=(
            "train on this file of token ids (uint16, one after the other, as "
            "nanoGPT's prepare scripts write them) instead of synthetic sequences"
        ),
    )
    # The model's sizes. The defaults make about 34 million parameters.
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument(
        "--log-every", type=int, default=50, help="print the loss every N steps"
    )
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=Path(os.environ.get("CHECKPOINT_DIR", "checkpoints")),
        help=(
            "shared storage that outlives the job and that every node sees "
            "(default: $CHECKPOINT_DIR, set by job.sh)"
        ),
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=20,
        help="requeue the job at most this often: a guard against a job that loops",
    )
    parser.add_argument(
        "--rendezvous-timeout",
        type=float,
        default=120,
        help="seconds to wait for every process to join before giving up",
    )
    return parser.parse_args(argv)


def main():
    args = parse_args()
    local_rank, rank, world_size = setup(args.rendezvous_timeout)
    device = get_device(local_rank)
    print(
        f"[{rank}/{world_size}] Running on {socket.gethostname()}, device {device}",
        flush=True,
    )
    dataset = TokenDataset(args)
    check_sizes(args, world_size, len(dataset))
    sampler = ResumableSampler(dataset, args.global_batch_size)
    dataloader = DataLoader(dataset, batch_size=sampler.batch_size, sampler=sampler)
    model = build_model(args, device)
    # AdamW's two moments per parameter follow its
    # sharding: each rank keeps its shard's.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # The settings that shape training: a checkpoint written with
    # others belongs to another run. The number of processes is
    # not one of them: a checkpoint resumes on any number.
    names = ["dataset_size", "data_file", "global_batch_size", "lr", "vocab_size",
             "seq_len", "dim", "heads", "layers"]  # fmt: skip
    settings = {name: str(getattr(args, name)) for name in names}
    trainer = Trainer(
        model, dataloader, optimizer, device, args.checkpoint_dir, settings
    )
    trainer.log_every = args.log_every
    trainer.resume()
    # From here on there is progress to lose: on either signal, stop after the current
    # step and save. Until now, Python's default, to end at once, lost nothing, and it
    # also ends a process stuck in the rendezvous, which a handler could not interrupt.
    signal.signal(signal.SIGUSR1, note_stop_signal)
    signal.signal(signal.SIGTERM, note_stop_signal)
    stopped_by = trainer.train(args.epochs)
    if stopped_by:
        print(
            f"[{rank}/{world_size}] Stopped at step {trainer.step}, checkpoint saved",
            flush=True,
        )
        # SIGUSR1 warns of the time limit, at which the job would
        # end for good: requeue it. After SIGTERM, Slurm is ending
        # the job already, and requeues it if it preempted it.
        if stopped_by == signal.SIGUSR1 and rank == 0:
            requeue(args.max_restarts)
        return

    summary = {
        "rank": rank,
        "world_size": world_size,
        "host": socket.gethostname(),
        "steps": trainer.step,
        "first_loss": trainer.losses[0],
        "last_loss": trainer.losses[-1],
        "restarts": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
    }
    print(f"summary: {json.dumps(summary)}", flush=True)
    # What this rank holds, counted from its own shards: about 1/world_size of each.
    shards = {"rank": rank, **local_sizes(model, optimizer)}
    print(f"shards: {json.dumps(shards)}", flush=True)


def check_sizes(args, world_size: int, sequences: int):
    """Stops with the cause when the model or the batches cannot be split as asked."""
    if not 1 <= args.global_batch_size <= sequences:
        raise SystemExit(
            f"error: --global-batch-size {args.global_batch_size} must be at least 1 "
            f"and at most the {sequences} sequences of the data, or no epoch holds a "
            "whole global batch."
        )
    if args.dim % args.heads:
        raise SystemExit(
            f"error: --dim {args.dim} does not divide into --heads {args.heads}: each "
            "attention head takes dim / heads features. Choose a --dim that is a "
            "multiple of --heads."
        )
    if args.global_batch_size % world_size:
        raise SystemExit(
            f"error: --global-batch-size {args.global_batch_size} does not divide "
            f"among {world_size} processes. Choose a multiple of {world_size}, or "
            "another number of tasks, so that every process takes the same share of "
            "each batch."
        )


def setup(rendezvous_timeout: float):
    """Joins the process group as the task srun started;
    returns local rank, rank, world size."""
    if "SLURM_STEP_NUM_TASKS" not in os.environ:
        # Without srun (in the batch script, say), only one process would start, and it
        # would wait for the others forever.
        raise SystemExit(
            "error: not started by srun: SLURM_STEP_NUM_TASKS is not set. Start one "
            "process per task with `srun python main.py` (job.sh does)."
        )
    rank = int(os.environ["SLURM_PROCID"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    world_size = int(os.environ["SLURM_NTASKS"])
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    # The store where the processes meet, made here rather than by init_process_group so
    # that joining has its own short timeout: the group's timeout also bounds every
    # collective, and its default is 10 minutes of silence for NCCL and 30 for gloo.
    try:
        store = dist.TCPStore(
            address,
            port,
            world_size,
            is_master=rank == 0,
            timeout=timedelta(seconds=rendezvous_timeout),
        )
    except dist.DistError as error:
        if "EADDRINUSE" in str(error):
            raise SystemExit(
                f"error: rank 0 cannot listen on port {port} of "
                f"{socket.gethostname()}: another process holds it. job.sh derives "
                "MASTER_PORT from the job ID; a port fixed by hand collides with other "
                "jobs on the node. Pick another, from 10000-19999."
            ) from None
        raise SystemExit(
            f"error: rank {rank} on {socket.gethostname()} waited "
            f"{rendezvous_timeout:.0f} s for the rendezvous at {address}:{port}, and "
            f"not all {world_size} processes joined. Rank 0 must run on MASTER_ADDR "
            "(the job's first node): check that the node is up, that its task started, "
            f"and that MASTER_ADDR names it.\n({type(error).__name__}: "
            f"{str(error).splitlines()[0]})"
        ) from None
    backend = "nccl" if use_gpus() else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    return local_rank, rank, world_size


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


def mixed_precision(device: torch.device) -> MixedPrecisionPolicy:
    """bf16 compute on GPUs that have it; float32 otherwise.

    FSDP2 casts each shard to bf16 before gathering it, so forward, backward
    and the gathers run in bf16. Gradients are reduce-scattered in float32, so
    that their sum over processes keeps its precision, and the optimizer
    updates the float32 shards, so that small updates are not lost. GPUs before
    compute capability 8.0 (T4, RTX 8000) have no native bf16. On CPUs, stay in
    float32: gloo's bf16 collectives have failed in some versions of torch.
    """
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8:
        return MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    return MixedPrecisionPolicy()


def build_model(args, device: torch.device) -> nn.Module:
    """The language model, sharded over all processes, each
    holding only its own shard."""
    # On the meta device, modules have shapes but no
    # memory: no process builds the whole model.
    with torch.device("meta"):
        model = TinyLM(args.vocab_size, args.seq_len, args.dim, args.heads, args.layers)
    # An explicit mesh of the device type in use. Without one,
    # FSDP2 builds it for the accelerator, which fails for a
    # gloo group on a CUDA build of torch (pytorch#132471).
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = mixed_precision(device)
    # Each block is a unit: gathered whole for its forward and backward, then freed, and
    # its gradients reduce-scattered while the next block computes. The root takes what
    # is left: the embeddings, the last norm and the output layer.
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    # Memory for this rank's shards only, then their values.
    model.to_empty(device=device)
    init_weights(model)
    return model


def init_weights(model: nn.Module, seed: int = 0):
    """Fills in every parameter, one at a time; each rank keeps its shard.

    Every rank draws each whole parameter from the same seed and keeps its own part, so
    that the weights are the same on any number of processes. The default initialisation
    of modules would not do: on CPUs, every shard of a parameter would get the same
    values. The cost: each rank draws the whole model, one parameter at a time, which
    for billions of parameters takes minutes. (Models that large usually start from
    pretrained weights, which dcp.load shards.)
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            full = torch.empty(param.shape)
            if param.ndim == 1:
                full.fill_(1.0)  # the norms' scales
            else:
                full.normal_(0.0, 0.02, generator=generator)
            # src_data_rank=None: each rank cuts its shard
            # from its own copy, without sending.
            shard = distribute_tensor(
                full.to(param.device),
                param.device_mesh,
                param.placements,
                src_data_rank=None,
            )
            param.copy_(shard)
            del full, shard  # one whole parameter at a time, on the GPU too


class TinyLM(nn.Module):
    """A decoder-only transformer: token and position
    embeddings, blocks, a norm, the output."""

    def __init__(
        self, vocab_size: int, seq_len: int, dim: int, heads: int, layers: int
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.position = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim, bias=False)
        self.head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class Block(nn.Module):
    """Causal self-attention, then an MLP, each added to its input."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.LayerNorm(dim, bias=False)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.LayerNorm(dim, bias=False)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim, bias=False),
            nn.GELU(),
            nn.Linear(4 * dim, dim, bias=False),
        )

    def forward(self, x):
        batch, length, dim = x.shape
        qkv = self.qkv(self.attention_norm(x)).view(batch, length, 3, self.heads, -1)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each: batch, heads, length, dim / heads
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, dim))
        return x + self.mlp(self.mlp_norm(x))


class ResumableSampler(DistributedSampler):
    """This rank's share of each step's global batch; an epoch can start part-way.

    A DistributedSampler deals an epoch's shuffled samples out to the ranks in turn, so
    the first `global_batch_size` samples of the order make the first global batch,
    whatever the number of processes. Epochs end after the last whole global batch, so
    that every number of processes trains on exactly the same batches.
    """

    def __init__(self, dataset, global_batch_size: int):
        super().__init__(dataset)
        self.batch_size = global_batch_size // self.num_replicas  # per process
        self.steps_per_epoch = len(dataset) // global_batch_size
        self.skip_steps = 0

    def __iter__(self):
        start, stop = (
            self.skip_steps * self.batch_size,
            self.steps_per_epoch * self.batch_size,
        )
        return itertools.islice(super().__iter__(), start, stop)

    def __len__(self):
        return (self.steps_per_epoch - self.skip_steps) * self.batch_size


class Trainer:
    """Trains the sharded model, and saves and restores
    everything needed to continue exactly."""

    def __init__(
        self, model, dataloader, optimizer, device, checkpoint_dir: Path, settings
    ):
        self.device = device
        self.settings = settings
        self.dataloader = dataloader
        self.optimizer = optimizer
        self.checkpoint_dir = checkpoint_dir
        self.model = model
        self.log_every = 0  # print the loss every this many steps; 0: never
        self.epoch = 0
        self.step = 0  # steps taken in all
        self.epoch_step = 0  # steps taken in this epoch
        self.losses = []  # the mean loss of each finished epoch
        # The sum of this epoch's step losses so far, each the mean over all processes:
        # the same on every rank, and on any number of processes.
        self.epoch_loss = torch.zeros((), device=device)

    def resume(self):
        """Loads the latest checkpoint, if there is one,
        whatever the number of processes."""
        rank, world_size = dist.get_rank(), dist.get_world_size()
        # Rank 0 chooses, for all: on a network file system, nodes
        # can list a folder differently for a while, and ranks that
        # loaded different checkpoints would wait on each other.
        chosen = [latest_checkpoint(self.checkpoint_dir) if rank == 0 else None]
        dist.broadcast_object_list(chosen, src=0)
        path = chosen[0]
        if path is None:
            if rank == 0:
                print(f"No checkpoint in {self.checkpoint_dir}: a new run", flush=True)
            return
        check_complete(path)
        progress = torch.load(path / "progress.pt", weights_only=True)
        if progress["settings"] != self.settings:
            changes = ", ".join(
                f"--{name.replace('_', '-')} {progress['settings'][name]} -> {value}"
                for name, value in self.settings.items()
                if progress["settings"][name] != value
            )
            raise SystemExit(
                f"error: {path} belongs to a run with other settings ({changes}). "
                "Resume with the same settings, or start a new run: another "
                f"--job-name, or delete {self.checkpoint_dir}."
            )
        # The sharded state of this run, which dcp.load fills in:
        # each rank reads its shard of each tensor, from whichever
        # files hold it, so a checkpoint of 2 processes loads on 3.
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
        self.epoch, self.step = progress["epoch"], progress["step"]
        self.epoch_step, self.losses = progress["epoch_step"], progress["losses"]
        self.epoch_loss.fill_(progress["epoch_loss"])
        if rank == 0:
            written_by = progress["world_size"]
            how = (
                f", resharded from {written_by} processes"
                if written_by != world_size
                else ""
            )
            print(f"Resumed from {path} at step {self.step}{how}", flush=True)

    def save(self):
        """Writes a checkpoint: each rank its shards, rank
        0 the progress. All ranks call it."""
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        # Nothing in training draws random numbers, so no random state is saved. Dropout
        # would: then save each rank's, as the checkpointing step does.
        progress = {
            "epoch": self.epoch,
            "step": self.step,
            "epoch_step": self.epoch_step,
            "losses": self.losses,
            "epoch_loss": self.epoch_loss.item(),
            "settings": self.settings,
            "world_size": dist.get_world_size(),
        }
        name = f"epoch-{self.epoch:04d}-step-{self.step:08d}"
        state = {"model": model_state, "optimizer": optimizer_state}
        save_checkpoint(self.checkpoint_dir / name, state, progress)

    def agree_to_stop(self) -> int:
        """The stop signal that any rank received, or 0.
        All ranks get the same answer."""
        flag = torch.tensor([stop_signal], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag)

    def _run_batch(self, tokens):
        self.optimizer.zero_grad()
        logits = self.model(tokens[:, :-1])
        # Each position predicts the next token. In float32, even where the model
        # computes in bf16: the softmax over the vocabulary needs the precision.
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        # FSDP2 reduce-scatters the gradients block by block
        # during backward, averaged over all processes: each
        # rank receives the mean gradient of its own shard only.
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def train(self, max_epochs: int) -> int:
        """Trains until max_epochs; returns 0, or the
        signal that stopped training before."""
        sampler = self.dataloader.sampler
        world_size = dist.get_world_size()
        while self.epoch < max_epochs:
            sampler.set_epoch(self.epoch)
            # A resumed epoch skips the global batches its
            # interrupted run already trained on.
            sampler.skip_steps = self.epoch_step
            for tokens in self.dataloader:
                loss = self._run_batch(tokens.to(self.device))
                # The step's loss over all processes, each
                # rank's being the mean of its share.
                dist.all_reduce(loss)
                self.epoch_loss += loss / world_size
                self.step += 1
                self.epoch_step += 1
                if (
                    self.log_every
                    and self.step % self.log_every == 0
                    and dist.get_rank() == 0
                ):
                    print(
                        f"step {self.step}: loss {loss.item() / world_size:.5f}",
                        flush=True,
                    )
                signum = self.agree_to_stop()
                if signum:
                    self.save()
                    return signum
            self.losses.append((self.epoch_loss / sampler.steps_per_epoch).item())
            if dist.get_rank() == 0:
                print(
                    f"epoch {self.epoch}: mean loss {self.losses[-1]:.4f}", flush=True
                )
            self.epoch += 1
            self.epoch_step = 0
            self.epoch_loss.zero_()
            self.save()
        return 0


def local_sizes(model: nn.Module, optimizer) -> dict[str, int]:
    """The number of values of the model and of its
    optimizer state that this rank holds."""
    parameters = sum(param.to_local().numel() for param in model.parameters())
    optimizer_state = sum(
        value.to_local().numel()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.ndim > 0  # not the step counts
    )
    return {"parameters": parameters, "optimizer_state": optimizer_state}


# A complete checkpoint's folder. One being written ends in ".tmp".
CHECKPOINT_NAME = re.compile(r"epoch-(\d+)-step-(\d+)")
UNFINISHED_NAME = re.compile(r"epoch-\d+-step-\d+\.tmp")


def checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints in `root`, oldest first."""
    found = [p for p in root.glob("epoch-*") if CHECKPOINT_NAME.fullmatch(p.name)]
    return sorted(
        found,
        key=lambda p: [int(n) for n in CHECKPOINT_NAME.fullmatch(p.name).groups()],
    )


def latest_checkpoint(root: Path) -> Path | None:
    found = checkpoints(root)
    return found[-1] if found else None


def save_checkpoint(path: Path, state: dict, progress: dict):
    """Writes a checkpoint folder that appears only when complete. All ranks call it.

    Every rank writes its shards into `path`.tmp, and rank 0 the
    progress. Once all are on disk, rank 0 renames the folder to `path`
    and deletes the checkpoints before it. A save killed half-way
    leaves only a .tmp folder, and the previous checkpoint as it was.
    """
    partial = path.with_name(path.name + ".tmp")
    if dist.get_rank() == 0:
        # What saves that were killed half-way left behind.
        for leftover in path.parent.glob("epoch-*.tmp"):
            if UNFINISHED_NAME.fullmatch(leftover.name) and leftover.is_dir():
                shutil.rmtree(leftover)
        partial.mkdir(parents=True)
    dist.barrier()
    # Each rank writes a file of its own and syncs it to disk. Rank 0 then writes the
    # index of all of them, .metadata; dcp.save returns on all ranks once it has.
    dcp.save(state, checkpoint_id=partial)
    if dist.get_rank() == 0:
        save_atomically(progress, partial / "progress.pt")
        # A rename within one folder is a single step:
        # readers see the whole folder, or none.
        os.rename(partial, path)
        sync_folder(path.parent)
        for older in checkpoints(path.parent):
            if older != path:
                # Renamed first: a kill during the deletion leaves a leftover, not a
                # checkpoint that looks complete and is not.
                doomed = older.rename(older.with_name(older.name + ".tmp"))
                shutil.rmtree(doomed)
    # No rank goes on, or exits, before the checkpoint is complete.
    dist.barrier()


def check_complete(path: Path):
    """Stops with the cause when a file of the checkpoint in `path` is missing."""
    missing = [
        name for name in (".metadata", "progress.pt") if not (path / name).is_file()
    ]
    if not missing:
        index = dcp.FileSystemReader(path).read_metadata()
        needed = {item.relative_path for item in index.storage_data.values()}
        missing = sorted(name for name in needed if not (path / name).is_file())
    if missing:
        raise SystemExit(
            f"error: the checkpoint {path} lacks {', '.join(missing)}. Its folder got "
            "its name only once every rank had written its part, so files went missing "
            "since, or never reached this node: the checkpoint folder must be on "
            "storage that every node sees, not a node's own disk. Delete the folder to "
            "resume from an earlier checkpoint, if there is one, or to start over."
        )


def save_atomically(state: dict, path: Path):
    """Writes `state` to `path` so that a reader finds the
    old file or the new, never a mix."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        # On disk before the rename, so that a crash of the
        # node cannot leave an empty file.
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    sync_folder(path.parent)


def sync_folder(path: Path):
    # A rename is a change to the folder: on disk too, or a crash can undo it.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    print(f"Requeueing job {job_id}", flush=True)
    # Needs `#SBATCH --requeue` on clusters whose default is not to requeue.
    result = subprocess.run(["scontrol", "requeue", job_id])
    # The requeue ends every process of the job, scontrol
    # included: its SIGTERM means success.
    if result.returncode not in (0, -signal.SIGTERM):
        raise SystemExit(
            f"error: `scontrol requeue {job_id}` failed, so the job will not start "
            f"again by itself. {resubmit}"
        )


class TokenDataset(Dataset):
    """Sequences of seq_len + 1 token ids: the inputs, and each position's next token.

    Synthetic by default: each sequence counts up from a random token in steps of a
    random stride, modulo the vocabulary, a pattern that a model learns within an epoch.
    With --data-file, consecutive pieces of that file of token ids.
    """

    def __init__(self, args):
        self.length = args.seq_len + 1
        if args.data_file is None:
            generator = torch.Generator().manual_seed(
                0
            )  # the same data in every process
            start = torch.randint(
                args.vocab_size, (args.dataset_size, 1), generator=generator
            )
            stride = torch.randint(1, 8, (args.dataset_size, 1), generator=generator)
            self.tokens = (start + stride * torch.arange(self.length)) % args.vocab_size
            return
        if not args.data_file.is_file():
            raise SystemExit(f"error: --data-file {args.data_file}: no such file")
        # Mapped, not read: every process shares the file's pages, however large it is.
        self.file = np.memmap(args.data_file, dtype=np.uint16, mode="r")
        if len(self.file) < self.length:
            raise SystemExit(
                f"error: --data-file {args.data_file} holds {len(self.file)} tokens, "
                f"fewer than one sequence of --seq-len {args.seq_len} needs. It must "
                "hold uint16 token ids."
            )
        # One pass over the file, now rather than hours into training: on a GPU, an id
        # past the embedding's end is an opaque device-side assert.
        chunk = 1 << 24
        largest = max(
            int(self.file[i : i + chunk].max()) for i in range(0, len(self.file), chunk)
        )
        if largest >= args.vocab_size:
            raise SystemExit(
                f"error: --data-file {args.data_file} holds token id {largest}, and "
                f"--vocab-size is {args.vocab_size}. Give the vocabulary size of the "
                "tokenizer that made it."
            )
        self.tokens = None

    def __len__(self):
        if self.tokens is not None:
            return len(self.tokens)
        return (len(self.file) - 1) // (self.length - 1)

    def __getitem__(self, index: int):
        if self.tokens is not None:
            return self.tokens[index]
        start = index * (self.length - 1)
        return torch.from_numpy(self.file[start : start + self.length].astype(np.int64))


if __name__ == "__main__":
    main()
    # The model and the optimizer's state sit in reference cycles that keep
    # the process group alive. Collect them now, while Python can still run
    # the group's threads down cleanly: left to the interpreter's exit,
    # gloo's threads abort the process (exit code 134).
    gc.collect()
    dist.destroy_process_group()
