"""The site builds cleanly, shows every example file, and shows no code that is not tested."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(
    p for p in DOCS.glob("**/*") if p.suffix in {".md", ".rst"} and "_build" not in p.parts
)
INCLUDE = re.compile(r"(?:\{literalinclude\}|literalinclude::)\s+(\S+)")
DIFF = re.compile(r"^\s*:diff:\s+(\S+)", re.MULTILINE)


@pytest.fixture(scope="module")
def html(tmp_path_factory):
    out = tmp_path_factory.mktemp("html")
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", str(DOCS), str(out)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return out


def included_files(pattern):
    found = set()
    for page in PAGES:
        for target in pattern.findall(page.read_text()):
            found.add((page.parent / target).resolve())
    return found


def test_site_builds_with_warnings_as_errors(html):
    assert (html / "index.html").exists()
    assert (html / "clusters" / "mila.html").exists()
    assert (html / "clusters" / "ibex.html").exists()


def test_every_example_file_is_shown_whole_on_a_page():
    example_files = {
        p.resolve()
        for p in (ROOT / "examples").glob("**/*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    missing = example_files - included_files(INCLUDE)
    assert not missing, f"not included by any page: {sorted(map(str, missing))}"


def test_every_diff_compares_example_files():
    for path in included_files(DIFF):
        assert path.is_file() and ROOT / "examples" in path.parents, path


def code_blocks(text):
    """Yields (info string, body) of each fenced code block of a MyST page."""
    info, body = None, []
    for line in text.splitlines():
        if info is None and line.startswith("```"):
            info, body = line[3:].strip(), []
        elif info is not None and line.strip() == "```":
            yield info, body
            info = None
        elif info is not None:
            body.append(line)


def test_pages_have_no_untested_code_blocks():
    # Code of more than one line must come from a file that the tests run (literalinclude).
    for page in PAGES:
        for info, body in code_blocks(page.read_text()):
            if info.startswith("{") and info != "{code-block}":
                continue  # a directive: literalinclude, toctree, ...
            lines = [line for line in body if line.strip()]
            assert len(lines) <= 1, f"{page.name}: a {len(lines)}-line code block: {lines}"
        if page.suffix == ".rst":
            # reStructuredText pages show code only through literalinclude.
            assert not re.search(r"^\s*\.\. (code-block|code|sourcecode)::", page.read_text(), re.M)
            for line in page.read_text().splitlines():
                directive = re.match(r"\s*\.\. [\w-]+::", line)
                assert directive or not line.rstrip().endswith("::"), f"literal block: {line}"


@pytest.mark.parametrize(("page", "diffs"), [("mila", 6), ("ibex", 4), ("generic", 10)])
def test_diffs_show_relative_paths_and_have_no_copy_button(html, page, diffs):
    text = (html / "clusters" / f"{page}.html").read_text()
    assert text.count('class="highlight-udiff') == diffs
    assert str(ROOT) not in text
    assert f"--- examples/{page}/" in text
    conf = (DOCS / "conf.py").read_text()
    assert 'copybutton_selector = "div:not(.highlight-udiff) > div.highlight > pre"' in conf
