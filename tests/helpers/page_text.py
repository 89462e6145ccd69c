"""The prose of the site's pages, as a reader reads it: what the page tests measure.

`python tests/helpers/page_text.py` prints, per page, how often it mentions the tests
outside a link to the testing page, its sentences of more than 35 words, its longest
one, and its claims marked untested.
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(
    p
    for p in DOCS.glob("**/*")
    if p.suffix in {".md", ".rst"} and "_build" not in p.parts
)
LONG = 35

# A role that points at the testing page or one of its sections, with the "Tested:"
# that may come before it: how a how-to page says that something is tested.
TESTED_LINK = re.compile(
    r"(?:Tested(?: by)?:\s*)?"
    r"(?:\{(?:doc|ref)\}|:(?:doc|ref):)`(?:[^`<]*<)?[./]*(?:testing|tested-[\w-]+)>?`"
)
ROLE = re.compile(r"(?:\{[\w:-]+\}|:[\w:-]+:)`([^`]*)`")
LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)|`([^`<]*?)\s*<[^>]*>`_")
CODE = re.compile(r"``?[^`]+``?")
# "nccl-tests", NVIDIA's benchmark, is a tool, not a mention of the guide's tests.
TEST_WORD = re.compile(r"(?<!nccl-)\btest(?:s|ed|ing)?\b", re.IGNORECASE)
SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[A-Z(\"'`*{])")


def numbered_prose_lines(text: str) -> list[tuple[int, str]]:
    """The page's lines of prose, with their index: no code blocks, directives,
    labels or headings."""
    lines, fence, in_rst_block, indent = [], None, False, 0
    all_lines = text.splitlines()
    underline = re.compile(r"[=\-~^\"*]{3,}")
    for number, line in enumerate(all_lines):
        stripped = line.strip()
        if fence:
            if stripped.startswith(fence) and stripped.strip(fence[0]) == "":
                fence = None
            continue
        match = re.match(r"^\s*(`{3,}|:{3,})", line)
        if match:
            fence = match.group(1)
            continue
        if in_rst_block:
            if stripped and len(line) - len(line.lstrip()) <= indent:
                in_rst_block = False
            else:
                continue
        if re.match(r"^\s*\.\. ", line) or stripped.endswith("::"):
            in_rst_block, indent = True, len(line) - len(line.lstrip())
            if not stripped.endswith("::") or stripped.startswith(".."):
                continue
        following = all_lines[number + 1].strip() if number + 1 < len(all_lines) else ""
        if (
            stripped.startswith(("#", "|"))
            or re.match(r":[\w-]+:(\s|$)", stripped)  # a directive's option
            or re.fullmatch(r"\(.+\)=", stripped)  # a MyST label
            or underline.fullmatch(stripped)
            or (stripped and underline.fullmatch(following))  # an RST heading
        ):
            continue
        lines.append((number, line))
    return lines


def prose_lines(text: str) -> list[str]:
    return [line for _, line in numbered_prose_lines(text)]


def readable(text: str) -> str:
    """Prose with links and roles reduced to the words a reader sees."""
    text = LINK.sub(lambda m: m.group(1) or m.group(2), text)
    text = ROLE.sub(lambda m: re.sub(r"\s*<[^>]*>$", "", m.group(1)), text)
    return text


def paragraphs(page: Path) -> list[str]:
    found, current = [], []
    for line in prose_lines(page.read_text()) + [""]:
        if re.match(r"^\s*(?:[-*+]|\d+\.)\s", line) and current:
            found.append(" ".join(current))
            current = []
        if line.strip():
            current.append(line.strip())
        elif current:
            found.append(" ".join(current))
            current = []
    return found


def sentences(page: Path) -> list[str]:
    found = []
    for paragraph in paragraphs(page):
        text = readable(paragraph)
        text = re.sub(r"^(?:[-*]|\d+\.)\s+", "", text)
        found.extend(s.strip() for s in SENTENCE_END.split(text) if s.strip())
    return found


def words(sentence: str) -> int:
    return len(re.findall(r"[\w`'’.-]+", sentence))


def page_command(page: str, start: str) -> str:
    """The one-line ```bash block of a page (`adapt.md`) that starts with `start`: the
    command as a reader copies it. Blocks indented in a list count too."""
    text = (DOCS / page).read_text()
    commands = re.findall(r"^ *```bash\n *(.+)\n *```$", text, re.M)
    [found] = [c for c in commands if c.startswith(start)]
    return found


def mentions_of_tests(page: Path) -> list[str]:
    """Sentences that mention the tests other than by a link to the testing page."""
    found = []
    for paragraph in paragraphs(page):
        text = TESTED_LINK.sub("", paragraph)
        text = CODE.sub("", readable(text))
        found.extend(s for s in SENTENCE_END.split(text) if TEST_WORD.search(s))
    return found


GLOSSARY = DOCS / "glossary.md"
TERM_ROLE = re.compile(r"(?:\{term\}|:term:)`([^`]*)`")
# What a reader does not see as the page's own words: code, links, roles (term roles
# included: they are found on their own), URLs.
MASKED = re.compile(
    r"``[^`]+``|\{[\w:-]+\}`[^`]*`|:[\w:-]+:`[^`]*`|`[^`]*<[^>]*>`_|`[^`]+`"
    r"|\[[^\]]*\]\([^)]*\)|https?://\S+"
)


def glossary_terms() -> list[str]:
    """The terms of the glossary page, in its order."""
    block = GLOSSARY.read_text().split("```{glossary}\n", 1)[1].split("\n```", 1)[0]
    return [line for line in block.splitlines() if line and not line[0].isspace()]


def term_pattern(term: str) -> re.Pattern:
    """A term as the pages write it: a lower-case term in any case and with a plural."""
    if term == term.lower():
        return re.compile(
            rf"(?<![\w-]){re.escape(term)}(?:s|es)?(?![\w-])", re.IGNORECASE
        )
    return re.compile(rf"(?<![\w-]){re.escape(term)}(?:'s|s)?(?![\w-])")


def term_uses(page: Path, terms: list[str]) -> dict[str, tuple[int, int, str, bool]]:
    """Where each term is first used on the page: (line index, column, the words used,
    whether that use is a link to the glossary)."""
    prose = numbered_prose_lines(page.read_text())
    # Paragraphs as one string, so that code spans that wrap are masked whole; each
    # character keeps its line and column.
    blocks, text, places = [], "", []
    for number, line in prose + [(-1, "")]:
        if line.strip():
            text += line + "\n"
            places.extend((number, col) for col in range(len(line) + 1))
        elif text:
            blocks.append((text, places))
            text, places = "", []
    first: dict[str, tuple[int, int, str, bool]] = {}
    for text, places in blocks:
        links = [
            (m.start(), m.group(0), (re.search(r"<([^>]*)>$", m[1]) or m)[1].lower())
            for m in TERM_ROLE.finditer(text)
        ]
        masked = MASKED.sub(lambda m: " " * len(m.group(0)), text)
        if page.suffix == ".rst":  # reStructuredText cannot nest a role in bold text
            masked = re.sub(r"\*\*[^*]+\*\*", lambda m: " " * len(m[0]), masked)
        for term in terms:
            if term in first:
                continue
            # A longer term that holds this one ("local rank", "rank") is not a use.
            visible = masked
            for other in terms:
                if other != term and term.lower() in other.lower():
                    visible = term_pattern(other).sub(
                        lambda m: " " * len(m.group(0)), visible
                    )
            uses = [
                (m.start(), m.group(0), False)
                for m in term_pattern(term).finditer(visible)
            ]
            uses += [
                (at, words, True)
                for at, words, target in links
                if target == term.lower()
            ]
            if uses:
                at, words, linked = min(uses)
                first[term] = (*places[at], words, linked)
    return first


def link_first_uses(page: Path) -> int:
    """Links the first use of each glossary term on the page to the glossary; returns
    how many links it made. For the page's author, not for the tests."""
    lines = page.read_text().splitlines(keepends=True)
    edits = sorted(
        (
            (number, col, words, term)
            for term, (number, col, words, linked) in term_uses(
                page, glossary_terms()
            ).items()
            if not linked
        ),
        reverse=True,
    )
    for number, col, words, term in edits:
        target = "" if words == term else f" <{term}>"
        role = ":term:" if page.suffix == ".rst" else "{term}"
        line = lines[number]
        assert line[col : col + len(words)] == words, (page, number, words)
        lines[number] = f"{line[:col]}{role}`{words}{target}`{line[col + len(words) :]}"
    page.write_text("".join(lines))
    return len(edits)


# A claim the guide has not run, marked where it stands (docs/_ext/guide_claims.py).
UNTESTED = re.compile(r"(?:\{untested\}|:untested:)`([^`]*)`")
# The same said in other words: the mark is the one form.
UNTESTED_WORDS = re.compile(
    r"\buntested\b|\bnot (?:been )?(?:tested|run) here\b|\bhave not (?:tested|run)\b",
    re.IGNORECASE,
)


def untested_claims(page: Path) -> list[tuple[int, str]]:
    """The page's claims marked {untested}, by line number (from 1) and reason: in its
    prose and its tables, not in code."""
    lines = page.read_text().splitlines()
    prose = {number for number, _ in numbered_prose_lines("\n".join(lines))}
    return [
        (number + 1, reason)
        for number, line in enumerate(lines)
        if number in prose or line.lstrip().startswith("|")
        for reason in UNTESTED.findall(line)
    ]


def untested_in_other_words(page: Path) -> list[str]:
    """Prose that says "untested" in words of its own, outside the mark."""
    found = []
    for paragraph in paragraphs(page):
        text = CODE.sub("", UNTESTED.sub("", paragraph))
        found.extend(s for s in SENTENCE_END.split(text) if UNTESTED_WORDS.search(s))
    return found


def report() -> str:
    rows = ["page | test mentions | sentences > 35 words | longest | untested claims"]
    for page in PAGES:
        lengths = [words(s) for s in sentences(page)]
        rows.append(
            f"{page.relative_to(DOCS)} | {len(mentions_of_tests(page))} | "
            f"{sum(n > LONG for n in lengths)} | {max(lengths, default=0)} | "
            f"{len(untested_claims(page))}"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    if sys.argv[1:] == ["--link-terms"]:
        for page in PAGES:
            if page != GLOSSARY:
                print(page.relative_to(DOCS), link_first_uses(page))
    elif sys.argv[1:] == ["--long"]:
        for page in PAGES:
            for sentence in sentences(page):
                if words(sentence) > LONG:
                    print(f"{page.relative_to(DOCS)} ({words(sentence)}): {sentence}\n")
    else:
        print(report())
