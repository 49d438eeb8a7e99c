"""§6.3 / Table 6, Figure 4: head-to-head training and the published ablation.

A 10-hidden-layer ReLU MLP (width 48, He init) on the six-arm spiral, softmax
cross-entropy, minibatch 64. Baselines are optax's own SGD, SGD + momentum,
Adam, AdamW, LARS and LAMB (default arguments), and Adam + Center (optax.adam
on the M2-centered network). The CBP ablation arms follow the paper's Table 6:
M1 and M2 on a bias-corrected momentum step, M3 and the full method on the
damped preconditioned step.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import numpy as np
import optax

import cbp_optax as cbp
from cbp_optax_experiments.reproduce import plotting
from cbp_optax_experiments.reproduce import protocol
from cbp_optax_experiments.reproduce import stats
from cbp_optax_experiments.reproduce import training
from cbp_optax_experiments.reproduce.context import StudyContext, StudyResult

NAME = 'head-to-head'
TITLE = '§6.3 / Table 6, Figure 4: head-to-head on the six-arm spiral'

DEPTH, WIDTH, BATCH = 10, 48, 64
# Our choices (Appendix C is not available): the iteration budget and the
# evaluation interval; threshold 0.30 is the paper's.
STEPS, EVAL_EVERY, THRESHOLD = 2000, 100, 0.30
REFERENCE = 'Adam'
QUICK_ARMS = ('SGD', 'Adam', 'CBP (full)')

PAPER = {
    'SGD': dict(lr='0.03', loss='0.245 ± 0.039', acc='0.862 ± 0.016', iters='896 ± 67'),
    'SGD + momentum': dict(lr='0.001', loss='0.222 ± 0.033', acc='0.879 ± 0.011', iters='897 ± 100'),
    'Adam': dict(lr='0.001', loss='0.201 ± 0.025', acc='0.871 ± 0.010', iters='326 ± 22'),
    'AdamW': dict(lr='0.001', loss='0.201 ± 0.021', acc='0.870 ± 0.012', iters='324 ± 24'),
    'LARS': dict(lr='0.001', loss='0.231 ± 0.016', acc='0.868 ± 0.012', iters='726 ± 55'),
    'LAMB': dict(lr='0.001', loss='0.196 ± 0.014', acc='0.875 ± 0.008', iters='371 ± 32'),
    'Adam + Center': dict(lr='0.001', loss='0.164 ± 0.010', acc='0.872 ± 0.008', iters='234 ± 7'),
    'CBP-M1': dict(lr='0.03', loss='0.233 ± 0.040', acc='0.870 ± 0.013', iters='721 ± 83'),
    'CBP-M2': dict(lr='0.01', loss='0.186 ± 0.014', acc='0.884 ± 0.005', iters='535 ± 63'),
    'CBP-M3': dict(lr='0.001', loss='0.206 ± 0.037', acc='0.871 ± 0.016', iters='342 ± 28'),
    'CBP-M1M2': dict(lr='0.01', loss='0.183 ± 0.014', acc='0.884 ± 0.005', iters='504 ± 63'),
    'CBP (full)': dict(lr='0.001', loss='0.170 ± 0.015', acc='0.875 ± 0.010', iters='241 ± 9'),
}


def methods() -> list[training.Method]:
  """The twelve arms of Table 6."""
  m1_momentum = lambda lr: training.factorial_tx(lr, m1=True, m3=False)
  momentum = lambda lr: training.factorial_tx(lr, m1=False, m3=False)
  m3 = lambda lr: training.factorial_tx(lr, m1=False, m3=True)
  return [
      training.Method('SGD', optax.sgd),
      training.Method('SGD + momentum', lambda lr: optax.sgd(lr, momentum=0.9)),
      training.Method('Adam', optax.adam),
      training.Method('AdamW', optax.adamw),
      training.Method('LARS', optax.lars),
      training.Method('LAMB', optax.lamb),
      training.Method('Adam + Center', optax.adam, centered=True),
      training.Method('CBP-M1', m1_momentum,
                      recipe=training.factorial_recipe(True, False)),
      training.Method('CBP-M2', momentum, centered=True,
                      recipe=training.factorial_recipe(False, False)),
      training.Method('CBP-M3', m3,
                      recipe=training.factorial_recipe(False, True)),
      training.Method('CBP-M1M2', m1_momentum, centered=True,
                      recipe=training.factorial_recipe(True, False)),
      training.Method('CBP (full)', cbp.cbp, centered=True,
                      recipe=training.factorial_recipe(True, True)),
  ]


def spiral_setup(ctx: StudyContext):
  """Model factory, data, config and grid (full or --quick) of §6.3/§6.4."""
  depth = 2 if ctx.quick else DEPTH
  config = training.TrainConfig(steps=200 if ctx.quick else STEPS,
                                batch_size=BATCH,
                                eval_every=50 if ctx.quick else EVAL_EVERY)
  grid = (0.001, 0.01) if ctx.quick else training.COMMON_GRID
  model_for = lambda centered: training.MLP(hidden=(WIDTH,) * depth, classes=6,
                                            centered=centered)
  return depth, model_for, training.spiral(), config, grid


def describe(depth, data, config, grid, seeds) -> str:
  return (f'Setup: {depth}-hidden-layer ReLU MLP, width {WIDTH}, He-normal '
          f'init, zero biases; {data.description}; minibatch {config.batch_size}'
          f' sampled with replacement, {config.steps} iterations (our budget); '
          f'learning rate picked per method on the mean final validation loss '
          f'from {list(grid)}, a rate discarded if any seed went non-finite; '
          f'{seeds} seeds, paired by seed (same minibatch order; the centered '
          'network has its own initialization draw). "train loss" is the '
          'full training-set loss at the end; iterations to the threshold use '
          f'a debiased EMA (decay {training.SMOOTHING}) of the minibatch loss; '
          'a run that never reaches it is censored and counted at the budget. '
          'CBP hyperparameters: ζ = 1e-3, ρ = 0.99 (equalization and '
          'centering), clip [0.1, 4], β1 = 0.9, β2 = 0.999. Paired tests are '
          'two-sided, uncorrected; d is Cohen\'s d of the per-seed '
          'differences (negative: lower than the reference).')


def compare_leaders(by_name: dict, budget: int) -> tuple[dict, str]:
  """Paired CBP (full) vs Adam + Center (paper: p = 0.058 on loss, 0.001 on
  iterations with Adam + Center faster); empty when either arm is absent."""
  if 'Adam + Center' not in by_name or 'CBP (full)' not in by_name:
    return {}, ''
  cbp_arm, center = by_name['CBP (full)'], by_name['Adam + Center']
  loss = stats.paired_test(cbp_arm.train_loss, center.train_loss)
  iters = stats.paired_test(
      protocol.censored_iterations(cbp_arm.iterations, budget),
      protocol.censored_iterations(center.iterations, budget))
  text = (f'CBP (full) vs Adam + Center, paired: train loss p(t) = '
          f'{stats.format_pvalue(loss.t_pvalue)} (paper 0.058), iterations '
          f'p(t) = {stats.format_pvalue(iters.t_pvalue)}, mean difference '
          f'{iters.mean_difference:+.0f} (paper 0.001, Adam + Center faster).')
  return {'train_loss': loss._asdict(), 'iterations': iters._asdict()}, text


def run(ctx: StudyContext,
        arms: Optional[Sequence[training.Method]] = None) -> StudyResult:
  """Table 6 with ``arms`` (default: the paper's twelve, three when quick)."""
  start = time.perf_counter()
  seeds = list(range(ctx.seed_count(paper=10, quick=2)))
  depth, model_for, data, config, grid = spiral_setup(ctx)
  if arms is None:
    arms = methods()
    if ctx.quick:  # a smoke test: the reference, CBP and SGD
      arms = [m for m in arms if m.name in QUICK_ARMS]
  outcomes = protocol.run_methods(arms, model_for, data, config, seeds,
                                  grid, THRESHOLD, progress=ctx.progress,
                                  description=NAME)
  table, tests = protocol.results_table(outcomes, REFERENCE, config.steps,
                                        PAPER, THRESHOLD)
  by_name = {o.name: o for o in outcomes}
  leaders, leaders_text = compare_leaders(by_name, config.steps)
  protocol.plot_curves(outcomes, ctx.out / 'fig4_learning_curves.png',
                       'smoothed training loss')
  summary = {
      'seeds': len(seeds), 'steps': config.steps, 'depth': depth,
      'selected_lr': {o.name: o.learning_rate for o in outcomes},
      'mean_train_loss': {o.name: float(o.train_loss.mean()) for o in outcomes},
      'mean_test_accuracy': {o.name: float(o.test_accuracy.mean())
                             for o in outcomes},
      'median_iterations': {o.name: float(
          np.median(protocol.censored_iterations(
              o.iterations, config.steps))) for o in outcomes},
  }
  plotting.write_json(ctx.out / 'results.json', {
      **summary, 'setup': describe(depth, data, config, grid, len(seeds)),
      'grid': grid, 'paired_tests_vs_adam': tests,
      'leaders': leaders,
      'per_seed': {o.name: protocol.outcome_json(o) for o in outcomes}})
  plotting.write_markdown(ctx.out / 'results.md', TITLE, [
      describe(depth, data, config, grid, len(seeds)), table, leaders_text,
      '## Validation profile (mean final validation loss per rate)',
      protocol.profile_table(outcomes, grid),
      '![Figure 4](fig4_learning_curves.png)'])
  return StudyResult(NAME, summary, time.perf_counter() - start)
