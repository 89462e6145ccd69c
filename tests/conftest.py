"""Shared fixtures (the built site, smoke runs, the Slurm cluster, the jobs of each
job.sh), the Slurm version option, the rule that in CI a skipped test fails, and the
count of the pages' untested claims at the end of every run."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import page_text
import pytest
from page_text import page_command
from site_browser import build_site
from slurm_lab import DEFAULT_VERSION, ROOTS, VERSIONS, Lab, LabUnavailable
from smoke import Launch, run_example


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slurm-version",
        choices=list(VERSIONS),
        default=DEFAULT_VERSION,
        help=f"the Slurm version of the test cluster (default {DEFAULT_VERSION})",
    )


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    """Deselects the tests marked since_slurm(V) when the test cluster runs a Slurm
    older than V, before_slurm(V) when it runs V or newer, those marked apptainer where
    its root has no Apptainer (all but 26.05), and those marked apptainer(False) where
    it has: deselected, not skipped, as CI counts a skip as a failure. The tests marked
    restarts_lab go last: a restart of the test cluster removes its files, and with them
    what the session's earlier jobs left for later tests to read. Each test gets its
    group for pytest-xdist (worker_group)."""
    lab = Lab(version=config.getoption("--slurm-version"))  # starts nothing
    keep, drop = [], []
    for item in items:
        (keep if runs_on(item, lab) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = sorted(keep, key=restarts_lab)
    for item in items:
        item.add_marker(pytest.mark.xdist_group(worker_group(item)))


def runs_on(item: pytest.Item, lab: Lab) -> bool:
    """Whether a test runs where the test cluster has `lab`'s version."""
    mark = item.get_closest_marker("since_slurm")
    too_old = mark is not None and not lab.at_least(mark.args[0])
    mark = item.get_closest_marker("before_slurm")
    too_old = too_old or mark is not None and lab.at_least(mark.args[0])
    # apptainer: needs Apptainer; apptainer(False): needs a cluster without it.
    apptainer = item.get_closest_marker("apptainer")
    wrong = apptainer and (apptainer.args or [True])[0] != lab.has_apptainer
    return not (too_old or wrong)


def uses_slurm(item: pytest.Item) -> bool:
    return bool(item.get_closest_marker("slurm")) or bool(
        {"lab", "jobs"} & set(getattr(item, "fixturenames", ()))
    )


def ci_versions(item: pytest.Item) -> list[str]:
    """The Slurm versions that `nox -s tests` (CI) runs a test on: every test on the
    default version, those marked every_version on the others too. ["none"] for a test
    that uses no Slurm; ["never"] for a Slurm test that CI runs nowhere (test_claims.py
    fails on it). docs/testing.md's "Slurm" column says the same (test_claims.py)."""
    if not uses_slurm(item):
        return ["none"]
    versions = [DEFAULT_VERSION]
    if item.get_closest_marker("every_version"):
        versions = list(VERSIONS)
    return sorted(v for v in versions if runs_on(item, Lab(version=v))) or ["never"]


def pytest_itemcollected(item: pytest.Item) -> None:
    # WHERE_TESTS_RUN=FILE: write each test function's CI versions into FILE, for
    # test_claims.py: JSON, by "file::function", the versions of each of its cases.
    if os.environ.get("WHERE_TESTS_RUN"):
        name = f"{item.path.name}::{getattr(item, 'originalname', None) or item.name}"
        versions = ci_versions(item)
        if versions not in WHERE.setdefault(name, []):
            WHERE[name].append(versions)


WHERE: dict[str, list[list[str]]] = {}


def pytest_collection_finish(session: pytest.Session) -> None:
    if path := os.environ.get("WHERE_TESTS_RUN"):
        Path(path).write_text(json.dumps(WHERE))


def restarts_lab(item: pytest.Item) -> bool:
    return item.get_closest_marker("restarts_lab") is not None


def worker_group(item: pytest.Item) -> str:
    """Where a test runs when nox -s tests runs two workers (pytest-xdist's --dist
    loadgroup): the tests of the one Slurm test cluster on one, in their order; all the
    others on the other, each session and module fixture made once."""
    return "slurm" if uses_slurm(item) else "rest"


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


@pytest.fixture
def process_group():
    """A one-process gloo group in this process, for the functions that DDP needs."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def site(tmp_path_factory):
    """The site, built once per session as `nox -s docs` builds it."""
    return build_site(tmp_path_factory.mktemp("site") / "html")


JOB_TIMEOUT = 300  # seconds; 8 ranks importing torch on 2 cores take about a minute
# The ReFrame checks of checks/examples.py run against the test cluster as
# docs/verify.md says to run them against a real one, with the cluster's site file in
# place of the reader's site.py.
SITE_FILE = Path(__file__).resolve().parent / "sites" / "reframe_site.py"


def checks_command() -> list[str]:
    """docs/verify.md's reframe command, with this cluster's site file, and each job's
    time limit that of the tests' own jobs."""
    words = shlex.split(page_command("verify.md", "reframe -C site.py -c checks/ -r"))
    reframe = str(Path(sys.executable).parent / "reframe")
    return [
        reframe,
        *[str(SITE_FILE) if word == "site.py" else word for word in words[1:]],
        "-S", f"time_limit={JOB_TIMEOUT}s",
    ]  # fmt: skip


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
def jobs(lab, request, tmp_path_factory):
    """The job of each job.sh, submitted unchanged by its ReFrame check, with its site's
    profile and its smoke-run arguments (tests/sites/reframe_site.py); tests read the
    finished jobs (and the checkpoints they leave in `job.workdir`).

    The first test that asks runs the checks of every example that the selected tests
    ask for, in one reframe run: each job.sh runs once in a session.
    """
    wanted = set()
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if "jobs" in item.fixturenames and callspec and "name" in callspec.params:
            wanted.add(callspec.params["name"])
    done = {}

    def job(name: str):
        if name not in done:
            batch = sorted({name} | (wanted - done.keys()))
            prefix = tmp_path_factory.mktemp("reframe")
            done.update(lab.run_checks(batch, prefix, checks_command()))
        return done[name]

    return job


@pytest.fixture(scope="session")
def exact_twin(lab, tmp_path_factory):
    """generic/checkpointing with EXACT_RUN, never interrupted: the twin that both the
    preempted job and the resubmitted one must end bitwise equal to. It starts with
    the first test that asks for it; calling the fixture's value waits for its end.
    The container example's job, whose main.py is step 4's, must too."""
    from test_failures import EXACT_LAYOUT, EXACT_RUN, submit

    workdir = tmp_path_factory.mktemp("plain")
    job_id = submit(
        lab, "generic/checkpointing", *EXACT_RUN, workdir=workdir,
        options=EXACT_LAYOUT,
    )  # fmt: skip
    finished = {}

    def wait():
        if not finished:
            finished["job"] = lab.wait(job_id, workdir, timeout=300)
        return finished["job"], workdir

    return wait


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


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    # The pages' claims that the guide has not run ({untested} marks): their number may
    # only fall (tests/test_claims.py), and every run of the suite says where it stands.
    counts = {
        str(page.relative_to(page_text.DOCS)): len(page_text.untested_claims(page))
        for page in page_text.PAGES
    }
    listed = ", ".join(f"{page} {n}" for page, n in counts.items() if n)
    terminalreporter.write_line(
        f"untested claims on the pages: {sum(counts.values())} ({listed})"
    )
    # Under two workers, the time each group took: the longer one is the run's length,
    # the place to look when CI grows.
    groups: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport) and "@" in report.nodeid:
                group = report.nodeid.rsplit("@", 1)[1]
                groups[group] = groups.get(group, 0.0) + report.duration
    if groups:
        terminalreporter.write_line(
            "time of each worker group: "
            + ", ".join(f"{g} {t / 60:.1f} min" for g, t in sorted(groups.items()))
        )


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
