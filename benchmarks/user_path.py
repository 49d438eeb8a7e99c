"""The user's path (issue 32): the fused CBP step against the AdamW step a
user writes, NNX and Linen, called directly and nested in the user's jit;
and the optimizer update's compile time against ``optax.adamw``'s.

The baseline is the tutorials' train step, undonated: for NNX an ``nnx.jit``
of ``nnx.value_and_grad`` and ``nnx.Optimizer.update``; for Linen a
``jax.jit`` of ``jax.value_and_grad``, ``tx.update`` and
``optax.apply_updates``. Every other row is a ratio to it, measured in the
same process: each round runs every row (rotating order) for one window of
back-to-back steps (``WINDOW_S`` of steps, counted once after warm-up) and
one sync, and the ratio of a round is the row's seconds per step over the
baseline's in that round. Reported: the median ratio and its min-max over
the rounds.

Rows live in ``ROWS`` and optimizers in ``OPTIMIZERS``; a new recipe is one
entry in each.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import re
import time
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import cbp_optax as cbp
from benchmarks import models, timing

LEARNING_RATE = 1e-3
WINDOW_S, QUICK_WINDOW_S = 0.4, 0.02
ROUNDS, QUICK_ROUNDS = 9, 3
WARMUP = 3  # calls after the compiling one, before the window is sized
BATCH = 128
TRANSFORMER_BATCH = 32  # x 128 tokens: the suite's transformer protocol
APIS = ('nnx', 'linen')
LEAF_COUNTS = (50, 200, 2000)
QUICK_COMPILE_ROUNDS = 1
LEAF_SIDE = 8  # every kernel LEAF_SIDE x LEAF_SIDE, every bias LEAF_SIDE
BEGIN = '<!-- user-path:begin -->'
END = '<!-- user-path:end -->'


def default_archs(quick: bool) -> list[models.Arch]:
  """The issue's models: MLPs 784-W-W-10, the tutorial CNN, the LM."""
  if quick:  # the CNN and LM compile for minutes on a busy 2-core machine
    return [models.mlp(32, depth=2)]
  return ([models.mlp(w, depth=2) for w in (128, 512, 1024, 2048, 4096)]
          + [models.cnn(), models.TRANSFORMER])


def batch_for(arch: models.Arch, quick: bool) -> int:
  if quick:
    return 8
  return TRANSFORMER_BATCH if arch.kind == 'transformer' else BATCH


# ------------------------------------------------------------------ rows

# name -> make(stacked, dims) -> optax transform; ``stacked`` is the NNX
# stack predicate of the model (M1's per-layer slices), None for other
# optimizers and models without stacks; ``dims`` is Muon's weight dimension
# numbers for the model (``cbp.nnx.muon_dimension_numbers``, the Linen one),
# None for optax's default (every 2-D leaf a matrix).
OPTIMIZERS: dict[str, Callable[[Any, Any], optax.GradientTransformation]] = {
    'adamw': lambda stacked, dims: optax.adamw(LEARNING_RATE),
    'cbp': lambda stacked, dims: cbp.cbp(LEARNING_RATE, stacked=stacked),
    'cbp_robust': lambda stacked, dims: cbp.cbp_robust(LEARNING_RATE,
                                                       stacked=stacked),
    # The recommended recipe: schedule-free CBP M3, for the centered model.
    'recommended': lambda stacked, dims: cbp.recommended(LEARNING_RATE),
    # Muon as the workload suite runs it (the recipe's runner-up on dev).
    'muon': lambda stacked, dims: optax.contrib.muon(
        LEARNING_RATE, adam_weight_decay=0.0,
        muon_weight_dimension_numbers=dims, consistent_rms=0.2),
}


@dataclasses.dataclass(frozen=True)
class Row:
  """One timed train step.

  Attributes:
    name: label in tables.
    optimizer: key of ``OPTIMIZERS``.
    centered: center the model (``cbp.nnx.center`` / ``cbp.linen.center``).
    path: ``'user'``: the user's own jit step, no cbp_optax; ``'direct'``:
      the fused step (``cbp.nnx.train_step`` / ``cbp.linen.train_step``)
      called directly; ``'nested'``: the fused step called inside the user's
      own undonated ``nnx.jit`` / ``jax.jit``.
    donate: the user's jit donates the model and optimizer (``'user'``).
  """

  name: str
  optimizer: str
  centered: bool
  path: str
  donate: bool = False


BASELINE = Row('AdamW, user jit', 'adamw', False, 'user')
ROWS: tuple[Row, ...] = (
    BASELINE,
    Row('AdamW, user jit, donated', 'adamw', False, 'user', donate=True),
    Row('AdamW fused', 'adamw', False, 'direct'),
    Row('AdamW fused, centered', 'adamw', True, 'direct'),
    Row('cbp fused, centered', 'cbp', True, 'direct'),
    Row('cbp_robust fused, centered', 'cbp_robust', True, 'direct'),
    Row('cbp_robust nested, centered', 'cbp_robust', True, 'nested'),
    Row('recommended fused, centered', 'recommended', True, 'direct'),
    Row('recommended nested, centered', 'recommended', True, 'nested'),
    Row('muon fused, centered', 'muon', True, 'direct'),
)
# Issue 32's targets, on the fused/baseline ratio of the optimizers below.
TARGET_OPTIMIZERS = ('cbp', 'cbp_robust')
TARGET_DIRECT, TARGET_NESTED, TARGET_FAST = 1.05, 1.10, 1.15
FAST_STEP_S = 1e-3  # "models whose steps take under 1 ms" (the baseline's)
TARGET_MLP_WIDTHS = (512, 4096)
COMPILE_TARGET, COMPILE_TARGET_LEAVES = 1.5, (200, 2000)


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@dataclasses.dataclass
class Runner:
  """A row bound to its own model and optimizer state.

  Attributes:
    row: what is timed.
    api: ``'nnx'`` or ``'linen'``.
    step: one train step as the user calls it; returns without waiting.
    sync: waits for the current state.
    first_call_s: the first call (trace, compile, one step).
    params: returns the current parameters as arrays (plain models: the
      trained ones; centered: the centered layers' stored ones).
    centered_layers: layers the model centers (0 for plain rows).
    compiled_text: the optimized HLO of the program ``step`` runs
      (``benchmarks.hlo_traffic`` reads the bytes it moves).
  """

  row: Row
  api: str
  step: Callable[[], Any]
  sync: Callable[[], None]
  first_call_s: float
  params: Callable[[], Any]
  centered_layers: int
  compiled_text: Callable[[], str]


def _first_call(step: Callable[[], Any], sync: Callable[[], None]) -> float:
  start = time.perf_counter()
  step()
  sync()
  return time.perf_counter() - start


def nnx_runner(arch: models.Arch, row: Row, batch: int) -> Runner:
  """``row`` on ``arch`` in NNX, compiled by its first call."""
  x, y = models.make_batch(arch, batch)
  # Built centered as models.nnx_model centers it (the transformer's blocks
  # inside their vmap, where center can tell the stack axis).
  model = models.nnx_model(arch, centered=row.centered)
  stacked = models.stacked_for(arch, model) if row.centered else None
  tx = OPTIMIZERS[row.optimizer](stacked,
                                 cbp.nnx.muon_dimension_numbers(model))

  def loss_fn(model, x, y):
    return cross_entropy(model(x), y)

  if row.path == 'user':
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    def user_step(model, optimizer, x, y):
      loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
      optimizer.update(model, grads)
      return loss

    jitted = nnx.jit(user_step, donate_argnums=(0, 1) if row.donate else ())
  else:
    optimizer = cbp.nnx.Optimizer(model, tx)
    fused = cbp.nnx.train_step(loss_fn)
    if row.path == 'direct':
      jitted = fused
    else:

      @nnx.jit
      def jitted(model, optimizer, x, y):
        return fused(model, optimizer, x, y).loss

  def step():
    return jitted(model, optimizer, x, y)

  def sync():
    jax.block_until_ready(nnx.state((model, optimizer)))

  first = _first_call(step, sync)
  return Runner(
      row=row, api='nnx', step=step, sync=sync, first_call_s=first,
      params=lambda: nnx.to_pure_dict(nnx.state(model, nnx.Param)),
      centered_layers=len(cbp.nnx.centered_layers(model)),
      compiled_text=lambda: jitted.lower(
          model, optimizer, x, y).compile().as_text())


def linen_runner(arch: models.Arch, row: Row, batch: int) -> Runner:
  """``row`` on ``arch`` in Linen, compiled by its first call."""
  x, y = models.make_batch(arch, batch)
  module: Any = models.linen_model(arch, centered=False)
  if row.centered:
    module = cbp.linen.center(module)
  variables = module.init(jax.random.key(0), x)
  tx = OPTIMIZERS[row.optimizer](None, cbp.linen.muon_dimension_numbers(
      module, jax.random.key(0), x))
  holder: dict[str, Any] = {}

  if row.path == 'user':
    holder.update(params=variables['params'],
                  opt_state=tx.init(variables['params']))

    def user_step(params, opt_state, x, y):
      def loss_of(params):
        return cross_entropy(module.apply({'params': params}, x), y)
      loss, grads = jax.value_and_grad(loss_of)(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    jitted = jax.jit(user_step, donate_argnums=(0, 1) if row.donate else ())

    def step():
      holder['params'], holder['opt_state'], loss = jitted(
          holder['params'], holder['opt_state'], x, y)
      return loss

    def sync():
      jax.block_until_ready((holder['params'], holder['opt_state']))

    params = lambda: holder['params']  # noqa: E731
    n_centered = 0
    arguments = lambda: (holder['params'], holder['opt_state'], x, y)  # noqa: E731
  else:
    holder['state'] = cbp.linen.TrainState.create(
        apply_fn=module.apply, params=variables['params'],
        centering=variables.get('centering', {}), tx=tx)

    def loss_fn(apply, x, y):
      return cross_entropy(apply(x), y)

    fused = cbp.linen.train_step(loss_fn)
    if row.path == 'direct':
      jitted = fused
    else:

      @jax.jit
      def jitted(state, x, y):
        state, out = fused(state, x, y)
        return state, out.loss

    def step():
      holder['state'], out = jitted(holder['state'], x, y)
      return out

    def sync():
      jax.block_until_ready(holder['state'])

    params = lambda: holder['state'].params  # noqa: E731
    arguments = lambda: (holder['state'], x, y)  # noqa: E731
    # One entry per centered layer: its mean and its recording state.
    n_centered = len(variables.get('centering', {}))

  first = _first_call(step, sync)
  return Runner(row=row, api='linen', step=step, sync=sync,
                first_call_s=first, params=params,
                centered_layers=n_centered,
                compiled_text=lambda: jitted.lower(
                    *arguments()).compile().as_text())


def make_runner(api: str, arch: models.Arch, row: Row, batch: int) -> Runner:
  if api == 'nnx':
    return nnx_runner(arch, row, batch)
  if api == 'linen':
    return linen_runner(arch, row, batch)
  raise ValueError(f'Unknown api {api!r}; use nnx or linen.')


def supports(api: str, arch: models.Arch) -> bool:
  """The transformer is NNX only (``nnx.vmap`` stacks, ``nnx.scan``)."""
  return not (api == 'linen' and arch.kind == 'transformer')


# ---------------------------------------------------------------- timing


def build(api: str, arch: models.Arch, batch: int, rows: Sequence[Row],
          log: Callable[[str], None] = lambda m: None) -> dict[str, Runner]:
  """One compiled runner per row, each on its own copy of the model."""
  runners = {}
  for row in rows:
    log(f'  build {api} {arch.name}: {row.name}')
    runners[row.name] = make_runner(api, arch, row, batch)
  return runners


def time_runners(runners: Mapping[str, Runner], rounds: int,
                 window_s: float) -> dict[str, dict[str, Any]]:
  """Warms up, sizes the windows and times ``runners``, interleaved; per
  row: its seconds per step and its per-round ratio to the baseline."""
  if BASELINE.name not in runners:
    raise ValueError(f'The rows must include the baseline {BASELINE.name!r}.')
  for runner in runners.values():
    for _ in range(WARMUP):
      runner.step()
    runner.sync()
  counts = {n: timing.steps_per_window(r.step, r.sync, window_s)
            for n, r in runners.items()}
  times = timing.windowed({n: r.step for n, r in runners.items()},
                          {n: r.sync for n, r in runners.items()},
                          counts, rounds)
  reference = np.asarray(times[BASELINE.name], float)
  out = {}
  for name, runner in runners.items():
    out[name] = {
        'optimizer': runner.row.optimizer, 'centered': runner.row.centered,
        'path': runner.row.path, 'donate': runner.row.donate,
        'steps_per_window': counts[name],
        'time': timing.spread(times[name]),
        'ratio': timing.spread(np.asarray(times[name], float) / reference),
        'first_call_s': runner.first_call_s,
        'centered_layers': runner.centered_layers,
    }
  return out


def time_group(api: str, arch: models.Arch, batch: int, rows: Sequence[Row],
               rounds: int, window_s: float,
               log: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
  """Builds and times every row of one model; the machine's load around."""
  load_at_start = os.getloadavg()
  runners = build(api, arch, batch, rows, log)
  n_params = models.count_params(runners[BASELINE.name].params())
  timed = time_runners(runners, rounds, window_s)
  del runners
  gc.collect()
  return {'arch': arch.name, 'kind': arch.kind, 'width': arch.width,
          'api': api, 'batch': batch, 'params': n_params, 'rounds': rounds,
          'window_s': window_s,
          'load_average': {'start': load_at_start, 'end': os.getloadavg()},
          'rows': timed}


def run_steps(archs: Sequence[models.Arch], apis: Sequence[str],
              rounds: int, window_s: float, quick: bool,
              rows: Sequence[Row] = ROWS,
              log: Callable[[str], None] = lambda m: None,
              save: Callable[[list], None] = lambda groups: None) -> list:
  """Every model in every API; ``save`` after each group."""
  groups = []
  for api in apis:
    for arch in archs:
      if not supports(api, arch):
        continue
      batch = batch_for(arch, quick)
      log(f'user path: {api} {arch.name} batch {batch}')
      group = time_group(api, arch, batch, rows, rounds, window_s, log)
      groups.append(group)
      base = group['rows'][BASELINE.name]['time']['median']
      for name, r in group['rows'].items():
        log(f'  {name}: {1e3 * r["time"]["median"]:.3g} ms, / baseline '
            f'{r["ratio"]["median"]:.3f} [{r["ratio"]["min"]:.3f}-'
            f'{r["ratio"]["max"]:.3f}]' + ('' if name != BASELINE.name else
                                          f' (baseline {1e3 * base:.3g} ms)'))
      save(groups)
  return groups


# ------------------------------------------------------- compile time


def leaf_tree(n_leaves: int, side: int = LEAF_SIDE) -> dict[str, Any]:
  """Shapes of a parameter tree of ``n_leaves`` leaves: kernel/bias pairs
  of dense layers (one M1 block each), as a Linen ``params`` dict."""
  if n_leaves < 2 or n_leaves % 2:
    raise ValueError(f'n_leaves must be even and >= 2, got {n_leaves}.')
  f32 = jnp.float32
  return {f'Dense_{i}': {'kernel': jax.ShapeDtypeStruct((side, side), f32),
                         'bias': jax.ShapeDtypeStruct((side,), f32)}
          for i in range(n_leaves // 2)}


def compile_rounds(n_leaves: int) -> int:
  """Rounds per leaf count: at 2,000 leaves one compile took 79 s (adamw)
  to 137 s (cbp) of wall time on 2 shared cores (load 8)."""
  if n_leaves <= 500:
    return 5
  return 3 if n_leaves <= 5000 else 1


def compile_update(tx: optax.GradientTransformation,
                   params: Any) -> dict[str, float]:
  """Trace, lower and compile ``jax.jit(tx.update)`` from cold caches.

  CPU seconds are the process's (every thread: XLA compiles on a pool);
  wall seconds are what the user waits.
  """
  state = jax.eval_shape(tx.init, params)
  jax.clear_caches()
  cpu, wall = time.process_time(), time.perf_counter()
  lowered = jax.jit(tx.update).lower(params, state, params)
  lower_wall = time.perf_counter() - wall
  lowered.compile()
  return {'cpu_s': time.process_time() - cpu,
          'wall_s': time.perf_counter() - wall, 'lower_wall_s': lower_wall}


def run_compile(leaf_counts: Sequence[int], rounds: Optional[int] = None,
                optimizers: Sequence[str] = tuple(OPTIMIZERS),
                log: Callable[[str], None] = lambda m: None) -> dict:
  """Compile seconds of each optimizer's update, interleaved per round, and
  per-round ratios to AdamW's; ``rounds`` defaults to
  :func:`compile_rounds`."""
  # The first compile of a process pays one-time setup; keep it untimed.
  compile_update(optax.adamw(LEARNING_RATE), leaf_tree(2))
  rows = []
  for n in leaf_counts:
    params = leaf_tree(n)
    n_rounds = rounds or compile_rounds(n)
    log(f'compile time: {n} leaves, {n_rounds} rounds')
    seconds: dict[str, list[dict]] = {name: [] for name in optimizers}
    for r in range(n_rounds):
      shift = r % len(optimizers)
      for name in list(optimizers[shift:]) + list(optimizers[:shift]):
        seconds[name].append(compile_update(OPTIMIZERS[name](None, None),
                                          params))
    row = {'leaves': n, 'rounds': n_rounds, 'optimizers': {}}
    for name, runs in seconds.items():
      entry = {}
      for key in ('cpu_s', 'wall_s', 'lower_wall_s'):
        values = np.asarray([run[key] for run in runs])
        base = np.asarray([run[key] for run in seconds['adamw']])
        entry[key] = timing.spread(values)
        entry[key.replace('_s', '_ratio')] = timing.spread(values / base)
      row['optimizers'][name] = entry
      log(f'  {name}: {entry["wall_s"]["median"]:.2f} s wall (trace and '
          f'lower {entry["lower_wall_s"]["median"]:.2f} s), / adamw '
          f'{entry["wall_ratio"]["median"]:.2f} (CPU '
          f'{entry["cpu_ratio"]["median"]:.2f}, lower '
          f'{entry["lower_wall_ratio"]["median"]:.2f})')
    rows.append(row)
  return {'leaf_side': LEAF_SIDE, 'rows': rows}


def run(args: Any, log: Callable[[str], None] = lambda m: None,
        save: Callable[[dict], None] = lambda r: None) -> dict:
  """The section: step ratios, then compile times."""
  quick = bool(args.quick)
  archs = (select_archs(args.user_archs) if args.user_archs
           else default_archs(quick))
  apis = args.user_apis.split(',') if args.user_apis else list(APIS)
  rounds = args.user_rounds or (QUICK_ROUNDS if quick else ROUNDS)
  window = args.window or (QUICK_WINDOW_S if quick else WINDOW_S)
  if args.compile_leaves is not None:
    leaves = [int(n) for n in args.compile_leaves.split(',') if n]
  else:
    leaves = [50] if quick else list(LEAF_COUNTS)
  result: dict[str, Any] = {'rounds': rounds, 'window_s': window,
                            'rows': [dataclasses.asdict(r) for r in ROWS]}

  def save_groups(groups):
    result['groups'] = groups
    save(result)

  result['groups'] = run_steps(archs, apis, rounds, window, quick, log=log,
                               save=save_groups)
  if leaves:
    result['compile'] = run_compile(
        leaves, args.compile_rounds or (QUICK_COMPILE_ROUNDS if quick
                                        else None), log=log)
  save(result)
  return result


def select_archs(names: str) -> list[models.Arch]:
  """``MLP-2x512,CNN,Transformer`` (also ``MLP-1024``, ``CNN-8``, ...)."""
  out = []
  for name in names.split(','):
    if name == 'Transformer':
      out.append(models.TRANSFORMER)
    elif name == 'CNN':
      out.append(models.cnn())
    elif name.startswith('CNN-'):
      out.append(models.cnn(int(name[4:])))
    elif name.startswith('Transformer-'):  # Transformer-2x32-ctx16
      size, _, context = name[len('Transformer-'):].partition('-ctx')
      depth, _, width = size.partition('x')
      out.append(models.transformer(int(width), int(depth), int(context)))
    elif name == 'ResNet-8':
      out.append(models.RESNET8)
    elif name.startswith('MLP-'):
      depth, _, width = name[4:].rpartition('x')
      out.append(models.mlp(int(width), int(depth) if depth
                            else models.MLP_DEPTH))
    else:
      raise ValueError(f'Unknown model {name!r}: MLP-2x512, MLP-1024, CNN, '
                       'CNN-8, ResNet-8, Transformer or Transformer-2x32-ctx16.')
  return out


# ---------------------------------------------------------------- report


def _ratio(stats: Optional[Mapping[str, float]]) -> str:
  if not stats:
    return '-'
  return f"{stats['median']:.2f} [{stats['min']:.2f}-{stats['max']:.2f}]"


def _ms(seconds: float) -> str:
  ms = 1e3 * seconds
  return f'{ms:.3g}' if ms < 100 else f'{ms:.0f}'


def target_for(group: Mapping[str, Any], path: str) -> Optional[float]:
  """Issue 32's bound on a fused row / the baseline, or None.

  1.15 where the baseline step takes under 1 ms; else 1.05 direct and 1.10
  nested, for MLP widths 512-4,096 and the CNN; no bound elsewhere (the
  transformer, narrower MLPs with slower steps).
  """
  base = group['rows'][BASELINE.name]['time']['median']
  if base < FAST_STEP_S:
    return TARGET_FAST
  lo, hi = TARGET_MLP_WIDTHS
  if (group['kind'] == 'mlp' and lo <= group['width'] <= hi
      or group['kind'] == 'cnn'):
    return TARGET_NESTED if path == 'nested' else TARGET_DIRECT
  return None


def _met(stats: Optional[Mapping[str, float]],
         target: Optional[float]) -> str:
  if not stats or target is None:
    return '-'
  return 'yes' if stats['median'] <= target else 'no'


def steps_table(groups: Sequence[Mapping[str, Any]]) -> str:
  names = [n for n in groups[0]['rows'] if n != BASELINE.name]
  head = (['model', 'API', 'batch', 'params', 'load', 'AdamW user jit ms']
          + [f'{n} / baseline' for n in names])
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for g in groups:
    load = g['load_average']
    cells = [g['arch'], g['api'], str(g['batch']),
             f"{g['params'] / 1e6:.2f}M",
             f"{load['start'][0]:.1f}-{load['end'][0]:.1f}",
             _ms(g['rows'][BASELINE.name]['time']['median'])]
    cells += [_ratio(g['rows'].get(n, {}).get('ratio')) for n in names]
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def targets_table(groups: Sequence[Mapping[str, Any]]) -> str:
  """Each fused cbp / cbp_robust row against its target."""
  fused = [n for n, r in groups[0]['rows'].items()
           if r['path'] != 'user' and r['optimizer'] in TARGET_OPTIMIZERS]
  head = ['model', 'API', 'AdamW user jit ms'] + [
      f'{n} (target, met)' for n in fused]
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for g in groups:
    cells = [g['arch'], g['api'],
             _ms(g['rows'][BASELINE.name]['time']['median'])]
    for n in fused:
      row = g['rows'].get(n)
      if row is None:
        cells.append('-')
        continue
      target = target_for(g, row['path'])
      bound = '-' if target is None else f'<= {target:.2f}'
      cells.append(f"{row['ratio']['median']:.2f} ({bound}, "
                   f"{_met(row['ratio'], target)})")
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def compile_table(result: Mapping[str, Any]) -> str:
  rows = result['rows']
  names = [n for n in rows[0]['optimizers'] if n != 'adamw']
  kinds = (('wall', 'wall_ratio'), ('CPU', 'cpu_ratio'),
           ('trace+lower', 'lower_wall_ratio'))
  head = ['leaves', 'rounds', 'adamw wall s', 'adamw CPU s',
          'adamw trace+lower s'] + [
              f'{n} / adamw {kind}' for n in names for kind, _ in kinds] + [
                  'target (wall)']
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for row in rows:
    adamw = row['optimizers']['adamw']
    cells = [str(row['leaves']), str(row['rounds']),
             f"{adamw['wall_s']['median']:.2f}",
             f"{adamw['cpu_s']['median']:.2f}",
             f"{adamw['lower_wall_s']['median']:.2f}"]
    for n in names:
      entry = row['optimizers'][n]
      cells += [_ratio(entry[key]) for _, key in kinds]
    target = row['leaves'] in COMPILE_TARGET_LEAVES
    if target:
      met = all(row['optimizers'][n]['wall_ratio']['median'] <= COMPILE_TARGET
                for n in names if n in TARGET_OPTIMIZERS)
      cells.append(f"<= {COMPILE_TARGET} ({'met' if met else 'missed'})")
    else:
      cells.append('-')
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def render(user: Mapping[str, Any], env: Mapping[str, Any],
           command: str) -> str:
  """The BENCHMARKS.md section (without its markers)."""
  revision = env.get('revision', {})
  parts = [
      "## The user's path: fused CBP step / the AdamW step a user writes "
      '(issue 32)', '',
      'Generated by `benchmarks/run.py` (this section only, between its '
      'markers); rerun with:', '', '```bash', command, '```', '',
      f"- date: {env['date']}; mode: {env['mode']}",
      f"- machine: {env['machine']}; load average at start "
      f"{env['load_average_at_start'][0]:.1f}",
      f"- jax {env['jax']}, jaxlib {env['jaxlib']}, flax {env['flax']}, "
      f"optax {env['optax']}, backend {env['backend']}; XLA_FLAGS "
      f"`{env['xla_flags'] or '(none)'}`",
      f"- commit {revision.get('commit', '?')}; library files differing "
      f"from it: {', '.join(revision.get('library_uncommitted', [])) or 'none'}",
      '',
      '**Protocol.** Baseline: AdamW (`optax.adamw(1e-3)`) in the step a '
      'user writes, undonated as the tutorials write it: NNX `nnx.jit` of '
      '`nnx.value_and_grad` + `nnx.Optimizer.update`, Linen `jax.jit` of '
      '`jax.value_and_grad` + `tx.update` + `optax.apply_updates`. Fused: '
      '`cbp.nnx.train_step` (with `cbp.nnx.Optimizer`) / '
      '`cbp.linen.train_step`, called directly, or (nested) inside the '
      "user's own undonated `nnx.jit` / `jax.jit`. Centered: "
      '`cbp.nnx.center` / `cbp.linen.center` on the same model. '
      f"Every round runs each row for a window of ~{user['window_s']} s of "
      'back-to-back steps and one sync, rows in rotating order, all in one '
      'process; a cell is the median [min-max] over '
      f"{user['rounds']} rounds of that row's seconds per step over the "
      "baseline's in the same round. Models: MLPs 784-W-W-10 (ReLU), the "
      'Flax MNIST tutorial CNN, the scanned byte-level LM (NNX only). '
      'Random inputs, one fixed batch, learning rate 1e-3.', '',
      steps_table(user['groups']), '',
      '**Issue 32 targets** (fused / baseline, median): direct <= 1.05 and '
      'nested <= 1.10 for MLP widths 512-4,096 and the CNN; <= 1.15 where '
      'the baseline step takes under 1 ms.', '',
      targets_table(user['groups']), '']
  if user.get('compile'):
    parts += [
        '**Compile time of the optimizer update alone**: '
        '`jax.jit(tx.update).lower(grads, state, params).compile()` from '
        '`jax.clear_caches()`, on a Linen-style tree of kernel/bias pairs '
        f"({user['compile']['leaf_side']}x{user['compile']['leaf_side']} "
        'kernels), per-round ratios to `optax.adamw` interleaved, median '
        '[min-max]; CPU = process CPU time (every XLA thread); trace+lower '
        '= the Python side (`lower`), the rest is XLA. Target: <= 1.5 '
        '(wall) at 200 and 2,000 leaves.', '',
        compile_table(user['compile']), '']
  return '\n'.join(parts)


def replace_section(text: str, section: str, begin_marker: str = BEGIN,
                    end_marker: str = END) -> str:
  """``text`` with the part between the markers set to ``section``.

  The markers default to this section's; another generated section
  (``benchmarks.step_traffic``) passes its own. Without them the section
  goes on top: before the first ``## `` heading (after the title and its
  introduction). Everything outside the markers is kept byte for byte.

  Raises:
    ValueError: only one marker, or the end marker first (a damaged file
      is not rewritten).
  """
  block = f'{begin_marker}\n{section.strip()}\n{end_marker}'
  begin, end = text.find(begin_marker), text.find(end_marker)
  if begin >= 0 and end > begin:
    if (text.find(begin_marker, begin + 1) >= 0
        or text.find(end_marker, end + 1) >= 0):
      raise ValueError(
          f'More than one {begin_marker} ... {end_marker} section.')
    return text[:begin] + block + text[end + len(end_marker):]
  if begin >= 0 or end >= 0:
    raise ValueError(f'Found only one of {begin_marker} / {end_marker}, or '
                     'the end first: fix the file by hand.')
  at = _first_free_heading(text)
  if at < 0:
    return text + ('\n' if text and not text.endswith('\n') else '') + (
        block + '\n')
  return text[:at + 1] + block + '\n\n' + text[at + 1:]


_GENERATED = re.compile(r'<!-- ([\w-]+):begin -->.*?<!-- \1:end -->',
                        re.DOTALL)


def _first_free_heading(text: str) -> int:
  """Where the first ``## `` heading outside every generated section
  starts (its preceding newline), or -1: a new section never lands inside
  another, whose next rewrite would delete it."""
  taken = [m.span() for m in _GENERATED.finditer(text)]
  at = text.find('\n## ')
  while at >= 0 and any(start <= at < end for start, end in taken):
    at = text.find('\n## ', at + 1)
  return at


def write_section(path: str, section: str, begin_marker: str = BEGIN,
                  end_marker: str = END) -> None:
  text = ''
  if os.path.exists(path):
    with open(path) as f:
      text = f.read()
  updated = replace_section(text, section, begin_marker, end_marker)
  with open(path, 'w') as f:
    f.write(updated)
