"""Render math as MathML when the site is built, so a page needs no MathJax script (from a CDN) to show it.

Browsers draw MathML themselves (Chrome/Edge since 109, Firefox, Safari), on phones too.
"""

from docutils import nodes
from latex2mathml.converter import convert


def visit_math(translator, node):
    translator.body.append(convert(node.astext()))
    raise nodes.SkipNode


def visit_displaymath(translator, node):
    translator.body.append(f'<div class="math">{convert(node["latex"], display="block")}</div>')
    raise nodes.SkipNode


def setup(app):
    app.add_html_math_renderer("mathml", (visit_math, None), (visit_displaymath, None))
    return {"parallel_read_safe": True, "parallel_write_safe": True}
