"""The Kronecker-factored M3 against AdamW and Muon: update time and state.

``python benchmarks/kron.py [--widths 128,1024,4096] [--rounds 9]``: for the
MLP 784 -> W x 4 -> 10 (the §6.6 MLP at W = 128, the paper's Table 4 widths
above it), the optimizer update alone (gradients given, jitted, donated) of
``optax.adamw``, ``optax.contrib.muon``, ``cbp.cbp_robust`` and
``precondition_kron`` with cbp_robust's settings, in two states: a step
that only rotates (9 of every 10) and a step that also refreshes the bases
(one eigendecomposition of each factor, 1 of every 10), and their mean over
a refresh interval. Rounds interleave the variants; medians and IQRs, and
the per-round ratio to AdamW. State bytes from the initialized state.
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import cbp_optax as cbp

EVERY = 10


def _params(width: int, depth: int = 4, seed: int = 0) -> dict:
  sizes = [784] + [width] * depth + [10]
  keys = jax.random.split(jax.random.key(seed), len(sizes))
  return {f'layer{i}': {'kernel': jax.random.normal(k, (a, b)) / np.sqrt(a),
                        'bias': jnp.zeros(b)}
          for i, (k, a, b) in enumerate(zip(keys, sizes, sizes[1:]))}


def _kron(every: int) -> optax.GradientTransformation:
  return optax.chain(
      cbp.equalize(min_scale=1.0, max_scale=1.0),
      cbp.precondition_kron(damping=1e-8, zero_moment='normalized',
                            every=every),
      optax.clip(3.0), optax.scale_by_learning_rate(1e-3))


def variants() -> dict:
  # A refresh every step times the refreshing step; every 10**9 steps the
  # rotating one (the state is advanced past the first refresh first).
  return {
      'AdamW': optax.adamw(1e-3),
      'Muon': optax.contrib.muon(1e-3),
      'cbp_robust': cbp.cbp_robust(1e-3),
      'kron, rotate': _kron(10**9),
      'kron, refresh': _kron(1),
  }


def _step(tx, params):
  def update(p, state, g):
    u, state = tx.update(g, state, p)
    return optax.apply_updates(p, u), state
  return jax.jit(update, donate_argnums=(0, 1))


def _bytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def eigh_seconds(size: int, repeats: int = 3) -> float:
  """Median seconds of one jitted eigendecomposition of a size x size PSD
  matrix (what a refresh does for each side of each matrix)."""
  a = jax.random.normal(jax.random.key(0), (1, size, size))
  a = a @ jnp.swapaxes(a, 1, 2)
  eigh = jax.jit(lambda x: jnp.linalg.eigh(x)[1])
  jax.block_until_ready(eigh(a))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(eigh(a))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def measure(width: int, rounds: int, refresh: bool = True) -> list[dict]:
  params = _params(width)
  grads = jax.tree.map(lambda x: 1e-2 * jnp.ones_like(x) + 1e-3 * x, params)
  runs = {}
  for name, tx in variants().items():
    if name == 'kron, refresh' and not refresh:
      continue
    p = jax.tree.map(jnp.copy, params)
    state = tx.init(p)
    state_mb = _bytes(state) / 2**20
    step = _step(tx, p)
    p, state = jax.block_until_ready(step(p, state, grads))  # compile
    runs[name] = [step, p, state, state_mb, []]
  for _ in range(rounds):
    for name, run in runs.items():
      step, p, state = run[0], run[1], run[2]
      start = time.perf_counter()
      p, state = jax.block_until_ready(step(p, state, grads))
      run[4].append(time.perf_counter() - start)
      run[1], run[2] = p, state
  adamw = np.asarray(runs['AdamW'][4])
  rows = []
  for name, run in runs.items():
    t = np.asarray(run[4])
    rows.append({'width': width, 'update': name,
                 'ms': 1e3 * float(np.median(t)),
                 'iqr': 1e3 * float(np.subtract(*np.percentile(t, [75, 25]))),
                 'x_adamw': float(np.median(t / adamw)),
                 'state_mb': run[3]})
  if not refresh:
    return rows
  rotate = next(r for r in rows if r['update'] == 'kron, rotate')
  refresh = next(r for r in rows if r['update'] == 'kron, refresh')
  mean_ms = ((EVERY - 1) * rotate['ms'] + refresh['ms']) / EVERY
  rows.append({'width': width, 'update': f'kron, every {EVERY} (mean)',
               'ms': mean_ms, 'iqr': float('nan'),
               'x_adamw': mean_ms / rows[0]['ms'],
               'state_mb': rotate['state_mb']})
  return rows


def table(rows: list[dict]) -> str:
  lines = ['| MLP width | update | ms (IQR) | x AdamW | state MB |',
           '|---|---|---|---|---|']
  for r in rows:
    iqr = '' if np.isnan(r['iqr']) else f' ({r["iqr"]:.3g})'
    lines.append(f'| {r["width"]} | {r["update"]} | {r["ms"]:.3g}{iqr} | '
                 f'{r["x_adamw"]:.2f} | {r["state_mb"]:.1f} |')
  return '\n'.join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument('--widths', default='128,1024,4096',
                      help='hidden widths of the MLP 784 -> W x 4 -> 10')
  parser.add_argument('--rounds', type=int, default=9,
                      help='interleaved rounds per width')
  parser.add_argument('--refresh-up-to', type=int, default=1024,
                      help='time the refreshing step up to this width; '
                      'above it, one eigendecomposition of a W x W factor '
                      'is timed instead')
  args = parser.parse_args()
  rows, eighs = [], {}
  for width in (int(w) for w in args.widths.split(',')):
    refresh = width <= args.refresh_up_to
    rows += measure(width, args.rounds, refresh)
    if not refresh:
      eighs[width] = eigh_seconds(width)
  print(f'jax {jax.__version__} on {jax.default_backend()}, '
        f'{jax.device_count()} device(s)\n')
  print(table(rows))
  for width, seconds in eighs.items():
    print(f'\nOne eigendecomposition of a {width} x {width} factor: '
          f'{seconds:.2f} s (a refresh at width {width} does one per side '
          'of each matrix longer than 10).')


if __name__ == '__main__':
  main()
