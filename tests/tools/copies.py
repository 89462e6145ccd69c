"""Writes the shared modules into the example folders that import them.

Each module of examples/shared/ (ranks.py, devices.py, ...) has one source there. An
example folder stands alone, so it holds a copy of every shared module that its files
import, directly or through another shared module. Edit the source, then run

    nox -s copies              # or: python tests/tools/copies.py
    python tests/tools/copies.py --check    # exit 1 if a copy is stale or missing

tests/test_layout.py fails when a copy differs from its source.
"""

import ast
import sys
from pathlib import Path

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
SHARED_DIR = EXAMPLES_DIR / "shared"


def imported(path: Path) -> set[str]:
    """The top-level names of the modules that a Python file imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def example_folders() -> list[Path]:
    return sorted(p.parent for p in EXAMPLES_DIR.glob("*/*/main.py"))


def shared_modules() -> dict[str, Path]:
    return {p.stem: p for p in sorted(SHARED_DIR.glob("*.py"))}


def wanted(folder: Path) -> dict[Path, Path]:
    """The copies that a folder needs: {its copy: the source}."""
    shared = shared_modules()
    own = [p for p in folder.glob("*.py") if p.stem not in shared]
    needed = set().union(*map(imported, own)) & shared.keys()
    # What the shared modules import of each other.
    while more := set().union(*(imported(shared[n]) for n in needed)) & shared.keys():
        if more <= needed:
            break
        needed |= more
    return {folder / shared[name].name: shared[name] for name in sorted(needed)}


def differences() -> list[tuple[Path, Path | None]]:
    """(copy, its source) for each copy missing or unlike its source; (copy, None) for
    each copy that no file of its folder imports."""
    found = []
    shared = shared_modules()
    for folder in example_folders():
        copies = wanted(folder)
        for copy, source in copies.items():
            if not copy.exists() or copy.read_bytes() != source.read_bytes():
                found.append((copy, source))
        found += [
            (path, None)
            for path in sorted(folder.glob("*.py"))
            if path.stem in shared and path not in copies
        ]
    return found


def stale() -> list[str]:
    """What `write()` would change, in words."""
    return [
        f"{copy.relative_to(EXAMPLES_DIR)}: "
        + (f"differs from shared/{source.name}" if source else "no file imports it")
        for copy, source in differences()
    ]


def write() -> list[str]:
    """Writes every copy; removes copies that no file of their folder imports."""
    changed = []
    for copy, source in differences():
        if source is None:
            copy.unlink()
        else:
            copy.write_bytes(source.read_bytes())
        changed.append(
            f"{copy.relative_to(EXAMPLES_DIR)}{'' if source else ' (removed)'}"
        )
    return changed


if __name__ == "__main__":
    if "--check" in sys.argv[1:]:
        problems = stale()
        print("\n".join(problems) or "every copy is up to date")
        sys.exit(1 if problems else 0)
    changed = write()
    print("\n".join(f"wrote {name}" for name in changed) or "every copy was up to date")
