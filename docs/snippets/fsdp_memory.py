"""What each process holds of the FSDP2 example's model, under DDP and under FSDP2.

Run it with `python docs/snippets/fsdp_memory.py`: it starts 1, 2 and 4 processes on
this machine's CPUs, builds the example's model at its default size
(examples/generic/fsdp, about 34 million parameters) both ways, takes one AdamW step,
and prints a CSV table. Every number is counted from the tensors a process holds: its
parameters, their gradients and the optimizer's state, each its own shard under FSDP2.
The guide's tests run it and compare its output with the table on the FSDP2 page.
"""

import csv
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

EXAMPLE = (
    Path(__file__).resolve().parents[2] / "examples" / "generic" / "fsdp" / "main.py"
)
MB = 2**20


def load_example():
    # With its folder first on the path: main.py imports the modules beside it.
    sys.path.insert(0, str(EXAMPLE.parent))
    spec = importlib.util.spec_from_file_location("fsdp_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a tensor: its shard under
    FSDP2, the whole tensor otherwise."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def held(model, optimizer) -> dict[str, int]:
    """The bytes of parameters, gradients and optimizer
    state that this process holds."""

    def size(tensors):
        return sum(local(t).numel() * local(t).element_size() for t in tensors)

    states = [
        value
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.ndim > 0  # not the step counts
    ]
    parameters = list(model.parameters())
    return {
        "parameters": size(parameters),
        "gradients": size(p.grad for p in parameters),
        "optimizer": size(states),
    }


def one_step(model, vocab_size: int):
    # A few tokens are enough: the table counts what outlives the step, not activations.
    tokens = torch.randint(
        vocab_size, (1, 9), generator=torch.Generator().manual_seed(0)
    )
    optimizer = torch.optim.AdamW(model.parameters())
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), tokens[:, 1:].flatten()
    ).backward()
    optimizer.step()
    return optimizer


def measure(rank: int, world_size: int, store_path: str, out: str):
    example = load_example()
    args = example.parse_args([])
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    config = (args.vocab_size, args.seq_len, args.dim, args.heads, args.layers)
    rows = {}
    ddp = DistributedDataParallel(example.TinyLM(*config))
    rows["DDP"] = held(ddp, one_step(ddp, args.vocab_size))
    del ddp
    with torch.device("meta"):
        model = example.build_model(args, args.vocab_size)
    fsdp = example.shard_model(model, torch.device("cpu"), args)
    rows["FSDP2"] = held(fsdp, one_step(fsdp, args.vocab_size))

    # Gathered whole to compute with, a unit at a time (numel() of a sharded parameter
    # is that of the whole): the embeddings, the largest block, and the last norm with
    # the output layer, which stay gathered from their forward to their backward.
    def whole(*modules):
        return sum(
            p.numel() * p.element_size() for m in modules for p in m.parameters()
        )

    rows["FSDP2"]["embeddings"] = whole(fsdp.embed, fsdp.position)
    rows["FSDP2"]["block"] = max(whole(block) for block in fsdp.blocks)
    rows["FSDP2"]["output"] = whole(fsdp.norm, fsdp.head)
    # The largest share of any process.
    everyone = [None] * world_size
    dist.all_gather_object(everyone, rows)
    if rank == 0:
        largest = {
            strategy: {
                key: max(r[strategy][key] for r in everyone) for key in rows[strategy]
            }
            for strategy in rows
        }
        Path(out).write_text(json.dumps(largest))
    dist.destroy_process_group()


def main():
    writer = csv.writer(sys.stdout, lineterminator="\n")
    writer.writerow(
        ["Processes", "Strategy", "Parameters (MiB)", "Gradients (MiB)",
         "AdamW state (MiB)", "Total (MiB)", "Embeddings gathered (MiB)",
         "A block gathered (MiB)", "Norm and output gathered (MiB)"]
    )  # fmt: skip
    for world_size in (1, 2, 4):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rows.json"
            # Forked, the processes start without importing torch again.
            args = (world_size, str(Path(tmp) / "store"), str(out))
            mp.start_processes(measure, args, nprocs=world_size, start_method="fork")
            rows = json.loads(out.read_text())
        for strategy, row in rows.items():
            parts = [row["parameters"], row["gradients"], row["optimizer"]]
            gathered = [
                f"{row[key] / MB:.1f}" if key in row else ""
                for key in ("embeddings", "block", "output")
            ]
            writer.writerow(
                [world_size, strategy, *(f"{n / MB:.1f}" for n in parts),
                 f"{sum(parts) / MB:.1f}", *gathered]
            )  # fmt: skip


if __name__ == "__main__":
    main()
