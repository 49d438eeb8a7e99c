"""Linen ``Centered`` and its ``'centering'`` entries: ``z = W (a - mu) + b~`` (eq. 8)."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Union

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import meta

from cbp_optax import _untransported
from cbp_optax import centering as core
from cbp_optax._paths import path_str


COLLECTION = 'centering'

# The entries of core.LayerState's mean, recorded, count and residual, and
# a convolution's kernel mask.
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
    moved = tuple(a + 1 if a >= index else a for a in self.stack_axes)
    return self.replace(stack_axes=tuple(sorted(moved + (index,))))

  def remove_axis(self, index: int, params: dict[Any, Any]) -> 'CenteringMean':
    return self.replace(stack_axes=tuple(
        a - 1 if a > index else a for a in self.stack_axes if a != index))


SUPPORTED = (nn.Dense, nn.DenseGeneral, nn.Conv, nn.ConvTranspose)
CONVS = (nn.Conv, nn.ConvTranspose)


def check_layer(layer: Any) -> None:
  """Refuses, at construction, a layer that cannot be centered exactly."""
  if type(layer) not in SUPPORTED:
    raise core.unsupported_layer_error(type(layer), SUPPORTED)
  core.check_centerable(
      type(layer),
      use_bias=layer.use_bias,
      input_dilation=getattr(layer, 'input_dilation', None),
      batch_axes=getattr(layer, 'batch_dims', None),
      transposed_strides=(layer.strides
                          if isinstance(layer, nn.ConvTranspose) else None))


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


def _no_collection_message(host: nn.Module) -> str:
  path = path_str(host.scope.path) or core.MODEL_PATH
  return (
      f'cbp_optax.linen: the centered layer {path!r} finds no {COLLECTION!r} '
      'collection. Inside nn.scan or nn.vmap (or another lifted transform), '
      f'add {COLLECTION!r} to variable_axes with the same axis as '
      "'params', e.g. nn.scan(Block, variable_axes={'params': 0, "
      "'centering': 0}, split_rngs={'params': True}, length=n); at apply, "
      "pass it with the parameters: apply({'params': params, 'centering': "
      "centering}, x). A layer whose parameters the transform broadcasts "
      '(a recurrent cell scanned over time) cannot be centered inside it: '
      'leave it out with center(..., where=...), or unroll the loop (its '
      'calls then share one mean).')


def centered_call(
    host: nn.Module, layer: nn.Module,
    layer_fn: Callable[[jax.Array], jax.Array],
    kernel_of: Callable[[], jax.Array], inputs: jax.Array,
    use_running_average: bool, mean_dtype: Any, axis_name: Any,
) -> jax.Array:
  """Eq. (8) for ``layer`` (run as ``layer_fn``), with the statistics in
  ``host``'s ``'centering'`` collection."""
  spec, mask = layer_spec(layer, inputs), getattr(layer, 'mask', None)
  mean_dtype = core.mean_dtype(mean_dtype, layer.param_dtype)
  try:
    mean = host.variable(
        COLLECTION, MEAN,
        lambda: CenteringMean(jnp.zeros(spec.mean_shape, mean_dtype), spec))
  except flax.errors.ScopeCollectionNotFound as error:
    raise ValueError(_no_collection_message(host)) from error
  recorded = host.variable(COLLECTION, RECORDED, jnp.zeros, spec.mean_shape,
                           mean_dtype)
  # An older collection without a count records the last call only.
  count = None
  if host.is_initializing() or host.has_variable(COLLECTION, COUNT):
    count = host.variable(COLLECTION, COUNT, core.zero_count,
                          spec.mean_shape, mean_dtype)
  if mask is not None:
    host.variable(COLLECTION, MASK, lambda: jnp.asarray(mask))
  # An older collection without a residual rounds its 16-bit bias.
  if core.needs_bias_residual(layer.param_dtype) and (
      host.is_initializing() or host.has_variable(COLLECTION, RESIDUAL)):
    host.variable(COLLECTION, RESIDUAL, jnp.zeros, spec.bias_shape, jnp.float32)
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

  Write it around a layer as you would call the layer::

    x = Centered(nn.Dense(128))(x)

  Parameters live under ``<Centered>/dense`` or ``/conv`` (:func:`center`
  centers a model without editing it). ``mu`` (``'centering'/'mean'``)
  starts at zero; with ``'centering'`` mutable in training, the forward pass
  records the batch mean (as ``cbp_optax.nnx.Centered``; eager calls warn
  with :class:`cbp_optax.centering.UntransportedWarning`) for
  :func:`transport`.

  Attributes:
    layer: an ``nn.Dense``, ``nn.DenseGeneral`` (without ``batch_dims``),
      ``nn.Conv`` (without input dilation) or ``nn.ConvTranspose`` (with
      strides 1), with a bias. Exact types only.
    use_running_average: True for evaluation (also a ``__call__`` argument).
    mean_dtype: dtype of ``mu``; defaults to the layer's ``param_dtype``.
    axis_name: the mapped batch axis to average the recorded mean over.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import flax.linen as nn
    >>> import cbp_optax as cbp
    >>> class Net(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     return cbp.linen.Centered(nn.Dense(1))(x)
    >>> x = jnp.array([[1.0, 2.0], [3.0, 4.0]])
    >>> variables = Net().init(jax.random.key(0), x)
    >>> jax.tree.map(jnp.shape, variables['params'])
    {'Centered_0': {'dense': {'bias': (1,), 'kernel': (2, 1)}}}
    >>> variables['centering']['Centered_0']['mean'].value
    Array([0., 0.], dtype=float32)
    >>> y, changed = Net().apply(variables, x, mutable=['centering'])
    >>> changed['centering']['Centered_0']['batch_mean']
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
  def __call__(
      self, inputs: jax.Array, *args,
      use_running_average: Optional[bool] = None, **kwargs,
  ) -> jax.Array:
    if use_running_average is None:
      use_running_average = bool(self.use_running_average)
    layer = self.layer
    name = CONV if isinstance(layer, CONVS) else DENSE
    inner = layer.clone(parent=self, name=name)
    return centered_call(
        self, layer, lambda x: inner(x, *args, **kwargs),
        lambda: inner.variables['params']['kernel'], inputs,
        use_running_average, self.mean_dtype, self.axis_name)


def is_entry(tree: Any) -> bool:
  return isinstance(tree, Mapping) and MEAN in tree and RECORDED in tree


def entry_at(centering: Any, layer_path: tuple[Any, ...]) -> Mapping[str, Any]:
  """The centering entry of the layer whose parameters are at ``layer_path``."""
  entry = flax.core.unfreeze(centering)
  for key in layer_path:
    if is_entry(entry):
      break  # the rest is the wrapper's inner name ('dense' or 'conv')
    entry = entry[key]
  return entry
