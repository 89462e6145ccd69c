"""How the guide shows its files: `literalinclude`, with readable diffs.

Sphinx's `literalinclude` with `:diff:` makes a unified diff with 3 lines
of context and shows it in Pygments' `udiff` colours, which colour whole
lines and drop the file's own highlighting. No maintained Sphinx extension
or Pygments lexer highlights the code inside a diff (pygments/pygments#1043
and #2986 are open), so this extension does, in three parts:

- the diff is still made by difflib from the two files, as Sphinx makes it, with
  DIFF_CONTEXT lines of context, and each hunk header names the function or class that
  holds the change (`git diff` names the last one that starts above the hunk, which
  may have ended before the change);
- a lexer per language lexes both files whole with the file's own lexer, gives each
  line of the diff the tokens of its line (the old file's for removed lines, the new
  file's for the rest), and marks each line's + or -;
- added and removed lines are Pygments' highlighted lines (`hl_lines`), and the
  stylesheet gives them a green or red background, in light and dark mode.

With `:pyobject:` as well, the diff is of that function or class in the two files, and
its hunk headers give the lines' numbers in the whole files: a page can show a long
file's changes one part at a time.

Every `literalinclude` also gets the file's path as its caption, so that a tab says
which file it holds, and classes that the stylesheet and the browser tests use:
`code-file` for a whole file, `code-diff` for a diff, `code-excerpt` for part of a file.
"""

import re
from difflib import unified_diff
from pathlib import Path

from docutils import nodes
from pygments.lexer import Lexer
from pygments.lexers import BashLexer, PythonLexer, TextLexer
from pygments.token import Error, Generic, Text
from sphinx.directives.code import LiteralInclude
from sphinx.pycode import ModuleAnalyzer

ROOT = Path(__file__).resolve().parents[2]

# Enough to read a change in place: 5 lines each side, with the enclosing function in
# the hunk header. 3 (difflib's and git's default) often showed a change without the
# line that says what it belongs to; the whole file is one click away in the next tab.
DIFF_CONTEXT = 5
# A hunk header and its function must fit the content column, as code lines do.
MAX_WIDTH = 88

LANGUAGES = {".py": "python", ".sh": "bash"}
# What `git diff` names in a hunk header: a def or class, a shell function.
DEFINITIONS = {
    "python": re.compile(r"^(\s*)(?:async\s+def|def|class)\s"),
    "bash": re.compile(r"^(\s*)(?:function\s+\w|\w[\w-]*\s*\(\)\s*\{?)"),
}
# Lines split at "\n" only: str.splitlines also splits at \f and \u2028, which
# would shift the diff's lines against the lexer's.
LINES = re.compile(r"[^\n]*\n|[^\n]+$")
HUNK = re.compile(r"@@ -(\d+)(?:,\d+)? \+(\d+)(?:,\d+)? @@")
PARTIAL_OPTIONS = {
    "pyobject",
    "lines",
    "start-after",
    "end-before",
    "start-at",
    "end-at",
    # Not partial, but not the file's bytes either.
    "dedent",
    "prepend",
    "append",
    "tab-width",
}


def indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def enclosing_definition(
    lines: list[str], index: int, level: int, language: str
) -> str:
    """The innermost def or class that holds a line at `index` indented by `level`."""
    pattern = DEFINITIONS.get(language)
    if pattern is None:
        return ""
    for line in reversed(lines[:index]):
        if not line.strip() or indent(line) >= level:
            continue
        if pattern.match(line):
            return line.strip()
        # A line of an outer block (an `if`, a loop, the top level): keep looking for
        # a definition that holds it.
        level = indent(line)
        if level == 0:
            return ""
    return ""


def fit(header: str, where: str) -> str:
    """The hunk header and its definition, cut at a word to MAX_WIDTH columns."""
    line = f"{header} {where}"
    if len(line) <= MAX_WIDTH:
        return line
    cut = line[: MAX_WIDTH - 1]
    return cut[: max(cut.rfind(" "), cut.rfind("(") + 1)].rstrip() + "…"


def read_lines(path: Path, encoding: str) -> list[str]:
    lines = LINES.findall(path.read_text(encoding=encoding))
    # difflib would join a last line without a newline to the next line of the diff.
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    return lines


def object_lines(path: Path, name: str) -> tuple[int, int]:
    """Where the Python function or class `name` lies in the file: its first line's
    index, and the index after its last, as literalinclude's :pyobject: takes it."""
    tag = ModuleAnalyzer.for_file(str(path), "").find_tags().get(name)
    if tag is None:
        raise ValueError(f"{path} has no function or class {name}")
    return tag[1] - 1, tag[2]


def make_diff(
    old_path: Path,
    new_path: Path,
    language: str,
    encoding: str,
    pyobject: str | None = None,
) -> str:
    old, new = read_lines(old_path, encoding), read_lines(new_path, encoding)
    names = (str(old_path.relative_to(ROOT)), str(new_path.relative_to(ROOT)))
    old_start = new_start = 0
    old_part, new_part = old, new
    if pyobject:
        old_start, old_end = object_lines(old_path, pyobject)
        new_start, new_end = object_lines(new_path, pyobject)
        old_part, new_part = old[old_start:old_end], new[new_start:new_end]
    lines = list(unified_diff(old_part, new_part, *names, n=DIFF_CONTEXT))
    for number, line in enumerate(lines):
        header = HUNK.match(line)
        if not header:
            continue
        if pyobject:
            # The lines' numbers in the whole files, which the lexer reads them from.
            old_first = int(header[1]) + old_start
            new_first = int(header[2]) + new_start
            counts = re.match(r"@@ -\d+(,\d+)? \+\d+(,\d+)? @@", line).groups("")
            line = f"@@ -{old_first}{counts[0]} +{new_first}{counts[1]} @@\n"
            lines[number], header = line, HUNK.match(line)
        # The hunk's first line in the new file, and its first change.
        first = max(int(header[2]) - 1, 0)
        context = 0
        while lines[number + 1 + context].startswith(" "):
            context += 1
        changed = [
            text[1:]
            for text in lines[number + 1 + context :]
            if text[:1] in ("+", "-") and text[1:].strip()
        ][:1]
        level = indent(changed[0]) if changed else 0
        # The definition that holds the first change, unless the hunk already shows it.
        where = enclosing_definition(new, first + context, level, language)
        shown = {text.strip() for text in new[first : first + context]}
        if where and where not in shown:
            lines[number] = fit(header.group(0), where) + "\n"
    return "".join(lines)


class GuideLiteralInclude(LiteralInclude):
    def run(self) -> list[nodes.Node]:
        path = (Path(self.env.relfn2path(self.arguments[0])[1])).resolve()
        if "diff" not in self.options:
            # A tab then says which file it holds. A diff's header names both files.
            self.options.setdefault("caption", str(path.relative_to(ROOT)))
        # Sphinx refuses :pyobject: with :diff:; this directive makes the diff itself.
        pyobject = None
        if "diff" in self.options:
            pyobject = self.options.pop("pyobject", None)
        result = super().run()
        block = next(
            iter(n for r in result for n in r.findall(nodes.literal_block)), None
        )
        if "diff" in self.options:
            # Rebuild the page when the older file changes, as when the newer one does.
            self.env.note_dependency(self.options["diff"])
        if block is None:  # a warning node: the file is missing, say
            return result
        language = self.options.get("language", LANGUAGES.get(path.suffix))
        if language not in ("python", "bash"):
            language = "text"
        if "diff" in self.options:
            encoding = self.options.get("encoding", self.config.source_encoding)
            old_path = Path(self.options["diff"])
            try:
                text = make_diff(old_path, path, language, encoding, pyobject)
            except ValueError as error:
                return [
                    self.state.document.reporter.warning(str(error), line=self.lineno)
                ]
            if not text:
                what = f"{pyobject} in " if pyobject else ""
                return [
                    self.state.document.reporter.warning(
                        f"{what}{old_path} and {path} are the same: no diff",
                        line=self.lineno,
                    )
                ]
            block.children = [nodes.Text(text)]
            block.rawsource = text
            block["language"] = f"diff-{language}"
            # The lines after the two file names that start with + or -.
            block["highlight_args"]["hl_lines"] = [
                number
                for number, line in enumerate(LINES.findall(text), start=1)
                if number > 2 and line[:1] in ("+", "-")
            ]
            block["classes"].append("code-diff")
        elif PARTIAL_OPTIONS & set(self.options):
            block["classes"].append("code-excerpt")
        else:
            block["classes"].append("code-file")
        return result


class CodeDiffLexer(Lexer):
    """A diff made by make_diff, whose lines keep the highlighting of their file.

    Each file is lexed whole, as its full-file tab shows it, and each line of the diff
    takes that line's tokens: a hunk that starts inside a docstring still shows it as a
    string. The files are found by the paths in the diff's first two lines.
    """

    inner = None  # the language's lexer class

    def get_tokens_unprocessed(self, text):
        lines = LINES.findall(text)
        names = [line[4:].rstrip("\n") for line in lines[:2]]
        heads = [line[:4] for line in lines[:2]]
        if heads != ["--- ", "+++ "] or not all((ROOT / n).is_file() for n in names):
            # Not a diff that literalinclude's :diff: made from two files of the guide:
            # an error token, which Sphinx reports with the block's place.
            yield 0, Error, text
            return
        old_file, new_file = (self.file_tokens(ROOT / name) for name in names)
        position = 0
        for line in lines[:2]:
            yield position, Generic.Heading, line
            position += len(line)
        old = new = 0
        for line in lines[2:]:
            if header := HUNK.match(line):
                # The first line of the hunk in each file.
                old, new = int(header[1]) - 1, int(header[2]) - 1
                yield position, Generic.Subheading, line
                position += len(line)
                continue
            marker = line[:1]
            if marker == "-":
                marker_type, tokens = Generic.Deleted, old_file[old]
                old += 1
            elif marker == "+":
                marker_type, tokens = Generic.Inserted, new_file[new]
                new += 1
            else:
                marker_type, tokens = Text.Whitespace, new_file[new]
                old, new = old + 1, new + 1
            if "".join(value for _, value in tokens) != line[1:]:
                # The files changed since the diff was made, or were read otherwise.
                tokens = [(Error, line[1:])]
            yield position, marker_type, marker
            position += 1
            for token_type, value in tokens:
                yield position, token_type, value
                position += len(value)

    def file_tokens(self, path: Path) -> list[list[tuple]]:
        """The tokens of each line of the file, as make_diff reads its lines."""
        # Sphinx's default source_encoding, as make_diff reads the files.
        code = "".join(read_lines(path, "utf-8-sig"))
        per_line = [[]]
        lexer = self.inner(stripnl=False, ensurenl=False)
        for _, token_type, value in lexer.get_tokens_unprocessed(code):
            for piece in LINES.findall(value):
                per_line[-1].append((token_type, piece))
                if piece.endswith("\n"):
                    per_line.append([])
        return per_line


class PythonDiffLexer(CodeDiffLexer):
    name = "Python diff"
    aliases = ["diff-python"]
    inner = PythonLexer


class BashDiffLexer(CodeDiffLexer):
    name = "Bash diff"
    aliases = ["diff-bash"]
    inner = BashLexer


class TextDiffLexer(CodeDiffLexer):
    name = "Text diff"
    aliases = ["diff-text"]
    inner = TextLexer


def setup(app):
    app.add_directive("literalinclude", GuideLiteralInclude, override=True)
    app.add_lexer("diff-python", PythonDiffLexer)
    app.add_lexer("diff-bash", BashDiffLexer)
    app.add_lexer("diff-text", TextDiffLexer)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
