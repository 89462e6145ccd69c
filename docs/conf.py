"""Sphinx configuration for Distributed PyTorch on Slurm."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "_ext"))

project = "Distributed PyTorch on Slurm"
author = "The ddp-slurm-guide contributors"
copyright = "2026, " + author

# guide_code: literalinclude with path captions, and diffs that keep the code's own
# highlighting on green and red lines (see docs/_ext/guide_code.py).
extensions = ["myst_parser", "sphinx_copybutton", "sphinx_design", "guide_code"]
myst_enable_extensions = ["colon_fence"]
exclude_patterns = ["_build"]

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
