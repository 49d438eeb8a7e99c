"""NNX ``Centered``: ``z = W (a - mu) + b~`` (eq. 8) for Linear, LinearGeneral,
Conv and ConvTranspose layers, layer stacks included."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from cbp_optax import _checks
from cbp_optax import _untransported
from cbp_optax import centering as core
from cbp_optax._stacks import resolve_stack_axes

# AMBIGUOUS_STACK_REMEDY in NNX's words.
_STACK_REMEDY = (
    'Record where the stack axis is: create the Centered layers inside the '
    'nnx.vmap / nnx.scan with transform_metadata={nnx.PARTITION_NAME: '
    "'layers'} (their means then track the axis), or wrap a layer stacked "
    'beforehand with cbp.nnx.Centered(layer, stack_axes=...) (the kernel '
    'axes that are stack axes) before cbp.nnx.center.'
)


class _StackTracked(nnx.BatchStat):
  """A statistic whose ``stack_axes`` metadata follows NNX's ``add_axis``
  (under a ``transform_metadata`` partition name); else found from shapes."""

  def add_axis(self, axis_index, axis_name):
    axes = self.get_metadata().get('stack_axes') or ()
    moved = tuple(a + 1 if a >= axis_index else a for a in axes)
    self.set_metadata(stack_axes=tuple(sorted(moved + (axis_index,))))

  def remove_axis(self, axis_index, axis_name):
    axes = self.get_metadata().get('stack_axes') or ()
    self.set_metadata(stack_axes=tuple(
        a - 1 if a > axis_index else a for a in axes if a != axis_index))


class CenteringMean(_untransported.MarksTransport, _StackTracked):
  """The EMA ``mu`` a centered layer subtracts from its input (eq. 8)."""


class RecordedMean(_StackTracked):
  """The mean of the training inputs since the last :func:`transport`."""


class RecordedCount(_untransported.CountWrites, _StackTracked):
  """Input positions :class:`RecordedMean` averages: ``mu``'s shape with
  feature axes 1, so each call weighs by the positions it saw."""


class TransportResidual(_StackTracked):
  """A 16-bit bias's float32 transport residual (``needs_bias_residual``)."""


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


def _conv_transpose_spec(layer: nnx.ConvTranspose) -> core.LayerSpec:
  core.check_centerable(type(layer), use_bias=layer.use_bias,
                        transposed_strides=layer.strides)
  return core.conv_spec(layer.kernel_size, layer.in_features,
                        layer.out_features, 1, layer.transpose_kernel)


# Exact types only: a subclass may override __call__ and change the maths.
SPEC_OF = {
    nnx.Linear: _linear_spec,
    nnx.LinearGeneral: _linear_general_spec,
    nnx.Conv: _conv_spec,
    nnx.ConvTranspose: _conv_transpose_spec,
}


def layer_spec(layer: nnx.Module) -> core.LayerSpec:
  """The :class:`~cbp_optax.centering.LayerSpec` of a layer (TypeError for an
  unknown type, CannotCenterError for an inexact configuration)."""
  spec_of = SPEC_OF.get(type(layer))
  if spec_of is None:
    raise core.unsupported_layer_error(type(layer), tuple(SPEC_OF))
  return spec_of(layer)


def _given_stack_axes(
    name: str, given: Sequence[int], kernel_shape: tuple[int, ...],
    spec: core.LayerSpec,
) -> tuple[int, ...]:
  """``Centered(stack_axes=given)`` as sorted non-negative axes, or why not."""
  ndim = len(kernel_shape)
  axes = tuple(sorted(
      a % ndim for a in given
      if isinstance(a, int) and not isinstance(a, bool) and -ndim <= a < ndim))
  placements = core.stack_axes_placements(kernel_shape, spec.kernel_shape)
  if len(axes) != len(tuple(given)) or axes not in placements:
    raise ValueError(
        f'{name}: stack_axes={given!r} does not fit: the kernel of shape '
        f'{kernel_shape} is {spec.kernel_shape} with stack axes at '
        f'{placements or "no placement"}.')
  return axes


def _stacked_shape(
    layer: nnx.Module, spec: core.LayerSpec,
    stack_axes: Optional[Sequence[int]] = None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """Shape and stack axes of ``mu`` for a layer that may already be stacked."""
  kernel_shape = tuple(layer.kernel.shape)
  name = type(layer).__name__
  if stack_axes is not None:
    stack_axes = _given_stack_axes(name, stack_axes, kernel_shape, spec)
  axes = resolve_stack_axes(
      kernel_shape, spec.kernel_shape, stack_axes,
      not_found=lambda: (
          f'{name}: kernel shape {kernel_shape} is not '
          f'{spec.kernel_shape} with stack axes added.'),
      ambiguous=lambda placements: (
          f'{name}: the kernel of shape {kernel_shape} is '
          f'{spec.kernel_shape} stacked along any of the axes {placements}; '
          'the shapes cannot tell which (a stack as long as a feature size), '
          'and a wrong guess would change the function at the first '
          'transport. ' + _STACK_REMEDY))
  shape = list(spec.mean_shape)
  for axis in axes:
    shape.insert(min(axis, len(shape)), kernel_shape[axis])
  mean_axes = tuple(
      min(a, len(spec.mean_shape) + i) for i, a in enumerate(axes))
  return tuple(shape), mean_axes


class Centered(nnx.Module):
  """A linear layer reparameterized as ``z = W (a - mu) + b~`` (paper eq. 8).

  ``mu`` starts at zero. In training the forward pass records its input's
  batch mean, pooled over calls (``batch_count``; 1,000 calls without a
  transport warn, :class:`cbp_optax.centering.UntransportedWarning`), which
  :func:`transport` moves ``mu`` to. A convolution runs as the plain layer
  minus ``centering.mean_correction`` (eq. 9).

  Args:
    layer: an ``nnx.Linear``, ``nnx.LinearGeneral`` (without batch axes),
      ``nnx.Conv`` (without input dilation) or ``nnx.ConvTranspose`` (with
      strides 1), with a bias. Exact types only.
    use_running_average: True stops recording batch means (evaluation).
    mean_dtype: dtype of ``mu``; defaults to the layer's ``param_dtype``.
    axis_name: the mapped batch axis (``shard_map``/``pmap``/``vmap``) to
      average the recorded mean over.
    stack_axes: a pre-stacked layer's kernel stack axes, where the shapes
      cannot tell (``(1,)`` for ``nnx.vmap(..., out_axes=1)``).

  Raises:
    TypeError: for any other layer type, subclasses included.
    cbp_optax.centering.CannotCenterError: (a ``ValueError``) for a layer
      without bias, with input dilation, with kernel batch axes or a
      strided transposed convolution.

  Examples:
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
    Layerwise Conditioned Backpropagation, §4.2, eqs. (8) and (9).
  """

  def __init__(
      self, layer: nnx.Module, *, use_running_average: bool = False,
      mean_dtype: Optional[Any] = None, axis_name: Optional[Any] = None,
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
    key = _untransported.LayerKey()
    self.mean = CenteringMean(jnp.zeros(shape, dtype), stack_axes=stack_axes,
                              untransported=key)
    self.batch_mean = RecordedMean(jnp.zeros(shape, dtype),
                                   stack_axes=stack_axes)
    self.batch_count = RecordedCount(core.zero_count(shape, dtype, stack_axes),
                                     stack_axes=stack_axes, untransported=key)
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
      new = core.record(layer_state(self), inputs, self.axis_name)
      self.batch_mean[...], self.batch_count[...] = new.recorded, new.count
    return core.centered_output(
        self.spec, lambda x: self.layer(x, *args, **kwargs), inputs,
        self._kernel, self.mean[...])

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
    """The uncentered layer's equivalent bias, ``b~ - W mu`` (read-only), for
    modules that read ``x @ kernel + bias`` (the trained ``b~`` is ``layer.bias``)."""
    correction = core.mean_correction(self.spec, self._kernel(),
                                      self.mean[...])
    bias = self.layer.bias[...]
    return bias - correction.astype(bias.dtype)

  def transport(self, mean_decay: Any = 0.99) -> None:
    """Refreshes ``mu`` and shifts this layer's own bias (eq. 10)."""
    _checks.check_mean_decay(mean_decay)
    transport_layer(self, mean_decay)

  def restart_recording(self) -> None:
    """Starts a fresh recorded mean: the next training call overwrites it."""
    self.batch_count[...] = jnp.zeros_like(self.batch_count[...])


def layer_state(layer: Centered) -> core.LayerState:
  """``layer``'s variables, for the core."""
  residual = getattr(layer, 'bias_residual', None)
  return core.LayerState(
      layer.spec, layer.layer.kernel[...], layer.layer.bias[...],
      layer.mean[...], layer.batch_mean[...], layer.batch_count[...],
      getattr(layer.layer, 'mask', None),
      layer.mean.get_metadata().get('stack_axes'),
      None if residual is None else residual[...])


def transport_layer(layer: Centered, mean_decay: Any,
                    recorded_only: bool = True) -> Any:
  """:meth:`Centered.transport` for a validated ``mean_decay``; returns
  the shift of the optimizer's parameter copies (``core.copy_shift``)."""
  old = layer_state(layer)
  new = core.refresh(old, mean_decay, recorded_only, _STACK_REMEDY)
  layer.layer.bias[...], layer.mean[...] = new.bias, new.mean
  layer.restart_recording()
  if new.residual is not None:
    layer.bias_residual[...] = new.residual
  return core.copy_shift(old, new)
