"""What a workload is: a ``Workload`` (budget, grid, family) building a ``Task``.

A ``Task`` is pure functions of (parameters, model state) that the protocol
scans over steps inside one ``jax.jit``; its ``step`` is the library's own
fused step (``cbp.linen.train_step``, ``cbp.nnx.train_step``), traced into
the scan, so the suite measures what a user runs. Every random choice comes
from the run's seed: ``init(key)`` the initialization, ``loss(...,
batch_key, dropout_key)`` the minibatch and the dropout masks, so two arms
run with the same seed see the same initialization, batches and dropout.

``linen_task`` and ``nnx_task`` turn a Flax model, its data and its loss into
a ``Task``; the workloads (``definitions``, ``families``) are written with
them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Optional

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import optax

import cbp_optax as cbp
from cbp_optax_experiments.reproduce import mnist
from cbp_optax_experiments.reproduce import training
from cbp_optax_experiments.reproduce import transformer

ACCURACY = 'validation accuracy'
BITS_PER_BYTE = 'validation bits per byte'
CROSS_ENTROPY = 'validation cross-entropy (nats)'
RECONSTRUCTION = 'validation squared error per image'
PSNR = 'validation PSNR (dB)'


class Task(NamedTuple):
  """One workload as pure functions (all traceable, no Python side effects).

  Attributes:
    init: ``init(key) -> (params, state)``; ``state`` holds the model's other
      variables (centering means, batch statistics), possibly empty.
    loss: ``loss(params, state, batch_key, dropout_key) -> (loss, state)``,
      the training-mode minibatch loss and the updated state.
    step: ``step(tx)(params, state, opt_state, batch_key, dropout_key) ->
      ((params, state, opt_state), cbp_optax StepOutput)``: the library's
      fused train step with ``tx``: forward and backward of ``loss``, the
      update and, for a centered model, M2's mean refresh and bias transport
      (Algorithm 1, steps 10-11, moving the optimizer state's copies of the
      parameters too); a non-finite batch is skipped (``skipped``).
    evaluate: ``evaluate(params, state) -> metric`` in evaluation mode.
    batch: ``batch(batch_key)``: the minibatch a step with that key sees.
    stacked: ``stacked=`` argument for ``cbp.cbp`` (layer-stacked leaves), or
      None.
    muon_dims: ``muon_weight_dimension_numbers`` for ``optax.contrib.muon``
      (a function of the parameters).
  """
  init: Callable[[jax.Array], tuple[Any, Any]]
  loss: Callable[..., tuple[jax.Array, Any]]
  step: Callable[[optax.GradientTransformation], Callable[..., Any]]
  evaluate: Callable[[Any, Any], jax.Array]
  batch: Callable[[jax.Array], Any]
  stacked: Any = None
  muon_dims: Any = None


@dataclasses.dataclass(frozen=True)
class Workload:
  """A fixed problem, its budget, its learning-rate grid and its target.

  Attributes:
    name: identifier used by ``--workloads``.
    description: one line for the report (model, data, batch, steps).
    metric: one of the metric names above (``ACCURACY``, ...).
    higher_is_better: the metric's direction.
    steps: the step budget.
    eval_every: steps between evaluations (time to target is counted in
      these units).
    grid: the learning-rate grid (factor 3) shared by every arm (an arm may
      scale it: ``Arm.grid_scale``).
    target: the metric to reach (``definitions.TARGETS``); None when not
      fixed yet and in ``--quick`` runs: the run sets it from its baselines.
    build: ``build(centered) -> Task``.
    family: the kind of problem (``splits.FAMILIES``); the dev/test split
      is drawn by family (``splits``).
    validation_size: how many examples the metric averages over (the
      report's resolution line: one example moves an accuracy by 1/n).
    scan_steps: run each chunk of ``eval_every`` steps as one ``lax.scan``;
      False: one compiled step at a time. XLA:CPU runs a convolution inside
      a loop far slower than alone (side by side in one process, idle:
      tutorial CNN 188 vs 27 ms a step, ResNet-8 338 vs 24 ms), so the
      convolutional workloads step one by one; the others keep the scan
      (transformer 45 vs 69 ms, measured under load).
    batch_norm: the model has BatchNorm layers, evaluated with their running
      averages (``Arm.centers`` reads it).
    ladder: the targets the learning rate is tuned against, easiest first
      (``definitions.LADDERS``); None: tuned on the area under the
      best-so-far curve.
  """
  name: str
  description: str
  metric: str
  higher_is_better: bool
  steps: int
  eval_every: int
  grid: tuple[float, ...]
  target: Optional[float]
  build: Callable[[bool], Task]
  family: str = ''
  validation_size: Optional[int] = None
  scan_steps: bool = True
  batch_norm: bool = False
  ladder: Optional[tuple[float, ...]] = None


# ---------------------------------------------------------------------------
# Parameters


def kernel_path(path) -> bool:
  return transformer._last_key(path) == 'kernel'  # pylint: disable=protected-access


def scale_kernels(params, scale: float):
  """Every kernel multiplied by ``scale`` (the init-scale study's alpha)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: x * scale if kernel_path(path) else x, params)


def default_muon_dims(params):
  """Muon on every kernel: matrices as they are, convolution kernels
  (h, w, in, out) flattened over their input axes; other leaves to AdamW.
  Guessed from the parameters' names and ranks (wrong for layer stacks,
  attention and multi-output kernels): the tasks read the dims from their
  models instead (``model_muon_dims``, ``cbp.linen.muon_dimension_numbers``)."""
  def dims(path, x):
    if not kernel_path(path) or x.ndim < 2:
      return None
    return optax.contrib.MuonDimensionNumbers(
        reduction_axis=tuple(range(x.ndim - 1)), output_axis=x.ndim - 1)
  return jax.tree_util.tree_map_with_path(dims, params)


@dataclasses.dataclass(frozen=True)
class FromModel:
  """Muon dimension numbers read from the built model, not from parameter
  names: ``nnx_task`` calls ``fn(model)`` on its concrete model and uses the
  ``dims(params)`` it returns.

  Attributes:
    fn: ``fn(model) -> dims``, like ``cbp.nnx.muon_dimension_numbers``.
  """
  fn: Callable[[Any], Callable[[Any], Any]]


def _model_muon_dims(model):
  return cbp.nnx.muon_dimension_numbers(model)


# Muon dimension numbers of an NNX model, from each layer's own
# configuration (``cbp.nnx.muon_dimension_numbers``): dense and convolution
# kernels are matrices over their input/output axes, attention kernels (in,
# heads, head_dim) and (heads, head_dim, out) too, and an axis is a
# layer-stack (batch) axis only where the layer's kernel has one beyond its
# own shape (a scanned stack), whatever the module holding it is called; a
# plain list of blocks has none.
model_muon_dims = FromModel(_model_muon_dims)
attention_muon_dims = model_muon_dims


# ---------------------------------------------------------------------------
# Linen models


def _same_leaves(params, donor):
  """``params``' structure with ``donor``'s leaves (same order and shapes)."""
  leaves = jax.tree.leaves(donor)
  if [x.shape for x in jax.tree.leaves(params)] != [x.shape for x in leaves]:
    raise ValueError('centered and plain models differ in their parameters')
  return jax.tree.unflatten(jax.tree.structure(params), leaves)


def linen_model_task(
    model: Any,
    plain: Optional[nn.Module],
    sample: Any,
    batch: Callable[[jax.Array], Any],
    loss_of: Callable[[Callable[..., Any], Any], jax.Array],
    metric_of: Callable[[Callable[..., Any]], jax.Array],
    init_scale_: Optional[float] = None,
    muon_dims=None,
) -> Task:
  """A Linen model as a ``Task``.

  Args:
    model: an ``nn.Module``, or ``cbp.linen.center(module)`` (it has
      ``init`` and ``apply`` too).
    plain: the uncentered module whose initialization the centered one
      takes (leaf for leaf), or None (the model is plain, or centering keeps
      every parameter path so the same key gives the same weights).
    sample: an input for ``init``.
    batch: ``batch(batch_key)`` -> what ``loss_of`` reads (indices).
    loss_of: ``loss_of(forward, index)``: the minibatch loss, where
      ``forward(x)`` applies the model in training mode.
    metric_of: ``metric_of(forward)``: the validation metric, ``forward`` in
      evaluation mode.
    init_scale_: multiply every kernel by it after initialization.
    muon_dims: ``muon_weight_dimension_numbers`` for Muon; by default read
      from ``model`` (``cbp.linen.muon_dimension_numbers``).
  """
  if muon_dims is None:
    muon_dims = cbp.linen.muon_dimension_numbers(model, jax.random.key(0),
                                                 sample)
  def init(key):
    params, state = training.init_variables(model, key, sample)
    if plain is not None:
      # Linen derives each layer's key from its path, which the Centered
      # wrapper changes: take the plain model's weights (same leaf order),
      # so that every arm starts from the same initialization.
      params = _same_leaves(params,
                            training.init_variables(plain, key, sample)[0])
    if init_scale_ is not None:
      params = scale_kernels(params, init_scale_)
    return params, state

  def loss(params, state, batch_key, dropout_key):
    del dropout_key  # no dropout in these models
    updated = {}

    def forward(x):
      out, mutated = model.apply({'params': params, **state}, x, train=True,
                                 mutable=list(state))
      updated.update(mutated)
      return out
    value = loss_of(forward, batch(batch_key))
    return value, {**state, **updated}

  def step(tx):
    fused = cbp.linen.train_step(
        lambda apply, index: loss_of(lambda x: apply(x, train=True), index),
        mean_decay=training.RHO, donate=False)

    def run(params, state, opt_state, batch_key, dropout_key):
      del dropout_key  # no dropout in these models
      centering = cbp.linen.COLLECTION
      train_state = cbp.linen.TrainState(
          step=0, apply_fn=model.apply, params=params, tx=tx,
          opt_state=opt_state, centering=state.get(centering, {}),
          model_state={k: v for k, v in state.items() if k != centering})
      train_state, out = fused(train_state, batch(batch_key))
      state = {k: train_state.centering if k == centering
               else train_state.model_state[k] for k in state}
      return (train_state.params, state, train_state.opt_state), out
    return run

  def evaluate(params, state):
    return metric_of(lambda x: model.apply({'params': params, **state}, x,
                                           train=False))

  return Task(init, loss, step, evaluate, batch, muon_dims=muon_dims)


def linen_task(model: nn.Module, data: training.Dataset, batch_size: int,
               init_scale_: Optional[float] = None) -> Task:
  """A Linen classifier on ``data`` (``model.centered`` says whether it is
  centered): minibatches sampled with replacement, metric = validation
  accuracy (``model.apply(..., train=False)``)."""
  train_x, train_y = jnp.asarray(data.train_x), jnp.asarray(data.train_y)
  val_x, val_y = jnp.asarray(data.val_x), jnp.asarray(data.val_y)
  n_train = train_x.shape[0]

  def batch(batch_key):
    return jax.random.randint(batch_key, (batch_size,), 0, n_train)

  return linen_model_task(
      model, model.clone(centered=False) if model.centered else None,
      train_x[:2], batch,
      lambda forward, index: training.cross_entropy(forward(train_x[index]),
                                                    train_y[index]),
      lambda forward: training.accuracy(forward(val_x), val_y),
      init_scale_)


@functools.lru_cache(maxsize=None)
def mnist_data(quick: bool) -> training.Dataset:
  """The MNIST splits of the §6.6 study (bundled subset when offline)."""
  return mnist.load(None, quick, bundled=True)


# ---------------------------------------------------------------------------
# NNX models


def nnx_task(make_model: Callable[[nnx.Rngs], nnx.Module], centered: bool,
             loss_fn: Callable[..., jax.Array],
             batch: Callable[[jax.Array], Any],
             metric: Callable[[nnx.Module], jax.Array],
             stacked_fn=None, muon_dims=model_muon_dims) -> Task:
  """An NNX model as pure functions of its ``nnx.split`` states.

  ``make_model(rngs)`` builds it (``cbp.nnx.center`` is applied when
  ``centered``); ``loss_fn(model, batch, rngs)`` runs in training mode with
  ``rngs.dropout``; ``metric(model)`` runs in evaluation mode. ``muon_dims``
  is a function of the parameters, or a :class:`FromModel` read from the
  built model (the default, ``model_muon_dims``).
  """
  def build(key):
    model = make_model(nnx.Rngs(params=key))
    if centered:
      cbp.nnx.center(model)
    model.train()
    return model

  concrete = build(jax.random.key(0))
  graphdef, _, _ = nnx.split(concrete, nnx.Param, ...)
  stacked = stacked_fn(concrete) if stacked_fn is not None else None
  if isinstance(muon_dims, FromModel):
    muon_dims = muon_dims.fn(concrete)

  def split(model):
    # Plain arrays: a later merge builds fresh Variables at its own trace
    # level, which the forward pass may write statistics into.
    _, params, rest = nnx.split(model, nnx.Param, ...)
    return nnx.as_pure(params), nnx.as_pure(rest)

  def init(key):
    return split(build(key))

  def loss(params, rest, batch_key, dropout_key):
    model = nnx.merge(graphdef, params, rest)
    value = loss_fn(model, batch(batch_key), nnx.Rngs(dropout=dropout_key))
    return value, split(model)[1]

  def step(tx):
    fused = cbp.nnx.train_step(
        lambda model, index, dropout_key: loss_fn(
            model, index, nnx.Rngs(dropout=dropout_key)),
        mean_decay=training.RHO, donate=False)

    def run(params, rest, opt_state, batch_key, dropout_key):
      model = nnx.merge(graphdef, params, rest)
      # The carried state in an optimizer (its own init is dead code).
      optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
      nnx.update(optimizer.opt_state, nnx.state(opt_state))
      out = fused(model, optimizer, batch(batch_key), dropout_key)
      return (*split(model), nnx.as_pure(optimizer.opt_state)), out
    return run

  def evaluate(params, rest):
    model = nnx.merge(graphdef, params, rest)
    model.eval()
    return metric(model)

  return Task(init, loss, step, evaluate, batch, stacked, muon_dims)
