"""Diagnostics study: gradient flow at depth 40 on MNIST, SGD vs Adam vs CBP.

The training-course classic: a 40-hidden-layer MLP (width 48) on MNIST with
four initializations - ReLU + He (N(0, 2/d_in)), ReLU + 1/d_in (N(0, 1/d_in),
forward-only scaling: the signal halves in energy at every layer), sigmoid +
1/d_in (the derivative <= 1/4 compounds), and ReLU + N(0, 1) (the forward
pass explodes). Each is trained with SGD, SGD + M1 (``cbp.equalize`` before
SGD: M1 alone), Adam and full CBP (M2 centering and ``cbp.cbp``) for a fixed
budget; the learning rate of each (initialization,
method) cell is selected on the validation split from a three-point grid.

Measured with ``cbp_optax_experiments.diagnostics``: the raw gradient profile (per-layer
Frobenius norm, the M1 blocks) at the first step, the profile of the update
each method applies, and test accuracy after the budget.

Claims tested: (1) M1 flattens the applied profile (SGD + M1's update
disparity max/min is below SGD's, whose profile is the raw gradient's); (2)
CBP closes the gap between the initializations at depth 40.
"""

from __future__ import annotations

import time

import flax.linen as nn
import numpy as np
import optax
import tqdm

import cbp_optax as cbp
from cbp_optax_experiments.reproduce import flow
from cbp_optax_experiments.reproduce import mnist
from cbp_optax_experiments.reproduce import plotting
from cbp_optax_experiments.reproduce import stats
from cbp_optax_experiments.reproduce import training
from cbp_optax_experiments.reproduce.context import StudyContext, StudyResult

NAME = 'gradient-flow'
TITLE = 'Diagnostics: gradient flow at depth 40 on MNIST (SGD, M1, Adam, CBP)'

DEPTH, WIDTH, BATCH, STEPS = 40, 48, 128, 400
# The applied profile is read as the mean over steps PROFILE_STEPS, after M1's
# energies and Adam's moments have warmed up.
PROFILE_STEPS = slice(40, 60)
_scaled = lambda s: nn.initializers.variance_scaling(s, 'fan_in', 'normal')
INITS = {
    'ReLU + He': (nn.relu, _scaled(2.0)),
    'ReLU + 1/d_in': (nn.relu, _scaled(1.0)),
    'sigmoid + 1/d_in': (nn.sigmoid, _scaled(1.0)),
    'ReLU + N(0, 1)': (nn.relu, nn.initializers.normal(1.0)),
}
GRIDS = {'SGD': (0.01, 0.03, 0.1), 'SGD + M1': (0.01, 0.03, 0.1),
         'Adam': (3e-4, 1e-3, 3e-3), 'CBP': (3e-4, 1e-3, 3e-3)}
# Claim 2 holds when CBP's test accuracies under He and 1/d_in differ by less.
CLOSED = 0.05
# Measured in earlier course notes on one MNIST batch / after training.
NOTES = {'ReLU + He': '74.4%', 'ReLU + 1/d_in': '64.1%',
         'ReLU + N(0, 1)': '10.2% (chance)', 'sigmoid + 1/d_in': '—'}


def methods() -> list[training.Method]:
  sgd_m1 = lambda lr: optax.chain(
      cbp.equalize(training.RHO, training.MIN_SCALE, training.MAX_SCALE),
      optax.sgd(lr))
  return [training.Method('SGD', optax.sgd),
          training.Method('SGD + M1', sgd_m1),
          training.Method('Adam', optax.adam),
          training.Method('CBP', cbp.cbp, centered=True)]


def model_for(init: str, centered: bool, depth: int, width: int):
  activation, kernel_init = INITS[init]
  return flow.NormMLP(hidden=(width,) * depth, classes=10,
                      activation=activation, kernel_init=kernel_init,
                      centered=centered)


def run(ctx: StudyContext) -> StudyResult:
  start = time.perf_counter()
  data = mnist.load(ctx.data_dir, ctx.quick)
  seeds = list(range(ctx.seed_count(paper=3, quick=2)))
  depth, width = (4, 8) if ctx.quick else (DEPTH, WIDTH)
  steps = 20 if ctx.quick else STEPS
  window = slice(10, 20) if ctx.quick else PROFILE_STEPS
  inits = (['ReLU + He', 'ReLU + 1/d_in'] if ctx.quick else list(INITS))
  grids = {k: v[1:2] for k, v in GRIDS.items()} if ctx.quick else GRIDS
  cells = {}
  arms = methods()
  if ctx.quick:
    arms = [m for m in arms if m.name != 'Adam']
  jobs = [(i, m) for i in inits for m in arms]
  for init, method in tqdm.tqdm(jobs, desc=NAME, unit='cell',
                                disable=not ctx.progress):
    grid = grids[method.name]
    result = flow.run_grid(model_for(init, method.centered, depth, width),
                           method, data, seeds, grid, steps=steps,
                           batch_size=BATCH, block_fn=flow.profile_block_fn)
    index, finite = flow.select(result)
    runs = flow.at_rate(result, 0 if index is None else index)
    cells[(init, method.name)] = {
        'lr': None if index is None else grid[index],
        'finite_rates': finite.tolist(),
        'test_accuracy': runs.test_accuracy,
        'final_loss': runs.losses[:, -20:].mean(-1),
        'raw_profile': runs.grad_norms[:, 0],          # (seed, layer)
        'applied_profile': runs.update_norms[:, window].mean(1),
        'relative_profile': runs.relative_updates[:, window].mean(1),
    }

  names = [m.name for m in arms]
  rows = []
  for init in inits:
    for name in names:
      cell = cells[(init, name)]
      raw = flow.disparity(cell['raw_profile'])
      applied = flow.disparity(cell['applied_profile'])
      bottom_top = cell['raw_profile'][:, 0] / cell['raw_profile'][:, -1]
      rows.append([
          init, name, '—' if cell['lr'] is None else f'{cell["lr"]:g}',
          stats.format_mean_std(cell['test_accuracy'], 3),
          _median(raw), _median(bottom_top), _median(applied),
          NOTES[init] if name == 'SGD' else ''])
  table = plotting.markdown_table(
      ['initialization', 'method', 'lr', 'test accuracy',
       'raw gradient disparity (step 1)', 'raw ‖g_in‖/‖g_out‖',
       f'applied update disparity (steps {window.start + 1}-{window.stop})',
       'notes (SGD-era)'], rows)
  setup = (f'Data: {data.description}. MLP 784 -> {width} x {depth} -> 10, '
           f'zero biases, batch {BATCH}, {steps} iterations, {len(seeds)} '
           'seeds; per (initialization, method) the learning rate with the '
           'lowest mean final validation loss among those where every seed '
           f'stayed finite, from {grids}. CBP = cbp.cbp (M1 + M3) on a '
           'centered network (M2). Profiles by cbp_optax_experiments.diagnostics: one '
           'block per layer (kernel + bias), depth order input -> output; '
           'disparity = max/min block Frobenius norm, median over seeds. '
           '"—" lr: every rate diverged (the row shows the smallest rate).')
  accuracy = {f'{i}/{n}': float(np.mean(cells[(i, n)]['test_accuracy']))
              for i in inits for n in names}
  gap = {n: float(max(accuracy[f'{i}/{n}'] for i in inits) -
                  min(accuracy[f'{i}/{n}'] for i in inits)) for n in names}
  applied = {f'{i}/{n}': _median_value(flow.disparity(
      cells[(i, n)]['applied_profile'])) for i in inits for n in names}
  raw = {i: _median_value(flow.disparity(cells[(i, 'SGD')]['raw_profile']))
         for i in inits}
  verdicts = _verdicts(inits, names, applied, raw, accuracy, gap)

  _plot(ctx, cells, inits, names, depth)
  summary = {'seeds': len(seeds), 'depth': depth, 'steps': steps,
             'mean_test_accuracy': accuracy, 'accuracy_gap_over_inits': gap,
             'median_applied_disparity': applied,
             'median_raw_disparity': raw,
             'selected_lr': {f'{i}/{n}': cells[(i, n)]['lr']
                             for i in inits for n in names}}
  plotting.write_json(ctx.out / 'results.json', {
      **summary, 'setup': setup, 'verdicts': verdicts,
      'per_seed': {f'{i}/{n}': cells[(i, n)] for i in inits for n in names}})
  plotting.write_markdown(ctx.out / 'results.md', TITLE, [
      setup, table, '## Verdicts', '\n'.join(f'- {v}' for v in verdicts),
      '![gradient flow profiles](gradient_flow_profiles.png)'])
  return StudyResult(NAME, summary, time.perf_counter() - start)


def _median_value(values) -> float:
  values = np.asarray(values, np.float64)
  return float(np.median(values)) if np.all(np.isfinite(values)) else np.nan


def _median(values) -> str:
  value = _median_value(values)
  return 'non-finite' if not np.isfinite(value) else f'{value:.3g}'


def _verdicts(inits, names, applied, raw, accuracy, gap) -> list[str]:
  out = []
  finite = [i for i in inits if np.isfinite(applied[f'{i}/SGD + M1'])
            and np.isfinite(applied[f'{i}/SGD'])]
  flatter = [i for i in finite
             if applied[f'{i}/SGD + M1'] < applied[f'{i}/SGD']]
  verdict = ('holds' if finite and len(flatter) == len(finite) else
             'partly' if flatter else 'not supported')
  out.append(
      f'Claim 1 (M1 flattens the applied profile): {verdict} — SGD + M1\'s '
      'applied update disparity is below SGD\'s for '
      f'{len(flatter)} of {len(finite)} initializations with finite profiles '
      '(the clip s_l in [0.1, 4] bounds the flattening to a factor 40). '
      f'Median disparities, raw at step 1 / applied by {", ".join(names)}: '
      + '; '.join(
          f'{i}: {raw[i]:.3g} / ' + ', '.join(
              f'{applied[f"{i}/{n}"]:.3g}' for n in names) for i in inits)
      + '. In full CBP, M3 divides by the per-coordinate second moment after '
      'M1, so its applied profile follows Adam\'s where the damping is '
      'negligible.')
  pair = ('ReLU + He', 'ReLU + 1/d_in')
  if all(i in inits for i in pair):
    he_gap = {n: accuracy[f'{pair[0]}/{n}'] - accuracy[f'{pair[1]}/{n}']
              for n in names}
    best = min(names, key=lambda n: abs(he_gap[n]))
    closes = abs(he_gap['CBP']) <= CLOSED
    out.append(
        'Claim 2 (CBP closes the gap between the initializations, |He - '
        f'1/d_in| <= {CLOSED} for CBP): '
        f'{"holds" if closes else "not supported"} — test accuracy He minus '
        '1/d_in: ' + ', '.join(f'{n} {he_gap[n]:+.3f}' for n in names) +
        f' (smallest: {best}). Spread over all initializations: ' +
        ', '.join(f'{n} {gap[n]:.3f}' for n in names) + '. Per cell: ' +
        ', '.join(f'{k} {v:.3f}' for k, v in accuracy.items()) + '.')
  return out


def _plot(ctx, cells, inits, names, depth) -> None:
  fig, axes = plotting.new_axes(2, 3)
  axes = axes.ravel()
  layers = np.arange(depth + 1)
  colors = {i: f'C{k}' for k, i in enumerate(inits)}
  for init in inits:
    plotting.band(axes[0], layers, cells[(init, 'SGD')]['raw_profile'], init,
                  color=colors[init])
  axes[0].set_title('(a) raw gradient norm per layer, step 1', fontsize=9)
  for k, (ax, name) in enumerate(zip(axes[1:5], names)):
    for init in inits:
      plotting.band(ax, layers, cells[(init, name)]['applied_profile'], init,
                    color=colors[init])
    ax.set_title(f'({"bcde"[k]}) {name}: applied update norm', fontsize=9)
  for ax in axes[:5]:
    ax.set_yscale('log')
    ax.set_xlabel('layer (0 = input)')
  axes[0].legend(fontsize=7)
  x = np.arange(len(names))
  for k, init in enumerate(inits):
    acc = np.array([cells[(init, n)]['test_accuracy'] for n in names])
    axes[5].errorbar(x + 0.1 * (k - 1.5), acc.mean(1), yerr=acc.std(1),
                     fmt='o', color=colors[init], label=init)
  axes[5].set_xticks(x, names, fontsize=8)
  axes[5].set_ylabel('test accuracy')
  axes[5].set_title('(f) accuracy after the budget', fontsize=9)
  plotting.save(fig, ctx.out / 'gradient_flow_profiles.png')
