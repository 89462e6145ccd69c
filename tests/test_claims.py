"""The pages' claims, held to the files they count and to each other.

- A number that the guide's own files decide (how many checks ReFrame lists, the GPUs
  they ask for, how many example folders there are) comes from those files at build
  time (docs/_ext/guide_numbers.py). Here: that it follows a change to them, that the
  built page shows it, and that no page writes it by hand. test_checks.py holds the
  counts to what ReFrame itself lists.
- A claim the guide has not run says so where it stands, in one form,
  {untested}`needs NCCL on GPUs`. Their number is printed at the end of every test
  run and may only fall.
- Where two pages state the same fact, they state it alike.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import guide_numbers
import page_text
import pytest
import tomllib
from page_text import DOCS, PAGES
from smoke import load_main

ROOT = DOCS.parent
HOW_TO_PAGES = [p for p in PAGES if p.stem not in {"testing", "glossary"}]

# ------------------------------------------------------------
# Numbers computed from the files

# How a page would write each computed number by hand: such a page must write the
# substitution instead ("lists {{ generic_checks }} checks").
BY_HAND = {
    "generic_checks": r"lists \d+ checks|the \d+ jobs",
    "generic_check_gpus": r"\b\d+ GPUs in all",
    "example_folders": r"\b\d+ example folders",
}


def test_every_computed_number_is_used_and_known():
    # A substitution the pages do not use is dead; a hand-written pattern for a name
    # that guide_numbers does not compute guards nothing.
    text = "".join(p.read_text() for p in PAGES)
    numbers = guide_numbers.numbers()
    for name in numbers:
        assert "{{ " + name + " }}" in text, f"no page uses {{{{ {name} }}}}"
    assert set(BY_HAND) <= set(numbers)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_pages_write_no_computed_number_by_hand(page):
    text = " ".join(page.read_text().split())
    for name, pattern in BY_HAND.items():
        found = re.findall(pattern, text)
        assert not found, f"{found}: write {{{{ {name} }}}} (guide_numbers.py)"


def test_the_numbers_follow_the_files(tmp_path):
    # A copy of the examples' job.sh files; then one more generic example of 3 nodes
    # of 2 GPUs each, and one example fewer. Each count moves with the files.
    for path in (ROOT / "examples").glob("*/*/job.sh"):
        target = tmp_path / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target)
    before = {k: int(v) for k, v in guide_numbers.numbers(tmp_path).items()}
    new = tmp_path / "examples/generic/bigger/job.sh"
    new.parent.mkdir()
    new.write_text("#!/bin/bash\n#SBATCH --nodes=3\n#SBATCH --gpus-per-node=h100:4\n")
    shutil.rmtree(tmp_path / "examples/mila/single_gpu")
    after = {k: int(v) for k, v in guide_numbers.numbers(tmp_path).items()}
    assert after["example_folders"] == before["example_folders"]
    assert after["generic_checks"] == before["generic_checks"] + 1
    assert after["generic_check_gpus"] == before["generic_check_gpus"] + 12
    assert (after["largest_check_gpus"], after["largest_check_nodes"]) == (12, 3)
    (tmp_path / "examples/ibex/single_node/job.sh").unlink()
    assert guide_numbers.numbers(tmp_path)["example_folders"] == str(
        before["example_folders"] - 1
    )


def test_gpus_asked_in_a_form_the_count_does_not_know_stop_the_build():
    assert guide_numbers.asked(
        "#SBATCH --nodes=2\n#SBATCH --gpus-per-node=a100:4\n"
    ) == (
        2,
        4,
    )
    for job_sh in [
        "#SBATCH --nodes=2\n",
        "#SBATCH --gres=gpu:4\n",
        "#SBATCH --gpus-per-node=4\n#SBATCH --gpus-per-task=1\n",
    ]:
        with pytest.raises(ValueError, match="other than by --gpus-per-node"):
            guide_numbers.asked(job_sh)


def test_the_folders_counted_are_the_example_folders():
    folders = {p.parent for p in (ROOT / "examples").glob("*/*/main.py")}
    assert guide_numbers.numbers()["example_folders"] == str(len(folders))


def test_the_built_pages_show_the_computed_numbers(site):
    numbers = guide_numbers.numbers()
    html = (site / "verify.html").read_text()
    verify = " ".join(re.sub(r"<[^>]+>", "", html).split())
    assert f"it lists {numbers['generic_checks']} checks" in verify
    assert f"ask for {numbers['generic_check_gpus']} GPUs in all" in verify
    assert "{{" not in verify


# A default that a page states, after the option's name: "`--max-restarts` requeues
# (20 by default)", "(default 5)".
STATED_DEFAULT = re.compile(
    r"`(--[a-z-]+)`[^`]{0,70}?[(,] ?(?:default (\d[\d,.]*)|(\d[\d,.]*|off) by default)"
)
# Whose options each page states: its examples' main.py, or torchrun's.
OPTIONS_OF = {
    "generic": "generic/*",
    "mila": "mila/*",
    "fabric": "generic/fabric",
    "fsdp": "generic/fsdp",
    "troubleshooting": "*/*",
    "launchers": "torchrun",
}


def example_defaults(name: str) -> dict[str, object]:
    """The defaults of an example's options, as its own parse_args() gives them."""
    args = vars(load_main(name).parse_args([]))
    return {"--" + dest.replace("_", "-"): value for dest, value in args.items()}


def torchrun_defaults() -> dict[str, object]:
    from torch.distributed.run import get_args_parser

    found = {}
    for action in get_args_parser()._actions:
        # Where the default is None, torchrun's help states the one it uses.
        said = re.search(r"defaults to (\d+)", action.help or "")
        for flag in action.option_strings:
            found[flag] = said[1] if action.default is None and said else action.default
    return found


def same(stated: str, default: object) -> bool:
    if stated == "off":
        return default in (False, None)
    try:
        return float(stated.replace(",", "")) == float(default)
    except (TypeError, ValueError):
        return False


@pytest.mark.parametrize("page", HOW_TO_PAGES, ids=lambda p: p.stem)
def test_the_defaults_a_page_states_are_the_codes(page):
    text = " ".join(page.read_text().split())
    stated = [(m[1], m[2] or m[3]) for m in STATED_DEFAULT.finditer(text)]
    if not stated:
        return
    assert page.stem in OPTIONS_OF, f"{page.name} states defaults: {stated}"
    whose = OPTIONS_OF[page.stem]
    if whose == "torchrun":
        defaults = {flag: [value] for flag, value in torchrun_defaults().items()}
    else:
        defaults = {}
        for main in (ROOT / "examples").glob(f"{whose}/main.py"):
            name = str(main.parent.relative_to(ROOT / "examples"))
            for flag, value in example_defaults(name).items():
                defaults.setdefault(flag, []).append(value)
    for flag, value in stated:
        assert flag in defaults, f"{page.name}: {flag} is not an option of {whose}"
        assert all(same(value, d) for d in defaults[flag]), (
            f"{page.name}: {flag} {value} by default; the code: {defaults[flag]}"
        )


def test_stated_defaults_are_found_and_checked():
    text = (
        "`--max-restarts` requeues (20 by default), `--warmup` ones (default 5), "
        "`--compile` (off by default)."
    )
    found = [(m[1], m[2] or m[3]) for m in STATED_DEFAULT.finditer(text)]
    assert found == [("--max-restarts", "20"), ("--warmup", "5"), ("--compile", "off")]
    template = example_defaults("generic/template")
    assert template["--max-restarts"] == 20 and template["--compile"] is None
    assert same("20", 20) and same("50,000", 50_000) and not same("21", 20)
    assert torchrun_defaults()["--max-restarts"] == 0


# ------------------------------------------------------------
# Claims the guide has not run

# The number of {untested} marks on the pages. It may only fall: test a claim, and
# lower this number with the mark you remove; a new claim that cannot be tested here
# is marked, and this number raised, only with a reviewer's yes.
UNTESTED_CLAIMS = 153


def untested_claims() -> dict[str, list[tuple[int, str]]]:
    return {
        str(page.relative_to(DOCS)): page_text.untested_claims(page) for page in PAGES
    }


def test_the_untested_claims_only_fall():
    found = untested_claims()
    count = sum(len(marks) for marks in found.values())
    listing = "\n".join(
        f"{page}:{line}: {reason}"
        for page, marks in found.items()
        for line, reason in marks
    )
    assert count <= UNTESTED_CLAIMS, (
        f"{count} untested claims, more than the {UNTESTED_CLAIMS} allowed:\n{listing}"
    )
    assert count == UNTESTED_CLAIMS, (
        f"{count} untested claims: lower UNTESTED_CLAIMS to {count} (test_claims.py)"
    )


@pytest.mark.parametrize("page", HOW_TO_PAGES, ids=lambda p: p.stem)
def test_untested_claims_take_the_one_form(page):
    assert page_text.untested_in_other_words(page) == []
    for _, reason in page_text.untested_claims(page):
        # Short, lower case, no end stop: "needs NCCL on GPUs".
        assert reason and len(reason.split()) <= 12, reason
        assert reason == reason.strip() and not reason.endswith("."), reason
        assert reason[0].islower(), reason


def test_the_untested_measures_see_what_they_should(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "NCCL says so. {untested}`needs NCCL on GPUs`\n\n"
        "| a | b |\n| --- | --- |\n| a row | says {untested}`needs GPUs` |\n\n"
        "```bash\n{untested}`in code`\n```\n\n"
        "This is untested. The word `untested` in code is not.\n"
    )
    assert page_text.untested_claims(page) == [
        (1, "needs NCCL on GPUs"),
        (5, "needs GPUs"),
    ]
    assert page_text.untested_in_other_words(page) == ["This is untested."]


# ------------------------------------------------------------
# Facts that several pages state


def paragraphs_with(needle: str) -> list[tuple[str, str]]:
    return [
        (page.name, paragraph)
        for page in HOW_TO_PAGES
        for paragraph in page_text.paragraphs(page)
        if needle in paragraph
    ]


def test_the_order_of_ranks_comes_with_slurm_26_05s_exception():
    # srun numbers the tasks node by node up to 25.11 only: from 26.05, on a cluster
    # with a topology.conf, in the network's order (test_slurm_versions.py). A page
    # that states the order, or the formula that follows from it, says so there.
    stated = paragraphs_with("node by node") + paragraphs_with("processes per node +")
    assert stated
    for page, paragraph in stated:
        assert "26.05" in paragraph, f"{page}: {paragraph}"


def test_the_preemption_signal_setting_is_named_alike():
    # Slurm 23.02 renamed SlurmctldParameters=preempt_send_user_signal to
    # PreemptParameters=send_user_signal (its changelog): the old name comes only with
    # the version that ended it, and with the new one.
    old = paragraphs_with("preempt_send_user_signal")
    assert old
    for page, paragraph in old:
        assert "23.02" in paragraph and "PreemptParameters=send_user_signal" in (
            paragraph
        ), f"{page}: {paragraph}"


# ------------------------------------------------------------
# The testing page's tables: which Slurm versions each promise's tests run on

PROMISES_HEADER = "| Promise | Checked by | Slurm | Cannot show |"
VERSION = re.compile(r"\b(22\.05|24\.11|26\.05)\b")


def promise_rows() -> list[list[str]]:
    """The rows of the testing page's promise tables, as lists of cells."""
    rows, inside = [], False
    for line in (DOCS / "testing.md").read_text().splitlines():
        if line.strip() == PROMISES_HEADER:
            inside = True
        elif inside and line.startswith("|") and not line.startswith("| ---"):
            rows.append([c.strip() for c in line.strip()[1:-1].split("|")])
        elif not line.startswith("|"):
            inside = False
    return rows


@pytest.fixture(scope="module")
def where_tests_run(tmp_path_factory) -> dict[str, list[list[str]]]:
    """Each test function's CI versions, case by case, as pytest collects them
    (conftest.py, ci_versions)."""
    path = tmp_path_factory.mktemp("where") / "where.json"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q",
         "-p", "no:cacheprovider", str(ROOT / "tests")],
        cwd=ROOT, env={**os.environ, "WHERE_TESTS_RUN": str(path)},
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    by_name: dict[str, list[list[str]]] = {}
    for key, cases in json.loads(path.read_text()).items():
        name = key.split("::")[1]
        # The page names a test by its function: one name, one test.
        assert name not in by_name, f"two tests named {name}"
        by_name[name] = cases
    return by_name


def test_every_slurm_test_runs_somewhere_in_ci(where_tests_run):
    never = [name for name, cases in where_tests_run.items() if ["never"] in cases]
    assert not never, f"Slurm tests that CI deselects on every version: {never}"


def test_the_testing_pages_slurm_column_is_where_its_tests_run(where_tests_run):
    rows = promise_rows()
    assert len(rows) > 80
    wrong = []
    assert all(len(row) == 4 for row in rows), [r for r in rows if len(r) != 4]
    for promise, checked_by, slurm, _ in rows:
        tests = re.findall(r"`(test_\w+)`", checked_by)
        stated = set(VERSION.findall(slurm)) | ({"none"} if "none" in slurm else set())
        cases = [where_tests_run[t] for t in tests if t in where_tests_run]
        unknown = [t for t in tests if t not in where_tests_run]
        # Every version the row names is one its tests run on; a test whose cases all
        # run on the same versions has each of them named.
        anywhere = {v for test in cases for case in test for v in case}
        alike = {v for test in cases if len(test) == 1 for v in test[0]}
        if not tests and checked_by.startswith("not ") and not slurm:
            continue  # "not reproduced": no test, no version
        if unknown or not stated or stated - anywhere or alike - stated:
            wrong.append(
                f"{promise[:70]}: says {sorted(stated)}; tests {cases} {unknown}"
            )
    assert not wrong, "\n".join(wrong)


# ------------------------------------------------------------
# The READMEs' lists of the test files


def test_the_readmes_name_every_test_file_marker_helper_and_tool():
    tests = ROOT / "tests"
    readme = (tests / "README.md").read_text()
    names = [p.name for p in tests.glob("test_*.py")]
    names += [p.name for p in (tests / "helpers").iterdir() if p.name != "__pycache__"]
    names += [p.name for p in (tests / "tools").glob("*.py")]
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    markers = config["tool"]["pytest"]["ini_options"]["markers"]
    names += [m.split(":")[0] for m in markers]
    missing = [n for n in names if f"`{n}" not in readme]
    assert not missing, f"tests/README.md does not name {missing}"
    top = (ROOT / "README.md").read_text()
    tools = [p.name for p in (tests / "tools").glob("*.py")]
    assert [n for n in tools if f"`{n}`" not in top] == [], "README.md: tools/"


# ------------------------------------------------------------
# Settings of the test cluster and of the checks, as the pages quote them


def number_in(pattern: str, text: str) -> str:
    found = re.findall(pattern, text, re.M)
    assert len(set(found)) == 1, (pattern, found)
    return found[0].replace(",", "")


LAB, CHECKS = "tests/helpers/slurm_lab.py", "checks/examples.py"
# (page, what the page says, where the value is set, how): each pattern one number.
QUOTED = [
    ("testing.md", r"(\d+) CPUs and [\d,]+ MB per node", LAB, r"CPUs=(\d+) "),
    ("testing.md", r"\d+ CPUs and ([\d,]+) MB per node", LAB, r"RealMemory=(\d+) "),
    ("testing.md", r"`KillWait=(\d+)`", LAB, r"^KillWait=(\d+)$"),
    ("testing.md", r"`SlurmdTimeout=(\d+)`", LAB, r"^SlurmdTimeout=(\d+)$"),
    ("clusters/generic.md", r"here (\d+) s\)", LAB, r"GraceTime=(\d+)"),
    ("clusters/generic.md", r"\((\d+) s where this was checked\)", LAB,
     r"^SlurmdTimeout=(\d+)$"),
    ("verify.md", r"`max_jobs` \((\d+)\)", "checks/site_template.py",
     r'"max_jobs": (\d+)'),
    ("verify.md", r"runs for (\d+) minutes at most", CHECKS, r'time_limit = "(\d+)m"'),
]  # fmt: skip


@pytest.mark.parametrize(
    ("page", "said", "source", "set_as"), QUOTED, ids=lambda x: str(x)[:30]
)
def test_the_pages_quote_the_settings_as_the_code_sets_them(page, said, source, set_as):
    text = " ".join((DOCS / page).read_text().split())
    code = re.sub(r"(?m)^\s+", "", (ROOT / source).read_text())
    assert number_in(said, text) == number_in(set_as, code)


def test_the_testing_page_counts_the_jobs_that_run_on_every_version():
    import test_slurm

    text = " ".join((DOCS / "testing.md").read_text().split())
    words = {3: "three", 4: "four", 5: "five", 6: "six", 7: "seven"}
    assert f"{words[len(test_slurm.EVERY_VERSION_RUNS)]} `job.sh` to completion" in text


# ------------------------------------------------------------
# Versions the pages name: the pinned ones


def pins() -> dict[str, str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    found = {}
    for group in config["dependency-groups"].values():
        for requirement in group:
            if isinstance(requirement, str) and "==" in requirement:
                name, version = requirement.split("==")
                found[name.lower()] = version
    return found


NAMED_VERSION = {  # how the pages name a package's version in words
    # A version with a build tag (2.11.0+cu130) is a measurement's machine, not a pin.
    "torch": r"\btorch (\d+\.\d+(?:\.\d+)?)(?![+\d.])",
    "lightning": r"\bLightning (\d+\.\d+\.\d+)\b",
    "accelerate": r"\bAccelerate (\d+\.\d+\.\d+)\b",
    "reframe-hpc": r"\bReFrame (\d+\.\d+\.\d+)\b",
}


def test_the_versions_the_pages_name_are_the_pinned_ones():
    pinned = pins()
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "requires-python"
    ]
    files = [*PAGES, ROOT / "README.md", *(ROOT / "examples").glob("*/*/job.sh")]
    wrong = []
    for path in files:
        text = path.read_text()
        for name, version in re.findall(r"\b([\w-]+)==(\d[\w.]*)", text):
            if name.lower() in pinned and version != pinned[name.lower()]:
                wrong.append(f"{path.name}: {name}=={version}, pinned {pinned[name]}")
        for name, pattern in NAMED_VERSION.items():
            for version in re.findall(pattern, text):
                if not pinned[name].startswith(version):
                    wrong.append(
                        f"{path.name}: {name} {version}, pinned {pinned[name]}"
                    )
        for version in re.findall(
            r"Python (3\.\d+) or newer|older than (3\.\d+)", text
        ):
            if f">={version[0] or version[1]}" != requires:
                wrong.append(f"{path.name}: Python {version}, requires {requires}")
    assert not wrong, "\n".join(wrong)
