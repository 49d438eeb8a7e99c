"""Conditioned Backpropagation for Flax Linen: centered layers and the fused step.

* :func:`center` turns an unmodified Linen module into one whose ``init``
  creates the ``'centering'`` collection and whose ``apply`` centers every
  supported linear layer, ``z = W (a - mu) + b~`` (eq. 8), attention
  projections and ``nn.scan``/``nn.vmap`` layer stacks included.
* :class:`Centered` wraps one layer, for models written with it.
* :func:`transport` is the pure mean refresh and bias transport
  (Algorithm 1, steps 10-11; eq. 10).
* :class:`TrainState` and :func:`train_step` give one jit-compiled iteration.
* :func:`stacked_blocks` tells M1 which parameters are layer stacks.

Example::

  model = cbp_optax.linen.center(MyModel())     # source unchanged
  variables = model.init(key, x)                # params + 'centering'
  state = cbp_optax.linen.TrainState.create(
      apply_fn=model.apply, params=variables['params'],
      centering=variables['centering'], tx=cbp_optax.cbp(1e-3))
  step = cbp_optax.linen.train_step(loss_fn)    # loss_fn(apply, *batch)
  state, out = step(state, images, labels)

References:
  Layerwise Conditioned Backpropagation: A Curvature-Aware
  Reparameterization of the Backward Pass with Convergence Guarantees,
  §4.2, eqs. (8)-(10), and Algorithm 1.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Mapping, NamedTuple, Optional, Union

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.core import meta
from flax.training import train_state

from cbp_optax import _batch_stats
from cbp_optax import _checks
from cbp_optax import _opt_state
from cbp_optax import _step
from cbp_optax import blocks
from cbp_optax import centering as core
from cbp_optax._step import StepOutput

__all__ = [
    'COLLECTION',
    'CenteredModel',
    'Centered',
    'CenteringMean',
    'StepOutput',
    'TrainState',
    'center',
    'eval_params',
    'muon_dimension_numbers',
    'recalibrate_batch_stats',
    'stacked_blocks',
    'train_step',
    'transport',
]

COLLECTION = 'centering'
_MEAN, _RECORDED, _MASK = 'mean', 'batch_mean', 'kernel_mask'
# How many input positions 'batch_mean' averages since the last transport.
_COUNT = 'batch_count'
# A 16-bit bias's float32 transport residual (core.needs_bias_residual).
_RESIDUAL = 'bias_residual'
# Inside the Centered wrapper the layer's parameters live under these names.
_DENSE, _CONV = 'dense', 'conv'


class CenteringMean(flax.struct.PyTreeNode, meta.AxisMetadata):
  """``mu`` in the ``'centering'`` collection, with what the transport needs.

  A Flax metadata box (like ``nn.Partitioned``): ``nn.scan`` and ``nn.vmap``
  call :meth:`add_axis` when they stack it, so ``stack_axes`` always says
  where the layer-stack axes are, and ``spec`` (static) describes one layer.
  ``.value`` is the array; ``nn.meta.unbox`` unboxes a whole collection.
  """

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


_SUPPORTED = (nn.Dense, nn.DenseGeneral, nn.Conv)


def check_layer(layer: Any) -> None:
  """Refuses, at construction, a layer that cannot be centered exactly."""
  if type(layer) not in _SUPPORTED:
    raise core.unsupported_layer_error(type(layer), _SUPPORTED)
  core.check_centerable(
      type(layer),
      use_bias=layer.use_bias,
      input_dilation=getattr(layer, 'input_dilation', None),
      batch_axes=getattr(layer, 'batch_dims', None),
  )


def _features(features: Union[int, tuple[int, ...]]) -> tuple[int, ...]:
  return (features,) if isinstance(features, int) else tuple(features)


def layer_spec(layer: nn.Module, inputs: jax.Array) -> core.LayerSpec:
  """The :class:`~cbp_optax.centering.LayerSpec` of a layer on ``inputs``."""
  check_layer(layer)
  if isinstance(layer, nn.Conv):
    kernel_size = _features(layer.kernel_size)
    return core.conv_spec(kernel_size, inputs.shape[-1], layer.features,
                          layer.feature_group_count)
  axis = -1 if isinstance(layer, nn.Dense) else layer.axis
  axes = core.normalize_axes(axis, inputs.ndim)
  return core.dense_spec(axis, tuple(inputs.shape[a] for a in axes),
                         _features(layer.features))


def _no_collection_message(host: nn.Module) -> str:
  path = '/'.join(host.scope.path) or core.MODEL_PATH
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
      'calls then share one mean).'
  )


def _centered_call(
    host: nn.Module,
    layer_fn: Callable[[jax.Array], jax.Array],
    kernel_of: Callable[[], jax.Array],
    spec: core.LayerSpec,
    mask: Optional[jax.Array],
    inputs: jax.Array,
    *,
    use_running_average: bool,
    mean_dtype: Any,
    axis_name: Any,
    bias_dtype: Any = None,
) -> jax.Array:
  """Eq. (8) with the statistics in ``host``'s ``'centering'`` collection."""
  try:
    mean = host.variable(
        COLLECTION, _MEAN,
        lambda: CenteringMean(jnp.zeros(spec.mean_shape, mean_dtype), spec))
  except flax.errors.ScopeCollectionNotFound as error:
    raise ValueError(_no_collection_message(host)) from error
  recorded = host.variable(COLLECTION, _RECORDED, jnp.zeros, spec.mean_shape,
                           mean_dtype)
  # A collection made before the count existed has none: it then records
  # the last call only, as it did.
  count = None
  if host.is_initializing() or host.has_variable(COLLECTION, _COUNT):
    count = host.variable(COLLECTION, _COUNT, jnp.zeros,
                          core.count_shape(spec.mean_shape),
                          core.count_dtype(mean_dtype))
  if mask is not None:
    host.variable(COLLECTION, _MASK, lambda: jnp.asarray(mask))
  # A collection made before the residual existed has none: its 16-bit
  # bias then rounds at every transport, as it did.
  if (bias_dtype is not None and core.needs_bias_residual(bias_dtype)
      and (host.is_initializing()
           or host.has_variable(COLLECTION, _RESIDUAL))):
    host.variable(COLLECTION, _RESIDUAL, jnp.zeros, spec.bias_shape,
                  jnp.float32)
  if (
      not use_running_average
      and not host.is_initializing()
      and host.is_mutable_collection(COLLECTION)
  ):
    if count is None:
      recorded.value = core.batch_mean(inputs, spec, mean_dtype, axis_name)
    else:
      recorded.value, count.value = core.record_mean(
          inputs, spec, recorded.value, count.value, axis_name)

  def kernel():
    value = kernel_of()
    return value if mask is None else value * mask

  return core.centered_output(spec, layer_fn, inputs, kernel, mean.value)


class Centered(nn.Module):
  """A linear layer reparameterized as ``z = W (a - mu) + b~`` (paper eq. 8).

  Write it around a layer as you would call the layer::

    x = Centered(nn.Dense(128))(x)

  The wrapper re-homes the layer under itself (parameters at
  ``<Centered>/dense`` or ``<Centered>/conv``), whether the layer was built in
  the parent's ``@nn.compact`` method, in ``setup``, or unbound. To center a
  model without editing it, use :func:`center` instead.

  ``mu`` (``'centering'/'mean'``, a :class:`CenteringMean` box) starts at
  zero, so the initial function is the layer's. With
  ``use_running_average=False`` and the ``'centering'`` collection mutable,
  the forward pass records the batch mean of its input
  (``'centering'/'batch_mean'``) and never changes ``mu``; :func:`transport`
  does, after the update. A layer called several times in one ``apply`` (an
  unrolled recurrent cell) records the mean over all its calls, each
  weighted by the positions it saw (``'centering'/'batch_count'``, which
  the transport sets back to zero). A convolution is centered after its
  padding and runs as the plain layer minus ``(sum over the window of W) .
  mu``; a conv ``mask`` is kept in ``'centering'/'kernel_mask'`` for the
  transport.

  Attributes:
    layer: an ``nn.Dense``, ``nn.DenseGeneral`` (without ``batch_dims``) or
      ``nn.Conv`` (without input dilation) with a bias. Exact types only.
    use_running_average: True for evaluation: use ``mu``, record nothing. May
      also be passed to ``__call__``.
    mean_dtype: dtype of ``mu``; defaults to the layer's ``param_dtype``.
    axis_name: the mapped batch axis to average the recorded mean over inside
      ``shard_map`` / ``pmap`` / ``vmap`` (not needed under ``jit``).

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
    Layerwise Conditioned Backpropagation: A Curvature-Aware
    Reparameterization of the Backward Pass with Convergence Guarantees,
    §4.2, eqs. (8) and (9).
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
      self,
      inputs: jax.Array,
      *args,
      use_running_average: Optional[bool] = None,
      **kwargs,
  ) -> jax.Array:
    if use_running_average is None:
      use_running_average = bool(self.use_running_average)
    layer = self.layer
    name = _CONV if isinstance(layer, nn.Conv) else _DENSE
    inner = layer.clone(parent=self, name=name)
    return _centered_call(
        self,
        lambda x: inner(x, *args, **kwargs),
        lambda: inner.variables['params']['kernel'],
        layer_spec(layer, inputs),
        getattr(layer, 'mask', None),
        inputs,
        use_running_average=use_running_average,
        mean_dtype=core.mean_dtype(self.mean_dtype, layer.param_dtype),
        axis_name=self.axis_name,
        bias_dtype=layer.param_dtype,
    )


_MAPPED_REASON = ('inside nn.map_variables: it computes with transformed '
                  'parameters, which the transport cannot see')


def _under_map_variables(module: nn.Module) -> bool:
  """Whether ``module`` runs inside ``nn.map_variables``.

  There the layer computes with ``trans_in_fn`` of its stored parameters (a
  mask, a tied or standardized weight), while the transport would move the
  stored bias by the stored kernel: inexact, so such layers are left as
  they are. (Flax names the lifted scope ``map_variables(...)``.)
  """
  return 'map_variables(' in module.scope.path_text


@functools.lru_cache(maxsize=None)
def _input_name(module_type: type) -> Optional[str]:
  """The name of the first argument of ``module_type.__call__`` after self."""
  try:
    parameters = list(
        inspect.signature(module_type.__call__).parameters.values())[1:]
  except (TypeError, ValueError):
    return None
  if parameters and parameters[0].kind in (
      inspect.Parameter.POSITIONAL_ONLY,
      inspect.Parameter.POSITIONAL_OR_KEYWORD):
    return parameters[0].name
  return None


def _call_input(
    module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any],
) -> tuple[bool, Any, tuple[Any, ...], dict[str, Any]]:
  """``(found, input, other args, other kwargs)`` of an intercepted call.

  The input is the call's first argument, given by position or by its name
  (``nn.Dense(1)(inputs=x)``, ``nn.BatchNorm()(x=h)``).
  """
  kwargs = dict(kwargs)
  if args:
    return True, args[0], tuple(args[1:]), kwargs
  name = _input_name(type(module))
  if name is not None and name in kwargs:
    return True, kwargs.pop(name), (), kwargs
  return False, None, tuple(args), kwargs


class CenteredModel(NamedTuple):
  """A Linen module run with every supported layer centered (see :func:`center`).

  ``init`` and ``apply`` take exactly what the module's own do; its
  parameters are the module's own, at the same paths, and the
  ``'centering'`` collection mirrors them (``centering/<layer path>/mean``).
  """

  module: nn.Module
  where: core.Where = None
  mean_dtype: Optional[Any] = None
  axis_name: Optional[Any] = None

  def _interceptor(self, next_fun, args, kwargs, context):
    module = context.module
    if context.method_name != '__call__' or type(module) not in _SUPPORTED:
      return next_fun(*args, **kwargs)
    path = '/'.join(module.scope.path)
    if not core.selected(self.where, path, module):
      return next_fun(*args, **kwargs)
    try:
      check_layer(module)
    except (TypeError, ValueError):
      return next_fun(*args, **kwargs)
    if _under_map_variables(module):
      return next_fun(*args, **kwargs)
    found, inputs, rest, kwargs = _call_input(module, args, kwargs)
    if not found:  # no input at all: the layer's own error says so
      return next_fun(*args, **kwargs)
    return _centered_call(
        module,
        lambda x: next_fun(x, *rest, **kwargs),
        lambda: module.get_variable('params', 'kernel'),
        layer_spec(module, inputs),
        getattr(module, 'mask', None),
        inputs,
        use_running_average=False,
        mean_dtype=core.mean_dtype(self.mean_dtype, module.param_dtype),
        axis_name=self.axis_name,
        bias_dtype=module.param_dtype,
    )

  def init(self, *args, **kwargs):
    """``module.init`` with the ``'centering'`` collection created."""
    with nn.intercept_methods(self._interceptor):
      return self.module.init(*args, **kwargs)

  def apply(self, *args, **kwargs):
    """``module.apply``, centered; records batch means when ``'centering'`` is mutable."""
    with nn.intercept_methods(self._interceptor):
      return self.module.apply(*args, **kwargs)

  def report(self, *args, **kwargs) -> core.CenterReport:
    """What centering does to the module called on ``args``.

    Traces ``init`` once (abstractly, nothing is computed) and lists, as
    ``cbp_optax.nnx.center`` does, the layers centered and every layer with
    parameters of its own left as it was, with a one-line reason (``str``
    of the result gives one line per layer type).

    Returns:
      A :class:`cbp_optax.centering.CenterReport` ``(centered, skipped)``.
    """
    centered, skipped = set(), set()

    def spy(next_fun, call_args, call_kwargs, context):
      out = next_fun(*call_args, **call_kwargs)
      module = context.module
      if context.method_name == '__call__' and _has_own_params(module):
        path = '/'.join(module.scope.path)
        try:
          check_layer(module)
          if _under_map_variables(module):
            reason = _MAPPED_REASON
          elif core.selected(self.where, path, module):
            reason = None
          else:
            reason = 'not selected by where'
        except (TypeError, ValueError) as error:
          reason = core.skip_reason(module, error)
        if reason:
          skipped.add((path or core.MODEL_PATH, reason))
        else:
          centered.add(path)
      return out

    with nn.intercept_methods(spy):
      jax.eval_shape(functools.partial(self.init, **kwargs), *args)
    return core.CenterReport(sorted(centered), sorted(skipped))


def _has_own_params(module: nn.Module) -> bool:
  params = module.variables.get('params', {})
  return any(not isinstance(v, Mapping) for v in params.values())


def center(
    module: nn.Module, *, where: core.Where = None,
    mean_dtype: Optional[Any] = None, axis_name: Optional[Any] = None,
) -> CenteredModel:
  """Centers every supported linear layer of an unmodified Linen module.

  Every ``nn.Dense``, ``nn.DenseGeneral`` and ``nn.Conv`` (exact types, with
  a bias) that the module calls is run as ``W (a - mu) + b~`` (eq. 8),
  wherever it is: ``@nn.compact`` or ``setup`` submodules, the q/k/v/out
  projections of ``nn.MultiHeadDotProductAttention`` / ``nn.SelfAttention``,
  and ``nn.scan``/``nn.vmap`` layer stacks (give the ``'centering'``
  collection the same ``variable_axes`` as ``'params'``). The module's
  source is not touched: the layers are intercepted at call time
  (``nn.intercept_methods``). Before training, the centered model computes
  exactly what the module does.

  Args:
    module: the Linen module.
    where: which layers: None for all, a type or tuple of types, or
      ``where(path, layer) -> bool`` with ``path`` like ``'Block_0/Dense_1'``.
    mean_dtype: dtype of the means; the layer's ``param_dtype`` by default.
    axis_name: the mapped batch axis to average recorded means over.

  Returns:
    A :class:`CenteredModel` with ``init``, ``apply`` and ``report``.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import flax.linen as nn
    >>> import cbp_optax as cbp
    >>> class MLP(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     x = nn.relu(nn.LayerNorm()(nn.Dense(4)(x)))
    ...     return nn.Dense(1)(x)
    >>> model = cbp.linen.center(MLP())
    >>> x = jnp.ones((8, 3))
    >>> variables = model.init(jax.random.key(0), x)
    >>> sorted(variables)
    ['centering', 'params']
    >>> variables['centering']['Dense_0']['mean'].value.shape
    (3,)
    >>> print(model.report(jax.random.key(0), x))
    centered (2): Dense_0, Dense_1
    left as is (1): LayerNorm_0 - LayerNorm: not a layer type centering knows (...)
    >>> plain = MLP().apply({'params': variables['params']}, x)
    >>> bool(jnp.array_equal(model.apply(variables, x), plain))
    True

  References:
    Layerwise Conditioned Backpropagation: A Curvature-Aware
    Reparameterization of the Backward Pass with Convergence Guarantees,
    §4.2, eq. (8).
  """
  if not isinstance(module, nn.Module):
    raise TypeError(
        f'center: module must be a flax.linen Module, got '
        f'{type(module).__name__}; for an NNX model use '
        'cbp_optax.nnx.center.')
  if mean_dtype is not None:
    core.mean_dtype(mean_dtype, None)
  return CenteredModel(module, core.check_where(where), mean_dtype, axis_name)


def _is_entry(tree: Any) -> bool:
  return isinstance(tree, Mapping) and _MEAN in tree and _RECORDED in tree


def _layer_params(layer_params: Mapping[str, Any]) -> tuple[Optional[str], Mapping[str, Any]]:
  if 'kernel' in layer_params:
    return None, layer_params
  for name in (_DENSE, _CONV):
    if name in layer_params:
      return name, layer_params[name]
  raise ValueError(
      'transport: a centering entry has no matching layer parameters '
      f'(expected kernel and bias, or a {_DENSE!r} or {_CONV!r} subtree, found '
      f'{sorted(layer_params)}); pass the params and centering collections '
      'of the same model.'
  )


def _transport_layer(layer_params, entry, mean_decay, path, moves):
  box = entry[_MEAN]
  if not isinstance(box, CenteringMean):
    raise ValueError(
        'transport: the centering mean is not a CenteringMean box (a '
        'collection from an older version, or unboxed with nn.meta.unbox): '
        'initialize the model again.'
    )
  name, inner = _layer_params(layer_params)
  mask, residual = entry.get(_MASK), entry.get(_RESIDUAL)
  moved = core.transport(
      box.spec, inner['kernel'], inner['bias'], box.value, entry[_RECORDED],
      mean_decay, mask=mask, mean_stack_axes=box.stack_axes,
      residual=residual)
  bias, mean = moved[0], moved[1]
  layer_path = path if name is None else path + (name,)
  moves.append(_opt_state.LayerMove(
      path=layer_path, kernel_key=('kernel',), bias_key=('bias',),
      bias_shape=tuple(jnp.shape(inner['bias'])), kernel=inner['kernel'],
      kernel_trained=True,
      shift=functools.partial(
          core.shift_bias, box.spec, mean=box.value, new_mean=mean,
          mask=mask, mean_stack_axes=box.stack_axes)))
  inner = dict(inner, bias=bias)
  new_params = inner if name is None else dict(layer_params, **{name: inner})
  new_entry = _restart_recording(
      dict(entry, **{_MEAN: box.replace_boxed(mean)}))
  if residual is not None:
    new_entry[_RESIDUAL] = moved[2]
  return new_params, new_entry


def _restart_recording(entry: Mapping[str, Any]) -> dict[str, Any]:
  """A centering entry whose next training call records a fresh mean.

  The transport calls it once it has used the recorded mean, so that every
  step records the calls of its own forward pass only.
  """
  if _COUNT not in entry:
    return dict(entry)
  return dict(entry, **{_COUNT: jnp.zeros_like(entry[_COUNT])})


def _transport_tree(params, centering, mean_decay, path=(), moves=None):
  if _is_entry(centering):
    return _transport_layer(params, centering, mean_decay, path, moves)
  new_params, new_centering = dict(params), dict(centering)
  for key, sub in centering.items():
    if key not in params:
      raise ValueError(
          f'transport: centering has a subtree {key!r} that params lacks; '
          'pass the params and centering collections of the same model.'
      )
    new_params[key], new_centering[key] = _transport_tree(
        params[key], sub, mean_decay, path + (key,), moves)
  return new_params, new_centering


def _freeze_like(like: Any, tree: Any) -> Any:
  if isinstance(like, flax.core.FrozenDict):
    return flax.core.freeze(tree)
  return tree


def _lookahead(params: Any) -> bool:
  return isinstance(params, optax.LookaheadParams)


def _moves(params: Any, centering: Any) -> list[_opt_state.LayerMove]:
  """The centered layers, for classifying an optimizer state (no transport)."""
  if _lookahead(params):
    params = params.fast
  moves = []
  boxes = flax.core.unfreeze(centering)

  def visit(params, entries, path):
    if _is_entry(entries):
      name, inner = _layer_params(params)
      moves.append(_opt_state.LayerMove(
          path=path if name is None else path + (name,),
          kernel_key=('kernel',), bias_key=('bias',),
          bias_shape=tuple(jnp.shape(inner['bias'])), kernel=inner['kernel'],
          kernel_trained=True, shift=None))
      return
    for key, sub in entries.items():
      if key in params:
        visit(params[key], sub, path + (key,))

  visit(flax.core.unfreeze(params), boxes, ())
  return moves


# The optimizers (tx) whose states the fused step classified.
_CLASSIFIED = _opt_state.CheckCache()


def check_opt_state(params: Any, centering: Any, opt_state: Any) -> None:
  """Refuses, before any tracing, an optimizer state the transport cannot
  classify (see :func:`transport`)."""
  _opt_state.transport_state(opt_state, _moves(params, centering),
                             what='opt_state')


def transport(
    params: Any, centering: Any, mean_decay: Any = 0.99, *,
    opt_state: Any = None, decay: Any = None,
) -> tuple[Any, ...]:
  """Mean refresh and bias transport for every centered layer (pure).

  ``mu_new = mean_decay * mu + (1 - mean_decay) * batch_mean`` and
  ``b~ += W (mu_new - mu_old)`` with the weights in ``params`` (pass the
  *updated* parameters; Algorithm 1, steps 10-11, eq. 10). Layer stacks are
  transported slice by slice. The model's output is unchanged for every
  input.

  Pass the ``opt_state`` whenever it may hold copies of the parameters
  (``optax.contrib.schedule_free``'s ``z``, SAM's cache, the initial point
  of DoG, Prodigy, MADGRAD, Mechanic or COCOB, or a state declared with
  :func:`cbp_optax.centering.register_parameter_state`): each copy's biases
  move by its own kernel, so every function the optimizer holds is
  unchanged too, and the new state is returned third. Gradient statistics
  are left as they are; a parameter-shaped tree in a state type the
  transport does not know raises
  :class:`cbp_optax.centering.UnclassifiedStateError`. ``params`` may also
  be ``optax.LookaheadParams``: the fast and the slow parameters both move,
  each by its own kernel.

  Args:
    params: the ``'params'`` collection (or ``optax.LookaheadParams`` of
      two).
    centering: the ``'centering'`` collection (with recorded batch means).
    mean_decay: the EMA decay ``rho`` of the means, in ``[0, 1)``.
    opt_state: the optimizer's state, to move its parameter copies too.
    decay: deprecated name of ``mean_decay``.

  Returns:
    ``(params, centering)`` with transported biases and refreshed means, in
    the containers they came in (dict or FrozenDict);
    ``(params, centering, opt_state)`` when ``opt_state`` is given.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import flax.linen as nn
    >>> import cbp_optax as cbp
    >>> model = cbp.linen.center(nn.Dense(1))
    >>> x = jnp.array([[1.0, 2.0], [3.0, 4.0]])
    >>> variables = model.init(jax.random.key(0), x)
    >>> y, changed = model.apply(variables, x, mutable=['centering'])
    >>> params, centering = cbp.linen.transport(
    ...     variables['params'], changed['centering'], mean_decay=0.5)
    >>> centering['mean'].value
    Array([1. , 1.5], dtype=float32)
    >>> y_new = model.apply({'params': params, 'centering': centering}, x)
    >>> bool(jnp.allclose(y_new, y, atol=1e-6))
    True

  References:
    Layerwise Conditioned Backpropagation: A Curvature-Aware
    Reparameterization of the Backward Pass with Convergence Guarantees,
    eq. (10) and Algorithm 1, steps 10-11.
  """
  mean_decay = _step.mean_decay_argument(mean_decay, decay, 'transport')
  if opt_state is not None:
    check_opt_state(params, centering, opt_state)
  lookahead = _lookahead(params)
  fast = params.fast if lookahead else params
  moves = []
  new_params, new_centering = _transport_tree(
      flax.core.unfreeze(fast), flax.core.unfreeze(centering), mean_decay,
      (), moves)
  new_params = _freeze_like(fast, new_params)
  new_centering = _freeze_like(centering, new_centering)
  if lookahead:
    slow = _opt_state.transport_copy(params.slow, moves, 'params.slow')
    new_params = params._replace(fast=new_params, slow=slow)
  if opt_state is None:
    return new_params, new_centering
  return new_params, new_centering, _opt_state.transport_state(
      opt_state, moves, what='opt_state')


def eval_params(params: Any, opt_state: Any = None) -> Any:
  """The parameters to evaluate a (centered) model at.

  Schedule-free optimizers train at one point and evaluate at another,
  ``x = (y - (1 - b1) z) / b1`` (``optax.contrib.schedule_free_eval_params``);
  for an ``opt_state`` holding a ``schedule_free`` state (at any depth of a
  chain or wrapper) this is ``x``, to be used with the model's
  ``'centering'`` collection as it is: the transport moved ``y`` and ``z``
  alike, so ``x`` is consistent with the means. ``optax.LookaheadParams``
  give their slow parameters. Otherwise ``params`` themselves. For a model
  with BatchNorm, recalibrate its statistics at these parameters
  (:func:`recalibrate_batch_stats`) before evaluating.

  Args:
    params: the trained ``'params'`` (or ``optax.LookaheadParams``).
    opt_state: the optimizer state, or None.

  Returns:
    A parameter tree like ``params`` (the slow one for lookahead).

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import cbp_optax as cbp
    >>> params = {'w': jnp.ones(2)}
    >>> opt_state = optax.contrib.schedule_free_sgd(0.1).init(params)
    >>> cbp.linen.eval_params(params, opt_state)['w']
    Array([1., 1.], dtype=float32)
  """
  if _lookahead(params):
    return params.slow
  if opt_state is None:
    return params
  return _opt_state.evaluation_params(opt_state, params)


def muon_dimension_numbers(params: Any, centering: Any) -> Callable[[Any], Any]:
  """Muon's ``muon_weight_dimension_numbers`` for a (centered) Linen model.

  ``optax.contrib.muon`` orthogonalizes 2-D matrices and sends every other
  parameter to AdamW unless told how to see a kernel as a matrix. For every
  centered layer this is derived from its recorded configuration: a dense
  kernel's contracted input axes are the reduction axes and its feature
  axes the output axes (``nn.DenseGeneral`` and attention projections
  included); a convolution's window and input-channel axes are the
  reduction axes (``(h, w, c_in, c_out)`` seen as ``(h w c_in, c_out)``);
  the stack axes of ``nn.scan`` / ``nn.vmap`` stacks are batch axes. Any
  other leaf named ``kernel`` with two or more axes is seen as a matrix over
  its last axis; biases, norms and embeddings get None (AdamW).

  Args:
    params: the ``'params'`` collection.
    centering: the ``'centering'`` collection (empty for a plain model).

  Returns:
    ``dims(params)``, for ``optax.contrib.muon(...,
    muon_weight_dimension_numbers=dims)``.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import flax.linen as nn
    >>> import cbp_optax as cbp
    >>> model = cbp.linen.center(nn.Conv(4, (3, 3)))
    >>> variables = model.init(jax.random.key(0), jnp.ones((1, 5, 5, 3)))
    >>> dims = cbp.linen.muon_dimension_numbers(
    ...     variables['params'], variables['centering'])
    >>> dims(variables['params'])['kernel']
    MuonDimensionNumbers(reduction_axis=(0, 1, 2), output_axis=(3,))
  """
  table = {}

  def plain(path, leaf):
    if str(blocks.key_name(path[-1])) == 'kernel' and jnp.ndim(leaf) >= 2:
      names = tuple(str(blocks.key_name(k)) for k in path)
      table[names] = optax.contrib.MuonDimensionNumbers(
          reduction_axis=tuple(range(jnp.ndim(leaf) - 1)),
          output_axis=(jnp.ndim(leaf) - 1,))

  jax.tree_util.tree_map_with_path(plain, flax.core.unfreeze(params))
  unfrozen = flax.core.unfreeze(params)
  for move in _moves(params, centering):
    layer = unfrozen
    for key in move.path:
      layer = layer[key]
    box = _entry_at(centering, move.path)[_MEAN]
    _, axes, _ = core.layer_axes(box.spec, layer['kernel'], layer['bias'],
                                 box.value, box.stack_axes)
    names = tuple(str(k) for k in move.path) + ('kernel',)
    table[names] = core.muon_dimension_numbers(box.spec, axes)
  return _opt_state.dimension_numbers_fn(table)


def _entry_at(centering: Any, layer_path: tuple[Any, ...]) -> Mapping[str, Any]:
  """The centering entry of the layer whose parameters are at ``layer_path``."""
  entry = flax.core.unfreeze(centering)
  for key in layer_path:
    if _is_entry(entry):
      break  # the rest is the wrapper's inner name ('dense' or 'conv')
    entry = entry[key]
  return entry


def stacked_blocks(params: Any, centering: Any, *stack_paths: str):
  """The ``stacked=`` predicate of ``cbp.cbp`` / ``cbp.equalize`` for a model.

  M1 (eq. 7) should see one block per layer of a layer stack. A stack's root
  is found from the centered layers in it (their means carry the stack's
  leading axis): the highest module above a stacked centered layer all of
  whose parameters share that leading axis. Name stack roots explicitly
  (``'ScanBlock_0'``) to override or for a model without centered layers.

  Args:
    params: the ``'params'`` collection.
    centering: the ``'centering'`` collection.
    *stack_paths: module paths of layer stacks, like ``'Decoder_0/layers'``.

  Returns:
    ``stacked(path, leaf) -> bool``, True for parameters inside a stack.

  Examples:
    Three ``nn.Dense`` layers scanned with ``nn.scan`` and one head: four M1
    blocks.

    >>> import jax, jax.numpy as jnp
    >>> import flax.linen as nn
    >>> import cbp_optax as cbp
    >>> class Block(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x, _):
    ...     return nn.Dense(2)(x), None
    >>> class Stack(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     layers = nn.scan(Block, length=3, split_rngs={'params': True},
    ...                      variable_axes={'params': 0, 'centering': 0})
    ...     x, _ = layers(name='layers')(x, None)
    ...     return nn.Dense(1)(x)
    >>> model = cbp.linen.center(Stack())
    >>> variables = model.init(jax.random.key(0), jnp.ones((4, 2)))
    >>> stacked = cbp.linen.stacked_blocks(
    ...     variables['params'], variables['centering'])
    >>> stacked
    stacked_predicate(['layers'])
    >>> cbp.block_names(variables['params'], stacked=stacked)
    ('Dense_0', 'layers/Dense_0[0]', 'layers/Dense_0[1]', 'layers/Dense_0[2]')
    >>> tx = cbp.cbp(1e-3, stacked=stacked)

  References:
    Layerwise Conditioned Backpropagation: A Curvature-Aware
    Reparameterization of the Backward Pass with Convergence Guarantees,
    eq. (7).
  """
  shapes = {
      tuple(blocks.key_name(k) for k in path): tuple(jnp.shape(leaf))
      for path, leaf in jax.tree_util.tree_leaves_with_path(
          flax.core.unfreeze(params))
  }
  roots = blocks.check_stack_paths(shapes, stack_paths)
  if not stack_paths:
    stacks, unstacked = [], []

    def visit(tree, path):
      if _is_entry(tree):
        box = tree[_MEAN]
        if box.stack_axes and box.stack_axes[0] == 0:
          stacks.append((path, box.value.shape[0]))
        elif not box.stack_axes:
          unstacked.append(path)
        return
      for key, sub in tree.items():
        visit(sub, path + (str(key),))

    visit(flax.core.unfreeze(centering), ())
    for path, size in stacks:
      roots.add(blocks.stack_root(shapes, path, size, unstacked))
  return blocks.stacked_predicate(roots)


class TrainState(train_state.TrainState):
  """``flax.training.train_state.TrainState`` with the model's other state.

  Create it with ``TrainState.create(apply_fn=..., params=...,
  centering=variables['centering'], model_state={'batch_stats': ...},
  tx=...)``; ``centering`` may be empty for an uncentered model.
  ``model_state`` holds every other variable collection the model reads and
  updates in training (BatchNorm's ``batch_stats``, ...). ``step`` counts
  the updates applied and ``skipped_steps`` the batches :func:`train_step`
  skipped as non-finite.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import flax.linen as nn
    >>> import cbp_optax as cbp
    >>> model = cbp.linen.center(nn.Dense(1))
    >>> variables = model.init(jax.random.key(0), jnp.ones((4, 2)))
    >>> state = cbp.linen.TrainState.create(
    ...     apply_fn=model.apply, params=variables['params'],
    ...     centering=variables['centering'], tx=cbp.cbp(1e-3))
    >>> int(state.step), int(state.skipped_steps), state.model_state
    (0, 0, {})
  """

  centering: Any = flax.struct.field(default_factory=dict)
  model_state: Any = flax.struct.field(default_factory=dict)
  skipped_steps: jax.Array = flax.struct.field(
      default_factory=lambda: jnp.zeros((), jnp.int32)
  )


def _like(container: Any, tree: Any) -> Any:
  # Keep the container type (dict or FrozenDict) so the skip can select.
  if isinstance(container, flax.core.FrozenDict):
    return flax.core.freeze(tree)
  return flax.core.unfreeze(tree)


def train_step(
    loss_fn: Callable[..., Any], *, mean_decay: Any = 0.99,
    donate: bool = True, decay: Any = None,
) -> Callable[..., tuple[TrainState, StepOutput]]:
  """One jit-compiled CBP iteration for a Linen model (Algorithm 1, 1-11).

  The returned ``step(state, *batch)`` runs the forward pass with centering
  (recording batch means), the backward pass, ``state.tx`` (``cbp.cbp`` for
  full CBP, any optax transform otherwise, e.g. ``optax.adam`` for "Adam +
  Center"), the parameter update and :func:`transport` (of the parameters
  and of the optimizer state's copies of them), in one ``jax.jit``
  with the state donated. A non-finite loss, gradient or recorded statistic
  skips the step: the returned state equals the input state (parameters,
  optimizer state, centering, model state, step) but for ``skipped_steps``,
  which grows by one, and ``StepOutput.skipped`` is True. Called directly on
  CPU, the step compiles with XLA's
  ``xla_cpu_copy_insertion_use_region_analysis`` (no parameter-sized
  copies). Called inside your own ``jax.jit`` it is traced into your
  program, with the same numbers, bit for bit.

  Args:
    loss_fn: ``loss_fn(apply, *batch)`` returning a scalar loss or ``(loss,
      aux)``. ``apply(*args, **kwargs)`` runs ``state.apply_fn`` on the
      current parameters, centering and model state, with those collections
      mutable; pass training flags and ``rngs={'dropout': key}`` through it.
      Call it once per step.
    mean_decay: the EMA decay ``rho`` of the centering means, in ``[0, 1)``.
    donate: donate the input state's buffers to the step.
    decay: deprecated name of ``mean_decay``.

  Returns:
    ``step(state, *batch) -> (state, StepOutput)``.

  Raises:
    ValueError: a ``mean_decay`` outside ``[0, 1)`` (at construction).
    TypeError: a first argument that is not a :class:`TrainState` (at the
      call); an optimizer state the transport cannot classify
      (:class:`cbp_optax.centering.UnclassifiedStateError`, at the call,
      before tracing).

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import flax.linen as nn
    >>> import cbp_optax as cbp
    >>> class MLP(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     return nn.Dense(1)(nn.relu(nn.Dense(4)(x)))
    >>> model = cbp.linen.center(MLP())
    >>> x, y = jnp.ones((8, 3)), jnp.zeros((8, 1))
    >>> variables = model.init(jax.random.key(0), x)
    >>> state = cbp.linen.TrainState.create(
    ...     apply_fn=model.apply, params=variables['params'],
    ...     centering=variables['centering'], tx=cbp.cbp(1e-3))
    >>> def loss_fn(apply, x, y):
    ...   return jnp.mean((apply(x) - y) ** 2)
    >>> step = cbp.linen.train_step(loss_fn, mean_decay=0.99)
    >>> state, out = step(state, x, y)
    >>> out.loss.shape, bool(out.skipped), int(state.step)
    ((), False, 1)
    >>> state.centering['Dense_1']['mean'].value  # 0.99 * 0 + 0.01 * mean(x)
    Array([0.01, 0.01, 0.01], dtype=float32)
    >>> state, out = step(state, x, jnp.full((8, 1), jnp.nan))
    >>> bool(out.skipped), int(state.step), int(state.skipped_steps)
    (True, 1, 1)

  References:
    Layerwise Conditioned Backpropagation: A Curvature-Aware
    Reparameterization of the Backward Pass with Convergence Guarantees,
    Algorithm 1.
  """
  mean_decay = _step.mean_decay_argument(mean_decay, decay, 'train_step')
  _checks.check_function('loss_fn', loss_fn)
  _checks.check_bool('donate', donate)

  def step(state: TrainState, *batch):
    def loss_of(params):
      mutated = []

      def apply(*args, **kwargs):
        if mutated:
          raise ValueError(
              'train_step: loss_fn called apply twice; the recorded means and '
              'batch statistics of one step must come from one forward pass. '
              'Concatenate the inputs into one call.'
          )
        variables = {'params': params, COLLECTION: state.centering,
                     **state.model_state}
        mutable = [COLLECTION, *state.model_state]
        out, changed = state.apply_fn(variables, *args, mutable=mutable,
                                      **kwargs)
        if changed.get(COLLECTION) and not state.centering:
          raise ValueError(
              'train_step: the model creates a centering collection but the '
              'TrainState has none: pass centering=variables["centering"] '
              'to TrainState.create.'
          )
        extra = set(changed) - set(mutable)
        if extra:
          raise ValueError(
              f'train_step: the model created collections {sorted(extra)} '
              'that the TrainState lacks: pass them in model_state.'
          )
        mutated.append(changed)
        return out

      loss, aux = _step.split_loss(loss_fn(apply, *batch))
      _step.check_scalar_loss(loss)
      changed = mutated[0] if mutated else {}
      centering = _like(state.centering,
                        changed.get(COLLECTION, state.centering))
      model_state = _like(state.model_state, {
          k: changed.get(k, v) for k, v in state.model_state.items()})
      return loss, (aux, (centering, model_state))

    def apply_step(state, grads, changed):
      centering, model_state = changed
      updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
      if centering:
        params, centering, opt_state = transport(
            params, centering, mean_decay, opt_state=opt_state)
      return state.replace(step=state.step + 1, params=params,
                           opt_state=opt_state, centering=centering,
                           model_state=model_state)

    def skip_step(state, grads, changed):
      del grads, changed
      return state.replace(skipped_steps=state.skipped_steps + 1)

    return _step.conditioned_update(
        loss_of, state.params, apply_step, skip_step, _step.select, state)

  jitted = _step.jit_step(step, donate_argnums=(0,) if donate else ())

  def train(*args):
    if not args or not isinstance(args[0], TrainState):
      got = f'a {type(args[0]).__name__}' if args else 'no argument'
      raise TypeError(
          'train_step: step(state, *batch) takes a cbp_optax.linen.TrainState '
          f'first, got {got}: build it with '
          'cbp_optax.linen.TrainState.create(apply_fn=..., params=..., '
          'centering=..., tx=...).'
      )
    state = args[0]
    if state.centering:
      # Classified once per tx (again while tracing, for any other state).
      _CLASSIFIED.check(
          state.tx, id(state.apply_fn),
          lambda: check_opt_state(state.params, state.centering,
                                  state.opt_state))
    if donate:
      args = (_step.unaliased(state),) + args[1:]
    return jitted(*args)

  train.lower = jitted.lower
  return train


# Beside every BatchNorm's statistics during recalibration only: how many
# positions, and in how many calls, it normalized so far in one batch.
_POOL_COUNT, _POOL_CALLS = 'cbp_recalibration_count', 'cbp_recalibration_calls'


def _is_norm_entry(tree: Any) -> bool:
  return (isinstance(tree, Mapping) and {'mean', 'var'} <= set(tree)
          and not any(isinstance(v, Mapping) for v in tree.values()))


def _with_counts(stats: Any) -> Any:
  """``batch_stats`` with empty accumulators beside every mean (stacked alike)."""
  if _is_norm_entry(stats):
    empty = _batch_stats.empty_like(stats['mean'], stats['var'])
    return dict(stats, **{_POOL_COUNT: empty.count, _POOL_CALLS: empty.calls})
  if isinstance(stats, Mapping):
    return {k: _with_counts(v) for k, v in stats.items()}
  return stats


def _counted_entries(stats: Any, path: tuple[str, ...] = ()) -> dict[str, Any]:
  if isinstance(stats, Mapping) and _POOL_COUNT in stats:
    return {'/'.join(path): _batch_stats.Moments(
        stats[_POOL_COUNT], stats['mean'], stats['var'], stats[_POOL_CALLS])}
  found = {}
  if isinstance(stats, Mapping):
    for key, sub in stats.items():
      found.update(_counted_entries(sub, path + (str(key),)))
  return found


def _replace_entries(stats: Any, new: Mapping[str, Any],
                     path: tuple[str, ...] = ()) -> Any:
  if not isinstance(stats, Mapping):
    return stats
  key = '/'.join(path)
  if _is_norm_entry(stats) and key in new:
    mean, var = new[key]
    return dict(stats, mean=mean.astype(jnp.result_type(stats['mean'])),
                var=var.astype(jnp.result_type(stats['var'])))
  return {k: _replace_entries(v, new, path + (str(k),))
          for k, v in stats.items()}


def recalibrate_batch_stats(
    apply_fn: Callable[..., Any], variables: Any, batches: Any,
    **apply_kwargs: Any,
) -> Any:
  """Sets every BatchNorm's running averages to population statistics.

  "Precise BatchNorm": the parameters frozen, each ``nn.BatchNorm``'s
  running mean and variance (``batch_stats``) become the mean and the
  (biased) variance of all its inputs over ``batches``, pooled (the
  variance of the pooled inputs, not an average of batch variances),
  instead of an EMA over a network that kept changing. Every call counts: a
  BatchNorm applied several times in one forward pass pools all its inputs,
  and each call is weighted by the positions it normalized (the product of
  its reduced axes' sizes, or its mask's sum), so time-major batches weigh
  what they hold and an empty batch weighs nothing. Every BatchNorm
  normalizes with its batch's statistics, as in training, whatever its
  ``use_running_average``; pass the model's evaluation flags in
  ``apply_kwargs`` (``train=False``) so that dropout is off. Only
  ``batch_stats`` changes (the ``'centering'`` collection is not mutable:
  nothing is recorded), and only for the BatchNorms the forward pass calls;
  ``nn.scan``/``nn.vmap`` stacks get per-slice statistics. Use it before
  evaluating with running averages after a short run, a large learning
  rate, or a BatchNorm momentum close to 1, where they lag the network; a
  few dozen training batches suffice.

  Args:
    apply_fn: ``model.apply`` (of a centered model or not).
    variables: the model's variables, with ``batch_stats``.
    batches: an iterable of training batches, each an array or a tuple of
      positional arguments of ``apply_fn`` after the variables.
    **apply_kwargs: keyword arguments of every ``apply_fn`` call.

  Returns:
    ``variables`` with new ``batch_stats`` (same container type).

  Raises:
    ValueError: ``variables`` without ``batch_stats``, no batches, a
      BatchNorm that normalized no example in any batch (all empty), or
      statistics that are not finite.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import flax.linen as nn
    >>> import cbp_optax as cbp
    >>> class Net(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x, train: bool = True):
    ...     x = nn.Dense(3, name='dense')(x)
    ...     return nn.BatchNorm(use_running_average=not train)(x)
    >>> model = Net()
    >>> batches = [jnp.ones((4, 2)), jnp.zeros((4, 2))]
    >>> variables = model.init(jax.random.key(0), batches[0], train=False)
    >>> variables = cbp.linen.recalibrate_batch_stats(
    ...     model.apply, variables, batches, train=False)
    >>> inputs = nn.Dense(3).apply(
    ...     {'params': variables['params']['dense']}, jnp.concatenate(batches))
    >>> stats = variables['batch_stats']['BatchNorm_0']
    >>> bool(jnp.allclose(stats['mean'], inputs.mean(0)))
    True
    >>> bool(jnp.allclose(stats['var'], inputs.var(0)))
    True
  """
  if 'batch_stats' not in variables:
    raise ValueError(
        'recalibrate_batch_stats: variables has no batch_stats collection '
        '(no BatchNorm layer).')

  def interceptor(next_fun, args, kwargs, context):
    module = context.module
    if not (type(module) is nn.BatchNorm  # pylint: disable=unidiomatic-typecheck
            and context.method_name == '__call__'
            and module.has_variable('batch_stats', _POOL_COUNT)):
      return next_fun(*args, **kwargs)
    found, x, _, kwargs = _call_input(module, args, kwargs)
    if not found:
      return next_fun(*args, **kwargs)
    mask = kwargs.get('mask')
    call = _batch_stats.moments(
        x, module.axis, mask=mask, axis_name=module.axis_name,
        axis_index_groups=module.axis_index_groups)
    so_far = _batch_stats.Moments(*(
        module.get_variable('batch_stats', name)
        for name in (_POOL_COUNT, 'mean', 'var', _POOL_CALLS)))
    # Batch statistics whatever the constructor or the call says (Linen
    # refuses the flag in both places, so clear the constructor's; a
    # positional flag is dropped with the other positional arguments).
    kwargs = dict(kwargs, use_running_average=False)
    constructed = module.use_running_average
    object.__setattr__(module, 'use_running_average', None)
    try:
      out = next_fun(x, **kwargs)
    finally:
      object.__setattr__(module, 'use_running_average', constructed)
    pooled = _batch_stats.combine(so_far, call)
    for name, value in ((_POOL_COUNT, pooled.count), ('mean', pooled.mean),
                        ('var', pooled.var), (_POOL_CALLS, pooled.calls)):
      module.put_variable('batch_stats', name, value)
    return out

  @jax.jit
  def batch_moments(variables, batch):
    with nn.intercept_methods(interceptor):
      _, changed = apply_fn(variables, *_batch_stats.as_args(batch),
                            mutable=['batch_stats'], **apply_kwargs)
    return _counted_entries(flax.core.unfreeze(changed['batch_stats']))

  plain = flax.core.unfreeze(variables)
  counted = dict(plain, batch_stats=_with_counts(plain['batch_stats']))
  stats = _batch_stats.finish(_batch_stats.pool(
      batch_moments(counted, batch) for batch in batches))
  new = dict(plain, batch_stats=_replace_entries(plain['batch_stats'], stats))
  if isinstance(variables, flax.core.FrozenDict):
    return flax.core.freeze(new)
  return new
