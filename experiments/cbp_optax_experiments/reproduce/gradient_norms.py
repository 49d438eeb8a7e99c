"""§6.1 / Figure 2: M1 equalizes per-layer gradient norms.

A 24-hidden-layer tanh network (width 48) at initialization in the saturating
offset-bias regime: weights at 1.2x the Xavier scale, biases N(0, 0.25^2). The
Frobenius norm of each layer's gradient block (kernel and bias, the M1 block)
is measured on the full training batch, raw and after one application of the
M1 scaling (eq. 6) through the public ``cbp.equalize`` transform. The
disparity is max_l ||g_l|| / min_l ||g_l||. Paper: 16 +- 10 raw, 2.1 +- 1.0 with
M1, over ten seeds.
"""

from __future__ import annotations

import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import cbp_optax as cbp
from cbp_optax_experiments import diagnostics
from cbp_optax_experiments.reproduce import plotting
from cbp_optax_experiments.reproduce import stats
from cbp_optax_experiments.reproduce import training
from cbp_optax_experiments.reproduce.context import StudyContext, StudyResult

NAME = 'gradient-norms'
TITLE = '§6.1 / Figure 2: per-layer gradient-block norms, raw vs M1'

DEPTH, WIDTH = 24, 48
XAVIER_GAIN, BIAS_STD = 1.2, 0.25
PAPER = {'raw': (16.0, 10.0), 'm1': (2.1, 1.0)}


def saturating_tanh_mlp(depth: int = DEPTH, width: int = WIDTH) -> training.MLP:
  """tanh MLP with 1.2x Xavier-normal weights and N(0, 0.25^2) biases."""
  layers = depth + 1
  # variance_scaling(g^2, 'fan_avg') has std g * sqrt(2 / (fan_in + fan_out)).
  kernel = nn.initializers.variance_scaling(XAVIER_GAIN**2, 'fan_avg', 'normal')
  bias = nn.initializers.normal(BIAS_STD)
  return training.MLP(hidden=(width,) * depth, classes=6, activation=jnp.tanh,
                      kernel_inits=(kernel,) * layers,
                      bias_inits=(bias,) * layers)


def layer_norms(tree) -> jax.Array:
  """Frobenius norm of each layer block, in layer order (layer_0, layer_1...).

  The M1 blocks of ``cbp_optax_experiments.diagnostics.gradient_profile``, which come in
  tree order (layer_0, layer_1, layer_10, ...), put back in depth order.
  """
  profile = diagnostics.gradient_profile(tree)
  order = sorted(range(len(profile.names)),
                 key=lambda i: int(profile.names[i].split('_')[-1]))
  return profile.norms[jnp.asarray(order)]


def raw_and_equalized_norms(model: nn.Module, key: jax.Array, x, y):
  """Full-batch block norms at the model's initialization; see below."""
  params, _ = training.init_variables(model, key, x)
  return norms_at(model, params, x, y)


def norms_at(model: nn.Module, params, x, y):
  """Full-batch block norms at ``params``, raw and after one M1 scaling (eq. 6).

  ``cbp.equalize`` with decay 0 stores ``q_l = ||g_l||^2`` on its first update
  (which applies s_l = 1); its second update of the same gradient applies
  ``s_l = clip(c / ||g_l||, 0.1, 4)`` with ``c^2 = mean_l q_l``.
  """
  grads = jax.grad(lambda p: training.cross_entropy(
      model.apply({'params': p}, x), y))(params)
  tx = cbp.equalize(0.0, training.MIN_SCALE, training.MAX_SCALE)
  _, state = tx.update(grads, tx.init(params))
  equalized, _ = tx.update(grads, state)
  return layer_norms(grads), layer_norms(equalized)


def disparity(norms: np.ndarray) -> np.ndarray:
  return norms.max(-1) / norms.min(-1)


def run(ctx: StudyContext) -> StudyResult:
  start = time.perf_counter()
  seeds = ctx.seed_count(paper=10, quick=5)
  depth = 12 if ctx.quick else DEPTH
  data = training.spiral()
  model = saturating_tanh_mlp(depth)
  keys = jax.vmap(jax.random.key)(jnp.arange(seeds))
  raw, equalized = jax.jit(jax.vmap(
      lambda k: raw_and_equalized_norms(model, k, data.train_x, data.train_y)
  ))(keys)
  raw, equalized = np.asarray(raw), np.asarray(equalized)
  d_raw, d_eq = disparity(raw), disparity(equalized)

  rows = [
      ['raw backprop', f'{PAPER["raw"][0]:g} ± {PAPER["raw"][1]:g}',
       stats.format_mean_std(d_raw, 1), f'{np.median(d_raw):.1f}'],
      ['one M1 scaling', f'{PAPER["m1"][0]:g} ± {PAPER["m1"][1]:g}',
       stats.format_mean_std(d_eq, 1), f'{np.median(d_eq):.1f}'],
  ]
  table = plotting.markdown_table(
      ['gradient-block disparity max/min', 'paper (mean ± std)',
       'ours (mean ± std)', 'ours (median)'], rows)
  setup = (f'Setup: {depth}-hidden-layer tanh MLP, width {WIDTH}, weights '
           f'{XAVIER_GAIN}x Xavier-normal, biases N(0, {BIAS_STD}^2), full '
           f'training batch of the {data.description}; {seeds} seeds; blocks '
           'are (kernel, bias) per layer, input and output layers included; '
           'M1 = `cbp.equalize(decay=0, min_scale=0.1, max_scale=4)` applied '
           'once.')

  fig, ax = plotting.new_axes()
  layers = np.arange(1, raw.shape[1] + 1)
  plotting.band(ax, layers, raw, 'standard backprop', color='grey')
  plotting.band(ax, layers, equalized, 'with M1 (one scaling)', color='C3')
  ax.set_yscale('log')
  ax.set_xlabel('layer (1 = input layer)')
  ax.set_ylabel('gradient-block norm ||g_l||')
  ax.set_title(f'Fig. 2: {depth}-layer tanh, median and IQR over {seeds} seeds')
  ax.legend()
  plotting.save(fig, ctx.out / 'fig2_gradient_norms.png')

  summary = {
      'depth': depth, 'seeds': seeds,
      'disparity_raw_mean': float(d_raw.mean()),
      'disparity_raw_std': stats.sample_std(d_raw),
      'disparity_m1_mean': float(d_eq.mean()),
      'disparity_m1_std': stats.sample_std(d_eq),
      'paper': PAPER,
  }
  plotting.write_json(ctx.out / 'results.json', {
      **summary, 'setup': setup, 'raw_norms': raw, 'm1_norms': equalized,
      'disparity_raw': d_raw, 'disparity_m1': d_eq})
  plotting.write_markdown(ctx.out / 'results.md', TITLE, [
      setup, table, '![Figure 2](fig2_gradient_norms.png)'])
  return StudyResult(NAME, summary, time.perf_counter() - start)
