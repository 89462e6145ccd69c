"""The collectives of torch.distributed, one function each,
as the concepts page shows them.

Run it with `torchrun --nproc-per-node=3 collectives.py`: each process prints, as one
JSON line, what every collective gave it. The guide's tests run it with 1, 2 and 3
processes and check each result against the formula on the page.
"""

import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist


def all_reduce_example(rank: int) -> float:
    # Every process contributes rank + 1, and every process receives the sum:
    # 1 + 2 + ... + world_size.
    value = torch.tensor([rank + 1.0])
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value.item()


def reduce_example(rank: int) -> float | None:
    # The same sum, delivered to one process only (dst). The others' tensors hold no
    # defined result afterwards, so only rank 0 reads it.
    value = torch.tensor([rank + 1.0])
    dist.reduce(value, dst=0, op=dist.ReduceOp.SUM)
    return value.item() if rank == 0 else None


def broadcast_example(rank: int) -> float:
    # Rank 0's tensor overwrites every other process's: all end with 100.0.
    value = torch.tensor([100.0 + rank])
    dist.broadcast(value, src=0)
    return value.item()


def all_gather_example(rank: int, world_size: int) -> list[float]:
    # Every process receives every process's tensor, in
    # rank order: [0.0, 10.0, 20.0, ...].
    mine = torch.tensor([10.0 * rank])
    everyone = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    return [t.item() for t in everyone]


def barrier_example(rank: int, marker: Path) -> bool:
    # Rank 0 arrives late and leaves a file before the barrier. No process gets past the
    # barrier before every process has reached it, so every process then sees the file.
    if rank == 0:
        time.sleep(0.3)
        marker.write_text("rank 0 was here")
    dist.barrier()
    return marker.exists()


def main():
    dist.init_process_group("gloo")  # torchrun set RANK, WORLD_SIZE and the rendezvous
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # All processes must use the same marker path: the
    # folder comes from the command line.
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.gettempdir())
    results = {
        "rank": rank,
        "world_size": world_size,
        "all_reduce": all_reduce_example(rank),
        "reduce": reduce_example(rank),
        "broadcast": broadcast_example(rank),
        "all_gather": all_gather_example(rank, world_size),
        "barrier": barrier_example(rank, folder / "barrier-marker"),
    }
    print(json.dumps(results), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
