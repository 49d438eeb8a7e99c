"""Diagnostics study: normalization layers vs CBP at depth 12 on MNIST.

A 12-hidden-layer ReLU MLP (width 64, He init, zero biases) on MNIST with Adam
and no normalization, LayerNorm or BatchNorm before every activation, then
centering alone (Adam + Center: M2) and full CBP (M2 + ``cbp.cbp``), without
normalization layers. Learning rate per arm selected on the validation loss
from a three-point grid; reported: test accuracy, the final training loss
(mean minibatch loss over the last 20 steps) and, with
``cbp_optax_experiments.diagnostics``, the raw gradient and applied update disparities.

Reported in earlier notes (no normalization / LayerNorm / BatchNorm): 91.0 /
90.0 / 89.1% test accuracy, BatchNorm the lowest training loss (0.025 vs
0.048). Claim tested: centering (and CBP) reaches a training loss at least as
low as BatchNorm's without normalization layers, at no loss of accuracy.
"""

from __future__ import annotations

import time

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

NAME = 'normalization'
TITLE = 'Diagnostics: normalization vs centering at depth 12 on MNIST'

DEPTH, WIDTH, BATCH, STEPS = 12, 64, 128, 600
GRID = (3e-4, 1e-3, 3e-3)
PROFILE_STEPS = slice(40, 60)
NOTES = {'Adam': '91.0% / —', 'Adam + LayerNorm': '90.0% / 0.048',
         'Adam + BatchNorm': '89.1% / 0.025'}


def arms() -> list[tuple[training.Method, str | None]]:
  """(method, normalization) pairs, in the table's order."""
  adam = lambda name, **kw: training.Method(name, optax.adam, **kw)
  return [(adam('Adam'), None), (adam('Adam + LayerNorm'), 'layer'),
          (adam('Adam + BatchNorm'), 'batch'),
          (adam('Adam + Center', centered=True), None),
          (training.Method('CBP (full)', cbp.cbp, centered=True), None)]


def run(ctx: StudyContext) -> StudyResult:
  start = time.perf_counter()
  data = mnist.load(ctx.data_dir, ctx.quick)
  seeds = list(range(ctx.seed_count(paper=3, quick=2)))
  depth, width = (3, 8) if ctx.quick else (DEPTH, WIDTH)
  steps = 20 if ctx.quick else STEPS
  window = slice(10, 20) if ctx.quick else PROFILE_STEPS
  grid = GRID[1:2] if ctx.quick else GRID
  chosen = arms()
  if ctx.quick:
    chosen = [a for a in chosen if a[0].name in ('Adam + BatchNorm',
                                                   'CBP (full)')]
  cells = {}
  for method, norm in tqdm.tqdm(chosen, desc=NAME, unit='arm',
                                disable=not ctx.progress):
    model = flow.NormMLP(hidden=(width,) * depth, classes=10, norm=norm,
                         centered=method.centered)
    result = flow.run_grid(model, method, data, seeds, grid, steps=steps,
                           batch_size=BATCH, block_fn=flow.profile_block_fn)
    index, _ = flow.select(result)
    runs = flow.at_rate(result, 0 if index is None else index)
    cells[method.name] = {
        'lr': None if index is None else grid[index],
        'test_accuracy': runs.test_accuracy,
        'train_loss': runs.losses[:, -20:].mean(-1),
        'losses': runs.losses,
        'raw_disparity': flow.disparity(runs.grad_norms[:, 0]),
        'applied_disparity': flow.disparity(
            runs.update_norms[:, window].mean(1)),
    }

  names = [m.name for m, _ in chosen]
  reference = 'Adam + BatchNorm'
  rows, pvalues = [], {}
  for name in names:
    cell = cells[name]
    test = (stats.paired_test(cell['train_loss'],
                              cells[reference]['train_loss'])
            if name != reference and len(seeds) > 1 else None)
    pvalues[name] = None if test is None else test.t_pvalue
    rows.append([
        name, '—' if cell['lr'] is None else f'{cell["lr"]:g}',
        stats.format_mean_std(cell['test_accuracy'], 4),
        stats.format_mean_std(cell['train_loss'], 4),
        '' if test is None else stats.format_pvalue(test.t_pvalue),
        f'{np.median(cell["raw_disparity"]):.3g}',
        f'{np.median(cell["applied_disparity"]):.3g}',
        NOTES.get(name, '')])
  table = plotting.markdown_table(
      ['arm', 'lr', 'test accuracy', 'final train loss',
       f'paired t-test p vs {reference} (train loss)',
       'raw gradient disparity (step 1)',
       f'applied update disparity (steps {window.start + 1}-{window.stop})',
       'notes: acc / train loss'], rows)
  setup = (f'Data: {data.description}. ReLU MLP 784 -> {width} x {depth} -> '
           f'10, He init, zero biases; LayerNorm / BatchNorm (momentum 0.9, '
           'running statistics at evaluation) before every activation; batch '
           f'{BATCH}, {steps} iterations, {len(seeds)} seeds; per arm the '
           f'learning rate from {list(grid)} with the lowest mean final '
           'validation loss. Train loss: mean minibatch loss of the last 20 '
           'steps. Disparities (cbp_optax_experiments.diagnostics, one block per layer, '
           'its norm parameters included): medians over seeds.')
  mean = lambda k: {n: float(np.mean(cells[n][k])) for n in names}
  accuracy, train_loss = mean('test_accuracy'), mean('train_loss')
  verdicts = _verdicts(names, accuracy, train_loss, reference, pvalues)
  edge = [n for n in names if cells[n]['lr'] in (grid[0], grid[-1])
          and len(grid) > 1]
  if edge:
    verdicts.append('Selected at an edge of the learning-rate grid: '
                    + ', '.join(f'{n} ({cells[n]["lr"]:g})' for n in edge)
                    + '; a wider grid could change the ordering.')
  fig, ax = plotting.new_axes()
  for i, name in enumerate(names):
    plotting.band(ax, np.arange(1, steps + 1),
                  training.smoothed(cells[name]['losses']), name,
                  color=f'C{i}')
  ax.set_yscale('log')
  ax.set_xlabel('iteration')
  ax.set_ylabel('smoothed minibatch loss')
  ax.legend(fontsize=7)
  plotting.save(fig, ctx.out / 'normalization_curves.png')
  summary = {'seeds': len(seeds), 'steps': steps, 'depth': depth,
             'mean_test_accuracy': accuracy, 'mean_train_loss': train_loss,
             'selected_lr': {n: cells[n]['lr'] for n in names}}
  plotting.write_json(ctx.out / 'results.json', {
      **summary, 'setup': setup, 'verdicts': verdicts,
      'per_seed': {n: {k: v for k, v in c.items() if k != 'losses'}
                   for n, c in cells.items()}})
  plotting.write_markdown(ctx.out / 'results.md', TITLE, [
      setup, table, '## Verdicts', '\n'.join(f'- {v}' for v in verdicts),
      '![normalization curves](normalization_curves.png)'])
  return StudyResult(NAME, summary, time.perf_counter() - start)


def _verdicts(names, accuracy, train_loss, reference, pvalues) -> list[str]:
  out = []
  if 'Adam' in names and 'Adam + LayerNorm' in names:
    lowest = min(('Adam', 'Adam + LayerNorm', reference),
                 key=lambda n: train_loss[n])
    out.append(
        'Notes\' ordering (BatchNorm the lowest training loss, the lowest '
        'accuracy of the three): training loss '
        f'{"holds" if lowest == reference else "not reproduced"}; accuracy '
        f'{"holds" if accuracy[reference] <= min(accuracy["Adam"], accuracy["Adam + LayerNorm"]) else "not reproduced"}'
        ' — ' + ', '.join(f'{n}: {accuracy[n]:.4f} / {train_loss[n]:.4f}'
                          for n in ('Adam', 'Adam + LayerNorm', reference))
        + '.')
  for name in ('Adam + Center', 'CBP (full)'):
    if name not in names:
      continue
    lower = train_loss[name] <= train_loss[reference]
    p = pvalues.get(name)
    significant = p is not None and p < 0.05
    verdict = ('holds' if lower and significant else
               'lower, not significant' if lower else 'not supported')
    out.append(
        f'{name} reaches a training loss at least as low as BatchNorm '
        f'without normalization layers: {verdict} ({train_loss[name]:.4f} vs '
        f'{train_loss[reference]:.4f}, paired t-test p = '
        f'{"n/a" if p is None else stats.format_pvalue(p)}); test accuracy '
        f'{accuracy[name]:.4f} vs {accuracy[reference]:.4f}.')
  return out
