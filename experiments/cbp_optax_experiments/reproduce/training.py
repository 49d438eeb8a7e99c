"""Shared training engine of the reproduction suite (§6 setup).

One training run is a ``lax.scan`` over steps inside one ``jax.jit``; seeds and
learning rates are batched with ``jax.vmap``, so a whole learning-rate grid of a
method over all seeds is one compiled program. Centered models (M2) record the
batch means on the forward pass and are transported after every update with
``cbp_optax.linen.transport`` (Algorithm 1, steps 10-11).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import cbp_optax as cbp

# The common learning-rate grid of §6 and the one shifted one step upward for
# the depth-training study (Figure 7).
COMMON_GRID = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3)
SHIFTED_GRID = (0.003, 0.01, 0.03, 0.1, 0.3, 1.0)

# Our choice (the paper leaves it open): the smoothed training loss is a
# debiased EMA of the minibatch loss with this decay (time constant ~10 steps).
SMOOTHING = 0.9

# CBP defaults of §6: damping, EMA decay rho, clip range.
DAMPING, RHO, MIN_SCALE, MAX_SCALE = 1e-3, 0.99, 0.1, 4.0


class Dataset(NamedTuple):
  """A classification task split into train / validation / test arrays."""
  train_x: np.ndarray
  train_y: np.ndarray
  val_x: np.ndarray
  val_y: np.ndarray
  test_x: np.ndarray
  test_y: np.ndarray
  description: str


def spiral(
    *,
    arms: int = 6,
    points_per_arm: int = 500,
    turns: float = 0.5,
    noise: float = 0.07,
    seed: int = 0,
) -> Dataset:
  """The multi-arm noisy spiral of §6, standardized and split 60/20/20.

  Arm ``k`` holds the points ``r (cos phi, sin phi)`` with ``r ~ U(0.05, 1)``
  and ``phi = 2 pi (k / arms + turns * r)``, plus isotropic Gaussian noise of
  standard deviation ``noise``. The defaults are our choice (the paper's
  Appendix C values are not available to us): they put Adam's test accuracy in
  the paper's 0.86-0.88 band on the 10-layer network. The features are standardized to zero mean and
  unit variance with the training split's statistics.
  """
  rng = np.random.default_rng(seed)
  radius = rng.uniform(0.05, 1.0, size=(arms, points_per_arm))
  arm = np.arange(arms)[:, None]
  angle = 2 * np.pi * (arm / arms + turns * radius)
  points = np.stack([radius * np.cos(angle), radius * np.sin(angle)], -1)
  points = points + noise * rng.standard_normal(points.shape)
  x = points.reshape(-1, 2).astype(np.float32)
  y = np.broadcast_to(arm, radius.shape).reshape(-1).astype(np.int32)
  order = rng.permutation(len(y))
  x, y = x[order], y[order]
  n_train, n_val = int(0.6 * len(y)), int(0.2 * len(y))
  mean, std = x[:n_train].mean(0), x[:n_train].std(0)
  x = (x - mean) / std
  cut = (n_train, n_train + n_val)
  return Dataset(
      x[:cut[0]], y[:cut[0]], x[cut[0]:cut[1]], y[cut[0]:cut[1]],
      x[cut[1]:], y[cut[1]:],
      description=(f'{arms}-arm spiral, {arms * points_per_arm} points, '
                   f'{turns:g} turn(s), noise std {noise:g}, seed {seed}, '
                   'standardized, split 60/20/20'),
  )


# ---------------------------------------------------------------------------
# Models


Initializer = Callable[..., jax.Array]


class MLP(nn.Module):
  """Fully connected network; every Dense optionally centered (M2, eq. 8).

  Attributes:
    hidden: widths of the hidden layers.
    classes: output width.
    activation: the hidden nonlinearity.
    centered: wrap every Dense (the output layer included) in
      ``cbp_optax.linen.Centered``.
    kernel_inits: one initializer per Dense (hidden layers then output), or
      None for He-normal (fan-in) weights.
    bias_inits: one initializer per Dense, or None for zero biases.
  """

  hidden: Sequence[int]
  classes: int
  activation: Callable[[jax.Array], jax.Array] = nn.relu
  centered: bool = False
  kernel_inits: Optional[Sequence[Initializer]] = None
  bias_inits: Optional[Sequence[Initializer]] = None

  @nn.compact
  def __call__(self, x: jax.Array, *, train: bool = False,
               return_hidden: bool = False):
    del train  # no train/eval difference (centering records when mutable)
    widths = list(self.hidden) + [self.classes]
    hidden_outputs = []
    for i, width in enumerate(widths):
      kernel_init = (self.kernel_inits[i] if self.kernel_inits else
                     nn.initializers.variance_scaling(2.0, 'fan_in', 'normal'))
      bias_init = (self.bias_inits[i] if self.bias_inits else
                   nn.initializers.zeros)
      if self.centered:
        # An unbound layer handed to the wrapper pairs its params with mu.
        dense = nn.Dense(width, kernel_init=kernel_init, bias_init=bias_init,
                         parent=None)
        x = cbp.linen.Centered(dense, name=f'layer_{i}')(x)
      else:
        x = nn.Dense(width, kernel_init=kernel_init, bias_init=bias_init,
                     name=f'layer_{i}')(x)
      if i < len(widths) - 1:
        x = self.activation(x)
        hidden_outputs.append(x)
    return (x, hidden_outputs) if return_hidden else x


def init_variables(model: nn.Module, key: jax.Array, x: jax.Array):
  """``(params, collections)``: the other collections ('centering' for M2,
  'batch_stats' for batch norm) as a dict, empty for a plain model."""
  variables = dict(model.init(key, x))
  params = variables.pop('params')
  return params, variables


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def accuracy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return jnp.mean(jnp.argmax(logits, -1) == labels)


# ---------------------------------------------------------------------------
# Methods


@dataclasses.dataclass(frozen=True)
class Method:
  """An optimizer arm: the optax transform for a learning rate, and M2 on/off.

  ``make_tx(learning_rate)`` is called inside the traced program, so the
  learning rate may be a tracer (a grid is one vmapped program). It may also
  be a dict of hyperparameters (``run_grid`` vmaps over any pytree), e.g. the
  Table 8 settings; ``centering_decay(hyper)`` then reads the centering EMA
  decay from it (None: ``TrainConfig.centering_decay``).

  ``recipe`` names the exact optimizer (same transform, same arguments) for
  methods that several studies run under different names; runs with the same
  recipe, network, data, budget, seeds and grid are computed once per process
  (``protocol.run_method``). None: never shared.
  """
  name: str
  make_tx: Callable[[Any], optax.GradientTransformation]
  centered: bool = False
  recipe: Optional[str] = None
  centering_decay: Optional[Callable[[Any], Any]] = None


def momentum_base(b1: float = 0.9) -> optax.GradientTransformation:
  """Bias-corrected heavy-ball momentum ``m_t / (1 - b1^t)`` (eq. 12, P = I)."""
  return optax.ema(b1, debias=True)


def factorial_tx(
    learning_rate: Any, *, m1: bool, m3: bool, b1: float = 0.9,
) -> optax.GradientTransformation:
  """The §6.4 common base with M1 and/or M3 switched in (M2 is the model's).

  base = bias-corrected momentum; M1 prepends ``cbp.equalize``; M3 replaces the
  plain momentum by ``cbp.precondition`` (the same bias-corrected momentum,
  divided by the lagged damped second moment, eqs. 11-12).
  """
  parts = []
  if m1:
    parts.append(cbp.equalize(RHO, MIN_SCALE, MAX_SCALE))
  parts.append(cbp.precondition(b1, 0.999, DAMPING) if m3 else
               momentum_base(b1))
  parts.append(optax.scale_by_learning_rate(learning_rate))
  return optax.chain(*parts)


def factorial_recipe(m1: bool, m3: bool) -> str:
  """``Method.recipe`` of ``factorial_tx`` (b1 = 0.9); M1 + M3 is ``cbp.cbp``
  with its defaults (the same chain: equalize -> precondition -> lr)."""
  return {(False, False): 'momentum', (True, False): 'equalize+momentum',
          (False, True): 'precondition', (True, True): 'cbp'}[(m1, m3)]


def factorial_method(m1: bool, m2: bool, m3: bool) -> Method:
  names = [n for n, on in (('M1', m1), ('M2', m2), ('M3', m3)) if on]
  return Method(' + '.join(names) or 'base',
                functools.partial(factorial_tx, m1=m1, m3=m3), centered=m2,
                recipe=factorial_recipe(m1, m3))


# ---------------------------------------------------------------------------
# Training


class RunResult(NamedTuple):
  """Per-run outputs; leading axes are whatever the caller vmapped over."""
  losses: jax.Array        # (steps,) minibatch training loss
  eval_steps: jax.Array    # (evals,) step index after which each eval ran
  train_loss: jax.Array    # (evals,) full training-set loss
  val_loss: jax.Array      # (evals,)
  val_accuracy: jax.Array  # (evals,)
  test_loss: jax.Array     # (evals,)
  test_accuracy: jax.Array  # (evals,)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int
  batch_size: int
  eval_every: int
  centering_decay: float = RHO
  # False: report the chunk's mean minibatch loss instead of a full pass over
  # the training set (the convolutional study, where that pass is costly).
  eval_train: bool = True


def _evaluate(model, params, collections, x, y):
  logits = model.apply({'params': params, **collections}, x, train=False)
  return cross_entropy(logits, y), accuracy(logits, y)


def make_trainer(
    model: nn.Module,
    method: Method,
    data: Dataset,
    config: TrainConfig,
    init: Optional[Callable[[jax.Array, jax.Array], tuple[Any, Any]]] = None,
) -> Callable[[jax.Array, jax.Array], RunResult]:
  """``train(seed_key, learning_rate) -> RunResult`` for one run.

  ``init(key, x) -> (params, collections)`` overrides the model's own
  initialization (the hetero-gain networks of §6.5 use it).

  The seed key fixes the initialization and the minibatch order (sampled with
  replacement), so two methods run with the same seed see the same batches.
  The forward pass runs with ``train=True`` and every non-parameter collection
  mutable: centered layers record their batch means, batch norm its
  statistics. After the update a centered model is transported
  (``cbp.linen.transport``, Algorithm 1 steps 10-11). Evaluation runs with
  ``train=False``: centered layers use ``mu``, which the transport keeps
  consistent with the biases.
  """
  train_x, train_y = jnp.asarray(data.train_x), jnp.asarray(data.train_y)
  val = (jnp.asarray(data.val_x), jnp.asarray(data.val_y))
  test = (jnp.asarray(data.test_x), jnp.asarray(data.test_y))
  n_train = train_x.shape[0]
  if config.steps % config.eval_every:
    raise ValueError('steps must be a multiple of eval_every')
  chunks = config.steps // config.eval_every

  def train(seed_key: jax.Array, learning_rate: jax.Array) -> RunResult:
    init_key, data_key = jax.random.split(seed_key)
    if init is None:
      params, collections = init_variables(model, init_key, train_x[:2])
    else:
      params, collections = init(init_key, train_x)
    tx = method.make_tx(learning_rate)
    opt_state = tx.init(params)
    decay = (config.centering_decay if method.centering_decay is None else
             method.centering_decay(learning_rate))

    def step(carry, index):
      params, collections, opt_state = carry
      batch = jax.random.randint(jax.random.fold_in(data_key, index),
                                 (config.batch_size,), 0, n_train)
      x, y = train_x[batch], train_y[batch]

      def loss_of(p):
        logits, mutated = model.apply(
            {'params': p, **collections}, x, train=True,
            mutable=list(collections))
        return cross_entropy(logits, y), {**collections, **mutated}

      (loss, recorded), grads = jax.value_and_grad(loss_of, has_aux=True)(
          params)
      updates, opt_state = tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      if method.centered:
        params, centering = cbp.linen.transport(
            params, recorded['centering'], decay)
        recorded = {**recorded, 'centering': centering}
      return (params, recorded, opt_state), loss

    def chunk(carry, chunk_index):
      indices = chunk_index * config.eval_every + jnp.arange(config.eval_every)
      carry, losses = jax.lax.scan(step, carry, indices)
      params, collections, _ = carry
      train_loss = (_evaluate(model, params, collections, train_x, train_y)[0]
                    if config.eval_train else losses.mean())
      metrics = (
          train_loss,
          *_evaluate(model, params, collections, *val),
          *_evaluate(model, params, collections, *test),
      )
      return carry, (losses, metrics)

    _, (losses, metrics) = jax.lax.scan(
        chunk, (params, collections, opt_state), jnp.arange(chunks))
    eval_steps = (jnp.arange(chunks) + 1) * config.eval_every
    return RunResult(losses.reshape(-1), eval_steps, *metrics)

  return train


def run_grid(
    model: nn.Module,
    method: Method,
    data: Dataset,
    config: TrainConfig,
    seeds: Sequence[int],
    learning_rates: Any,
    init: Optional[Callable[[jax.Array, jax.Array], tuple[Any, Any]]] = None,
) -> RunResult:
  """All (seed, learning rate) runs of a method as one jit: axes (seed, lr).

  ``learning_rates`` is a sequence of rates, or a dict of equal-length
  sequences (one hyperparameter setting per index) for ``make_tx``.
  """
  train = make_trainer(model, method, data, config, init)
  grid = jax.jit(jax.vmap(jax.vmap(train, (None, 0)), (0, None)))
  keys = jnp.stack([jax.random.key_data(jax.random.key(s)) for s in seeds])
  keys = jax.vmap(jax.random.wrap_key_data)(keys)
  as_array = lambda v: jnp.asarray(v, jnp.float32)
  rates = ({k: as_array(v) for k, v in learning_rates.items()}
           if isinstance(learning_rates, dict) else as_array(learning_rates))
  result = grid(keys, rates)
  return jax.tree.map(np.asarray, result)


# ---------------------------------------------------------------------------
# Post-processing


def smoothed(losses: np.ndarray, decay: float = SMOOTHING) -> np.ndarray:
  """Debiased EMA of the minibatch losses along the last axis."""
  losses = np.asarray(losses, np.float64)
  out = np.empty_like(losses)
  acc = np.zeros(losses.shape[:-1])
  for t in range(losses.shape[-1]):
    acc = decay * acc + (1 - decay) * losses[..., t]
    out[..., t] = acc / (1 - decay ** (t + 1))
  return out


def iterations_to(losses: np.ndarray, threshold: float,
                  decay: float = SMOOTHING) -> np.ndarray:
  """First iteration (1-based) whose smoothed loss is below ``threshold``.

  Runs that never get there are ``inf`` (censored at the budget).
  """
  below = smoothed(losses, decay) < threshold
  first = np.argmax(below, axis=-1).astype(np.float64) + 1
  return np.where(below.any(axis=-1), first, np.inf)


def all_finite(result: RunResult, axis: int) -> np.ndarray:
  """Per learning rate: did every seed stay finite (the §6 discard rule)?"""
  finite = np.isfinite(result.losses).all(-1) & np.isfinite(
      result.train_loss).all(-1)
  return finite.all(axis=axis)


def select_learning_rate(result: RunResult) -> Optional[int]:
  """Index of the rate with the lowest mean final validation loss over seeds.

  Rates on which any seed went non-finite are discarded first (§6). Returns
  None when every rate was discarded. Axes of ``result``: (seed, lr, ...).
  """
  keep = all_finite(result, axis=0)
  if not keep.any():
    return None
  val = result.val_loss[..., -1].mean(axis=0)
  val = np.where(keep, val, np.inf)
  return int(np.argmin(val))


def finite_or_budget(iterations: np.ndarray, budget: int) -> list[float]:
  """JSON-friendly iteration counts (censored runs recorded as None)."""
  return [None if not math.isfinite(v) else float(v) for v in iterations]
