"""§6.4 / Tables 7 and 8: common-base factorial and hyperparameter sensitivity.

Table 7: all eight combinations of M1 (``cbp.equalize``), M2 (centered
network, ``cbp.linen.transport``) and M3 (``cbp.precondition``) on one base,
bias-corrected heavy-ball momentum with b1 = 0.9, under the protocol of §6.3
(same network, data, budget, grid and seeds).

Table 8: one factor at a time around the full method's defaults (damping,
rho, clip range, b1, b2), five seeds, learning rate fixed at the rate Table 7
selected for M1 + M2 + M3.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any

import numpy as np

import cbp_optax as cbp
from cbp_optax_experiments.reproduce import head_to_head
from cbp_optax_experiments.reproduce import plotting
from cbp_optax_experiments.reproduce import protocol
from cbp_optax_experiments.reproduce import stats
from cbp_optax_experiments.reproduce import training
from cbp_optax_experiments.reproduce.context import StudyContext, StudyResult

NAME = 'factorial'
TITLE = '§6.4 / Tables 7 and 8: common-base factorial and sensitivity'

PAPER_T7 = {
    'base': dict(lr='0.01', loss='0.223 ± 0.020', acc='0.875 ± 0.011', iters='858 ± 121'),
    'M1': dict(lr='0.01', loss='0.213 ± 0.023', acc='0.884 ± 0.008', iters='692 ± 73'),
    'M2': dict(lr='0.01', loss='0.177 ± 0.006', acc='0.885 ± 0.003', iters='554 ± 72'),
    'M3': dict(lr='0.001', loss='0.206 ± 0.037', acc='0.871 ± 0.016', iters='342 ± 28'),
    'M1 + M2': dict(lr='0.01', loss='0.173 ± 0.006', acc='0.888 ± 0.004', iters='523 ± 69'),
    'M1 + M3': dict(lr='0.001', loss='0.207 ± 0.028', acc='0.870 ± 0.015', iters='340 ± 25'),
    'M2 + M3': dict(lr='0.001', loss='0.170 ± 0.014', acc='0.873 ± 0.006', iters='241 ± 9'),
    'M1 + M2 + M3': dict(lr='0.001', loss='0.170 ± 0.015', acc='0.875 ± 0.010', iters='241 ± 9'),
}
QUICK_CELLS = ('base', 'M3')


@dataclasses.dataclass(frozen=True)
class Setting:
  """One row of Table 8: a full-CBP configuration."""
  factor: str
  value: str
  damping: float = training.DAMPING
  rho: float = training.RHO
  clip: tuple[float, float] = (training.MIN_SCALE, training.MAX_SCALE)
  b1: float = 0.9
  b2: float = 0.999
  paper: str = ''

  def hyperparameters(self, learning_rate: float) -> dict[str, float]:
    return dict(lr=learning_rate, b1=self.b1, b2=self.b2,
                damping=self.damping, rho=self.rho, min_scale=self.clip[0],
                max_scale=self.clip[1])


def sensitivity_method() -> training.Method:
  """Full CBP with every Table 8 hyperparameter read from a dict, so all
  settings share one compiled program (vmapped like a learning-rate grid)."""
  def make_tx(h: dict[str, Any]):
    return cbp.cbp(h['lr'], b1=h['b1'], b2=h['b2'], damping=h['damping'],
                   decay=h['rho'], min_scale=h['min_scale'],
                   max_scale=h['max_scale'])
  return training.Method('CBP (full), Table 8 settings', make_tx,
                         centered=True, centering_decay=lambda h: h['rho'])


# Paper's Table 8 (train loss, iters@0.30); '*' marks the defaults.
SETTINGS = (
    Setting('damping ζ', '1e-4', damping=1e-4, paper='0.168 ± 0.008 / 244'),
    Setting('damping ζ', '1e-3 *', paper='0.171 ± 0.008 / 245'),
    Setting('damping ζ', '1e-2', damping=1e-2, paper='0.171 ± 0.013 / 284'),
    Setting('damping ζ', '1e-1', damping=1e-1, paper='0.175 ± 0.001 / 578'),
    Setting('EMA decay ρ', '0.9', rho=0.9, paper='0.164 ± 0.011 / 215'),
    Setting('EMA decay ρ', '0.999', rho=0.999, paper='0.170 ± 0.011 / 312'),
    Setting('clip', '[0.25, 2]', clip=(0.25, 2.0), paper='0.171 ± 0.011 / 245'),
    Setting('clip', '[0.02, 20]', clip=(0.02, 20.0), paper='0.173 ± 0.012 / 245'),
    Setting('clip', '[0.01, 100]', clip=(0.01, 100.0), paper='0.173 ± 0.012 / 245'),
    Setting('momentum β1', '0', b1=0.0, paper='0.198 ± 0.023 / 259'),
    Setting('momentum β1', '0.5', b1=0.5, paper='0.175 ± 0.013 / 237'),
    Setting('momentum β1', '0.95', b1=0.95, paper='0.159 ± 0.007 / 258'),
    Setting('second moment β2', '0.99', b2=0.99, paper='0.174 ± 0.006 / 244'),
    Setting('second moment β2', '0.9999', b2=0.9999, paper='0.175 ± 0.007 / 245'),
)


def factorial_methods() -> list[training.Method]:
  """The 2^3 cells in the paper's order (base, M1, M2, M3, M1+M2, ...)."""
  cells = sorted(itertools.product((False, True), repeat=3),
                 key=lambda c: (sum(c), [not x for x in c]))
  return [training.factorial_method(*cell) for cell in cells]


def run_sensitivity(ctx, model_for, data, config, learning_rate, seeds):
  """Table 8 rows: per-seed final training loss and iterations per setting.

  All settings and seeds are one vmapped program (axes: seed, setting).
  """
  settings = SETTINGS[1:2] if ctx.quick else SETTINGS
  per_setting = [s.hyperparameters(learning_rate) for s in settings]
  hypers = {k: [h[k] for h in per_setting] for k in per_setting[0]}
  if ctx.progress:
    print(f'sensitivity: {len(settings)} settings x {len(seeds)} seeds, one '
          'program', flush=True)
  result = training.run_grid(model_for(True), sensitivity_method(), data,
                             config, seeds, hypers)
  rows = []
  for i, setting in enumerate(settings):
    rows.append((setting, result.train_loss[:, i, -1],
                 training.iterations_to(result.losses[:, i],
                                        head_to_head.THRESHOLD)))
  return rows


def run(ctx: StudyContext) -> StudyResult:
  start = time.perf_counter()
  seeds = list(range(ctx.seed_count(paper=10, quick=2)))
  depth, model_for, data, config, grid = head_to_head.spiral_setup(ctx)
  cells = factorial_methods()
  if ctx.quick:
    cells = [m for m in cells if m.name in QUICK_CELLS]
  outcomes = protocol.run_methods(cells, model_for, data, config, seeds, grid,
                                  head_to_head.THRESHOLD,
                                  progress=ctx.progress, description=NAME)
  table7, tests = protocol.results_table(outcomes, 'base', config.steps,
                                         PAPER_T7, head_to_head.THRESHOLD)
  by_name = {o.name: o for o in outcomes}
  full = by_name.get('M1 + M2 + M3')  # absent in --quick
  full_lr = (full and full.learning_rate) or training.COMMON_GRID[0]
  sensitivity_seeds = list(range(ctx.seed_count(paper=5, quick=2)))
  sensitivity = run_sensitivity(ctx, model_for, data, config, full_lr,
                                sensitivity_seeds)
  rows8 = []
  for setting, loss, iters in sensitivity:
    rows8.append([
        setting.factor, setting.value, setting.paper,
        stats.format_mean_std(loss),
        f'{np.median(protocol.censored_iterations(iters, config.steps)):.0f}'
        + (f' ({int(np.sum(~np.isfinite(iters)))} censored)'
           if not np.all(np.isfinite(iters)) else ''),
        'yes' if np.all(np.isfinite(loss)) else 'NO'])
  table8 = plotting.markdown_table(
      ['factor', 'value', 'paper: train loss / iters', 'ours: train loss',
       'ours: median iters@0.3', 'all finite'], rows8)
  protocol.plot_curves(outcomes, ctx.out / 'table7_learning_curves.png',
                       'factorial, smoothed training loss')
  setup = head_to_head.describe(depth, data, config, grid, len(seeds))
  summary = {
      'seeds': len(seeds), 'steps': config.steps,
      'selected_lr': {o.name: o.learning_rate for o in outcomes},
      'mean_train_loss': {o.name: float(np.mean(o.train_loss))
                          for o in outcomes},
      'median_iterations': {o.name: float(np.median(
          protocol.censored_iterations(o.iterations, config.steps)))
          for o in outcomes},
      'sensitivity_lr': full_lr,
      'sensitivity': {f'{s.factor}={s.value}': {
          'mean_train_loss': float(np.mean(loss)),
          'median_iterations': float(np.median(
              protocol.censored_iterations(iters, config.steps)))}
          for s, loss, iters in sensitivity},
  }
  plotting.write_json(ctx.out / 'results.json', {
      **summary, 'setup': setup, 'grid': grid, 'paired_tests_vs_base': tests,
      'per_seed': {o.name: protocol.outcome_json(o) for o in outcomes},
      'sensitivity_per_seed': {f'{s.factor}={s.value}': {
          'train_loss': loss, 'iterations': iters}
          for s, loss, iters in sensitivity}})
  plotting.write_markdown(ctx.out / 'results.md', TITLE, [
      setup + ' Base = bias-corrected momentum (b1 = 0.9, optax.ema with '
      'debias); M1 = cbp.equalize before it; M3 = cbp.precondition in place '
      'of it (same momentum, divided by the lagged damped second moment); '
      'M2 = every Dense centered. Paired tests against the base cell.',
      '## Table 7', table7,
      '### Validation profile', protocol.profile_table(outcomes, grid),
      f'## Table 8 (lr fixed at {full_lr:g}, {len(sensitivity_seeds)} seeds; '
      'ρ sets both the equalization and the centering EMA)', table8,
      '![Table 7 curves](table7_learning_curves.png)'])
  return StudyResult(NAME, summary, time.perf_counter() - start)
