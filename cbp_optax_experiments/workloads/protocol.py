"""External tuning in miniature: grid, tuning seed, evaluation seeds, cost.

Per (workload, arm): one compiled chunk of ``eval_every`` steps (a
``lax.scan``, or a compiled step called ``eval_every`` times where the
workload's ``scan_steps`` is False; the seed and the peak learning rate are
traced arguments, so the whole grid and every seed reuse it), plus compiled
init and evaluation. The arm's rate is chosen from the workload's grid on the
tuning seed (fastest to the target, then best metric; rates on which the
tuning run diverged are discarded); a choice at an edge of the grid extends
it once by a factor 3 in that direction. The chosen rate then runs on the
evaluation seeds, which every arm shares: the seed alone fixes the
initialization, the minibatches and the dropout masks (``seed_keys``).

A run diverged when a loss or metric is not finite or the smoothed training
loss exceeds ``BLOWUP`` times the first step's loss; it is recorded per seed
and scored as a miss, never raised. The step cost relative to the reference
arm (AdamW) is measured in the same process by alternating single steps of
the two compiled chunks and taking the ratio of the medians.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from cbp_optax_experiments.reproduce import training
from cbp_optax_experiments.workloads import arms as arms_lib
from cbp_optax_experiments.workloads import definitions

TUNING_SEEDS = (1000,)
BLOWUP = 3.0
# Step cost: medians over at least 3 and at most 15 alternated chunks,
# about COST_STEPS steps of each arm.
COST_STEPS = 150


def cost_repeats(eval_every: int) -> int:
  return max(3, min(15, COST_STEPS // eval_every))


def seed_keys(seed) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(init, data, dropout) keys of a seed: nothing else enters them."""
  init_key, data_key, dropout_key = jax.random.split(jax.random.key(seed), 3)
  return init_key, data_key, dropout_key


def step_keys(data_key, dropout_key, index):
  """The batch and dropout keys of step ``index``."""
  return (jax.random.fold_in(data_key, index),
          jax.random.fold_in(dropout_key, index))


def make_step(task: definitions.Task, centered: bool,
              tx: optax.GradientTransformation, data_key, dropout_key):
  """``step((params, state, opt_state), index) -> (carry, loss)``; a
  ``centered`` task is transported after each update."""
  def step(carry, index):
    params, state, opt_state = carry
    batch_key, drop_key = step_keys(data_key, dropout_key, index)
    (loss, state), grads = jax.value_and_grad(task.loss, has_aux=True)(
        params, state, batch_key, drop_key)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    if centered:
      params, state = task.transport(params, state)
    return (params, state, opt_state), loss
  return step


def context(task: definitions.Task, workload: definitions.Workload):
  return arms_lib.Context(workload.steps, task.stacked, task.muon_dims)


class Runner(NamedTuple):
  """The compiled pieces of one (workload, arm); seed and rate are traced.

  ``init(seed, lr) -> carry``; ``chunk(carry, c, seed, lr) -> (carry,
  losses)`` runs steps ``c * eval_every ... (c + 1) * eval_every - 1`` (one
  ``lax.scan``, or one compiled step at a time); ``evaluate(carry) ->
  metric``.
  """
  init: Callable[..., Any]
  chunk: Callable[..., Any]
  evaluate: Callable[..., Any]
  workload: definitions.Workload

  def __call__(self, seed: int, lr: float) -> tuple[np.ndarray, np.ndarray]:
    """One run: per-step losses and the metric after every chunk."""
    seed, lr = jnp.int32(seed), jnp.float32(lr)
    carry = self.init(seed, lr)
    losses, metrics = [], []
    for c in range(self.workload.steps // self.workload.eval_every):
      carry, chunk_losses = self.chunk(carry, jnp.int32(c), seed, lr)
      losses.append(chunk_losses)
      metrics.append(self.evaluate(carry))
    return (np.concatenate([np.asarray(x, np.float64) for x in losses]),
            np.asarray([float(m) for m in metrics], np.float64))


def make_runner(task: definitions.Task, arm: arms_lib.Arm,
                workload: definitions.Workload) -> Runner:
  """The jitted ``Runner`` of ``arm`` on ``workload``."""
  ctx = context(task, workload)
  every = workload.eval_every
  if workload.steps % every:
    raise ValueError(f'{workload.name}: steps must be a multiple of '
                     'eval_every')

  def init(seed, lr):
    init_key, _, _ = seed_keys(seed)
    params, state = task.init(init_key)
    return params, state, arm.make(lr, ctx).init(params)

  def seeded_step(seed, lr):
    _, data_key, dropout_key = seed_keys(seed)
    return make_step(task, arm.centers(workload), arm.make(lr, ctx),
                     data_key, dropout_key)

  if workload.scan_steps:
    def scanned(carry, c, seed, lr):
      return jax.lax.scan(seeded_step(seed, lr), carry,
                          c * every + jnp.arange(every))
    chunk = jax.jit(scanned)
  else:
    one_step = jax.jit(
        lambda carry, index, seed, lr: seeded_step(seed, lr)(carry, index))

    def chunk(carry, c, seed, lr):
      losses = []
      for index in range(every):
        carry, loss = one_step(carry, c * every + index, seed, lr)
        losses.append(loss)
      return carry, jnp.stack(losses)

  def evaluate(carry):
    params, state, opt_state = carry
    if arm.eval_params is not None:
      params = arm.eval_params(opt_state, params)
    return task.evaluate(params, state)

  return Runner(jax.jit(init), chunk, jax.jit(evaluate), workload)


# ---------------------------------------------------------------------------
# One run's summary


@dataclasses.dataclass
class RunRecord:
  seed: int
  lr: float
  losses: np.ndarray
  metrics: np.ndarray
  diverged: bool


def diverged(losses: np.ndarray, metrics: np.ndarray) -> bool:
  """Non-finite anywhere, or the smoothed loss blew up past ``BLOWUP`` x
  the first step's loss."""
  if not (np.all(np.isfinite(losses)) and np.all(np.isfinite(metrics))):
    return True
  smooth = training.smoothed(losses)
  return bool(np.any(smooth > BLOWUP * abs(float(losses[0]))))


def steps_to_target(curve: Sequence[Optional[float]], target: Optional[float],
                    every: int, higher_is_better: bool,
                    diverged_: bool) -> Optional[int]:
  """Steps of the first evaluation at or past ``target`` (None: missed)."""
  if target is None or diverged_:
    return None
  for i, value in enumerate(curve):
    if value is None or not math.isfinite(value):
      continue
    if (value >= target) if higher_is_better else (value <= target):
      return (i + 1) * every
  return None


def best_metric(curve, higher_is_better: bool) -> float:
  values = [v for v in curve if v is not None and math.isfinite(v)]
  if not values:
    return -math.inf if higher_is_better else math.inf
  return max(values) if higher_is_better else min(values)


def _select(records: dict[float, list[RunRecord]], workload, target):
  """The rate with the fastest median time to target, then best metric;
  None when every rate diverged."""
  sign = 1.0 if workload.higher_is_better else -1.0
  keys = {}
  for lr, runs in records.items():
    if any(r.diverged for r in runs):
      continue
    steps = [steps_to_target(r.metrics.tolist(), target, workload.eval_every,
                             workload.higher_is_better, r.diverged)
             for r in runs]
    steps = np.median([math.inf if s is None else s for s in steps])
    metric = np.median([best_metric(r.metrics.tolist(),
                                    workload.higher_is_better) for r in runs])
    keys[lr] = (steps, -sign * metric)
  if not keys:
    return None
  return min(keys, key=lambda lr: keys[lr])


# ---------------------------------------------------------------------------
# Step cost


# (workload name, budget, arm name) -> the reference arm's Runner.
_REFERENCE: dict = {}


def step_cost(runners: Sequence[Runner], lr: float,
              repeats: Optional[int] = None) -> list[float]:
  """Median seconds per step of each runner's compiled chunk, measured by
  alternating chunks of the runners (seed 0, rate ``lr``)."""
  if repeats is None:
    repeats = cost_repeats(runners[0].workload.eval_every)
  lr, seed = jnp.float32(lr), jnp.int32(0)
  carries = [jax.block_until_ready(r.init(seed, lr)) for r in runners]
  times = [[] for _ in runners]
  for rep in range(repeats + 1):
    for k, runner in enumerate(runners):
      start = time.perf_counter()
      carries[k] = jax.block_until_ready(
          runner.chunk(carries[k], jnp.int32(rep), seed, lr)[0])
      if rep:  # the first round warms up
        times[k].append((time.perf_counter() - start) /
                        runner.workload.eval_every)
  return [float(np.median(t)) for t in times]


# ---------------------------------------------------------------------------
# Tuning and evaluation of one arm on one workload


@dataclasses.dataclass
class ArmOutcome:
  """What ``evaluate_arm`` measured (before targets are applied)."""
  learning_rate: float
  tuning: dict[float, list[RunRecord]]
  runs: list[RunRecord]
  cost_vs_reference: float
  seconds_per_step: float
  reference_seconds_per_step: float
  wall_seconds: float
  centered: bool  # trained the centered model (``Arm.centers``)


def evaluate_arm(
    workload: definitions.Workload,
    arm: arms_lib.Arm,
    reference: arms_lib.Arm,
    target: Optional[float],
    seeds: Sequence[int],
    tuning_seeds: Sequence[int] = TUNING_SEEDS,
    on_run: Optional[Callable[[], None]] = None,
) -> ArmOutcome:
  """Grid (extended once at an edge) on ``tuning_seeds``, then ``seeds``."""
  start = time.perf_counter()
  centered = arm.centers(workload)
  run = make_runner(workload.build(centered), arm, workload)

  def one(seed, lr):
    losses, metrics = run(seed, lr)
    if on_run is not None:
      on_run()
    return RunRecord(int(seed), float(lr), losses, metrics,
                     diverged(losses, metrics))

  grid = list(workload.grid)
  tuning = {lr: [one(s, lr) for s in tuning_seeds] for lr in grid}
  chosen = _select(tuning, workload, target)
  if chosen is None or chosen in (grid[0], grid[-1]):
    edge = grid[-1] * 3 if chosen == grid[-1] else grid[0] / 3
    tuning[edge] = [one(s, edge) for s in tuning_seeds]
    chosen = _select(tuning, workload, target)
    if chosen is None:  # every rate diverged: report the smallest one tried
      chosen = min(tuning)
  runs = [one(s, chosen) for s in seeds]
  key = (workload.name, workload.steps, reference.name)
  if arm.name == reference.name:
    _REFERENCE[key] = run
    cost, own = 1.0, step_cost([run], chosen)[0]
    ref_seconds = own
  else:
    if key not in _REFERENCE:
      _REFERENCE[key] = make_runner(
          workload.build(reference.centers(workload)), reference, workload)
    own, ref_seconds = step_cost([run, _REFERENCE[key]], chosen)
    cost = own / ref_seconds
  return ArmOutcome(chosen, tuning, runs, cost, own, ref_seconds,
                    time.perf_counter() - start, centered)
