"""Which processes of a step Slurm's signals reach, under the two ways Slurm tracks a
job's processes: proctrack/linuxproc, the test cluster's, and proctrack/cgroup, what
most clusters run (here with task/cgroup, each node in cgroup v1 hierarchies of its own:
tests/helpers/slurm_lab.py).

The launchers page says what follows for the examples: their DataLoader workers, and
torchrun's workers, get Slurm's SIGTERM and SIGUSR1 from Slurm itself under linuxproc,
and only from their parent under cgroup.
"""

import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_lab import Lab
from test_failures import wait_until

# The cgroup cluster replaces the usual one for a while: what it held is gone after.
pytestmark = [pytest.mark.slurm, pytest.mark.restarts_lab]

PROBE = Path(__file__).parent / "helpers" / "signals" / "probe.py"
# Who notes the signal: the task srun started, its child, torchrun's workers. Under
# cgroup, only the task gets it from Slurm; torchrun, the other step's task, passes
# SIGTERM on to its workers, and dies of SIGUSR1, which it does not handle.
REACHED = {
    ("linuxproc", "USR1"): {"task", "child", "worker"},
    ("linuxproc", "TERM"): {"task", "child", "worker"},
    ("cgroup", "USR1"): {"task"},
    ("cgroup", "TERM"): {"task", "worker"},
}


@pytest.fixture(scope="module")
def cgroup_lab(lab):
    """The test cluster started again with proctrack/cgroup and task/cgroup; the usual
    one back afterwards, for the tests that follow."""
    lab.down()
    tracked = Lab(version=lab.version, cgroups=True)
    tracked.up()
    yield tracked
    tracked.down()
    lab.up()


@pytest.mark.parametrize(("tracking", "signal"), REACHED)
def test_which_processes_a_signal_to_the_steps_reaches(
    request, tmp_path, tracking, signal
):
    lab = request.getfixturevalue("lab" if tracking == "linuxproc" else "cgroup_lab")
    notes = tmp_path / "signals.txt"
    bin_dir = Path(sys.executable).parent
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        f"srun --ntasks=1 --overlap {sys.executable} {PROBE} {notes} task &\n"
        f"srun --ntasks=1 --overlap {bin_dir}/torchrun --standalone --nproc-per-node=2"
        f" {PROBE} {notes} worker &\n"
        "wait\n"
    )
    job = lab.sbatch(script, site="generic", workdir=tmp_path,
                     options=["--nodes=1", "--ntasks=2"])  # fmt: skip

    def ready():
        text = notes.read_text() if notes.exists() else ""
        return text.count("ready") == 4

    try:
        wait_until(ready, 120, "the task, its child and torchrun's two workers")
        # As --signal=USR1@120 does before the time limit: the steps, not the script.
        subprocess.run(["scancel", f"--signal={signal}", job], env=lab.env(),
                       check=True)  # fmt: skip
        time.sleep(3)
    finally:
        # Not lab.cancel(), which waits at most 60 s for the end: under linuxproc, after
        # SIGUSR1 has killed torchrun, this job stayed COMPLETING longer (seen once).
        subprocess.run(["scancel", job], env=lab.env(), capture_output=True)
    reached = {
        line.split()[0] for line in notes.read_text().splitlines()
        if line.endswith(f"SIG{signal}")
    }  # fmt: skip
    assert reached == REACHED[tracking, signal], notes.read_text()
    print(f"proctrack/{tracking}, SIG{signal}: reached {sorted(reached)}")
