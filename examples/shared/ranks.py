"""How a task of a Slurm job becomes a rank: setup() finds this process's place in the
job from the variables of whatever started it (srun, torchrun, or nothing), meets the
job's other processes, and joins the process group, NCCL on GPUs, gloo on CPUs.

The guide keeps one source of this file, examples/shared/ranks.py, and
copies it into every example that uses it (`nox -s copies`): edit that one.
"""

import gc
import os
import socket
from datetime import timedelta
from typing import NamedTuple

import torch.distributed as dist

from devices import use_gpus


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


def leave():
    """Leaves the process group, at the end of a run. The model's wrappers (DDP, FSDP2)
    hold reference cycles that keep the group alive: they are collected first, while
    Python can still end the group's threads cleanly. Left to the exit, gloo aborts
    (exit code 134)."""
    gc.collect()
    dist.destroy_process_group()
