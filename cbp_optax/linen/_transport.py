"""Linen mean refresh and bias transport (Algorithm 1, steps 10-11; eq. 10),
with the optimizer's parameter copies; ``eval_params``, ``muon_dimension_numbers``."""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.core import meta

from cbp_optax import _opt_state
from cbp_optax._flax_state import FLAX
from cbp_optax._paths import key_name
from cbp_optax._paths import path_names
from cbp_optax._paths import path_str
from cbp_optax._stacks import einsum_kernel_dims
from cbp_optax._stacks import place_kernel_dims
from cbp_optax import _checks
from cbp_optax import centering as core
from cbp_optax.linen._center import CenteredModel
from cbp_optax.linen._wrapper import CenteringMean
from cbp_optax.linen._wrapper import CONV
from cbp_optax.linen._wrapper import DENSE
from cbp_optax.linen._wrapper import entries
from cbp_optax.linen._wrapper import layer_state
from cbp_optax.linen._wrapper import transport_layer


def _layers(params: Any, centering: Any):
  """``(path, name, inner params, entry)`` of every centered layer (``name``:
  the wrapper's inner ``'dense'`` or ``'conv'``, else None)."""
  for path, entry in entries(centering):
    layer = params
    for key in path:
      if key not in layer:  # test_linen_transport_refuses_mismatched_collections
        raise ValueError(f'transport: params has no {key!r}, which centering '
                         'has: pass the collections of the same model.')
      layer = layer[key]
    name = None if 'kernel' in layer else next(
        (n for n in (DENSE, CONV) if n in layer), None)
    yield path, name, layer if name is None else layer[name], entry


def _move(path, name, inner, shift=None) -> _opt_state.LayerMove:
  return _opt_state.LayerMove(
      path=path if name is None else path + (name,),
      kernel_key=('kernel',), bias_key=('bias',),
      bias_shape=tuple(jnp.shape(inner['bias'])), kernel=inner['kernel'],
      kernel_trained=True, shift=shift)


def like(container: Any, tree: Any) -> Any:
  """``tree`` as a FrozenDict where ``container`` is one, else a dict."""
  if isinstance(container, flax.core.FrozenDict):
    return flax.core.freeze(tree)
  return flax.core.unfreeze(tree)


def check_opt_state(params: Any, centering: Any, opt_state: Any) -> None:
  """Refuses, before tracing, an unclassifiable optimizer state."""
  if isinstance(params, optax.LookaheadParams):
    params = params.fast
  moves = [_move(path, name, inner) for path, name, inner, _ in _layers(
      flax.core.unfreeze(params), flax.core.unfreeze(centering))]
  _opt_state.transport_state(opt_state, moves, what='opt_state', kind=FLAX,
                             params=params)


def transport(params: Any, centering: Any, mean_decay: Any = 0.99, *,
              opt_state: Any = None) -> tuple[Any, ...]:
  """Mean refresh and bias transport for every centered layer (pure).

  As ``cbp_optax.nnx.transport`` (Algorithm 1, steps 10-11, eq. 10), with
  the *updated* weights in ``params``: the output is unchanged. Pass
  ``opt_state`` whenever it may hold parameter copies: each copy's biases
  move by its own kernel (an unknown parameter-shaped tree raises
  :class:`cbp_optax.centering.UnclassifiedStateError`).

  Args:
    params: the ``'params'`` collection (or ``optax.LookaheadParams``).
    centering: the ``'centering'`` collection (with recorded batch means).
    mean_decay: the EMA decay ``rho`` of the means, in ``[0, 1)``.
    opt_state: the optimizer's state, to move its parameter copies too.

  Returns:
    ``(params, centering)`` in their containers (dict or FrozenDict), and
    ``opt_state`` third when given.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import flax.linen as nn
    >>> import cbp_optax as cbp
    >>> model = cbp.linen.center(nn.Dense(1))
    >>> x = jnp.array([[1.0, 2.0], [3.0, 4.0]])
    >>> variables = model.init(jax.random.key(0), x)
    >>> y, changed = model.apply(variables, x, mutable=['centering'])
    >>> params, centering = cbp.linen.transport(
    ...     variables['params'], changed['centering'], mean_decay=0.5)
    >>> centering['mean'].value
    Array([1. , 1.5], dtype=float32)
    >>> y_new = model.apply({'params': params, 'centering': centering}, x)
    >>> bool(jnp.allclose(y_new, y, atol=1e-6))
    True

  References:
    Layerwise Conditioned Backpropagation, eq. (10), Algorithm 1 steps 10-11.
  """
  _checks.check_mean_decay(mean_decay)
  if opt_state is not None:
    check_opt_state(params, centering, opt_state)
  return transport_collections(params, centering, mean_decay, opt_state)


def transport_collections(params: Any, centering: Any, mean_decay: Any,
                          opt_state: Any, recorded_only: bool = True
                          ) -> tuple[Any, ...]:
  """:func:`transport` for a validated ``mean_decay`` and classified
  ``opt_state`` (fused steps keep no recorded count: ``recorded_only=False``)."""
  lookahead = isinstance(params, optax.LookaheadParams)
  fast = params.fast if lookahead else params
  new_params, new_centering = map(flax.core.unfreeze, (fast, centering))
  moves = []  # the layers' moves, for the optimizer's parameter copies
  for path, name, inner, entry in list(_layers(new_params, new_centering)):
    shift = transport_layer(inner, entry, mean_decay, recorded_only)
    moves.append(_move(path, name, inner, shift))
  new_params, new_centering = like(fast, new_params), like(centering,
                                                           new_centering)
  if lookahead:
    slow = _opt_state.transport_copy(params.slow, moves, 'params.slow', FLAX)
    new_params = params._replace(fast=new_params, slow=slow)
  if opt_state is None:
    return new_params, new_centering
  return new_params, new_centering, _opt_state.transport_state(
      opt_state, moves, what='opt_state', kind=FLAX)


def eval_params(params: Any, opt_state: Any = None) -> Any:
  """The parameters to evaluate a (centered) model at, in buffers of their
  own (they outlive the donating :func:`train_step`).

  Schedule-free's evaluation point ``x = (y - (1 - b1) z) / b1`` for an
  ``opt_state`` holding one (with ``'centering'`` as it is), the slow
  parameters of ``optax.LookaheadParams``, otherwise ``params``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import cbp_optax as cbp
    >>> params = {'w': jnp.ones(2)}
    >>> opt_state = optax.contrib.schedule_free_sgd(0.1).init(params)
    >>> cbp.linen.eval_params(params, opt_state)['w']
    Array([1., 1.], dtype=float32)
  """
  if isinstance(params, optax.LookaheadParams):
    return _opt_state.unshared(params.slow)
  return _opt_state.unshared(params if opt_state is None else
                             _opt_state.evaluation_params(opt_state, params))


# A kernel-shaped CenteringMean box muon_dimension_numbers' abstract init
# adds next to each kernel: stacking transforms call its add_axis.
_PROBE = 'cbp_muon_probe'

_LAYERS = (nn.Dense, nn.DenseGeneral, nn.Conv, nn.ConvTranspose, nn.Einsum)


def _own_dims(module: nn.Module, ndim: int, args, kwargs
              ) -> Optional[tuple[tuple[int, ...], tuple[int, ...]]]:
  """(reduction, output) axes of one layer's own (unstacked) kernel."""
  if isinstance(module, nn.Einsum):
    einsum_str = kwargs.get('einsum_str', args[1] if len(args) > 1 else None)
    return einsum_kernel_dims(einsum_str or module.einsum_str)
  if isinstance(module, nn.DenseGeneral):
    batch = len(module.batch_dims)
    outputs = 1 if isinstance(module.features, int) else len(module.features)
    return (tuple(range(batch, ndim - outputs)),
            tuple(range(ndim - outputs, ndim)))
  last = ndim - 1  # Dense (in, out) and Conv (*window, in, out) ...
  if getattr(module, 'transpose_kernel', False):  # ... or (*window, out, in)
    return tuple(range(ndim - 2)) + (last,), (last - 1,)
  return tuple(range(last)), (last,)


def _model_table(model, args, kwargs) -> dict[tuple[str, ...], Any]:
  """Kernel path -> its view, from one abstract ``init`` of ``model``."""
  own = {}  # layer path -> (reduction, output, ndim) of its own kernel

  def probe(next_fun, call_args, call_kwargs, context):
    out = next_fun(*call_args, **call_kwargs)
    module = context.module
    if (context.method_name == '__call__' and isinstance(module, _LAYERS)
        and module.has_variable('params', 'kernel')
        and 'map_variables(' not in module.scope.path_text):
      shape = jnp.shape(meta.unbox(module.get_variable('params', 'kernel')))
      dims = _own_dims(module, len(shape), call_args, call_kwargs)
      if dims is not None:
        own[tuple(module.scope.path)] = dims + (len(shape),)
        module.param(_PROBE, lambda _: CenteringMean(
            jnp.zeros(shape, jnp.int8), None))
    return out

  with nn.intercept_methods(probe):
    variables = jax.eval_shape(functools.partial(model.init, **kwargs), *args)
  table = {}
  for path, box in jax.tree_util.tree_leaves_with_path(
      flax.core.unfreeze(variables.get('params', {})),
      is_leaf=lambda x: isinstance(x, CenteringMean)):
    layer = path_names(path[:-1])
    if path_names(path[-1:]) == (_PROBE,) and layer in own:
      table[layer + ('kernel',)] = place_kernel_dims(*own[layer],
                                                     box.stack_axes)
  return table


def _collections_table(params, centering) -> dict[tuple[str, ...], Any]:
  """Kernel path -> its view, for the layers ``centering`` describes; any
  other kernel is refused (its layer cannot be told from its shape)."""
  unfrozen = flax.core.unfreeze(params)
  table = {_move(path, name, inner).path + ('kernel',):
           core.kernel_dimension_numbers(layer_state(inner, entry))
           for path, name, inner, entry in _layers(
               unfrozen, flax.core.unfreeze(centering))}
  for path, leaf in jax.tree_util.tree_leaves_with_path(unfrozen):
    names = path_names(path)
    if (str(key_name(path[-1])) == 'kernel' and jnp.ndim(leaf) >= 2
        and names not in table):
      raise ValueError(
          f'muon_dimension_numbers: the kernel {path_str(path)!r} belongs to '
          'no centered layer, and its shape cannot tell its axes: pass the '
          'model and what its init takes, (model, jax.random.key(0), x).')
  return table


def muon_dimension_numbers(model: Any, *args: Any, **kwargs: Any
                           ) -> Callable[[Any], Any]:
  """Muon's ``muon_weight_dimension_numbers`` for a (centered) Linen model.

  From one abstract ``init``, as ``cbp_optax.nnx.muon_dimension_numbers``
  (``nn.scan``/``nn.vmap`` stack axes and kernel batch axes are batch axes).
  The older form ``muon_dimension_numbers(params, centering)`` knows the
  centered layers only, and refuses any other kernel.

  Args:
    model: the ``nn.Module``, or ``cbp.linen.center(module)``.
    *args: what ``model.init`` takes: its rngs, then example inputs.
    **kwargs: ``model.init``'s keyword arguments.

  Returns:
    ``dims(params)`` for ``optax.contrib.muon(...,
    muon_weight_dimension_numbers=dims)``, on the ``'params'`` collection.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import flax.linen as nn
    >>> import cbp_optax as cbp
    >>> model = cbp.linen.center(nn.Conv(4, (3, 3)))
    >>> x = jnp.ones((1, 5, 5, 3))
    >>> variables = model.init(jax.random.key(0), x)
    >>> dims = cbp.linen.muon_dimension_numbers(model, jax.random.key(0), x)
    >>> dims(variables['params'])['kernel']
    MuonDimensionNumbers(reduction_axis=(0, 1, 2), output_axis=(3,))
  """
  is_model = isinstance(model, (nn.Module, CenteredModel))
  if is_model and args:
    table = _model_table(model, args, kwargs)
  elif not is_model and len(args) == 1 and not kwargs:
    table = _collections_table(model, args[0])
  else:
    raise TypeError(
        'muon_dimension_numbers takes a Linen module (or center(module)) and '
        f'what its init takes, got a {type(model).__name__} and {len(args)} '
        'more arguments.')
  return _opt_state.dimension_numbers_fn(table, FLAX)
