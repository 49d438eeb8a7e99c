"""Layer stacks: where a stacked layer's stack axes are, and Muon's dimension
numbers of its kernel (re-exported by :mod:`cbp_optax.centering`)."""

from __future__ import annotations

import itertools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import optax

from cbp_optax._layer_spec import CONV
from cbp_optax._layer_spec import LayerSpec
from cbp_optax._layer_spec import Shape


def stack_axes_placements(shape: Shape,
                          unstacked_shape: Shape) -> list[tuple[int, ...]]:
  """Every placement of stack axes that makes ``shape`` ``unstacked_shape``,
  leading axes first (several: a stack as long as a feature size)."""
  shape, unstacked_shape = tuple(shape), tuple(unstacked_shape)
  extra = len(shape) - len(unstacked_shape)
  if extra < 0:
    return []
  return [axes for axes in itertools.combinations(range(len(shape)), extra)
          if tuple(d for i, d in enumerate(shape) if i not in axes)
          == unstacked_shape]


def resolve_stack_axes(
    shape: Shape, unstacked_shape: Shape,
    preferred: Optional[Sequence[int]] = None, *,
    not_found: Optional[Callable[[], str]] = None,
    ambiguous: Optional[Callable[[list[tuple[int, ...]]], str]] = None,
) -> Optional[tuple[int, ...]]:
  """Which axes of ``shape`` are stack axes around ``unstacked_shape``:
  ``preferred`` if it fits, else the first placement. No placement:
  ``ValueError(not_found())`` (None without it); several:
  ``ValueError(ambiguous(placements))`` when given."""
  placements = stack_axes_placements(shape, unstacked_shape)
  if preferred is not None and tuple(preferred) in placements:
    return tuple(preferred)
  if not placements and not_found is not None:
    raise ValueError(not_found())
  if len(placements) > 1 and ambiguous is not None:
    raise ValueError(ambiguous(placements))
  return placements[0] if placements else None


AMBIGUOUS_STACK_REMEDY = (
    "Record where the stack axis is: pass the means' stack axes "
    '(mean_stack_axes), or create the centered layers inside the stacking '
    'transform with the stack axis named, so that their means track it.')


def stack_axes_of(name: str, array: jax.Array, unstacked: Shape, preferred,
                  spec: LayerSpec) -> tuple[int, ...]:
  """The stack axes of one of a layer's arrays in the transport, or why not."""
  return resolve_stack_axes(
      array.shape, unstacked, preferred,
      not_found=lambda: (
          f'transport: the {name} has shape {tuple(array.shape)}, which is '
          f'not {unstacked} with stack axes added ({spec}); pass the '
          'parameters and centering statistics of the same model.'),
      ambiguous=lambda placements: (
          f'transport: the {name} has shape {tuple(array.shape)}, which is '
          f'{unstacked} with stack axes at any of {placements}. '
          + AMBIGUOUS_STACK_REMEDY))


def to_front(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
  return jnp.moveaxis(x, axes, tuple(range(len(axes))))


def from_front(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
  return jnp.moveaxis(x, tuple(range(len(axes))), axes)


def layer_axes(spec: LayerSpec, kernel: jax.Array, bias: jax.Array,
               mean: jax.Array, mean_stack_axes: Optional[tuple[int, ...]]
               ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
  """The stack axes of ``mean``, ``kernel`` and ``bias``, which must agree."""
  mean_axes = stack_axes_of('mean', mean, spec.mean_shape, mean_stack_axes, spec)
  kernel_axes = stack_axes_of('kernel', kernel, spec.kernel_shape, mean_axes, spec)
  bias_axes = stack_axes_of('bias', bias, spec.bias_shape, mean_axes, spec)
  sizes = [tuple(x.shape[a] for a in axes) for x, axes in
           ((mean, mean_axes), (kernel, kernel_axes), (bias, bias_axes))]
  if len(set(sizes)) != 1:
    raise ValueError('transport: mean, kernel and bias have different stack '
                     f'sizes {sizes}.')
  return mean_axes, kernel_axes, bias_axes


def muon_dimension_numbers(spec: LayerSpec,
                           kernel_stack_axes: Sequence[int] = ()) -> Any:
  """How ``optax.contrib.muon`` should see this layer's kernel as a matrix:
  its input axes reduce, its feature axes are outputs, stack axes batch.

  Args:
    spec: the layer, unstacked.
    kernel_stack_axes: where the stacked kernel's stack axes are.

  Returns:
    An ``optax.contrib.MuonDimensionNumbers``.

  Examples:
    >>> from cbp_optax import centering
    >>> spec = centering.conv_spec((3, 3), 8, 16, feature_group_count=1)
    >>> centering.muon_dimension_numbers(spec, kernel_stack_axes=(0,))
    MuonDimensionNumbers(reduction_axis=(1, 2, 3), output_axis=(4,))
  """
  ndim = len(spec.kernel_shape)
  inputs = ndim - 1 if spec.kind == CONV else len(spec.mean_shape)
  reduction, output = tuple(range(inputs)), tuple(range(inputs, ndim))
  if spec.transpose_kernel:  # (*window, C_out, C_in)
    reduction, output = reduction[:-1] + (ndim - 1,), (ndim - 2,)
  return place_kernel_dims(reduction, output, ndim, kernel_stack_axes)


def place_kernel_dims(reduction: Sequence[int], output: Sequence[int],
                      ndim: int, stack_axes: Sequence[int] = ()) -> Any:
  """The stacked kernel's ``MuonDimensionNumbers`` from the ``reduction``
  and ``output`` axes among its ``ndim`` own axes."""
  stack = sorted(stack_axes)
  own = [a for a in range(ndim + len(stack)) if a not in stack]
  return optax.contrib.MuonDimensionNumbers(
      reduction_axis=tuple(own[a] for a in reduction),
      output_axis=tuple(own[a] for a in output))


def einsum_kernel_dims(einsum_str: Optional[str]
                       ) -> Optional[tuple[tuple[int, ...], tuple[int, ...]]]:
  """(reduction, output) axes of an einsum's kernel (its second operand):
  summed away, or only in the output. None where it is no matrix."""
  if not einsum_str or '->' not in einsum_str or ',' not in einsum_str:
    return None
  operands, out = einsum_str.replace(' ', '').split('->')
  lhs, rhs = operands.split(',', 1)
  if '.' in rhs:
    return None
  reduction = tuple(i for i, c in enumerate(rhs) if c not in out)
  output = tuple(i for i, c in enumerate(rhs) if c in out and c not in lhs)
  return (reduction, output) if reduction and output else None
