"""NNX mean refresh and bias transport (Algorithm 1, steps 10-11; eq. 10),
with the optimizer's parameter copies; ``eval_model``, ``muon_dimension_numbers``."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Sequence

import jax
from flax import nnx

from cbp_optax import _opt_state
from cbp_optax._flax_state import FLAX
from cbp_optax._paths import path_names
from cbp_optax._stacks import einsum_kernel_dims
from cbp_optax._stacks import place_kernel_dims
from cbp_optax._stacks import resolve_stack_axes
from cbp_optax import _checks
from cbp_optax import centering as core
from cbp_optax.nnx._center import centered_paths
from cbp_optax.nnx._center import centered_layers
from cbp_optax.nnx._wrapper import Centered
from cbp_optax.nnx._wrapper import layer_state
from cbp_optax.nnx._wrapper import transport_layer
from cbp_optax.nnx._wrapper import SUPPORTED
from cbp_optax.nnx._wrapper import layer_spec


# Where a Centered layer holds the wrapped layer's kernel and bias.
_KERNEL, _BIAS = (core.LAYER_KEY, 'kernel'), (core.LAYER_KEY, 'bias')


def _is_variable(node: Any) -> bool:
  return isinstance(node, nnx.Variable)


def _layer_moves(
    model: nnx.Module, wrt: Any, shifts: Optional[Sequence[Any]] = None,
) -> list[_opt_state.LayerMove]:
  """The centered layers as an optimizer of ``wrt`` sees them."""
  layers = centered_paths(model)
  if not layers:
    return []
  trained = {tuple(path) for path, _ in
             nnx.to_flat_state(nnx.state(model, wrt))}
  # A kernel shared between layers sits at its first owner's path.
  where = {id(v): tuple(path) for path, v in
           nnx.to_flat_state(nnx.state(model, nnx.Param))}
  shifts = shifts if shifts is not None else [None] * len(layers)
  moves = []
  for (path, layer), shift in zip(layers, shifts):
    kernel_path = where.get(id(layer.layer.kernel), path + _KERNEL)
    moves.append(_opt_state.LayerMove(
        path=path, kernel_key=_KERNEL, bias_key=_BIAS,
        bias_shape=tuple(layer.layer.bias.shape), shift=shift,
        kernel=layer.layer.kernel[...], kernel_trained=kernel_path in trained,
        kernel_path=None if kernel_path == path + _KERNEL else kernel_path))
  return moves


def check_optimizer_state(model: nnx.Module, optimizer: nnx.Optimizer,
                           where: str) -> None:
  """Classifies the optimizer's state before anything is traced."""
  if not isinstance(optimizer, nnx.Optimizer):
    raise TypeError(f'{where}: optimizer must be an nnx.Optimizer, got a '
                    f'{type(optimizer).__name__}.')
  _opt_state.transport_state(
      optimizer.opt_state, _layer_moves(model, optimizer.wrt),
      what='optimizer.opt_state', kind=FLAX,
      params=nnx.state(model, optimizer.wrt))


def transport(model: nnx.Module, mean_decay: Any = 0.99, *,
              optimizer: Optional[nnx.Optimizer] = None,
              opt_state: Any = None) -> Any:
  """Mean refresh and bias transport for every centered layer, in place.

  ``mu_new = mean_decay * mu + (1 - mean_decay) * batch_mean``, then
  ``b~ += W (mu_new - mu_old)`` with the updated weights (Algorithm 1, steps
  10-11): the output is unchanged; a layer that recorded nothing keeps
  ``mu``. Call it after the update (or use :func:`train_step`), with the
  ``optimizer`` (or its functional ``opt_state``) whenever its state may hold
  parameter copies (schedule-free, SAM, Prodigy, ..., or a
  :func:`cbp_optax.centering.register_parameter_state` type): each copy's
  biases move by its own kernel.

  Args:
    model: any NNX module; layers that are not :class:`Centered` are ignored.
    mean_decay: the EMA decay ``rho`` of the means, in ``[0, 1)``.
    optimizer: the ``nnx.Optimizer`` training ``model`` (moved in place).
    opt_state: an optax state on ``nnx.state(model, nnx.Param)`` (or its
      ``nnx.as_pure`` arrays); exclusive with ``optimizer``.

  Returns:
    The transported ``opt_state`` when one is given; otherwise None.

  Raises:
    cbp_optax.centering.UnclassifiedStateError: (a ``TypeError``) an
      unclassified parameter-shaped tree, before anything moves.

  Examples:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import cbp_optax as cbp
    >>> model = nnx.Sequential(nnx.Linear(2, 1, rngs=nnx.Rngs(0)))
    >>> _ = cbp.nnx.center(model)
    >>> x = jnp.array([[1.0, 2.0], [3.0, 4.0]])
    >>> before = model(x)  # training mode: records each layer's input mean
    >>> cbp.nnx.transport(model, mean_decay=0.5)
    >>> print(model.layers[0].mean[...])
    [1. 1.5]
    >>> bool(jnp.allclose(model(x), before, atol=1e-6))
    True

  References:
    Layerwise Conditioned Backpropagation, eq. (10), Algorithm 1 steps 10-11.
  """
  # test_every_transport_path_validates_mean_decay: NaN means and biases.
  _checks.check_mean_decay(mean_decay)
  if optimizer is not None and opt_state is not None:
    raise ValueError('transport: pass optimizer or opt_state, not both.')
  return transport_model(model, mean_decay, optimizer, opt_state)


def transport_model(model: nnx.Module, mean_decay: Any,
                    optimizer: Optional[nnx.Optimizer],
                    opt_state: Any, recorded_only: bool = True) -> Any:
  """:func:`transport` for a validated ``mean_decay`` (fused steps keep no
  recorded count: ``recorded_only=False``)."""
  if optimizer is not None:
    check_optimizer_state(model, optimizer, 'transport')
  elif opt_state is not None:
    _opt_state.transport_state(opt_state, _layer_moves(model, nnx.Param),
                               what='opt_state', kind=FLAX,
                               params=nnx.state(model, nnx.Param))
  shifts = [transport_layer(layer, mean_decay, recorded_only)
            for layer in centered_layers(model)]
  if optimizer is None and opt_state is None:
    return None
  trained = nnx.Param if optimizer is None else optimizer.wrt
  moves = _layer_moves(model, trained, shifts)
  # The model's own Variables in the state moved above: not twice.
  own = {id(v) for v in jax.tree.leaves(nnx.state(model), is_leaf=_is_variable)
         if _is_variable(v)}
  kind = FLAX._replace(moved=lambda box: id(box) in own)
  if optimizer is not None:
    _opt_state.transport_state(optimizer.opt_state, moves,
                               what='optimizer.opt_state', kind=kind)
    return None
  return _opt_state.transport_state(opt_state, moves, what='opt_state',
                                    kind=kind)


def eval_model(model: nnx.Module,
               optimizer: Optional[nnx.Optimizer] = None) -> nnx.Module:
  """A copy of ``model`` to evaluate: in eval mode, at the evaluation point.

  With a ``schedule_free`` state in ``optimizer``, the copy has its evaluation
  point ``x = (y - (1 - b1) z) / b1`` and the model's means (recalibrate
  BatchNorm statistics at ``x``), else the model's own parameters. It shares
  no variable or array with ``model``, so it outlives the donating
  :func:`train_step`.

  Args:
    model: the trained model.
    optimizer: its ``nnx.Optimizer``, or None.

  Raises:
    ValueError: several ``schedule_free`` states, or one over part of them.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> import cbp_optax as cbp
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> optimizer = cbp.nnx.Optimizer(
    ...     model, optax.contrib.schedule_free_sgd(0.1, b1=0.5))
    >>> step = cbp.nnx.train_step(lambda m, x: jnp.mean(m(x) ** 2))
    >>> _ = step(model, optimizer, jnp.ones((4, 2)))
    >>> evaluated = cbp.nnx.eval_model(model, optimizer)
    >>> x = optax.contrib.schedule_free_eval_params(
    ...     nnx.as_pure(optimizer.opt_state),
    ...     nnx.as_pure(nnx.state(model, nnx.Param)))
    >>> bool(jnp.array_equal(evaluated.kernel[...], x['kernel']))
    True
  """
  if optimizer is None:
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, _opt_state.unshared(state))
  else:
    graphdef, params, rest = nnx.split(model, optimizer.wrt, ...)
    params = _opt_state.evaluation_params(nnx.as_pure(optimizer.opt_state),
                                          nnx.as_pure(params))
    copy = nnx.merge(graphdef,
                     *_opt_state.unshared((params, nnx.as_pure(rest))))
  copy.eval()
  return copy


def muon_dimension_numbers(model: nnx.Module) -> Callable[[Any], Any]:
  """Muon's ``muon_weight_dimension_numbers`` for every kernel of ``model``.

  Each linear layer's kernel (``nnx.Einsum`` too), centered or not, is a
  matrix from its contracted input axes (reduction) to its features (output);
  stack axes are batch axes; other parameters get None (AdamW). ``dims``
  reads the model as it is when muon calls it.

  Args:
    model: the model, before or after :func:`center`.

  Returns:
    ``dims(params)`` for ``optax.contrib.muon(...,
    muon_weight_dimension_numbers=dims)``, on ``nnx.state(model, nnx.Param)``.

  Examples:
    >>> from flax import nnx
    >>> import cbp_optax as cbp
    >>> model = nnx.Sequential(nnx.Conv(3, 4, (3, 3), rngs=nnx.Rngs(0)))
    >>> _ = cbp.nnx.center(model)
    >>> dims = cbp.nnx.muon_dimension_numbers(model)
    >>> dims(nnx.state(model, nnx.Param))['layers'][0]['layer']['kernel']
    MuonDimensionNumbers(reduction_axis=(0, 1, 2), output_axis=(3,))
  """
  model_ref = weakref.ref(model)
  fallback = _muon_table(model)

  def dims(params):
    current = model_ref()
    table = fallback if current is None else _muon_table(current)
    return _opt_state.dimension_numbers_fn(table, FLAX)(params)

  return dims


def _muon_table(model: nnx.Module) -> dict[tuple[str, ...], Any]:
  """:func:`muon_dimension_numbers`'s table: kernel path -> its view."""
  table = {}
  for path, module in nnx.iter_modules(model):
    path = tuple(path)
    if isinstance(module, Centered):
      table[path_names(path + _KERNEL)] = core.kernel_dimension_numbers(
          layer_state(module))
    elif type(module) in SUPPORTED and path[-1:] != _KERNEL[:1]:
      spec = layer_spec(module, check=False)
      axes = resolve_stack_axes(tuple(module.kernel.shape), spec.kernel_shape)
      if axes is not None:
        table[path_names(path + ('kernel',))] = core.muon_dimension_numbers(
            spec, axes)
    elif type(module) is nnx.Einsum:
      dims = einsum_kernel_dims(module.einsum_str)
      own = tuple(module.kernel_shape)
      axes = resolve_stack_axes(tuple(module.kernel.shape), own)
      if dims is not None and axes is not None:
        table[path_names(path + ('kernel',))] = place_kernel_dims(
            *dims, len(own), axes)
  return table
