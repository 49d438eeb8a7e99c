"""Conditioned Backpropagation for Flax NNX: centered layers and the fused step.

* :class:`Centered` wraps an ``nnx.Linear``, ``nnx.LinearGeneral`` or
  ``nnx.Conv`` so that it computes ``z = W (a - mu) + b~`` (eq. 8).
* :func:`transport` refreshes every centering mean and moves the biases so the
  function is unchanged (Algorithm 1, steps 10-11; eq. 10).
* :func:`train_step` builds one ``nnx.jit``-compiled CBP iteration.

Example::

  model = nnx.Sequential(
      cbp_optax.nnx.Centered(nnx.Linear(784, 256, rngs=rngs)), nnx.relu,
      cbp_optax.nnx.Centered(nnx.Linear(256, 10, rngs=rngs)))
  optimizer = nnx.Optimizer(model, cbp_optax.cbp(1e-3), wrt=nnx.Param)
  step = cbp_optax.nnx.train_step(loss_fn)   # loss_fn(model, *batch)
  out = step(model, optimizer, images, labels)   # out.loss, out.skipped
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from cbp_optax import _step
from cbp_optax import centering as centering_lib
from cbp_optax._step import StepOutput

__all__ = [
    'Centered',
    'CenteringMean',
    'Optimizer',
    'RecordedMean',
    'StepOutput',
    'train_step',
    'transport',
]


class CenteringMean(nnx.BatchStat):
  """The EMA ``mu`` a centered layer subtracts from its input (eq. 8)."""


class RecordedMean(nnx.BatchStat):
  """The input mean of the last training batch, consumed by :func:`transport`."""


_SUPPORTED = (nnx.Linear, nnx.LinearGeneral, nnx.Conv)


class Centered(nnx.Module):
  """A linear layer reparameterized as ``z = W (a - mu) + b~`` (paper eq. 8).

  ``mu`` starts at zero, so a freshly wrapped layer computes exactly what the
  layer did. The forward pass centers with the stored ``mu`` and, in training
  mode, records the batch mean of its input (per input feature; per input
  channel over batch and spatial positions for convolutions); it never changes
  ``mu`` itself. :func:`transport` does, after the parameter update, together
  with the bias shift that keeps the function unchanged. ``model.eval()`` (or
  ``nnx.view(model, use_running_average=True)``) stops the recording;
  ``model.train()`` resumes it.

  A convolution is centered after its padding (``mu`` is subtracted at the
  border too, which keeps the transport exact there). It runs as the plain
  layer, on the raw input with its own padding, minus
  ``(sum over the window of W) . mu`` (``centering.conv_mean_correction``):
  the same values and gradients (eq. 9), without a pass over the activation.

  Args:
    layer: an ``nnx.Linear``, ``nnx.LinearGeneral`` (without batch axes) or
      ``nnx.Conv`` (without input dilation), built with a bias.
    use_running_average: True stops recording batch means (evaluation).
    mean_dtype: dtype of ``mu``; defaults to the layer's ``param_dtype``.
    axis_name: the mapped batch axis to average the recorded mean over inside
      ``shard_map`` / ``pmap`` / ``vmap`` (not needed under ``jit``, where a
      sharded batch's mean is already global).

  Raises:
    TypeError: for any other layer type (e.g. ``nnx.ConvTranspose``, whose
      inserted zeros make an exact transport impossible).
    ValueError: for a layer without bias or with input dilation.
  """

  def __init__(
      self,
      layer: nnx.Module,
      *,
      use_running_average: bool = False,
      mean_dtype: Optional[Any] = None,
      axis_name: Optional[Any] = None,
  ):
    if not isinstance(layer, _SUPPORTED):
      raise TypeError(
          'Centered wraps nnx.Linear, nnx.LinearGeneral or nnx.Conv; got '
          f'{type(layer).__name__}. Transposed convolutions and input '
          'dilation insert zeros that a mean shift would not move, so no bias '
          'transport could keep them exact.'
      )
    if not layer.use_bias:
      raise ValueError(
          f'Centered needs a bias to transport (eq. 10); {type(layer).__name__}'
          ' was built with use_bias=False.'
      )
    dtype = mean_dtype or layer.param_dtype
    if isinstance(layer, nnx.Conv):
      centering_lib.check_conv_supported(layer.input_dilation, layer.use_bias)
      shape = (layer.in_features,)
    elif isinstance(layer, nnx.LinearGeneral):
      if layer.batch_axis:
        raise ValueError(
            'Centered does not support LinearGeneral with batch_axis: the '
            'kernel then differs along the batch axes and so would mu.'
        )
      shape = tuple(layer.in_features)
    else:
      shape = (layer.in_features,)
    self.layer = layer
    self.use_running_average = use_running_average
    self.axis_name = axis_name
    self.mean = CenteringMean(jnp.zeros(shape, dtype))
    self.batch_mean = RecordedMean(jnp.zeros(shape, dtype))

  def set_view(self, use_running_average: Optional[bool] = None):
    """Used by ``nnx.view``: ``use_running_average=True`` for evaluation."""
    if use_running_average is not None:
      self.use_running_average = use_running_average

  def _feature_axes(self, inputs: jax.Array) -> tuple[int, ...]:
    if isinstance(self.layer, nnx.LinearGeneral):
      return centering_lib.normalize_axes(self.layer.axis, inputs.ndim)
    return (inputs.ndim - 1,)

  def __call__(self, inputs: jax.Array) -> jax.Array:
    axes = self._feature_axes(inputs)
    if not self.use_running_average:
      self.batch_mean[...] = centering_lib.batch_mean(
          inputs, axes, self.batch_mean.dtype, self.axis_name
      )
    if isinstance(self.layer, nnx.Conv):
      # conv(pad(a) - mu) as conv(a) minus a per-channel constant: the plain
      # layer's convolution and gradients, no pass over the activation.
      outputs = self.layer(inputs)
      correction = centering_lib.conv_mean_correction(
          self._kernel(), self.mean[...], self.layer.feature_group_count
      )
      return outputs - correction.astype(outputs.dtype)
    return self.layer(centering_lib.subtract_mean(inputs, self.mean[...], axes))

  def _kernel(self) -> jax.Array:
    """The kernel the layer convolves with (``mask`` applied)."""
    kernel = self.layer.kernel[...]
    if getattr(self.layer, 'mask', None) is not None:
      kernel = kernel * self.layer.mask
    return kernel

  def transport(self, decay: Any = 0.99) -> None:
    """Refreshes ``mu`` from the recorded mean and shifts the bias (eq. 10)."""
    old = self.mean[...]
    new = centering_lib.ema(old, self.batch_mean[...], decay)
    if isinstance(self.layer, nnx.Conv):
      shift = centering_lib.conv_bias_shift(
          self._kernel(), new - old, self.layer.feature_group_count
      )
    else:
      shift = centering_lib.dense_bias_shift(self.layer.kernel[...], new - old)
    self.layer.bias[...] = centering_lib.transported_bias(
        self.layer.bias[...], shift
    )
    self.mean[...] = new


class Optimizer(nnx.Optimizer):
  """``nnx.Optimizer`` that also counts the steps :func:`train_step` skipped.

  ``optimizer.skipped_steps`` (an ``nnx.OptState`` int32 scalar) grows by one
  for every batch whose loss, gradients or recorded means were not finite;
  ``optimizer.step`` counts only the updates applied. A plain
  ``nnx.Optimizer`` works with :func:`train_step` too, without the count.
  """

  def __init__(self, model: nnx.Module, tx: Any, *, wrt: Any = nnx.Param):
    super().__init__(model, tx, wrt=wrt)
    self.skipped_steps = nnx.OptState(jnp.zeros((), jnp.int32))


def centered_layers(model: nnx.Module) -> list[Centered]:
  """Every :class:`Centered` layer inside ``model``."""
  return [m for _, m in nnx.iter_modules(model) if isinstance(m, Centered)]


def transport(model: nnx.Module, decay: Any = 0.99) -> None:
  """Mean refresh and bias transport for every centered layer, in place.

  ``mu_new = decay * mu + (1 - decay) * batch_mean``, then
  ``b~ += W (mu_new - mu_old)`` with the current (updated) weights
  (Algorithm 1, steps 10-11), so the model's output is unchanged. Call it
  after the optimizer update, inside the same ``nnx.jit`` -- or use
  :func:`train_step`, which does.

  Args:
    model: any NNX module; layers that are not :class:`Centered` are ignored.
    decay: the EMA decay ``rho`` of the means.
  """
  for layer in centered_layers(model):
    layer.transport(decay)


def train_step(
    loss_fn: Callable[..., Any],
    *,
    decay: float = 0.99,
    donate: bool = True,
) -> Callable[..., StepOutput]:
  """One jit-compiled CBP iteration for an NNX model (Algorithm 1, steps 1-11).

  The returned ``step(model, optimizer, *batch)`` runs the forward pass with
  centering (recording batch means), the backward pass, ``optimizer.update``
  with whatever optax transform the ``nnx.Optimizer`` holds (``cbp.cbp`` for
  full CBP, ``optax.adam`` for "Adam + Center"), then :func:`transport`; all
  inside one ``nnx.jit`` with the model and optimizer buffers donated. If the
  loss, any gradient or any recorded batch mean is not finite the step is
  skipped: parameters, optimizer state and centering statistics stay exactly
  as they were, ``StepOutput.skipped`` is True, and a :class:`Optimizer`
  counts it in ``skipped_steps``. With no centered layer it is an ordinary
  train step. On CPU the step compiles with ``_step.compiler_options()``
  (no parameter-sized buffer copies); ``step.lower(model, optimizer,
  *batch)`` gives the lowered program for inspection or AOT compilation.

  Args:
    loss_fn: ``loss_fn(model, *batch)`` returning a scalar loss or
      ``(loss, aux)``; it runs the model in training mode.
    decay: the EMA decay ``rho`` of the centering means.
    donate: donate the model and optimizer buffers to the step.

  Returns:
    ``step(model, optimizer, *batch) -> StepOutput``; the model and optimizer
    are updated in place.
  """

  def step(model, optimizer, *batch):
    graphdef, params, rest = nnx.split(model, optimizer.wrt, ...)
    rest = nnx.as_pure(rest)

    def loss_of(params):
      # A pure function of the parameters, so it differentiates the same way
      # in graph and tree mode. Merging builds fresh Variables at this trace
      # level (from arrays for `rest`), which the forward pass may write
      # batch means into; `params` keeps its Variable types so the gradients
      # pass `optimizer.update`'s `wrt` filter.
      model = nnx.merge(graphdef, params, rest)
      loss, aux = _step.split_loss(loss_fn(model, *batch))
      _step.check_scalar_loss(loss)
      return loss, (aux, nnx.state(model, nnx.Not(optimizer.wrt)))

    (loss, (aux, recorded)), grads = jax.value_and_grad(
        loss_of, has_aux=True
    )(params)
    ok = _step.all_finite(loss, grads, recorded)

    def apply_step(model, optimizer, grads, recorded):
      nnx.update(model, recorded)
      optimizer.update(model, grads)
      transport(model, decay)

    def skip_step(model, optimizer, grads, recorded):
      del model, grads, recorded
      if isinstance(optimizer, Optimizer):
        optimizer.skipped_steps[...] += 1

    # A conditional, not a select of old and new state: selecting would keep
    # every old buffer alive next to the new one and cost full copies.
    nnx.cond(ok, apply_step, skip_step, model, optimizer, grads, recorded)
    return StepOutput(loss=loss, aux=aux, skipped=jnp.logical_not(ok))

  jitted = nnx.jit(step, donate_argnums=(0, 1) if donate else ())
  options = _step.compiler_options()
  if options is None:
    return jitted
  # nnx.jit takes no compiler options, but its AOT path does: compile once
  # per model structure and batch signature, as jit's own cache would.
  executables = {}

  def step_with_options(model, optimizer, *batch):
    signature = (
        nnx.graphdef((model, optimizer)),
        jax.tree.structure(batch),
        tuple((jnp.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(batch)),
    )
    if signature not in executables:
      executables[signature] = jitted.lower(model, optimizer, *batch).compile(
          options
      )
    return executables[signature](model, optimizer, *batch)

  step_with_options.lower = jitted.lower
  return step_with_options
