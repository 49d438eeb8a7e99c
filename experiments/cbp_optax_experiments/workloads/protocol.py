"""External tuning in miniature: grid, tuning seed, evaluation seeds, cost.

Per (workload, arm): one compiled chunk of ``eval_every`` steps of the
library's fused step (``cbp.linen.train_step`` / ``cbp.nnx.train_step``,
traced in; a ``lax.scan``, or a compiled step called ``eval_every`` times
where the workload's ``scan_steps`` is False; the seed and the peak learning
rate are traced arguments, so the whole grid and every seed reuse it), plus
compiled init and evaluation. The arm's rate is chosen from the workload's grid on the
tuning seed by the measure the scores read (``tuning_value``: the any-time
value against the workload's ladder of targets, then the best metric;
rates on which the tuning run diverged are discarded); a choice at an edge of the grid extends
it once by a factor 3 in that direction. The chosen rate then runs on the
evaluation seeds, which every arm shares: the seed alone fixes the
initialization, the minibatches and the dropout masks (``seed_keys``).
The grid's runs, then the evaluation seeds, can train together as one
``jax.vmap``-ped program where the workload allows (``batchable``; the
others loop), each run's result the looped run's to float rounding; on a CPU
they loop unless asked (``vmap_by_default``).

A run diverged when a loss or metric is not finite or the smoothed training
loss exceeds ``BLOWUP`` times the first step's loss; it is recorded per seed
and scored as a miss, never raised. The step cost relative to the reference
arm (AdamW) is measured in the same process by alternating compiled chunks
of the two for a fixed time window each (``COST_WINDOW_SECONDS``, not a
fixed step count) and taking the ratio of the medians.

Every run (workload, arm, rate, seed) and every cost measurement is saved as
its own file, written atomically, by a ``RecordStore``: a run interrupted at
any point and started again loads what it had and computes only the rest,
and gives the same results as an uninterrupted one (the step costs, which
are timings, aside).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import pathlib
import tempfile
import time
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from cbp_optax_experiments.reproduce import training
from cbp_optax_experiments.workloads import arms as arms_lib
from cbp_optax_experiments.workloads import definitions
from cbp_optax_experiments.workloads import scoring

TUNING_SEEDS = (1000,)
BLOWUP = 3.0
# Step cost: chunks of the arm and of AdamW alternate until each has run for
# this long (and at least COST_MIN_CHUNKS chunks); medians per step. Short
# for --quick (a smoke test).
COST_WINDOW_SECONDS = 1.0
QUICK_COST_WINDOW_SECONDS = 0.2
COST_MIN_CHUNKS = 3
# Bumped when a change would make stored runs differ from new ones.
RECORD_VERSION = 1


def seed_keys(seed) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(init, data, dropout) keys of a seed: nothing else enters them."""
  init_key, data_key, dropout_key = jax.random.split(jax.random.key(seed), 3)
  return init_key, data_key, dropout_key


def step_keys(data_key, dropout_key, index):
  """The batch and dropout keys of step ``index``."""
  return (jax.random.fold_in(data_key, index),
          jax.random.fold_in(dropout_key, index))


def make_step(task: definitions.Task, tx: optax.GradientTransformation,
              data_key, dropout_key):
  """``step((params, state, opt_state), index) -> (carry, loss)``: the
  library's fused step (update, and transport for a centered model).

  A step it skipped (a non-finite loss, gradient or statistic) reports a NaN
  loss, so that the run counts as diverged (``diverged``), as it did when
  the non-finite update went through."""
  fused = task.step(tx)

  def step(carry, index):
    batch_key, drop_key = step_keys(data_key, dropout_key, index)
    carry, out = fused(*carry, batch_key, drop_key)
    return carry, jnp.where(out.skipped, jnp.nan, out.loss)
  return step


def context(task: definitions.Task, workload: definitions.Workload):
  return arms_lib.Context(workload.steps, task.stacked, task.muon_dims)


def batchable(workload: definitions.Workload) -> tuple[bool, str]:
  """Whether ``workload``'s runs (seeds, rates) train as one vmapped
  program, and why (``make_runner``).

  Every Task is pure and the seed and the rate are traced arguments, so
  ``jax.vmap`` can batch any of them; a workload whose steps do not run in
  a ``lax.scan`` (``scan_steps`` False: the convolutional ones) is looped
  instead: vmapping a convolution over per-run kernels makes it a grouped
  convolution, which XLA:CPU runs far slower than the separate ones that
  the unscanned path was chosen to keep fast.
  """
  if not workload.scan_steps:
    return False, ('looped: its steps run one compiled step at a time '
                   '(scan_steps=False, convolutions), and vmapping a '
                   'convolution over per-run kernels makes it a grouped '
                   'convolution, slower on CPU than the runs one by one')
  return True, 'vmapped: seeds and rates of one batch as one program'


class Runner(NamedTuple):
  """The compiled pieces of one (workload, arm); seed and rate are traced.

  ``init(seed, lr) -> carry``; ``chunk(carry, c, seed, lr) -> (carry,
  losses)`` runs steps ``c * eval_every ... (c + 1) * eval_every - 1`` (one
  ``lax.scan``, or one compiled step at a time); ``evaluate(carry) ->
  metric``. ``batch_init``, ``batch_chunk`` and ``batch_evaluate`` are the
  same under ``jax.vmap`` over a leading axis of seeds and rates (None where
  the workload is not ``batchable``).
  """
  init: Callable[..., Any]
  chunk: Callable[..., Any]
  evaluate: Callable[..., Any]
  workload: definitions.Workload
  batch_init: Optional[Callable[..., Any]] = None
  batch_chunk: Optional[Callable[..., Any]] = None
  batch_evaluate: Optional[Callable[..., Any]] = None

  def __call__(self, seed: int, lr: float) -> tuple[np.ndarray, np.ndarray]:
    """One run: per-step losses and the metric after every chunk."""
    return self.run(seed, lr)[:2]

  def run(self, seed: int, lr: float
          ) -> tuple[np.ndarray, np.ndarray, float]:
    """Per-step losses, the metric after every chunk, and the metric of the
    initialization (where every arm starts)."""
    seed, lr = jnp.int32(seed), jnp.float32(lr)
    carry = self.init(seed, lr)
    initial = float(self.evaluate(carry))
    losses, metrics = [], []
    for c in range(self.workload.steps // self.workload.eval_every):
      carry, chunk_losses = self.chunk(carry, jnp.int32(c), seed, lr)
      losses.append(chunk_losses)
      metrics.append(self.evaluate(carry))
    return (np.concatenate([np.asarray(x, np.float64) for x in losses]),
            np.asarray([float(m) for m in metrics], np.float64), initial)

  def run_many(self, seeds: Sequence[int], lrs: Sequence[float],
               width: Optional[int] = None
               ) -> list[tuple[np.ndarray, np.ndarray, float]]:
    """``run`` of every ``(seeds[i], lrs[i])``: as one vmapped program where
    the runner has one, else one run after the other. Each run's result is
    its own: a run that diverges leaves the others as they are.

    ``width``: pad a smaller batch to this many runs (repeats of its first
    run, discarded), so that batches of different sizes share one compiled
    program; compiling dominates a small workload's time on a CPU."""
    if len(seeds) != len(lrs):
      raise ValueError(f'{len(seeds)} seeds for {len(lrs)} rates')
    count = len(seeds)
    if self.batch_chunk is None or count < 2:
      return [self.run(s, lr) for s, lr in zip(seeds, lrs)]
    pad = max(0, (width or 0) - count)
    seeds = jnp.asarray(list(seeds) + [seeds[0]] * pad, jnp.int32)
    lrs = jnp.asarray(list(lrs) + [lrs[0]] * pad, jnp.float32)
    carry = self.batch_init(seeds, lrs)
    initial = np.asarray(self.batch_evaluate(carry), np.float64)
    losses, metrics = [], []
    for c in range(self.workload.steps // self.workload.eval_every):
      carry, chunk_losses = self.batch_chunk(carry, jnp.int32(c), seeds, lrs)
      losses.append(np.asarray(chunk_losses, np.float64))
      metrics.append(np.asarray(self.batch_evaluate(carry), np.float64))
    losses = np.concatenate(losses, axis=1)
    metrics = np.stack(metrics, axis=1)
    return [(losses[i], metrics[i], float(initial[i]))
            for i in range(count)]


def vmap_by_default() -> bool:
  """Whether runs are vmapped where ``batchable`` allows when nothing says
  otherwise: on an accelerator, not on a CPU.

  On two CPU cores the suite's models keep the cores busy one run at a time
  (10 seeds of the full-size MNIST MLP: 0.9x the looped speed vmapped; the
  spiral MLP 2.35x, the tabular one 1.5x), and the batched program costs a
  compilation of its own, longer than what it saves on runs of 0.1-1 s; an
  accelerator, which these small models leave mostly idle, runs a batch of
  seeds in about the time of one.
  """
  return jax.default_backend() != 'cpu'


def make_runner(task: definitions.Task, arm: arms_lib.Arm,
                workload: definitions.Workload,
                vmap: Optional[bool] = True) -> Runner:
  """The jitted ``Runner`` of ``arm`` on ``workload``; with batched pieces
  where ``vmap`` (None: ``vmap_by_default()``) and the workload is
  ``batchable``."""
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
    return make_step(task, arm.make(lr, ctx), data_key, dropout_key)

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

  if vmap is None:
    vmap = vmap_by_default()
  if not (vmap and batchable(workload)[0]):
    return Runner(jax.jit(init), chunk, jax.jit(evaluate), workload)
  return Runner(
      jax.jit(init), chunk, jax.jit(evaluate), workload,
      jax.jit(jax.vmap(init)),
      jax.jit(jax.vmap(scanned, in_axes=(0, None, 0, 0))),
      jax.jit(jax.vmap(evaluate)))


# ---------------------------------------------------------------------------
# One run's summary


@dataclasses.dataclass
class RunRecord:
  seed: int
  lr: float
  losses: np.ndarray
  metrics: np.ndarray
  diverged: bool
  initial_metric: float = math.nan

  def to_json(self) -> dict[str, Any]:
    # Python's float repr round-trips exactly; NaN and inf are kept.
    return {'seed': self.seed, 'lr': self.lr,
            'losses': [float(x) for x in self.losses],
            'metrics': [float(x) for x in self.metrics],
            'diverged': self.diverged,
            'initial_metric': float(self.initial_metric)}

  @classmethod
  def from_json(cls, data: dict[str, Any]) -> 'RunRecord':
    return cls(int(data['seed']), float(data['lr']),
               np.asarray(data['losses'], np.float64),
               np.asarray(data['metrics'], np.float64),
               bool(data['diverged']), float(data['initial_metric']))


# ---------------------------------------------------------------------------
# The record store: one file per run, written atomically


def write_atomically(path: pathlib.Path, text: str) -> None:
  """``path`` holds either its old content or all of ``text``, never part."""
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f'.{path.name}.')
  try:
    with os.fdopen(fd, 'w') as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    pathlib.Path(tmp).unlink(missing_ok=True)
    raise


# The modules whose code decides what a run computes (with the library).
_RUN_MODULES = ('cbp_optax_experiments.workloads.arms',
                'cbp_optax_experiments.workloads.definitions',
                'cbp_optax_experiments.workloads.families',
                'cbp_optax_experiments.workloads.protocol',
                'cbp_optax_experiments.workloads.tasks',
                'cbp_optax_experiments.datasets',
                'cbp_optax_experiments.reproduce.flow',
                'cbp_optax_experiments.reproduce.init_scale',
                'cbp_optax_experiments.reproduce.mnist',
                'cbp_optax_experiments.reproduce.resnet',
                'cbp_optax_experiments.reproduce.training',
                'cbp_optax_experiments.reproduce.transformer')


@functools.lru_cache(maxsize=None)
def code_fingerprint() -> str:
  """A hash of the code a run depends on: every source file of the library
  (``cbp_optax``), the suite's run modules, and the jax, optax and flax
  versions. A changed default of the library changes it, so records made
  before the change are not reused."""
  import importlib  # pylint: disable=g-import-not-at-top
  import flax  # pylint: disable=g-import-not-at-top
  import cbp_optax  # pylint: disable=g-import-not-at-top
  digest = hashlib.sha256(
      f'{jax.__version__} {optax.__version__} {flax.__version__}'.encode())
  files = sorted(pathlib.Path(cbp_optax.__file__).parent.rglob('*.py'))
  files += [pathlib.Path(importlib.import_module(m).__file__)
            for m in _RUN_MODULES]
  for path in files:
    digest.update(path.name.encode())
    digest.update(path.read_bytes())
  return digest.hexdigest()[:16]


class RecordStore:
  """Each (workload, arm, rate, seed) run and each (workload, arm) step cost
  as one JSON file under ``root`` (None: nothing is stored).

  A record is used only if the identity it was written under (the
  workload's and arm's definitions, a user arm's code fingerprint included,
  ``context``: data source, ``--quick``, ``RECORD_VERSION``, and
  ``code_fingerprint``) equals the current one, and
  it holds what that run writes (the run's seed and rate, one loss per step
  and one metric per evaluation; a positive step cost); any other, stale or
  damaged, is recomputed and overwritten: a store is a cache.
  """

  def __init__(self, root: Optional[os.PathLike],
               context: Optional[dict[str, Any]] = None):
    self.root = None if root is None else pathlib.Path(root)
    self.context = dict(context or {})

  def identity(self, workload: definitions.Workload,
               arm: arms_lib.Arm) -> dict[str, Any]:
    arm_identity = {'name': arm.name, 'description': arm.description,
                    'centered': arm.centers(workload),
                    'grid_scale': arm.grid_scale}
    if arm.fingerprint:  # a user arm's code (arms.code_fingerprint)
      arm_identity['code'] = arm.fingerprint
    return {'version': RECORD_VERSION, 'code': code_fingerprint(),
            'context': self.context,
            'workload': {'name': workload.name, 'steps': workload.steps,
                         'eval_every': workload.eval_every,
                         'grid': list(workload.grid),
                         'description': workload.description,
                         'metric': workload.metric},
            'arm': arm_identity}

  def _path(self, identity, name: str) -> pathlib.Path:
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()
                            ).hexdigest()[:12]
    return (self.root / identity['workload']['name'] / identity['arm']['name']
            / digest / name)

  def _load(self, identity, name: str,
            decode: Callable[[Any], Any]) -> Optional[Any]:
    """``decode`` of the stored value; None where there is none to use."""
    if self.root is None:
      return None
    path = self._path(identity, name)
    try:
      stored = json.loads(path.read_text())
      if not isinstance(stored, dict) or stored.get('identity') != identity:
        return None  # another definition's, or code's: stale
      return decode(stored['value'])
    except (OSError, ValueError, KeyError, TypeError):
      return None  # absent, unreadable or damaged: computed again

  def _save(self, identity, name: str, value: Any) -> None:
    if self.root is not None:
      write_atomically(self._path(identity, name),
                        json.dumps({'identity': identity, 'value': value}))

  @staticmethod
  def _run_name(lr: float, seed: int) -> str:
    return f'run_lr{float(lr)!r}_seed{int(seed)}.json'

  def load_run(self, identity, lr: float, seed: int) -> Optional[RunRecord]:
    workload = identity['workload']

    def decode(value) -> RunRecord:
      record = RunRecord.from_json(value)
      if ((record.seed, record.lr) != (int(seed), float(lr))
          or not isinstance(value['diverged'], bool)
          or record.losses.shape != (workload['steps'],)
          or record.metrics.shape != (
              workload['steps'] // workload['eval_every'],)):
        raise ValueError('not this run\'s record')
      return record
    return self._load(identity, self._run_name(lr, seed), decode)

  def save_run(self, identity, record: RunRecord) -> None:
    self._save(identity, self._run_name(record.lr, record.seed),
               record.to_json())

  def load_cost(self, identity, lr: float) -> Optional[dict[str, float]]:
    def decode(value) -> dict[str, float]:
      cost = {key: value[key] for key in ('own', 'reference')}
      if not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                 and math.isfinite(v) and v > 0 for v in cost.values()):
        raise ValueError('not a step cost')
      return cost
    return self._load(identity, f'cost_lr{float(lr)!r}.json', decode)

  def save_cost(self, identity, lr: float, cost: dict[str, float]) -> None:
    self._save(identity, f'cost_lr{float(lr)!r}.json', cost)


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


def tuning_value(metrics: Sequence[float], workload,
                 diverged_: bool) -> float:
  """A tuning run's any-time value, the measure the scores read
  (``scoring.anytime_value``) against the workload's ``ladder``; without a
  ladder, the area under its best-so-far curve (the mean over evaluations,
  negated where lower is better): the any-time value of a dense ladder, up
  to a constant. A diverged run is worth nothing (-inf)."""
  if diverged_:
    return -math.inf
  higher = workload.higher_is_better
  if workload.ladder:
    return scoring.anytime_value(list(metrics), workload.ladder, higher,
                                 False)
  area = float(np.mean(scoring.best_so_far(list(metrics), higher)))
  return area if higher else -area


def _select(records: dict[float, list[RunRecord]], workload):
  """The rate with the best median any-time value on the tuning seeds
  (``tuning_value``), then the best median best metric, then the smaller
  rate; None when every rate diverged (a rate on which any tuning run
  diverged is discarded)."""
  sign = 1.0 if workload.higher_is_better else -1.0
  keys = {}
  for lr, runs in records.items():
    if any(r.diverged for r in runs):
      continue
    value = np.median([tuning_value(r.metrics, workload, r.diverged)
                       for r in runs])
    metric = np.median([best_metric(r.metrics.tolist(),
                                    workload.higher_is_better) for r in runs])
    keys[lr] = (-value, -sign * metric, lr)
  if not keys:
    return None
  return min(keys, key=lambda lr: keys[lr])


# ---------------------------------------------------------------------------
# Step cost


# (workload name, budget, arm name) -> the reference arm's Runner.
_REFERENCE: dict = {}


def step_cost(runners: Sequence[Runner], lr: float,
              window: float = COST_WINDOW_SECONDS,
              min_chunks: int = COST_MIN_CHUNKS) -> list[float]:
  """Median seconds per step of each runner's compiled chunk (seed 0, rate
  ``lr``), measured by alternating one chunk of each runner until every one
  has run for ``window`` seconds and ``min_chunks`` chunks.

  Each runner walks through its real trajectory (chunk 0, 1, ...) and starts
  again from its initialization after the budget's last chunk, so the
  timed steps are the steps the runs take. A first round warms up.
  """
  lr, seed = jnp.float32(lr), jnp.int32(0)
  chunks = runners[0].workload.steps // runners[0].workload.eval_every
  carries = [jax.block_until_ready(r.init(seed, lr)) for r in runners]
  times: list[list[float]] = [[] for _ in runners]
  spent = [0.0 for _ in runners]
  index = 0
  while index == 0 or any(s < window or len(t) < min_chunks
                          for s, t in zip(spent, times)):
    c = index % chunks
    for k, runner in enumerate(runners):
      if c == 0 and index:
        carries[k] = jax.block_until_ready(runner.init(seed, lr))
      start = time.perf_counter()
      carries[k] = jax.block_until_ready(
          runner.chunk(carries[k], jnp.int32(c), seed, lr)[0])
      elapsed = time.perf_counter() - start
      if index:  # the first round warms up
        times[k].append(elapsed / runner.workload.eval_every)
        spent[k] += elapsed
    index += 1
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
    seeds: Sequence[int],
    tuning_seeds: Sequence[int] = TUNING_SEEDS,
    on_run: Optional[Callable[[], None]] = None,
    store: Optional[RecordStore] = None,
    cost_window: float = COST_WINDOW_SECONDS,
    vmap: Optional[bool] = None,
) -> ArmOutcome:
  """Grid (extended once at an edge) on ``tuning_seeds``, then ``seeds``.

  Runs and the step cost found in ``store`` are loaded, not recomputed;
  the ones computed are saved there as soon as each batch is done. ``vmap``:
  train each batch (the grid, the seeds) as one vmapped program where the
  workload is ``batchable`` (None: ``vmap_by_default()``).
  """
  start = time.perf_counter()
  store = store or RecordStore(None)
  centered = arm.centers(workload)
  identity = store.identity(workload, arm)
  runner: list[Runner] = []

  def run():
    if not runner:  # built (and compiled) only when something is computed
      runner.append(make_runner(workload.build(centered), arm, workload,
                                vmap))
    return runner[0]

  # One batch width for the grid and the seeds: one compiled program.
  width = max(len(seeds), len(arm.grid(workload)) * len(tuning_seeds))

  def many(pairs: Sequence[tuple[int, float]]) -> list[RunRecord]:
    """The runs ``(seed, lr)``: the stored ones loaded, the others computed
    together (``Runner.run_many``) and saved one by one."""
    records = [store.load_run(identity, lr, seed) for seed, lr in pairs]
    missing = [i for i, r in enumerate(records) if r is None]
    if missing:
      outs = run().run_many([pairs[i][0] for i in missing],
                            [pairs[i][1] for i in missing], width)
      for i, (losses, metrics, initial) in zip(missing, outs):
        seed, lr = pairs[i]
        records[i] = RunRecord(int(seed), float(lr), losses, metrics,
                               diverged(losses, metrics), initial)
        store.save_run(identity, records[i])
    if on_run is not None:
      for _ in pairs:
        on_run()
    return records

  def rates(lrs: Sequence[float]) -> dict[float, list[RunRecord]]:
    """Every tuning seed at each of ``lrs``, as one batch."""
    pairs = [(s, lr) for lr in lrs for s in tuning_seeds]
    done = many(pairs)
    n = len(tuning_seeds)
    return {lr: done[i * n:(i + 1) * n] for i, lr in enumerate(lrs)}

  grid = arm.grid(workload)
  tuning = rates(grid)
  chosen = _select(tuning, workload)
  if chosen is None or chosen in (grid[0], grid[-1]):
    edge = grid[-1] * 3 if chosen == grid[-1] else grid[0] / 3
    tuning.update(rates([edge]))
    chosen = _select(tuning, workload)
    if chosen is None:  # every rate diverged: report the smallest one tried
      chosen = min(tuning)
  runs = many([(s, chosen) for s in seeds])
  cost = store.load_cost(identity, chosen)
  if cost is None:
    key = (workload.name, workload.steps, reference.name)
    if arm.name == reference.name:
      _REFERENCE[key] = run()
      own = step_cost([run()], chosen, cost_window)[0]
      cost = {'own': own, 'reference': own}
    else:
      if key not in _REFERENCE:
        _REFERENCE[key] = make_runner(
            workload.build(reference.centers(workload)), reference, workload)
      own, ref_seconds = step_cost([run(), _REFERENCE[key]], chosen,
                                   cost_window)
      cost = {'own': own, 'reference': ref_seconds}
    store.save_cost(identity, chosen, cost)
  return ArmOutcome(chosen, tuning, runs, cost['own'] / cost['reference'],
                    cost['own'], cost['reference'],
                    time.perf_counter() - start, centered)
