"""Sphinx configuration for Distributed PyTorch on Slurm."""

import io
import os
import stat
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "_ext"))

import guide_numbers  # noqa: E402

project = "Distributed PyTorch on Slurm"
author = "The ddp-slurm-guide contributors"
copyright = "2026, " + author

# guide_code: literalinclude with path captions, and diffs that keep the code's own
# highlighting on green and red lines (see docs/_ext/guide_code.py).
extensions = [
    "myst_parser",
    "sphinx_copybutton",
    "sphinx_design",
    "guide_code",
    "guide_claims",
]
# substitution: the numbers that the guide's files decide, such as how many checks
# ReFrame lists, come from those files: {{ generic_checks }} (_ext/guide_numbers.py).
myst_enable_extensions = ["colon_fence", "substitution"]
myst_substitutions = guide_numbers.numbers()
exclude_patterns = ["_build", "_archives"]

html_theme = "furo"
html_title = project
html_favicon = "_static/favicon.svg"
html_static_path = ["_static"]
html_css_files = ["guide.css"]
# Whole files copy with their last newline (see _static/guide.js).
html_js_files = ["guide.js"]
# The diff colours, per theme; _static/guide.css applies them. Code is 12 px rather than
# furo's 13 px, so that an 88-column line and a diff's marker column fit the content
# column with room to spare in every common monospace font.
html_theme_options = {
    "light_css_variables": {
        "code-font-size": "var(--font-size--small--3)",
        "color-diff-added": "#dcfce4",
        "color-diff-removed": "#ffe6e6",
        "color-diff-added-marker": "#1a7f37",
        "color-diff-removed-marker": "#cf222e",
    },
    "dark_css_variables": {
        "color-diff-added": "#1c3a27",
        "color-diff-removed": "#46201f",
        "color-diff-added-marker": "#56d364",
        "color-diff-removed-marker": "#ff7b72",
    },
}

# A copy button on every code block but the diffs: copying a diff would bring its +/-
# markers along. Each diff sits next to its full file, which copies clean.
copybutton_selector = "div:not(.code-diff) > div.highlight > pre"
copybutton_exclude = ".linenos, .gp"


def write_archives(examples: Path, archives: Path):
    """One .zip per example folder, for the pages' "the folder as a .zip" links:
    _archives/generic-single_gpu.zip holds generic-single_gpu/job.sh, main.py and the
    folder's other files (not what a run left there). Written with fixed dates, and only
    where a file changed: a rebuild changes no byte, and sphinx-autobuild sees none."""
    archives.mkdir(exist_ok=True)
    for folder in sorted(p.parent for p in examples.glob("*/*/main.py")):
        name = f"{folder.parent.name}-{folder.name}"
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as archive:
            for path in archived_files(folder):
                entry = zipfile.ZipInfo(f"{name}/{path.name}", ZIP_DATE)
                mode = 0o755 if os.access(path, os.X_OK) else 0o644
                entry.external_attr = (stat.S_IFREG | mode) << 16
                entry.compress_type = zipfile.ZIP_DEFLATED
                archive.writestr(entry, path.read_bytes())
        target = archives / f"{name}.zip"
        if not target.exists() or target.read_bytes() != buffer.getvalue():
            target.write_bytes(buffer.getvalue())


def archived_files(folder: Path) -> list[Path]:
    """An example folder's own files: its code, job.sh, a container's definition."""
    return sorted(p for p in folder.iterdir() if p.suffix in {".py", ".sh", ".def"})


ZIP_DATE = (2026, 1, 1, 0, 0, 0)
DOCS = Path(__file__).parent
write_archives(DOCS.parent / "examples", DOCS / "_archives")
