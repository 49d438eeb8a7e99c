"""Conditioned Backpropagation for Flax NNX: centered layers and the fused step.

* :func:`center` wraps every supported layer of a built model in place
  (attention projections and layer stacks included), so the model computes
  ``z = W (a - mu) + b~`` (eq. 8) in every linear layer without editing its
  source.
* :class:`Centered` is that wrapper, for models written with it.
* :func:`transport` refreshes every centering mean and moves the biases so the
  function is unchanged (Algorithm 1, steps 10-11; eq. 10).
* :func:`train_step` builds one compiled CBP iteration (callable on its own
  or inside your ``nnx.jit``).
* :func:`stacked_blocks` tells M1 which parameters are layer stacks.

Example::

  model = MyModel(rngs=nnx.Rngs(0))
  cbp_optax.nnx.center(model)   # every Linear, Conv, attention projection
  optimizer = cbp_optax.nnx.Optimizer(
      model, cbp_optax.cbp(1e-3, stacked=cbp_optax.nnx.stacked_blocks(model)))
  step = cbp_optax.nnx.train_step(loss_fn)     # loss_fn(model, *batch)
  out = step(model, optimizer, images, labels)  # out.loss, out.skipped

References:
  Layerwise Conditioned Backpropagation: A Curvature-Aware Reparameterization
  of the Backward Pass with Convergence Guarantees,
  §4.2, eqs. (8)-(10), and Algorithm 1.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterable, Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import graphlib

from cbp_optax import _batch_stats
from cbp_optax import _checks
from cbp_optax import _opt_state
from cbp_optax import _step
from cbp_optax import blocks
from cbp_optax import centering as core
from cbp_optax._step import StepOutput

__all__ = [
    'CenterReport', 'Centered', 'CenteringMean', 'Optimizer', 'RecordedCount',
    'RecordedMean', 'StepOutput', 'TransportResidual', 'center', 'eval_model',
    'muon_dimension_numbers', 'recalibrate_batch_stats', 'stacked_blocks',
    'train_step', 'transport',
]


class _StackTracked(nnx.BatchStat):
  """A statistic that keeps ``stack_axes`` metadata through ``add_axis``.

  NNX calls ``add_axis`` / ``remove_axis`` when a transform is given a
  ``transform_metadata`` partition name; then the stack axes are known
  exactly. Otherwise :func:`cbp_optax.centering.transport` finds them from
  the shapes.
  """

  def add_axis(self, axis_index, axis_name):
    axes = self.get_metadata().get('stack_axes') or ()
    moved = tuple(a + 1 if a >= axis_index else a for a in axes)
    self.set_metadata(stack_axes=tuple(sorted(moved + (axis_index,))))

  def remove_axis(self, axis_index, axis_name):
    axes = self.get_metadata().get('stack_axes') or ()
    self.set_metadata(stack_axes=tuple(
        a - 1 if a > axis_index else a for a in axes if a != axis_index))


class CenteringMean(_StackTracked):
  """The EMA ``mu`` a centered layer subtracts from its input (eq. 8)."""


class RecordedMean(_StackTracked):
  """The mean of the training inputs since the last :func:`transport`."""


class RecordedCount(_StackTracked):
  """How many input positions :class:`RecordedMean` averages (0: none yet).

  ``mu``'s shape with every feature axis 1 (its stack axes kept), so that
  the calls of one forward pass are weighted by the positions each saw.
  """


class TransportResidual(_StackTracked):
  """What a 16-bit bias lacks of its exact transported value (float32).

  See :func:`cbp_optax.centering.needs_bias_residual`: carried into the next
  transport, so that the roundings of the bias do not add up.
  """


def _linear_spec(layer: nnx.Linear) -> core.LayerSpec:
  core.check_centerable(type(layer), use_bias=layer.use_bias)
  return core.dense_spec(-1, (layer.in_features,), (layer.out_features,))


def _linear_general_spec(layer: nnx.LinearGeneral) -> core.LayerSpec:
  core.check_centerable(type(layer), use_bias=layer.use_bias,
                        batch_axes=dict(layer.batch_axis))
  return core.dense_spec(layer.axis, layer.in_features, layer.out_features)


def _conv_spec(layer: nnx.Conv) -> core.LayerSpec:
  core.check_centerable(type(layer), use_bias=layer.use_bias,
                        input_dilation=layer.input_dilation)
  return core.conv_spec(layer.kernel_size, layer.in_features,
                        layer.out_features, layer.feature_group_count)


# Exact types only: a subclass may override __call__ and change the maths.
_SPEC_OF = {
    nnx.Linear: _linear_spec,
    nnx.LinearGeneral: _linear_general_spec,
    nnx.Conv: _conv_spec,
}


def layer_spec(layer: nnx.Module) -> core.LayerSpec:
  """The :class:`~cbp_optax.centering.LayerSpec` of a layer, or why not.

  Raises:
    TypeError: a type the core does not know exactly.
    cbp_optax.centering.CannotCenterError: a known type configured so that
      the transport could not be exact.
  """
  spec_of = _SPEC_OF.get(type(layer))
  if spec_of is None:
    raise core.unsupported_layer_error(type(layer), tuple(_SPEC_OF))
  return spec_of(layer)


def _stacked_shape(
    layer: nnx.Module, spec: core.LayerSpec,
    stack_axes: Optional[Sequence[int]] = None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """Shape and stack axes of ``mu`` for a layer that may already be stacked."""
  kernel_shape = tuple(layer.kernel.shape)
  placements = core.stack_axes_placements(kernel_shape, spec.kernel_shape)
  if stack_axes is not None:
    ndim = len(kernel_shape)
    given = stack_axes
    stack_axes = tuple(sorted(
        a % ndim for a in given
        if isinstance(a, int) and not isinstance(a, bool) and -ndim <= a < ndim))
    if len(stack_axes) != len(tuple(given)) or stack_axes not in placements:
      raise ValueError(
          f'{type(layer).__name__}: stack_axes={given!r} does not fit: '
          f'the kernel of shape {kernel_shape} is {spec.kernel_shape} with '
          f'stack axes at {placements or "no placement"}.'
      )
    axes = stack_axes
  elif not placements:
    raise ValueError(
        f'{type(layer).__name__}: kernel shape {kernel_shape} is not '
        f'{spec.kernel_shape} with stack axes added.'
    )
  elif len(placements) > 1:
    raise ValueError(
        f'{type(layer).__name__}: the kernel of shape {kernel_shape} is '
        f'{spec.kernel_shape} stacked along any of the axes {placements}; '
        'the shapes cannot tell which (a stack as long as a feature size), '
        'and a wrong guess would change the function at the first '
        'transport. ' + core.AMBIGUOUS_STACK_REMEDY
    )
  else:
    axes = placements[0]
  shape = list(spec.mean_shape)
  for axis in axes:
    shape.insert(min(axis, len(shape)), kernel_shape[axis])
  mean_axes = tuple(
      min(a, len(spec.mean_shape) + i) for i, a in enumerate(axes))
  return tuple(shape), mean_axes


class Centered(nnx.Module):
  """A linear layer reparameterized as ``z = W (a - mu) + b~`` (paper eq. 8).

  ``mu`` starts at zero, so a freshly wrapped layer computes exactly what the
  layer did. The forward pass centers with the stored ``mu`` and, in training
  mode, records the batch mean of its input (per input feature; per input
  channel over batch and spatial positions for convolutions); it never changes
  ``mu`` itself. :func:`transport` does, after the parameter update, together
  with the bias shift that keeps the function unchanged. A layer called
  several times before the transport (an unrolled recurrent cell, one layer
  applied twice) records the mean over all those calls, each weighted by the
  positions it saw (``batch_count`` counts them; the transport sets it back
  to zero). ``model.eval()`` (or ``nnx.view(model,
  use_running_average=True)``) stops the recording; ``model.train()``
  resumes it; ``use_running_average`` may also be passed to the call. Other
  keyword arguments (e.g. ``out_sharding``) go to the layer.

  The layer may already be a stack (built under ``nnx.vmap``/``nnx.scan``):
  ``mu`` then gets the same stack axes, and :func:`transport` moves every
  slice's bias by its own kernel. Built inside ``nnx.vmap``, the wrapper is
  stacked along with the layer.

  A convolution is centered after its padding (``mu`` is subtracted at the
  border too, which keeps the transport exact there). It runs as the plain
  layer, on the raw input with its own padding, minus
  ``(sum over the window of W) . mu`` (``centering.mean_correction``): the
  same values and gradients (eq. 9), without a pass over the activation.

  Args:
    layer: an ``nnx.Linear``, ``nnx.LinearGeneral`` (without batch axes) or
      ``nnx.Conv`` (without input dilation; any padding, stride, groups,
      kernel dilation or mask), built with a bias. Exact types only.
    use_running_average: True stops recording batch means (evaluation).
    mean_dtype: dtype of ``mu``; defaults to the layer's ``param_dtype``.
    axis_name: the mapped batch axis to average the recorded mean over inside
      ``shard_map`` / ``pmap`` / ``vmap`` (not needed under ``jit``, where a
      sharded batch's mean is already global).
    stack_axes: for a layer stacked before wrapping, the axes of its kernel
      that are stack axes (``(1,)`` for ``nnx.vmap(..., out_axes=1)``);
      needed only where the shapes cannot tell (a stack as long as a feature
      size), found from them otherwise.

  Raises:
    TypeError: for any other layer type, subclasses included.
    cbp_optax.centering.CannotCenterError: (a ``ValueError``) for a layer
      without bias, with input dilation or with kernel batch axes.

  Examples:
    The forward pass records the batch mean; :meth:`transport` moves ``mu``
    to it (``mean_decay=0``) and the bias with it, so the output is the same:

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import cbp_optax as cbp
    >>> layer = cbp.nnx.Centered(nnx.Linear(2, 1, rngs=nnx.Rngs(0)))
    >>> layer.mean.shape, layer.mean.dtype
    ((2,), dtype('float32'))
    >>> a = jnp.array([[1.0, 2.0], [3.0, 4.0]])
    >>> before = layer(a)
    >>> print(layer.batch_mean[...], layer.mean[...])
    [2. 3.] [0. 0.]
    >>> layer.transport(mean_decay=0.0)
    >>> print(layer.mean[...], bool(jnp.allclose(layer(a), before)))
    [2. 3.] True

  References:
    Layerwise Conditioned Backpropagation: A Curvature-Aware Reparameterization
    of the Backward Pass with Convergence Guarantees,
    §4.2, eqs. (8) and (9).
  """

  def __init__(
      self,
      layer: nnx.Module,
      *,
      use_running_average: bool = False,
      mean_dtype: Optional[Any] = None,
      axis_name: Optional[Any] = None,
      stack_axes: Optional[Sequence[int]] = None,
  ):
    _checks.check_bool('use_running_average', use_running_average)
    spec = layer_spec(layer)
    shape, stack_axes = _stacked_shape(layer, spec, stack_axes)
    dtype = core.mean_dtype(mean_dtype, layer.param_dtype)
    self.layer = layer
    self.spec = spec
    self.use_running_average = use_running_average
    self.axis_name = axis_name
    self.mean = CenteringMean(jnp.zeros(shape, dtype), stack_axes=stack_axes)
    self.batch_mean = RecordedMean(jnp.zeros(shape, dtype),
                                   stack_axes=stack_axes)
    self.batch_count = RecordedCount(
        jnp.zeros(core.count_shape(shape, stack_axes), core.count_dtype(dtype)),
        stack_axes=stack_axes)
    if core.needs_bias_residual(layer.bias.dtype):
      self.bias_residual = TransportResidual(
          jnp.zeros(layer.bias.shape, jnp.float32))

  def set_view(self, use_running_average: Optional[bool] = None):
    """Used by ``nnx.view``: ``use_running_average=True`` for evaluation."""
    if use_running_average is not None:
      self.use_running_average = use_running_average

  def __call__(self, inputs: jax.Array, *args,
               use_running_average: Optional[bool] = None, **kwargs):
    """``W (a - mu) + b~``; extra arguments go to the layer."""
    if use_running_average is None:
      use_running_average = self.use_running_average
    if not use_running_average:
      self.batch_mean[...], self.batch_count[...] = core.record_mean(
          inputs, self.spec, self.batch_mean[...], self.batch_count[...],
          self.axis_name)
    return core.centered_output(
        self.spec,
        lambda x: self.layer(x, *args, **kwargs),
        inputs,
        self._kernel,
        self.mean[...],
    )

  def _kernel(self) -> jax.Array:
    """The kernel the layer applies (a convolution's ``mask`` included)."""
    kernel = self.layer.kernel[...]
    mask = getattr(self.layer, 'mask', None)
    return kernel if mask is None else kernel * mask

  @property
  def kernel(self) -> nnx.Param:
    """The wrapped layer's kernel (shared: the centered layer's ``W``)."""
    return self.layer.kernel

  @property
  def bias(self) -> jax.Array:
    """The bias of the uncentered layer this one equals: ``b~ - W mu``.

    For modules that read a layer's parameters instead of calling it (a
    LoRA adapter computing ``x @ base.kernel + base.bias``): with these,
    ``x @ kernel + bias`` is the centered layer's output, before and after
    every transport. Read-only; the trained bias ``b~`` is
    ``layer.bias``. (Such a module never calls the layer, so no batch mean
    is recorded and ``mu`` stays where it is.)
    """
    correction = core.mean_correction(self.spec, self._kernel(),
                                      self.mean[...])
    bias = self.layer.bias[...]
    return bias - correction.astype(bias.dtype)

  def transport(self, mean_decay: Any = 0.99) -> None:
    """Refreshes ``mu`` from the recorded mean and shifts the bias (eq. 10).

    The layer's own bias only: an optimizer's copies of the parameters move
    with :func:`cbp_optax.nnx.transport` ``(model, optimizer=...)``.
    """
    residual = getattr(self, 'bias_residual', None)
    moved = core.transport(
        self.spec,
        self.layer.kernel[...],
        self.layer.bias[...],
        self.mean[...],
        self.batch_mean[...],
        mean_decay,
        mask=getattr(self.layer, 'mask', None),
        mean_stack_axes=self.mean.get_metadata().get('stack_axes'),
        residual=None if residual is None else residual[...],
    )
    self.layer.bias[...] = moved[0]
    self.mean[...] = moved[1]
    if residual is not None:
      residual[...] = moved[2]
    self.restart_recording()

  def restart_recording(self) -> None:
    """Starts a fresh recorded mean: the next training call overwrites it.

    :meth:`transport` calls it once it has used the recorded mean, so that
    every step records the calls of its own forward pass only.
    """
    self.batch_count[...] = jnp.zeros_like(self.batch_count[...])


class Optimizer(nnx.Optimizer):
  """``nnx.Optimizer`` that also counts the steps :func:`train_step` skipped.

  ``optimizer.skipped_steps`` (an ``nnx.OptState`` int32 scalar) grows by one
  for every batch whose loss, gradients or recorded statistics were not
  finite; ``optimizer.step`` counts only the updates applied. A plain
  ``nnx.Optimizer`` works with :func:`train_step` too, without the count.
  On a centered model the optimizer state is classified at construction
  (see :func:`transport`): one holding a parameter-shaped tree the
  transport cannot tell copy from statistic is refused with a
  :class:`cbp_optax.centering.UnclassifiedStateError` there, not at the
  first step.

  Examples:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import cbp_optax as cbp
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> optimizer = cbp.nnx.Optimizer(model, cbp.cbp(1e-3))
    >>> step = cbp.nnx.train_step(lambda m, x, y: jnp.mean((m(x) - y) ** 2))
    >>> x = jnp.ones((4, 2))
    >>> out = step(model, optimizer, x, jnp.full((4, 1), jnp.nan))
    >>> bool(out.skipped), int(optimizer.step[...]), int(optimizer.skipped_steps[...])
    (True, 0, 1)
    >>> out = step(model, optimizer, x, jnp.zeros((4, 1)))
    >>> bool(out.skipped), int(optimizer.step[...]), int(optimizer.skipped_steps[...])
    (False, 1, 1)
  """

  def __init__(self, model: nnx.Module, tx: Any, *, wrt: Any = nnx.Param):
    super().__init__(model, tx, wrt=wrt)
    self.skipped_steps = nnx.OptState(jnp.zeros((), jnp.int32))
    # A centered model's transport must know what the state holds: refuse
    # an unclassifiable one now rather than at the first step.
    _check_optimizer_state(model, self, 'Optimizer')

  def update(self, model: nnx.Module, grads: Any, /, **kwargs: Any) -> Any:
    """``nnx.Optimizer.update``; says so when ``center`` came after it."""
    try:
      return super().update(model, grads, **kwargs)
    except (TypeError, ValueError) as error:
      hint = blocks.centered_after_init(grads, nnx.state(self))
      if hint:
        raise ValueError(f'Optimizer.update: {hint}') from error
      raise


def centered_layers(model: nnx.Module) -> list[Centered]:
  """Every :class:`Centered` layer inside ``model``."""
  return [m for _, m in nnx.iter_modules(model) if isinstance(m, Centered)]


def _centered_paths(model: nnx.Module) -> list[tuple[tuple[Any, ...], Centered]]:
  return [(tuple(path), m) for path, m in nnx.iter_modules(model)
          if isinstance(m, Centered)]


def _layer_moves(
    model: nnx.Module, wrt: Any,
    shifts: Optional[Sequence[Any]] = None,
) -> list[_opt_state.LayerMove]:
  """The centered layers as the copies of an optimizer of ``wrt`` (the
  filter it trains) see them."""
  layers = _centered_paths(model)
  if not layers:
    return []
  trained = {tuple(path) for path, _ in
             nnx.to_flat_state(nnx.state(model, wrt))}
  shifts = shifts if shifts is not None else [None] * len(layers)
  moves = []
  for (path, layer), shift in zip(layers, shifts):
    moves.append(_opt_state.LayerMove(
        path=path, kernel_key=('layer', 'kernel'), bias_key=('layer', 'bias'),
        bias_shape=tuple(layer.layer.bias.shape),
        kernel=layer.layer.kernel[...],
        kernel_trained=path + ('layer', 'kernel') in trained,
        shift=shift))
  return moves


def _check_optimizer_state(model: nnx.Module, optimizer: nnx.Optimizer,
                           where: str) -> None:
  """Classifies the optimizer's state before anything is traced."""
  if not isinstance(optimizer, nnx.Optimizer):
    raise TypeError(
        f'{where}: optimizer must be an nnx.Optimizer (or '
        f'cbp_optax.nnx.Optimizer), got a {type(optimizer).__name__}.')
  moves = _layer_moves(model, optimizer.wrt)
  _opt_state.transport_state(optimizer.opt_state, moves,
                             what='optimizer.opt_state')


# The optimizers whose states the fused step classified (for which model).
_CLASSIFIED = _opt_state.CheckCache()


def transport(
    model: nnx.Module, mean_decay: Any = 0.99, *,
    optimizer: Optional[nnx.Optimizer] = None, opt_state: Any = None,
    decay: Any = None,
) -> Any:
  """Mean refresh and bias transport for every centered layer, in place.

  ``mu_new = mean_decay * mu + (1 - mean_decay) * batch_mean``, then
  ``b~ += W (mu_new - mu_old)`` with the current (updated) weights
  (Algorithm 1, steps 10-11), so the model's output is unchanged. Layer
  stacks are transported slice by slice. Call it after the optimizer update,
  inside the same ``nnx.jit`` -- or use :func:`train_step`, which does.

  Pass the ``optimizer`` whenever its state holds copies of the parameters
  (``optax.contrib.schedule_free``'s ``z``, SAM's cache, the initial point
  of DoG, Prodigy, MADGRAD, Mechanic or COCOB, or a state of your own
  declared with :func:`cbp_optax.centering.register_parameter_state`): each
  copy's biases then move by its own kernel, so that every function the
  optimizer holds (schedule-free's evaluation point included) is unchanged
  too. Gradient statistics (moments, momenta, M1's energies) are left as
  they are. A parameter-shaped tree in a state type the transport does not
  know is refused with a :class:`cbp_optax.centering.UnclassifiedStateError`.
  Without ``optimizer`` only the model moves.

  In the functional style (``nnx.split`` the model, ``tx.update`` on its
  ``nnx.Param`` state) pass that optax state as ``opt_state`` instead: its
  copies move the same way and the new state is returned. It must have been
  initialized on the whole ``nnx.Param`` state of ``model`` (a copy holding
  a centered bias without its kernel is refused).

  Args:
    model: any NNX module; layers that are not :class:`Centered` are ignored.
    mean_decay: the EMA decay ``rho`` of the means, in ``[0, 1)``.
    optimizer: the ``nnx.Optimizer`` training ``model``; its state's
      parameter copies are moved in place.
    opt_state: an optax state initialized on ``nnx.state(model, nnx.Param)``
      (or its ``nnx.as_pure`` arrays); exclusive with ``optimizer``.
    decay: deprecated name of ``mean_decay``.

  Returns:
    The transported ``opt_state`` when one is given; otherwise None.

  Raises:
    cbp_optax.centering.UnclassifiedStateError: (a ``TypeError``) the
      optimizer's state holds a parameter-shaped tree that is neither a
      registered copy nor a known statistic (before anything moves).

  Examples:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import cbp_optax as cbp
    >>> model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.relu,
    ...                        nnx.Linear(3, 1, rngs=nnx.Rngs(1)))
    >>> cbp.nnx.center(model).centered
    ['layers/0', 'layers/2']
    >>> x = jnp.array([[1.0, 2.0], [3.0, 4.0]])
    >>> before = model(x)  # training mode: records each layer's input mean
    >>> cbp.nnx.transport(model, mean_decay=0.5)
    >>> print(model.layers[0].mean[...])
    [1. 1.5]
    >>> bool(jnp.allclose(model(x), before, atol=1e-6))
    True

  References:
    Layerwise Conditioned Backpropagation: A Curvature-Aware Reparameterization
    of the Backward Pass with Convergence Guarantees,
    eq. (10) and Algorithm 1, steps 10-11.
  """
  mean_decay = _step.mean_decay_argument(mean_decay, decay, 'transport')
  if optimizer is not None and opt_state is not None:
    raise ValueError('transport: pass optimizer (an nnx.Optimizer) or '
                     'opt_state (a functional optax state), not both.')
  if optimizer is None and opt_state is None:
    for layer in centered_layers(model):
      layer.transport(mean_decay)
    return None
  if optimizer is not None:
    _check_optimizer_state(model, optimizer, 'transport')
    trained = optimizer.wrt
  else:
    trained = nnx.Param
    _opt_state.transport_state(opt_state, _layer_moves(model, trained),
                               what='opt_state')
  shifts = []
  for _, layer in _centered_paths(model):
    old = layer.mean[...]
    layer.transport(mean_decay)
    shifts.append(functools.partial(
        core.shift_bias, layer.spec, mean=old, new_mean=layer.mean[...],
        mask=getattr(layer.layer, 'mask', None),
        mean_stack_axes=layer.mean.get_metadata().get('stack_axes')))
  moves = _layer_moves(model, trained, shifts)
  if optimizer is not None:
    _opt_state.transport_state(optimizer.opt_state, moves,
                               what='optimizer.opt_state')
    return None
  return _opt_state.transport_state(opt_state, moves, what='opt_state')


def eval_model(model: nnx.Module,
               optimizer: Optional[nnx.Optimizer] = None) -> nnx.Module:
  """A copy of ``model`` to evaluate: in eval mode, at the evaluation point.

  Schedule-free optimizers train at one point and evaluate at another,
  ``x = (y - (1 - b1) z) / b1`` (``optax.contrib.schedule_free_eval_params``);
  with ``optimizer`` holding a ``schedule_free`` state, the copy has those
  parameters, with the model's centering means (both ``y`` and ``z`` were
  transported, so ``x`` is too). Otherwise it has the model's own. Either
  way the copy is in ``eval()`` mode (running averages, no dropout, no mean
  recording) and the model itself is left as it is. For a model with
  BatchNorm, whose running averages were gathered at ``y``, recalibrate the
  copy at ``x``: ``recalibrate_batch_stats(eval_model(model, optimizer),
  batches)``.

  Args:
    model: the trained model.
    optimizer: its optimizer (``nnx.Optimizer``), or None.

  Returns:
    A new module sharing no variable with ``model``.

  Raises:
    ValueError: an optimizer state with more than one ``schedule_free``
      state, or one that covers only part of the parameters.

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
    copy = nnx.clone(model)
    copy.eval()
    return copy
  graphdef, params, rest = nnx.split(model, optimizer.wrt, ...)
  params = _opt_state.evaluation_params(nnx.as_pure(optimizer.opt_state),
                                        nnx.as_pure(params))
  copy = nnx.merge(graphdef, params, nnx.as_pure(rest))
  copy.eval()
  return copy


def muon_dimension_numbers(model: nnx.Module) -> Callable[[Any], Any]:
  """Muon's ``muon_weight_dimension_numbers`` for every kernel of ``model``.

  ``optax.contrib.muon`` orthogonalizes 2-D matrices and sends every other
  parameter to AdamW unless told how to see a kernel as a matrix. This
  derives that from each linear layer's own configuration, centered or not:
  a dense kernel's contracted input axes are the reduction axes and its
  feature axes the output axes (``nnx.LinearGeneral`` and attention
  projections included); a convolution's window and input-channel axes are
  the reduction axes (the reshape of a kernel ``(h, w, c_in, c_out)`` to
  ``(h w c_in, c_out)``); the stack axes of a layer stack are batch axes
  (each slice is its own matrix). Biases, norms, embeddings and other
  parameters get None (AdamW).

  Args:
    model: the model (before or after :func:`center`).

  Returns:
    ``dims(params)``, a callable for ``optax.contrib.muon(...,
    muon_weight_dimension_numbers=dims)``, valid for the parameters
    ``nnx.state(model, nnx.Param)`` (with variables or as arrays).

  Examples:
    >>> import optax
    >>> from flax import nnx
    >>> import cbp_optax as cbp
    >>> model = nnx.Sequential(nnx.Conv(3, 4, (3, 3), rngs=nnx.Rngs(0)))
    >>> _ = cbp.nnx.center(model)
    >>> dims = cbp.nnx.muon_dimension_numbers(model)
    >>> dims(nnx.state(model, nnx.Param))['layers'][0]['layer']['kernel']
    MuonDimensionNumbers(reduction_axis=(0, 1, 2), output_axis=(3,))
    >>> optimizer = nnx.Optimizer(
    ...     model, optax.contrib.muon(1e-2, muon_weight_dimension_numbers=dims),
    ...     wrt=nnx.Param)
  """
  table = {}
  for path, module in nnx.iter_modules(model):
    path = tuple(path)
    if isinstance(module, Centered):
      layer = module.layer
      kernel = layer.kernel[...]
      _, axes, _ = core.layer_axes(
          module.spec, kernel, layer.bias[...], module.mean[...],
          module.mean.get_metadata().get('stack_axes'))
      table[_str_path(path + ('layer', 'kernel'))] = (
          core.muon_dimension_numbers(module.spec, axes))
    elif type(module) in _SPEC_OF and path[-1:] != ('layer',):
      spec = _plain_spec(module)
      axes = core.locate_stack_axes(tuple(module.kernel.shape),
                                    spec.kernel_shape)
      if axes is not None:
        table[_str_path(path + ('kernel',))] = core.muon_dimension_numbers(
            spec, axes)
  return _opt_state.dimension_numbers_fn(table)


def _str_path(path: Sequence[Any]) -> tuple[str, ...]:
  return tuple(str(p) for p in path)


def _plain_spec(layer: nnx.Module) -> core.LayerSpec:
  """A layer's spec without the checks centering needs (Muon needs none)."""
  if isinstance(layer, nnx.Conv):
    return core.conv_spec(layer.kernel_size, layer.in_features,
                          layer.out_features, layer.feature_group_count)
  if isinstance(layer, nnx.LinearGeneral):
    return core.dense_spec(layer.axis, layer.in_features, layer.out_features)
  return core.dense_spec(-1, (layer.in_features,), (layer.out_features,))


CenterReport = core.CenterReport


def _path_str(path: Sequence[Any]) -> str:
  return '/'.join(str(p) for p in path)


def _child(node: Any, key: Any) -> Any:
  if isinstance(node, nnx.Module) and isinstance(key, str):
    return getattr(node, key)
  return node[key]


def _set_child(node: Any, key: Any, value: Any) -> None:
  if isinstance(node, nnx.Module) and isinstance(key, str):
    setattr(node, key, value)
  else:
    node[key] = value


def _has_own_params(module: nnx.Module) -> bool:
  return any(isinstance(v, nnx.Param) for v in vars(module).values())


def _graph_paths(
    model: nnx.Module,
) -> tuple[dict[int, list[str]], dict[int, list[str]]]:
  """Every path to every module and to every Variable, by ``id``.

  A module reachable by two paths (one layer at two call sites, two
  attributes naming it) has two; so has a Variable two modules hold (tied
  weights, ``b.bias = a.bias``).
  """
  modules: dict[int, list[str]] = {}
  variables: dict[int, list[str]] = {}

  def walk(node, path, above):
    if isinstance(node, nnx.Module):
      modules.setdefault(id(node), []).append(_path_str(path))
    if isinstance(node, nnx.Variable):
      variables.setdefault(id(node), []).append(_path_str(path))
    if id(node) in above:
      return
    above = above | {id(node)}
    if isinstance(node, (list, tuple)):
      children = enumerate(node)
    elif isinstance(node, dict):
      children = node.items()
    elif (not isinstance(node, nnx.Variable)
          and graphlib.get_node_impl(node) is not None):
      children = graphlib.get_node_impl(node).node_dict(node).items()
    else:  # a Variable, an array
      return
    for key, child in children:
      if not (isinstance(key, str) and key.startswith('_pytree__')):
        walk(child, path + (key,), above)

  walk(model, (), frozenset())
  return modules, variables


def _check_not_shared(paths: list[str]) -> None:
  if len(paths) > 1:
    raise ValueError(
        f'center: one layer is reachable at {" and ".join(map(repr, paths))} '
        '(the same module object at two call sites or under two names). A '
        'shared layer sees two input distributions, and wrapping it at one '
        'path would leave the other path uncentered while the transport '
        'moves the shared bias, changing the function. Give each call site '
        'its own layer, or leave this one out with where=(e.g. where=lambda '
        f'path, layer: path not in {paths!r}).'
    )


def _check_bias_not_tied(
    name: str, layer: nnx.Module, variable_paths: dict[int, list[str]]
) -> None:
  """Refuses a layer whose bias Variable something else holds too.

  The transport moves the bias by ``W (mu_new - mu_old)`` (eq. 10), right
  for this layer only: any other holder of the same Variable (a second layer
  tied to it, a module reading it) would compute with a moved bias. A kernel
  may be tied: the transport never changes it.
  """
  paths = variable_paths.get(id(layer.bias), [])
  if len(paths) <= 1:
    return
  holders = sorted({p.rpartition('/')[0] or core.MODEL_PATH for p in paths})
  raise core.CannotCenterError(
      f'center: the bias of {name or core.MODEL_PATH!r} is one Variable held '
      f'at {" and ".join(map(repr, paths))} (tied, e.g. b.bias = a.bias). '
      'Centering moves a bias by its own layer\'s W (mu_new - mu_old) at '
      'every transport, which would change what every other holder computes. '
      'Give each layer its own bias (tying only the kernel is fine), or leave '
      f'every holder out: where=lambda path, layer: path not in {holders!r}.'
  )


def center(
    model: nnx.Module, *, where: core.Where = None,
    mean_dtype: Optional[Any] = None, axis_name: Optional[Any] = None,
) -> CenterReport:
  """Centers every supported linear layer of a built model, in place.

  Each ``nnx.Linear``, ``nnx.LinearGeneral`` and ``nnx.Conv`` (exact types,
  with a bias) is replaced by ``Centered(layer)`` wherever it sits: plain
  attributes, lists and dicts of layers, ``nnx.Sequential``, the q/k/v/out
  projections of ``nnx.MultiHeadAttention``, and layer stacks built with
  ``nnx.vmap``/``nnx.scan`` (one mean per slice). ``mu`` starts at zero, so
  the model computes exactly what it did before. Embeddings, norms and
  anything not linear in its input are left as they are; so are layers that
  are already centered.

  Args:
    model: the model; changed in place.
    where: which layers to center: None for all, a type or tuple of types,
      or ``where(path, layer) -> bool`` with ``path`` like
      ``'blocks/attn/query'``.
    mean_dtype: dtype of the means; the layer's ``param_dtype`` by default.
    axis_name: see :class:`Centered`.

  Returns:
    A :class:`CenterReport`: the paths centered, and every module with
    parameters that was not, with the reason.

  Raises:
    ValueError: ``model`` itself is a layer to center (it cannot be replaced
      in place: wrap it with :class:`Centered`), or one layer is reachable
      at two paths.
    cbp_optax.centering.CannotCenterError: (a ``ValueError``) a layer to
      center whose bias Variable is held elsewhere too (tied to another
      layer's). Nothing is changed when it raises.

  Examples:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import cbp_optax as cbp
    >>> class MLP(nnx.Module):
    ...   def __init__(self, rngs):
    ...     self.hidden = nnx.Linear(3, 4, rngs=rngs)
    ...     self.norm = nnx.LayerNorm(4, rngs=rngs)
    ...     self.out = nnx.Linear(4, 1, rngs=rngs)
    ...   def __call__(self, x):
    ...     return self.out(nnx.relu(self.norm(self.hidden(x))))
    >>> model = MLP(nnx.Rngs(0))
    >>> x = jnp.ones((8, 3))
    >>> before = model(x)
    >>> report = cbp.nnx.center(model)
    >>> report.centered
    ['hidden', 'out']
    >>> [path for path, reason in report.skipped]
    ['norm']
    >>> type(model.hidden).__name__, model.hidden.mean.shape
    ('Centered', (3,))
    >>> bool(jnp.array_equal(model(x), before))  # mu = 0: the same function
    True

  References:
    Layerwise Conditioned Backpropagation: A Curvature-Aware Reparameterization
    of the Backward Pass with Convergence Guarantees,
    §4.2, eq. (8).
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(
        f'center: model must be an nnx.Module, got {type(model).__name__}; '
        'for a Linen module use cbp_optax.linen.center.')
  where = core.check_where(where)
  if mean_dtype is not None:
    core.mean_dtype(mean_dtype, None)
  centered, skipped, chosen = [], [], []
  inside_centered = set()
  modules = list(nnx.iter_modules(model))
  module_paths, variable_paths = _graph_paths(model)
  for path, module in modules:
    if isinstance(module, Centered):
      inside_centered.add(tuple(path) + ('layer',))
      _check_bias_not_tied(_path_str(path), module.layer, variable_paths)
  for path, module in modules:
    name = _path_str(path)
    if isinstance(module, Centered) or tuple(path) in inside_centered:
      continue
    if not _has_own_params(module):
      continue
    try:
      layer_spec(module)
    except (TypeError, ValueError) as error:
      skipped.append((name or core.MODEL_PATH, core.skip_reason(module, error)))
      continue
    if not core.selected(where, name, module):
      skipped.append((name or core.MODEL_PATH, 'not selected by where'))
      continue
    _check_not_shared(module_paths.get(id(module), [name]))
    _check_bias_not_tied(name, module, variable_paths)
    if not path:
      raise ValueError(
          'center: the model itself is a linear layer and cannot be replaced '
          'in place; use cbp_optax.nnx.Centered(model) instead.'
      )
    chosen.append((path, module))
  # Every check first: a refused layer leaves the whole model as it was.
  wrapped = [(path, Centered(module, mean_dtype=mean_dtype,
                             axis_name=axis_name))
             for path, module in chosen]
  for path, layer in wrapped:
    parent = model
    for key in path[:-1]:
      parent = _child(parent, key)
    _set_child(parent, path[-1], layer)
    centered.append(_path_str(path))
  return CenterReport(centered=sorted(centered), skipped=sorted(skipped))


def stacked_blocks(
    model: nnx.Module, *stack_paths: str
) -> Callable[[Any, Any], bool]:
  """The ``stacked=`` predicate of ``cbp.cbp`` / ``cbp.equalize`` for ``model``.

  M1 (eq. 7) should see one block per layer of a layer stack, not one block
  for the whole stack. A stack's root is found from the centered layers in it
  (their means carry the stack's leading axis): the highest module above a
  stacked centered layer all of whose parameters share that leading axis.
  Name stack roots explicitly (``'blocks'``) for a model without centered
  layers, or to override.

  Args:
    model: the model (after :func:`center`, for automatic detection).
    *stack_paths: module paths of layer stacks, like ``'decoder/blocks'``.

  Returns:
    ``stacked(path, leaf) -> bool``, True for parameters inside a stack.

  Examples:
    Three layers built by ``nnx.vmap`` and one head: four M1 blocks.

    >>> import jax
    >>> from flax import nnx
    >>> import cbp_optax as cbp
    >>> @nnx.vmap(in_axes=0, out_axes=0)
    ... def make_layers(key):
    ...   return nnx.Linear(2, 2, rngs=nnx.Rngs(key))
    >>> class Stack(nnx.Module):
    ...   def __init__(self):
    ...     self.blocks = make_layers(jax.random.split(jax.random.key(0), 3))
    ...     self.head = nnx.Linear(2, 1, rngs=nnx.Rngs(1))
    >>> model = Stack()
    >>> cbp.nnx.center(model).centered
    ['blocks', 'head']
    >>> model.blocks.mean.shape  # one mean per layer of the stack
    (3, 2)
    >>> stacked = cbp.nnx.stacked_blocks(model)
    >>> stacked
    stacked_predicate(['blocks'])
    >>> cbp.block_names(nnx.state(model, nnx.Param), stacked=stacked)
    ('blocks/layer[0]', 'blocks/layer[1]', 'blocks/layer[2]', 'head/layer')
    >>> tx = cbp.cbp(1e-3, stacked=stacked)

  References:
    Layerwise Conditioned Backpropagation: A Curvature-Aware Reparameterization
    of the Backward Pass with Convergence Guarantees,
    eq. (7).
  """
  params = nnx.state(model, nnx.Param)
  shapes = {
      tuple(str(blocks.key_name(k)) for k in path): tuple(jnp.shape(leaf))
      for path, leaf in jax.tree_util.tree_leaves_with_path(params)
  }
  roots = blocks.check_stack_paths(shapes, stack_paths)
  if not stack_paths:
    stacks, unstacked = [], []
    for path, module in nnx.iter_modules(model):
      path = tuple(str(p) for p in path)
      if isinstance(module, Centered):
        axes = core.locate_stack_axes(
            module.mean.shape, module.spec.mean_shape,
            module.mean.get_metadata().get('stack_axes'))
        if axes and axes[0] == 0:
          stacks.append((path, module.mean.shape[0]))
        elif not axes:
          unstacked.append(path)
      elif type(module) in _SPEC_OF and path[-1:] != ('layer',):
        try:
          spec = layer_spec(module)
        except (TypeError, ValueError):
          continue
        if tuple(module.kernel.shape) == spec.kernel_shape:
          unstacked.append(path)
    for path, size in stacks:
      roots.add(blocks.stack_root(shapes, path, size, unstacked))
  return blocks.stacked_predicate(roots)


def _graph_nodes(tree: Any) -> list[Any]:
  return [x for x in jax.tree.leaves(tree, is_leaf=graphlib.is_graph_node)
          if graphlib.is_graph_node(x)]


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Slot:
  """Where a graph-node argument sat in a step's ``args`` (static)."""

  index: int


def _slots(args: Any, nodes: list[Any]) -> Any:
  index = {id(node): i for i, node in enumerate(nodes)}
  return jax.tree.map(
      lambda x: _Slot(index[id(x)]) if graphlib.is_graph_node(x) else x,
      args, is_leaf=graphlib.is_graph_node)


def _fill_slots(slotted: Any, nodes: Sequence[Any]) -> Any:
  return jax.tree.map(
      lambda x: nodes[x.index] if isinstance(x, _Slot) else x, slotted,
      is_leaf=lambda x: isinstance(x, _Slot))


def _check_step_arguments(model: Any, optimizer: Any) -> None:
  if isinstance(model, nnx.Optimizer) and not isinstance(
      optimizer, nnx.Optimizer):
    raise TypeError(
        'train_step: step(model, optimizer, *args) got the optimizer first '
        f'and a {type(optimizer).__name__} second: pass the model first, '
        'then the optimizer.'
    )
  if not isinstance(optimizer, nnx.Optimizer):
    raise TypeError(
        'train_step: step(model, optimizer, *args) takes an nnx.Optimizer '
        f'(or cbp_optax.nnx.Optimizer) second, got a '
        f'{type(optimizer).__name__}.'
    )


def _check_training_mode(model: nnx.Module) -> None:
  evaluating = [_path_str(p) for p, m in nnx.iter_modules(model)
                if isinstance(m, Centered) and m.use_running_average]
  if evaluating:
    raise ValueError(
        'train_step: the model is in evaluation mode (centered layers '
        f'{evaluating[:3]} record no batch mean, so the transport would move '
        'mu toward a stale one). Call model.train() before training.'
    )


def _check_has_params(params: nnx.State, optimizer: nnx.Optimizer) -> None:
  if 0 not in params:
    raise ValueError(
        'train_step: the model has no variable the optimizer trains (its '
        f'wrt filter is {optimizer.wrt!r}); there are no gradients to take. '
        'Give the model parameters (nnx.Param), or build the optimizer with '
        'wrt= naming the variables to train.'
    )


def _select(ok: jax.Array, apply_step: Callable[..., None],
            skip_step: Callable[..., None], *operands: Any) -> None:
  """``nnx.cond(ok, apply_step, skip_step, *operands)`` as a select.

  Runs both in-place steps on the graph nodes among ``operands`` (from the
  same starting state) and keeps, leaf by leaf, the state of the one ``ok``
  chooses: :func:`cbp_optax._step.select` for graph nodes.
  """
  nodes = _graph_nodes(operands)
  start = nnx.as_pure(nnx.state(nodes))
  apply_step(*operands)
  applied = nnx.as_pure(nnx.state(nodes))
  nnx.update(nodes, start)
  skip_step(*operands)
  skipped = nnx.as_pure(nnx.state(nodes))
  nnx.update(nodes, _step.select_leaves(ok, applied, skipped))


def train_step(
    loss_fn: Callable[..., Any], *, mean_decay: Any = 0.99,
    donate: bool = True, decay: Any = None,
) -> Callable[..., StepOutput]:
  """One jit-compiled CBP iteration for an NNX model (Algorithm 1, steps 1-11).

  The returned ``step(model, optimizer, *args)`` runs ``loss_fn(model,
  *args)`` (the forward pass with centering, recording batch means), the
  backward pass, ``optimizer.update`` with whatever optax transform the
  ``nnx.Optimizer`` holds (``cbp.cbp`` for full CBP, ``optax.adam`` for
  "Adam + Center", ``optax.contrib.schedule_free_adamw``, Muon, ...), then
  :func:`transport` of the model and of the optimizer state's copies of the
  parameters (schedule-free's ``z``, ...); all in one compiled program with
  the model and optimizer buffers donated. Calling ``step`` inside your own
  ``@nnx.jit`` train step works too (the tutorials' pattern: metrics, EMA
  or logging beside it): it is then traced into your program, with the same
  numbers, bit for bit; keep the ``donate_argnums`` you want on your own
  jit.

  ``args`` may hold anything a plain ``nnx.jit`` train step takes: arrays,
  ``nnx.Rngs`` (dropout keys), other modules or graph nodes. Every state the
  forward pass changes (BatchNorm statistics, RNG counts, the recorded
  means, state in graph-node arguments) is updated exactly as a plain
  ``nnx.jit`` step would. If the loss, any gradient or any recorded
  statistic is not finite the step is skipped: parameters, optimizer state,
  centering and batch statistics and RNG counts stay exactly as they were,
  ``StepOutput.skipped`` is True, and a :class:`Optimizer` counts it in
  ``skipped_steps``. With no centered layer it is an ordinary train step.
  Called directly on CPU, the step compiles with XLA's
  ``xla_cpu_copy_insertion_use_region_analysis`` (no parameter-sized buffer
  copies); ``step.lower(model, optimizer, *args)`` gives the lowered
  program.

  Args:
    loss_fn: ``loss_fn(model, *args)`` returning a scalar loss or ``(loss,
      aux)``; the model must be in training mode (``model.train()``).
    mean_decay: the EMA decay ``rho`` of the centering means, in ``[0, 1)``.
    donate: donate the model and optimizer buffers to the step.
    decay: deprecated name of ``mean_decay``.

  Returns:
    ``step(model, optimizer, *args) -> StepOutput``; the model, optimizer
    and graph-node arguments are updated in place.

  Raises:
    ValueError: a ``mean_decay`` outside ``[0, 1)`` (at construction); a
      model whose centered layers are in evaluation mode (at the call).
    TypeError: ``step(optimizer, model, ...)``, or a second argument that is
      not an ``nnx.Optimizer`` (at the call); an optimizer state the
      transport cannot classify
      (:class:`cbp_optax.centering.UnclassifiedStateError`, at the call,
      before tracing).

  Examples:
    Full CBP on a centered two-layer model:

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import cbp_optax as cbp
    >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.relu,
    ...                        nnx.Linear(4, 1, rngs=nnx.Rngs(1)))
    >>> _ = cbp.nnx.center(model)
    >>> optimizer = cbp.nnx.Optimizer(model, cbp.cbp(1e-3))
    >>> def loss_fn(model, x, y):
    ...   return jnp.mean((model(x) - y) ** 2)
    >>> step = cbp.nnx.train_step(loss_fn, mean_decay=0.99)
    >>> x, y = jnp.ones((8, 3)), jnp.zeros((8, 1))
    >>> out = step(model, optimizer, x, y)
    >>> out.loss.shape, out.loss.dtype, bool(out.skipped)
    ((), dtype('float32'), False)
    >>> int(optimizer.step[...])
    1
    >>> print(model.layers[0].mean[...])  # 0.99 * 0 + 0.01 * mean(x)
    [0.01 0.01 0.01]

  References:
    Layerwise Conditioned Backpropagation: A Curvature-Aware Reparameterization
    of the Backward Pass with Convergence Guarantees,
    Algorithm 1.
  """
  mean_decay = _step.mean_decay_argument(mean_decay, decay, 'train_step')
  _checks.check_function('loss_fn', loss_fn)
  _checks.check_bool('donate', donate)

  def step(model, optimizer, *args):
    _check_training_mode(model)
    nodes = _graph_nodes(args)
    # Split the model with the graph-node arguments, so that references
    # shared between them (an Rngs held by both) stay shared, but
    # differentiate the model's own parameters only: their paths are those
    # the optimizer was initialized with.
    graphdef, params, rest = nnx.split((model, nodes), optimizer.wrt, ...)
    _check_has_params(params, optimizer)
    node_params = {k: v for k, v in params.items() if k != 0}
    rest = nnx.as_pure(rest)

    def loss_of(model_params):
      # A pure function of the parameters, so it differentiates the same way
      # in graph and tree mode. Merging builds fresh Variables at this trace
      # level (from arrays for `rest`), which the forward pass may write
      # statistics and RNG counts into.
      inner_model, inner_nodes = nnx.merge(
          graphdef, nnx.State({0: model_params, **node_params}), rest)
      swap = dict(zip(map(id, nodes), inner_nodes))
      inner_args = jax.tree.map(lambda x: swap.get(id(x), x), args,
                                is_leaf=graphlib.is_graph_node)
      loss, aux = _step.split_loss(loss_fn(inner_model, *inner_args))
      _step.check_scalar_loss(loss)
      changed = nnx.state((inner_model, inner_nodes), nnx.Not(optimizer.wrt))
      return loss, (aux, changed)

    def apply_step(model, optimizer, nodes, grads, changed):
      nnx.update((model, nodes), changed)
      optimizer.update(model, grads)
      transport(model, mean_decay, optimizer=optimizer)

    def skip_step(model, optimizer, nodes, grads, changed):
      del model, nodes, grads, changed
      if isinstance(optimizer, Optimizer):
        optimizer.skipped_steps[...] += 1

    _, out = _step.conditioned_update(
        loss_of, params[0], apply_step, skip_step, _select,
        model, optimizer, nodes)
    return out

  def pure_step(graphdef, state, slotted_args):
    model, optimizer, nodes = nnx.merge(graphdef, state)
    out = step(model, optimizer, *_fill_slots(slotted_args, nodes))
    return nnx.state((model, optimizer, nodes)), out

  jitted = _step.jit_step(pure_step, static_argnums=(0,),
                          donate_argnums=(1,) if donate else ())

  def train(*args):
    if len(args) < 2:
      raise TypeError(
          'train_step: step(model, optimizer, *args) takes the model and the '
          f'optimizer first, got {len(args)} argument(s).')
    model, optimizer, *args = args
    _check_step_arguments(model, optimizer)
    _CLASSIFIED.check(
        optimizer, (id(model), id(optimizer.tx)),
        lambda: _check_optimizer_state(model, optimizer, 'train_step'))
    nodes = _graph_nodes(args)
    graphdef, state = nnx.split((model, optimizer, nodes))
    if donate:
      state = _step.unaliased(state)
    try:
      new_state, out = jitted(graphdef, state, _slots(args, nodes))
    except (TypeError, ValueError) as error:
      hint = blocks.centered_after_init(nnx.state(model, optimizer.wrt),
                                        nnx.state(optimizer))
      if hint:
        raise ValueError(f'train_step: {hint}') from error
      raise
    nnx.update((model, optimizer, nodes), new_state)
    return out

  # The same step under nnx.jit, for inspecting the program:
  # step.lower(model, optimizer, *args).compile(options).
  train.lower = nnx.jit(step, donate_argnums=(0, 1) if donate else ()).lower
  return train


def _norm_layers(model: nnx.Module) -> list[tuple[str, nnx.BatchNorm]]:
  return [(_path_str(p), m) for p, m in nnx.iter_modules(model)
          if isinstance(m, nnx.BatchNorm)]


def _call_model(model: nnx.Module, batch: Any) -> Any:
  return model(*_batch_stats.as_args(batch))


# How many positions, and in how many calls, a BatchNorm of the throw-away
# copy has normalized so far in one batch (attributes of the copy only).
_COUNT, _CALLS = 'cbp_recalibration_count', 'cbp_recalibration_calls'


_POOLING_TYPES: dict[type, type] = {}


def _pooling_type(norm_type: type) -> type:
  """``norm_type`` whose every call's moments are pooled (for a copy).

  The layer normalizes with its batch's statistics, as in training,
  whatever its flags; its ``mean`` and ``var`` accumulate the moments of
  every call of the forward pass, weighted by the positions each call
  normalized (a layer applied twice counts both inputs). A subclass, not a
  wrapper, so that paths, attributes and layer stacks stay as they are.
  """
  if norm_type in _POOLING_TYPES:
    return _POOLING_TYPES[norm_type]

  def __call__(self, x, use_running_average=None, *, mask=None, **kwargs):
    del use_running_average
    call = _batch_stats.moments(
        x, self.axis, mask=mask, axis_name=self.axis_name,
        axis_index_groups=self.axis_index_groups)
    so_far = _batch_stats.Moments(
        getattr(self, _COUNT)[...], self.mean[...], self.var[...],
        getattr(self, _CALLS)[...])
    out = norm_type.__call__(self, x, use_running_average=False, mask=mask,
                             **kwargs)
    pooled = _batch_stats.combine(so_far, call)
    getattr(self, _COUNT)[...] = pooled.count
    getattr(self, _CALLS)[...] = pooled.calls
    self.mean[...], self.var[...] = pooled.mean, pooled.var
    return out

  # No mixin base: CPython allows __class__ assignment to a plain subclass.
  pooling = type(f'_Pooling{norm_type.__name__}', (norm_type,),
                 {'__call__': __call__, '__module__': __name__})
  _POOLING_TYPES[norm_type] = pooling
  return pooling


def recalibrate_batch_stats(
    model: nnx.Module, batches: Iterable[Any], *,
    forward: Optional[Callable[[nnx.Module, Any], Any]] = None,
) -> list[str]:
  """Sets every BatchNorm's running averages to population statistics.

  "Precise BatchNorm": the parameters frozen, each ``nnx.BatchNorm``'s
  running mean and variance become the mean and the (biased) variance of
  all its inputs over ``batches``, pooled (the variance of the pooled
  inputs, not an average of batch variances), instead of an EMA over a
  network that kept changing. Every call counts: a BatchNorm applied
  several times in one forward pass pools all its inputs, and each call is
  weighted by the positions it normalized (the product of its reduced axes'
  sizes, or its mask's sum), so time-major batches weigh what they hold and
  an empty batch weighs nothing. Each BatchNorm sees what it sees in
  training: it normalizes with its batch's statistics (whatever
  ``use_running_average`` it is given); dropout is off, centered layers
  record nothing. Nothing else in the model changes (parameters, centering
  means, RNG state); layer stacks (``nnx.vmap``/``nnx.scan``) get per-slice
  statistics. Use it before evaluating with running averages after a short
  run, a large learning rate, or a BatchNorm momentum close to 1, where
  they lag the network; a few dozen training batches suffice.

  Args:
    model: the model (centered or not); its BatchNorm statistics are set in
      place.
    batches: an iterable of training batches, each an array or a tuple of
      positional arguments of ``model``.
    forward: ``forward(model, batch)`` runs the model on one batch (for
      batches that hold labels or keyword arguments); by default
      ``model(*batch)``.

  Returns:
    The paths of the BatchNorm layers recalibrated: all those the forward
    pass calls (one it never calls keeps its statistics).

  Raises:
    ValueError: a model without ``nnx.BatchNorm``, no batches, a BatchNorm
      that normalized no example in any batch (all empty), or statistics
      that are not finite; the model is then left as it was.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import cbp_optax as cbp
    >>> model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)),
    ...                        nnx.BatchNorm(3, rngs=nnx.Rngs(0)))
    >>> batches = [jnp.ones((4, 2)), jnp.zeros((4, 2))]
    >>> cbp.nnx.recalibrate_batch_stats(model, batches)
    ['layers/1']
    >>> outputs = model.layers[0](jnp.concatenate(batches))  # the BN input
    >>> bool(jnp.allclose(model.layers[1].mean[...], outputs.mean(0)))
    True
    >>> bool(jnp.allclose(model.layers[1].var[...], outputs.var(0)))
    True
  """
  norms = _norm_layers(model)
  if not norms:
    raise ValueError(
        'recalibrate_batch_stats: the model has no nnx.BatchNorm layer.')
  forward = forward or _call_model
  graphdef, state = nnx.split(model)

  @jax.jit
  def batch_moments(state, batch):
    copy = nnx.view(nnx.merge(graphdef, state), deterministic=True,
                    use_running_average=True, raise_if_not_found=False)
    for _, norm in _norm_layers(copy):
      # The copy is thrown away: its BatchNorms become pooling ones, their
      # statistics the accumulators (a count beside them, stacked alike).
      norm.__class__ = _pooling_type(type(norm))
      empty = _batch_stats.empty_like(norm.mean[...], norm.var[...])
      setattr(norm, _COUNT, norm.mean.replace(empty.count))
      setattr(norm, _CALLS, norm.mean.replace(empty.calls))
      norm.mean[...], norm.var[...] = empty.mean, empty.var
    forward(copy, batch)
    return {p: _batch_stats.Moments(getattr(n, _COUNT)[...], n.mean[...],
                                    n.var[...], getattr(n, _CALLS)[...])
            for p, n in _norm_layers(copy)}

  stats = _batch_stats.finish(_batch_stats.pool(
      batch_moments(state, batch) for batch in batches))
  for path, norm in norms:
    if path in stats:
      mean, var = stats[path]
      norm.mean[...] = mean.astype(norm.mean.dtype)
      norm.var[...] = var.astype(norm.var.dtype)
  return [path for path, _ in norms if path in stats]
