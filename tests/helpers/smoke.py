"""Runs the examples in CPU smoke mode: gloo, synthetic
data, a few steps, one thread a process.

Each example is launched the way its job.sh launches it, without Slurm: one process per
Slurm task, each with the SLURM_* variables that srun would give it and what job.sh
exports before srun. The task runs main.py itself, or the launcher that job.sh starts in
it: torchrun, or the deprecated torch.distributed.launch, which then start main.py once
per (pretend) GPU. The Slurm tests (test_slurm.py) submit the job.sh files themselves to
a real cluster, with the same arguments.

    python tests/helpers/smoke.py                  # every example, one line each
    python tests/helpers/smoke.py mila/multi_gpu   # just these
    python tests/helpers/smoke.py --gpus           # on this node's GPUs, with NCCL

With --gpus (`nox -s examples -- --gpus` on a GPU node), each example runs on the GPUs
of the node, a process per GPU, started as its job.sh starts them (gpu_launch()), and
must pass the same checks, with every rank on its own GPU.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import tinyimagenet

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"

# Small and fast, but through the same code as a real run: sampler, training steps,
# validation. 250 synthetic images leave 25 for validation, a count that 2 and 3
# processes do not divide, so any padding of the validation shards would show.
MILA_SMOKE_ARGS = (
    "--synthetic-data", "--synthetic-size", "250", "--batch-size", "16",
    "--epochs", "1", "--max-steps", "4", "--warmup-steps", "2", "--log-every", "2",
)  # fmt: skip
MILA_VAL_SAMPLES = 25
# The Ibex examples read a generated TinyImageNet (tinyimagenet.py) of 5 classes x 5
# validation images; these arguments just keep the run short. One worker per process,
# which 2 processes per task would not get from 2 CPUs.
IBEX_SMOKE_ARGS = (
    "--epochs", "1", "--max-steps", "3", "--batch-size", "8", "--num-workers", "1",
    "--warmup-steps", "2", "--log-every", "1",
)  # fmt: skip
IBEX_VAL_SAMPLES = 25
# The generic line and its launcher variants: ResNet-18 on 32x32 crops of a generated
# image folder (tinyimagenet.py) of 5 classes, 130 training and 25 validation images.
GENERIC_SMOKE_ARGS = (
    "--model", "resnet18", "--image-size", "32", "--batch-size", "4", "--epochs", "2",
    "--max-steps", "6", "--warmup-steps", "2", "--log-every", "2",
)  # fmt: skip
GENERIC_VAL_SAMPLES = 25
# The template: micro-batches of 4, accumulated 2 by 2.
TEMPLATE_SMOKE_ARGS = (*GENERIC_SMOKE_ARGS, "--accumulation-steps", "2")
# The FSDP2 example: a tiny language model on synthetic token sequences, 8 global
# batches of 24 sequences an epoch, and 19 validation sequences, which 2 processes split
# unevenly. 24 divides among 1, 2, 3, 4 and 8 processes (job.sh's 2 nodes x 4 tasks),
# so every test layout trains on the same batches.
FSDP_SMOKE_ARGS = (
    "--synthetic-data", "--epochs", "2", "--synthetic-size", "192",
    "--global-batch-size", "24", "--warmup-steps", "2", "--log-every", "2",
    "--vocab-size", "64", "--seq-len", "16", "--dim", "32", "--heads", "2",
    "--layers", "2",
)  # fmt: skip
FSDP_VAL_SAMPLES = 19
# The fabric check: all_reduce of 1 KiB to 256 KiB, a few times each.
FABRIC_SMOKE_ARGS = (
    "--max-bytes", "256K", "--warmup", "1", "--iterations", "3",
)  # fmt: skip


# main.py's use_gpus() reads TRAIN_ON_CPU=1 only: anything else lets it take the GPUs.
ON_GPUS = {"TRAIN_ON_CPU": "0"}


@dataclass(frozen=True)
class Launch:
    """How an example's job.sh starts main.py, and the arguments of its smoke run."""

    # "python": `python main.py` once, which may spawn procs_per_task processes itself;
    # "srun": main.py in each task; "torchrun" or "torch.distributed.launch": that
    # launcher in each task, starting procs_per_task processes
    launcher: str
    nodes: int = 1
    tasks_per_node: int = 1
    procs_per_task: int = 1
    args: tuple[str, ...] = ()
    val_samples: int | None = None  # the validation set's size under `args`
    # "tinyimagenet" or "imagefolder": generate one
    # (tinyimagenet.py), and export DATA_DIR to it
    dataset: str | None = None
    trains: bool = True  # False for the fabric check, which times all_reduce only

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node * self.procs_per_task


# Every example folder, with how its job.sh launches it, scaled down to 2 processes.
EXAMPLES: dict[str, Launch] = {
    "mila/single_gpu": Launch(
        "python", args=MILA_SMOKE_ARGS, val_samples=MILA_VAL_SAMPLES
    ),
    "mila/multi_gpu": Launch(
        "srun", tasks_per_node=2, args=MILA_SMOKE_ARGS, val_samples=MILA_VAL_SAMPLES
    ),
    "mila/multi_node": Launch(
        "srun",
        nodes=2,
        tasks_per_node=1,
        args=MILA_SMOKE_ARGS,
        val_samples=MILA_VAL_SAMPLES,
    ),
    "mila/checkpointing": Launch(
        "srun",
        nodes=2,
        tasks_per_node=1,
        args=MILA_SMOKE_ARGS,
        val_samples=MILA_VAL_SAMPLES,
    ),
    "ibex/single_node": Launch(
        "torchrun", procs_per_task=2, args=IBEX_SMOKE_ARGS,
        val_samples=IBEX_VAL_SAMPLES, dataset="tinyimagenet",
    ),
    "ibex/multi_node": Launch(
        "torchrun", nodes=2, args=IBEX_SMOKE_ARGS,
        val_samples=IBEX_VAL_SAMPLES, dataset="tinyimagenet",
    ),
    "ibex/multi_node_legacy": Launch(
        "torch.distributed.launch", nodes=2, args=IBEX_SMOKE_ARGS,
        val_samples=IBEX_VAL_SAMPLES, dataset="tinyimagenet",
    ),
    "generic/single_gpu": Launch(
        "python", args=GENERIC_SMOKE_ARGS, val_samples=GENERIC_VAL_SAMPLES,
        dataset="imagefolder",
    ),
    "generic/multi_gpu": Launch(
        "srun", tasks_per_node=2, args=GENERIC_SMOKE_ARGS,
        val_samples=GENERIC_VAL_SAMPLES, dataset="imagefolder",
    ),
    "generic/multi_node": Launch(
        "srun", nodes=2, args=GENERIC_SMOKE_ARGS, val_samples=GENERIC_VAL_SAMPLES,
        dataset="imagefolder",
    ),
    "generic/checkpointing": Launch(
        "srun", nodes=2, args=GENERIC_SMOKE_ARGS, val_samples=GENERIC_VAL_SAMPLES,
        dataset="imagefolder",
    ),
    # Step 4's main.py, which its job.sh runs in a container.
    "generic/container": Launch(
        "srun", nodes=2, args=GENERIC_SMOKE_ARGS, val_samples=GENERIC_VAL_SAMPLES,
        dataset="imagefolder",
    ),
    "generic/template": Launch(
        "srun", nodes=2, args=TEMPLATE_SMOKE_ARGS, val_samples=GENERIC_VAL_SAMPLES,
        dataset="imagefolder",
    ),
    "generic/fsdp": Launch(
        "srun", nodes=2, args=FSDP_SMOKE_ARGS, val_samples=FSDP_VAL_SAMPLES
    ),
    "generic/fabric": Launch("srun", nodes=2, args=FABRIC_SMOKE_ARGS, trains=False),
    "launchers/srun_torchrun": Launch(
        "torchrun", nodes=2, args=GENERIC_SMOKE_ARGS, val_samples=GENERIC_VAL_SAMPLES,
        dataset="imagefolder",
    ),
    "launchers/lightning": Launch(
        "srun", nodes=2, args=GENERIC_SMOKE_ARGS, val_samples=GENERIC_VAL_SAMPLES,
        dataset="imagefolder",
    ),
    "launchers/accelerate": Launch(
        "srun", nodes=2, args=GENERIC_SMOKE_ARGS, val_samples=GENERIC_VAL_SAMPLES,
        dataset="imagefolder",
    ),
    "launchers/mp_spawn": Launch(
        "python", procs_per_task=2, args=(*GENERIC_SMOKE_ARGS, "--nprocs", "2"),
        val_samples=GENERIC_VAL_SAMPLES, dataset="imagefolder",
    ),
}  # fmt: skip

# Examples that are also run under other launchers than their job.sh's: every main.py
# finds its place under srun, torchrun or none (setup(), in ranks.py).
MORE_LAUNCHES: list[tuple[str, Launch]] = [
    (
        "generic/multi_node",
        Launch("torchrun", procs_per_task=2, args=GENERIC_SMOKE_ARGS,
               val_samples=GENERIC_VAL_SAMPLES, dataset="imagefolder"),
    ),
    (
        "generic/multi_node",
        Launch("python", args=GENERIC_SMOKE_ARGS, val_samples=GENERIC_VAL_SAMPLES,
               dataset="imagefolder"),
    ),
]  # fmt: skip


@dataclass
class Run:
    name: str
    launch: Launch
    returncodes: list[int]
    outputs: list[str]  # stdout and stderr of each Slurm task, in order
    elapsed: float
    summaries: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(rc == 0 for rc in self.returncodes)

    @property
    def output(self) -> str:
        return "\n".join(f"--- task {t}\n{out}" for t, out in enumerate(self.outputs))

    def line(self) -> str:
        """The one-line result that `nox -s examples` prints."""
        per_node = self.launch.tasks_per_node * self.launch.procs_per_task
        shape = f"{self.launch.nodes} node(s) x {per_node} process(es)"
        launcher = self.launch.launcher
        head = f"{self.name:<22} {launcher:<24} {shape:<28} {self.elapsed:5.1f} s"
        if not self.ok:
            return f"{head}  FAILED (exit codes {self.returncodes})"
        if not self.summaries:  # a run stopped by a signal ends without one
            return f"{head}  ok, no summary"
        s = self.summaries[0]
        if not self.launch.trains:  # the fabric check
            best = max(s["results"], key=lambda r: r["busbw_gbps"])
            return (
                f"{head}  ok  {s['backend']} all_reduce, busbw up to "
                f"{best['busbw_gbps']:.3f} GB/s ({best['bytes']} bytes)"
            )
        line = f"{head}  ok  loss {s['first_loss']:.3f} -> {s['last_loss']:.3f}"
        if "val_samples" in s:
            line += (
                f", val {s['val_samples']} samples, accuracy {s['val_accuracy']:.1%}"
            )
        return line


def load_main(name: str, file: str = "main.py"):
    """The example's main.py (or another of its files) as a module, without running
    its main(). Registered in sys.modules, so that pickle finds its classes.

    The modules that it imports from its folder (ranks.py, devices.py, ...) are loaded
    from there too, each under a name of its own (example_<folder>_ranks, ...): two
    folders' modules of one name never mix in one process, and a class of each pickles
    by its own name."""
    folder = EXAMPLES_DIR / name
    prefix = f"example_{name.replace('/', '_')}_"
    beside = {path.stem for path in folder.glob("*.py")}
    # While the file runs, its folder comes first on sys.path and the plain names are
    # free, as when Python runs `python main.py` in the folder.
    hidden = {stem: sys.modules.pop(stem) for stem in beside if stem in sys.modules}
    sys.path.insert(0, str(folder))
    try:
        module_name = prefix + Path(file).stem
        spec = importlib.util.spec_from_file_location(module_name, folder / file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(folder))
        for stem in beside:
            loaded = sys.modules.pop(stem, None)
            if loaded is not None and stem != Path(file).stem:
                rename(loaded, prefix + stem)
        sys.modules.update(hidden)
    return module


def rename(module, name: str):
    """Registers a module loaded under its plain name under `name` instead, with its
    classes and functions, so that pickle looks them up there."""
    old, module.__name__ = module.__name__, name
    for value in vars(module).values():
        if getattr(value, "__module__", None) == old:
            value.__module__ = name
    sys.modules[name] = module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env() -> dict[str, str]:
    """This environment without any Slurm or
    torch.distributed variables, one thread a process."""
    drop = (
        "SLURM_",
        "SRUN_",
        "MASTER_",
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    # Two processes with a thread per core each made
    # training steps 8x slower on 2 cores.
    env["OMP_NUM_THREADS"] = "1"
    # CPUs and gloo even where there are GPUs: smoke mode
    # asks for it, as a CPU job would.
    env["TRAIN_ON_CPU"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def srun_env(rank: int, launch: Launch, tmpdir: Path, port: int) -> dict[str, str]:
    """What srun gives task `rank`, plus what job.sh exports before calling srun."""
    node = rank // launch.tasks_per_node
    nodes = [f"node{i + 1}" for i in range(launch.nodes)]
    n_tasks = launch.nodes * launch.tasks_per_node
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": ",".join(nodes),
        "SLURM_JOB_NUM_NODES": str(launch.nodes),
        "SLURM_NNODES": str(launch.nodes),
        "SLURM_NTASKS": str(n_tasks),
        "SLURM_NPROCS": str(n_tasks),
        "SLURM_NTASKS_PER_NODE": str(launch.tasks_per_node),
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_TASKS": str(n_tasks),
        "SLURM_STEP_NUM_NODES": str(launch.nodes),
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank % launch.tasks_per_node),
        "SLURM_NODEID": str(node),
        "SLURMD_NODENAME": nodes[node],
        # Two CPUs a task: one for the process and one for a DataLoader worker.
        "SLURM_CPUS_PER_TASK": "2",
        # Each node has its own $SLURM_TMPDIR, as on Mila.
        "SLURM_TMPDIR": str(tmpdir / nodes[node]),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        # The checkpointing examples' job.sh points this at shared storage.
        "CHECKPOINT_DIR": str(tmpdir / "checkpoints"),
    }


def command(launch: Launch, task: int, port: int) -> list[str]:
    """What a task runs: main.py, or the launcher that job.sh starts in the task."""
    node = task // launch.tasks_per_node
    if launch.launcher == "torchrun":
        launcher = [
            "-m", "torch.distributed.run", f"--nnodes={launch.nodes}",
            f"--nproc-per-node={launch.procs_per_task}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=4242",
        ]  # fmt: skip
    elif launch.launcher == "torch.distributed.launch":
        launcher = [
            "-m", "torch.distributed.launch", "--use_env",
            f"--nproc_per_node={launch.procs_per_task}", f"--nnodes={launch.nodes}",
            f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}",
        ]  # fmt: skip
    else:
        launcher = []
    return [sys.executable, *launcher, "main.py"]


def run_example(
    name: str,
    launch: Launch | None = None,
    args: tuple[str, ...] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 240,
    while_running: Callable[[list[subprocess.Popen], list[Path]], None] | None = None,
    folder: Path | None = None,
    open_file_limit: int | None = None,
) -> Run:
    """Runs one example in smoke mode; `launch`, `args` and `env` override its defaults.

    `while_running`, if given, is called with the tasks' processes and log files once
    they have started, to interrupt them, say. `folder`, if given, holds the main.py
    to run instead of the example's own: a copy of it, changed by a test.
    `open_file_limit`, if given, is each task's limit of open files (its soft
    RLIMIT_NOFILE), and its children's: this process keeps its own.
    """

    def limit_open_files():
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (open_file_limit, hard))

    launch = launch or EXAMPLES[name]
    args = launch.args if args is None else args
    folder = folder or EXAMPLES_DIR / name
    tmpdir = Path(tempfile.mkdtemp(prefix="smoke-"))
    port = free_port()
    procs, logs = [], []
    start = time.monotonic()
    try:
        data_env = {}
        if launch.dataset == "tinyimagenet":
            tinyimagenet.make(tmpdir / "tinyimagenet")
            data_env["DATA_DIR"] = str(tmpdir / "tinyimagenet")
        elif launch.dataset == "imagefolder":
            tinyimagenet.make_folders(tmpdir / "images")
            data_env["DATA_DIR"] = str(tmpdir / "images")
        for task in range(launch.nodes * launch.tasks_per_node):
            proc_env = base_env()
            proc_env.update(data_env)
            if launch.launcher == "python":
                proc_env.update(
                    SLURM_TMPDIR=str(tmpdir / "node1"), SLURM_CPUS_PER_TASK="2"
                )
            else:
                proc_env.update(srun_env(task, launch, tmpdir, port))
            proc_env.update(env or {})
            Path(proc_env.get("SLURM_TMPDIR", tmpdir)).mkdir(
                parents=True, exist_ok=True
            )
            log = open(tmpdir / f"task{task}.log", "w+")  # noqa: SIM115 (closed below)
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    [*command(launch, task, port), *args],
                    cwd=folder,
                    env=proc_env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    preexec_fn=limit_open_files if open_file_limit else None,
                )
            )
        if while_running:
            while_running(procs, [Path(log.name) for log in logs])
        returncodes = wait_all(procs, timeout)
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for log in logs:
            log.close()
        shutil.rmtree(tmpdir, ignore_errors=True)
    run = Run(name, launch, returncodes, outputs, time.monotonic() - start)
    run.summaries = parse_summaries("\n".join(outputs))
    return run


def site_of(name: str) -> str:
    """The site profile a job.sh runs with: launcher variants are generic scripts."""
    site = name.split("/")[0]
    return "generic" if site == "launchers" else site


def descendants(pid: int) -> list[int]:
    """The PIDs of the processes that `pid` started, and of theirs, and so on.

    A rank's DataLoader workers are its grandchildren: they come from a fork server.
    """
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # The command name, in parentheses, may hold
            # spaces: the fields follow the last ")".
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def wait_all(
    procs: list[subprocess.Popen], timeout: float, grace: float = 20
) -> list[int]:
    """Waits for every process; once one fails, gives the
    others `grace` seconds, then kills.

    A rank that dies leaves the others blocked in a
    collective, so waiting could last forever.
    """
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + grace)
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
    return [p.wait() for p in procs]


def parse_summaries(output: str) -> list[dict]:
    """The `summary: {...}` records of a run, sorted by rank."""
    return sorted(decode_records(output, "summary: "), key=lambda s: s.get("rank", 0))


def decode_records(output: str, marker: str) -> list[dict]:
    """The JSON objects that follow each `marker` in `output`, in order.

    Processes that share a stdout (under torchrun) can interleave their lines, so each
    record is decoded where it starts rather than line by line.
    """
    decoder = json.JSONDecoder()
    records = []
    start = output.find(marker)
    while start != -1:
        # A marker that is itself the start of the JSON
        # object ('{"rank"') belongs to it.
        at = start if marker.startswith("{") else start + len(marker)
        record, end = decoder.raw_decode(output, at)
        records.append(record)
        start = output.find(marker, end)
    return records


def numbers(summaries: list[dict]) -> list[dict]:
    """The summaries without the host names: what must
    match between two runs of one layout."""
    return [{k: v for k, v in s.items() if k != "host"} for s in summaries]


def newest_checkpoint(folder: Path) -> Path:
    """The newest checkpoint file that a DDP checkpointing example wrote in `folder`:
    step-<8 digits>.pt, so that the newest sorts last."""
    found = sorted(folder.glob("step-*.pt"))
    assert found, f"no checkpoint in {folder}: {sorted(folder.iterdir())}"
    return found[-1]


def load_checkpoint(folder: Path) -> dict:
    """The newest checkpoint in `folder`, loaded."""
    import torch

    return torch.load(newest_checkpoint(folder), map_location="cpu", weights_only=True)


# What two runs of one training record differently in their checkpoints: the arguments
# each was started with, its folders among them, at the top of a DDP checkpoint and in
# FSDP2's progress record. The settings that shape training ("settings") are compared.
NOT_COMPARED = {"arguments"}
HOLDS_ARGUMENTS = {"checkpoint", "checkpoint['progress']"}


def assert_bitwise_equal(a, b, where="checkpoint"):
    """Fails unless `a` and `b`, nested dicts, lists and
    tensors, are equal bit for bit (but for NOT_COMPARED, where HOLDS_ARGUMENTS)."""
    # Here, so that running the examples does not import torch in this process.
    import torch

    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a.keys() - (NOT_COMPARED if where in HOLDS_ARGUMENTS else set()):
            assert_bitwise_equal(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def load_sharded_checkpoint(checkpoint_dir: Path) -> dict:
    """The newest complete checkpoint of the FSDP2 example in
    `checkpoint_dir`, as whole tensors.

    Folders are named by epoch and step, so that the newest sorts last; a folder ending
    in .tmp is an unfinished one. DCP's own converter gathers the shards, without a
    process group.
    """
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = sorted(p for p in checkpoint_dir.iterdir() if not p.name.endswith(".tmp"))[
        -1
    ]
    with tempfile.TemporaryDirectory() as tmp:
        whole = Path(tmp) / "whole.pt"
        dcp_to_torch_save(folder, whole)
        state = torch.load(whole, weights_only=True)
    state["progress"] = torch.load(folder / "progress.pt", weights_only=True)
    return state


def unwrapped(output: str) -> str:
    """The output with rich's log lines, which it wraps at
    80 columns, made whole again."""
    return re.sub(r"\s+main\.py:\d+\n\s+", " ", output)


def check_run(run: Run) -> list[str]:
    """The behaviour every smoke run must show; returns what is wrong, if anything."""
    problems = []
    if not run.ok:
        return [f"exit codes {run.returncodes}"]
    world_size = run.launch.world_size
    ranks = [s.get("rank", 0) for s in run.summaries]
    if ranks != list(range(world_size)):
        problems.append(f"summaries from ranks {ranks}, expected 0..{world_size - 1}")
    for s in run.summaries:
        for key in ("first_loss", "last_loss", "val_loss"):
            if key in s and not math.isfinite(s[key]):
                problems.append(f"rank {s.get('rank', 0)}: {key} is {s[key]}")
        for r in s.get("results", []):  # the fabric check's timings
            if world_size > 1 and not (
                math.isfinite(r["busbw_gbps"]) and r["busbw_gbps"] > 0
            ):
                problems.append(f"rank {s['rank']}: busbw {r['busbw_gbps']} at {r}")
    metrics = [
        {k: v for k, v in s.items() if k not in ("rank", "host")} for s in run.summaries
    ]
    if any(m != metrics[0] for m in metrics):
        problems.append(f"ranks disagree: {metrics}")
    expected = run.launch.val_samples
    if expected is not None and any(
        s["val_samples"] != expected for s in run.summaries
    ):
        problems.append(
            f"validation counted {run.summaries[0]['val_samples']} != {expected}"
        )
    return problems


def gpu_launch(launch: Launch, gpus: int) -> Launch:
    """The example's launch on one node with `gpus` GPUs: a process per GPU, started
    as its job.sh starts them. A single-GPU step keeps one process. The FSDP2 step
    takes as many GPUs as divide its global batch, no more."""
    if gpus < 1:
        raise ValueError(f"gpus must be 1 or more, not {gpus}")
    # The fabric check at its own sizes, up to 1 GiB: seconds on GPUs, and a real
    # measure of the node's links.
    args = list(launch.args) if launch.trains else []
    world = gpus
    if "--global-batch-size" in args:
        batch = int(args[args.index("--global-batch-size") + 1])
        world = max(w for w in range(1, gpus + 1) if batch % w == 0)
    if launch.launcher == "python" and launch.procs_per_task == 1:
        return dataclasses.replace(launch, nodes=1)  # step 1: one GPU
    if launch.launcher == "python":  # mp.spawn, a process per GPU of the node
        args[args.index("--nprocs") + 1] = str(world)
        return dataclasses.replace(
            launch, nodes=1, tasks_per_node=1, procs_per_task=world, args=tuple(args)
        )
    if launch.launcher == "srun":  # a task per GPU
        return dataclasses.replace(
            launch, nodes=1, tasks_per_node=world, procs_per_task=1, args=tuple(args)
        )
    # torchrun or torch.distributed.launch: one task, a process per GPU
    return dataclasses.replace(
        launch, nodes=1, tasks_per_node=1, procs_per_task=world, args=tuple(args)
    )


def check_gpu_run(run: Run) -> list[str]:
    """On a GPU node, beyond check_run: every rank ran on its own GPU, the one of its
    local rank, and a training run's loss fell."""
    problems = check_run(run)
    world = run.launch.world_size
    for rank in range(world):
        # One process logs without the [rank/world] prefix: step 1's.
        prefix = rf"\[{rank}/{world}\] " if world > 1 else r"(?:\[0/1\] )?"
        device = re.search(rf"{prefix}Running on \S+, device (\S+)", run.output)
        if not device:
            problems.append(f"rank {rank} did not say which device it ran on")
        elif device[1] != f"cuda:{rank}":
            problems.append(f"rank {rank} ran on {device[1]}, not cuda:{rank}")
    if run.launch.trains and run.summaries:
        first = run.summaries[0]
        if not first["last_loss"] < first["first_loss"]:
            problems.append(f"loss did not fall: {first}")
    return problems


def gpus_here() -> int:
    """The GPUs that torch can use on this node; stops with the reason if none."""
    import torch  # here, so that the CPU smoke runs do not import torch in this process

    if not torch.cuda.is_available():
        sys.exit(
            f"error: --gpus runs the examples on this node's GPUs, and torch "
            f"{torch.__version__} finds none (CUDA {torch.version.cuda}). Run it on a "
            "GPU node, in a job step with all its GPUs and enough CPUs and memory, for "
            "example: srun --nodes=1 --ntasks=1 --gpus-per-node=4 --cpus-per-task=16 "
            "--mem=64G --pty nox -s examples -- --gpus. Without --gpus, the examples "
            "run on CPUs."
        )
    return torch.cuda.device_count()


def main(argv: list[str]) -> int:
    on_gpus = "--gpus" in argv
    names = [arg for arg in argv if arg != "--gpus"]
    unknown = set(names) - set(EXAMPLES)
    if unknown:
        sys.exit(
            f"unknown example(s): {', '.join(sorted(unknown))}; known: "
            f"{', '.join(EXAMPLES)}"
        )
    failed = 0
    launches = [(name, EXAMPLES[name]) for name in names or EXAMPLES]
    launches += [
        (name, launch) for name, launch in MORE_LAUNCHES if not names or name in names
    ]
    env, check = None, check_run
    if on_gpus:
        gpus = gpus_here()
        print(f"{gpus} GPU(s): a process per GPU, NCCL", flush=True)
        launches = [(name, gpu_launch(launch, gpus)) for name, launch in launches]
        env, check = ON_GPUS, check_gpu_run
    for name, launch in launches:
        run = run_example(name, launch, env=env, timeout=600 if on_gpus else 240)
        problems = check(run)
        print(
            run.line() if not problems else f"{run.line()}  PROBLEMS: {problems}",
            flush=True,
        )
        if problems:
            failed += 1
            print(run.output, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
