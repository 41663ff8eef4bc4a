"""Sphinx configuration: the Markdown guides in docs/ as a site (`make docs`, warnings fail)."""

project = 'tf_gpipe'
author = 'the tf_gpipe developers'
extensions = ['myst_parser']
source_suffix = {'.md': 'markdown'}
root_doc = 'index'
exclude_patterns = ['_build', 'results']
# GitHub's heading anchors, so a link like [x](engine.md#recompute) works on the code host and
# in the site alike; a link to a missing page or anchor is a warning, and warnings fail.
myst_heading_anchors = 3
myst_enable_extensions = ['colon_fence']
html_theme = 'alabaster'
html_title = 'tf_gpipe'
