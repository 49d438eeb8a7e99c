"""The bias transport's arithmetic, ``b~ += W (mu_new - mu_old)`` (eq. 10)
(re-exported by :mod:`cbp_optax.centering`)."""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax

from cbp_optax._layer_spec import CONV
from cbp_optax._layer_spec import LayerSpec
from cbp_optax._stacks import from_front
from cbp_optax._stacks import stack_axes_of
from cbp_optax._stacks import to_front
from cbp_optax._stacks import layer_axes


def bias_shift(spec: LayerSpec, kernel: jax.Array, delta: jax.Array) -> jax.Array:
  """``W delta``: how one (unstacked) layer's output moves when its input
  moves by ``delta``."""
  delta = delta.astype(kernel.dtype)
  if spec.kind != CONV:
    n = delta.ndim
    return jnp.tensordot(delta, kernel, axes=(tuple(range(n)), tuple(range(n))),
                         precision=lax.Precision.HIGHEST)
  if spec.transpose_kernel:  # (*window, C_out, C_in): the same window sum
    kernel = jnp.swapaxes(kernel, -1, -2)
  # A constant image `delta`: the window-summed kernel times `delta`, per group.
  groups = spec.feature_group_count
  in_per_group, out_features = kernel.shape[-2], kernel.shape[-1]
  window_sum = jnp.sum(kernel, axis=tuple(range(kernel.ndim - 2)))
  shift = jnp.einsum(
      'gc,cgo->go', jnp.reshape(delta, (groups, in_per_group)),
      jnp.reshape(window_sum, (in_per_group, groups, out_features // groups)),
      precision=lax.Precision.HIGHEST)
  return jnp.reshape(shift, (out_features,))


def needs_bias_residual(dtype: Any) -> bool:
  """Whether a bias of ``dtype`` keeps a float32 transport residual (a
  16-bit bias: compensated summation)."""
  return jnp.finfo(dtype).bits < 32


def _stored(x: jax.Array, wide: Any) -> jax.Array:
  """``x`` in the wider dtype ``wide``, at exactly the value ``x`` holds
  (XLA may keep a 16-bit result in excess precision)."""
  narrow = jnp.finfo(x.dtype)
  x = x.astype(wide)
  if narrow.bits >= jnp.finfo(wide).bits:
    return x
  return lax.reduce_precision(x, exponent_bits=narrow.nexp,
                              mantissa_bits=narrow.nmant)


def _moved_bias(spec, kernel, bias, mean, new_mean, residual):
  """A layer's ``b~ + W (mu_new - mu_old)`` (float32 at least), new residual."""
  wide = (residual.dtype if residual is not None else jnp.promote_types(
      jnp.promote_types(kernel.dtype, mean.dtype), jnp.float32))
  delta = _stored(new_mean, wide) - _stored(mean, wide)
  shift = bias_shift(spec, _stored(kernel, wide), delta)
  if residual is None:
    return (_stored(bias, wide) + shift).astype(bias.dtype), None
  exact = _stored(bias, wide) + residual + shift
  rounded = lax.reduce_precision(
      exact, exponent_bits=jnp.finfo(bias.dtype).nexp,
      mantissa_bits=jnp.finfo(bias.dtype).nmant)
  return rounded.astype(bias.dtype), exact - rounded


def shift_bias(spec: LayerSpec, kernel: jax.Array, bias: jax.Array,
               mean: jax.Array, new_mean: jax.Array, *,
               mask: Optional[jax.Array] = None,
               mean_stack_axes: Optional[tuple[int, ...]] = None,
               residual: Optional[jax.Array] = None) -> Any:
  """The bias transport of eq. (10) alone: ``b~ + W (mu_new - mu_old)``.

  For one layer or one stack (each slice by its own kernel); an optimizer's
  copy of the parameters moves by this with its own kernel.

  Args:
    spec: the layer, unstacked.
    kernel: the kernel, possibly with stack axes.
    bias: the bias, with the same stack axes.
    mean: ``mu_old``, with the same stack sizes.
    new_mean: ``mu_new``, shaped like ``mean``.
    mask: a convolution's kernel mask (unstacked or stacked like ``kernel``).
    mean_stack_axes: where ``mean``'s stack axes are, when the caller knows.
    residual: a 16-bit bias's float32 residual, shaped like ``bias``
      (:func:`needs_bias_residual`).

  Returns:
    The new bias; ``(new_bias, new_residual)`` when ``residual`` is given.
  """
  mean_axes, kernel_axes, bias_axes = layer_axes(
      spec, kernel, bias, mean, mean_stack_axes)
  if mask is not None:
    if mask.ndim < kernel.ndim:
      mask = jnp.expand_dims(mask, kernel_axes)
    kernel = kernel * mask
  fn = functools.partial(_moved_bias, spec)
  for _ in mean_axes:
    fn = jax.vmap(fn)
  if residual is None:
    residual_axes = fronted_residual = None
  else:
    residual_axes = stack_axes_of('residual', residual, spec.bias_shape,
                                mean_axes, spec)
    fronted_residual = to_front(residual, residual_axes)
  new_bias, new_residual = fn(
      to_front(kernel, kernel_axes), to_front(bias, bias_axes),
      to_front(mean, mean_axes), to_front(new_mean, mean_axes),
      fronted_residual)
  new_bias = from_front(new_bias, bias_axes)
  if residual is None:
    return new_bias
  return new_bias, from_front(new_residual, residual_axes)
