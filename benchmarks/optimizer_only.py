"""Optimizer-only time (gradients given) beside its memory-traffic bound.

Each variant is one donated ``jax.jit`` of an optimizer update applied to the
parameters; the gradients are fixed inputs. The bound divides the bytes a
perfectly fused update must move by the copy bandwidth of this machine,
measured with a large array copy.

Bytes per step, P = parameters, 4-byte floats:
* Adam: read g, p, m, v; write p, m, v -> 7P.
* CBP M1+M3: one more read of g for the block norms (eq. 5) -> 8P.
* Transport (M2, eq. 10): read every kernel once (W (mu_new - mu_old)), read
  and write the biases, read mu and the recorded mean, write mu.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import cbp_optax as cbp
from benchmarks import hlo_copies
from benchmarks import models
from benchmarks import steps as steps_lib
from benchmarks import timing

COPY_BYTES = 256 * 2**20


def copy_bandwidth(repeats: int = 20, nbytes: int = COPY_BYTES) -> dict:
  """Bytes per second of a jitted copy of a large float32 array.

  A streaming pass reads and writes every byte once, so it moves
  ``2 * nbytes``. It is ``x + 1`` written back into the donated input (``x +
  0`` would be simplified away), the access pattern of an in-place optimizer
  update; a copy into a fresh buffer would also time the page faults of a
  new allocation.
  """
  x = jnp.ones((nbytes // 4,), jnp.float32)
  stream = jax.jit(lambda a: a + jnp.float32(1.0), donate_argnums=0)
  x = jax.block_until_ready(stream(x))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    x = jax.block_until_ready(stream(x))
    times.append(time.perf_counter() - start)
  seconds = float(np.median(times))
  return {'bytes': 2 * nbytes, 'seconds': seconds,
          'bytes_per_s': 2 * nbytes / seconds}


def _random_like(tree: Any, seed: int) -> Any:
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(treedef, [
      jax.random.normal(k, jnp.shape(x), jnp.float32) * 1e-2
      for k, x in zip(keys, leaves)])


def _transport_bytes(params: Any, centering: Any) -> int:
  kernels = sum(np.size(x) for x in jax.tree.leaves(params) if np.ndim(x) >= 2)
  biases = sum(np.size(x) for x in jax.tree.leaves(params) if np.ndim(x) == 1)
  means = sum(np.size(x) for x in jax.tree.leaves(centering)) // 2
  return 4 * (kernels + 2 * biases + 3 * means)


def _bound_runner(fn: Callable, args: tuple, donate: tuple[int, ...],
                  options=None) -> tuple[Callable[[], None], str]:
  """A compiled, donated update bound to its own copy of ``args``."""
  args = jax.tree.map(jnp.copy, args)
  compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile(options)
  holder = list(args)

  def run() -> None:
    outs = compiled(*holder)
    for i, out in zip(donate, outs):
      holder[i] = out
    jax.block_until_ready(outs)

  return run, compiled.as_text()


def optimizer_runners(
    arch: models.Arch, region_analysis: bool = True
) -> tuple[dict, dict, dict]:
  """``{name: run}``, ``{name: bytes moved}``, ``{name: hlo}`` for one arch.

  ``region_analysis`` adds the variants compiled with the CPU copy-insertion
  option (meaningless on other backends).
  """
  images, _ = models.make_batch(arch, 2)
  variables = models.linen_model(arch, centered=True).init(
      jax.random.key(0), images)
  params = variables['params']
  centering = _with_recorded_means(variables['centering'])
  grads = _random_like(params, seed=1)
  n = models.count_params(params)
  adam, cbp_tx = optax.adam(1e-3), cbp.cbp(1e-3)

  def update(tx):
    def fn(p, s, g):
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s
    return fn

  def update_and_transport(p, s, c, g):
    u, s = cbp_tx.update(g, s, p)
    p, c = cbp.linen.transport(optax.apply_updates(p, u), c)
    return p, s, c

  transport_bytes = _transport_bytes(params, centering)
  specs = {
      'Adam': (update(adam), (params, adam.init(params), grads), (0, 1),
               None, 7 * 4 * n),
      'CBP M1+M3': (update(cbp_tx), (params, cbp_tx.init(params), grads),
                    (0, 1), None, 8 * 4 * n),
      'CBP M1+M3 (RA)': (update(cbp_tx), (params, cbp_tx.init(params), grads),
                         (0, 1), steps_lib.REGION_ANALYSIS, 8 * 4 * n),
      'Transport': (cbp.linen.transport, (params, centering), (0, 1), None,
                    transport_bytes),
      'CBP M1+M3+transport': (
          update_and_transport,
          (params, cbp_tx.init(params), centering, grads), (0, 1, 2), None,
          8 * 4 * n + transport_bytes),
      'CBP M1+M3+transport (RA)': (
          update_and_transport,
          (params, cbp_tx.init(params), centering, grads), (0, 1, 2),
          steps_lib.REGION_ANALYSIS, 8 * 4 * n + transport_bytes),
  }
  runs, traffic, hlos = {}, {}, {}
  for name, (fn, args, donate, options, nbytes) in specs.items():
    if options and not region_analysis:
      continue
    runs[name], hlos[name] = _bound_runner(fn, args, donate, options)
    traffic[name] = nbytes
  return runs, traffic, hlos


def _with_recorded_means(centering: Any) -> Any:
  """Non-zero recorded means, so the transport moves every bias."""
  return jax.tree.map(lambda x: x + 0.25, centering)


def run(arch: models.Arch, rounds: int, warmup: int, bandwidth: dict,
        region_analysis: bool = True) -> dict:
  """Times the optimizer-only variants of ``arch``, interleaved."""
  runs, traffic, hlos = optimizer_runners(arch, region_analysis)
  warm = timing.warm_up(runs, warmup)
  rounds, reduced = timing.rounds_for(warm, rounds, max(10, rounds // 3))
  times = timing.interleaved(runs, rounds)
  ratios = timing.pairwise_ratios(times, 'Adam')
  rows = {}
  for name in runs:
    bound_s = traffic[name] / bandwidth['bytes_per_s']
    stats = timing.quartiles(times[name])
    found = hlo_copies.copies(hlos[name])
    rows[name] = {
        'time': stats,
        'ratio_to_adam': ratios.get(name),
        'bytes_moved': traffic[name],
        'bound_s': bound_s,
        'bound_ratio_to_adam': traffic[name] / traffic['Adam'],
        'measured_over_bound': stats['median'] / bound_s,
        'copies': hlo_copies.summary(found, min_elements=1024),
    }
  return {'arch': arch.name, 'rounds': rounds, 'reduced_rounds': reduced,
          'rows': rows}
