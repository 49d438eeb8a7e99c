"""What M2 needs to know about one linear layer (re-exported by
:mod:`cbp_optax.centering`)."""

from __future__ import annotations

from typing import NamedTuple, Sequence, Union

Shape = tuple[int, ...]
DENSE, CONV = 'dense', 'conv'


class LayerSpec(NamedTuple):
  """What centering needs to know about one (unstacked) linear layer;
  hashable, so it can be static metadata.

  Attributes:
    kind: ``'dense'`` or ``'conv'``.
    axis: the input axes the layer contracts (dense, as configured, possibly
      negative), or ``(-1,)`` (conv: the channel axis).
    mean_shape: shape of ``mu``: the contracted input axes' sizes in
      ascending axis order (dense), or ``(in_channels,)`` (conv).
    kernel_shape: the kernel's shape.
    bias_shape: the bias's shape.
    feature_group_count: the convolution's feature groups (1 for dense).
    transpose_kernel: the kernel is ``(*window, C_out, C_in)``.
  """

  kind: str
  axis: tuple[int, ...]
  mean_shape: Shape
  kernel_shape: Shape
  bias_shape: Shape
  feature_group_count: int = 1
  transpose_kernel: bool = False


def normalize_axes(axes: Union[int, Sequence[int]], ndim: int) -> tuple[int, ...]:
  """Axes as non-negative indices, in ascending order (the kernel's order)."""
  if isinstance(axes, int):
    axes = (axes,)
  return tuple(sorted(a % ndim for a in axes))


def dense_spec(axis: Union[int, Sequence[int]], in_shape: Sequence[int],
               out_shape: Sequence[int]) -> LayerSpec:
  """A dense layer contracting ``axis`` (``in_shape`` in kernel order)."""
  axis = (axis,) if isinstance(axis, int) else tuple(axis)
  in_shape, out_shape = tuple(in_shape), tuple(out_shape)
  return LayerSpec(DENSE, axis, in_shape, in_shape + out_shape, out_shape)


def conv_spec(kernel_size: Sequence[int], in_features: int, out_features: int,
              feature_group_count: int,
              transpose_kernel: bool = False) -> LayerSpec:
  """A convolution with a ``(*window, C_in/G, C_out)`` kernel, or a stride-1
  transposed one (``(*window, C_out, C_in)``)."""
  channels = (in_features // feature_group_count, out_features)
  kernel_shape = tuple(kernel_size) + (
      channels[::-1] if transpose_kernel else channels)
  return LayerSpec(CONV, (-1,), (in_features,), kernel_shape, (out_features,),
                   feature_group_count, bool(transpose_kernel))


def feature_axes(spec: LayerSpec, ndim: int) -> tuple[int, ...]:
  """The input axes ``mu`` lives on, ascending, for an input of rank ``ndim``."""
  return normalize_axes(spec.axis, ndim)
