"""``center``: an unmodified Linen module whose linear layers are centered."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Mapping, NamedTuple, Optional

import flax
import flax.linen as nn
import jax

from cbp_optax import centering as core
from cbp_optax._paths import path_str
from cbp_optax.linen._wrapper import MEAN
from cbp_optax.linen._wrapper import SUPPORTED
from cbp_optax.linen._wrapper import centered_call
from cbp_optax.linen._wrapper import entries
from cbp_optax.linen._wrapper import check_layer


def _under_map_variables(module: nn.Module) -> bool:
  return 'map_variables(' in module.scope.path_text


class CenteredModel(NamedTuple):
  """A Linen module run with every supported layer centered (see
  :func:`center`); ``init`` and ``apply`` take what the module's own do."""

  module: nn.Module
  where: core.Where = None
  mean_dtype: Optional[Any] = None
  axis_name: Optional[Any] = None

  def _interceptor(self, next_fun, args, kwargs, context):
    module = context.module
    if (context.method_name == '__call__' and type(module) in SUPPORTED
        and not _under_map_variables(module) and not core.skip_reason(
            self.where, path_str(module.scope.path), module, check_layer)):
      # The input: the first argument, by position or by name (the exact
      # supported types name it in their own __call__).
      other, name = dict(kwargs), None if args else list(
          inspect.signature(type(module).__call__).parameters)[1]
      if args or name in other:  # no input at all: the layer's error says so
        inputs = args[0] if args else other.pop(name)
        return centered_call(
            module, module, lambda x: next_fun(x, *args[1:], **other),
            lambda: module.get_variable('params', 'kernel'), inputs, False,
            self.mean_dtype, self.axis_name)
    return next_fun(*args, **kwargs)

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
      if context.method_name == '__call__' and any(  # params of its own
          not isinstance(v, Mapping)
          for v in module.variables.get('params', {}).values()):
        path = path_str(module.scope.path)
        reason = core.skip_reason(self.where, path, module, check_layer)
        if reason is None and _under_map_variables(module):
          reason = ('inside nn.map_variables: it computes with transformed '
                    'parameters, which the transport cannot see')
        if reason:
          skipped.add((path or core.MODEL_PATH, reason))
        else:
          centered.add(path)
      return out

    with nn.intercept_methods(spy):
      jax.eval_shape(functools.partial(self.init, **kwargs), *args)
    return core.CenterReport(sorted(centered), sorted(skipped))


def center(module: nn.Module, *, where: core.Where = None,
           mean_dtype: Optional[Any] = None,
           axis_name: Optional[Any] = None) -> CenteredModel:
  """Centers every supported linear layer of an unmodified Linen module.

  Every ``nn.Dense``, ``nn.DenseGeneral``, ``nn.Conv`` and stride-1
  ``nn.ConvTranspose`` (exact types, with a bias) the module calls runs as
  ``W (a - mu) + b~`` (eq. 8), intercepted at call time, computing what the
  module does while ``mu`` is zero. In ``nn.scan``/``nn.vmap``, give
  ``'centering'`` the ``variable_axes`` of ``'params'``.

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
    >>> module = nn.Sequential([nn.Dense(4), nn.LayerNorm()])
    >>> model, x = cbp.linen.center(module), jnp.ones((8, 3))
    >>> variables = model.init(jax.random.key(0), x)
    >>> variables['centering']['layers_0']['mean'].value.shape
    (3,)
    >>> print(model.report(jax.random.key(0), x))
    centered (1): layers_0
    left as is (1): layers_1 - LayerNorm: not a layer type centering knows (...)
    >>> plain = module.apply({'params': variables['params']}, x)
    >>> bool(jnp.array_equal(model.apply(variables, x), plain))
    True

  References:
    Layerwise Conditioned Backpropagation, §4.2, eq. (8).
  """
  if not isinstance(module, nn.Module):
    raise TypeError('center: module must be a flax.linen Module, got '
                    f'{type(module).__name__} (NNX: cbp_optax.nnx.center).')
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
    Three ``nn.Dense`` layers stacked by ``nn.vmap`` and a head: four blocks.

    >>> import jax, jax.numpy as jnp
    >>> import flax.linen as nn
    >>> import cbp_optax as cbp
    >>> Layers = nn.vmap(nn.Dense, split_rngs={'params': True},
    ...                  variable_axes={'params': 0, 'centering': 0})
    >>> model = cbp.linen.center(nn.Sequential([Layers(2), nn.Dense(1)]))
    >>> variables = model.init(jax.random.key(0), jnp.ones((3, 4, 2)))
    >>> stacked = cbp.linen.stacked_blocks(
    ...     variables['params'], variables['centering'])
    >>> cbp.block_names(variables['params'], stacked=stacked)
    ('layers_0[0]', 'layers_0[1]', 'layers_0[2]', 'layers_1')
    >>> tx = cbp.cbp(1e-3, stacked=stacked)

  References:
    Layerwise Conditioned Backpropagation, eq. (7).
  """
  layers = ((path, entry[MEAN].stack_axes, entry[MEAN].value.shape)
            for path, entry in entries(flax.core.unfreeze(centering)))
  return core.stacked_blocks(flax.core.unfreeze(params), stack_paths, layers)
