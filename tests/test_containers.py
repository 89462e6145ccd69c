"""The container example (examples/generic/container) under the real Slurm test
cluster, in Apptainer, and what pyxis and enroot set in a task.

Apptainer runs in the Slurm 26.05 root only (Debian sid's package, slurm_lab.py), so
the tests marked `apptainer` run on 26.05. The image is a stand-in for NVIDIA's
(tests/helpers/container_image.py): no Slurm commands, the pinned torch in /opt/venv.
"""

import re
import subprocess
import time

import pytest
from slurm_lab import IMAGE
from smoke import (
    EXAMPLES_DIR,
    GENERIC_SMOKE_ARGS,
    assert_bitwise_equal,
    parse_summaries,
)
from test_failures import (
    EPOCH_END,
    EXACT_LAYOUT,
    EXACT_RANKS,
    EXACT_RUN,
    FAIL_FAST,
    assert_same_summaries,
    checkpoint_of,
    read,
    restart_when_requeued,
    submit,
    wait_until,
)

NAME = "generic/container"
FOLDER = EXAMPLES_DIR / NAME


def in_containers(test):
    """Runs `test` in the 26.05 pass of `nox -s tests` (every_version), where Apptainer
    is, and nowhere else."""
    for mark in (pytest.mark.slurm, pytest.mark.apptainer, pytest.mark.every_version):
        test = mark(test)
    return test


def test_the_container_step_runs_step_4_unchanged():
    step_4 = EXAMPLES_DIR / "generic/checkpointing"
    for path in step_4.glob("*.py"):  # main.py and its modules
        assert (FOLDER / path.name).read_bytes() == path.read_bytes(), path.name
    # The image that job.sh looks for is the one that pytorch.def builds, from the NGC
    # release that the definition file names.
    definition = (FOLDER / "pytorch.def").read_text()
    tag = re.search(
        r"^From: nvcr\.io/nvidia/pytorch:(\d\d\.\d\d)-py3$", definition, re.M
    )
    assert tag, definition
    job = (FOLDER / "job.sh").read_text()
    image = f"images/pytorch-{tag[1]}.sif"
    assert f"image=${{IMAGE:-$storage/{image}}}" in job
    assert f'apptainer build "$SCRATCH/{image}" pytorch.def' in definition
    assert image == IMAGE  # where the test cluster puts its stand-in
    # Every task starts main.py in the image with the node's NVIDIA libraries (--nv):
    # the test nodes have none, so only this line shows it.
    assert re.search(
        r'^srun .*\\\n +apptainer exec --nv "\$image" python main\.py "\$@"', job, re.M
    )


@in_containers
@pytest.mark.timeout(900)
def test_requeued_from_inside_the_container_it_resumes_exactly(
    lab, tmp_path, exact_twin
):
    # Warned as --signal=USR1@120 warns every task before the time limit. main.py,
    # inside the container, finds no scontrol and leaves job.sh the requeue.
    job = submit(lab, NAME, *EXACT_RUN, workdir=tmp_path / "run", options=EXACT_LAYOUT)
    output = tmp_path / "run" / f"slurm-{job}.out"
    wait_until(lambda: EPOCH_END in read(output), 180, "an epoch of training")
    subprocess.run(["scancel", "--signal=USR1", job], env=lab.env(), check=True)
    restart_when_requeued(lab, job, 1)
    resumed = lab.wait(job, tmp_path / "run", timeout=300)
    assert resumed.ok, resumed.output
    assert "No scontrol here: asking job.sh to requeue job" in resumed.output
    stops = re.findall(
        r"\[(\d)/4\] Stopped at step (\d+), checkpoint saved", resumed.output
    )
    (step,) = {int(step) for _, step in stops}
    assert len(stops) == EXACT_RANKS, resumed.output
    assert re.search(rf"Resumed from \S+ at step {step}\b", resumed.output)
    # Every rank on its node, two a node.
    summaries = parse_summaries(resumed.output)
    assert sorted(s["host"] for s in summaries) == ["cn1", "cn1", "cn2", "cn2"]
    # The same numbers, bitwise, as step 4 run directly by srun and never interrupted.
    uninterrupted, plain = exact_twin()
    assert uninterrupted.ok, uninterrupted.output
    assert_same_summaries(resumed, uninterrupted, restarts=1)
    assert_bitwise_equal(
        checkpoint_of(lab, tmp_path / "run"), checkpoint_of(lab, plain)
    )


def fails_fast(lab, tmp_path, **env) -> str:
    """Submits the container job with `env` and returns its output once it has failed,
    within FAIL_FAST seconds, before any task started."""
    start = time.monotonic()
    job = submit(lab, NAME, "--synthetic-data", workdir=tmp_path, **env)
    done = lab.wait(job, tmp_path, timeout=FAIL_FAST)
    assert done.state == "FAILED", done.output
    assert time.monotonic() - start < FAIL_FAST
    assert "summary:" not in done.output
    return " ".join(done.output.split())


@in_containers
def test_a_missing_image_fails_fast_and_names_the_fix(lab, tmp_path):
    missing = lab.state / "scratch" / "images" / "nothing-here.sif"
    out = fails_fast(lab, tmp_path, IMAGE=str(missing))
    assert f"error: no container image at {missing}: build it with" in out
    assert f"`apptainer build {missing} pytorch.def`, or set IMAGE to yours" in out


@in_containers
def test_a_bind_of_a_missing_folder_fails_fast_and_names_the_fix(lab, tmp_path):
    # A folder bound by the reader that this node lacks: Apptainer refuses to start.
    missing = lab.state / "datasets-not-on-this-node"
    out = fails_fast(lab, tmp_path, APPTAINER_BIND=str(missing))
    assert f"mount source {missing} doesn't exist" in out
    assert "error: apptainer could not start " in out
    assert f"APPTAINER_BIND={missing}," in out


@pytest.mark.slurm
@pytest.mark.apptainer(False)
def test_a_node_without_apptainer_fails_fast_and_names_the_fix(lab, tmp_path):
    # Slurm 24.11's nodes have no Apptainer, as a node whose module is not loaded.
    out = fails_fast(lab, tmp_path)
    assert "error: no apptainer command on cn1: load its module" in out


@in_containers
def test_gpus_not_shown_to_the_container_stop_it_at_once(lab, tmp_path):
    # The nodes' GPUs are stand-ins that CUDA cannot use, as the GPUs of a container
    # started without --nv are: the check in devices.py stops every task, inside.
    start = time.monotonic()
    job = submit(lab, NAME, "--synthetic-data", workdir=tmp_path, TRAIN_ON_CPU="")
    done = lab.wait(job, tmp_path, timeout=FAIL_FAST)
    assert done.state == "FAILED", done.output
    assert time.monotonic() - start < FAIL_FAST
    out = " ".join(done.output.split())
    assert "a container started without its GPUs (apptainer --nv)" in out, out
    # main.py's exit status (1, for the error) reached srun through apptainer.
    assert re.search(
        r"srun: error: cn\d: tasks? [\d-]+: Exited with exit code 1\b", out
    )


@in_containers
def test_without_tmp_python_writes_its_temporary_files_in_the_current_folder(
    lab, tmp_path
):
    # A site whose Apptainer binds no /tmp (`mount tmp = no`): the image's /tmp is
    # read-only, so Python falls back to the current folder. From a deep folder, the
    # socket of multiprocessing's fork server gets too long a path (AF_UNIX).
    code = "import tempfile; print(tempfile.gettempdir())"
    exec_ = ["apptainer", "exec", str(lab.state / "scratch" / IMAGE), "python", "-c"]

    def temporary_folder(**env) -> str:
        return subprocess.run(
            ["srun", "-N1", "-n1", *exec_, code], cwd=tmp_path, check=True,
            env=lab.env(APPTAINER_USERNS="1", **env), capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip

    assert temporary_folder() == "/tmp"  # Apptainer's default binds
    assert temporary_folder(APPTAINER_NO_MOUNT="tmp") == str(tmp_path)
    # The fix: a folder of the node's own disk, bound at /tmp.
    (tmp_path / "node-tmp").mkdir()
    bind = f"{tmp_path}/node-tmp:/tmp"
    assert temporary_folder(APPTAINER_NO_MOUNT="tmp", APPTAINER_BIND=bind) == "/tmp"


# ------------------------------------------------------------
# pyxis and enroot


@pytest.mark.slurm
@pytest.mark.every_version
@pytest.mark.since_slurm("26.05")
def test_a_task_with_pyxis_variables_meets_at_the_first_node(lab, tmp_path):
    # What a task started by `srun --container-image` has, under pyxis with NVIDIA's
    # PyTorch image and enroot's hook: RANK, LOCAL_RANK, WORLD_SIZE and the hook's
    # MASTER_PORT beside srun's variables (the cluster's TaskProlog sets them, asked
    # by LAB_PYXIS_PYTORCH). On 26.05, rank 0 runs on cn2 (topology.conf); MASTER_ADDR
    # names cn1. Read as torchrun's, the variables left rank 0 to serve the rendezvous
    # on cn2 while the others looked for it on cn1, and the job hung.
    name = "generic/multi_node"
    start = time.monotonic()
    args = (*GENERIC_SMOKE_ARGS, "--synthetic-data")
    job = submit(lab, name, *args, workdir=tmp_path, LAB_PYXIS_PYTORCH="1")
    done = lab.wait(job, tmp_path, timeout=150)
    assert done.ok, done.output
    summaries = parse_summaries(done.output)
    hosts = {s["rank"]: s["host"] for s in summaries}
    assert len(hosts) == 8 and hosts[0] == "cn2", done.output
    print(f"pyxis variables: 8 ranks met in {time.monotonic() - start:.0f} s")
