"""Counts what a main.py asks of torch.distributed, without changing it.

Python imports this module at start-up from a folder on PYTHONPATH. It wraps the
collectives of torch.distributed (the functions main.py calls by name) with counters, by
group: "default" for the group every process joins, "own" for a group main.py makes.
At exit, each process prints one line, `collectives: {...}`, with the counts, the
devices of the tensors sent over its own groups, its rank, and the sockets it held when
main.py ended its process group (its groups' connections and its store's).

With COUNT_CUDA_SYNCS=1 on a GPU, it also counts the times the process waited for the
GPU (torch.cuda.set_sync_debug_mode), as `cuda_syncs`.

Used by test_the_stop_agreement_adds_no_collective_to_the_default_group
(tests/test_resume.py) and by tests/tools/gpu_check.py.
"""

import atexit
import collections
import contextlib
import functools
import inspect
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

counts = collections.Counter()
devices = set()
NAMES = (
    "all_reduce", "broadcast", "barrier", "all_gather", "all_gather_object",
    "gather_object", "broadcast_object_list", "reduce_scatter_tensor",
    "all_gather_into_tensor", "gather", "scatter", "reduce",
)  # fmt: skip


def counted(name, function):
    signature = inspect.signature(function)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        group = bound.arguments.get("group")
        which = "default" if group in (None, dist.group.WORLD) else "own"
        counts[f"{which}:{name}"] += 1
        tensor = bound.arguments.get("tensor")
        if which == "own" and isinstance(tensor, torch.Tensor):
            devices.add(tensor.device.type)
        return function(*args, **kwargs)

    return wrapper


for name in NAMES:
    setattr(dist, name, counted(name, getattr(dist, name)))

# In main.py's own process only: not in the fork server and its DataLoader workers.
main_py = sys.argv[0].endswith("main.py")
if main_py and os.environ.get("COUNT_CUDA_SYNCS") == "1" and torch.cuda.is_available():
    torch.cuda.set_sync_debug_mode("warn")
    show = warnings.showwarning

    def note_sync(message, category, *args, **kwargs):
        if "synchronizing" in str(message):
            counts["cuda_syncs"] += 1
        else:
            show(message, category, *args, **kwargs)

    warnings.showwarning = note_sync
    warnings.simplefilter("always")


def open_sockets() -> int:
    """The sockets among this process's open files."""
    found = 0
    for fd in os.listdir("/proc/self/fd"):
        # The listing's own file descriptor is closed by now: no link to read.
        with contextlib.suppress(OSError):
            found += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return found


destroy = dist.destroy_process_group


@functools.wraps(destroy)
def destroy_and_count(*args, **kwargs):
    counts["sockets"] = open_sockets()
    counts["rank"] = dist.get_rank()
    return destroy(*args, **kwargs)


dist.destroy_process_group = destroy_and_count


@atexit.register
def report():
    # Not from the processes that only start others (multiprocessing's fork server and
    # resource tracker, which import this module too): they call no collective.
    if counts:
        record = {**counts, "own_devices": sorted(devices)}
        print(f"collectives: {json.dumps(record)}", flush=True)
