"""Step 6: FSDP2, for a model too large for one GPU. Step 5, with the model sharded over
all processes instead of copied whole to each.

Over step 5:
- a small decoder-only transformer language model, trained on files of token ids
  (train.bin and val.bin) or on synthetic sequences;
- fully_shard() splits the embeddings, each block, and the output over all processes:
  each keeps 1/world_size of the parameters, gradients and optimizer state, and
  gathers one unit's parameters at a time to compute with;
- the model is made on the meta device and filled in one parameter at a time: no
  process ever holds the whole model;
- --global-batch-size fixes a step's batch over all processes, so that a checkpoint
  resumes on another number of processes, on the same batches; --micro-batch-size
  bounds each process's activations;
- gradients clipped to --grad-clip; the log gives tokens/s and the MFU;
- a checkpoint is a folder of every rank's shards (torch.distributed.checkpoint), the
  periodic ones written in the background while training goes on.
Left out: torch.compile, usually applied to each block before sharding.

Try the job before the data is in place, as a run of its own name:
`sbatch --job-name=trial job.sh --synthetic-data --max-steps 200`.
"""

import argparse
import contextlib
import functools
import json
import logging
import math
import multiprocessing
import os
import re
import shutil
import socket
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import distribute_tensor
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, Subset

from checkpoint_files import changes, save_atomically
from devices import end_with_rank, get_device, get_num_workers
from ranks import leave, setup
from resumable_data import ResumableSampler, SeededSamples, start_fork_server
from stopping import Agreement, requeue, stop_for_good

log = logging.getLogger(__name__)


# ---- Your model and data: replace these for your own task ----------------------------


def build_model(args, num_classes: int) -> nn.Module:
    """The network to train: a language model, whose classes are the tokens.

    main() builds it on the meta device, and shard_model() makes FSDP2 units of
    `model.embed` with `model.position`, of each module of `model.blocks`, and of
    `model.norm` with `model.head`: give your model's parts those names, or change
    shard_model().
    """
    return TinyLM(num_classes, args.seq_len, args.dim, args.heads, args.layers)


def make_datasets(args) -> tuple[Dataset, Dataset, int]:
    """The training and validation sets, and the number of classes: the vocabulary's
    size, since each next token is one of them."""
    if args.synthetic_data:
        size, vocab, length = args.synthetic_size, args.vocab_size, args.seq_len + 1
        train = SyntheticTokens(size, vocab, length, first_seed=0)
        valid = SyntheticTokens(max(size // 10, 1), vocab, length, first_seed=size)
        return train, valid, vocab
    check_dataset(args.data_dir)
    length, dtype = args.seq_len + 1, token_dtype(args.vocab_size, args.token_dtype)
    train = TokenFile(args.data_dir / "train.bin", length, args.vocab_size, dtype)
    valid = TokenFile(args.data_dir / "val.bin", length, args.vocab_size, dtype)
    return train, valid, args.vocab_size


def token_dtype(vocab_size: int, name: str | None) -> str:
    """The integer type of the token files: `name`, or the smaller of uint16 and uint32
    that holds every id below `vocab_size`. One too small is refused: its files could
    not hold the tokenizer's ids, and read as it, uint32 files would be other tokens."""
    name = name or ("uint16" if vocab_size <= 2**16 else "uint32")
    if vocab_size > np.iinfo(name).max + 1:
        raise SystemExit(
            f"error: --vocab-size {vocab_size} has ids up to {vocab_size - 1}, more "
            f"than --token-dtype {name} holds. Write the token files as uint32, and "
            "pass --token-dtype uint32."
        )
    return name


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    """The loss to minimise: a mean over every position of the batch. In float32, even
    where the model computes in bf16: the softmax over the vocabulary needs it."""
    return F.cross_entropy(output.float().flatten(0, 1), target.flatten())


def to_device(batch, device: torch.device) -> tuple[Tensor, Tensor]:
    """A batch of sequences, as (the model's input, the target), on the device: the
    target of each position is the token after it."""
    tokens = batch.to(device, non_blocking=True)
    return tokens[:, :-1], tokens[:, 1:]


def correct(output: Tensor, target: Tensor) -> Tensor:
    """The validation metric, summed over the batch: for each sequence, the share of
    its next tokens predicted right."""
    return output.argmax(-1).eq(target).float().mean(-1).sum()


def flops_per_token(args) -> float:
    """The model's floating-point operations to train on one token, forward and
    backward: 6 per weight that multiplies (the embeddings only look up), and the
    attention's 12 x layers x dim x seq_len (PaLM's paper, appendix B). For MFU."""
    weights = args.layers * 12 * args.dim**2 + args.dim * args.vocab_size
    return 6 * weights + 12 * args.layers * args.dim * args.seq_len


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
        if dim % heads:
            raise SystemExit(
                f"error: --dim {dim} does not divide into --heads {heads}: each "
                "attention head takes dim / heads features. Choose a --dim that is a "
                "multiple of --heads."
            )
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


class SyntheticTokens(Dataset):
    """Sequences of `length` token ids that count up from a random token in steps of a
    random stride, modulo the vocabulary: a pattern a model learns within an epoch.

    Sequence `i` comes from its own seed: the same in every epoch and every process.
    """

    def __init__(self, size: int, vocab_size: int, length: int, first_seed: int):
        self.size, self.vocab_size, self.length = size, vocab_size, length
        self.first_seed = first_seed

    def __len__(self):
        return self.size

    def __getitem__(self, index: int):
        generator = torch.Generator().manual_seed(self.first_seed + index)
        start = torch.randint(self.vocab_size, (1,), generator=generator)
        stride = torch.randint(1, 8, (1,), generator=generator)
        return (start + stride * torch.arange(self.length)) % self.vocab_size


class TokenFile(Dataset):
    """Consecutive pieces of `length` tokens of a file of token ids of type `dtype`,
    one after the other: the format of nanoGPT's data scripts (train.bin, val.bin,
    uint16)."""

    def __init__(self, path: Path, length: int, vocab_size: int, dtype: str):
        self.path, self.length, self.dtype = path, length, dtype
        # Mapped, not read: the processes share the file's pages, however large it is.
        self.tokens = np.memmap(path, dtype=dtype, mode="r")
        # Ids written as uint32 and read as uint16 are each an id and a 0.
        head = self.tokens[: 1 << 20]
        if dtype == "uint16" and head[::2].any() and not head[1::2].any():
            raise SystemExit(
                f"error: every other number of {path} is 0, as in a file of uint32 ids "
                "read as uint16. Pass --token-dtype uint32."
            )
        if len(self.tokens) < length:
            raise SystemExit(
                f"error: {path} holds {len(self.tokens)} tokens, fewer than one "
                f"sequence of --seq-len {length - 1} needs. It must hold {dtype} ids."
            )
        # One pass over the file, now rather than hours into training: on a GPU, an id
        # past the embedding's end is an opaque device-side assert. Each process reads
        # its share of the file, and they compare: not every process reading it all.
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, self.largest_id(dist.get_rank(), len(found)))
        if (largest := max(found)) >= vocab_size:
            raise SystemExit(
                f"error: {path} holds token id {largest}, and --vocab-size is "
                f"{vocab_size}. Give the vocabulary size of the tokenizer that made it."
            )

    def largest_id(self, part: int, parts: int) -> int:
        """The largest token id in every `parts`-th chunk of the file, from `part`."""
        chunk = 1 << 24
        starts = range(part * chunk, len(self.tokens), parts * chunk)
        return max((int(self.tokens[i : i + chunk].max()) for i in starts), default=0)

    def __getstate__(self):
        # DataLoader workers get a pickled copy of the dataset: send the path, not the
        # mapped tokens, which would be copied whole. Each worker maps the file again.
        return {"path": self.path, "length": self.length, "dtype": self.dtype}

    def __setstate__(self, state):
        vars(self).update(state)
        self.tokens = np.memmap(self.path, dtype=self.dtype, mode="r")

    def __len__(self):
        return (len(self.tokens) - 1) // (self.length - 1)

    def __getitem__(self, index: int):
        start = index * (self.length - 1)
        piece = self.tokens[start : start + self.length]
        return torch.from_numpy(piece.astype(np.int64))


def check_dataset(data_dir: Path | None):
    """Stops with a clear message when the dataset is not where main.py looks for it."""
    if data_dir is None:
        raise SystemExit(
            "error: no dataset given: set DATA_DIR in job.sh or pass --data-dir.\n"
            "To try the job without a dataset, add --synthetic-data."
        )
    missing = [
        name for name in ("train.bin", "val.bin") if not (data_dir / name).is_file()
    ]
    if missing:
        raise SystemExit(
            f"error: {data_dir} has no {' or '.join(missing)}. The dataset must be two "
            "files of token ids, train.bin and val.bin (nanoGPT's format); "
            "check DATA_DIR in job.sh (and the variables it is made of, such as "
            "$SCRATCH), or pass --data-dir.\nTo try the job without a dataset, add "
            "--synthetic-data."
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
    log.info(f"Speed settings: {json.dumps(speed_settings(args, device))}")

    train_set, valid_set, num_classes = make_datasets(args)
    check_sizes(args, place.world_size, train_set, valid_set)
    # On the meta device, modules have shapes but no memory: no process builds the
    # whole model. shard_model() gives each process memory for its shards only.
    with torch.device("meta"):
        model = build_model(args, num_classes)
    model = shard_model(model, device, args)
    # AdamW's two moments per parameter follow its sharding: each rank keeps its own.
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay
    )
    loaders = make_loaders(args, train_set, valid_set, place)
    if args.benchmark:
        return benchmark(model, optimizer, loaders[0], args, place)
    scheduler = make_scheduler(args, optimizer, steps_per_epoch(args, loaders[0]))
    shares = f"{args.batch_size} x {args.accumulation_steps} micro-batches"
    shares += f" x {place.world_size} processes"
    log.info(f"Global batch: {shares} = {args.global_batch_size}")
    progress, train_log = Progress(), TrainLog(device, args)
    checkpoint = Checkpoint(args)
    checkpoint.load(model, optimizer, scheduler, progress, train_log)
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
    # What this rank holds, counted from its own shards: about 1/world_size of each.
    shards = {"rank": place.rank, **local_sizes(model, optimizer)}
    print(f"shards: {json.dumps(shards)}", flush=True)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    add = parser.add_argument
    add("--epochs", type=positive, default=5)
    # The sequences of an optimizer step, over all processes: each process takes its
    # share, in micro-batches of --micro-batch-size.
    add("--global-batch-size", type=positive, default=32)
    add("--micro-batch-size", type=positive, help="default: its whole share")
    add("--learning-rate", type=float, default=1e-3)
    add("--grad-clip", type=float, default=1.0, help="largest gradient norm; 0: off")
    add("--warmup-steps", type=positive, default=500, help="in optimizer steps")
    add("--weight-decay", type=float, default=0.05)
    add("--seed", type=int, default=0)
    add("--max-steps", type=positive, help="steps in all; a later run goes on")
    add("--log-every", type=positive, default=50, help="steps between log lines")
    # The model's sizes. The defaults make about 34 million parameters.
    add("--vocab-size", type=positive, default=8192)
    # The token files' integers: uint16 holds ids up to 65,535 (GPT-2's 50,257 tokens),
    # uint32 more (Llama 3's 128,256). By default, the smaller that holds --vocab-size.
    add("--token-dtype", choices=["uint16", "uint32"])
    add("--seq-len", type=positive, default=256)
    add("--dim", type=positive, default=512)
    add("--heads", type=positive, default=8)
    add("--layers", type=positive, default=8)
    # A folder with train.bin and val.bin, of token ids (--token-dtype).
    add("--data-dir", type=Path, default=os.environ.get("DATA_DIR"))
    add(
        "--synthetic-data", action="store_true", help="synthetic sequences of token ids"
    )
    add("--synthetic-size", type=positive, default=8192)
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
    # Speed settings. By default each is on where it pays: on GPUs (bf16: of compute
    # capability 8.0 and newer). --no-X turns one off, to measure what it buys.
    for name in ("bf16", "pin-memory"):
        add(f"--{name}", action=argparse.BooleanOptionalAction)
    add("--peak-tflops", type=float, help="the GPU's dense bf16 TFLOP/s, for the MFU")
    add("--benchmark", type=positive, metavar="N", help="time N batches, N steps only")
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
    samples: int = 0  # sequences of the epoch under way trained on, by all processes
    first_loss: float | None = None  # the mean loss of the first log line
    last_loss: float | None = None  # and of the last
    val_loss: float | None = None  # the last validation's results
    val_accuracy: float | None = None
    val_samples: int | None = None


def check_sizes(args, world_size: int, train_set: Dataset, valid_set: Dataset):
    """Sets each process's micro-batch (args.batch_size) and their number per step
    (args.accumulation_steps): its share of the global batch, in micro-batches of
    --micro-batch-size. Stops with the cause when the data or the batch cannot be split
    as asked."""
    if args.global_batch_size > len(train_set):
        raise SystemExit(
            f"error: --global-batch-size {args.global_batch_size} is more than the "
            f"{len(train_set)} sequences of the training data: no step would be whole. "
            "Lower it, or give more data."
        )
    if args.global_batch_size % world_size:
        raise SystemExit(
            f"error: --global-batch-size {args.global_batch_size} does not divide "
            f"among {world_size} processes. Choose a multiple of {world_size}, or "
            "another number of tasks, so that every process takes the same share of "
            "each batch."
        )
    share = args.global_batch_size // world_size
    micro = args.micro_batch_size or share
    if share % micro:
        raise SystemExit(
            f"error: --micro-batch-size {micro} does not divide the {share} sequences "
            f"that each of {world_size} processes takes of --global-batch-size "
            f"{args.global_batch_size}. Choose a divisor of {share}."
        )
    if len(valid_set) < world_size:
        raise SystemExit(
            f"error: the {len(valid_set)} validation sequences leave some of the "
            f"{world_size} processes none to validate. Give more validation data."
        )
    args.batch_size, args.accumulation_steps = micro, share // micro


def shard_model(model: nn.Module, device: torch.device, args) -> nn.Module:
    """The model, built on the meta device, sharded over all processes: each holds
    memory for its own shards only, filled in by init_weights()."""
    # An explicit mesh of the device type in use. Without one, FSDP2 builds it for
    # the accelerator, which fails for a gloo group on a CUDA build of torch
    # (pytorch#132471).
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    # With bf16, shards are gathered in bf16 (half the bytes) and gradients reduced in
    # float32, to keep the sum's precision. On CPUs all stays float32: gloo's bf16
    # collectives have failed in some versions of torch.
    policy = MixedPrecisionPolicy()
    if args.bf16:
        policy = MixedPrecisionPolicy(torch.bfloat16, reduce_dtype=torch.float32)
    # Each unit is gathered for its forward, freed, gathered again for its backward,
    # while the next one computes. The embeddings and the output are units of their own:
    # in the root, they would stay gathered all step (two vocab x dim matrices). The
    # last block and the output stay gathered for the backward pass, which starts there.
    fully_shard([model.embed, model.position], mesh=mesh, mp_policy=policy)
    for i, block in enumerate(model.blocks):
        last = i == len(model.blocks) - 1
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=not last)
    output = [model.norm, model.head]
    fully_shard(output, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.to_empty(device=device)
    init_weights(model, args.seed)
    return model


def init_weights(model: nn.Module, seed: int):
    """Fills in every parameter, one at a time: every rank draws it whole from the same
    seed and keeps its shard, so the weights are the same on any number of processes.
    (Modules' own initialisation gives every shard the same values on CPUs.) For
    billions of parameters that takes minutes; such models usually start from
    pretrained weights, which dcp.load shards. Weights from N(0, 0.02), biases 0, norms'
    scales 1: adapt the rule to your model."""
    if buffers := [name for name, _ in model.named_buffers()]:
        raise SystemExit(
            f"error: the model has buffers ({', '.join(buffers)}), which to_empty() "
            "leaves unset. Fill them in init_weights(), as it fills the parameters."
        )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = torch.empty(param.shape)
            if name.endswith("bias"):
                full.zero_()
            elif param.ndim == 1:
                full.fill_(1.0)  # the norms' scales
            else:
                full.normal_(0.0, 0.02, generator=generator)
            # src_data_rank=None: each rank cuts its shard from its own copy, without
            # sending.
            shard = distribute_tensor(
                full.to(param.device), param.device_mesh, param.placements,
                src_data_rank=None,
            )  # fmt: skip
            param.copy_(shard)
            del full, shard  # one whole parameter at a time, on the GPU too


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


def make_loaders(args, train_set: Dataset, valid_set: Dataset, place):
    """The DataLoaders: workers load and transform batches while the GPU computes."""
    # Workers start from a fork server, a clean process, not by fork() of this one,
    # whose process group runs threads. On Python up to 3.11.9, a fork while one of
    # them holds the interpreter's lock leaves the worker deadlocked (gh-112275).
    # The server imports torch once; its workers start at once.
    multiprocessing.set_start_method("forkserver", force=True)
    multiprocessing.set_forkserver_preload(["torch"])
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
        # Pinned (page-locked) memory lets a copy to the GPU run without blocking
        # this process, which can queue the next step's work meanwhile.
        "pin_memory": args.pin_memory,
    }
    # Each process trains on its own 1/world_size of every epoch, shuffled by the
    # sampler. It drops the samples that do not divide among the processes, where
    # step 5 repeats some: a step's global batch is then the same samples on any
    # number of processes, and a checkpoint resumes on another number.
    sampler = ResumableSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
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
    while progress.epoch < args.epochs and (
        progress.steps < max_steps or progress.samples
    ):
        # Without set_epoch, the sampler would shuffle every epoch the same way.
        train_loader.sampler.set_epoch(progress.epoch)
        # The sequences done, over all processes: on another number of processes,
        # each skips its new share of them.
        train_loader.sampler.skip = progress.samples // dist.get_world_size()
        model.train()
        batches = iter(train_loader)
        early = False  # whether --max-steps stopped the run part-way through the epoch
        for _ in range(steps_per_epoch(args, train_loader)):
            if progress.steps >= max_steps:
                early = True
                break
            loss = accumulate_gradients(model, batches, args, train_log)
            if args.grad_clip:
                # On the sharded gradients: FSDP2 adds up the norm over the ranks.
                nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            progress.steps += 1
            progress.samples += args.global_batch_size
            train_log.add(loss)
            if progress.steps % args.log_every == 0:
                log_line(progress, train_log, scheduler)
            # A save every --checkpoint-every minutes, in the background: a crash,
            # which sends no signal, loses the steps since the last one only.
            stop, save = agreement.poll()
            if stop:
                checkpoint.save(model, optimizer, scheduler, progress, train_log)
                return stop
            if save or checkpoint.due(progress.steps):
                checkpoint.save_in_background(
                    model, optimizer, scheduler, progress, train_log
                )
                agreement.saved()
        if train_log.steps and not early:  # the steps since the last line
            log_line(progress, train_log, scheduler)
        log.info(f"Epoch {progress.epoch}: validation")
        results = validate(model, valid_loader, device, args, agreement)
        if results is None:  # a stop during validation: the next run validates
            checkpoint.save(model, optimizer, scheduler, progress, train_log)
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
            checkpoint.save(model, optimizer, scheduler, progress, train_log)
            break
        progress.epoch += 1
        progress.samples = 0
        checkpoint.save_in_background(model, optimizer, scheduler, progress, train_log)
        agreement.saved()
        train_log.restart_clock()  # the next line counts training only
    checkpoint.wait()  # the last checkpoint complete on disk before the job ends
    if progress.epoch < args.epochs:
        log.warning(
            f"Stopped by --max-steps {args.max_steps} after step {progress.steps}, "
            f"with {progress.epoch} of {args.epochs} epochs done: training is not "
            "finished. To go on, run again under the same job name without --max-steps."
        )
    return 0


class TrainLog:
    """The mean loss since the last log line, the samples and tokens per second, the
    MFU, and the share of the time spent waiting for data. The losses stay on the
    device until a line is logged: a .item() at every step would make the CPU wait."""

    def __init__(self, device: torch.device, args):
        self.device = device
        self.samples_per_step = args.batch_size * args.accumulation_steps
        self.tokens_per_sample = args.seq_len
        # The model's FLOPs per second at the GPU's peak, in tokens: for the MFU.
        peak = peak_flops(device, args)
        self.peak_tokens = peak / flops_per_token(args) if peak else None
        self.total = torch.zeros((), device=device)
        self.steps = 0
        self.restart_clock()

    def restart_clock(self):
        self.started, self.data_wait = time.perf_counter(), 0.0

    def add(self, loss: Tensor):
        self.total += loss.detach()
        self.steps += 1

    @contextlib.contextmanager
    def waiting_for_data(self):
        begin = time.perf_counter()
        yield
        self.data_wait += time.perf_counter() - begin

    def report(self) -> dict:
        """The numbers since the last report, over all processes; starts anew."""
        # The GPU may still run steps that this process queued: time them too.
        synchronize(self.device)
        elapsed = time.perf_counter() - self.started
        rate, wait = (
            self.steps * self.samples_per_step / elapsed,
            self.data_wait / elapsed,
        )
        sums = torch.stack([self.total / self.steps, self.total.new_tensor(rate)])
        sums = torch.cat([sums, self.total.new_tensor([wait])])
        dist.all_reduce(sums)  # one collective per line, for all three
        loss, total_rate, wait = sums.tolist()
        world_size = dist.get_world_size()
        self.total.zero_()
        self.steps = 0
        self.restart_clock()
        tokens_per_s = total_rate / world_size * self.tokens_per_sample
        return {
            "loss": loss / world_size,
            "samples_per_s": total_rate / world_size,
            "total_samples_per_s": total_rate,
            "tokens_per_s": tokens_per_s,
            # The share of the GPU's peak that the model's own FLOPs use.
            "mfu": tokens_per_s / self.peak_tokens if self.peak_tokens else None,
            "data_wait": wait / world_size,
        }


# Dense bf16 TFLOP/s per GPU, from NVIDIA's data sheets (the figures without sparsity),
# by a part of the name that torch.cuda.get_device_name() gives; the first match wins.
PEAK_TFLOPS = {
    "H100 PCIe": 756, "H100 NVL": 835, "H100": 989, "H200 NVL": 835, "GH200": 989,
    "H200": 989, "A100": 312,
}  # fmt: skip


def peak_flops(device: torch.device, args) -> float | None:
    """The device's peak FLOP/s for the MFU: --peak-tflops, or PEAK_TFLOPS when training
    in bf16; None for CPUs, MIG slices and GPUs not in the table."""
    peak_tflops = args.peak_tflops
    if peak_tflops is None and device.type == "cuda" and args.bf16:
        name = torch.cuda.get_device_name(device)
        if "MIG" not in name:  # a slice has a share of the GPU's peak
            peak_tflops = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    return None if peak_tflops is None else peak_tflops * 1e12


def log_line(progress: Progress, train_log: TrainLog, scheduler):
    report = train_log.report()
    loss = report["loss"]
    progress.first_loss = loss if progress.first_loss is None else progress.first_loss
    progress.last_loss = loss
    mfu = "n/a (--peak-tflops)" if report["mfu"] is None else f"{report['mfu']:.1%}"
    log.info(
        f"epoch {progress.epoch} step {progress.steps} | loss {loss:.4f} | "
        f"lr {scheduler.get_last_lr()[0]:.2e} | {report['samples_per_s']:.1f} "
        f"samples/s per process, {report['total_samples_per_s']:.1f} in total | "
        f"{report['tokens_per_s']:.0f} tokens/s per process | MFU {mfu} | "
        f"waiting for data {report['data_wait']:.0%}"
    )


@torch.no_grad()
def validate(
    model: nn.Module, loader: DataLoader, device: torch.device, args, agreement
):
    """The mean loss and accuracy over every validation sample, and their count; or
    None if a rank was told to stop: all check after each batch."""
    model.eval()
    # Sums, not means, so that a smaller last batch weighs exactly its size: loss,
    # right predictions and samples, in float64 to keep the counts exact.
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    # Every forward gathers each unit's parameters from all ranks, so all ranks must
    # run as many. A rank whose shard has fewer batches runs its last one again, and
    # does not count it.
    most = torch.tensor(len(loader), device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    batches, last = iter(loader), None
    for _ in range(int(most)):
        batch = next(batches, None)
        last = last if batch is None else batch
        inputs, target = to_device(last, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            output = model(inputs).float()
        if batch is not None:
            n = len(target)
            sums[0] += loss_fn(output, target).double() * n
            sums[1] += correct(output, target)
            sums[2] += n
        if agreement.poll()[0]:
            return None
    # Each process saw its own shard: add the sums up, and every process has them.
    dist.all_reduce(sums)
    loss, right, n = sums.tolist()
    return {"val_loss": loss / n, "val_accuracy": right / n, "val_samples": int(n)}


def speed_settings(args, device: torch.device) -> dict:
    """Sets each speed setting that was left to its default (None) to what pays on this
    device: on for GPUs, off for CPUs. Returns them all, for the log."""
    cuda = device.type == "cuda"
    bf16_ok = cuda and torch.cuda.get_device_capability(device) >= (8, 0)
    if args.bf16 and not bf16_ok:
        raise SystemExit(
            "error: --bf16 asks for bf16 autocast, which needs a GPU of compute "
            "capability 8.0 or newer (A100, H100, RTX 30xx and later); this process "
            f"has {torch.cuda.get_device_name(device) if cuda else 'a CPU'}. Leave it "
            "out to train in fp32."
        )
    for name, default in [("bf16", bf16_ok), ("pin_memory", cuda)]:
        if getattr(args, name) is None:
            setattr(args, name, default)
    settings = ("bf16", "pin_memory")
    device_name = torch.cuda.get_device_name(device) if cuda else "cpu"
    return {"device": device_name, **{name: getattr(args, name) for name in settings}}


def steps_per_epoch(args, train_loader: DataLoader) -> int:
    """Optimizer steps in what is left of the epoch: whole steps of micro-batches."""
    return len(train_loader) // args.accumulation_steps


def accumulate_gradients(model, batches, args, train_log: TrainLog) -> Tensor:
    """Forward and backward over --accumulation-steps micro-batches, taken from
    `batches` one at a time; returns their mean loss, on the device.

    The backward pass of every micro-batch reduce-scatters its gradients, averaged over
    the processes, and they add up in each rank's shard. (Skipping that until the last
    micro-batch, as step 5's no_sync() does, would keep whole gradients on every rank:
    the memory that sharding saves.)
    """
    device = next(model.parameters()).device
    total = torch.zeros((), device=device)
    for _ in range(args.accumulation_steps):
        with train_log.waiting_for_data():
            inputs, target = to_device(next(batches), device)
        # Autocast covers the forward pass; backward runs in its precisions.
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            loss = loss_fn(model(inputs), target)
        # Each micro-batch weighs 1/n: the sum is the mean over the whole batch.
        (loss / args.accumulation_steps).backward()
        total += loss.detach()
    return total / args.accumulation_steps


def benchmark(model, optimizer, loader: DataLoader, args, place):
    """Prints the samples/s of the input pipeline alone, then of the training step
    alone, on one batch already on the device: the ceiling, which no input pipeline can
    beat. Training runs at about the smaller of the two."""
    device, n = next(model.parameters()).device, args.benchmark
    # Untimed: the workers start, and the batches they prefetch (two each) are taken,
    # so that the timed ones are those the workers make while they are timed.
    untimed = max(2 * loader.num_workers, 1)
    if len(loader) < untimed + n:
        raise SystemExit(
            f"error: --benchmark {n} times {n} batches after {untimed} untimed ones, "
            f"but the training set has {len(loader)} batches of {loader.batch_size}. "
            "Ask for fewer."
        )
    batches = iter(loader)
    for _ in range(untimed):
        inputs, target = to_device(next(batches), device)
    rates = {}
    synchronize(device)
    begin = time.perf_counter()
    for _ in range(n):
        to_device(next(batches), device)
    synchronize(device)
    rates["input_samples_per_s"] = n * loader.batch_size / (time.perf_counter() - begin)
    del batches
    model.train()
    for timed in (False, True):  # untimed first: the first steps' allocations
        synchronize(device)
        begin = time.perf_counter()
        for _ in range(n if timed else 3):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
                loss = loss_fn(model(inputs), target)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        synchronize(device)
    rates["step_samples_per_s"] = n * loader.batch_size / (time.perf_counter() - begin)
    record = {**speed_settings(args, device), "num_workers": loader.num_workers}
    record.update(rates, rank=place.rank, world_size=place.world_size)
    record.update(seq_len=args.seq_len, dim=args.dim, layers=args.layers)
    record["batch_size"] = args.batch_size
    if device.type == "cuda":
        record["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    print(f"benchmark: {json.dumps(record)}", flush=True)


def synchronize(device: torch.device):
    """Waits for the GPU to finish the work queued so far."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# The arguments that a resumed run may change: where things are, how often it logs and
# saves, how long it trains, how fast. Every other one shapes training, your own
# arguments included: a checkpoint written with another value of one belongs to another
# run. The number of processes and --micro-batch-size are not among them: a checkpoint
# resumes on any number of processes, on the same global batches.
MAY_CHANGE_ON_RESUME = {
    "epochs", "max_steps", "log_every", "data_dir", "num_workers", "rendezvous_timeout",
    "checkpoint_dir", "checkpoint_every", "checkpoint_every_steps", "keep_checkpoints",
    "max_failed_saves", "max_restarts", "micro_batch_size", "peak_tflops",
    "batch_size", "accumulation_steps",  # set by main.py from --micro-batch-size
    # speed settings: the same training, faster
    "bf16", "pin_memory", "benchmark",
}  # fmt: skip


class Checkpoint:
    """The run's checkpoints: folders of every rank's shards, named by epoch and step,
    the newest --keep-checkpoints kept. Each holds all it takes to continue exactly, on
    any number of processes."""

    def __init__(self, args):
        self.root = args.checkpoint_dir
        self.keep = args.keep_checkpoints
        self.every_steps = args.checkpoint_every_steps
        # Every argument, as plain values (a Path as its text, a tuple as a list):
        # torch.load with weights_only=True, which load() uses, refuses other objects.
        self.arguments = json.loads(json.dumps(vars(args), default=str))
        self.settings = {
            name: value
            for name, value in sorted(self.arguments.items())
            if name not in MAY_CHANGE_ON_RESUME
        }
        # The background saves' own group: their collectives run in a thread, on CPU
        # tensors, and must not mix with training's. Its ranks wait in it for up to an
        # hour: a file system that blocks (Lustre, NFS) may outlast the default group's
        # timeout (10 minutes with NCCL), which would end every rank. Past the hour, the
        # storage counts as gone: every rank fails, and job.sh requeues the job.
        self.group = dist.new_group(backend="gloo", timeout=timedelta(hours=1))
        self.under_way = None  # the background save: its future, and rank 0's thread
        self.error = None  # what failed in that thread
        self.max_failures, self.failures = args.max_failed_saves, 0

    def due(self, steps: int) -> bool:
        """Whether --checkpoint-every-steps asks for a save after `steps` steps."""
        return self.every_steps is not None and steps % self.every_steps == 0

    def save(self, model, optimizer, scheduler, progress, train_log):
        """Writes a checkpoint, and returns once it is complete on disk. All ranks
        call it."""
        self.save_in_background(model, optimizer, scheduler, progress, train_log)
        self.wait()

    def save_in_background(self, model, optimizer, scheduler, progress, train_log):
        """Starts a checkpoint: each rank copies its shards to CPU memory (as much as
        it holds of the model and of AdamW's state), then writes them in a thread while
        training goes on. One save at a time: waits for the previous one first.
        Training draws no random numbers (no dropout; the sampler shuffles by seed and
        epoch), so no random state is saved, unlike in step 5."""
        self.wait()
        begin = time.perf_counter()
        mine = {"losses": train_log.total.cpu(), "losses_steps": train_log.steps}
        ranks = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, ranks, dst=0)
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {
            "scheduler": scheduler.state_dict(),
            "progress": asdict(progress),
            "settings": self.settings,
            "arguments": self.arguments,
            "ranks": ranks,
        }
        path = self.root / f"epoch-{progress.epoch:04d}-step-{progress.steps:08d}"
        shards = {"model": model_state, "optimizer": optimizer_state}
        future = start_checkpoint(path, shards, self.group)
        seconds = time.perf_counter() - begin
        log.info(f"Writing {path.name} (shards copied in {seconds:.1f} s)")
        # Rank 0 completes the checkpoint as soon as its future is done, which is once
        # every rank's shards are written: in a thread, while training goes on.
        finisher = None
        if dist.get_rank() == 0:
            finisher = threading.Thread(
                target=self.finish, args=(future, path, state, begin)
            )
            finisher.start()
        self.under_way = (future, finisher, path)

    def finish(self, future, path, state, begin):
        """Rank 0, in a thread: completes the checkpoint once every rank's shards are
        written. What fails is for wait() to report."""
        try:
            future.result()
            finish_checkpoint(path, state, self.keep)
            log.info(f"Saved {path} in {time.perf_counter() - begin:.1f} s")
        except (Exception, dcp.CheckpointException) as error:
            self.error = error

    def wait(self):
        """Waits for the save under way, if any, to be complete on disk, or to have
        failed on some rank: then training goes on, as failed() says."""
        if self.under_way is None:
            return
        future, finisher, path = self.under_way
        self.under_way = None
        try:
            future.result()  # this rank's shards written
        except (Exception, dcp.CheckpointException) as error:  # a full disk, say
            self.error = error
        if finisher is not None:
            finisher.join()
        error, self.error = self.error, None
        if isinstance(error, dcp.CheckpointException):
            # The same on every rank, with each failed rank's error: keep this one's.
            error = error.failures.get(dist.get_rank(), [None])[0]
        if error is not None:
            log.warning(f"Could not save {path}: {error}")
        # No rank goes on, or exits, before the checkpoint is complete; all learn the
        # errors of any rank's part.
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error and str(error), group=self.group)
        error = next((f"{path}: {e}" for e in errors if e is not None), None)
        if error is not None and dist.get_rank() == 0:
            shutil.rmtree(path.with_name(path.name + ".tmp"), ignore_errors=True)
        self.failed(error)

    def failed(self, error: str | None):
        """Counts the saves that failed in a row. Training goes on after one: the
        checkpoints before it are still there, and the next save tries again. After
        --max-failed-saves of them, stops the job, for a person to look."""
        self.failures = 0 if error is None else self.failures + 1
        if self.failures >= self.max_failures:
            stop_for_good(
                self.root,
                f"error: {self.failures} checkpoints in a row could not be saved, "
                f"the last one to {error}. Free space in {self.root} or fix what the "
                "error names, then resubmit: the run resumes from its last checkpoint.",
            )

    def load(self, model, optimizer, scheduler, progress, train_log):
        """Restores the latest checkpoint, if there is one, whatever the number of
        processes that wrote it."""
        # Rank 0 chooses, for all: on a network file system, nodes can list a folder
        # differently for a while, and ranks that loaded different checkpoints would
        # wait on each other.
        chosen = [readable_checkpoint(self.root) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(chosen, src=0, group=self.group)
        if (path := chosen[0]) is None:
            return
        begin = time.perf_counter()
        check_complete(path)
        state = torch.load(path / "progress.pt", map_location="cpu", weights_only=True)
        self.check(state, path)
        # The sharded state of this run, which dcp.load fills in: each rank reads its
        # shard of each tensor, from whichever files hold it, so that a checkpoint of
        # 2 processes loads on 3.
        model_state, optimizer_state = get_state_dict(model, optimizer)
        shards = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(shards, checkpoint_id=path)
        set_state_dict(
            model, optimizer, model_state_dict=shards["model"],
            optim_state_dict=shards["optimizer"],
        )  # fmt: skip
        scheduler.load_state_dict(state["scheduler"])
        vars(progress).update(state["progress"])
        # The losses that no log line has reported yet: this rank's own; on another
        # number of processes, their mean, which the next line's mean over ranks keeps.
        ranks, world_size = state["ranks"], dist.get_world_size()
        same = len(ranks) == world_size
        losses = [r["losses"] for r in ([ranks[dist.get_rank()]] if same else ranks)]
        train_log.total.copy_(sum(losses) / len(losses))
        train_log.steps = ranks[0]["losses_steps"]
        how = "" if same else f", resharded from {len(ranks)} processes"
        how += f", in {time.perf_counter() - begin:.1f} s"
        log.info(f"Resumed from {path} at step {progress.steps}{how}")

    def check(self, state: dict, path: Path):
        """Stops with the cause when the checkpoint belongs to another run."""
        if other := changes(state["settings"], self.settings):
            raise SystemExit(
                f"error: {path} belongs to a run with other settings ({other}). "
                "Resume with the same settings, or start a new run: another "
                f"--job-name, or delete {self.root}."
            )
        # Those that may change, said: some change the numbers, if not the run
        # (--bf16 on a GPU without bf16).
        if changed := changes(state.get("arguments", self.arguments), self.arguments):
            log.info(f"Changed since {path.name}: {changed}")


# A complete checkpoint's folder. One being written ends in ".tmp".
CHECKPOINT_NAME = re.compile(r"epoch-(\d+)-step-(\d+)")
UNFINISHED_NAME = re.compile(r"epoch-\d+-step-\d+\.tmp")


def checkpoints(root: Path, last: Path | None = None) -> list[Path]:
    """The complete checkpoints in `root`, up to `last` if given, oldest first."""

    def order(path: Path) -> list[int]:
        return [int(n) for n in CHECKPOINT_NAME.fullmatch(path.name).groups()]

    found = [p for p in root.glob("epoch-*") if CHECKPOINT_NAME.fullmatch(p.name)]
    return sorted(
        (p for p in found if last is None or order(p) <= order(last)), key=order
    )


def readable_checkpoint(root: Path) -> Path | None:
    """The newest checkpoint in `root` with all its files, or None. One that lacks some
    is passed over with a warning, for the one before it. If every one lacks some, as
    on a node's own disk, the newest: check_complete() then says what is wrong."""
    found = checkpoints(root)
    for path in reversed(found):
        if not (missing := missing_files(path)):
            return path
        log.warning(f"Passing over {path}, which lacks {', '.join(missing)}")
    return found[-1] if found else None


def start_checkpoint(path: Path, shards: dict, group):
    """Starts writing a checkpoint folder that appears only when complete, once
    finish_checkpoint() has run; returns dcp.async_save's future. All ranks call it.

    Every rank writes its shards into `path`.tmp, in a thread. A save killed half-way
    leaves only a .tmp folder, and the checkpoints before it as they were.
    """
    partial = path.with_name(path.name + ".tmp")
    if dist.get_rank() == 0:
        # What saves that were killed half-way left behind.
        for leftover in path.parent.glob("epoch-*.tmp"):
            if UNFINISHED_NAME.fullmatch(leftover.name) and leftover.is_dir():
                shutil.rmtree(leftover)
        partial.mkdir(parents=True)
    dist.barrier(group)
    # A copy of this rank's shards in CPU memory, made now; a thread writes it to a
    # file of its own and syncs it to disk. Rank 0 then writes the index of all of
    # them, .metadata, and its future is done once it has.
    return dcp.async_save(shards, checkpoint_id=partial, process_group=group)


def finish_checkpoint(path: Path, state: dict, keep: int):
    """Completes the checkpoint that start_checkpoint() began, once every rank's
    shards are written: adds `state` as progress.pt, renames the folder to `path`, and
    deletes all but the newest `keep` checkpoints. Rank 0 alone calls it."""
    partial = path.with_name(path.name + ".tmp")
    save_atomically(state, partial / "progress.pt")
    damaged = None
    if path.exists() and not missing_files(path):
        # The same epoch and step, saved before: a run resumed from it and stopped
        # again before a step. Nothing has changed since.
        shutil.rmtree(partial)
    else:
        if path.exists():
            # Damaged: load() passed over it, for an earlier one. The new one replaces
            # it, or a run resumed again would pass over it again. Moved aside, and
            # deleted only once the new one has its name.
            missing = ", ".join(missing_files(path))
            log.warning(f"Replacing {path}, which lacks {missing}")
            damaged = path.rename(path.with_name(path.name + ".damaged"))
        # A rename within one folder is a single step: readers see the whole folder, or
        # none. Synced, as save_atomically() syncs its rename.
        os.rename(partial, path)
        folder = os.open(path.parent, os.O_RDONLY)
        os.fsync(folder)
        os.close(folder)
    if damaged is not None:
        shutil.rmtree(damaged, ignore_errors=True)
    for older in checkpoints(path.parent, last=path)[:-keep]:  # never a later one
        # Renamed first: a kill during the deletion leaves a leftover, not a checkpoint
        # that looks complete and is not. One that cannot be deleted (in use over NFS,
        # say) stays, and the next save tries again.
        try:
            shutil.rmtree(older.rename(older.with_name(older.name + ".tmp")))
        except OSError as error:
            log.warning(f"Could not delete {older}: {error}")


def missing_files(path: Path) -> list[str]:
    """The files of the checkpoint in `path` that this node does not see."""
    missing = [
        name for name in (".metadata", "progress.pt") if not (path / name).is_file()
    ]
    if not missing:
        index = dcp.FileSystemReader(path).read_metadata()
        needed = {item.relative_path for item in index.storage_data.values()}
        missing = sorted(name for name in needed if not (path / name).is_file())
    return missing


def check_complete(path: Path):
    """Stops with the cause when a file of the checkpoint in `path` is missing."""
    if missing := missing_files(path):
        raise SystemExit(
            f"error: the checkpoint {path} lacks {', '.join(missing)}. Its folder got "
            "its name only once every rank had written its part, so files went missing "
            "since, or never reached this node: the checkpoint folder must be on "
            "storage that every node sees, not a node's own disk. Delete the folder to "
            "resume from an earlier checkpoint, if there is one, or to start over."
        )


if __name__ == "__main__":
    main()
    leave()
