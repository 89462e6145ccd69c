"""Shared fixtures, and the rule that in CI a skipped test fails the run."""

import os

import pytest
from smoke import Launch, run_example


@pytest.fixture(scope="session")
def smoke_run():
    """Runs each (example, launch) in smoke mode once per session; several tests read it."""
    runs = {}

    def run(name: str, launch: Launch | None = None, env: dict[str, str] | None = None):
        key = (name, launch, tuple(sorted((env or {}).items())))
        if key not in runs:
            runs[key] = run_example(name, launch, env=env)
        return runs[key]

    return run


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # A skip hides a failure: CI (CI=true) must run every test. Only a developer without what a
    # test needs (root, for the Slurm cluster) may skip, and pytest -ra prints the reason.
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if os.environ.get("CI") and skipped and exitstatus == 0:
        reporter.write_line(f"CI: {len(skipped)} test(s) skipped, which CI counts as failures")
        session.exitstatus = 1
