"""``center``: an unmodified Linen module whose linear layers are centered."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Mapping, NamedTuple, Optional

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from cbp_optax import blocks
from cbp_optax import centering as core
from cbp_optax._paths import path_names
from cbp_optax._paths import path_str

from cbp_optax.linen._wrapper import MEAN
from cbp_optax.linen._wrapper import SUPPORTED
from cbp_optax.linen._wrapper import centered_call
from cbp_optax.linen._wrapper import is_entry
from cbp_optax.linen._wrapper import check_layer


_MAPPED_REASON = ('inside nn.map_variables: it computes with transformed '
                  'parameters, which the transport cannot see')


def _under_map_variables(module: nn.Module) -> bool:
  """Whether ``module`` runs inside ``nn.map_variables``, whose transformed
  parameters the transport cannot see (such layers are left as they are)."""
  return 'map_variables(' in module.scope.path_text


@functools.lru_cache(maxsize=None)
def _input_name(module_type: type) -> Optional[str]:
  """The name of the first argument of ``module_type.__call__`` after self."""
  try:
    parameters = list(
        inspect.signature(module_type.__call__).parameters.values())[1:]
  except (TypeError, ValueError):
    return None
  if parameters and parameters[0].kind in (
      inspect.Parameter.POSITIONAL_ONLY,
      inspect.Parameter.POSITIONAL_OR_KEYWORD):
    return parameters[0].name
  return None


def _call_input(
    module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any],
) -> tuple[bool, Any, tuple[Any, ...], dict[str, Any]]:
  """``(found, input, other args, other kwargs)`` of an intercepted call; the
  input is the first argument, by position or by name."""
  kwargs = dict(kwargs)
  if args:
    return True, args[0], tuple(args[1:]), kwargs
  name = _input_name(type(module))
  if name is not None and name in kwargs:
    return True, kwargs.pop(name), (), kwargs
  return False, None, tuple(args), kwargs


class CenteredModel(NamedTuple):
  """A Linen module run with every supported layer centered (see :func:`center`);
  ``init`` and ``apply`` take what the module's own do."""

  module: nn.Module
  where: core.Where = None
  mean_dtype: Optional[Any] = None
  axis_name: Optional[Any] = None

  def _interceptor(self, next_fun, args, kwargs, context):
    module = context.module
    if context.method_name != '__call__' or type(module) not in SUPPORTED:
      return next_fun(*args, **kwargs)
    path = path_str(module.scope.path)
    if not core.selected(self.where, path, module):
      return next_fun(*args, **kwargs)
    try:
      check_layer(module)
    except (TypeError, ValueError):
      return next_fun(*args, **kwargs)
    if _under_map_variables(module):
      return next_fun(*args, **kwargs)
    found, inputs, rest, kwargs = _call_input(module, args, kwargs)
    if not found:  # no input at all: the layer's own error says so
      return next_fun(*args, **kwargs)
    return centered_call(
        module, module, lambda x: next_fun(x, *rest, **kwargs),
        lambda: module.get_variable('params', 'kernel'), inputs, False,
        self.mean_dtype, self.axis_name)

  def init(self, *args, **kwargs):
    """``module.init`` with the ``'centering'`` collection created."""
    with nn.intercept_methods(self._interceptor):
      return self.module.init(*args, **kwargs)

  def apply(self, *args, **kwargs):
    """``module.apply``, centered; records batch means when ``'centering'`` is mutable."""
    with nn.intercept_methods(self._interceptor):
      return self.module.apply(*args, **kwargs)

  def report(self, *args, **kwargs) -> core.CenterReport:
    """What centering does to the module called on ``args``: a
    :class:`cbp_optax.centering.CenterReport`, from one abstract ``init``."""
    centered, skipped = set(), set()

    def spy(next_fun, call_args, call_kwargs, context):
      out = next_fun(*call_args, **call_kwargs)
      module = context.module
      if context.method_name == '__call__' and _has_own_params(module):
        path = path_str(module.scope.path)
        try:
          check_layer(module)
          if _under_map_variables(module):
            reason = _MAPPED_REASON
          elif core.selected(self.where, path, module):
            reason = None
          else:
            reason = 'not selected by where'
        except (TypeError, ValueError) as error:
          reason = core.skip_reason(module, error)
        if reason:
          skipped.add((path or core.MODEL_PATH, reason))
        else:
          centered.add(path)
      return out

    with nn.intercept_methods(spy):
      jax.eval_shape(functools.partial(self.init, **kwargs), *args)
    return core.CenterReport(sorted(centered), sorted(skipped))


def _has_own_params(module: nn.Module) -> bool:
  params = module.variables.get('params', {})
  return any(not isinstance(v, Mapping) for v in params.values())


def center(
    module: nn.Module, *, where: core.Where = None,
    mean_dtype: Optional[Any] = None, axis_name: Optional[Any] = None,
) -> CenteredModel:
  """Centers every supported linear layer of an unmodified Linen module.

  Every ``nn.Dense``, ``nn.DenseGeneral``, ``nn.Conv`` and stride-1
  ``nn.ConvTranspose`` (exact types, with a bias) the module calls runs as
  ``W (a - mu) + b~`` (eq. 8), intercepted
  at call time; in ``nn.scan``/``nn.vmap`` give ``'centering'`` the
  ``variable_axes`` of ``'params'``. Initially it computes what the module does.

  Args:
    module: the Linen module.
    where: as for ``cbp_optax.nnx.center`` (paths like ``'Block_0/Dense_1'``).
    mean_dtype: dtype of the means; the layer's ``param_dtype`` by default.
    axis_name: the mapped batch axis to average recorded means over.

  Returns:
    A :class:`CenteredModel` with ``init``, ``apply`` and ``report``.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import flax.linen as nn
    >>> import cbp_optax as cbp
    >>> class MLP(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     x = nn.relu(nn.LayerNorm()(nn.Dense(4)(x)))
    ...     return nn.Dense(1)(x)
    >>> model = cbp.linen.center(MLP())
    >>> x = jnp.ones((8, 3))
    >>> variables = model.init(jax.random.key(0), x)
    >>> sorted(variables)
    ['centering', 'params']
    >>> variables['centering']['Dense_0']['mean'].value.shape
    (3,)
    >>> print(model.report(jax.random.key(0), x))
    centered (2): Dense_0, Dense_1
    left as is (1): LayerNorm_0 - LayerNorm: not a layer type centering knows (...)
    >>> plain = MLP().apply({'params': variables['params']}, x)
    >>> bool(jnp.array_equal(model.apply(variables, x), plain))
    True

  References:
    Layerwise Conditioned Backpropagation, §4.2, eq. (8).
  """
  if not isinstance(module, nn.Module):
    raise TypeError(
        f'center: module must be a flax.linen Module, got '
        f'{type(module).__name__}; for an NNX model use '
        'cbp_optax.nnx.center.')
  if mean_dtype is not None:
    core.mean_dtype(mean_dtype, None)
  return CenteredModel(module, core.check_where(where), mean_dtype, axis_name)


def stacked_blocks(params: Any, centering: Any, *stack_paths: str):
  """The ``stacked=`` predicate of ``cbp.cbp`` / ``cbp.equalize`` for a model.

  M1 (eq. 7) sees one block per layer of a stack, found from the stacked
  means or named (``'ScanBlock_0'``).

  Args:
    params: the ``'params'`` collection.
    centering: the ``'centering'`` collection.
    *stack_paths: module paths of layer stacks, like ``'Decoder_0/layers'``.

  Returns:
    ``stacked(path, leaf) -> bool``, True for parameters inside a stack.

  Examples:
    Three scanned ``nn.Dense`` layers and one head: four M1 blocks.

    >>> import jax, jax.numpy as jnp
    >>> import flax.linen as nn
    >>> import cbp_optax as cbp
    >>> class Block(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x, _):
    ...     return nn.Dense(2)(x), None
    >>> class Stack(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     layers = nn.scan(Block, length=3, split_rngs={'params': True},
    ...                      variable_axes={'params': 0, 'centering': 0})
    ...     x, _ = layers(name='layers')(x, None)
    ...     return nn.Dense(1)(x)
    >>> model = cbp.linen.center(Stack())
    >>> variables = model.init(jax.random.key(0), jnp.ones((4, 2)))
    >>> stacked = cbp.linen.stacked_blocks(
    ...     variables['params'], variables['centering'])
    >>> stacked
    stacked_predicate(['layers'])
    >>> cbp.block_names(variables['params'], stacked=stacked)
    ('Dense_0', 'layers/Dense_0[0]', 'layers/Dense_0[1]', 'layers/Dense_0[2]')
    >>> tx = cbp.cbp(1e-3, stacked=stacked)

  References:
    Layerwise Conditioned Backpropagation, eq. (7).
  """
  shapes = {
      path_names(path): tuple(jnp.shape(leaf))
      for path, leaf in jax.tree_util.tree_leaves_with_path(
          flax.core.unfreeze(params))
  }
  roots = blocks.check_stack_paths(shapes, stack_paths)
  if not stack_paths:
    stacks, unstacked = [], []

    def visit(tree, path):
      if is_entry(tree):
        box = tree[MEAN]
        if box.stack_axes and box.stack_axes[0] == 0:
          stacks.append((path, box.value.shape[0]))
        elif not box.stack_axes:
          unstacked.append(path)
        return
      for key, sub in tree.items():
        visit(sub, path + (str(key),))

    visit(flax.core.unfreeze(centering), ())
    for path, size in stacks:
      roots.add(blocks.stack_root(shapes, path, size, unstacked))
  return blocks.stacked_predicate(roots)
