"""Runs the docstring examples of the core modules; any failing example fails.

The modules are listed explicitly: the experiments (``cbp_optax.reproduce``)
need matplotlib and are not part of the installed core.
"""

import doctest
import importlib

import pytest

CORE_MODULES = (
    'cbp_optax',
    'cbp_optax._step',
    'cbp_optax.alias',
    'cbp_optax.blocks',
    'cbp_optax.centering',
    'cbp_optax.checkpoint',
    'cbp_optax.diagnostics',
    'cbp_optax.equalize',
    'cbp_optax.linen',
    'cbp_optax.nnx',
    'cbp_optax.precondition',
    'cbp_optax.sharding',
)

# Modules whose public API must carry examples (issue 14): at least one.
MUST_HAVE_EXAMPLES = (
    'cbp_optax.alias',
    'cbp_optax.blocks',
    'cbp_optax.centering',
    'cbp_optax.checkpoint',
    'cbp_optax.equalize',
    'cbp_optax.linen',
    'cbp_optax.nnx',
    'cbp_optax.precondition',
    'cbp_optax.sharding',
)


@pytest.mark.parametrize('name', CORE_MODULES)
def test_module_doctests(name):
  module = importlib.import_module(name)
  result = doctest.testmod(
      module,
      optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
      verbose=False,
      report=True,
  )
  assert result.failed == 0, f'{result.failed} doctest example(s) failed in {name}'
  if name in MUST_HAVE_EXAMPLES:
    assert result.attempted > 0, f'{name} has no doctest examples'
