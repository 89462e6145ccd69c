"""Two roles that keep the pages' claims honest (see docs/testing.md).

{untested}`needs NCCL on GPUs` marks a claim that the guide has not run, where it
stands, in one form: "(Untested here: needs NCCL on GPUs)". tests/test_claims.py
counts these marks, and the count may only fall.

{promise}`tested-x` puts a link target inside a table cell of the testing page, so that
a how-to page's {ref}`Tested <tested-x>` lands on the row that says how it was checked.
"""

from docutils import nodes


def untested(name, rawtext, text, lineno, inliner, options=None, content=None):
    # In parentheses: a mark may stand inside a sentence.
    mark = nodes.inline(rawtext, "", classes=["untested"])
    mark += nodes.Text("(")
    mark += nodes.strong("", "Untested here:")
    mark += nodes.Text(f" {text})")
    return [mark], []


def promise(name, rawtext, text, lineno, inliner, options=None, content=None):
    label = text.strip()
    target = nodes.target(rawtext, "", ids=[nodes.make_id(label)], names=[label])
    inliner.document.note_explicit_target(target)
    return [target], []


def setup(app):
    app.add_role("untested", untested)
    app.add_role("promise", promise)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
