"""§6.5 / Figure 7 (Study D3): SGD vs SGD + M1 on hetero tanh nets by depth.

The hetero-gain tanh networks of Table 9 (see ``disparity``) are trained at
depths 4..20 with plain SGD and with ``cbp.equalize`` before SGD; the learning
rate is selected per depth and per method on the validation split from the
shifted grid {0.003, ..., 1.0}; five seeds per cell. Reported: iterations to a
smoothed training loss below 0.20. Paper: comparable within the clip range
(medians 77 vs 63 at depth 12), both rising beyond depth 16 (380 vs 419 at
depth 20); no end-to-end depth advantage is claimed.
"""

from __future__ import annotations

import functools
import time

import numpy as np
import optax
import tqdm

import cbp_optax as cbp
from cbp_optax_experiments.reproduce import disparity
from cbp_optax_experiments.reproduce import plotting
from cbp_optax_experiments.reproduce import protocol
from cbp_optax_experiments.reproduce import training
from cbp_optax_experiments.reproduce.context import StudyContext, StudyResult

NAME = 'depth-training'
TITLE = '§6.5 / Figure 7: iterations to loss 0.20, SGD vs SGD + M1, by depth'

DEPTHS = (4, 8, 12, 16, 20)
THRESHOLD, STEPS, BATCH, EVAL_EVERY = 0.20, 1000, 64, 100
PAPER_MEDIANS = {12: (77, 63), 20: (380, 419)}  # (SGD, SGD + M1)


def task() -> training.Dataset:
  """Our choice: an easier spiral (3 arms, noise 0.05) that tanh nets of every
  tested depth can drive below 0.20 within the budget."""
  return training.spiral(arms=3, points_per_arm=500, turns=0.5, noise=0.05)


def methods() -> list[training.Method]:
  sgd_m1 = lambda lr: optax.chain(
      cbp.equalize(training.RHO, training.MIN_SCALE, training.MAX_SCALE),
      optax.sgd(lr))
  return [training.Method('SGD', optax.sgd),
          training.Method('SGD + M1', sgd_m1)]


def run(ctx: StudyContext) -> StudyResult:
  start = time.perf_counter()
  seeds = list(range(ctx.seed_count(paper=5, quick=2)))
  depths = (4,) if ctx.quick else DEPTHS
  grid = (0.03, 0.3) if ctx.quick else training.SHIFTED_GRID
  config = training.TrainConfig(steps=200 if ctx.quick else STEPS,
                                batch_size=BATCH,
                                eval_every=50 if ctx.quick else EVAL_EVERY)
  data = task()
  cells = {}
  jobs = [(d, m) for d in depths for m in methods()]
  for depth, method in tqdm.tqdm(jobs, desc=NAME, unit='cell',
                                 disable=not ctx.progress):
    model = disparity.hetero_tanh_mlp(depth, classes=3)
    init = functools.partial(disparity.hetero_params, model)
    result = training.run_grid(model, method, data, config, seeds, grid,
                               init=init)
    index = training.select_learning_rate(result)
    if index is None:
      iters = np.full(len(seeds), np.inf)
      lr = None
    else:
      iters = training.iterations_to(result.losses[:, index], THRESHOLD)
      lr = grid[index]
    cells[(depth, method.name)] = (lr, iters)

  names = [m.name for m in methods()]
  rows = []
  for depth in depths:
    row = [depth]
    for name in names:
      lr, iters = cells[(depth, name)]
      censored = int(np.sum(~np.isfinite(iters)))
      row += ['—' if lr is None else f'{lr:g}',
              f'{np.median(protocol.censored_iterations(iters, config.steps)):.0f}'
              + (f' ({censored} censored)' if censored else '')]
    paper = PAPER_MEDIANS.get(depth)
    row.append(f'{paper[0]} / {paper[1]}' if paper else '')
    rows.append(row)
  table = plotting.markdown_table(
      ['depth', 'SGD l.r.', 'SGD median iters', 'SGD+M1 l.r.',
       'SGD+M1 median iters', 'paper medians SGD / SGD+M1'], rows)
  setup = (f'Setup: hetero-gain tanh MLPs of Table 9 (width '
           f'{disparity.WIDTH}), {data.description} (our choice: easier than '
           f'the six-arm task so that the 0.20 target is reachable), batch '
           f'{BATCH}, budget {config.steps} iterations (censored runs count '
           f'at the budget), lr per depth and method from {list(grid)} on '
           f'the mean final validation loss, {len(seeds)} seeds. SGD + M1 = '
           'optax.chain(cbp.equalize(0.99, 0.1, 4), optax.sgd(lr)).')

  fig, ax = plotting.new_axes()
  for i, name in enumerate(names):
    runs = np.array([protocol.censored_iterations(cells[(d, name)][1],
                                                  config.steps)
                     for d in depths]).T
    plotting.band(ax, depths, runs, name, color=['grey', 'C3'][i], marker='o')
  ax.set_yscale('log')
  ax.set_xlabel('hidden layers')
  ax.set_ylabel(f'iterations to smoothed loss < {THRESHOLD}')
  ax.set_title(f'Fig. 7: median and IQR over {len(seeds)} seeds')
  ax.legend()
  plotting.save(fig, ctx.out / 'fig7_depth_training.png')

  summary = {
      'seeds': len(seeds), 'depths': list(depths), 'steps': config.steps,
      'median_iterations': {f'{d}/{n}': float(np.median(
          protocol.censored_iterations(cells[(d, n)][1], config.steps)))
          for d in depths for n in names},
      'selected_lr': {f'{d}/{n}': cells[(d, n)][0]
                      for d in depths for n in names},
  }
  plotting.write_json(ctx.out / 'results.json', {
      **summary, 'setup': setup, 'paper_medians': PAPER_MEDIANS,
      'per_seed_iterations': {f'{d}/{n}': cells[(d, n)][1]
                              for d in depths for n in names}})
  plotting.write_markdown(ctx.out / 'results.md', TITLE, [
      setup, table, '![Figure 7](fig7_depth_training.png)'])
  return StudyResult(NAME, summary, time.perf_counter() - start)
