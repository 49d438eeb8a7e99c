"""§6.5 / Table 9, Figure 6: block-norm disparity vs depth, raw and with M1.

tanh networks of width 48 with heterogeneous per-layer gains (our "hetero"
choice, since the paper does not give its gains): the weights of layer l are
N(0, g_l^2 / fan_in) with ``g_l = 0.9 exp(0.1 xi_l)``, ``xi_l ~ N(0, 1)`` drawn
from the seed's key, biases N(0, 0.25^2). The sub-critical mean gain makes the backward
signal decay geometrically with depth while tanh and the bias offsets keep the
forward signal bounded away from zero. The full-batch block-norm disparity
max/min is measured at initialization, raw and after one M1 scaling
(``cbp.equalize``, clip [0.1, 4]), for depths 4..24 over 15 seeds.

The per-layer growth kappa-bar is fitted from the raw medians (log-linear fit),
and Corollary 1's crossover ``L* = log R / log kappa-bar`` (R = 40) is
compared with the depth where the raw disparity crosses R.
"""

from __future__ import annotations

import math
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from cbp_optax_experiments.reproduce import gradient_norms
from cbp_optax_experiments.reproduce import plotting
from cbp_optax_experiments.reproduce import training
from cbp_optax_experiments.reproduce.context import StudyContext, StudyResult

NAME = 'disparity'
TITLE = '§6.5 / Table 9, Figure 6: disparity vs depth in hetero tanh nets'

WIDTH, MEAN_GAIN, GAIN_SPREAD, BIAS_STD = 48, 0.9, 0.1, 0.25
DEPTHS = (4, 8, 12, 16, 20, 24)
CLIP_RANGE = training.MAX_SCALE / training.MIN_SCALE
PAPER = {4: (4.0, 1.0), 8: (4.3, 1.0), 12: (5.4, 1.0), 16: (13.5, 1.7),
         20: (46.4, 6.8), 24: (797.0, 93.0)}


def hetero_gains(key: jax.Array, depth: int) -> jax.Array:
  """Per-layer gains ``0.9 exp(0.1 xi)`` for the depth + 1 Dense layers,
  drawn from the initialization key."""
  xi = jax.random.normal(jax.random.fold_in(key, 0x6A1), (depth + 1,))
  return MEAN_GAIN * jnp.exp(GAIN_SPREAD * xi)


def hetero_tanh_mlp(depth: int, classes: int = 6) -> training.MLP:
  """Unit-gain (LeCun-normal) tanh MLP; the gains are applied by
  :func:`hetero_params`, so one compiled program serves every seed."""
  biases = (nn.initializers.normal(BIAS_STD),) * (depth + 1)
  kernels = (nn.initializers.lecun_normal(),) * (depth + 1)
  return training.MLP(hidden=(WIDTH,) * depth, classes=classes,
                      activation=jnp.tanh, kernel_inits=kernels,
                      bias_inits=biases)


def hetero_params(model: training.MLP, key: jax.Array, x) -> tuple[Any, Any]:
  """``(params, {})``: layer l's kernel multiplied by ``hetero_gains[l]``."""
  gains = hetero_gains(key, len(model.hidden))
  params, _ = training.init_variables(model, key, x[:2])
  params = dict(params)
  for i in range(len(model.hidden) + 1):
    layer = dict(params[f'layer_{i}'])
    layer['kernel'] = layer['kernel'] * gains[i]
    params[f'layer_{i}'] = layer
  return params, {}


def disparities(depth: int, seeds: int, data: training.Dataset):
  """Raw and equalized disparity per seed at one depth (one vmapped jit)."""
  model = hetero_tanh_mlp(depth)
  keys = jax.vmap(jax.random.key)(jnp.arange(seeds))
  x, y = jnp.asarray(data.train_x), jnp.asarray(data.train_y)

  def one(key):
    params, _ = hetero_params(model, key, x)
    return gradient_norms.norms_at(model, params, x, y)

  raw, eq = jax.jit(jax.vmap(one))(keys)
  return (gradient_norms.disparity(np.asarray(raw)),
          gradient_norms.disparity(np.asarray(eq)))


def run(ctx: StudyContext) -> StudyResult:
  start = time.perf_counter()
  seeds = ctx.seed_count(paper=15, quick=3)
  depths = (4, 8) if ctx.quick else DEPTHS
  data = training.spiral()
  raw, eq = {}, {}
  for depth in depths:
    raw[depth], eq[depth] = disparities(depth, seeds, data)
  med_raw = np.array([np.median(raw[d]) for d in depths])
  med_eq = np.array([np.median(eq[d]) for d in depths])
  slope = float(np.polyfit(depths, np.log(med_raw), 1)[0])
  kappa_bar = math.exp(slope)
  crossover = math.log(CLIP_RANGE) / slope if slope > 0 else math.inf
  above = [d for d, m in zip(depths, med_raw) if m >= CLIP_RANGE]
  rows = [
      ['raw disparity (paper)'] + [PAPER.get(d, ('',))[0] for d in depths],
      ['raw disparity (ours)'] + [f'{m:.1f}' for m in med_raw],
      ['with M1 (paper)'] + [PAPER.get(d, ('', ''))[1] for d in depths],
      ['with M1 (ours)'] + [f'{m:.1f}' for m in med_eq],
      ['reduction (paper)'] + [f'{PAPER[d][0] / PAPER[d][1]:.1f}'
                               if d in PAPER else '' for d in depths],
      ['reduction (ours)'] + [f'{r / e:.1f}' for r, e in zip(med_raw, med_eq)],
  ]
  table = plotting.markdown_table(['depth'] + list(depths), rows)
  setup = (f'Setup: tanh MLP width {WIDTH}, weights N(0, g_l²/fan_in) with '
           f'g_l = {MEAN_GAIN} exp({GAIN_SPREAD} ξ_l), ξ_l ~ N(0, 1) per layer '
           'and seed, '
           f'biases N(0, {BIAS_STD}²) (our "hetero" choice); full training '
           f'batch of the {data.description}; medians over {seeds} seeds; M1 '
           'applied once (cbp.equalize, clip [0.1, 4]). Log-linear fit of the '
           f'raw medians: slope {slope:.3f} per layer (paper 0.25), κ̄ = '
           f'{kappa_bar:.3f}; predicted crossover L* = log 40 / log κ̄ = '
           f'{crossover:.1f} (paper ≈ 15); raw median first ≥ 40 at depth '
           f'{above[0] if above else "none tested"}.')

  fig, ax = plotting.new_axes()
  plotting.band(ax, depths, np.array([raw[d] for d in depths]).T,
                'raw backprop', color='grey', marker='o')
  plotting.band(ax, depths, np.array([eq[d] for d in depths]).T,
                'with M1', color='C3', marker='s')
  ax.axhline(CLIP_RANGE, color='k', ls='--', lw=0.8, label='clip range R = 40')
  if math.isfinite(crossover):
    ax.axvline(crossover, color='C0', ls=':', lw=1,
               label=f'predicted L* = {crossover:.1f}')
  ax.set_yscale('log')
  ax.set_xlabel('hidden layers')
  ax.set_ylabel('block-norm disparity max/min')
  ax.set_title(f'Fig. 6: median and IQR over {seeds} seeds')
  ax.legend(fontsize=7)
  plotting.save(fig, ctx.out / 'fig6_disparity.png')

  summary = {
      'seeds': seeds, 'depths': list(depths),
      'median_raw': med_raw, 'median_m1': med_eq,
      'slope_per_layer': slope, 'kappa_bar': kappa_bar,
      'predicted_crossover': crossover,
  }
  plotting.write_json(ctx.out / 'results.json', {
      **summary, 'setup': setup, 'paper': PAPER,
      'per_seed_raw': {d: raw[d] for d in depths},
      'per_seed_m1': {d: eq[d] for d in depths}})
  plotting.write_markdown(ctx.out / 'results.md', TITLE, [
      setup, table, '![Figure 6](fig6_disparity.png)'])
  return StudyResult(NAME, summary, time.perf_counter() - start)
