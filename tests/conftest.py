"""Shared fixtures (the built site, smoke runs, the Slurm cluster, the jobs of each
job.sh), the Slurm version option, and the rule that in CI a skipped test fails."""

import os
import subprocess
from pathlib import Path

import pytest
from site_browser import build_site
from slurm_lab import DEFAULT_VERSION, ROOTS, VERSIONS, Lab, LabUnavailable
from smoke import EXAMPLES, EXAMPLES_DIR, Launch, run_example, site_of


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slurm-version",
        choices=list(VERSIONS),
        default=DEFAULT_VERSION,
        help=f"the Slurm version of the test cluster (default {DEFAULT_VERSION})",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    """Deselects the tests marked since_slurm(V) when the test cluster runs a Slurm
    older than V: deselected, not skipped, as CI counts a skip as a failure."""
    lab = Lab(version=config.getoption("--slurm-version"))  # starts nothing
    keep, drop = [], []
    for item in items:
        mark = item.get_closest_marker("since_slurm")
        (drop if mark and not lab.at_least(mark.args[0]) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def smoke_run():
    """Runs each (example, launch) in smoke mode once per session; several tests read
    it."""
    runs = {}

    def run(name: str, launch: Launch | None = None, env: dict[str, str] | None = None):
        key = (name, launch, tuple(sorted((env or {}).items())))
        if key not in runs:
            runs[key] = run_example(name, launch, env=env)
        return runs[key]

    return run


@pytest.fixture(scope="session")
def site(tmp_path_factory):
    """The site, built once per session as `nox -s docs` builds it."""
    return build_site(tmp_path_factory.mktemp("site") / "html")


JOB_TIMEOUT = 300  # seconds; 8 ranks importing torch on 2 cores take about a minute


@pytest.fixture(scope="session")
def lab(pytestconfig):
    lab = Lab(version=pytestconfig.getoption("--slurm-version"))
    # First what a crashed run left behind, folders it made included: a /network made
    # by an interrupted 22.05 run is the lab's to remove, not the machine's own.
    lab.down()
    network_existed = Path("/network").exists()  # Mila's dataset mount point
    try:
        lab.up()
    except LabUnavailable as error:
        # Only a developer without root may skip; as root, or in CI, it is a failure.
        if os.geteuid() != 0 and not os.environ.get("CI"):
            pytest.skip(f"Slurm test cluster unavailable: {error}")
        pytest.fail(f"Slurm test cluster unavailable: {error}")
    yield lab
    lab.down()
    assert_torn_down(network_existed)


@pytest.fixture(scope="session")
def jobs(lab, tmp_path_factory):
    """Submits each job.sh unchanged, with its site's profile and its smoke-run
    arguments, once; tests read the finished jobs (and the checkpoints they leave)."""
    done = {}

    def job(name: str):
        if name not in done:
            workdir = tmp_path_factory.mktemp(name.replace("/", "-"))
            script = EXAMPLES_DIR / name / "job.sh"
            job_id = lab.sbatch(
                script, *EXAMPLES[name].args, site=site_of(name), workdir=workdir,
                OMP_NUM_THREADS="1",
            )  # fmt: skip
            done[name] = lab.wait(job_id, workdir, timeout=JOB_TIMEOUT)
        return done[name]

    return job


def assert_torn_down(network_existed: bool):
    netns = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True
    ).stdout
    assert "ddplab" not in netns
    links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert "ddplab" not in links and "ddpe-" not in links and "ddpi-" not in links
    assert "ddp-slurm-lab" not in Path("/etc/hosts").read_text()
    daemons = subprocess.run(
        ["pgrep", "-f", "ddp-slurm-lab"], capture_output=True, text=True
    )
    assert daemons.stdout == "", daemons.stdout
    assert not Path("/tmp/ddp-slurm-lab").exists()
    # The Debian root's bind mounts live in namespaces of the lab's processes: none may
    # remain.
    for mountinfo in Path("/proc").glob("[0-9]*/mountinfo"):
        try:
            mounts = mountinfo.read_text()
        except OSError:  # the process has just exited
            continue
        assert str(ROOTS) not in mounts, (
            f"{mountinfo.parent.name} still holds a mount in {ROOTS}"
        )
    assert Path("/network").exists() == network_existed


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # A skip hides a failure: CI (CI=true) must run every test. Only a developer without
    # what a test needs (root, for the Slurm cluster) may skip, and pytest -ra prints
    # the reason.
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if os.environ.get("CI") and skipped and exitstatus == 0:
        reporter.write_line(
            f"CI: {len(skipped)} test(s) skipped, which CI counts as failures"
        )
        session.exitstatus = 1
