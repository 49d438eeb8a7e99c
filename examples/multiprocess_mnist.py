"""Train a centered MNIST MLP with full CBP across several JAX processes.

  python examples/multiprocess_mnist.py --processes 2
  python examples/multiprocess_mnist.py --processes 1   # same final loss

Starts ``--processes`` worker processes on this machine (the coordinator on
127.0.0.1) that together hold ``--devices`` simulated CPU devices, exactly as
the hosts of a cluster would: every worker calls
``jax.distributed.initialize``, builds the same model, places it on one mesh
over the devices of *all* processes, and feeds only its own rows of every
global batch (``jax.make_array_from_process_local_data``). The train
step is the library's ``cbp_optax.nnx.train_step``, unchanged: XLA inserts
the cross-process collectives, so the centering means and M1's block
energies are over the global batch. With the same total number of devices
the run is the same computation whatever the number of processes, and the
script prints the same final loss. It keeps Algorithm 1 (``cbp_optax.cbp``)
rather than the recommended recipe: what it shows is that Algorithm 1 across
processes is the same computation as in one.

Data: MNIST from ``--data-dir`` or the default directories
(``cbp_optax_experiments.datasets.find_mnist``: ``$CBP_OPTAX_MNIST``, the
user cache; no download unless ``--download``; else the small subset shipped
with the package), or ``--synthetic`` for random digits-shaped data. Runs offline
either way. On a
real cluster, start one worker per host with your scheduler instead and see
docs/multihost.md.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import time

_WORKER_FLAG = '--worker'
# What the launching process tells each worker (environment variables).
_ENV_COORDINATOR = 'MULTIPROCESS_MNIST_COORDINATOR'
_ENV_PROCESSES = 'MULTIPROCESS_MNIST_PROCESSES'
_ENV_PROCESS_ID = 'MULTIPROCESS_MNIST_PROCESS_ID'


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument('--processes', type=int, default=2,
                      help='worker processes to start')
  parser.add_argument('--devices', type=int, default=4,
                      help='simulated CPU devices in all, split evenly over '
                      'the processes')
  parser.add_argument('--layout', choices=('data', 'fsdp'), default='data',
                      help='data parallel, or parameters/moments/means '
                      'sharded too (FSDP)')
  parser.add_argument('--steps', type=int, default=100,
                      help='training steps')
  parser.add_argument('--batch-size', type=int, default=256,
                      help='global batch size (all processes together)')
  parser.add_argument('--learning-rate', type=float, default=3e-3,
                      help='learning rate of CBP')
  parser.add_argument('--seed', type=int, default=0,
                      help='seed of the initialization and the batches')
  parser.add_argument('--data-dir', default=None,
                      help='MNIST IDX directory; else $CBP_OPTAX_MNIST, '
                      'then the user cache, then the bundled subset')
  parser.add_argument('--download', action='store_true',
                      help='allow downloading MNIST if it is not found')
  parser.add_argument('--synthetic', action='store_true',
                      help='random data instead of MNIST')
  parser.add_argument('--timeout', type=float, default=900.0,
                      help='seconds before the launcher stops all workers')
  parser.add_argument(_WORKER_FLAG, action='store_true',
                      help=argparse.SUPPRESS)
  return parser.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.worker:
    worker(args)
    return 0
  if args.processes < 1 or args.devices % args.processes:
    sys.exit(f'--devices {args.devices} must be a positive multiple of '
             f'--processes {args.processes}.')
  argv = list(sys.argv[1:] if argv is None else argv)
  start = time.perf_counter()
  code = launch_workers([os.path.abspath(__file__), *argv, _WORKER_FLAG],
                        args.processes, args.devices // args.processes,
                        args.timeout)
  if code:
    print(f'multiprocess_mnist: a worker failed (exit status {code})',
          file=sys.stderr)
    return 1
  print(f'{args.processes} process(es) finished in '
        f'{time.perf_counter() - start:.1f} s')
  return 0


def launch_workers(command: list[str], processes: int, devices: int,
                   timeout: float) -> int:
  """Runs ``command`` as ``processes`` workers; the first failure's status.

  Each worker gets ``devices`` simulated CPU devices and, in environment
  variables, the coordinator's address (a free port on 127.0.0.1), the
  number of processes and its index. A worker that fails, or the timeout,
  stops all of them.
  """
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  flags = re.sub(r'--xla_force_host_platform_device_count=\S+', '',
                 os.environ.get('XLA_FLAGS', ''))
  workers = []
  for index in range(processes):
    env = dict(os.environ, JAX_PLATFORMS='cpu', **{
        _ENV_COORDINATOR: f'127.0.0.1:{port}',
        _ENV_PROCESSES: str(processes), _ENV_PROCESS_ID: str(index),
        'XLA_FLAGS': f'{flags} --xla_force_host_platform_device_count='
                     f'{devices}'.strip()})
    workers.append(subprocess.Popen([sys.executable, *command], env=env))
  deadline = time.monotonic() + timeout
  code = 0
  try:
    while any(w.poll() is None for w in workers):
      failed = [w.returncode for w in workers if w.returncode]
      if failed or time.monotonic() > deadline:
        code = failed[0] if failed else 124
        break
      time.sleep(0.1)
    code = code or next((w.returncode for w in workers if w.returncode), 0)
  finally:
    for w in workers:
      if w.poll() is None:
        w.kill()
      w.wait()
  return code


def initialize() -> None:
  """``jax.distributed.initialize`` with what the launching process passed;
  on a cluster, plain ``jax.distributed.initialize()`` instead."""
  import jax  # pylint: disable=g-import-not-at-top

  address = os.environ[_ENV_COORDINATOR]
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(
      coordinator_address=address,
      num_processes=int(os.environ[_ENV_PROCESSES]),
      process_id=int(os.environ[_ENV_PROCESS_ID]),
      coordinator_bind_address=address,
      cluster_detection_method='deactivate')


def worker(args: argparse.Namespace) -> None:
  """One process of the run (what each host of a cluster would execute)."""
  initialize()  # before any other JAX call

  # pylint: disable=g-import-not-at-top
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from flax import nnx
  from jax.sharding import AxisType
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import cbp_optax as cbp
  from cbp_optax_experiments import datasets

  process = jax.process_index()
  log = (lambda *a: print(*a, flush=True)) if process == 0 else (
      lambda *a: None)

  # Data. Every process reads the same arrays here because MNIST is small;
  # what matters is that each one hands over only its own rows below. With
  # a large dataset, read only those rows (e.g. this process's files).
  if args.synthetic:
    rng = np.random.default_rng(1234)
    train_x = rng.random((8192, 28, 28), dtype=np.float32)
    train_y = rng.integers(0, 10, 8192).astype(np.int32)
    test_x, test_y = train_x[:2048], train_y[:2048]
    source = 'synthetic (8,192 random 28x28 images)'
  else:
    try:
      # Offline without a copy of MNIST: the subset shipped with the package.
      data = datasets.find_mnist(args.data_dir, download=args.download,
                                 bundled=True)
    except datasets.DataError as e:
      raise SystemExit(
          f'{e}\nPass --data-dir DIR (or set $CBP_OPTAX_MNIST), --download, '
          'or --synthetic.') from None
    train_x, train_y = data.train_images, data.train_labels
    test_x, test_y = data.test_images, data.test_labels
    source = data.source
  log(f'data: {source}')

  mesh = jax.make_mesh((jax.device_count(),), ('data',),
                       axis_types=(AxisType.Auto,))
  batch_sharding = NamedSharding(mesh, P('data'))

  def process_rows(global_batch):
    """The rows of a global batch that this process's devices hold."""
    index = batch_sharding.addressable_devices_indices_map(
        (global_batch,)).values()
    return slice(min(i[0].start or 0 for i in index),
                 max(global_batch if i[0].stop is None else i[0].stop
                     for i in index))

  def global_batch(local, size):
    """The global batch, from each process's rows of it."""
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(
            batch_sharding, x, (size, *x.shape[1:])), local)

  # This process's rows of every global batch.
  rows = process_rows(args.batch_size)
  print(f'process {process} of {jax.process_count()}: '
        f'{jax.local_device_count()} of {jax.device_count()} devices, global '
        f'batch {args.batch_size}, rows '
        f'{rows.start}:{rows.stop} of each batch',
        flush=True)

  class MLP(nnx.Module):

    def __init__(self, rngs: nnx.Rngs, width: int = 256):
      self.layers = nnx.List([
          cbp.nnx.Centered(nnx.Linear(a, b, rngs=rngs))
          for a, b in ((784, width), (width, width), (width, 10))])

    def __call__(self, x):
      x = x.reshape(x.shape[0], -1)
      for layer in self.layers[:-1]:
        x = nnx.relu(layer(x))
      return self.layers[-1](x)

  def loss_fn(model, images, labels):
    logits = model(images)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, labels).mean()

  # The same initialization on every process, then placed on the mesh.
  model = MLP(nnx.Rngs(args.seed))
  tx = cbp.cbp(args.learning_rate)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  def fsdp(leaf):
    # Split along the largest dimension the devices divide, else replicate.
    shape = np.shape(leaf)
    dims = [d for d in range(len(shape)) if shape[d] % jax.device_count() == 0]
    spec = [None] * len(shape)
    if dims:
      spec[max(dims, key=lambda d: (shape[d], d))] = 'data'
    return NamedSharding(mesh, P(*spec))

  def rule(tree):
    if args.layout == 'fsdp':
      return jax.tree.map(fsdp, tree)
    return jax.tree.map(lambda _: NamedSharding(mesh, P()), tree)

  model_state = nnx.state(model)
  nnx.update(model, jax.device_put(model_state, rule(model_state)))
  optimizer_state = nnx.state(optimizer)
  nnx.update(optimizer, jax.device_put(
      optimizer_state,
      jax.tree.map(lambda _: NamedSharding(mesh, P()), optimizer_state)))
  # The moments follow their parameters (M1's energies stay replicated).
  params = nnx.state(model, nnx.Param)
  derived = optax.tree_map_params(
      tx, lambda _, sharding: sharding, jax.eval_shape(tx.init, params),
      jax.tree.map(lambda p: p.sharding, params),
      transform_non_params=lambda _: NamedSharding(mesh, P()))
  variables = jax.tree.leaves(
      optimizer.opt_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  for variable, target in zip(variables, jax.tree.leaves(derived)):
    variable[...] = jax.device_put(variable[...], target)

  step = cbp.nnx.train_step(loss_fn)
  # The same global order on every process (same seed).
  order_rng = np.random.default_rng(args.seed)
  order = order_rng.permutation(len(train_y))
  position = 0
  start = time.perf_counter()
  for i in range(args.steps):
    if position + args.batch_size > len(order):
      order, position = order_rng.permutation(len(train_y)), 0
    batch = order[position:position + args.batch_size][rows]
    position += args.batch_size
    images, labels = global_batch((train_x[batch], train_y[batch]),
                                  args.batch_size)
    out = step(model, optimizer, images, labels)
    if i % 20 == 0 or i == args.steps - 1:
      log(f'step {i + 1:4d}  loss {float(out.loss):.6f}')

  @nnx.jit
  def correct(model, images, labels):
    return jnp.sum(jnp.argmax(model(images), -1) == labels)

  # Evaluation on as many test images as the devices divide evenly.
  usable = len(test_y) - len(test_y) % jax.device_count()
  test_rows = process_rows(usable)
  images, labels = global_batch(
      (test_x[:usable][test_rows], test_y[:usable][test_rows]), usable)
  model.eval()
  accuracy = float(correct(model, images, labels)) / usable
  log(f'{args.steps} steps in {time.perf_counter() - start:.1f} s; '
      f'test accuracy {accuracy:.4f} on {usable} images')
  log(f'final loss {float(out.loss):.8f}')


if __name__ == '__main__':
  sys.exit(main())
