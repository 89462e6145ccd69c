"""The section "Your model and data" of the template's main.py, for a language model
trained on files of token ids instead of images.

To use it, replace main.py's section (from its line "# ---- Your model and data" to
the line "# ---- Training") with everything below the same line here, and add
`import numpy as np` to main.py's imports. Nothing else changes. The tests do exactly
that, then train, validate, stop and resume the result under Slurm.

Validation counts tokens, not sequences: `val_samples` in the summary is the number of
tokens predicted, and `val_accuracy` the share of them predicted right.
"""

import argparse
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import Dataset

# ---- Your model and data: a language model on files of token ids ---------------------


def add_arguments(parser: argparse.ArgumentParser):
    """The command-line arguments of your model and data. A checkpoint records their
    values, and a run resumes only with the same ones (MAY_CHANGE_ON_RESUME below
    names the exceptions)."""
    add = parser.add_argument
    add("--vocab-size", type=int, default=50304, help="token ids")
    # The token files' integers: uint16 holds ids up to 65,535 (GPT-2's 50,257 tokens),
    # uint32 more (Llama 3's 128,256). By default, the smaller that holds --vocab-size.
    add("--token-dtype", choices=["uint16", "uint32"])
    add("--seq-len", type=int, default=1024, help="tokens a sequence")
    add("--dim", type=int, default=768, help="the model's width")
    add("--heads", type=int, default=12, help="attention heads")
    add("--layers", type=int, default=12, help="transformer blocks")
    # A folder with train.bin and val.bin, of token ids (--token-dtype).
    add("--data-dir", type=Path, default=os.environ.get("DATA_DIR"))
    add("--synthetic-data", action="store_true", help="synthetic token sequences")
    add("--synthetic-size", type=int, default=100_000)
    # 8 sequences a process and micro-batch: one step's tensors peak at under 12 GiB
    # (counted; the image section's 128 would take 128 GiB). For a larger global batch,
    # raise --accumulation-steps.
    parser.set_defaults(batch_size=8)


def build_model(args, num_classes: int) -> nn.Module:
    """The network to train: a small GPT, whose classes are the tokens."""
    return TinyLM(num_classes, args.seq_len, args.dim, args.heads, args.layers)


def make_datasets(args) -> tuple[Dataset, Dataset, int]:
    """The training and validation sets, and the number of classes: the vocabulary's
    size, since each next token is one of them."""
    length = args.seq_len + 1  # the inputs, and the last input's next token
    if args.synthetic_data:
        size = args.synthetic_size
        train = SyntheticTokens(size, args.vocab_size, length, first_seed=0)
        valid = SyntheticTokens(max(size // 10, 1), args.vocab_size, length, size)
        return train, valid, args.vocab_size
    check_dataset(args.data_dir)
    dtype = token_dtype(args.vocab_size, args.token_dtype)
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
    """The loss to minimise: a mean over every token of the batch, in float32."""
    return F.cross_entropy(output.float().flatten(0, 1), target.flatten())


def to_device(batch, device: torch.device) -> tuple[Tensor, Tensor]:
    """A batch of sequences, as (the model's input, the target), on the device: the
    target of each position is the token after it."""
    tokens = batch.to(device, non_blocking=True)
    return tokens[:, :-1], tokens[:, 1:]


def correct(output: Tensor, target: Tensor) -> Tensor:
    """The validation metric, summed over the batch: next tokens predicted right. The
    training loop divides it by target.numel(), the number of tokens."""
    return output.argmax(-1).eq(target).sum()


class TinyLM(nn.Module):
    """A decoder-only transformer: token and position
    embeddings, blocks, a norm, the output."""

    def __init__(self, vocab: int, seq_len: int, dim: int, heads: int, layers: int):
        super().__init__()
        if dim % heads:
            raise SystemExit(
                f"error: --dim {dim} does not divide into --heads {heads}: each head "
                "takes dim / heads features. Choose a --dim that --heads divides."
            )
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

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
        self.attention_norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)
        )

    def forward(self, x):
        batch, length, dim = x.shape
        qkv = self.qkv(self.attention_norm(x)).view(batch, length, 3, self.heads, -1)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each: batch, heads, length, dim / heads
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, dim))
        return x + self.mlp(self.mlp_norm(x))


class TokenFile(Dataset):
    """Consecutive sequences of a file of token ids of type `dtype` (nanoGPT's train.bin
    and val.bin: uint16), each `length` tokens long and overlapping the next by one.

    The file is mapped into memory, not read: the processes of a node share its pages.
    A DataLoader worker gets a pickled copy of the dataset, and a pickled np.memmap is
    a full copy of the file, in every worker of every process. So the copy holds the
    path alone, and each worker maps the file anew.
    """

    def __init__(self, path: Path, length: int, vocab_size: int, dtype: str):
        self.path, self.length, self.dtype = path, length, dtype
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
        # An id past the embedding's end fails on a GPU as an opaque device-side
        # assert, hours in: look now. Each process reads its share of the file.
        rank, parts, chunk = dist.get_rank(), dist.get_world_size(), 1 << 24
        starts = range(rank * chunk, len(self.tokens), parts * chunk)
        mine = max((int(self.tokens[i : i + chunk].max()) for i in starts), default=0)
        found = [None] * parts
        dist.all_gather_object(found, mine)
        if max(found) >= vocab_size:
            raise SystemExit(
                f"error: {path} holds token id {max(found)}, and --vocab-size is "
                f"{vocab_size}. Give the vocabulary size of the tokenizer that made it."
            )

    def __getstate__(self):  # what a worker gets: the path, not the tokens
        return {"path": self.path, "length": self.length, "dtype": self.dtype}

    def __setstate__(self, state):
        vars(self).update(state)
        self.tokens = np.memmap(self.path, dtype=self.dtype, mode="r")

    def __len__(self):
        return (len(self.tokens) - 1) // (self.length - 1)

    def __getitem__(self, index: int):
        start = index * (self.length - 1)
        return torch.from_numpy(
            self.tokens[start : start + self.length].astype(np.int64)
        )


class SyntheticTokens(Dataset):
    """Sequences that count up from a random token by a random stride, modulo the
    vocabulary: a pattern that a model learns quickly. Sequence `i` comes from its own
    seed: the same in every epoch and every process."""

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


def check_dataset(data_dir: Path | None):
    """Stops with a clear message when the token files are not where main.py looks."""
    if data_dir is None:
        raise SystemExit(
            "error: no dataset given: set DATA_DIR in job.sh or pass --data-dir.\n"
            "To try the job without a dataset, add --synthetic-data."
        )
    missing = [n for n in ("train.bin", "val.bin") if not (data_dir / n).is_file()]
    if missing:
        raise SystemExit(
            f"error: {data_dir} has no {' or '.join(missing)}. The dataset must be two "
            "files of token ids, train.bin and val.bin; check DATA_DIR in "
            "job.sh, or pass --data-dir.\nTo try the job without a dataset, add "
            "--synthetic-data."
        )
