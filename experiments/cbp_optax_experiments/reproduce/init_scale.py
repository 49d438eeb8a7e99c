"""Diagnostics study: initialization scale x depth on a binary MNIST task.

ReLU MLPs (width 32, zero biases) whose Gaussian weights are
``alpha * N(0, 1/d_in)`` for alpha in {1, 2, 4, 8, 10} (alpha = sqrt 2 is He;
the forward signal grows like ``(alpha / sqrt 2) ** depth``), at depths
{5, 10, ..., 30}, trained on MNIST digits 0-4 vs 5-9 with SGD, AdamW and full
CBP. Per (method, depth, alpha) the learning rate is selected on the validation
loss from a three-point grid. Reported per run, with ``cbp_optax_experiments.diagnostics``:
test AUC, the Hutchinson trace of the final Hessian (``hessian_trace``) and the
relative distance from initialization (``parameter_movement``).

Claims tested: SGD's AUC falls as alpha grows (the lazy regime: a tiny
selected step, parameters that barely move); AdamW is insensitive to alpha;
CBP is as insensitive to alpha as AdamW.
"""

from __future__ import annotations

import time

import flax.linen as nn
import jax
import numpy as np
import optax
from scipy import stats as scipy_stats
import tqdm

import cbp_optax as cbp
from cbp_optax_experiments.reproduce import flow
from cbp_optax_experiments.reproduce import mnist
from cbp_optax_experiments.reproduce import plotting
from cbp_optax_experiments.reproduce import training
from cbp_optax_experiments.reproduce.context import StudyContext, StudyResult

NAME = 'init-scale'
TITLE = 'Diagnostics: initialization scale x depth, binary MNIST (SGD, AdamW, CBP)'

ALPHAS = (1.0, 2.0, 4.0, 8.0, 10.0)
DEPTHS = (5, 10, 15, 20, 25, 30)
WIDTH, BATCH, STEPS, HESSIAN_SAMPLES = 32, 64, 300, 8
GRIDS = {'SGD': (0.003, 0.03, 0.3), 'AdamW': (3e-4, 1e-3, 3e-3),
         'CBP': (3e-4, 1e-3, 3e-3)}
# Insensitive: AUC range over alpha (mean over seeds, per depth) below this.
INSENSITIVE = 0.05


def methods() -> list[training.Method]:
  return [training.Method('SGD', optax.sgd),
          training.Method('AdamW', optax.adamw),
          training.Method('CBP', cbp.cbp, centered=True)]


def binary(data: training.Dataset) -> training.Dataset:
  """Digits 0-4 -> 0, 5-9 -> 1; inputs unchanged."""
  to_binary = lambda y: (np.asarray(y) >= 5).astype(np.int32)
  return data._replace(
      train_y=to_binary(data.train_y), val_y=to_binary(data.val_y),
      test_y=to_binary(data.test_y),
      description=data.description + '; labels 0-4 -> 0, 5-9 -> 1')


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
  """Area under the ROC curve: the Mann-Whitney statistic with mid-ranks."""
  scores = np.asarray(scores, np.float64)
  labels = np.asarray(labels).astype(bool)
  if not np.all(np.isfinite(scores)):
    return 0.5  # a diverged run ranks nothing
  ranks = scipy_stats.rankdata(scores)
  pos, neg = labels.sum(), (~labels).sum()
  return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


def model_for(depth: int, centered: bool, width: int) -> flow.NormMLP:
  # alpha multiplies this base after initialization (flow.make_run).
  return flow.NormMLP(hidden=(width,) * depth, classes=2, centered=centered,
                      kernel_init=nn.initializers.variance_scaling(
                          1.0, 'fan_in', 'normal'))


def run(ctx: StudyContext) -> StudyResult:
  start = time.perf_counter()
  data = binary(mnist.load(ctx.data_dir, ctx.quick))
  seeds = list(range(ctx.seed_count(paper=3, quick=2)))
  depths = (3,) if ctx.quick else DEPTHS
  alphas = (1.0, 8.0) if ctx.quick else ALPHAS
  width = 8 if ctx.quick else WIDTH
  steps = 30 if ctx.quick else STEPS
  grids = {k: v[1:2] for k, v in GRIDS.items()} if ctx.quick else GRIDS
  probes = 2 if ctx.quick else HESSIAN_SAMPLES
  names = [m.name for m in methods()]
  # metric -> (method, depth) -> (seed, alpha)
  results = {k: {} for k in ('auc', 'trace', 'trace_stderr', 'movement',
                             'lr')}
  jobs = [(m, d) for m in methods() for d in depths]
  for method, depth in tqdm.tqdm(jobs, desc=NAME, unit='cell',
                                 disable=not ctx.progress):
    grid = grids[method.name]
    out = flow.run_grid(model_for(depth, method.centered, width), method, data,
                        seeds, grid, steps=steps, batch_size=BATCH,
                        init_scales=alphas,
                        hessian_samples=probes)
    cell = {k: np.full((len(seeds), len(alphas)), np.nan) for k in results}
    for a in range(len(alphas)):
      per_alpha = jax.tree.map(lambda x: np.asarray(x[:, :, a]), out)
      index, _ = flow.select(per_alpha)
      chosen = flow.at_rate(per_alpha, 0 if index is None else index)
      for s in range(len(seeds)):
        score = chosen.test_logits[s, :, 1] - chosen.test_logits[s, :, 0]
        cell['auc'][s, a] = auc(score, data.test_y)
      cell['trace'][:, a] = chosen.hessian_trace
      cell['trace_stderr'][:, a] = chosen.hessian_stderr
      cell['movement'][:, a] = chosen.movement
      cell['lr'][:, a] = np.nan if index is None else grid[index]
    for k in results:
      results[k][(method.name, depth)] = cell[k]

  mean_auc = {(n, d): results['auc'][(n, d)].mean(0)
              for n in names for d in depths}
  auc_range = {(n, d): float(np.ptp(mean_auc[(n, d)]))
               for n in names for d in depths}
  rows = []
  for name in names:
    for depth in depths:
      cell = {k: results[k][(name, depth)] for k in results}
      rows.append([name, depth] + [
          f'{np.mean(cell["auc"][:, a]):.3f}±{np.std(cell["auc"][:, a], ddof=1):.3f}'
          for a in range(len(alphas))] + [
              f'{auc_range[(name, depth)]:.3f}',
              ' / '.join(_short(np.median(cell['movement'][:, a]))
                         for a in range(len(alphas))),
              ' / '.join(_short(np.median(cell['trace'][:, a]))
                         for a in range(len(alphas))),
              ' / '.join('—' if np.isnan(cell['lr'][0, a]) else
                         f'{cell["lr"][0, a]:g}' for a in range(len(alphas)))])
  header = (['method', 'depth'] + [f'AUC α={a:g}' for a in alphas] +
            ['AUC range over α', 'movement ‖θ−θ₀‖/‖θ₀‖ by α',
             'Hessian trace by α', 'selected lr by α'])
  table = plotting.markdown_table(header, rows)
  setup = (f'Data: {data.description}. ReLU MLP 784 -> {width} x depth -> 2, '
           f'weights α·N(0, 1/d_in), zero biases, batch {BATCH}, {steps} '
           f'iterations, {len(seeds)} seeds, softmax cross-entropy. Per '
           '(method, depth, α) the learning rate with the lowest mean final '
           'validation loss among those where every seed stayed finite, from '
           f'{grids} ("—": all diverged, the smallest rate is reported; a '
           'non-finite score counts as AUC 0.5). AUC on the test split '
           '(mean ± sd over seeds); movement = diagnostics.parameter_movement'
           '(...).total and Hessian trace = diagnostics.hessian_trace '
           f'({probes} Rademacher probes, the first 512 training '
           'images, evaluation mode) at the end, medians over seeds. CBP = '
           'cbp.cbp on a centered network (M2).')
  verdicts = _verdicts(names, depths, alphas, mean_auc, auc_range, results)
  _plot(ctx, names, depths, alphas, results)
  summary = {
      'seeds': len(seeds), 'steps': steps, 'depths': list(depths),
      'alphas': list(alphas),
      'mean_auc': {f'{n}/{d}': mean_auc[(n, d)] for n in names
                   for d in depths},
      'auc_range_over_alpha': {f'{n}/{d}': auc_range[(n, d)] for n in names
                               for d in depths},
      'max_auc_range_over_alpha': {n: max(auc_range[(n, d)] for d in depths)
                                   for n in names},
  }
  plotting.write_json(ctx.out / 'results.json', {
      **summary, 'setup': setup, 'verdicts': verdicts,
      'per_seed': {k: {f'{n}/{d}': v for (n, d), v in r.items()}
                   for k, r in results.items()}})
  plotting.write_markdown(ctx.out / 'results.md', TITLE, [
      setup, table, '## Verdicts', '\n'.join(f'- {v}' for v in verdicts),
      '![AUC by initialization scale](init_scale_auc.png)'])
  return StudyResult(NAME, summary, time.perf_counter() - start)


def _short(value: float) -> str:
  return 'nan' if not np.isfinite(value) else f'{value:.3g}'


def _verdicts(names, depths, alphas, mean_auc, auc_range, results):
  out = []
  sgd_drop = [d for d in depths
              if mean_auc[('SGD', d)][-1] < mean_auc[('SGD', d)][0] - 0.05]
  near_half = [d for d in depths if mean_auc[('SGD', d)][-1] < 0.6]
  out.append(
      f'SGD\'s AUC falls as α grows: {"holds" if len(sgd_drop) == len(depths) else "partly" if sgd_drop else "not supported"}'
      f' — AUC at α={alphas[-1]:g} is at least 0.05 below α={alphas[0]:g} at '
      f'{len(sgd_drop)} of {len(depths)} depths; below 0.6 at {len(near_half)}'
      '. Movement by α (median, deepest net): ' + ' / '.join(
          _short(np.median(results['movement'][('SGD', depths[-1])][:, a]))
          for a in range(len(alphas))) + '.')
  diverged = {n: sum(int(np.isnan(results['lr'][(n, d)][0, a]))
                     for d in depths for a in range(len(alphas)))
              for n in names}
  mean_range = {n: float(np.mean([auc_range[(n, d)] for d in depths]))
                for n in names}
  cells = len(depths) * len(alphas)
  for name in names[1:]:
    worst = max(auc_range[(name, d)] for d in depths)
    verdict = 'holds' if worst < INSENSITIVE else 'not supported'
    out.append(
        f'{name} is insensitive to α (AUC range over α < {INSENSITIVE} at '
        f'every depth): {verdict} — range by depth ' + ', '.join(
            f'{d}: {auc_range[(name, d)]:.3f}' for d in depths) +
        f'; every rate diverged in {diverged[name]} of {cells} (depth, α) '
        'cells.')
  as_good = (mean_range['CBP'] <= mean_range['AdamW'] + 0.02
             and diverged['CBP'] <= diverged['AdamW'])
  out.append(
      'CBP is as insensitive to α as AdamW (mean AUC range over depths within '
      '0.02 of AdamW\'s and no more diverged cells): '
      f'{"holds" if as_good else "not supported"} — mean range CBP '
      f'{mean_range["CBP"]:.3f}, AdamW {mean_range["AdamW"]:.3f}, SGD '
      f'{mean_range["SGD"]:.3f}; diverged cells CBP {diverged["CBP"]}, AdamW '
      f'{diverged["AdamW"]}, SGD {diverged["SGD"]} of {cells}; mean AUC over '
      f'all cells: CBP '
      f'{np.mean([mean_auc[("CBP", d)] for d in depths]):.3f}, AdamW '
      f'{np.mean([mean_auc[("AdamW", d)] for d in depths]):.3f}, SGD '
      f'{np.mean([mean_auc[("SGD", d)] for d in depths]):.3f}.')
  return out


def _plot(ctx, names, depths, alphas, results) -> None:
  fig, axes = plotting.new_axes(1, 3)
  for ax, metric, label in zip(
      axes, ('auc', 'movement', 'trace'),
      ('test AUC', 'relative movement ‖θ−θ₀‖/‖θ₀‖', 'Hessian trace')):
    for k, name in enumerate(names):
      for j, depth in enumerate((depths[0], depths[-1])):
        plotting.band(ax, alphas, results[metric][(name, depth)],
                      f'{name}, depth {depth}', color=f'C{k}',
                      linestyle='-' if j else ':', marker='o')
    ax.set_xlabel('initialization scale α')
    ax.set_ylabel(label)
    if metric != 'auc':
      ax.set_yscale('symlog', linthresh=1e-3)
  axes[0].legend(fontsize=6)
  plotting.save(fig, ctx.out / 'init_scale_auc.png')
