"""Sessions for the guide.

nox -s examples docs    every example in CPU smoke mode, then the site
nox -s examples -- --gpus
                        every example on the GPUs of this node, with NCCL
nox -s lint tests       the test suite, Slurm test cluster and browser included (root;
                        what .ci/run runs): everything on Slurm 24.11, then the
                        every_version tests on 26.05 and 22.05
nox -s slurm            only the tests that submit job.sh files to the Slurm test
                        cluster, all of them on each version;
                        `nox -s "slurm(version='26.05')"` for one
nox -s docs -- --serve  rebuild the site on every change, served on localhost:8000
nox -s copies           write each module of examples/shared/ into the example folders
                        that import it (edit the source there, never a copy)
nox -s bench            samples/s of the generic template with each speed
                        setting (GPU)
nox -s screenshots      PNGs of the Mila page's first diff, light and dark, for the
                        README
"""

import os
import shutil
import subprocess
from pathlib import Path

import nox

nox.needs_version = ">=2025.2.9"
nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["examples", "docs"]

ROOT = Path(__file__).parent
PYPROJECT = nox.project.load_toml(ROOT / "pyproject.toml")
# Every shell script a reader copies, and the test cluster's.
JOB_SCRIPTS = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("examples/**/*.sh"))
SITE_SCRIPTS = sorted(
    str(p.relative_to(ROOT))
    for p in [
        *ROOT.glob("tests/sites/**/*"),
        *ROOT.glob("tests/helpers/hang/*"),
        *ROOT.glob("tests/helpers/lightning_alone/*"),
    ]
    if p.suffix == ".sh" or p.name == "activate"
)


def pip_config(key: str) -> str:
    try:
        out = subprocess.run(
            ["python3", "-m", "pip", "config", "get", key],
            capture_output=True,
            text=True,
        )
    except OSError:
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


# uv ignores pip's configuration. Where pip is set up with extra
# indexes or a wheel folder (on this project's machines, torch lies on
# local disk there), give uv the same ones, or it downloads several GB
# of CUDA wheels. Bytecode: without it every torch import takes 10 s.
for variable, key in [
    ("UV_EXTRA_INDEX_URL", "global.extra-index-url"),
    ("UV_FIND_LINKS", "global.find-links"),
]:
    if variable not in os.environ and (value := pip_config(key)):
        os.environ[variable] = value
# pip takes each package's versions from all its indexes; uv, by default, from the first
# index that has the package only, so a local index with an older jsonschema would hide
# the one reframe-hpc needs. This order still takes torch from the local indexes first.
if "UV_EXTRA_INDEX_URL" in os.environ:
    os.environ.setdefault("UV_INDEX_STRATEGY", "unsafe-first-match")
os.environ.setdefault("UV_COMPILE_BYTECODE", "1")


def install(session: nox.Session, group: str) -> None:
    session.install(*nox.project.dependency_groups(PYPROJECT, group))


@nox.session
def examples(session: nox.Session) -> None:
    """Runs every example in CPU gloo smoke mode, a line of results each; with
    `-- --gpus`, on this node's GPUs with NCCL (tests/helpers/smoke.py)."""
    install(session, "examples")
    session.run("python", "tests/helpers/smoke.py", *session.posargs)


@nox.session(python=False)
def copies(session: nox.Session) -> None:
    """Writes each module of examples/shared/ into the example folders that import it
    (tests/tools/copies.py); `-- --check` only lists the copies that differ."""
    session.run("python3", "tests/tools/copies.py", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Samples/s of the template as each speed setting is turned on (GPU node).

    `nox -s bench -- --csv bench.csv -- --data-dir DIR` measures
    your own data's input pipeline; see tests/tools/bench.py.
    """
    install(session, "examples")
    session.run("python", "tests/tools/bench.py", *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """Builds the site into docs/_build/html; warnings are errors."""
    install(session, "docs")
    if "--serve" in session.posargs:
        session.install("sphinx-autobuild")
        session.run(
            "sphinx-autobuild", "--watch", "examples", "docs", "docs/_build/html"
        )
        return
    shutil.rmtree(ROOT / "docs" / "_build", ignore_errors=True)
    session.run(
        "sphinx-build", "-W", "--keep-going", "-b", "html", "docs", "docs/_build/html",
        *session.posargs,
    )  # fmt: skip


@nox.session
def screenshots(session: nox.Session) -> None:
    """Builds the site; writes docs/images/mila-diff-{light,dark}.png (chromium)."""
    install(session, "docs")
    install(session, "browser")
    session.run("python", "tests/tools/screenshots.py", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff on the Python files; shellcheck on the shell scripts."""
    install(session, "lint")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("shellcheck", "-x", *JOB_SCRIPTS, *SITE_SCRIPTS)


@nox.session
def tests(session: nox.Session) -> None:
    """The whole test suite, Slurm and browser tests included (root), on three versions.

    Slurm 24.11, the version of the three closest to what most clusters run, gets every
    test. Slurm 26.05, the newest, and 22.05, the oldest, get the tests marked
    every_version: each job.sh through sbatch --test-only, five to completion, among
    them every site and launcher (not Mila's on 22.05, older than Mila's Slurm), the
    nodes' names and addresses, the variable table, and the version differences.
    docs/testing.md says why.
    """
    install(session, "test")
    # Two workers (pytest-xdist): one runs the Slurm tests, in order, while the other
    # runs the rest, as the Slurm tests mostly wait (tests/conftest.py, worker_group).
    session.run("pytest", "-n", "2", "--dist", "loadgroup", *session.posargs)
    for version in ["26.05", "22.05"]:
        session.run(
            "pytest", "-m", "every_version", f"--slurm-version={version}",
            *session.posargs,
        )  # fmt: skip


@nox.session
@nox.parametrize("version", ["24.11", "26.05", "22.05"])
def slurm(session: nox.Session, version: str) -> None:
    """The tests that use the Slurm test cluster, all of them, on Slurm `version`."""
    install(session, "test")
    session.run("pytest", "-m", "slurm", f"--slurm-version={version}", *session.posargs)
