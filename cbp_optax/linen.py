"""Conditioned Backpropagation for Flax Linen: centered layers and the fused step.

* :class:`Centered` wraps an ``nn.Dense``, ``nn.DenseGeneral`` or ``nn.Conv``
  so that it computes ``z = W (a - mu) + b~`` (eq. 8); ``mu`` and the recorded
  batch mean live in the ``'centering'`` collection.
* :func:`transport` is the pure mean refresh and bias transport
  (Algorithm 1, steps 10-11; eq. 10).
* :class:`TrainState` and :func:`train_step` give one jit-compiled iteration.

Example::

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.relu(cbp_optax.linen.Centered(nn.Dense(256))(x))
      return cbp_optax.linen.Centered(nn.Dense(10))(x)

  variables = MLP().init(key, x)
  state = cbp_optax.linen.TrainState.create(
      apply_fn=MLP().apply, params=variables['params'],
      centering=variables['centering'], tx=cbp_optax.cbp(1e-3))
  step = cbp_optax.linen.train_step(loss_fn)  # loss_fn(apply, *batch)
  state, out = step(state, images, labels)
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

from cbp_optax import _step
from cbp_optax import centering as centering_lib
from cbp_optax._step import StepOutput

__all__ = [
    'COLLECTION',
    'Centered',
    'StepOutput',
    'TrainState',
    'train_step',
    'transport',
]

COLLECTION = 'centering'
_MEAN, _RECORDED = 'mean', 'batch_mean'
# The wrapped layer's parameters live under this name inside the wrapper; the
# transport reads the layer kind from it.
_DENSE, _CONV = 'dense', 'conv'


class Centered(nn.Module):
  """A linear layer reparameterized as ``z = W (a - mu) + b~`` (paper eq. 8).

  Write it around a layer as you would call the layer::

    x = Centered(nn.Dense(128))(x)

  The wrapper re-homes the layer under itself (parameters at
  ``<Centered>/dense`` or ``<Centered>/conv``), whether the layer was built in
  the parent's ``@nn.compact`` method, in ``setup``, or unbound; the layer's
  own auto-name in the parent is left unused.

  ``mu`` (``'centering'/'mean'``) starts at zero, so the initial function is
  the layer's. With ``use_running_average=False`` and the ``'centering'``
  collection mutable, the forward pass records the batch mean of its input
  (``'centering'/'batch_mean'``: per input feature, or per input channel over
  batch and spatial positions for a convolution) and never changes ``mu``;
  :func:`transport` does, after the update. A convolution is centered after
  its padding (``mu`` is subtracted at the border too), which keeps the
  transport exact there; it runs as the plain layer, on the raw input, minus
  ``(sum over the window of W) . mu`` (``centering.conv_mean_correction``).

  Attributes:
    layer: an ``nn.Dense``, ``nn.DenseGeneral`` (without ``batch_dims``) or
      ``nn.Conv`` (without input dilation) with a bias.
    use_running_average: True for evaluation: use ``mu``, record nothing. May
      also be passed to ``__call__``.
    mean_dtype: dtype of ``mu``; defaults to the layer's ``param_dtype``.
    axis_name: the mapped batch axis to average the recorded mean over inside
      ``shard_map`` / ``pmap`` / ``vmap`` (not needed under ``jit``, where a
      sharded batch's mean is already global).
  """

  layer: nn.Module
  use_running_average: Optional[bool] = None
  mean_dtype: Optional[Any] = None
  axis_name: Optional[Any] = None

  def __post_init__(self):
    _check_supported(self.layer)
    super().__post_init__()

  @nn.compact
  def __call__(
      self, inputs: jax.Array, use_running_average: Optional[bool] = None
  ) -> jax.Array:
    if use_running_average is None:
      use_running_average = bool(self.use_running_average)
    layer = self.layer
    dtype = self.mean_dtype or layer.param_dtype
    if isinstance(layer, nn.Conv):
      axes = (inputs.ndim - 1,)
    elif isinstance(layer, nn.DenseGeneral):
      axes = centering_lib.normalize_axes(layer.axis, inputs.ndim)
    else:
      axes = (inputs.ndim - 1,)
    shape = tuple(inputs.shape[a] for a in axes)
    mean = self.variable(COLLECTION, _MEAN, jnp.zeros, shape, dtype)
    recorded = self.variable(COLLECTION, _RECORDED, jnp.zeros, shape, dtype)
    if (
        not use_running_average
        and not self.is_initializing()
        and self.is_mutable_collection(COLLECTION)
    ):
      recorded.value = centering_lib.batch_mean(
          inputs, axes, dtype, self.axis_name
      )

    if isinstance(layer, nn.Conv):
      # conv(pad(a) - mu) as conv(a) minus a per-channel constant: the plain
      # layer's convolution and gradients, no pass over the activation.
      inner = layer.clone(parent=self, name=_CONV)
      outputs = inner(inputs)
      kernel = inner.variables['params']['kernel']
      correction = centering_lib.conv_mean_correction(
          kernel, mean.value, layer.feature_group_count
      )
      return outputs - correction.astype(outputs.dtype)
    inner = layer.clone(parent=self, name=_DENSE)
    return inner(centering_lib.subtract_mean(inputs, mean.value, axes))


def _check_supported(layer: Any) -> None:
  if not isinstance(layer, (nn.Dense, nn.DenseGeneral, nn.Conv)):
    raise TypeError(
        'Centered wraps nn.Dense, nn.DenseGeneral or nn.Conv; got '
        f'{type(layer).__name__}. Transposed and locally connected '
        'convolutions are not supported: no single bias shift keeps them '
        'exact.'
    )
  if not layer.use_bias:
    raise ValueError(
        f'Centered needs a bias to transport (eq. 10); {type(layer).__name__}'
        ' was built with use_bias=False.'
    )
  if isinstance(layer, nn.Conv):
    centering_lib.check_conv_supported(layer.input_dilation, layer.use_bias)
    if layer.mask is not None:
      # transport(params, centering) sees the parameters, not the module, so
      # it would shift the bias with the unmasked kernel: not exact.
      raise ValueError(
          'Centered (Linen) does not support a conv mask: the pure transport '
          'cannot see it and would move the bias by the unmasked kernel. Use '
          'cbp_optax.nnx.Centered, whose transport applies the mask.'
      )
  if isinstance(layer, nn.DenseGeneral) and layer.batch_dims:
    raise ValueError(
        'Centered does not support DenseGeneral with batch_dims: the kernel '
        'then differs along the batch axes and so would mu.'
    )


def _is_centered_entry(tree: Any) -> bool:
  return isinstance(tree, Mapping) and _MEAN in tree and _RECORDED in tree


def _transport_layer(layer_params, entry, decay):
  old, recorded = entry[_MEAN], entry[_RECORDED]
  new = centering_lib.ema(old, recorded, decay)
  if _CONV in layer_params:
    name = _CONV
    kernel = layer_params[_CONV]['kernel']
    groups = old.shape[0] // kernel.shape[-2]
    shift = centering_lib.conv_bias_shift(kernel, new - old, groups)
  elif _DENSE in layer_params:
    name = _DENSE
    shift = centering_lib.dense_bias_shift(
        layer_params[_DENSE]['kernel'], new - old
    )
  else:
    raise ValueError(
        'transport: a centering entry has no matching layer parameters '
        f'(expected a {_DENSE!r} or {_CONV!r} subtree, found '
        f'{sorted(layer_params)}); pass the params and centering collections '
        'of the same model.'
    )
  inner = dict(layer_params[name])
  inner['bias'] = centering_lib.transported_bias(inner['bias'], shift)
  new_params = dict(layer_params)
  new_params[name] = inner
  new_entry = dict(entry)
  new_entry[_MEAN] = new
  return new_params, new_entry


def _transport_tree(params, centering, decay):
  if _is_centered_entry(centering):
    return _transport_layer(params, centering, decay)
  new_params, new_centering = dict(params), dict(centering)
  for key, sub in centering.items():
    if key not in params:
      raise ValueError(
          f'transport: centering has a subtree {key!r} that params lacks; '
          'pass the params and centering collections of the same model.'
      )
    new_params[key], new_centering[key] = _transport_tree(
        params[key], sub, decay
    )
  return new_params, new_centering


def transport(
    params: Any, centering: Any, decay: Any = 0.99
) -> tuple[Any, Any]:
  """Mean refresh and bias transport for every centered layer (pure).

  ``mu_new = decay * mu + (1 - decay) * batch_mean`` and
  ``b~ += W (mu_new - mu_old)`` with the weights in ``params`` (pass the
  *updated* parameters; Algorithm 1, steps 10-11, eq. 10). The model's output
  is unchanged for every input.

  Args:
    params: the ``'params'`` collection.
    centering: the ``'centering'`` collection (with recorded batch means).
    decay: the EMA decay ``rho`` of the means.

  Returns:
    ``(params, centering)`` with transported biases and refreshed means, in
    the containers they came in (dict or FrozenDict).
  """
  frozen = isinstance(params, flax.core.FrozenDict)
  new_params, new_centering = _transport_tree(
      flax.core.unfreeze(params), flax.core.unfreeze(centering), decay
  )
  if frozen:
    return flax.core.freeze(new_params), flax.core.freeze(new_centering)
  return new_params, new_centering


class TrainState(train_state.TrainState):
  """``flax.training.train_state.TrainState`` with the centering collection.

  Create it with ``TrainState.create(apply_fn=..., params=...,
  centering=variables['centering'], tx=...)``; ``centering`` may be empty for
  an uncentered model. ``step`` counts the updates applied and
  ``skipped_steps`` the batches :func:`train_step` skipped as non-finite.
  """

  centering: Any = flax.struct.field(default_factory=dict)
  skipped_steps: jax.Array = flax.struct.field(
      default_factory=lambda: jnp.zeros((), jnp.int32)
  )


def train_step(
    loss_fn: Callable[..., Any],
    *,
    decay: float = 0.99,
    donate: bool = True,
) -> Callable[..., tuple[TrainState, StepOutput]]:
  """One jit-compiled CBP iteration for a Linen model (Algorithm 1, 1-11).

  The returned ``step(state, *batch)`` runs the forward pass with centering
  (recording batch means), the backward pass, ``state.tx`` (``cbp.cbp`` for
  full CBP, any optax transform otherwise, e.g. ``optax.adam`` for "Adam +
  Center"), the parameter update and :func:`transport`, in one ``jax.jit``
  with the state donated. A non-finite loss, gradient or recorded batch mean
  skips the step: the returned state equals the input state (parameters,
  optimizer state, centering, step) but for ``skipped_steps``, which grows by
  one, and ``StepOutput.skipped`` is True. On CPU the step compiles with
  ``_step.compiler_options()`` (no parameter-sized buffer copies).

  Args:
    loss_fn: ``loss_fn(apply, *batch)`` returning a scalar loss or ``(loss,
      aux)``. ``apply(*args, **kwargs)`` runs ``state.apply_fn`` on the
      current parameters and centering with the ``'centering'`` collection
      mutable; pass your model's training flags through it.
    decay: the EMA decay ``rho`` of the centering means.
    donate: donate the input state's buffers to the step.

  Returns:
    ``step(state, *batch) -> (state, StepOutput)``.
  """

  def step(state: TrainState, *batch):
    def loss_of(params):
      recorded = {}

      def apply(*args, **kwargs):
        variables = {'params': params, COLLECTION: state.centering}
        out, mutated = state.apply_fn(
            variables, *args, mutable=[COLLECTION], **kwargs
        )
        recorded['centering'] = mutated.get(COLLECTION, state.centering)
        return out

      loss, aux = _step.split_loss(loss_fn(apply, *batch))
      _step.check_scalar_loss(loss)
      centering = recorded.get('centering', state.centering)
      # Keep the container type (dict or FrozenDict) so the skip can select.
      if isinstance(state.centering, flax.core.FrozenDict):
        centering = flax.core.freeze(centering)
      else:
        centering = flax.core.unfreeze(centering)
      return loss, (aux, centering)

    (loss, (aux, centering)), grads = jax.value_and_grad(
        loss_of, has_aux=True
    )(state.params)
    ok = _step.all_finite(loss, grads, centering)

    def apply_step(state):
      updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
      new_centering = centering
      if centering:
        params, new_centering = transport(params, centering, decay)
      return state.replace(
          step=state.step + 1,
          params=params,
          opt_state=opt_state,
          centering=new_centering,
      )

    def skip_step(state):
      return state.replace(skipped_steps=state.skipped_steps + 1)

    # A conditional, not a select of old and new state: selecting would keep
    # every old buffer alive next to the new one and cost full copies.
    new_state = jax.lax.cond(ok, apply_step, skip_step, state)
    return new_state, StepOutput(
        loss=loss, aux=aux, skipped=jnp.logical_not(ok)
    )

  return jax.jit(
      step,
      donate_argnums=(0,) if donate else (),
      compiler_options=_step.compiler_options(),
  )
