"""Linen ``Centered`` and its ``'centering'`` entries: ``z = W (a - mu) + b~`` (eq. 8)."""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator, Mapping, Optional, Union

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import meta

from cbp_optax import _untransported
from cbp_optax import centering as core
from cbp_optax._paths import path_str


COLLECTION = 'centering'

# The entries of LayerState's mean, recorded, count, residual and conv mask.
MEAN, RECORDED, COUNT = 'mean', 'batch_mean', 'batch_count'
RESIDUAL, MASK = 'bias_residual', 'kernel_mask'

# Inside the Centered wrapper the layer's parameters live under these names.
DENSE, CONV = 'dense', 'conv'


class CenteringMean(flax.struct.PyTreeNode, meta.AxisMetadata):
  """``mu`` in the ``'centering'`` collection: a Flax metadata box whose
  ``stack_axes`` follow ``nn.scan``/``nn.vmap`` (:meth:`add_axis`) and whose
  static ``spec`` describes one layer; ``.value`` is the array."""

  value: Any
  spec: core.LayerSpec = flax.struct.field(pytree_node=False)
  stack_axes: tuple[int, ...] = flax.struct.field(pytree_node=False,
                                                  default=())

  def unbox(self) -> Any:
    return self.value

  def replace_boxed(self, val: Any) -> 'CenteringMean':
    return self.replace(value=val)

  def add_axis(self, index: int, params: dict[Any, Any]) -> 'CenteringMean':
    return self.replace(stack_axes=core.added_stack_axis(self.stack_axes,
                                                         index))

  def remove_axis(self, index: int, params: dict[Any, Any]) -> 'CenteringMean':
    return self.replace(stack_axes=core.removed_stack_axis(self.stack_axes,
                                                           index))


SUPPORTED = (nn.Dense, nn.DenseGeneral, nn.Conv, nn.ConvTranspose)
CONVS = (nn.Conv, nn.ConvTranspose)


def check_layer(layer: Any) -> None:
  """Refuses, at construction, a layer that cannot be centered exactly."""
  core.check_layer(layer, SUPPORTED,
                   transposed=isinstance(layer, nn.ConvTranspose),
                   batch_axes=getattr(layer, 'batch_dims', None))


def _features(features: Union[int, tuple[int, ...]]) -> tuple[int, ...]:
  return (features,) if isinstance(features, int) else tuple(features)


def layer_spec(layer: nn.Module, inputs: jax.Array) -> core.LayerSpec:
  """The :class:`~cbp_optax.centering.LayerSpec` of a layer on ``inputs``."""
  check_layer(layer)
  if isinstance(layer, CONVS):
    return core.conv_spec(
        _features(layer.kernel_size), inputs.shape[-1], layer.features,
        getattr(layer, 'feature_group_count', 1),
        getattr(layer, 'transpose_kernel', False))
  axis = -1 if isinstance(layer, nn.Dense) else layer.axis
  axes = core.normalize_axes(axis, inputs.ndim)
  return core.dense_spec(axis, tuple(inputs.shape[a] for a in axes),
                         _features(layer.features))


def centered_call(host: nn.Module, layer: nn.Module,
                  layer_fn: Callable[[jax.Array], jax.Array],
                  kernel_of: Callable[[], jax.Array], inputs: jax.Array,
                  use_running_average: bool, mean_dtype: Any,
                  axis_name: Any) -> jax.Array:
  """Eq. (8) for ``layer`` (run as ``layer_fn``), with the statistics in
  ``host``'s ``'centering'`` collection."""
  spec, mask = layer_spec(layer, inputs), getattr(layer, 'mask', None)
  dtype = core.mean_dtype(mean_dtype, layer.param_dtype)
  zero = functools.cache(lambda: core.zero_state(  # built when initializing
      spec, dtype, jax.ShapeDtypeStruct(spec.bias_shape, layer.param_dtype)))
  try:
    mean = host.variable(COLLECTION, MEAN,
                         lambda: CenteringMean(zero().mean, spec))
  except flax.errors.ScopeCollectionNotFound as error:
    path = path_str(host.scope.path) or core.MODEL_PATH
    raise ValueError(
        f'the centered layer {path!r} finds no {COLLECTION!r} collection: pass'
        " it with the parameters, apply({'params': ..., 'centering': ...}, x),"
        " and in nn.scan/nn.vmap give it the axis of 'params', variable_axes="
        "{'params': 0, 'centering': 0} (a layer whose parameters the transform"
        ' broadcasts cannot be centered there: leave it out with where=).'
    ) from error
  recorded = host.variable(COLLECTION, RECORDED, lambda: zero().recorded)
  # An older collection without a count records the last call only, and
  # one without a residual rounds its 16-bit bias.
  count = None
  if host.is_initializing() or host.has_variable(COLLECTION, COUNT):
    count = host.variable(COLLECTION, COUNT, lambda: zero().count)
  if mask is not None:
    host.variable(COLLECTION, MASK, lambda: jnp.asarray(mask))
  if host.has_variable(COLLECTION, RESIDUAL) or (
      host.is_initializing() and zero().residual is not None):
    host.variable(COLLECTION, RESIDUAL, lambda: zero().residual)
  if (not use_running_average and not host.is_initializing()
      and host.is_mutable_collection(COLLECTION)):
    new = core.record(
        core.LayerState(spec, kernel_of(), None, mean.value, recorded.value,
                        None if count is None else count.value),
        inputs, axis_name)
    recorded.value = new.recorded
    if count is not None:
      _untransported.check('linen', count.value, new.count, mean.value)
      count.value = new.count
  return core.centered_output(spec, layer_fn, inputs, kernel_of, mean.value,
                              mask)


class Centered(nn.Module):
  """A linear layer reparameterized as ``z = W (a - mu) + b~`` (paper eq. 8).

  Written around a layer, ``Centered(nn.Dense(128))(x)``, with its
  parameters under ``dense`` or ``conv`` (:func:`center` needs no edit).
  ``mu`` (``'centering'/'mean'``) starts at zero; with ``'centering'``
  mutable in training, the forward pass records the input mean for
  :func:`transport` (as ``cbp_optax.nnx.Centered`` does; eager calls warn
  with :class:`cbp_optax.centering.UntransportedWarning`).

  Attributes:
    layer: an ``nn.Dense``, ``nn.DenseGeneral`` (no ``batch_dims``),
      ``nn.Conv`` (no input dilation) or ``nn.ConvTranspose`` (strides 1),
      with a bias; exact types only.
    use_running_average: True for evaluation (also a ``__call__`` argument).
    mean_dtype: dtype of ``mu``; defaults to the layer's ``param_dtype``.
    axis_name: the mapped batch axis to average the recorded mean over.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import flax.linen as nn
    >>> import cbp_optax as cbp
    >>> model = cbp.linen.Centered(nn.Dense(1))
    >>> x = jnp.array([[1.0, 2.0], [3.0, 4.0]])
    >>> variables = model.init(jax.random.key(0), x)
    >>> jax.tree.map(jnp.shape, variables['params'])
    {'dense': {'bias': (1,), 'kernel': (2, 1)}}
    >>> y, changed = model.apply(variables, x, mutable=['centering'])
    >>> changed['centering']['batch_mean']
    Array([2., 3.], dtype=float32)

  References:
    Layerwise Conditioned Backpropagation, §4.2, eqs. (8) and (9).
  """

  layer: nn.Module
  use_running_average: Optional[bool] = None
  mean_dtype: Optional[Any] = None
  axis_name: Optional[Any] = None

  def __post_init__(self):
    check_layer(self.layer)
    core.mean_dtype(self.mean_dtype, self.layer.param_dtype)
    super().__post_init__()

  @nn.compact
  def __call__(self, inputs: jax.Array, *args,
               use_running_average: Optional[bool] = None,
               **kwargs) -> jax.Array:
    if use_running_average is None:
      use_running_average = bool(self.use_running_average)
    layer = self.layer
    name = CONV if isinstance(layer, CONVS) else DENSE
    inner = layer.clone(parent=self, name=name)
    return centered_call(
        self, layer, lambda x: inner(x, *args, **kwargs),
        lambda: inner.variables['params']['kernel'], inputs,
        use_running_average, self.mean_dtype, self.axis_name)


def entries(centering: Any, path: tuple[str, ...] = ()
            ) -> Iterator[tuple[tuple[str, ...], Mapping[str, Any]]]:
  """``(path, entry)`` of every centered layer in a ``'centering'`` tree."""
  if isinstance(centering, Mapping) and MEAN in centering and (
      RECORDED in centering):
    yield path, centering
  else:
    for key, sub in centering.items():
      yield from entries(sub, path + (key,))


def layer_state(params: Mapping[str, Any], entry: Mapping[str, Any]
                ) -> core.LayerState:
  """A centered layer's ``params`` (kernel, bias) and ``entry``, for the core."""
  box = entry[MEAN]
  return core.LayerState(
      box.spec, params['kernel'], params['bias'], box.value, entry[RECORDED],
      entry.get(COUNT), entry.get(MASK), box.stack_axes, entry.get(RESIDUAL))


def transport_layer(params: dict[str, Any], entry: dict[str, Any],
                    mean_decay: Any, recorded_only: bool = True) -> Any:
  """The mean refresh and bias transport (eq. 10) of one layer's unfrozen
  ``params`` and ``entry``, in place; returns the shift of the optimizer's
  parameter copies (``core.copy_shift``)."""
  old = layer_state(params, entry)
  new = core.refresh(old, mean_decay, recorded_only)
  params['bias'], entry[MEAN] = new.bias, entry[MEAN].replace_boxed(new.mean)
  for key, value in ((COUNT, new.count), (RESIDUAL, new.residual)):
    if value is not None:
      entry[key] = value
  return core.copy_shift(old, new)
