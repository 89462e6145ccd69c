"""The site builds cleanly, shows every example file, and shows no code that is not
tested."""

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "docs" / "_ext"))
import guide_code  # noqa: E402
import page_text  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = page_text.PAGES
INCLUDE = re.compile(r"(?:\{literalinclude\}|literalinclude::)\s+(\S+)")
DIFF = re.compile(r"^\s*:diff:\s+(\S+)", re.MULTILINE)


def included_files(pattern):
    found = set()
    for page in PAGES:
        for target in pattern.findall(page.read_text()):
            found.add((page.parent / target).resolve())
    return found


def test_site_builds_with_warnings_as_errors(site):
    assert (site / "index.html").exists()
    assert (site / "clusters" / "mila.html").exists()
    assert (site / "clusters" / "ibex.html").exists()


def test_every_example_file_is_shown_whole_on_a_page():
    example_files = {
        p.resolve()
        for p in (ROOT / "examples").glob("**/*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    shown = included_files(INCLUDE)
    # The copies of a shared module are one file (test_layout.py): one copy shown on a
    # page shows them all, its source in examples/shared/ included.
    shown_bytes = {path.read_bytes() for path in shown if path.is_file()}
    shared = {p.stem for p in (ROOT / "examples" / "shared").glob("*.py")}
    missing = {
        p
        for p in example_files - shown
        if p.stem not in shared or p.read_bytes() not in shown_bytes
    }
    assert not missing, f"not included by any page: {sorted(map(str, missing))}"


def test_every_file_shown_fits_the_content_column():
    # 88 columns (ruff's line-length), and one more for a diff's marker, fit the page at
    # 1366 px; test_site_in_browser.py measures it.
    for path in included_files(INCLUDE):
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            assert len(line) <= 88, (
                f"{path.relative_to(ROOT)}:{number}: {len(line)} columns"
            )


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
    # Code of more than one line must come from a file that the tests run
    # (literalinclude).
    for page in PAGES:
        for info, body in code_blocks(page.read_text()):
            if info.startswith("{") and info != "{code-block}":
                continue  # a directive: literalinclude, toctree, ...
            lines = [line for line in body if line.strip()]
            assert len(lines) <= 1, (
                f"{page.name}: a {len(lines)}-line code block: {lines}"
            )
        if page.suffix == ".rst":
            # reStructuredText pages show code only through literalinclude.
            assert not re.search(
                r"^\s*\.\. (code-block|code|sourcecode)::", page.read_text(), re.M
            )
            for line in page.read_text().splitlines():
                directive = re.match(r"\s*\.\. [\w-]+::", line)
                assert directive or not line.rstrip().endswith("::"), (
                    f"literal block: {line}"
                )


@pytest.mark.parametrize(("page", "diffs"), [("mila", 6), ("ibex", 4), ("generic", 8)])
def test_diffs_show_relative_paths_and_have_no_copy_button(site, page, diffs):
    text = (site / "clusters" / f"{page}.html").read_text()
    assert text.count('<div class="code-diff highlight-diff-') == diffs
    assert str(ROOT) not in text
    assert f"--- examples/{page}/" in text
    conf = (DOCS / "conf.py").read_text()
    assert 'copybutton_selector = "div:not(.code-diff) > div.highlight > pre"' in conf


def python_diff(folder: Path, old: str, new: str) -> str:
    """The diff that the site would show between two Python files in `folder`."""
    (folder / "old.py").write_text(old)
    (folder / "new.py").write_text(new)
    return guide_code.make_diff(folder / "old.py", folder / "new.py", "python", "utf-8")


def test_diff_hunks_keep_their_context_and_name_their_function(tmp_path, monkeypatch):
    monkeypatch.setattr(guide_code, "ROOT", tmp_path)
    body = [f"    x{i} = {i}\n" for i in range(40)]
    old = ["import os\n", "\n", "\n", "def train(model):\n", *body, "\n", "\n"]
    new = list(old)
    new[4 + 12] = (
        "    x12 = 'changed'\n"  # deep inside train(), out of the context's reach
    )
    new.append("STEPS = 3\n")  # at the top level
    diff = python_diff(tmp_path, "".join(old), "".join(new))
    headers = [line for line in diff.splitlines() if line.startswith("@@")]
    assert headers == ["@@ -12,11 +12,11 @@ def train(model):", "@@ -42,5 +42,6 @@"]
    first_hunk = diff.split("@@ -12")[1].splitlines()[1:12]
    assert [line[:1] for line in first_hunk] == [" "] * 5 + ["-", "+"] + [" "] * 4
    assert diff.startswith("--- old.py\n+++ new.py\n")


def test_a_hunk_header_names_only_a_definition_that_holds_the_change(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(guide_code, "ROOT", tmp_path)
    name = "a_function_whose_signature_is_too_long_to_fit_the_header"
    old = [
        f"def {name}(first_argument, second_argument, third_argument):\n",
        *[f"    x{i} = {i}\n" for i in range(12)],
        'if __name__ == "__main__":\n',
        *[f"    y{i} = {i}\n" for i in range(12)],
    ]
    new = list(old)
    new[6] = "    x5 = 'changed'\n"
    new[20] = "    y6 = 'changed'\n"  # under the `if`, after the def: no def holds it
    diff = python_diff(tmp_path, "".join(old), "".join(new))
    headers = [line for line in diff.splitlines() if line.startswith("@@")]
    assert headers[0] == f"@@ -2,11 +2,11 @@ def {name}(…"
    assert len(headers[0]) <= 88
    assert headers[1] == "@@ -16,11 +16,11 @@"


def test_a_diff_of_one_function_numbers_its_lines_as_in_the_files(
    tmp_path, monkeypatch
):
    # :diff: with :pyobject: diffs that function alone; its hunks give the lines'
    # numbers in the whole files, which the lexer takes each line's tokens from.
    from pygments.token import Error, Name, String

    monkeypatch.setattr(guide_code, "ROOT", tmp_path)
    before = ["import os\n", "\n", "\n", "def other():\n", "    return 0\n", "\n"]
    body = [f"    x{i} = {i}\n" for i in range(12)]
    old = [
        *before,
        "\n",
        "def train():\n",
        *body,
        "\n",
        "\n",
        "def last():\n",
        "    a = 1\n",
    ]
    new = [*before, "def train():\n", *body, "\n", "\n", "def last():\n", "    a = 2\n"]
    new[6 + 1 + 10] = "    x10 = 'changed'\n"
    new[1] = "import sys\n"  # outside train(): not shown
    (tmp_path / "old.py").write_text("".join(old))
    (tmp_path / "new.py").write_text("".join(new))
    diff = guide_code.make_diff(
        tmp_path / "old.py", tmp_path / "new.py", "python", "utf-8", "train"
    )
    headers = [line for line in diff.splitlines() if line.startswith("@@")]
    # x10 is line 19 of old.py and line 18 of new.py; the hunk starts 5 lines above
    # and ends with train(), a line below.
    assert headers == ["@@ -14,7 +13,7 @@ def train():"], diff
    assert "import sys" not in diff and "a = 2" not in diff
    tokens = list(guide_code.PythonDiffLexer().get_tokens(diff))
    assert "".join(value for _, value in tokens) == diff
    # Each line got its own line's tokens: no mismatch (Error), and the right kinds.
    assert Error not in [token for token, _ in tokens]
    assert (Name, "x10") in tokens
    assert any(t in String and value == "changed" for t, value in tokens)
    with pytest.raises(ValueError, match="no function or class absent"):
        guide_code.make_diff(
            tmp_path / "old.py", tmp_path / "new.py", "python", "utf-8", "absent"
        )


def lex_diff(tmp_path, old: str, new: str) -> tuple[str, list]:
    diff = python_diff(tmp_path, old, new)
    return diff, list(guide_code.PythonDiffLexer().get_tokens(diff))


def test_diff_lexer_highlights_the_code_and_loses_nothing(tmp_path, monkeypatch):
    from pygments.token import Generic, Keyword, String

    monkeypatch.setattr(guide_code, "ROOT", tmp_path)
    diff, tokens = lex_diff(
        tmp_path,
        'def f():\n    """Old."""\n    return 1\n',
        'def f():\n    """New,\n    on two lines."""\n    return 1\n',
    )
    assert "".join(value for _, value in tokens) == diff
    assert (Keyword, "def") in tokens
    assert (Generic.Inserted, "+") in tokens and (Generic.Deleted, "-") in tokens
    # The added docstring's second line is still a string.
    assert any(t in String and "on two lines" in value for t, value in tokens)


def test_a_hunk_that_starts_inside_a_docstring_keeps_it_a_string(tmp_path, monkeypatch):
    # Lexed alone, the hunk would start with the docstring's text taken for code, and
    # its closing quotes would open a string that swallows the code after it.
    from pygments.token import Keyword, Name, String

    monkeypatch.setattr(guide_code, "ROOT", tmp_path)
    words = [f"    line {i} of the docstring\n" for i in range(20)]
    old = ["def f():\n", '    """Summary.\n', *words, '    """\n', "    return 1\n"]
    new = list(old)
    new[19] = "    a changed line of the docstring\n"
    diff, tokens = lex_diff(tmp_path, "".join(old), "".join(new))
    # The hunk shows the docstring's end, not its start.
    hunk = diff.split("\n", 3)[3]
    assert '"""Summary' not in hunk and hunk.count('"""') == 1
    assert "".join(value for _, value in tokens) == diff
    assert any(t in String and "changed line" in value for t, value in tokens)
    assert any(t in String and "line 14 of" in value for t, value in tokens)
    assert (Keyword, "return") in tokens
    assert not any(t in Name and value == "line" for t, value in tokens)


def test_diff_lexer_marks_a_diff_not_made_from_the_guides_files_an_error():
    # Sphinx reports an error token with the block's place, and -W fails the build.
    from pygments.token import Error

    diff = "--- a.py\n+++ b.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"
    tokens = list(guide_code.PythonDiffLexer().get_tokens(diff))
    assert [token for token, _ in tokens] == [Error]


def test_a_page_authors_slips_are_reported_with_their_place(tmp_path, monkeypatch):
    # An empty diff, and a hand-written diff given the diff lexer: warnings that name
    # the page and line, which -W turns into a failed build, not a traceback.
    import io

    from sphinx.application import Sphinx

    monkeypatch.setattr(guide_code, "ROOT", tmp_path)
    (tmp_path / "conf.py").write_text('extensions = ["guide_code"]\n')
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("x = 1\n")
    (tmp_path / "index.rst").write_text(
        "Title\n=====\n\n"
        ".. literalinclude:: b.py\n   :diff: a.py\n\n"
        ".. code-block:: diff-python\n\n   -x = 1\n   +x = 2\n"
    )
    warnings = io.StringIO()
    build = tmp_path / "_build"
    app = Sphinx(
        tmp_path, tmp_path, build, build / "doctrees", "html", warning=warnings
    )
    app.build()
    text = warnings.getvalue()
    assert (
        f"index.rst:4: WARNING: {tmp_path}/a.py and {tmp_path}/b.py are the same"
        in text
    )
    assert (
        "index.rst:7: WARNING: Lexing literal_block" in text and "diff-python" in text
    )


# ------------------------------------------------------------
# Plain words (tests/helpers/page_text.py measures the pages' prose)

HOW_TO_PAGES = [p for p in page_text.PAGES if p.stem not in {"testing", "glossary"}]


@pytest.mark.parametrize("page", HOW_TO_PAGES, ids=lambda p: p.stem)
def test_how_to_pages_mention_the_tests_only_by_a_link_to_the_testing_page(page):
    # What was run and how belongs on the testing page; a how-to page says "Tested:"
    # with a link to the section there.
    assert page_text.mentions_of_tests(page) == []


@pytest.mark.parametrize("page", HOW_TO_PAGES, ids=lambda p: p.stem)
def test_how_to_pages_have_no_sentence_over_35_words(page):
    long = [s for s in page_text.sentences(page) if page_text.words(s) > page_text.LONG]
    assert long == []


def test_every_tested_link_has_its_section_on_the_testing_page():
    # A section's label, or a table row's {promise}`tested-x` target; each once.
    testing = (DOCS / "testing.md").read_text()
    labels = re.findall(r"^\((tested-[\w-]+)\)=$", testing, re.M)
    labels += re.findall(r"\{promise\}`(tested-[\w-]+)`", testing)
    assert len(labels) == len(set(labels)), sorted(labels)
    linked = set()
    for page in HOW_TO_PAGES:
        for label in re.findall(r"<(tested-[\w-]+)>`", page.read_text()):
            assert label in labels, f"{page.name}: {label}"
            linked.add(label)
    # Every row that says how a page's promise was checked is one a page links to.
    assert set(labels) == linked


@pytest.mark.parametrize(
    "page",
    [p for p in page_text.PAGES if p != page_text.GLOSSARY],
    ids=lambda p: p.stem,
)
def test_each_glossary_term_is_linked_where_a_page_first_uses_it(page):
    uses = page_text.term_uses(page, page_text.glossary_terms())
    unlinked = {
        term: f"line {number + 1}: {words}"
        for term, (number, _, words, linked) in uses.items()
        if not linked
    }
    assert not unlinked, "run `python tests/helpers/page_text.py --link-terms`"


def test_the_page_measures_see_what_they_should(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# A rank heading\n\n"
        "The guide's tests check this. Tested: {ref}`how <tested-x>`.\n"
        "`sbatch --test-only` is a command. Each {term}`rank` has a rank.\n"
        "NVIDIA's nccl-tests define busbw.\n\n"
        "```bash\nthe tests in code do not count, nor does a rank\n```\n\n"
        + "word " * 36
        + "ends here.\n"
    )
    # One sentence names the guide's tests; nccl-tests is a tool's name.
    assert len(page_text.mentions_of_tests(page)) == 1
    assert [page_text.words(s) for s in page_text.sentences(page)][-1] == 38
    uses = page_text.term_uses(page, ["rank", "task"])
    assert uses == {"rank": (3, 40, "{term}`rank`", True)}
    page.write_text("A task and a {term}`task`.\n")
    assert page_text.term_uses(page, ["task"])["task"][3] is False


def test_every_test_and_file_the_pages_name_exists():
    tests = "".join(p.read_text() for p in (ROOT / "tests").glob("*.py"))
    for page in PAGES:
        text = page.read_text()
        for name in set(re.findall(r"`(test_\w+)`", text)):
            assert re.search(rf"def {name}\b", tests), f"{page.name}: {name}"
        for path in set(
            re.findall(r"`((?:tests|examples|docs)/[\w./-]+\.(?:py|sh))`", text)
        ):
            assert (ROOT / path).is_file(), f"{page.name}: {path}"
