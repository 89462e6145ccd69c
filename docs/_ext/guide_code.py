"""How the guide shows its files: `literalinclude`, with readable diffs.

Sphinx's `literalinclude` with `:diff:` makes a unified diff with 3 lines
of context and shows it in Pygments' `udiff` colours, which colour whole
lines and drop the file's own highlighting. No maintained Sphinx extension
or Pygments lexer highlights the code inside a diff (pygments/pygments#1043
and #2986 are open), so this extension does, in three parts:

- the diff is still made by difflib from the two files, as Sphinx makes it, with
  DIFF_CONTEXT lines of context, and each hunk header names the function or class that
  the change sits in, as `git diff` does;
- a lexer per language highlights each side of each hunk with the file's own lexer (the
  old side for removed lines, the new side for the rest) and marks each line's + or -;
- added and removed lines are Pygments' highlighted lines (`hl_lines`), and the
  stylesheet gives them a green or red background, in light and dark mode.

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
from pygments.token import Generic, Text
from sphinx.directives.code import LiteralInclude

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
PARTIAL_OPTIONS = {
    "pyobject",
    "lines",
    "start-after",
    "end-before",
    "start-at",
    "end-at",
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


def make_diff(old_path: Path, new_path: Path, language: str, encoding: str) -> str:
    old, new = read_lines(old_path, encoding), read_lines(new_path, encoding)
    names = (str(old_path.relative_to(ROOT)), str(new_path.relative_to(ROOT)))
    lines = list(unified_diff(old, new, *names, n=DIFF_CONTEXT))
    for number, line in enumerate(lines):
        header = re.match(r"@@ -\d+(?:,\d+)? \+(\d+)(?:,\d+)? @@", line)
        if not header:
            continue
        # The hunk's first line in the new file, and its first change.
        first = max(int(header.group(1)) - 1, 0)
        context = 0
        while lines[number + 1 + context].startswith(" "):
            context += 1
        changed = [
            text[1:]
            for text in lines[number + 1 + context :]
            if text[:1] in "+-" and text[1:].strip()
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
        result = super().run()
        block = next(
            iter(n for r in result for n in r.findall(nodes.literal_block)), None
        )
        if block is None:  # a warning node: the file is missing, say
            return result
        language = self.options.get("language", LANGUAGES.get(path.suffix))
        if language not in ("python", "bash"):
            language = "text"
        if "diff" in self.options:
            encoding = self.options.get("encoding", self.config.source_encoding)
            text = make_diff(Path(self.options["diff"]), path, language, encoding)
            block.children = [nodes.Text(text)]
            block.rawsource = text
            block["language"] = f"diff-{language}"
            # The lines after the two file names that start with + or -.
            block["highlight_args"]["hl_lines"] = [
                number
                for number, line in enumerate(text.splitlines(), start=1)
                if number > 2 and line[:1] in "+-"
            ]
            block["classes"].append("code-diff")
        elif PARTIAL_OPTIONS & set(self.options):
            block["classes"].append("code-excerpt")
        else:
            block["classes"].append("code-file")
        return result


class CodeDiffLexer(Lexer):
    """A unified diff whose lines keep the highlighting of the language they are in."""

    inner = None  # the language's lexer class

    def get_tokens_unprocessed(self, text):
        lines = LINES.findall(text)
        position, index = 0, 0
        # The two file names, then hunks: a header and its lines.
        while index < len(lines) and lines[index].startswith(("--- ", "+++ ")):
            yield position, Generic.Heading, lines[index]
            position += len(lines[index])
            index += 1
        while index < len(lines):
            yield position, Generic.Subheading, lines[index]
            position += len(lines[index])
            index += 1
            hunk = []
            while index < len(lines) and not lines[index].startswith("@@ "):
                hunk.append(lines[index])
                index += 1
            for token_type, value in self.hunk_tokens(hunk):
                yield position, token_type, value
                position += len(value)

    def hunk_tokens(self, hunk):
        """Each side of the hunk lexed as one piece of code, then dealt out by line."""
        old = [line for line in hunk if line[:1] in (" ", "-")]
        new = [line for line in hunk if line[:1] in (" ", "+")]
        old_tokens, new_tokens = self.side_tokens(old), self.side_tokens(new)
        old_index = new_index = 0
        for line in hunk:
            marker = line[:1]
            if marker == "-":
                yield Generic.Deleted, "-"
                yield from old_tokens[old_index]
                old_index += 1
            elif marker == "+":
                yield Generic.Inserted, "+"
                yield from new_tokens[new_index]
                new_index += 1
            elif marker == " ":
                yield Text.Whitespace, " "
                yield from new_tokens[new_index]
                old_index += 1
                new_index += 1

    def side_tokens(self, side):
        """The tokens of each line of one side, lexed together so strings span lines."""
        code = "".join(line[1:] for line in side)
        per_line = [[] for _ in side]
        row = 0
        lexer = self.inner(stripnl=False, ensurenl=False)
        for _, token_type, value in lexer.get_tokens_unprocessed(code):
            for piece in LINES.findall(value):
                if row < len(per_line):
                    per_line[row].append((token_type, piece))
                if piece.endswith("\n"):
                    row += 1
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
