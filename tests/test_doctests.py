"""Runs the docstring examples of the core modules; any failing example fails.

The modules are listed explicitly: the experiments
(``cbp_optax_experiments``) need matplotlib and are not part of the core. The
public API listed in ``DOCUMENTED`` must carry an ``Examples:`` section with at
least one checked example and, where it implements a piece of the method, a
``References:`` section naming the paper.
"""

import doctest
import importlib
import inspect
import pkgutil

import pytest

CORE_MODULES = (
    'cbp_optax',
    'cbp_optax._step',
    'cbp_optax._stacks',
    'cbp_optax._alias',
    'cbp_optax.blocks',
    'cbp_optax.centering',
    'cbp_optax._equalize',
    'cbp_optax.linen',
    'cbp_optax.nnx',
    'cbp_optax._precondition',
    'cbp_optax._recipe',
)

# Modules whose public API must carry examples (issue 14): at least one.
# The package's __init__ and the private step skeleton define no API of
# their own.
MUST_HAVE_EXAMPLES = tuple(
    m for m in CORE_MODULES if m not in ('cbp_optax', 'cbp_optax._step'))


def _modules(name):
  """The module ``name`` and, for a package, its implementation modules
  (doctest finds only what a module itself defines, not what it imports)."""
  module = importlib.import_module(name)
  found = [module]
  for info in pkgutil.iter_modules(getattr(module, '__path__', [])):
    found.append(importlib.import_module(f'{name}.{info.name}'))
  return found


@pytest.mark.parametrize('name', CORE_MODULES)
def test_module_doctests(name):
  failed = attempted = 0
  for module in _modules(name):
    result = doctest.testmod(
        module,
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
        verbose=False,
        report=True,
    )
    failed += result.failed
    attempted += result.attempted
  assert failed == 0, f'{failed} doctest example(s) failed in {name}'
  if name in MUST_HAVE_EXAMPLES:
    assert attempted > 0, f'{name} has no doctest examples'


PAPER = 'Layerwise Conditioned Backpropagation'

# (object, whether its docstring cites the paper).
DOCUMENTED = (
    ('cbp_optax.cbp', True),
    ('cbp_optax.recommended', True),
    ('cbp_optax.equalize', True),
    ('cbp_optax.precondition', True),
    ('cbp_optax.equalize_stats', True),
    ('cbp_optax.block_names', True),
    ('cbp_optax.blocks.block_layout', True),
    ('cbp_optax.centering.transport', True),
    ('cbp_optax.nnx.center', True),
    ('cbp_optax.nnx.Centered', True),
    ('cbp_optax.nnx.transport', True),
    ('cbp_optax.nnx.train_step', True),
    ('cbp_optax.nnx.stacked_blocks', True),
    ('cbp_optax.nnx.Optimizer', False),
    ('cbp_optax.linen.center', True),
    ('cbp_optax.linen.Centered', True),
    ('cbp_optax.linen.transport', True),
    ('cbp_optax.linen.train_step', True),
    ('cbp_optax.linen.TrainState', False),
    ('cbp_optax.linen.stacked_blocks', True),
)


def _resolve(dotted):
  module_name, _, attr = dotted.rpartition('.')
  while True:
    try:
      obj = importlib.import_module(module_name)
      break
    except ModuleNotFoundError:
      module_name, _, outer = module_name.rpartition('.')
      attr = f'{outer}.{attr}'
  for part in attr.split('.'):
    obj = getattr(obj, part)
  return obj


@pytest.mark.parametrize('dotted,cites_paper', DOCUMENTED)
def test_public_api_has_checked_examples(dotted, cites_paper):
  doc = inspect.getdoc(_resolve(dotted)) or ''
  assert 'Examples:' in doc, f'{dotted} has no Examples section'
  examples = doctest.DocTestParser().get_examples(doc)
  assert examples, f'{dotted} has no doctest example'
  assert any(e.want for e in examples), (
      f'{dotted}: no example checks any output')
  if cites_paper:
    assert 'References:' in doc and PAPER in doc, (
        f'{dotted} does not cite the paper by its title')
