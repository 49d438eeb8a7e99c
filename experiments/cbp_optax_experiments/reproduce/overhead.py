"""§5.6 / Table 4: per-iteration wall-clock time of SGD, Adam and full CBP.

Fully connected networks 784 -> width x 4 -> 10 (ReLU) at widths 256, 1024
and 4096, and the ResNet-8 of Table 11 on 32x32x3 inputs, batch 128. Every
method runs through the same fused step, ``cbp_optax.linen.train_step`` (one
jit with donated state): SGD and Adam on the plain network, CBP with every
layer centered, so its time includes the centering, the M1/M3 transform and
the bias transport. Mean over timed iterations after warm-up; random inputs
(timing only). The paper measured PyTorch on its CPU (two threads); ours is
JAX on this machine, so only the ratios are comparable.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm

import cbp_optax as cbp
from cbp_optax_experiments.reproduce import plotting
from cbp_optax_experiments.reproduce import resnet
from cbp_optax_experiments.reproduce import training
from cbp_optax_experiments.reproduce.context import StudyContext, StudyResult

NAME = 'overhead'
TITLE = '§5.6 / Table 4: per-iteration time of SGD, Adam and CBP'

BATCH = 128
PAPER = {  # params, SGD ms, Adam ms, CBP ms, xAdam
    'MLP, width 256': ('0.40 M', 2.2, 3.8, 7.8, 2.1),
    'MLP, width 1024': ('4.0 M', 23.2, 36.5, 69.5, 1.9),
    'MLP, width 4096': ('53.6 M', 281, 654, 1061, 1.6),
    'ResNet-8 (CIFAR)': ('78 K', 147, 146, 252, 1.7),
}


def _loss_fn(apply, x, y):
  return training.cross_entropy(apply(x, train=True), y)


def time_method(model, tx, x, y, *, warmup: int, iterations: int) -> float:
  """Milliseconds per fused step, excluding compilation and warm-up."""
  variables = dict(model.init(jax.random.key(0), x[:2]))
  params = variables.pop('params')
  state = cbp.linen.TrainState.create(
      apply_fn=model.apply, params=params,
      centering=variables.get('centering', {}), tx=tx)
  step = cbp.linen.train_step(_loss_fn)
  for _ in range(warmup):
    state, out = step(state, x, y)
  jax.block_until_ready(out.loss)
  start = time.perf_counter()
  for _ in range(iterations):
    state, out = step(state, x, y)
  jax.block_until_ready((state.params, out.loss))
  return 1e3 * (time.perf_counter() - start) / iterations


def architectures(quick: bool) -> dict[str, tuple[Any, tuple[int, ...]]]:
  """name -> (model factory(centered), input shape)."""
  mlp = lambda width: (lambda centered: training.MLP(
      hidden=(width,) * 4, classes=10, centered=centered), (784,))
  archs = {'MLP, width 256': mlp(256)}
  if not quick:
    archs['MLP, width 1024'] = mlp(1024)
    archs['MLP, width 4096'] = mlp(4096)
    archs['ResNet-8 (CIFAR)'] = (
        lambda centered: resnet.ResNet8(centered=centered), (32, 32, 3))
  return archs


def run(ctx: StudyContext) -> StudyResult:
  start = time.perf_counter()
  rng = np.random.default_rng(0)
  rows, timings = [], {}
  archs = architectures(ctx.quick)
  for name, (factory, shape) in tqdm.tqdm(archs.items(), desc=NAME,
                                          unit='arch',
                                          disable=not ctx.progress):
    x = jnp.asarray(rng.standard_normal((BATCH, *shape)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 10, BATCH), jnp.int32)
    big = '4096' in name or 'ResNet' in name
    iterations = 3 if ctx.quick else (10 if big else 30)
    ms = {}
    for method, centered, tx in (('SGD', False, optax.sgd(0.01)),
                                 ('Adam', False, optax.adam(1e-3)),
                                 ('CBP', True, cbp.cbp(1e-3))):
      ms[method] = time_method(factory(centered), tx, x, y,
                               warmup=1 if ctx.quick else 3,
                               iterations=iterations)
    params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(
        factory(False).init(jax.random.key(0), x[:2])['params']))
    timings[name] = {**ms, 'params': params, 'iterations': iterations}
    paper = PAPER[name]
    rows.append([name, f'{paper[0]} / {params / 1e6:.3g} M',
                 f'{paper[1]} / {ms["SGD"]:.1f}', f'{paper[2]} / {ms["Adam"]:.1f}',
                 f'{paper[3]} / {ms["CBP"]:.1f}',
                 f'{paper[4]} / {ms["CBP"] / ms["Adam"]:.2f}'])
  table = plotting.markdown_table(
      ['architecture', 'params paper / ours', 'SGD ms', 'Adam ms', 'CBP ms',
       '×Adam'], rows)
  setup = (f'Setup: batch {BATCH}, fused `cbp.linen.train_step` for every '
           f'method, JAX {jax.__version__} on {jax.devices()[0].platform} '
           '(this machine, shared with other jobs: absolute times are noisy); '
           'cells are "paper (PyTorch, 2 threads) / ours". ResNet-8 here has '
           '3 input channels as on CIFAR-10.')
  fig, ax = plotting.new_axes()
  names = list(timings)
  ratios = [timings[n]['CBP'] / timings[n]['Adam'] for n in names]
  ax.bar(np.arange(len(names)) - 0.2, [PAPER[n][4] for n in names], 0.4,
         label='paper (PyTorch)', color='grey')
  ax.bar(np.arange(len(names)) + 0.2, ratios, 0.4, label='ours (JAX)',
         color='C3')
  ax.set_xticks(np.arange(len(names)), names, fontsize=7)
  ax.set_ylabel('CBP time / Adam time')
  ax.axhline(1, color='k', lw=0.5)
  ax.legend()
  plotting.save(fig, ctx.out / 'table4_overhead.png')
  summary = {'timings_ms': timings,
             'cbp_over_adam': dict(zip(names, ratios))}
  plotting.write_json(ctx.out / 'results.json', {**summary, 'setup': setup,
                                                 'paper': PAPER})
  plotting.write_markdown(ctx.out / 'results.md', TITLE, [
      setup, table, '![Table 4](table4_overhead.png)'])
  return StudyResult(NAME, summary, time.perf_counter() - start)
