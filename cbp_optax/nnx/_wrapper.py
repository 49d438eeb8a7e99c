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

# AMBIGUOUS_STACK_REMEDY in NNX's words.
_STACK_REMEDY = (
    'Create the Centered layers inside nnx.vmap / nnx.scan with '
    "transform_metadata={nnx.PARTITION_NAME: 'layers'}, or wrap the stacked "
    'layer as cbp.nnx.Centered(layer, stack_axes=...) before center.')


class _StackTracked(nnx.BatchStat):
  """A statistic whose ``stack_axes`` metadata follows NNX's ``add_axis``
  (under a ``transform_metadata`` partition name); else found from shapes."""

  def add_axis(self, axis_index, axis_name):
    self.set_metadata(stack_axes=core.added_stack_axis(
        self.get_metadata().get('stack_axes'), axis_index))

  def remove_axis(self, axis_index, axis_name):
    self.set_metadata(stack_axes=core.removed_stack_axis(
        self.get_metadata().get('stack_axes'), axis_index))


class CenteringMean(_untransported.MarksTransport, _StackTracked):
  """The EMA ``mu`` a centered layer subtracts from its input (eq. 8)."""


class RecordedMean(_StackTracked):
  """The mean of the training inputs since the last :func:`transport`."""


class RecordedCount(_untransported.CountWrites, _StackTracked):
  """Input positions :class:`RecordedMean` averages: ``mu``'s shape with
  feature axes 1, so each call weighs by the positions it saw."""


class TransportResidual(_StackTracked):
  """A 16-bit bias's float32 transport residual (``needs_bias_residual``)."""


# Exact types only: a subclass may override __call__ and change the maths.
SUPPORTED = (nnx.Linear, nnx.LinearGeneral, nnx.Conv, nnx.ConvTranspose)


def layer_spec(layer: nnx.Module, check: bool = True) -> core.LayerSpec:
  """The :class:`~cbp_optax.centering.LayerSpec` of a layer; with ``check``
  (Muon needs none), TypeError for an unknown type and CannotCenterError for
  an inexact configuration."""
  if check:
    core.check_layer(layer, SUPPORTED,
                     transposed=isinstance(layer, nnx.ConvTranspose),
                     batch_axes=dict(getattr(layer, 'batch_axis', {})))
  if isinstance(layer, (nnx.Conv, nnx.ConvTranspose)):
    return core.conv_spec(layer.kernel_size, layer.in_features,
                          layer.out_features,
                          getattr(layer, 'feature_group_count', 1),
                          getattr(layer, 'transpose_kernel', False))
  if isinstance(layer, nnx.LinearGeneral):
    return core.dense_spec(layer.axis, layer.in_features, layer.out_features)
  return core.dense_spec(-1, (layer.in_features,), (layer.out_features,))


class Centered(nnx.Module):
  """A linear layer reparameterized as ``z = W (a - mu) + b~`` (paper eq. 8).

  ``mu`` starts at zero. In training the forward pass records its input's mean,
  pooled over calls (``batch_count``; 1,000 calls without a transport warn:
  :class:`cbp_optax.centering.UntransportedWarning`), to which :func:`transport`
  moves ``mu``. A convolution runs as the plain layer minus ``W mu`` (eq. 9).

  Args:
    layer: an ``nnx.Linear``, ``nnx.LinearGeneral`` (no batch axes),
      ``nnx.Conv`` (no input dilation) or ``nnx.ConvTranspose`` (strides 1),
      with a bias; exact types only (TypeError, or
      :class:`cbp_optax.centering.CannotCenterError`, otherwise).
    use_running_average: True stops recording (evaluation).
    mean_dtype: dtype of ``mu``; defaults to the layer's ``param_dtype``.
    axis_name: the mapped batch axis (``shard_map``/``pmap``/``vmap``) to
      average the recorded mean over.
    stack_axes: a pre-stacked layer's kernel stack axes, where the shapes
      cannot tell (``(1,)`` for ``nnx.vmap(..., out_axes=1)``).

  Examples:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import cbp_optax as cbp
    >>> layer = cbp.nnx.Centered(nnx.Linear(2, 1, rngs=nnx.Rngs(0)))
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
  def __init__(self, layer: nnx.Module, *, use_running_average: bool = False,
               mean_dtype: Optional[Any] = None,
               axis_name: Optional[Any] = None,
               stack_axes: Optional[Sequence[int]] = None):
    _checks.check_bool('use_running_average', use_running_average)
    spec = layer_spec(layer)
    zero = core.zero_state(spec, core.mean_dtype(mean_dtype, layer.param_dtype),
                           layer.bias, layer.kernel.shape, stack_axes,
                           _STACK_REMEDY)
    self.layer = layer
    self.spec = spec
    self.use_running_average = use_running_average
    self.axis_name = axis_name
    axes, key = zero.stack_axes, _untransported.LayerKey()
    self.mean = CenteringMean(zero.mean, stack_axes=axes, untransported=key)
    self.batch_mean = RecordedMean(zero.recorded, stack_axes=axes)
    self.batch_count = RecordedCount(zero.count, stack_axes=axes,
                                     untransported=key)
    if zero.residual is not None:
      self.bias_residual = TransportResidual(zero.residual)

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
