"""The prose of the site's pages, as a reader reads it: what the page tests measure.

`python tests/page_text.py` prints, per page, how often it mentions the tests outside a
link to the testing page, its sentences of more than 35 words, and its longest one.
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
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
TEST_WORD = re.compile(r"\btest(?:s|ed|ing)?\b", re.IGNORECASE)
SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[A-Z(\"'`*{])")


def prose_lines(text: str) -> list[str]:
    """The page's lines of prose: no code blocks, directives, labels or headings."""
    lines, fence, in_rst_block, indent = [], None, False, 0
    for line in text.splitlines():
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
        if stripped.startswith(("#", "(", "|", ":")) or re.fullmatch(
            r"[=\-~^\"*]{3,}", stripped
        ):
            continue
        lines.append(line)
    return lines


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


def test_mentions(page: Path) -> list[str]:
    """Sentences that mention the tests other than by a link to the testing page."""
    found = []
    for paragraph in paragraphs(page):
        text = TESTED_LINK.sub("", paragraph)
        text = CODE.sub("", readable(text))
        found.extend(s for s in SENTENCE_END.split(text) if TEST_WORD.search(s))
    return found


def report() -> str:
    rows = ["page | test mentions | sentences > 35 words | longest (words)"]
    for page in PAGES:
        lengths = [words(s) for s in sentences(page)]
        rows.append(
            f"{page.relative_to(DOCS)} | {len(test_mentions(page))} | "
            f"{sum(n > LONG for n in lengths)} | {max(lengths, default=0)}"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    if sys.argv[1:] == ["--long"]:
        for page in PAGES:
            for sentence in sentences(page):
                if words(sentence) > LONG:
                    print(f"{page.relative_to(DOCS)} ({words(sentence)}): {sentence}\n")
    else:
        print(report())
