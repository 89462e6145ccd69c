"""The fabric check: how fast the job's GPUs and nodes add up a tensor together.

Before you blame your script for a slow or hanging multi-node job, time the one
operation DDP leans on: all_reduce, the sum of a tensor over every process, with the
result on every process. This program times it for message sizes from 1 KiB to 1 GiB
and prints, per size, the time, the algorithm bandwidth and the bus bandwidth, as
NVIDIA's nccl-tests define them (doc/PERFORMANCE.md in github.com/NVIDIA/nccl-tests):

    algbw = size / time
    busbw = algbw * 2 * (n - 1) / n     (all_reduce over n processes)

busbw can be compared with the links' speed, whatever the number of processes. It
drops from one node to two (the network is slower than NVLink), then stays about flat
as nodes are added on a healthy network. job.sh sets NCCL_DEBUG=INFO, so that the
output also says which network NCCL chose ("Using network IB", or "Socket" when it
fell back to TCP).

job.sh asks for what step 3 of the guide's generic line asks for (2 nodes, 4 GPUs each):
`sbatch job.sh`, or `sbatch job.sh --max-bytes 64M` for a quicker check.
"""

import argparse
import json
import logging
import socket
import time

import torch
import torch.distributed as dist

from devices import get_device
from ranks import leave, setup

log = logging.getLogger(__name__)


# ---- What to measure: change these for your own check --------------------------------

# float32, as DDP's gradients are for a model trained in float32 or autocast.
DTYPE = torch.float32


def message_sizes(smallest: int, largest: int, factor: int) -> list[int]:
    """The sizes to time, in bytes: smallest, smallest x factor, ... up to largest."""
    sizes = [smallest]
    while sizes[-1] * factor <= largest:
        sizes.append(sizes[-1] * factor)
    return sizes


def bus_bandwidth(algbw: float, world_size: int) -> float:
    """all_reduce's bus bandwidth, nccl-tests' definition: each process sends and
    receives 2 (n - 1) / n times the message in a ring all_reduce."""
    return algbw * 2 * (world_size - 1) / world_size


# ---- The check -----------------------------------------------------------------------


def main():
    args = parse_args()
    place = setup(args.rendezvous_timeout)
    device = get_device(place.local_rank)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s [{place.rank}/{place.world_size}] %(message)s",
        datefmt="%H:%M:%S",
    )
    log.info(f"Running on {socket.gethostname()}, device {device}")
    log.setLevel(logging.INFO if place.rank == 0 else logging.WARNING)
    backend = dist.get_backend()
    log.info(f"all_reduce of {DTYPE} with {backend}, {place.world_size} processes")
    log.info(f"{'bytes':>12} {'time (us)':>12} {'algbw GB/s':>12} {'busbw GB/s':>12}")
    results = []
    for size in message_sizes(args.min_bytes, args.max_bytes, args.factor):
        tensor = torch.empty(size // DTYPE.itemsize, dtype=DTYPE, device=device)
        check_sum(tensor, place)
        seconds = time_all_reduce(tensor, args.warmup, args.iterations, device)
        algbw = size / seconds / 1e9  # GB/s, in 10^9 bytes, as nccl-tests
        busbw = bus_bandwidth(algbw, place.world_size)
        log.info(f"{size:>12} {seconds * 1e6:>12.1f} {algbw:>12.3f} {busbw:>12.3f}")
        results.append(
            {"bytes": size, "time_us": seconds * 1e6, "algbw_gbps": algbw,
             "busbw_gbps": busbw}
        )  # fmt: skip
    # One plain line per process to grep from the job's output: the numbers agree.
    summary = {
        "rank": place.rank,
        "world_size": place.world_size,
        "host": socket.gethostname(),
        "backend": backend,
        "results": results,
    }
    print(f"summary: {json.dumps(summary)}", flush=True)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    add = parser.add_argument
    add("--min-bytes", type=size_in_bytes, default="1K")
    add("--max-bytes", type=size_in_bytes, default="1G")
    add("--factor", type=int, default=4, help="each size is the last times this")
    add("--warmup", type=int, default=5, help="untimed all_reduces per size")
    add("--iterations", type=int, default=20, help="timed all_reduces per size")
    add("--rendezvous-timeout", type=float, default=120, help="seconds for all to join")
    args = parser.parse_args(argv)
    if args.factor < 2 or args.iterations < 1 or args.warmup < 0:
        parser.error(
            "--factor must be 2 or more, --iterations 1 or more, --warmup 0 or more"
        )
    if args.max_bytes < args.min_bytes:
        parser.error("--max-bytes is smaller than --min-bytes")
    return args


def size_in_bytes(text: str) -> int:
    """A size such as 4096, 64K, 16M or 1G (powers of 1024), a multiple of 4 bytes
    (one float32)."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    try:
        if text[-1:].upper() in units:
            value = int(text[:-1]) * units[text[-1].upper()]
        else:
            value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: give bytes, or a number and K, M or G"
        ) from None
    if value < DTYPE.itemsize or value % DTYPE.itemsize:
        raise argparse.ArgumentTypeError(
            f"{text} is not a whole number of {DTYPE.itemsize}-byte elements"
        )
    return value


def check_sum(tensor: torch.Tensor, place) -> None:
    """One all_reduce whose answer is known: proof that every process took part.

    Rank r contributes r + 1 everywhere; the sum over n processes is n (n + 1) / 2.
    """
    tensor.fill_(place.rank + 1)
    dist.all_reduce(tensor)
    expected = place.world_size * (place.world_size + 1) // 2
    wrong = (tensor != expected).sum().item()
    if wrong:
        raise SystemExit(
            f"error: rank {place.rank}: all_reduce of {tensor.numel()} elements gave "
            f"{wrong} wrong (expected {expected} everywhere). A process added the "
            "wrong data: a bad GPU or link. Run the check on fewer nodes to find it."
        )


def time_all_reduce(
    tensor: torch.Tensor, warmup: int, iterations: int, device: torch.device
) -> float:
    """Seconds per all_reduce, averaged over the processes (as nccl-tests does).

    NCCL returns before the GPU has done the work: wait for the GPU before reading the
    clock, at the start and at the end.
    """
    tensor.zero_()  # sums of zeros stay zero: no overflow however many iterations
    for _ in range(warmup):
        dist.all_reduce(tensor)
    synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(tensor)
    synchronize(device)
    elapsed = torch.tensor(
        [(time.perf_counter() - start) / iterations], dtype=torch.float64, device=device
    )
    # Every process gets the same average: the summaries agree.
    dist.all_reduce(elapsed)
    return elapsed.item() / dist.get_world_size()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
    leave()
