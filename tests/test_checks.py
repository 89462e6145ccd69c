"""The ReFrame checks of checks/ and docs/verify.md's commands.

The checks of every example run against the test cluster in the `jobs` fixture
(conftest.py), whose jobs test_slurm.py reads: each job.sh is submitted once. Here: the
page's other commands, the sanity's verdicts on made-up output, and a run of broken
copies of examples whose checks must fail.
"""

import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import guide_numbers
import pytest
from conftest import JOB_TIMEOUT, SITE_FILE
from page_text import page_command
from smoke import load_main

ROOT = Path(__file__).resolve().parent.parent
REFRAME_BIN = Path(sys.executable).parent
PYPROJECT = (ROOT / "pyproject.toml").read_text()


def load_checks():
    spec = importlib.util.spec_from_file_location(
        "checks_examples", ROOT / "checks/examples.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # ReFrame finds a check's file through it
    spec.loader.exec_module(module)
    return module


checks = load_checks()


LOGGED = "12:00:00 [0/2] epoch 0 step {} | loss 1.5 | lr 1e-3\n"


def summary(rank, **changes):
    record = {
        "rank": rank, "world_size": 2, "host": f"cn{rank + 1}", "epoch": 1,
        "steps": 6, "first_loss": 1.6, "last_loss": 1.4, "val_loss": 1.5,
        "val_accuracy": 0.2, "val_samples": 25,
    }  # fmt: skip
    record.update(changes)
    return f"summary: {json.dumps(record)}\n"


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        (summary(0) + summary(1), []),
        (
            LOGGED.format(2) + summary(0) + summary(1),
            ["the loss was logged on 1 line(s), fewer than 2: too few to see it fall"],
        ),
        (summary(1), ["summaries from ranks [1], expected 0 to 1"]),
        (
            summary(0, val_samples=26) + summary(1, val_samples=26),
            ["rank 0: validation counted 26 samples, not 25",
             "rank 1: validation counted 26 samples, not 25"],
        ),
        (
            summary(0, last_loss=1.7) + summary(1, last_loss=1.7),
            ["rank 0: the loss did not fall: 1.6 then 1.7",
             "rank 1: the loss did not fall: 1.6 then 1.7"],
        ),
        (
            summary(0, val_loss=math.nan) + summary(1),
            ["rank 0: a loss is not a finite number: [1.6, 1.4, nan]",
             "the ranks disagree"],
        ),
        (summary(0) + summary(1, steps=5), ["the ranks disagree"]),
        (
            summary(0) + summary(1, host="cn1"),
            ["ranks per node {'cn1': 2}, expected 2 alike"],
        ),
        (
            summary(0, world_size=4) + summary(1, world_size=4),
            ["rank 0: world size 4, not 2", "rank 1: world size 4, not 2"],
        ),
    ],
)  # fmt: skip
def test_sanity_names_what_is_wrong(output, expected):
    # Two log lines, but for the case that has one.
    logs = "" if "step 2" in output else LOGGED.format(2) + LOGGED.format(4)
    found = checks.problems(logs + output, ranks=2, val_samples=25, nodes=2)
    assert len(found) == len(expected), found
    for problem, start in zip(found, expected, strict=True):
        assert problem.startswith(start), found


NCCL = "cn1:1:9 [0] NCCL INFO Channel 00/0 : 4[0] -> 0[0] [receive] via NET/{}/0\n"


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        (NCCL.format("IB") + NCCL.format("IB"), None),
        (NCCL.format("IBext_v8") + NCCL.format("IB"), None),
        (
            NCCL.format("IB") + NCCL.format("Socket"),
            "over ['IB', 'Socket'], not only IB",
        ),
        ("summary: {}\n", "no NCCL line `via NET/IB`: is NCCL_DEBUG=INFO set?"),
        (NCCL.format("AWS Libfabric"), "over ['AWS Libfabric'], not only IB"),
    ],
)
def test_network_sanity_fails_a_job_that_fell_back_to_sockets(lines, expected):
    found = checks.network_problems(lines, "IB")
    assert checks.network_problems(NCCL.format("AWS Libfabric"), "AWS Libfabric") == []
    assert found == ([] if expected is None else [found[0]])
    assert expected is None or expected in found[0]


def test_nodes_and_ranks_asked_are_one_per_gpu_of_every_node():
    asked = {
        name: checks.asked((ROOT / "examples" / name / "job.sh").read_text())
        for name in checks.EXAMPLES
    }
    assert asked["generic/multi_node"] == (2, 4) and asked["generic/single_gpu"] == (
        1,
        1,
    )
    assert asked["mila/multi_gpu"] == (1, 4) and asked["ibex/multi_node"] == (2, 2)


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        ("job.sh exit status: 0\n", []),
        ("job.sh exit status: 1\n", ["job.sh exited with status 1"]),
        (
            "summary: {}\n",
            ["job.sh did not end: it reached the time limit, or was killed"],
        ),
    ],
)
def test_sanity_requires_that_job_sh_ended_well(output, expected):
    assert checks.exit_problems(output) == expected


def test_job_sh_lines_are_kept_but_the_name_time_limit_and_dependency():
    text = (ROOT / "examples/generic/checkpointing/job.sh").read_text()
    kept = checks.job_sh_options(text)
    assert "--requeue" in kept and "--signal=USR1@120" in kept
    assert "--nodes=2" in kept and "--gpus-per-node=4" in kept
    assert not [o for o in kept if o.startswith(("--job-name", "--time", "--dep"))]
    assert not [o for o in kept if "partition" in o]  # job.sh's commented ones


def test_the_site_file_loads_as_reframe_loads_it(tmp_path):
    # ReFrame runs the site file by its path, from the folder it is started in, with
    # none of pytest's paths: what the file imports (smoke.py) it must find itself.
    result = subprocess.run(
        [sys.executable, "-I", "-c",
         f"import runpy; runpy.run_path({str(SITE_FILE)!r})['site_configuration']"],
        cwd=tmp_path, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr


def test_the_pages_reframe_is_the_pinned_one(tmp_path):
    """The page's install command, as a reader runs it, in a home of its own."""
    command = page_command("verify.md", "python3 -m venv")
    env = {**os.environ, "HOME": str(tmp_path)}
    result = subprocess.run(
        ["bash", "-c", command], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    version = subprocess.run(
        [tmp_path / "venvs/reframe/bin/reframe", "--version"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    pinned = re.search(r'^checks = \[\s*"reframe-hpc==(\S+)",\s*\]', PYPROJECT, re.M)
    assert version == pinned[1]


def test_the_template_lists_the_generic_examples(tmp_path):
    """The page's cp and list commands, from a folder that holds the guide's checks."""
    (tmp_path / "checks").symlink_to(ROOT / "checks")
    env = {**os.environ, "PATH": f"{REFRAME_BIN}:{os.environ['PATH']}"}
    for start in ["cp checks/", "reframe -C site.py -c checks/ -l"]:
        result = subprocess.run(
            shlex.split(page_command("verify.md", start)),
            cwd=tmp_path, env=env, capture_output=True, text=True,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
    listed = sorted(
        line.split("%example=")[1].split()[0]
        for line in result.stdout.splitlines()
        if "%example=" in line
    )
    generic = [n for n in checks.EXAMPLES if n.startswith(("generic/", "launchers/"))]
    assert listed == generic
    # The page's counts come from docs/_ext/guide_numbers.py: held here to what ReFrame
    # lists, and to the GPUs that each listed check's job.sh asks for.
    examples = [
        line.split("%example=")[1].split()[0]
        if "%example=" in line
        else getattr(checks, line.split()[1]).example
        for line in result.stdout.splitlines()
        if line.startswith("- ")
    ]
    gpus = [
        checks.asked((checks.EXAMPLES_DIR / e / "job.sh").read_text()) for e in examples
    ]
    number = guide_numbers.numbers()
    assert f"Found {len(examples)} check(s)" in result.stdout
    assert number["generic_checks"] == str(len(examples))
    assert number["generic_check_gpus"] == str(sum(n * g for n, g in gpus))
    largest = max(gpus, key=lambda asked: asked[0] * asked[1])
    assert number["largest_check_gpus"] == str(largest[0] * largest[1])
    assert number["largest_check_nodes"] == str(largest[0])


# One broken copy is enough to show a check failing through a real job: what each
# sanity function finds is tested on made-up output above, without Slurm.
BROKEN = {
    # the validation counts one sample twice
    "generic/single_gpu": (
        '    print(f"summary: {json.dumps(summary)}", flush=True)\n',
        '    summary["val_samples"] += 1\n'
        '    print(f"summary: {json.dumps(summary)}", flush=True)\n',
        "rank 0: validation counted 26 samples, not 25",
    ),
}  # fmt: skip


@pytest.mark.slurm
@pytest.mark.timeout(900)
def test_checks_of_broken_examples_fail_with_the_reason(lab, tmp_path):
    """A copy of an example that miscounts the validation: its job ends well, and its
    check fails, with the reason."""
    guide = tmp_path / "guide"
    shutil.copytree(ROOT / "checks", guide / "checks")
    for name, (old, new, _) in BROKEN.items():
        shutil.copytree(ROOT / "examples" / name, guide / "examples" / name)
        main = guide / "examples" / name / "main.py"
        assert old in main.read_text()
        main.write_text(main.read_text().replace(old, new))
    command = [
        str(REFRAME_BIN / "reframe"), "-C", str(SITE_FILE), "-c", str(guide / "checks"),
        "-r", "-S", f"time_limit={JOB_TIMEOUT}s",
    ]  # fmt: skip
    found = lab.run_checks(list(BROKEN), tmp_path / "reframe", command)
    for name, (_, _, reason) in BROKEN.items():
        job = found[name]
        assert job.ok, job.output
        assert job.check.startswith("fail in sanity"), job.check
        assert reason in job.check, job.check


@pytest.mark.parametrize("name", checks.EXAMPLES)
def test_each_short_run_parses_and_makes_the_validation_set_it_names(name):
    """The defaults for GPU sites cannot run here at their size; their arguments and
    validation sets are checked through main.py's own parse_args and make_datasets."""
    run = checks.SHORT_RUNS.get(name, checks.SHORT_RUNS[name.split("/")[0]])
    main = load_main(name)
    args = main.parse_args(run["args"])
    if run["val_samples"] is None:
        assert name == "generic/fabric"
        return
    assert args.synthetic_data
    _, valid, _ = main.make_datasets(args)
    assert len(valid) == run["val_samples"]


@pytest.mark.every_version
def test_of_two_sbatch_lines_for_one_option_the_later_wins(lab, tmp_path):
    """What the page says of the site's access options, which ReFrame writes before
    job.sh's #SBATCH lines: where both set an option, job.sh's line wins."""
    script = tmp_path / "rfm_job.sh"
    script.write_text(
        "#!/bin/bash\n#SBATCH --time=10:00\n#SBATCH --time=20:00\nhostname\n"
    )
    job_id = lab.sbatch(script, site="generic", workdir=tmp_path, options=["--hold"])
    try:
        assert lab.job_info(job_id)["TimeLimit"] == "00:20:00"
    finally:
        lab.cancel(job_id)


@pytest.mark.slurm
@pytest.mark.timeout(1800)  # it may be the first to wait for the checks' jobs
@pytest.mark.parametrize("name", ["StagedDataJob"])
def test_the_staging_check_trains_on_an_archive_unpacked_on_every_node(jobs, name):
    """The check that runs the template's copy of the dataset, which the other checks
    skip: every node unpacks the check's archive, and all 8 ranks train on it."""
    job = jobs(name)
    assert job.ok, job.output
    assert job.check == "pass", job.check
    assert re.search(r"Unpacked the dataset in \S+ on every node", job.output)
    found = checks.summaries(job.output)
    assert [s["rank"] for s in found] == list(range(8)), job.output
    assert {s["host"] for s in found} == {"cn1", "cn2"}
    assert {s["val_samples"] for s in found} == {checks.STAGED_RUN["val_samples"]}
    assert found[0]["last_loss"] < found[0]["first_loss"]
