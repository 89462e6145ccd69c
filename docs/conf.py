"""Sphinx configuration for Distributed PyTorch on Slurm."""

from pathlib import Path

from docutils import nodes

ROOT = Path(__file__).resolve().parent.parent

project = "Distributed PyTorch on Slurm"
author = "The ddp-slurm-guide contributors"
copyright = "2026, " + author

extensions = ["myst_parser", "sphinx_copybutton", "sphinx_design"]
myst_enable_extensions = ["colon_fence"]
exclude_patterns = ["_build"]

html_theme = "furo"
html_title = project

# A copy button on every code block but the diffs: copying a diff would bring its +/- markers
# along. Each diff sits next to its full file, which copies clean.
copybutton_selector = "div:not(.highlight-udiff) > div.highlight > pre"
copybutton_exclude = ".linenos, .gp"


def relative_diff_headers(app, doctree):
    """`literalinclude :diff:` heads its diffs with absolute paths; show them from the repo."""
    for block in doctree.findall(nodes.literal_block):
        if block.get("language") == "udiff":
            text = block.astext().replace(f"{ROOT}/", "")
            block.children = [nodes.Text(text)]
            block.rawsource = text


def setup(app):
    app.connect("doctree-read", relative_diff_headers)
