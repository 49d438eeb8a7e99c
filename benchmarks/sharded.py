"""Step time of the sharded fused CBP step on 1, 2, 4 and 8 devices (issue 6).

Usage::

  python benchmarks/sharded.py                # CPU: 8 simulated devices
  python benchmarks/sharded.py --quick        # smoke run (< 1 min)
  python benchmarks/sharded.py --device gpu   # real accelerators, as many as
                                              # are present (1, 2, 4, 8 of them)

Times ``cbp_optax.linen.train_step`` (forward, backward, full CBP, bias
transport) on the centered MLP of the suite, at a fixed global batch (strong
scaling), on meshes of the first 1, 2, 4 and 8 devices, in two layouts:
data-parallel (state replicated) and FSDP (parameters, moments and centering
means split over the data axis). All configurations live in one process and
are timed interleaved, one step each per round, so slow drifts of the machine
fall on all of them alike; the table gives the median and the interquartile
range per step, and the median per-round ratio to one device.

On CPU the devices are simulated (``--xla_force_host_platform_device_count``)
on however many cores the machine has: on 2 cores, 8 "devices" share 2 cores,
so the table measures the overhead of partitioning and of XLA's collectives,
not a speed-up. Run it with ``--device gpu`` on a machine with several
accelerators for scaling numbers.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

SIMULATED_DEVICES = 8
DEVICE_COUNTS = (1, 2, 4, 8)
LAYOUTS = ('data', 'fsdp')


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--device', choices=('cpu', 'gpu'), default='cpu')
  parser.add_argument('--quick', action='store_true',
                      help='smoke run: width 64, 5 rounds')
  parser.add_argument('--width', type=int, default=256,
                      help='hidden width of the 4-layer centered MLP')
  parser.add_argument('--batch', type=int, default=256,
                      help='global batch (a multiple of 8)')
  parser.add_argument('--rounds', type=int, default=30)
  parser.add_argument('--warmup', type=int, default=3)
  return parser.parse_args(argv)


def configure_environment(args: argparse.Namespace) -> str:
  """Platform and simulated devices; must run before jax is imported."""
  flags = os.environ.get('XLA_FLAGS', '')
  if args.device == 'gpu':
    os.environ.setdefault('JAX_PLATFORMS', 'cuda')
  else:
    os.environ['JAX_PLATFORMS'] = 'cpu'
    if 'xla_force_host_platform_device_count' not in flags:
      flags = (flags + ' --xla_force_host_platform_device_count='
               f'{SIMULATED_DEVICES}').strip()
  os.environ['XLA_FLAGS'] = flags
  return flags


def optimizer_sharding(tx: Any, params: Any) -> Any:
  """The sharding of ``tx.init(params)``: each moment like its parameter,
  the rest (counters, M1's per-block energies) replicated (plain JAX and
  optax, as in docs/sharding.md)."""
  import jax
  import optax
  from jax.sharding import NamedSharding, PartitionSpec

  param_sharding = jax.tree.map(lambda p: p.sharding, params)
  replicated = NamedSharding(jax.tree.leaves(param_sharding)[0].mesh,
                             PartitionSpec())

  def is_masked(x):
    return isinstance(x, optax.MaskedNode)

  return optax.tree_map_params(
      tx, lambda leaf, sharding: leaf if is_masked(leaf) else sharding,
      jax.eval_shape(tx.init, params), param_sharding,
      transform_non_params=lambda _: replicated, is_leaf=is_masked)


def fsdp_sharding(tree: Any, mesh: Any, axis: str = 'data') -> Any:
  """Each array split over ``axis`` along its largest dimension the axis
  size divides (the last on ties), replicated when none does."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec

  size = mesh.shape[axis]

  def rule(leaf):
    shape = np.shape(leaf)
    dims = [d for d in range(len(shape)) if shape[d] % size == 0]
    spec = [None] * len(shape)
    if dims:
      spec[max(dims, key=lambda d: (shape[d], d))] = axis
    return NamedSharding(mesh, PartitionSpec(*spec))

  return jax.tree.map(rule, tree)


def make_runner(devices: int, layout: str, width: int,
                batch: int) -> Callable[[], None]:
  """A compiled sharded step bound to its own state; each call runs one."""
  import jax
  from jax.sharding import AxisType, NamedSharding, PartitionSpec

  import cbp_optax as cbp
  from benchmarks import models
  from benchmarks import steps as steps_lib

  arch = models.mlp(width)
  mesh = jax.make_mesh((devices,), ('data',), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:devices])
  images, labels = models.make_batch(arch, batch)
  model = models.linen_model(arch, centered=True)
  variables = model.init(jax.random.key(0), images)
  params, centering = variables['params'], variables['centering']
  if layout == 'fsdp':
    params = jax.device_put(params, fsdp_sharding(params, mesh))
    centering = jax.device_put(centering, fsdp_sharding(centering, mesh))
  else:
    replicated = NamedSharding(mesh, PartitionSpec())
    params, centering = jax.device_put((params, centering), replicated)
  tx = cbp.cbp(steps_lib.LEARNING_RATE)
  opt_state = jax.jit(
      tx.init, out_shardings=optimizer_sharding(tx, params))(params)
  state = cbp.linen.TrainState(
      step=0, apply_fn=model.apply, params=params, tx=tx,
      opt_state=opt_state, centering=centering)
  batch_arrays = jax.device_put(
      (jax.device_get(images), jax.device_get(labels)),
      NamedSharding(mesh, PartitionSpec('data')))

  def loss_fn(apply, images, labels):
    return steps_lib.cross_entropy(apply(images), labels)

  step = cbp.linen.train_step(loss_fn)
  holder = [state]

  def run() -> None:
    holder[0], out = step(holder[0], *batch_arrays)
    jax.block_until_ready((holder[0], out.loss))

  run()  # Compile outside the timed rounds.
  return run


def table(times: dict[tuple[int, str], list[float]]) -> str:
  import numpy as np

  from benchmarks import timing
  lines = ['| devices | layout | median ms | IQR ms | x 1 device (median of '
           'per-round ratios) |', '|---:|---|---:|---:|---:|']
  for (devices, layout), values in sorted(times.items()):
    stats = timing.quartiles(values)
    reference = times.get((1, layout))
    ratio = ('' if reference is None else
             f'{timing.quartiles(np.asarray(values) / np.asarray(reference))["median"]:.2f}')
    lines.append(f'| {devices} | {layout} | {1e3 * stats["median"]:.2f} | '
                 f'{1e3 * stats["iqr"]:.2f} | {ratio} |')
  return '\n'.join(lines)


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
  args = parse_args(argv)
  if args.quick:
    args.width, args.rounds, args.warmup = 64, 5, 1
  flags = configure_environment(args)
  import jax

  from benchmarks import timing

  available = jax.device_count()
  counts = [n for n in DEVICE_COUNTS if n <= available]
  runners = {(n, layout): make_runner(n, layout, args.width, args.batch)
             for n in counts for layout in LAYOUTS}
  names = {key: f'{key[0]}x{key[1]}' for key in runners}
  steps = {names[key]: run for key, run in runners.items()}
  timing.warm_up(steps, args.warmup)
  timed = timing.interleaved(steps, args.rounds)
  times = {key: timed[names[key]] for key in runners}
  cores = os.cpu_count()
  print(f'# Sharded fused CBP step: MLP-{args.width} (4 centered layers), '
        f'global batch {args.batch}\n')
  print(f'backend {jax.default_backend()}, {available} device(s), '
        f'{cores} CPU cores, XLA_FLAGS="{flags}", {args.rounds} interleaved '
        f'rounds after {args.warmup} warm-up steps each.\n')
  print(table(times))
  if jax.default_backend() == 'cpu':
    print(f'\nNote: the {available} CPU devices are simulated and share '
          f'{cores} cores; these times measure the overhead of partitioning '
          'and collectives, not a speed-up.')
  return {'times': {names[k]: v for k, v in times.items()}}


if __name__ == '__main__':
  main()
