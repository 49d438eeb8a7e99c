"""Beyond the paper: which opt-in extension makes CBP match AdamW on a transformer.

The test bed is the transformer study (``transformer.py``): a byte-level
language model over the Python standard library's sources, pre-LN blocks
stacked with ``nnx.vmap`` and run with ``nnx.scan``, warm-up + cosine, weight
decay 0.1 on kernels, validation bits per byte. Every arm has its own
learning-rate grid at seed 0 (extended by one point when the best rate is at
an edge of it), then seeds 1.. at the chosen rate. Seeds pair the arms: the
same seed gives every arm the same initialization, batches and dropout masks,
so AdamW and each CBP variant are compared by a paired t-test over seeds.

Arms (all CBP arms are full CBP, i.e. the model centered by
``cbp_optax.nnx.center`` and ``cbp.cbp`` with one M1 block per layer slice,
except "former cbp_transformer, not centered", the optimizer side alone):

* AdamW: ``optax.adamw`` (eps 1e-8), the reference.
* CBP (Algorithm 1): ``cbp.cbp`` with its defaults.
* + small damping: ``damping=1e-8`` alone (Adam's epsilon, no relative term).
* + relative damping: ``damping=1e-8, relative_damping=0.03``.
* + zero-moment identity: ``zero_moment='identity'``.
* + kernel blocks: ``block_fn=cbp.kernel_blocks`` (M1 on matrices only).
* + M1 off: ``block_fn=cbp.no_blocks`` (S_t = I).
* former cbp_transformer: the combination (small damping, relative damping,
  zero-moment identity, M1 off; ``configurations.TRANSFORMER_COMBINATION``), what
  ``cbp.cbp_transformer`` was until it became an alias of ``cbp_robust``.
* former cbp_transformer, not centered: the combination on the plain model
  (the optimizer side alone).
* cbp_robust: ``cbp.cbp_robust``, the recommended configuration (small
  damping, normalized first step, update clip, M1's scales at one).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import pathlib
import sys
import time
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm
from flax import nnx

import cbp_optax as cbp
from cbp_optax_experiments import configurations
from cbp_optax_experiments.reproduce import head_to_head
from cbp_optax_experiments.reproduce import mnist
from cbp_optax_experiments.reproduce import plotting
from cbp_optax_experiments.reproduce import stats
from cbp_optax_experiments.reproduce import training
from cbp_optax_experiments.reproduce import transformer as lm
from cbp_optax_experiments.reproduce.context import StudyContext, StudyResult

NAME = 'transformer-ablation'
TITLE = ('Beyond the paper: opt-in extensions of CBP on a byte-level '
         'transformer LM, against AdamW')
REFERENCE = 'AdamW'

# The transformer study's reduced run: 4 scanned layers, width 64, context 64,
# 240 steps (237,184 parameters).
CONFIG = lm.Config(depth=4, width=64, heads=4, context=64, batch=32,
                   steps=240, eval_every=24, eval_windows=64)
QUICK = lm.QUICK
# --quick: a smoke test of the reference, Algorithm 1 and the recommended
# configuration.
QUICK_ARMS = ('AdamW', 'CBP (Algorithm 1)', 'cbp_robust')


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One arm: a name, whether the model is centered, the CBP keywords."""
  name: str
  centered: bool
  cbp_kwargs: Optional[dict[str, Any]]  # None: AdamW.
  grid: tuple[float, ...]
  # train_run reads `arm.cbp` to decide whether M1 profiles are recorded.
  cbp: bool = False


def _cbp(name, centered=True, grid=(1e-2, 3e-2, 1e-1), **kwargs):
  return Candidate(name, centered, kwargs, grid)


CANDIDATES = (
    Candidate('AdamW', False, None, (3e-3, 1e-2, 3e-2)),
    _cbp('CBP (Algorithm 1)'),
    _cbp('+ small damping', damping=1e-8, grid=(3e-3, 1e-2, 3e-2)),
    _cbp('+ relative damping', damping=1e-8, relative_damping=0.03,
         grid=(3e-3, 1e-2, 3e-2)),
    _cbp('+ zero-moment identity', zero_moment='identity'),
    _cbp('+ kernel blocks', block_fn=cbp.kernel_blocks),
    _cbp('+ M1 off', block_fn=cbp.no_blocks),
    _cbp('former cbp_transformer', grid=(3e-3, 1e-2, 3e-2),
         **configurations.TRANSFORMER_COMBINATION),
    _cbp('former cbp_transformer, not centered', centered=False,
         grid=(3e-3, 1e-2, 3e-2), **configurations.TRANSFORMER_COMBINATION),
    _cbp('cbp_robust', robust_alias=True, grid=(3e-3, 1e-2, 3e-2)),
)


def make_tx(candidate: Candidate, model, steps: int):
  """The arm's transform with a unit-peak schedule, then ``x peak``."""
  lr = lm.schedule(1.0, steps)
  if candidate.cbp_kwargs is None:
    base = optax.adamw(lr, weight_decay=lm.WEIGHT_DECAY, mask=lm.decay_mask)
  else:
    kwargs = dict(candidate.cbp_kwargs)
    factory = configurations.cbp_study  # cbp.cbp, with relative_damping
    if kwargs.pop('robust_alias', False):
      factory = cbp.cbp_robust
    base = factory(lr, weight_decay=lm.WEIGHT_DECAY, mask=lm.decay_mask,
                   stacked=lm.stacked_for(model, candidate.centered), **kwargs)
  return lm.peak_scaled(base)


def _final(run: lm.Run) -> float:
  return run.final_bpb if math.isfinite(run.final_bpb) else math.inf


def _extend(grid: Sequence[float], best: int) -> Optional[float]:
  """The next rate past the edge the best rate sits on (x 3), if it does."""
  if len(grid) < 2:
    return None
  if best == len(grid) - 1:
    return grid[-1] * (grid[-1] / grid[-2])
  if best == 0:
    return grid[0] / (grid[1] / grid[0])
  return None


def tune(trainer, corpus, val, grid, bar) -> dict[float, lm.Run]:
  """Seed-0 runs over ``grid``, extended once past an edge that wins."""
  runs: dict[float, lm.Run] = {}
  rates = list(grid)
  for extension in range(2):
    for lr in rates:
      if lr in runs:
        continue
      bar.set_postfix_str(f'{trainer.arm.name} lr {lr:g}')
      runs[lr] = lm.train_run(trainer, corpus, lr, 0, val)
      bar.update()
    ordered = sorted(runs)
    best = min(range(len(ordered)), key=lambda i: _final(runs[ordered[i]]))
    extra = _extend(ordered, best) if extension == 0 else None
    if extra is None:
      break
    bar.total += 1
    rates = [extra]
  return dict(sorted(runs.items()))


def _changed_defaults(factory) -> dict[str, Any]:
  """The keyword defaults of ``factory`` that differ from ``cbp.cbp``'s."""
  base = inspect.signature(cbp.cbp).parameters
  return {name: p.default
          for name, p in inspect.signature(factory).parameters.items()
          if name in base and p.default is not inspect.Parameter.empty
          and p.default != base[name].default}


def options(candidate: Candidate) -> dict[str, Any]:
  """The CBP keywords an arm changes from ``cbp.cbp``'s defaults."""
  kwargs = dict(candidate.cbp_kwargs or {})
  if kwargs.pop('robust_alias', False):
    kwargs = {**_changed_defaults(cbp.cbp_robust), **kwargs}
  return {k: getattr(v, '__name__', v) for k, v in kwargs.items()}


def equal_time_bpb(run: lm.Run, steps: float) -> float:
  """Validation loss after ``steps`` steps (linear between evaluations; the
  final loss past the run's end)."""
  return float(np.interp(steps, np.asarray(run.eval_steps, float),
                         np.asarray(run.val_bpb, float)))


def interleaved_step_ratio(trainer: lm.Trainer, reference: lm.Trainer,
                           corpus: lm.Corpus, steps: int = 20) -> float:
  """Median step time of ``trainer`` over ``reference``'s, the two stepped
  alternately on the same batches, so machine load affects both alike.

  The runs themselves are timed one after the other; on a shared machine
  their own clocks also measure the load when they ran.
  """
  config = trainer.config
  starts = lm.training_batches(corpus, config, 0, steps + 1)
  setups = []
  for t in (trainer, reference):
    model = lm.build_model(config, 0, t.arm.centered)
    optimizer = cbp.nnx.Optimizer(model, t.tx)
    lm.set_peak(optimizer, 1e-3)
    setups.append((t.step, model, optimizer, nnx.Rngs(dropout=0)))
  seconds = [[], []]
  for i in range(steps + 1):
    batch = jnp.asarray(lm.windows(corpus.train, starts[i], config.context + 1))
    for k, (step, model, optimizer, rngs) in enumerate(setups):
      begin = time.perf_counter()
      jax.block_until_ready(step(model, optimizer, batch, rngs).loss)
      if i > 0:  # step 0 may compile
        seconds[k].append(time.perf_counter() - begin)
  return float(np.median(seconds[0]) / np.median(seconds[1]))


def study(ctx: StudyContext, config: lm.Config,
          candidates: Sequence[Candidate], seeds: int,
          data: Optional[pathlib.Path]) -> StudyResult:
  start = time.perf_counter()
  corpus = lm.load_corpus(data, max_bytes=400_000 if ctx.quick else None)
  val = lm.validation_windows(corpus, config)
  total = sum(len(c.grid) + seeds - 1 for c in candidates)
  bar = tqdm.tqdm(total=total, desc=NAME, unit='run', disable=not ctx.progress)
  grids: dict[str, dict[float, lm.Run]] = {}
  seed_runs: dict[str, list[lm.Run]] = {}
  trainers: dict[str, lm.Trainer] = {}
  for candidate in candidates:
    trainer = trainers[candidate.name] = lm.Trainer(candidate, config,
                                                   tx_factory=make_tx)
    grids[candidate.name] = tune(trainer, corpus, val, candidate.grid, bar)
    runs = grids[candidate.name]
    chosen = min(runs, key=lambda lr: _final(runs[lr]))
    seed_runs[candidate.name] = [runs[chosen]]
    for seed in range(1, seeds):
      bar.set_postfix_str(f'{candidate.name} seed {seed}')
      seed_runs[candidate.name].append(
          lm.train_run(trainer, corpus, chosen, seed, val))
      bar.update()
  bar.close()
  cost = {name: interleaved_step_ratio(t, trainers[REFERENCE], corpus)
          for name, t in trainers.items()}
  summary, md = report(config, corpus, candidates, grids, seed_runs, cost)
  summary['seconds'] = time.perf_counter() - start
  plotting.write_json(ctx.out / 'results.json', {
      **summary,
      'grid_runs': {a: {str(lr): dataclasses.asdict(r) for lr, r in g.items()}
                    for a, g in grids.items()},
      'seed_runs': {a: [dataclasses.asdict(r) for r in runs]
                    for a, runs in seed_runs.items()}})
  plotting.write_markdown(ctx.out / 'results.md', TITLE, md)
  plot_curves(seed_runs, ctx.out / 'ablation_curves.png')
  return StudyResult(NAME, summary, summary['seconds'])


def report(config, corpus, candidates, grids, seed_runs, cost):
  """Tables and summary. ``cost``: each arm's step time over AdamW's,
  measured interleaved (:func:`interleaved_step_ratio`)."""
  reference = seed_runs[REFERENCE]
  target = float(np.mean([r.final_bpb for r in reference]))
  ref_steps = reference[0].steps
  ref_step_seconds = float(np.median([r.step_seconds for r in reference]))
  rows, per_arm = [], {}
  for candidate in candidates:
    runs = seed_runs[candidate.name]
    ratio = cost[candidate.name]
    # AdamW's wall-clock buys this arm ref_steps / ratio steps.
    at_ref_time = [equal_time_bpb(r, ref_steps / ratio) for r in runs]
    ref_at_time = [equal_time_bpb(r, ref_steps) for r in reference]
    test = (stats.paired_test(at_ref_time, ref_at_time)
            if candidate.name != REFERENCE and len(runs) == len(reference)
            and len(runs) > 1 else None)
    steps_to = [lm.first_reach(r, target)[0] for r in runs]
    per_arm[candidate.name] = {
        'lr': runs[0].lr, 'final_bpb': [r.final_bpb for r in runs],
        'bpb_at_adamw_time': at_ref_time,
        'steps_to_target': steps_to,
        # In AdamW step times: load-free wall-clock to AdamW's final loss.
        'adamw_seconds_to_target': [s * ratio * ref_step_seconds
                                    for s in steps_to],
        'reached': sum(math.isfinite(s) for s in steps_to),
        'step_ratio': ratio,
        'paired_t_pvalue': None if test is None else test.t_pvalue,
        'mean_difference': None if test is None else test.mean_difference,
        'options': options(candidate),
    }
    p = per_arm[candidate.name]
    rows.append([
        candidate.name, 'yes' if candidate.centered else 'no',
        f'{p["lr"]:g}', lm._fmt(p['final_bpb']), lm._fmt(at_ref_time),
        '' if test is None else f'{test.mean_difference:+.3f}',
        '' if test is None else stats.format_pvalue(test.t_pvalue),
        f'{lm._fmt(steps_to, 0)} ({p["reached"]}/{len(runs)})',
        lm._fmt(p['adamw_seconds_to_target'], 1), f'{ratio:.2f}'])
  table = plotting.markdown_table(
      ['arm', 'centered', 'peak lr', 'final val bits/byte',
       'at AdamW\'s wall-clock', 'diff. vs AdamW', 'paired t p',
       'steps to AdamW\'s final (reached)', 'seconds to it',
       'step time / AdamW (interleaved)'], rows)
  rates = sorted({lr for g in grids.values() for lr in g})
  grid_table = plotting.markdown_table(
      ['arm'] + [f'{lr:g}' for lr in rates],
      [[name] + [(f'{g[lr].final_bpb:.3f}' if math.isfinite(g[lr].final_bpb)
                  else 'diverged') if lr in g else '' for lr in rates]
       for name, g in grids.items()])
  info = corpus.info
  setup = (
      f'Data: {info["source"]} (Python {info["python"]}); '
      f'{info["train_bytes"]:,} training bytes, {info["validation_bytes"]:,} '
      f'validation bytes. Model: {config.depth} layers, width {config.width}, '
      f'{config.heads} heads, context {config.context}, batch {config.batch}, '
      f'{config.steps} steps, dropout {config.dropout}. Each arm: its own '
      f'grid at seed 0 (extended past a winning edge), then '
      f'{len(reference)} seeds at the chosen rate; seeds pair the arms. '
      f'Target: AdamW\'s mean final validation loss, {target:.4f} bits/byte. '
      f'Step cost: each arm\'s step time over AdamW\'s, the two stepped '
      f'alternately in one process (load affects both alike). "At AdamW\'s '
      f'wall-clock": the validation curve after {ref_steps} / (step cost) '
      f'steps, i.e. after AdamW\'s training time; the paired t-test '
      f'(two-sided, by seed) is on that number. "Seconds to it": steps to '
      f'AdamW\'s final loss x step cost x AdamW\'s median step '
      f'({ref_step_seconds * 1e3:.0f} ms).')
  summary = {'config': dataclasses.asdict(config), 'corpus': info,
             'target_bpb': target, 'adamw_step_seconds': ref_step_seconds,
             'per_arm': per_arm}
  md = [setup, table, '## Learning-rate grids (final validation bits/byte, '
        'seed 0)', grid_table, '![curves](ablation_curves.png)']
  return summary, md


def plot_curves(seed_runs, path):
  fig, axes = plotting.new_axes(1, 1)
  ax = axes[0] if isinstance(axes, (list, tuple, np.ndarray)) else axes
  for name, runs in seed_runs.items():
    steps = np.asarray(runs[0].eval_steps)
    plotting.band(ax, steps, np.array([r.val_bpb for r in runs]), name)
  ax.set_xlabel('step')
  ax.set_ylabel('validation bits / byte')
  finite = [v for r in seed_runs.values() for x in r for v in x.val_bpb[2:]
            if math.isfinite(v)]
  if finite:
    ax.set_ylim(min(finite) - 0.05, min(max(finite), 6.0))
  ax.legend(fontsize=6)
  plotting.save(fig, path)


# ----------------------------------------------------------------------------
# The same candidates where the paper's CBP already does well


def paper_arms() -> list[training.Method]:
  """Adam, the paper's full CBP, and each candidate on the centered MLP."""
  def variant(**kwargs):
    return lambda lr: configurations.cbp_study(lr, **kwargs)
  return [
      training.Method('Adam', optax.adam),
      training.Method('CBP (full)', cbp.cbp, centered=True,
                      recipe=training.factorial_recipe(True, True)),
      training.Method('+ relative damping', variant(
          damping=1e-8, relative_damping=0.03), centered=True),
      training.Method('+ M1 off', variant(block_fn=cbp.no_blocks),
                      centered=True),
      training.Method('+ zero-moment identity', variant(
          zero_moment='identity'), centered=True),
      training.Method('former cbp_transformer', variant(
          **configurations.TRANSFORMER_COMBINATION), centered=True),
  ]


def paper_checks(ctx: StudyContext, studies=('head-to-head', 'mnist')
                 ) -> dict[str, StudyResult]:
  """Table 6 (spiral) and Table 10 (MNIST) rerun with the candidates, each
  study's own protocol (grid, seeds, budget), into ``<out>/<study>``."""
  runners = {'head-to-head': head_to_head.run, 'mnist': mnist.run}
  results = {}
  for name in studies:
    sub = dataclasses.replace(ctx, out=ctx.out / name)
    sub.out.mkdir(parents=True, exist_ok=True)
    results[name] = runners[name](sub, arms=paper_arms())
  return results


def select(names: Optional[Sequence[str]]) -> tuple[Candidate, ...]:
  if not names:
    return CANDIDATES
  known = {c.name: c for c in CANDIDATES}
  missing = [n for n in names if n not in known]
  if missing:
    raise ValueError(f'unknown arms {missing}; known: {list(known)}')
  chosen = [known[n] for n in names]
  if REFERENCE not in names:
    chosen.insert(0, known[REFERENCE])
  return tuple(chosen)


def run(ctx: StudyContext, data: Optional[pathlib.Path] = None,
        config: Optional[lm.Config] = None,
        arms: Optional[Sequence[str]] = None,
        grid_override: Optional[Callable[[Candidate], tuple]] = None,
        ) -> StudyResult:
  data = data if data is not None else getattr(ctx, 'data', None)
  if config is None:
    config = QUICK if ctx.quick else CONFIG
  if ctx.quick and arms is None:
    arms = QUICK_ARMS
  candidates = select(arms)
  if ctx.quick:
    candidates = tuple(dataclasses.replace(c, grid=c.grid[1:2])
                       for c in candidates)
  if grid_override is not None:
    candidates = tuple(dataclasses.replace(c, grid=grid_override(c))
                       for c in candidates)
  seeds = ctx.seed_count(paper=3, quick=2)
  return study(ctx, config, candidates, seeds, data)


def main(argv: Optional[Sequence[str]] = None) -> int:
  """``python -m cbp_optax_experiments.reproduce.transformer_ablation``."""
  parser = argparse.ArgumentParser(
      prog='cbp_optax_experiments.reproduce.transformer_ablation',
      description=TITLE,
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument('--out', type=pathlib.Path,
                      default=pathlib.Path('reproduction') / NAME,
                      help='output folder (results.md, results.json, PNG)')
  parser.add_argument('--data', type=pathlib.Path, default=None,
                      help='a text file or a directory of text files '
                      '(default: the Python standard library)')
  parser.add_argument('--quick', action='store_true',
                      help='tiny model, one rate per arm: a smoke test')
  parser.add_argument('--seeds', type=int, default=None,
                      help='seeds at the chosen rate (default 3; quick 2)')
  parser.add_argument('--arms', default=None,
                      help='comma-separated arm names (AdamW is always run); '
                      f'known: {", ".join(c.name for c in CANDIDATES)}')
  parser.add_argument('--steps', type=int, default=None,
                      help=f'training steps per run (default {CONFIG.steps})')
  parser.add_argument('--no-progress', action='store_true',
                      help='hide the progress bar')
  parser.add_argument('--paper-checks', default=None,
                      help='instead of the transformer: rerun these paper '
                      'studies (comma-separated: head-to-head, mnist) with '
                      'Adam, the paper\'s CBP and the candidates')
  parser.add_argument('--data-dir', type=pathlib.Path, default=None,
                      help='MNIST for --paper-checks mnist (default: '
                      '$CBP_OPTAX_MNIST, the cache, or the bundled subset)')
  args = parser.parse_args(argv)
  config = QUICK if args.quick else CONFIG
  if args.steps is not None:
    config = dataclasses.replace(config, steps=args.steps)
  ctx = StudyContext(out=args.out, seeds=args.seeds, quick=args.quick,
                     data_dir=args.data_dir, progress=not args.no_progress)
  if args.paper_checks:
    studies = [n.strip() for n in args.paper_checks.split(',')]
    for name, result in paper_checks(ctx, studies).items():
      print(f'{name}: {result.seconds:.1f} s -> {args.out / name}')
    return 0
  arms = [a.strip() for a in args.arms.split(',')] if args.arms else None
  result = run(ctx, args.data, config, arms)
  print(f'{NAME}: {result.seconds:.1f} s -> {args.out}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
