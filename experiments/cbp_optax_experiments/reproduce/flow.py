"""Training engine of the diagnostics studies: every step's block profiles.

Like ``training.make_trainer`` (one ``lax.scan`` per run, seeds and learning
rates vmapped, M2 transport after every update), but each step also records
``cbp_optax_experiments.diagnostics.gradient_profile`` of the raw gradient and
``update_profile`` of the update the optimizer applies, in depth order, and the
run returns its initial and final parameters so that the studies can measure
movement and curvature with the public diagnostics.
"""

from __future__ import annotations

import re
from typing import Any, Callable, NamedTuple, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import cbp_optax as cbp
from cbp_optax_experiments import diagnostics
from cbp_optax_experiments.reproduce import training


def depth_order(names: Sequence[str]) -> list[int]:
  """Indices that sort block names ``layer_<i>[/...]`` by ``i`` (tree order
  is lexicographic: layer_0, layer_1, layer_10, ...)."""
  def layer(i):
    match = re.match(r'layer_(\d+)', names[i])
    if match is None:
      raise ValueError(f'block {names[i]!r} is not named layer_<i>')
    return int(match.group(1))
  return sorted(range(len(names)), key=layer)


class FlowRun(NamedTuple):
  """One run; leading axes are whatever the caller vmapped over."""
  losses: jax.Array          # (steps,) minibatch loss
  grad_norms: jax.Array      # (steps, L) raw gradient block norms, depth order
  update_norms: jax.Array    # (steps, L) applied update block norms
  relative_updates: jax.Array  # (steps, L) ||u_l|| / ||theta_l||
  val_loss: jax.Array        # () at the end
  test_loss: jax.Array
  test_accuracy: jax.Array
  test_logits: jax.Array     # (n_test, classes)
  movement: jax.Array        # () ||theta - theta_0|| / ||theta_0||
  hessian_trace: jax.Array   # () Hutchinson estimate at the end (or nan)
  hessian_stderr: jax.Array  # () its standard error (or nan)


class NormMLP(nn.Module):
  """ReLU MLP with optional LayerNorm / BatchNorm before every activation.

  Layers are named ``layer_<i>`` (the Dense or centered Dense), norms
  ``norm_<i>``; ``train`` switches BatchNorm between batch and running
  statistics.
  """
  hidden: Sequence[int]
  classes: int
  norm: Optional[str] = None  # None, 'layer' or 'batch'
  centered: bool = False
  activation: Callable[[jax.Array], jax.Array] = nn.relu
  kernel_init: Callable[..., jax.Array] = nn.initializers.variance_scaling(
      2.0, 'fan_in', 'normal')

  @nn.compact
  def __call__(self, x, *, train: bool = False):
    widths = list(self.hidden) + [self.classes]
    for i, width in enumerate(widths):
      if self.centered:
        dense = nn.Dense(width, kernel_init=self.kernel_init, parent=None)
        x = cbp.linen.Centered(dense, name=f'layer_{i}')(x)
      else:
        x = nn.Dense(width, kernel_init=self.kernel_init,
                     name=f'layer_{i}')(x)
      if i == len(widths) - 1:
        break
      if self.norm == 'layer':
        x = nn.LayerNorm(name=f'norm_{i}')(x)
      elif self.norm == 'batch':
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9,
                         name=f'norm_{i}')(x)
      x = self.activation(x)
    return x


def profile_block_fn(path, leaf):
  """One block per ``layer_<i>`` (its norm's scale and shift join it), so the
  profiles and M1 see one block per depth."""
  del leaf
  name = getattr(path[0], 'key', str(path[0]))
  return re.sub(r'^norm_', 'layer_', str(name))


def make_run(
    model: nn.Module,
    method: training.Method,
    data: training.Dataset,
    *,
    steps: int,
    batch_size: int,
    block_fn: Optional[Callable[..., Any]] = None,
    hessian_samples: int = 0,
    hessian_batch: int = 512,
) -> Callable[..., FlowRun]:
  """``run(seed_key, learning_rate, init_scale=1.0) -> FlowRun``.

  ``init_scale`` multiplies every initial kernel (a Gaussian initialization
  scaled by alpha). With ``hessian_samples > 0`` the run ends with
  ``diagnostics.hessian_trace`` of the loss on the first ``hessian_batch``
  training examples (evaluation mode) at the final parameters.
  """
  train_x, train_y = jnp.asarray(data.train_x), jnp.asarray(data.train_y)
  val_x, val_y = jnp.asarray(data.val_x), jnp.asarray(data.val_y)
  test_x, test_y = jnp.asarray(data.test_x), jnp.asarray(data.test_y)
  n_train = train_x.shape[0]

  def run(seed_key, learning_rate, init_scale=1.0):
    init_key, data_key = jax.random.split(seed_key)
    params, collections = training.init_variables(model, init_key,
                                                  train_x[:2])
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x * init_scale if getattr(path[-1], 'key', None) ==
        'kernel' else x, params)
    tx = method.make_tx(learning_rate)

    def step(carry, index):
      params, collections, opt_state = carry
      batch = jax.random.randint(jax.random.fold_in(data_key, index),
                                 (batch_size,), 0, n_train)

      def loss_of(p):
        logits, mutated = model.apply(
            {'params': p, **collections}, train_x[batch], train=True,
            mutable=list(collections))
        return (training.cross_entropy(logits, train_y[batch]),
                {**collections, **mutated})

      (loss, recorded), grads = jax.value_and_grad(loss_of, has_aux=True)(
          params)
      updates, opt_state = tx.update(grads, opt_state, params)
      raw = diagnostics.gradient_profile(grads, block_fn=block_fn)
      applied = diagnostics.update_profile(updates, params,
                                           block_fn=block_fn)
      order = jnp.asarray(depth_order(raw.names))
      params = optax.apply_updates(params, updates)
      if method.centered:
        params, centering = cbp.linen.transport(
            params, recorded['centering'], training.RHO)
        recorded = {**recorded, 'centering': centering}
      return (params, recorded, opt_state), (
          loss, raw.norms[order], applied.norms[order],
          applied.relative[order])

    (final, collections, _), (losses, grad_norms, update_norms, relative) = (
        jax.lax.scan(step, (params, collections, tx.init(params)),
                     jnp.arange(steps)))
    evaluate = lambda x: model.apply({'params': final, **collections}, x,
                                     train=False)
    val_loss = training.cross_entropy(evaluate(val_x), val_y)
    test_logits = evaluate(test_x)
    movement = diagnostics.parameter_movement(final, params).total
    trace = stderr = jnp.full((), jnp.nan)
    if hessian_samples:
      x, y = train_x[:hessian_batch], train_y[:hessian_batch]
      loss = lambda p: training.cross_entropy(
          model.apply({'params': p, **collections}, x, train=False), y)
      estimate = diagnostics.hessian_trace(
          loss, final, jax.random.fold_in(seed_key, 0x7ACE),
          num_samples=hessian_samples)
      trace, stderr = estimate.estimate, estimate.stderr
    return FlowRun(losses, grad_norms, update_norms, relative, val_loss,
                   training.cross_entropy(test_logits, test_y),
                   training.accuracy(test_logits, test_y), test_logits,
                   movement, trace, stderr)

  return run


def run_grid(model, method, data, seeds, learning_rates, *, steps, batch_size,
             block_fn=None, init_scales=None, hessian_samples=0) -> FlowRun:
  """All (seed, learning rate) runs as one jit; axes (seed, lr, ...), or
  (seed, lr, init scale, ...) when ``init_scales`` is given."""
  run = make_run(model, method, data, steps=steps, batch_size=batch_size,
                 block_fn=block_fn, hessian_samples=hessian_samples)
  keys = jax.vmap(jax.random.key)(jnp.asarray(seeds))
  rates = jnp.asarray(learning_rates, jnp.float32)
  if init_scales is None:
    grid = jax.jit(jax.vmap(jax.vmap(run, (None, 0)), (0, None)))
    return grid(keys, rates)
  inner = jax.vmap(run, (None, None, 0))
  grid = jax.jit(jax.vmap(jax.vmap(inner, (None, 0, None)), (0, None, None)))
  return grid(keys, rates, jnp.asarray(init_scales, jnp.float32))


def select(result: FlowRun) -> tuple[Optional[int], np.ndarray]:
  """Index of the rate with the lowest mean final validation loss over the
  seeds among those where every seed stayed finite (the §6 discard rule);
  None when all diverged. Also the per-rate "all finite" mask."""
  losses = np.asarray(result.losses)
  finite = (np.isfinite(losses).all(-1)
            & np.isfinite(np.asarray(result.val_loss))).all(0)
  if not finite.any():
    return None, finite
  val = np.where(finite, np.asarray(result.val_loss).mean(0), np.inf)
  return int(np.argmin(val)), finite


def at_rate(result: FlowRun, index: int) -> FlowRun:
  """The runs of one learning rate: axes (seed, ...)."""
  return jax.tree.map(lambda x: np.asarray(x[:, index]), result)


def disparity(norms: np.ndarray) -> np.ndarray:
  """max / min over the last (block) axis."""
  norms = np.asarray(norms, np.float64)
  with np.errstate(divide='ignore', invalid='ignore'):
    return norms.max(-1) / norms.min(-1)
