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
import os
import signal
import socket
import threading
import time
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

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


# ---- Plumbing: the same in every example (tests/test_layout.py checks it) ------------


class Place(NamedTuple):
    """Where this process stands in the job."""

    rank: int  # its number among all processes, from 0
    local_rank: int  # its number among the processes of its node: picks its GPU
    world_size: int  # the number of processes


def setup(rendezvous_timeout: float = 120) -> Place:
    """Joins the process group, whoever started this process: srun, torchrun, or none.
    Under srun, joining waits at most `rendezvous_timeout` seconds."""
    place, launcher = find_place()
    # For libraries that read them, as torchrun sets them.
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
    os.environ.update(zip(names, map(str, place), strict=True))
    # gloo (the main group on CPUs; side groups on GPUs) connects two processes only
    # once they exchange data. Connected to all at the start, a group would hold a
    # socket per other process: 511 at 512, of a usual limit of 1,024 open files.
    os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")
    backend = "nccl" if use_gpus() else "gloo"
    if launcher == "torchrun":  # its rendezvous is done: env:// meets its store
        dist.init_process_group(backend)
        return place
    if launcher == "single process":
        store = dist.HashStore()  # no other process to meet
    else:
        store = rendezvous(place, rendezvous_timeout)
    dist.init_process_group(
        backend, store=store, rank=place.rank, world_size=place.world_size
    )
    return place


def find_place() -> tuple[Place, str]:
    """This process's place, from the variables of the launcher that started it."""
    env = os.environ
    launch = "Start one process per task with `srun python main.py` (job.sh does)"
    # The batch script has SLURM_PROCID and SLURM_NTASKS too, but no step.
    srun = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS")
    variables = {"torchrun": ("RANK", "LOCAL_RANK", "WORLD_SIZE"), "srun": srun}
    # pyxis copies srun's numbers into RANK, LOCAL_RANK and WORLD_SIZE: read them as
    # srun's. rendezvous() serves from MASTER_ADDR's node, where rank 0 need not run.
    copied = "TORCHELASTIC_RUN_ID" not in env and all(
        env.get(a) == env.get(b) for a, b in zip(*variables.values(), strict=False)
    )
    for launcher in ["srun", "torchrun"] if copied else ["torchrun", "srun"]:
        names = variables[launcher]
        if all(name in env for name in names):
            place = Place(*(int(env[name]) for name in names[:3]))
            if not 0 <= place.rank < place.world_size:
                raise SystemExit(
                    f"error: rank {place.rank} does not fit a world of "
                    f"{place.world_size}: {launcher}'s variables were set or changed "
                    f"by hand. {launch}."
                )
            return place, launcher
    if int(env.get("SLURM_NTASKS", "1")) > 1:
        raise SystemExit(
            "error: main.py was started by the batch script, not by srun. The job has "
            f"{env['SLURM_NTASKS']} task(s); without srun only this process runs, and "
            f"it would wait forever for the others. {launch}."
        )
    if found := [name for name in ("RANK", "OMPI_COMM_WORLD_RANK") if name in env]:
        raise SystemExit(
            f"error: cannot tell this process's rank (found {', '.join(found)}). "
            "main.py reads RANK, LOCAL_RANK, WORLD_SIZE (torchrun) or SLURM_PROCID, "
            "SLURM_LOCALID, SLURM_NTASKS (srun), or none of them (a single process)."
        )
    return Place(0, 0, 1), "single process"


def rendezvous(place: Place, timeout: float) -> dist.TCPStore:
    """The store where srun's tasks meet, at MASTER_ADDR:MASTER_PORT (job.sh exports
    them: the job's first node). The first task on that node serves it."""
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise SystemExit(
                f"error: {name} is not set. job.sh exports MASTER_ADDR and MASTER_PORT "
                "before srun; export them too when you launch by hand."
            )
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    host = socket.gethostname()
    # Not always rank 0: Slurm 26.05 numbers tasks by topology.conf, where there is one.
    serves = os.environ["SLURM_NODEID"] == "0" and place.local_rank == 0
    try:
        return dist.TCPStore(
            address, port, place.world_size, is_master=serves,
            timeout=timedelta(seconds=timeout),
        )  # fmt: skip
    except dist.DistError as error:
        if "EADDRINUSE" in str(error):
            raise SystemExit(
                f"error: rank {place.rank} cannot listen on port {port} of {host}: "
                "another process holds it. job.sh derives MASTER_PORT from the job "
                "ID; a port fixed by hand collides with other jobs on the node. Pick "
                "another, from 10000-19999."
            ) from None
        raise SystemExit(
            f"error: rank {place.rank} on {host} waited {timeout:.0f} s for the "
            f"rendezvous at {address}:{port}, and not all {place.world_size} processes "
            "joined. The first task on the job's first node serves the rendezvous: "
            "check that MASTER_ADDR names that node, that the node is up and that its "
            "tasks started.\n"
            f"({type(error).__name__}: {str(error).splitlines()[0]})"
        ) from None


def use_gpus() -> bool:
    """True to train on GPUs with NCCL, False on CPUs with gloo (TRAIN_ON_CPU=1 asks
    for that). A task given GPUs that CUDA cannot use stops at once."""
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
    """This process's GPU, made its current device, or the CPU. Slurm may show a task
    every GPU of its node or only its own (--gpu-bind, a MIG slice): a process that sees
    one GPU takes it, else the one at its local rank."""
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


def get_num_workers() -> int:
    """DataLoader workers: this process's share of its task's CPUs, less one."""
    # The CPUs Slurm bound the task to; where a site does not bind, the job's share.
    affinity = getattr(os, "sched_getaffinity", None)  # macOS has none
    cpus = len(affinity(0)) if affinity else (os.cpu_count() or 1)
    if "SLURM_CPUS_PER_TASK" in os.environ:
        cpus = min(cpus, int(os.environ["SLURM_CPUS_PER_TASK"]))
    # torchrun's processes share their task's CPUs.
    return max(cpus // int(os.environ.get("LOCAL_WORLD_SIZE", "1")) - 1, 0)


def end_with_rank(rank_pid: int, worker_id: int):
    """A DataLoader worker's worker_init_fn: a thread ends the worker once process
    `rank_pid`, which it loads for, has ended or sent it SIGTERM. Workers that are not
    its children, or that block SIGTERM, would outlive a process killed out of memory,
    say, holding the job's output open, or ignore multiprocessing's end at an error.
    """

    def watch():
        while True:
            # A SIGTERM from anyone else (Slurm signals the whole step) is dropped.
            received = signal.sigtimedwait({signal.SIGTERM}, 1)
            if received is not None and received.si_pid == rank_pid:
                os._exit(0)
            try:
                os.kill(rank_pid, 0)  # signal 0: only asks whether it exists
            except ProcessLookupError:
                os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
