"""M2: the activation-centering reparameterization, one framework-free core.

A centered linear layer computes ``z = W (a - mu) + b~`` (eq. 8); when the
EMA ``mu`` of its input mean moves, the bias is transported,
``b~ <- b~ + W (mu_new - mu_old)`` (eq. 10), so the function is unchanged.
Each exactly centered layer kind (``'dense'``, ``'conv'``: run as the plain
layer minus :func:`mean_correction`, eq. 9) is a :class:`LayerSpec` of one
stack slice; ``cbp_optax.nnx`` and ``cbp_optax.linen`` hold the state, which
:func:`record` and :func:`refresh` move as a :class:`LayerState`.

References:
  Layerwise Conditioned Backpropagation, §4.2, eqs. (8)-(10), Algorithm 1.
"""

from __future__ import annotations

import functools
import math
from typing import (Any, Callable, Iterable, NamedTuple, Optional, Sequence,
                    Union)

import jax
import jax.numpy as jnp
from jax import lax

from cbp_optax import _checks
from cbp_optax import _opt_state
from cbp_optax._paths import path_names
from cbp_optax._layer_spec import CONV
from cbp_optax._layer_spec import LayerSpec
from cbp_optax._layer_spec import Shape
from cbp_optax._layer_spec import conv_spec
from cbp_optax._layer_spec import dense_spec
from cbp_optax._layer_spec import feature_axes
from cbp_optax._layer_spec import normalize_axes  # noqa: F401  (for the adapters)
from cbp_optax._stacks import AMBIGUOUS_STACK_REMEDY
from cbp_optax._stacks import layer_axes
from cbp_optax._stacks import muon_dimension_numbers
from cbp_optax._stacks import stack_axes_placements
from cbp_optax._bias_shift import bias_shift
from cbp_optax._bias_shift import needs_bias_residual
from cbp_optax._bias_shift import shift_bias
from cbp_optax._untransported import UntransportedWarning
from cbp_optax.blocks import check_stack_paths
from cbp_optax.blocks import stack_root
from cbp_optax.blocks import stacked_predicate
from cbp_optax.blocks import strip_variable_suffix


# The documented surface; the other names serve the adapters.
__all__ = ['CannotCenterError', 'LayerSpec', 'UnclassifiedStateError',
           'UntransportedWarning', 'conv_spec', 'dense_spec',
           'muon_dimension_numbers', 'register_parameter_state', 'shift_bias',
           'transport']


class CannotCenterError(ValueError):
  """A layer whose transport (eq. 10) could not keep the function exact."""


def _layer_label(layer_type: type) -> str:
  return f'{layer_type.__module__}.{layer_type.__qualname__}'


def _not_ones(value: Optional[Union[int, Sequence[int]]]) -> bool:
  values = (value,) if isinstance(value, int) else (value or ())
  return any(v != 1 for v in values)


def check_layer(layer: Any, supported: Sequence[type], *,
                transposed: bool = False, batch_axes: Any = None) -> None:
  """Refuses a layer centering cannot keep exact: TypeError unless its type
  is one of ``supported`` (exactly: a subclass may change the maths), else
  CannotCenterError where no bias transport (eq. 10) follows it."""
  label = _layer_label(type(layer))
  if type(layer) not in supported:
    raise TypeError(
        f'Cannot center {label}: centering is exact for the types '
        f'{", ".join(map(_layer_label, supported))} only (a subclass may '
        'change the maths).')
  dilation = getattr(layer, 'input_dilation', None)
  strides = layer.strides if transposed else None
  # A strided transposed convolution's output phases (position mod stride)
  # sum their own kernel taps: W mu differs between them.
  why = ('was built with use_bias=False: centering needs a bias to transport'
         if not layer.use_bias else
         f'has input dilation {dilation}: mu does not shift its zeros'
         if _not_ones(dilation) else
         f'has strides {strides}: W mu differs per output phase'
         if _not_ones(strides) else
         f'has kernel batch axes {batch_axes}: mu would differ along them'
         if batch_axes else None)
  if why:
    raise CannotCenterError(f'{label} {why}.')


Where = Union[None, type, tuple[type, ...], Callable[[str, Any], bool]]


def check_where(where: Any) -> Where:
  """``center``'s ``where`` as None, a type, a tuple of types or a callable
  (a list of types becomes a tuple); TypeError otherwise."""
  if isinstance(where, (list, tuple)):
    bad = [t for t in where if not isinstance(t, type)]
    if where and not bad:
      return tuple(where)
    got = f'{where!r}, ' + (f'whose {bad[0]!r} is not a type' if bad
                            else 'empty')
  elif where is None or callable(where):
    return where
  else:
    got = f'the {type(where).__name__} {where!r}'
  example = where if isinstance(where, str) else 'encoder'
  raise TypeError(
      'where must be None, a layer type, a tuple of layer types or a '
      f'predicate where(path, layer) -> bool; got {got} (by path: '
      f'where=lambda path, layer: path.startswith({example!r})).')


def mean_dtype(requested: Any, param_dtype: Any) -> jnp.dtype:
  """The dtype of ``mu``: ``requested``, else the layer's ``param_dtype``
  (TypeError unless a real floating-point dtype)."""
  value = param_dtype if requested is None else requested
  return _checks.float_dtype(
      'mean_dtype', value,
      ('' if requested is not None else " (the layer's param_dtype)")
      + ': the mean of the inputs is not an integer.')


def batch_mean(inputs: jax.Array, spec: LayerSpec, dtype: Any,
               axis_name: Optional[Any] = None) -> jax.Array:
  """The input mean over every axis but the feature axes (global under
  ``jit``; ``axis_name`` also averages over a mapped batch axis)."""
  axes = feature_axes(spec, inputs.ndim)
  reduce_axes = tuple(a for a in range(inputs.ndim) if a not in axes)
  mean = jnp.mean(inputs.astype(dtype), axis=reduce_axes)
  if axis_name is not None:
    mean = lax.pmean(mean, axis_name)
  return mean


def subtract_mean(inputs: jax.Array, mean: jax.Array, spec: LayerSpec) -> jax.Array:
  """``inputs - mu`` with ``mu`` laid along the feature axes, in the inputs'
  dtype when it is a float one, else in ``mu``'s."""
  axes = feature_axes(spec, inputs.ndim)
  shape = [1] * inputs.ndim
  for axis in axes:
    shape[axis] = inputs.shape[axis]
  dtype = jnp.result_type(inputs)
  if not jnp.issubdtype(dtype, jnp.inexact):
    dtype = jnp.result_type(mean)
  return inputs.astype(dtype) - jnp.reshape(mean, shape).astype(dtype)


# What centering subtracts from the plain layer's output, ``W mu`` (eq. 9).
mean_correction = bias_shift


def centered_output(
    spec: LayerSpec, layer_fn: Callable[[jax.Array], jax.Array],
    inputs: jax.Array, kernel: Callable[[], jax.Array], mean: jax.Array,
    mask: Optional[jax.Array] = None,
) -> jax.Array:
  """``W (a - mu) + b~`` (eq. 8), given the plain layer ``layer_fn``; a
  convolution subtracts :func:`mean_correction` with the (masked) kernel
  (``kernel()`` is called after ``layer_fn``, so that a lazy one exists)."""
  if spec.kind == CONV:
    outputs = layer_fn(inputs)
    kernel = kernel() if mask is None else kernel() * mask
    correction = mean_correction(spec, kernel, mean)
    return outputs - correction.astype(outputs.dtype)
  return layer_fn(subtract_mean(inputs, mean, spec))


def ema(mean: jax.Array, recorded: jax.Array, decay: Any) -> jax.Array:
  """``decay * mu + (1 - decay) * batch_mean`` (Algorithm 1, step 10)."""
  wide = jnp.promote_types(mean.dtype, jnp.float32)
  return (decay * mean.astype(wide)
          + (1 - decay) * recorded.astype(wide)).astype(mean.dtype)


class LayerState(NamedTuple):
  """One centered layer's variables, which an adapter (``cbp_optax.nnx``,
  ``cbp_optax.linen``) hands :func:`record` and :func:`refresh` and gets back.
  ``kernel`` (unmasked; ``mask`` for a convolution), ``bias`` (``b~``) and
  ``mean`` (``mu``, eq. 8) may carry stack axes (``stack_axes``: ``mean``'s,
  where known); ``count``: the input positions ``recorded`` pools (None: none
  kept); ``residual``: a 16-bit bias's float32 residual
  (:func:`needs_bias_residual`)."""

  spec: LayerSpec
  kernel: jax.Array
  bias: jax.Array
  mean: jax.Array
  recorded: jax.Array
  count: Optional[jax.Array] = None
  mask: Optional[jax.Array] = None
  stack_axes: Optional[tuple[int, ...]] = None
  residual: Optional[jax.Array] = None


def added_stack_axis(axes: Optional[Sequence[int]], index: int
                     ) -> tuple[int, ...]:
  """Stack ``axes`` after a stacking transform inserts axis ``index``."""
  moved = tuple(a + 1 if a >= index else a for a in axes or ())
  return tuple(sorted(moved + (index,)))


def removed_stack_axis(axes: Optional[Sequence[int]], index: int
                       ) -> tuple[int, ...]:
  """Stack ``axes`` after a transform removes axis ``index``."""
  return tuple(a - 1 if a > index else a for a in axes or () if a != index)


def _kernel_stack_axes(spec: LayerSpec, kernel_shape: Shape,
                       given: Optional[Sequence[int]], remedy: str
                       ) -> tuple[int, ...]:
  """The stack axes of a kernel of ``kernel_shape``: ``given`` where it fits,
  else the one placement the shapes allow (ValueError otherwise)."""
  placements = stack_axes_placements(kernel_shape, spec.kernel_shape)
  if given is not None:
    ndim = len(kernel_shape)
    axes = tuple(sorted(a % ndim for a in given if isinstance(a, int) and not
                        isinstance(a, bool) and -ndim <= a < ndim))
    if len(axes) == len(tuple(given)) and axes in placements:
      return axes
  elif len(placements) == 1:
    return placements[0]
  what = f'a kernel of shape {kernel_shape} is {spec.kernel_shape} stacked'
  if given is not None:
    raise ValueError(f'stack_axes={given!r} does not fit: {what} along '
                     f'{placements or "no axes"}.')
  if not placements:
    raise ValueError(f'a kernel of shape {kernel_shape} is not '
                     f'{spec.kernel_shape} with stack axes added.')
  raise ValueError(f'{what} along any of the axes {placements}, which the '
                   'shapes cannot tell apart; a wrong guess would change the '
                   f'function at the first transport. {remedy}')


def zero_state(spec: LayerSpec, mean_dtype: Any, bias: Any,
               kernel_shape: Optional[Shape] = None,
               stack_axes: Optional[Sequence[int]] = None,
               remedy: str = AMBIGUOUS_STACK_REMEDY) -> LayerState:
  """A new layer's statistics, all zero: ``mu`` and the recorded mean
  (``mean_dtype``), the recorded count (feature axes 1, a float of >= 32 bits:
  no wrap-around) and, for a 16-bit ``bias`` (anything with a shape and dtype),
  its float32 residual. Stacked as ``kernel_shape`` (default the spec's) is:
  ``stack_axes`` are its kernel's where the shapes cannot tell, and ``remedy``
  says how to tell them. ``kernel`` and ``bias`` are None."""
  kernel_shape = tuple(kernel_shape or spec.kernel_shape)
  axes = _kernel_stack_axes(spec, kernel_shape, stack_axes, remedy)
  shape = list(spec.mean_shape)
  for axis in axes:
    shape.insert(min(axis, len(shape)), kernel_shape[axis])
  mean_axes = tuple(min(a, len(spec.mean_shape) + i)
                    for i, a in enumerate(axes))
  count = jnp.zeros([d if a in mean_axes else 1 for a, d in enumerate(shape)],
                    jnp.promote_types(mean_dtype, jnp.float32))
  residual = (jnp.zeros(bias.shape, jnp.float32)
              if needs_bias_residual(bias.dtype) else None)
  return LayerState(spec, None, None, jnp.zeros(shape, mean_dtype),
                    jnp.zeros(shape, mean_dtype), count, stack_axes=mean_axes,
                    residual=residual)


def record(layer: LayerState, inputs: jax.Array,
           axis_name: Any) -> LayerState:
  """``layer`` after one training call on ``inputs``: the input mean since the
  last transport, pooled by input positions (no count: the last call's)."""
  spec, recorded, count = layer.spec, layer.recorded, layer.count
  if count is None:
    return layer._replace(
        recorded=batch_mean(inputs, spec, recorded.dtype, axis_name))
  axes = feature_axes(spec, inputs.ndim)
  n = math.prod(d for a, d in enumerate(inputs.shape) if a not in axes)
  if n == 0:
    return layer
  mean = batch_mean(inputs, spec, recorded.dtype, axis_name)
  dtype = jnp.promote_types(recorded.dtype, count.dtype)
  pooled = recorded.astype(dtype) + (mean.astype(dtype) - recorded.astype(
      dtype)) * (n / (count + n)).astype(dtype)
  return layer._replace(
      recorded=jnp.where(count > 0, pooled.astype(recorded.dtype), mean),
      count=count + n)


def refresh(layer: LayerState, decay: Any, recorded_only: bool = True,
            remedy: Optional[str] = None) -> LayerState:
  """``layer`` after the mean refresh (:func:`ema`) and bias transport
  (Algorithm 1, steps 10-11; eq. 10), its count restarted; with
  ``recorded_only``, a slice that recorded nothing keeps ``mu``.
  ``remedy``: the adapter's words for ``AMBIGUOUS_STACK_REMEDY``."""
  mean, new_mean = layer.mean, ema(layer.mean, layer.recorded, decay)
  if recorded_only and layer.count is not None:
    new_mean = jnp.where(layer.count > 0, new_mean, mean)
  try:
    moved = shift_bias(layer.spec, layer.kernel, layer.bias, mean, new_mean,
                       mask=layer.mask, mean_stack_axes=layer.stack_axes,
                       residual=layer.residual)
  except ValueError as error:
    if remedy is None or AMBIGUOUS_STACK_REMEDY not in str(error):
      raise
    raise ValueError(str(error).replace(AMBIGUOUS_STACK_REMEDY,
                                        remedy)) from error
  bias, residual = moved if layer.residual is not None else (moved, None)
  count = None if layer.count is None else jnp.zeros_like(layer.count)
  return layer._replace(bias=bias, mean=new_mean, count=count,
                        residual=residual)


def copy_shift(old: LayerState, new: LayerState) -> Callable[..., Any]:
  """``shift(kernel, bias)``: :func:`refresh`'s transport (eq. 10) for a
  copy of the parameters with its own kernel."""
  return functools.partial(shift_bias, old.spec, mean=old.mean,
                           new_mean=new.mean, mask=old.mask,
                           mean_stack_axes=old.stack_axes)


def kernel_dimension_numbers(layer: LayerState) -> Any:
  """Muon's view of ``layer``'s kernel: contracted input axes reduce, stack
  axes are batch axes."""
  _, axes, _ = layer_axes(layer.spec, layer.kernel, layer.bias, layer.mean,
                          layer.stack_axes)
  return muon_dimension_numbers(layer.spec, axes)


def transport(
    spec: LayerSpec, kernel: jax.Array, bias: jax.Array, mean: jax.Array,
    recorded: jax.Array, decay: Any, *, mask: Optional[jax.Array] = None,
    mean_stack_axes: Optional[tuple[int, ...]] = None,
    residual: Optional[jax.Array] = None,
) -> tuple[jax.Array, ...]:
  r"""Mean refresh and bias transport of one layer or one stack of layers.

  ``mu_new = decay * mu + (1 - decay) * recorded`` (Algorithm 1, step 10) and
  ``b~ += W (mu_new - mu_old)`` (eq. 10) with the given (updated) kernel,
  each slice of a layer stack with its own.

  Args:
    spec: the layer, unstacked.
    kernel: its kernel, possibly with stack axes; ``bias`` and ``mean``
      (``mu``) have the same stack sizes.
    recorded: the batch mean recorded by the last forward pass.
    decay: the EMA decay of ``mu``, in ``[0, 1)`` (or a tracer).
    mask: a convolution's kernel mask (unstacked or stacked like ``kernel``).
    mean_stack_axes: ``mean``'s stack axes if known; else found from shapes.
    residual: a 16-bit bias's float32 residual (see :func:`shift_bias`).

  Returns:
    ``(new_bias, new_mean)``, and ``new_residual`` third when given.

  Examples:
    The mean moves half-way, the bias by :math:`W \Delta\mu`, and the
    output :math:`W (a - \mu) + \tilde b` stays the same:

    >>> import jax.numpy as jnp
    >>> from cbp_optax import centering
    >>> spec = centering.dense_spec(-1, in_shape=(2,), out_shape=(1,))
    >>> kernel, bias = jnp.array([[1.0], [2.0]]), jnp.zeros(1)
    >>> mean, recorded = jnp.zeros(2), jnp.ones(2)
    >>> new_bias, new_mean = centering.transport(
    ...     spec, kernel, bias, mean, recorded, decay=0.5)
    >>> print(new_mean, new_bias)
    [0.5 0.5] [1.5]
    >>> a = jnp.array([3.0, -1.0])
    >>> print((a - mean) @ kernel + bias, (a - new_mean) @ kernel + new_bias)
    [1.] [1.]

  References:
    Layerwise Conditioned Backpropagation, §4.2 (eqs. 8-10) and Algorithm 1,
    steps 10-11.
  """
  _checks.check_mean_decay(decay)
  new = refresh(LayerState(spec, kernel, bias, mean, recorded, mask=mask,
                           stack_axes=mean_stack_axes, residual=residual),
                decay)
  return (new.bias, new.mean) + (() if residual is None else (new.residual,))


def register_parameter_state(state_type: type, *fields: str) -> None:
  """Declares the fields of an optimizer state type that hold parameters.

  The transport (eq. 10) moves each registered field's biases with its own
  kernel; a parameter-shaped tree in an unregistered state type raises
  :class:`UnclassifiedStateError`.

  Args:
    state_type: the state class of your transform (a ``NamedTuple``, or any
      pytree node whose children have names).
    *fields: its fields holding a tree like the parameters; none declares
      gradient statistics only.

  Examples:
    An EMA of the parameters, kept by a transform of your own, whose biases
    a centered model's fused step then moves:

    >>> from typing import NamedTuple
    >>> import jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> import cbp_optax as cbp
    >>> class ParamEmaState(NamedTuple):
    ...   ema: optax.Params
    >>> cbp.centering.register_parameter_state(ParamEmaState, 'ema')
    >>> def update(updates, state, params):
    ...   new = optax.apply_updates(params, updates)
    ...   return updates, ParamEmaState(
    ...       optax.incremental_update(new, state.ema, 0.1))
    >>> param_ema = optax.GradientTransformation(ParamEmaState, update)
    >>> model = nnx.Sequential(nnx.Linear(2, 1, rngs=nnx.Rngs(0)))
    >>> _ = cbp.nnx.center(model)
    >>> optimizer = cbp.nnx.Optimizer(
    ...     model, optax.chain(optax.sgd(0.1), param_ema))
    >>> step = cbp.nnx.train_step(lambda m, x: jnp.mean(m(x) ** 2))
    >>> out = step(model, optimizer, jnp.ones((4, 2)))
    >>> type(optimizer.opt_state[1]).__name__, bool(out.skipped)
    ('ParamEmaState', False)
  """
  _opt_state.register_parameter_state(state_type, *fields)


UnclassifiedStateError = _opt_state.UnclassifiedStateError


def stacked_blocks(
    params: Any, stack_paths: Sequence[str],
    layers: Iterable[tuple[tuple[str, ...], Optional[Sequence[int]], Shape]],
) -> Callable[[Any, Any], bool]:
  """The adapters' ``stacked_blocks`` (eq. 7): the modules ``stack_paths``
  name, else the root of every stack in ``layers``, ``(path, stack axes,
  mean shape)`` of each layer (stack axes empty or None: unstacked)."""
  shapes = {path_names(path): tuple(jnp.shape(leaf))
            for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
  roots = check_stack_paths(shapes, stack_paths)
  if not stack_paths:
    layers = list(layers)
    unstacked = [path for path, axes, _ in layers if not axes]
    roots.update(stack_root(shapes, path, shape[0], unstacked)
                 for path, axes, shape in layers if axes and axes[0] == 0)
  return stacked_predicate(roots)


# Centering in place puts a layer's parameters one level down, under this key.
LAYER_KEY = 'layer'


def centered_after_init(
    tree: Any, state_tree: Any, *, center: str = 'centering',
    remedy: str = 'Build the optimizer after centering the model.',
) -> Optional[str]:
  """Why ``tree`` no longer matches ``state_tree`` (whose paths may carry a
  prefix), when centering in place moved ``hidden/kernel`` to
  ``hidden/layer/kernel`` after the optimizer was built: a message naming
  ``center`` and ending with ``remedy``; None for any other cause."""
  def names(t):
    return [path_names(strip_variable_suffix(path))
            for path, _ in jax.tree_util.tree_leaves_with_path(t)]

  suffixes = {p[i:] for p in names(state_tree) for i in range(len(p))}
  for path in names(tree):
    if path in suffixes or LAYER_KEY not in path:
      continue
    i = path.index(LAYER_KEY)
    old = path[:i] + path[i + 1:]
    if old in suffixes:
      return ('the model was centered after the optimizer was built: '
              f"{center} moved '{'/'.join(old)}' to '{'/'.join(path)}', "
              f'and the optimizer state still has the old layout. {remedy}')
  return None


# How center names a model that holds parameters itself (its path is empty).
MODEL_PATH = '(model)'


def skip_reason(where: Where, path: str, layer: Any,
                check: Callable[[Any], Any]) -> Optional[str]:
  """Why ``center`` leaves ``layer`` at ``path`` as it is (one line), or None
  to center it; ``check(layer)`` is the adapter's check of the layer."""
  try:
    check(layer)
  except CannotCenterError as error:
    return str(error)
  except (TypeError, ValueError):
    return (f'{type(layer).__name__}: not a layer type centering knows (exact '
            'Linear/Dense, LinearGeneral/DenseGeneral, Conv, ConvTranspose)')
  if isinstance(where, (type, tuple)):
    selected = isinstance(layer, where)
  else:
    selected = where is None or bool(where(path, layer))
  return None if selected else 'not selected by where'


class CenterReport(NamedTuple):
  """What ``center`` did (NNX and Linen alike); ``str`` lists it by reason.

  Attributes:
    centered: the paths (``'block/attn/query'``) of the layers it centered.
    skipped: ``(path, reason)`` for every layer with parameters of its own
      left as it was (the model itself is ``'(model)'``).
  """

  centered: list[str]
  skipped: list[tuple[str, str]]

  def __str__(self) -> str:
    lines = [f'centered ({len(self.centered)}): '
             + (', '.join(self.centered) or 'none')]
    by_reason = {}
    for path, reason in self.skipped:
      by_reason.setdefault(reason, []).append(path)
    for reason, paths in by_reason.items():
      lines.append(f'left as is ({len(paths)}): {", ".join(paths)} - {reason}')
    return '\n'.join(lines)
