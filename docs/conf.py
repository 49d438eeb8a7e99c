"""Sphinx configuration for the cbp_optax documentation.

Build with ``sphinx-build -W -b html docs docs/_build/html`` after
``pip install -e ".[docs]"``.
"""

import os
import sys

sys.path.insert(0, os.path.abspath('..'))

import cbp_optax  # noqa: E402
from sphinx import addnodes  # noqa: E402
from sphinx.transforms.post_transforms import SphinxPostTransform  # noqa: E402

project = 'cbp_optax'
author = 'cbp_optax authors'
copyright = 'cbp_optax authors'  # pylint: disable=redefined-builtin
release = cbp_optax.__version__
version = release

extensions = [
    'myst_parser',
    'sphinx.ext.autodoc',
    'sphinx.ext.napoleon',
    'sphinx.ext.mathjax',
    'sphinx.ext.viewcode',
]

source_suffix = {'.md': 'markdown', '.rst': 'restructuredtext'}
root_doc = 'index'
exclude_patterns = ['_build', 'Thumbs.db', '.DS_Store']

# Markdown: $...$ and $$...$$ math, ::: fences, heading anchors for links
# such as sharding.md#mesh-axes.
myst_enable_extensions = ['dollarmath', 'amsmath', 'colon_fence']
myst_heading_anchors = 3

# Docstrings are Google style.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

autodoc_member_order = 'bysource'
autodoc_typehints = 'description'
autodoc_default_options = {'show-inheritance': False}

html_theme = 'alabaster'

# The repository's top-level Markdown files are pages here (included by
# getting-started.md, reproduction.md, benchmarks.md, contributing.md); links
# to them from those files and from the pages in docs/ point at the pages.
_TOP_LEVEL_PAGES = {
    'README': 'getting-started',
    'REPRODUCTION': 'reproduction',
    'BENCHMARKS': 'benchmarks',
    'CONTRIBUTING': 'contributing',
}


def _top_level_page(target):
  name = os.path.basename(target or '')
  if name.endswith('.md'):
    name = name[:-len('.md')]
  return _TOP_LEVEL_PAGES.get(name)


class _TopLevelLinks(SphinxPostTransform):
  """Points Markdown links to README.md & co. at the pages including them."""

  default_priority = 5  # Before myst's resolver (9).

  def run(self, **kwargs):
    for node in self.document.findall(addnodes.pending_xref):
      if node.get('reftype') != 'myst':
        continue
      target, _, anchor = (node.get('reftarget') or '').partition('#')
      page = _top_level_page(target)
      if page is not None:
        node['refdomain'] = 'doc'
        node['reftarget'] = page
        # An unresolved 'FILE.md#section' keeps its anchor in the target.
        node['reftargetid'] = anchor or node.get('reftargetid')


def setup(app):
  app.add_post_transform(_TopLevelLinks)
html_title = f'cbp_optax {release}'
