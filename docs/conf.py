"""Sphinx configuration of jonebit's documentation site: the Markdown guides of docs/ (MyST) and an API reference
built by autodoc from the Google-style docstrings. Build with `make docs` (warnings are errors)."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # autodoc imports jonebit, which imports jax

import jonebit  # noqa: E402

project = "jonebit"
author = "jonebit developers"
copyright = "jonebit developers"  # noqa: A001 (Sphinx's name)
release = version = jonebit.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build"]

myst_heading_anchors = 3  # GitHub-style anchors for headings down to ###, so `page.md#section` links resolve

napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
napoleon_use_ivar = True  # an Attributes section as fields: autodoc lists the members themselves

html_theme = "furo" if importlib.util.find_spec("furo") else "alabaster"
html_title = f"jonebit {release}"

# The guides link to the benchmark reports as the repository lays them out (../benchmarks/NAME.md), which is
# right when reading them on the repository; the site carries those reports as docs/benchmarks/NAME.md (pages
# that include them). These two hooks point the links at the site's pages.
_BENCH_LINK = re.compile(r"\]\(\.\./benchmarks/((?:results/)?[A-Z]+\.md)")


def _guide_links(app, docname, source):
    if "/" not in docname:  # a guide at the top of docs/
        source[0] = _BENCH_LINK.sub(r"](benchmarks/\1", source[0])


def _report_links(app, relative_path, parent_docname, content):
    # An included report ../benchmarks/SUB/NAME.md is the site's page docs/benchmarks/SUB/NAME.md: links between
    # reports keep working as they are; links to ../docs/X lose the docs/ part; links to other files (results,
    # figures) are pointed back at the repository's copy, which Sphinx then copies into the site.
    here = pathlib.PurePosixPath(pathlib.PurePath(relative_path).as_posix()).parent
    if here.parts[:2] != ("..", "benchmarks"):
        return
    up = "../" * len(here.parts) + "/".join(here.parts[1:]) + "/"

    def fix(m):
        target = m.group(2)
        if target.startswith(("http:", "https:", "#", "../")) or target.split("#")[0].endswith(".md"):
            return m.group(0)
        return f"{m.group(1)}({up}{target})"

    text = re.sub(r"\]\(((?:\.\./)+)docs/", r"](\1", content[0])
    content[0] = re.sub(r"(\])\(([^)\s]+)\)", fix, text)


def setup(app):
    app.connect("source-read", _guide_links)
    app.connect("include-read", _report_links)
