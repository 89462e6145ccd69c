"""Where this process computes, and with how many DataLoader workers: its GPU (CUDA and
NCCL) when it has one, the CPU (gloo) when it has none or TRAIN_ON_CPU=1 asks for it.

The guide keeps one source of this file, examples/shared/devices.py, and
copies it into every example that uses it (`nox -s copies`): edit that one.
"""

import os
import signal
import threading

import torch


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


def check_one_process():
    """Stops a program of one process (step 1) that srun or torchrun started as one of
    several: each would train alone, on the node's first GPU, apart from the others."""
    for name in ("WORLD_SIZE", "SLURM_STEP_NUM_TASKS"):
        if int(os.environ.get(name, "1")) > 1:
            raise SystemExit(
                f"error: this main.py trains in one process, and was started as one "
                f"of {os.environ[name]} ({name}): each would train alone, on the same "
                "GPU. Start it once, `python main.py`, as its job.sh does. To train on "
                "several GPUs, take the guide's next step: its processes train as one."
            )


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
