"""Sphinx settings for the tutorial's static site (built by ``make docs``; see docs/build.py).

Notebooks are rendered from their stored outputs (never re-executed), and every asset a page needs is
served from the site itself, so it can be read offline.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "_ext"))

project = "日本語 BERT のマルチ GPU ファインチューニング"
author = "the tutorial's authors"
language = "ja"

extensions = ["myst_nb", "sphinx_copybutton", "mathml", "gpu_outputs"]  # the last two: docs/_ext/
root_doc = "index"
# training.md and memo-model.md: the README's long sections in full, read on GitHub or in an editor, not site pages
exclude_patterns = ["_build", "**.ipynb_checkpoints", "training.md", "memo-model.md"]

# The committed notebooks already carry outputs made by `make notebooks`; the site shows exactly those.
nb_execution_mode = "off"
# No widget state is stored, and the widget manager would load require.js and ipywidgets from a CDN.
nb_ipywidgets_js = {}
myst_enable_extensions = ["dollarmath"]
html_math_renderer = "mathml"  # docs/_ext/mathml.py: formulas as MathML, no MathJax from a CDN

html_theme = "furo"  # responsive (phones), self-contained assets, no web fonts
html_title = "日本語 BERT マルチ GPU チュートリアル"
html_show_sourcelink = False
html_copy_source = False
# Copy only the code, not the `[3]:` prompts or `>>>` of doctests.
copybutton_exclude = ".linenos, .gp, .go"

# Pygments cannot lex every traceback a notebook shows (it retries in relaxed mode and renders it fine);
# that is not a broken page, so it must not fail the warnings-as-errors build.
suppress_warnings = ["misc.highlighting_failure"]
