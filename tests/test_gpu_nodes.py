"""What a real GPU node does with the examples, where the
CPU test cluster cannot show it.

The Slurm tests run every job.sh on CPUs with stand-in GPUs. These tests
check the rest: that each GPU type a job.sh asks for can run the torch build
it installs, that a task given GPUs which CUDA cannot use stops instead of
training on CPUs, how a process picks its GPU and counts its DataLoader
workers, and what the pages say about NCCL and DDP against this torch.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from page_text import page_command
from smoke import EXAMPLES, EXAMPLES_DIR, load_main, run_example

DOCS = Path(__file__).resolve().parent.parent / "docs"
JOB_SCRIPTS = sorted(EXAMPLES_DIR.glob("**/job.sh"))
NAMES = sorted(EXAMPLES)

# Compute capability of each GPU type or node feature that a job.sh
# may name, from NVIDIA's tables (developer.nvidia.com/cuda-gpus
# and its legacy page). Add a type before using it.
COMPUTE_CAPABILITY = {
    "p100": (6, 0),
    "gtx1080ti": (6, 1),
    "p6000": (6, 1),
    "v100": (7, 0),
    "t4": (7, 5),
    "rtx8000": (7, 5),
    "rtx2080ti": (7, 5),
    "a100": (8, 0),
    "a10": (8, 6),
    "a6000": (8, 6),
    "l40s": (8, 9),
    "h100": (9, 0),
    "h200": (9, 0),
}
# Node features of the guide's clusters that name no GPU
# (Ibex: GPUs per node, CPU models).
OTHER_FEATURES = {
    "4gpus",
    "8gpus",
    "gpu_ai",
    "cpu_intel_gold_6142",
    "cpu_intel_e5_2699_v3",
}
# The oldest NVIDIA driver that runs each CUDA major version
# of a torch build (Linux; NVIDIA's CUDA compatibility guide:
# a 13.x build needs 580 or newer, a 12.x build 525 or newer).
DRIVER_FOR_CUDA = {"13": 580, "12": 525}
# Short forms of the #SBATCH options that ask for GPUs or node features.
SHORT_OPTIONS = {"C": "constraint", "G": "gpus"}


def gpu_types(script: str) -> set[str]:
    """The GPU types and node features that a job script asks for, lower-cased."""
    found = set()
    lines = re.findall(
        r"^#SBATCH\s+(?:--([\w-]+)|-(\w))(?:[=\s]\s*(\S+))?", script, re.M
    )
    for long, short, value in lines:
        option = long or SHORT_OPTIONS.get(short, short)
        if option == "constraint":
            # features joined by & (and) or | (or), maybe
            # in brackets, maybe with a *count
            features = re.split(r"[&|,()\[\]]", value.strip("'\""))
            found |= {f.split("*")[0] for f in features if f}
        elif option in ("gpus", "gpus-per-node", "gpus-per-task", "gres"):
            # [gpu:]type:count, or a bare count
            parts = value.lower().split(":")
            parts = parts[1:] if parts[0] == "gpu" else parts
            if len(parts) == 2:
                found.add(parts[0])
    return {f.lower() for f in found}


def installed_build(script: str) -> tuple[str, str]:
    """The torch version and package index named by the script's install comment."""
    match = re.search(r"^#.*pip install .*\btorch==(\S+)(.*)$", script, re.M)
    assert match, "name the torch build in a comment: `pip install torch==X ...`"
    index = re.search(r"--index-url \S+/whl/(cu\d+)", match[2])
    return match[1], index[1] if index else "pypi"


def runs_on(arch_list: list[str], capability: tuple[int, int]) -> bool:
    """Whether a build with these kernels runs on a GPU of this compute capability.

    A kernel built for sm_XY runs on any GPU of major version X and minor version Y or
    more; a compute_XY entry (PTX) compiles at run time for XY or newer.
    """
    major, minor = capability
    for arch in arch_list:
        kind, _, number = arch.partition("_")
        arch_major, arch_minor = int(number[:-1]), int(number[-1])
        if kind == "sm" and arch_major == major and arch_minor <= minor:
            return True
        if kind == "compute" and (arch_major, arch_minor) <= capability:
            return True
    return False


# ------------------------------------------------------------
# The build a job installs, against the GPUs it asks for


def test_arch_rule_matches_nvidias_compatibility():
    assert runs_on(["sm_80", "sm_86"], (8, 9))  # L40S runs sm_86 kernels
    assert not runs_on(["sm_75", "sm_80"], (7, 0))  # V100: no kernel image
    assert not runs_on(["sm_90"], (8, 0))  # kernels for newer GPUs do not run on older
    assert runs_on(["compute_70"], (9, 0))  # PTX compiles for newer GPUs


# The container job runs its image's torch instead (below).
CONTAINER = EXAMPLES_DIR / "generic" / "container"


@pytest.mark.parametrize(
    "script",
    [p for p in JOB_SCRIPTS if p.parent != CONTAINER],
    ids=lambda p: str(p.parent.relative_to(EXAMPLES_DIR)),
)
def test_every_gpu_a_job_asks_for_runs_the_build_it_installs(script):
    text = script.read_text()
    version, index = installed_build(text)
    # The build that the test environment installs is the one the scripts name: its arch
    # list and CUDA version come from torch itself, not from a table.
    assert (version, index) == ("2.14.1", "pypi"), (
        f"add the arch list of torch {version} {index}"
    )
    assert torch.__version__.split("+")[0] == version
    arch_list, cuda = torch.cuda.get_arch_list(), torch.version.cuda
    assert arch_list, "this torch has no CUDA kernels"
    asked = gpu_types(text)
    unknown = asked - COMPUTE_CAPABILITY.keys() - OTHER_FEATURES
    assert not unknown, f"add the compute capability of {unknown} to COMPUTE_CAPABILITY"
    for gpu in sorted(asked & COMPUTE_CAPABILITY.keys()):
        assert runs_on(arch_list, COMPUTE_CAPABILITY[gpu]), (
            f"{gpu} (sm_{''.join(map(str, COMPUTE_CAPABILITY[gpu]))}) cannot run torch "
            f"{version} from {index}, built for {arch_list}"
        )
    # The comment names the driver that the build's CUDA needs.
    driver = re.search(r"NVIDIA driver (\d+) or newer", text)
    needed = DRIVER_FOR_CUDA[cuda.split(".")[0]]
    assert driver and int(driver[1]) == needed, (
        f"CUDA {cuda} needs driver {needed} or newer"
    )


def test_the_container_image_names_the_driver_its_cuda_needs():
    # The image's kernels cannot be read here (the test machines cannot reach NGC): its
    # definition file names its CUDA and the driver that needs, and job.sh asks for no
    # GPU type whose compute capability would have to be checked against it.
    definition = (CONTAINER / "pytorch.def").read_text()
    cuda = re.search(r"CUDA (\d+)\.\d+", definition)
    driver = re.search(r"NVIDIA driver (\d+) or newer", definition)
    assert cuda and driver and int(driver[1]) == DRIVER_FOR_CUDA[cuda[1]], definition
    assert gpu_types((CONTAINER / "job.sh").read_text()) == set()


def test_gpu_types_are_read_from_every_form_of_request():
    script = (
        "#SBATCH --gpus-per-node=rtx8000:4\n#SBATCH --constraint=a100&4gpus\n"
        '#SBATCH --gres=gpu:v100:2\n#SBATCH --gpus=4\n#SBATCH -C "[p100|t4]"\n'
        "#SBATCH --gres gpu:h100:1\n#SBATCH -G l40s:2\n"
    )
    assert gpu_types(script) == {
        "rtx8000",
        "a100",
        "4gpus",
        "v100",
        "p100",
        "t4",
        "h100",
        "l40s",
    }


# ------------------------------------------------------------
# A task given GPUs that CUDA cannot use


GPUS_GIVEN = {
    "SLURM_GPUS_ON_NODE": "2",
    "CUDA_VISIBLE_DEVICES": "0,1",
    "TRAIN_ON_CPU": "",
}


# devices.py: its one source, which every example holds byte for byte (test_layout.py).
def test_every_example_refuses_gpus_that_cuda_cannot_use(monkeypatch):
    module = load_main("shared", "devices.py")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for variable, value in GPUS_GIVEN.items():
        monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit, match="was given GPUs .* set TRAIN_ON_CPU=1"):
        module.use_gpus()
    monkeypatch.setenv("TRAIN_ON_CPU", "1")  # asked for
    assert module.use_gpus() is False
    monkeypatch.setenv("TRAIN_ON_CPU", "")
    monkeypatch.delenv("SLURM_GPUS_ON_NODE")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # no GPU given: a laptop, a CPU job
    assert module.use_gpus() is False


# One example per launch: python, srun, torchrun and mp.spawn.
@pytest.mark.parametrize(
    "name",
    ["mila/single_gpu", "generic/multi_gpu", "ibex/single_node", "launchers/mp_spawn"],
)
def test_a_task_given_gpus_that_cuda_cannot_use_stops_at_once(name):
    # This machine's CUDA build of torch finds no GPU, as
    # on a node whose driver is too old.
    if torch.cuda.is_available():
        pytest.skip("needs a machine where CUDA finds no GPU")
    run = run_example(name, env=GPUS_GIVEN, timeout=120)
    assert not run.ok and not run.summaries, run.output
    assert (
        "was given GPUs (SLURM_GPUS_ON_NODE=2, CUDA_VISIBLE_DEVICES=0,1)" in run.output
    )
    assert "set TRAIN_ON_CPU=1" in run.output
    assert (
        "Running on" not in run.output
    )  # before any training, and before the rendezvous


def test_without_gpus_an_example_trains_on_cpus_unasked():
    # A laptop, or a job that asked for no GPU: nothing to set.
    run = run_example("generic/multi_gpu", env={"TRAIN_ON_CPU": ""})
    assert run.ok, run.output
    assert "device cpu" in run.output


# ------------------------------------------------------------
# Which GPU a process takes


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    ("visible", "local_rank", "expected"),
    [
        (
            1,
            3,
            0,
        ),  # bound: --gpus-per-task, --gpu-bind or a MIG slice shows the task its own
        (4, 3, 3),  # the node's GPUs, shared by its tasks: the local rank picks one
        (4, 0, 0),
        (
            2,
            3,
            None,
        ),  # fewer GPUs than processes on the node: stop, rather than share one
    ],
)
def test_a_process_takes_its_own_gpu_however_slurm_binds_them(
    monkeypatch, name, visible, local_rank, expected
):
    module = load_main(name, "devices.py")
    chosen = []
    monkeypatch.delenv("TRAIN_ON_CPU", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    if expected is None:
        with pytest.raises(
            SystemExit, match=f"sees {visible} GPUs, none of them its own"
        ):
            module.get_device(local_rank)
        return
    device = module.get_device(local_rank)
    assert device == torch.device("cuda", expected) and chosen == [device]
    # Asked for CPUs, it takes no GPU, even where CUDA works.
    monkeypatch.setenv("TRAIN_ON_CPU", "1")
    assert module.get_device(local_rank) == torch.device("cpu")


# ------------------------------------------------------------
# How many DataLoader workers


# devices.py's one source (every example holds it byte for byte): under srun, one
# process per task; under torchrun, as Ibex's steps start it, two.
@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
@pytest.mark.parametrize(
    ("affinity", "cpus_per_task", "per_process"),
    [
        (8, "64", 8),  # Slurm bound the task to 8 CPUs: SLURM_CPUS_PER_TASK says more
        (8, None, 8),
        (
            64,
            "8",
            8,
        ),  # a site that binds no task: the whole node is visible, keep to the ask
        (1, "8", 1),  # Slurm 22.05 to 23.02, srun without -c: the step got one CPU
    ],
)
def test_workers_are_counted_from_the_cpus_a_process_may_use(
    monkeypatch, launcher, affinity, cpus_per_task, per_process
):
    module = load_main("shared", "devices.py")
    monkeypatch.setattr(
        module.os, "sched_getaffinity", lambda pid: set(range(affinity))
    )
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    if cpus_per_task is None:
        monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    else:
        monkeypatch.setenv("SLURM_CPUS_PER_TASK", cpus_per_task)
    if launcher == "torchrun":
        # torchrun's two processes share the task's CPUs.
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        expected = max(per_process // 2 - 1, 0)
        assert module.get_num_workers() == expected
    else:
        # One CPU stays with the training process.
        assert module.get_num_workers() == max(per_process - 1, 0)


def test_every_process_seeds_its_own_dataloader_workers():
    # Workers draw their random numbers (augmentations) from a seed that the DataLoader
    # takes from its generator. With one seed on every rank, rank r's k-th sample would
    # be cropped and flipped as every other rank's k-th sample.
    checked = []
    for path in sorted(EXAMPLES_DIR.glob("**/main.py")):
        source = path.read_text()
        # DistributedSampler, or step 4's ResumableSampler (resumable_data.py).
        if "num_workers" in source and re.search(r"\b\w*Sampler\(", source):
            assert re.search(r"manual_seed\(.*\brank\b", source), path
            checked.append(path.parent.relative_to(EXAMPLES_DIR))
    # Every example of several processes that loads with workers: 16 of the 19.
    assert len(checked) == 16, checked


def test_mp_spawn_holds_its_port_from_choice_to_use():
    # A free port found by binding port 0 and closing the socket can be taken by another
    # process before rank 0 binds it again. mp_spawn's parent binds the store itself, on
    # port 0, and keeps it for the children.
    source = (EXAMPLES_DIR / "launchers" / "mp_spawn" / "main.py").read_text()
    assert 'dist.TCPStore("127.0.0.1", 0, is_master=True' in source
    assert "MASTER_PORT=str(port)" in source and ".close()" not in source


# ------------------------------------------------------------
# Requests and settings that only matter on a real cluster


@pytest.mark.parametrize(
    "script", JOB_SCRIPTS, ids=lambda p: str(p.parent.relative_to(EXAMPLES_DIR))
)
def test_every_job_asks_for_memory(script):
    # Without it, the site's default decides: an out-of-memory kill, or the whole node.
    assert re.search(
        r"^#SBATCH\s+--mem(-per-cpu|-per-gpu)?=\d+[KMGT]?$", script.read_text(), re.M
    )


@pytest.mark.parametrize(
    "script", JOB_SCRIPTS, ids=lambda p: str(p.parent.relative_to(EXAMPLES_DIR))
)
def test_no_job_logs_nccl_info_on_every_run(script):
    if script.parent.name == "fabric":  # the network NCCL picks is what it checks
        assert re.search(r"^export NCCL_DEBUG=INFO$", script.read_text(), re.M)
        return
    assert not re.search(r"^\s*export NCCL_DEBUG=INFO", script.read_text(), re.M)


def test_pages_give_this_torchs_collective_timeouts():
    from torch.distributed import constants

    assert constants.default_pg_nccl_timeout.total_seconds() == 10 * 60
    assert constants.default_pg_timeout.total_seconds() == 30 * 60
    concepts = (DOCS / "concepts.md").read_text()
    assert "10 minutes for NCCL and 30 minutes for gloo" in concepts


def first_step_buckets(**ddp_options) -> list[list[tuple[int, ...]]]:
    """The shapes of the parameters in each of DDP's
    first-step buckets, in reduction order."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(300_000, 1), torch.nn.Linear(1, 2))
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=1, **ddp_options
        )
        buckets = ddp.reducer._get_zeros_like_grad_buckets()
        return [[tuple(p.shape) for p in bucket.parameters()] for bucket in buckets]
    finally:
        dist.destroy_process_group()


def test_ddp_first_step_buckets_are_as_the_troubleshooting_page_says():
    # By default (find_unused_parameters=False), this torch puts every
    # parameter in one bucket for the first step, in the order of
    # model.parameters(): the order of backward() is not known yet. DDP's notes
    # describe the other case: buckets of bucket_cap_mb, filled in parameter
    # order and reduced last bucket first, "(roughly) the reverse order".
    assert first_step_buckets() == [[(1, 300_000), (1,), (2, 1), (2,)]]
    assert first_step_buckets(find_unused_parameters=True) == [
        [(1,), (2, 1), (2,)],
        [(1, 300_000)],
    ]


def test_the_adapt_pages_build_check_prints_what_the_page_says():
    text = (DOCS / "adapt.md").read_text()
    line = page_command("adapt.md", "python -c ")
    python_bin = Path(sys.executable).parent
    result = subprocess.run(
        ["bash", "-c", line], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PATH": f"{python_bin}:{os.environ['PATH']}"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    [printed] = re.findall(r"The PyPI build prints `([^`]+)`", text)
    assert result.stdout.strip() == printed
    # And the driver the page names for that CUDA.
    assert (
        f"driver {DRIVER_FOR_CUDA[torch.version.cuda.split('.')[0]]} or newer" in text
    )
