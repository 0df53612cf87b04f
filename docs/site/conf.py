"""Sphinx configuration of the course site (built by tools/build_site.py, `make site`).

The sources Sphinx reads are not this folder: tools/build_site.py assembles them in
build/site-src/ (this folder's pages, the notebooks from notebooks/ and the two docs from
docs/, with a "run this notebook" box added and links to repository files rewritten), then
runs ``sphinx-build -W --keep-going -c docs/site build/site-src site``. Nothing is executed:
the notebooks' saved outputs are what the site shows.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(REPO))  # autodoc imports this checkout's accumlab
sys.path.insert(0, str(REPO / "tools"))

import accumlab_site  # noqa: E402
from build_site import project_urls  # noqa: E402  (one reader of pyproject.toml)

import accumlab  # noqa: E402

project = "accumlab"
author = "the accumlab authors"
copyright = "the accumlab authors"  # noqa: A001  (Sphinx's name)
release = version = accumlab.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx_copybutton",
    "accumlab_site",
]

# Notebooks are shown as committed: saved outputs, figures and widget state, never re-run.
nb_execution_mode = "off"
# ipywidgets' JavaScript comes from a CDN; accumlab_site draws the widgets' saved state as
# static HTML instead, so pages read the same offline.
nb_ipywidgets_js = {}
nb_merge_streams = True
myst_heading_anchors = 4
# $...$ and $$...$$ in the lessons' Markdown are math, typeset by the MathJax 2 that the
# jupyter-server-mathjax package ships (copied into the site by accumlab_site: no CDN).
myst_enable_extensions = ["colon_fence", "dollarmath", "amsmath", "attrs_inline"]
myst_update_mathjax = False
mathjax_path = "mathjax/MathJax.js?config=TeX-AMS-MML_HTMLorMML-full"
mathjax2_config = {
    "tex2jax": {"inlineMath": [["\\(", "\\)"]], "displayMath": [["\\[", "\\]"]]},
    # \_ inside \text{...} (loss\_sum), as JupyterLab's MathJax 3 shows it
    "TeX": {"extensions": ["text-macros.js"]},
    # MathJax's blank test font points to about:blank, which the browser refuses (a console
    # error); a local() font that does not exist serves the same purpose, quietly
    "HTML-CSS": {"availableFonts": [], "imageFont": None, "preferredFont": None,
                 "webFont": "STIX-Web", "linebreaks": {"automatic": True},
                 "styles": {"@font-face": {"font-family": "MathJax_Blank",
                                           "src": "local('MathJax Blank Absent')"}}},
    "showMathMenu": False,
    "messageStyle": "none",
}
# the copy button on code cells (its script and icons are in _static: works offline);
# it copies the code, not an output
copybutton_selector = "div.cell_input div.highlight pre, div.highlight-python pre, div.highlight-bash pre"
suppress_warnings = ["myst.header"]  # notebook titles are '# 00 · ...' then '##' sections

# _notebooks/ holds the lessons as committed, offered as downloads, not pages
exclude_patterns = ["_build", "**.ipynb_checkpoints", "_notebooks"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
root_doc = "index"

# API reference: docstrings are reST with Google-style sections where they have them.
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

urls = project_urls()
html_theme = "sphinx_book_theme"
html_title = "accumlab: gradient accumulation in PyTorch"
html_static_path = [str(HERE / "_static"), str(accumlab_site.mathjax_static(REPO / "build"))]
html_css_files = ["accumlab.css"]
html_js_files = ["accumlab.js"]  # the sidebar buttons of the article header (see the file)
html_favicon = str(HERE / "_static" / "favicon.svg")  # else browsers ask for a missing /favicon.ico
html_last_updated_fmt = None
html_show_sourcelink = False
html_copy_source = False
# The theme's colour mode on a first visit (empty, its script logs a console error).
html_context = {"default_mode": "auto"}
html_theme_options = {
    "repository_url": urls["Repository"],
    "repository_branch": "main",
    "use_repository_button": True,
    "show_toc_level": 2,
    "home_page_in_toc": True,
    "path_to_docs": "",
    # the theme's download menu links into _sources/, which this site does not copy; each
    # lesson offers its notebook in its "Run this notebook" box instead
    "use_download_button": False,
}
