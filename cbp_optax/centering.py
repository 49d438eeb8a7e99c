"""M2: the activation-centering reparameterization, framework-independent math.

A centered linear layer computes ``z = W (a - mu) + b~`` (eq. 8). ``mu`` is an
EMA of the layer's input mean; when it moves, the bias is transported,
``b~ <- b~ + W (mu_new - mu_old)`` (eq. 10), so that the represented function is
unchanged. The Flax wrappers in ``cbp_optax.nnx`` and ``cbp_optax.linen`` call
these functions; they hold no state of their own.

Convolutions with zero padding are centered *after* padding: ``mu`` is
subtracted everywhere in the padded input, the border included, so that every
output position sees a full window of ``-mu`` shifts and the transport is exact
at the border too. That centered convolution is never formed explicitly: since
``pad(a) - mu`` is ``pad(a)`` minus a constant image, and a convolution of a
constant image is the same at every output position,

  ``conv_valid(pad(a) - mu) = conv(a) - (sum over the window of W) . mu``

(:func:`conv_mean_correction`). The wrappers run the layer as it is, on the
raw input with its own padding (so XLA sees the plain layer's convolution and
its gradients), and subtract a per-output-channel constant. The same holds for
wrap and reflect padding, which commute with the shift. Gradients are those of
the centered layer: ``dW = (pad(a) - mu)^T delta`` (eq. 9) arrives as
``pad(a)^T delta`` minus ``mu`` times the summed ``delta`` at every window tap.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp
from jax import lax

def normalize_axes(axes: Union[int, Sequence[int]], ndim: int) -> tuple[int, ...]:
  if isinstance(axes, int):
    axes = (axes,)
  return tuple(a % ndim for a in axes)


def batch_mean(
    inputs: jax.Array,
    feature_axes: Sequence[int],
    dtype: Any,
    axis_name: Optional[Any] = None,
) -> jax.Array:
  """Mean of ``inputs`` over every axis but ``feature_axes``, in their order.

  For a dense layer the feature axes are the contracted ones, so the mean is
  per input feature; for a convolution it is the channel axis, and the mean is
  per input channel over batch and spatial positions. Under ``jit`` with a
  sharded batch this is already the global mean; inside ``shard_map``,
  ``pmap`` or ``vmap``, name the mapped batch axis in ``axis_name`` to average
  across it too (equal per-device batches assumed, as for BatchNorm).
  """
  feature_axes = normalize_axes(feature_axes, inputs.ndim)
  reduce_axes = tuple(a for a in range(inputs.ndim) if a not in feature_axes)
  mean = jnp.mean(inputs.astype(dtype), axis=reduce_axes)
  if axis_name is not None:
    mean = lax.pmean(mean, axis_name)
  # jnp.mean leaves the kept axes in ascending order; restore feature order.
  ascending = sorted(feature_axes)
  return jnp.transpose(mean, [ascending.index(a) for a in feature_axes])


def subtract_mean(
    inputs: jax.Array, mean: jax.Array, feature_axes: Sequence[int]
) -> jax.Array:
  """``inputs - mean`` with ``mean`` laid along ``feature_axes``."""
  feature_axes = normalize_axes(feature_axes, inputs.ndim)
  ascending = sorted(feature_axes)
  mean = jnp.transpose(mean, [feature_axes.index(a) for a in ascending])
  shape = [1] * inputs.ndim
  for axis in ascending:
    shape[axis] = inputs.shape[axis]
  dtype = jnp.result_type(inputs)
  return inputs - jnp.reshape(mean, shape).astype(dtype)


def ema(mean: jax.Array, recorded: jax.Array, decay: Any) -> jax.Array:
  """``mu_new = decay * mu + (1 - decay) * batch_mean`` (Algorithm 1, step 10)."""
  return (decay * mean + (1 - decay) * recorded).astype(mean.dtype)


def dense_bias_shift(kernel: jax.Array, delta_mean: jax.Array) -> jax.Array:
  """``W (mu_new - mu_old)`` for a kernel laid out ``in_shape + out_shape``."""
  n = delta_mean.ndim
  return jnp.tensordot(
      delta_mean.astype(kernel.dtype),
      kernel,
      axes=(tuple(range(n)), tuple(range(n))),
      precision=lax.Precision.HIGHEST,
  )


def conv_bias_shift(
    kernel: jax.Array, delta_mean: jax.Array, feature_group_count: int
) -> jax.Array:
  """``W (mu_new - mu_old)`` for a convolution kernel ``(*window, C_in/G, C_out)``.

  An unpadded convolution of a constant image ``d`` gives, at every output
  position, the kernel summed over its window and contracted with ``d``
  within each of the ``G`` feature groups.
  """
  in_per_group, out_features = kernel.shape[-2], kernel.shape[-1]
  groups = feature_group_count
  window_sum = jnp.sum(kernel, axis=tuple(range(kernel.ndim - 2)))
  grouped_kernel = jnp.reshape(
      window_sum, (in_per_group, groups, out_features // groups)
  )
  grouped_delta = jnp.reshape(
      delta_mean.astype(kernel.dtype), (groups, in_per_group)
  )
  shift = jnp.einsum(
      'gc,cgo->go',
      grouped_delta,
      grouped_kernel,
      precision=lax.Precision.HIGHEST,
  )
  return jnp.reshape(shift, (out_features,))


def conv_mean_correction(
    kernel: jax.Array, mean: jax.Array, feature_group_count: int
) -> jax.Array:
  """What centering subtracts from a convolution's output: ``(sum_window W) . mu``.

  ``conv(pad(a) - mu) = conv(pad(a)) - conv_mean_correction(W, mu, G)`` at
  every output position, for any padding, stride and kernel dilation (every
  output sees a full window of the padded input); a per-output-channel
  vector. It is :func:`conv_bias_shift` of ``mu`` itself: the transport moves
  the bias by exactly the change of this correction, so the function stays
  the same.
  """
  return conv_bias_shift(kernel, mean, feature_group_count)


def transported_bias(bias: jax.Array, shift: jax.Array) -> jax.Array:
  """``b~ + W (mu_new - mu_old)`` (eq. 10), in the bias dtype."""
  return (bias + shift.astype(bias.dtype)).astype(bias.dtype)


def check_conv_supported(
    input_dilation: Optional[Union[int, Sequence[int]]], use_bias: bool
) -> None:
  """Refuses convolutions whose transport could not be exact."""
  if not use_bias:
    raise ValueError(
        'Centering needs a bias to transport (eq. 10): build the layer with '
        'use_bias=True.'
    )
  if input_dilation is not None and any(
      d != 1 for d in ((input_dilation,) if isinstance(input_dilation, int)
                       else input_dilation)
  ):
    raise ValueError(
        'Centering cannot be exact with input dilation: the inserted zeros are '
        'not shifted by mu, so a mean update would change the function.'
    )
