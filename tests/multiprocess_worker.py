"""One process of a multi-process CBP run; started by tests/test_multiprocess.py.

  python -m tests.launch --processes 2 --cpu-devices 2 -- \\
      tests/multiprocess_worker.py --framework nnx --out run.npz

Every process builds the same centered MLP, places it on a mesh over the
devices of *all* processes, and feeds only its own rows of every batch
(``process_rows`` + ``shard_process_batch`` of docs/sharding.md, plain
JAX). Process 0
writes the final parameters, optimizer state, centering means and losses,
gathered from all processes, to ``--out`` (an ``.npz``). Optionally the run
saves a checkpoint with Orbax after ``--save-at`` steps, resumes from
``--restore``, or
has process ``--die-process`` exit abruptly after ``--die-at`` steps.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from typing import Optional

from tests import launch

if __name__ == '__main__':
  # Before any other JAX call. Without the launcher: one ordinary process.
  launch.initialize_from_env()

# pylint: disable=g-import-not-at-top,wrong-import-position
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cbp_optax as cbp
from tests.doc_code import run_page

# The placement helpers of docs/sharding.md (plain JAX and optax).
sharding = run_page('sharding.md', definitions_only=True)

WIDTHS = (16, 64, 32, 8)
BATCH = 16
DECAY = 0.9
LR = 1e-3
HPARAMS = dict(b1=0.9, b2=0.99, damping=1e-3, decay=0.95)


def batches(steps: int, dtype) -> list[tuple[np.ndarray, np.ndarray]]:
  """The same global batches on every process (off-center inputs)."""
  rng = np.random.default_rng(0)
  return [((rng.standard_normal((BATCH, WIDTHS[0])) + 1.5).astype(dtype),
           rng.integers(0, WIDTHS[-1], BATCH).astype(np.int32))
          for _ in range(steps)]


def cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


class NnxMLP(nnx.Module):
  """A centered MLP (NNX)."""

  def __init__(self, rngs: nnx.Rngs, dtype):
    self.layers = nnx.List([
        cbp.nnx.Centered(nnx.Linear(a, b, param_dtype=dtype, rngs=rngs))
        for a, b in zip(WIDTHS[:-1], WIDTHS[1:])])

  def __call__(self, x):
    for layer in self.layers[:-1]:
      x = nnx.relu(layer(x))
    return self.layers[-1](x)


class LinenMLP(nn.Module):
  """The same centered MLP (Linen)."""

  dtype: object = jnp.float32

  @nn.compact
  def __call__(self, x):
    for i, width in enumerate(WIDTHS[1:]):
      x = cbp.linen.Centered(nn.Dense(width, param_dtype=self.dtype))(x)
      if i < len(WIDTHS) - 2:
        x = nn.relu(x)
    return x


def placement(mesh, tree, layout: str):
  if layout == 'fsdp':
    return sharding.fsdp_sharding(tree, mesh, 'data')
  return jax.tree.map(lambda _: NamedSharding(mesh, P()), tree)


class NnxRun:
  """Model, optimizer and step of the NNX run, placed on ``mesh``."""

  def __init__(self, mesh, layout: str, dtype):
    self.model = NnxMLP(nnx.Rngs(0), dtype)
    tx = cbp.cbp(LR, **HPARAMS)
    self.optimizer = nnx.Optimizer(self.model, tx, wrt=nnx.Param)
    model_state = nnx.state(self.model)
    nnx.update(self.model, jax.device_put(
        model_state, placement(mesh, model_state, layout)))
    # Every leaf on the mesh, counters included (replicated): a checkpoint
    # is restored onto the shardings of the state it is restored into.
    optimizer_state = nnx.state(self.optimizer)
    nnx.update(self.optimizer, jax.device_put(
        optimizer_state, placement(mesh, optimizer_state, 'data')))
    # The moments follow their parameters, M1's energies are replicated.
    derived = sharding.optimizer_sharding(tx, nnx.state(self.model, nnx.Param))
    variables = jax.tree.leaves(
        self.optimizer.opt_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    for variable, target in zip(variables, jax.tree.leaves(derived)):
      variable[...] = jax.device_put(variable[...], target)
    self.step_fn = cbp.nnx.train_step(
        lambda m, x, y: cross_entropy(m(x), y), mean_decay=DECAY)

  def step(self, x, y) -> float:
    out = self.step_fn(self.model, self.optimizer, x, y)
    assert not bool(out.skipped)
    return float(out.loss)  # replicated: every process holds it

  def state(self):
    return nnx.state((self.model, self.optimizer))

  def load(self, state) -> None:
    nnx.update((self.model, self.optimizer), state)

  def results(self):
    return {
        'params': nnx.as_pure(nnx.state(self.model, nnx.Param)),
        'opt_state': nnx.as_pure(nnx.state(self.optimizer.opt_state)),
        'means': nnx.as_pure(nnx.state(self.model, nnx.BatchStat)),
    }


class LinenRun:
  """Train state and step of the Linen run, placed on ``mesh``."""

  def __init__(self, mesh, layout: str, dtype):
    model = LinenMLP(dtype)
    variables = model.init(jax.random.key(0), jnp.zeros((1, WIDTHS[0]), dtype))
    params, centering = variables['params'], variables['centering']
    params = jax.device_put(params, placement(mesh, params, layout))
    centering = jax.device_put(centering, placement(mesh, centering, layout))
    tx = cbp.cbp(LR, **HPARAMS)
    opt_state = jax.jit(
        tx.init, out_shardings=sharding.optimizer_sharding(tx, params))(params)
    state = cbp.linen.TrainState(
        step=0, apply_fn=model.apply, params=params, tx=tx,
        opt_state=opt_state, centering=centering)
    # The counters (step, skipped steps) replicated on the mesh too: a
    # checkpoint is restored onto the shardings of the state it is restored
    # into.
    replicated = NamedSharding(mesh, P())
    self.train_state = jax.tree.map(
        lambda x: x if isinstance(getattr(x, 'sharding', None), NamedSharding)
        else jax.device_put(jnp.asarray(x), replicated), state)
    self.step_fn = cbp.linen.train_step(
        lambda apply, x, y: cross_entropy(apply(x), y), mean_decay=DECAY)

  def step(self, x, y) -> float:
    self.train_state, out = self.step_fn(self.train_state, x, y)
    assert not bool(out.skipped)
    return float(out.loss)  # replicated: every process holds it

  def state(self):
    return self.train_state

  def load(self, state) -> None:
    self.train_state = state

  def results(self):
    return {'params': self.train_state.params,
            'opt_state': self.train_state.opt_state,
            'means': self.train_state.centering}


def listening_addresses() -> Optional[list[str]]:
  """Addresses this process listens on (TCP), from /proc; None off Linux."""
  try:
    inodes = set()
    for fd in os.listdir('/proc/self/fd'):
      try:
        target = os.readlink(f'/proc/self/fd/{fd}')
      except OSError:
        continue
      if target.startswith('socket:['):
        inodes.add(target[len('socket:['):-1])
    addresses = []
    for table in ('/proc/self/net/tcp', '/proc/self/net/tcp6'):
      if not os.path.exists(table):
        continue
      with open(table) as f:
        rows = [line.split() for line in f.readlines()[1:]]
      for row in rows:
        local, state, inode = row[1], row[3], row[9]
        if state != '0A' or inode not in inodes:  # 0A: LISTEN
          continue
        host, port = local.split(':')
        # /proc prints each 32-bit word in host (little-endian) order.
        raw = b''.join(bytes.fromhex(host[i:i + 8])[::-1]
                       for i in range(0, len(host), 8))
        address = ipaddress.ip_address(raw)
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
          address = address.ipv4_mapped
        addresses.append(f'{address}:{int(port, 16)}')
    return addresses
  except OSError:
    return None


def check_coordinator_on_loopback() -> None:
  """The coordinator's port, where this process listens on it, is bound to
  the loopback address only (gloo's own sockets listen on the address the
  host name resolves to: JAX has no public setting for it)."""
  addresses = listening_addresses()
  if addresses is None:
    print('listening sockets: not checked (no /proc)', flush=True)
    return
  print(f'listening on {sorted(addresses)}', flush=True)
  port = os.environ.get(launch.ENV_COORDINATOR, '').rpartition(':')[2]
  for entry in addresses:
    host, _, entry_port = entry.rpartition(':')
    if entry_port == port:
      assert ipaddress.ip_address(host).is_loopback, entry


def abstract(state):
  """Orbax's restore target: every array's shape, dtype and sharding."""
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      state)


def flatten(tree, prefix: str) -> dict[str, np.ndarray]:
  # Gather every global array whole (collective: all processes call it).
  tree = multihost_utils.process_allgather(tree, tiled=True)
  return {prefix + jax.tree_util.keystr(path): np.asarray(leaf)
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--framework', choices=('nnx', 'linen'), default='nnx')
  parser.add_argument('--layout', choices=('data', 'fsdp'), default='data')
  parser.add_argument(
      '--mesh', choices=('data', 'model_data'), default='data',
      help="data: one axis over all devices; model_data: (model=2, data) "
      "with 'model' across the processes, so every process holds all of "
      "'data' and feeds the whole batch")
  parser.add_argument('--dtype', choices=('float32', 'float64'),
                      default='float64')
  parser.add_argument('--steps', type=int, default=10)
  parser.add_argument('--out', default=None)
  parser.add_argument('--save-at', type=int, default=None)
  parser.add_argument('--save-dir', default=None)
  parser.add_argument('--restore', default=None)
  parser.add_argument('--start', type=int, default=0)
  parser.add_argument('--die-at', type=int, default=None)
  parser.add_argument('--die-process', type=int, default=1)
  args = parser.parse_args(argv)

  if args.dtype == 'float64':
    jax.config.update('jax_enable_x64', True)
  dtype = np.dtype(args.dtype)
  process, processes = jax.process_index(), jax.process_count()
  if args.mesh == 'data':
    mesh = jax.make_mesh((jax.device_count(),), ('data',),
                         axis_types=(AxisType.Auto,))
  else:
    # jax.make_mesh puts the processes along the first axis.
    mesh = jax.make_mesh((2, jax.device_count() // 2), ('model', 'data'),
                         axis_types=(AxisType.Auto,) * 2)
  print(f'process {process} of {processes}: {jax.local_device_count()} local '
        f'of {jax.device_count()} devices, mesh {dict(mesh.shape)}', flush=True)
  run = (NnxRun if args.framework == 'nnx' else LinenRun)(
      mesh, args.layout, dtype)
  if args.restore:
    with ocp.StandardCheckpointer() as checkpointer:
      run.load(checkpointer.restore(os.path.abspath(args.restore),
                                    abstract(run.state())))
    print(f'restored {args.restore} (step {args.start})', flush=True)

  data = batches(args.steps, dtype)
  rows = sharding.process_rows(BATCH, mesh, 'data')
  # With jax.make_mesh, process p of N feeds the p-th of N equal parts.
  if args.mesh == 'data':
    part = BATCH // processes
    assert rows == slice(process * part, (process + 1) * part), rows
  else:
    assert rows == slice(0, BATCH), rows
  losses = []
  for i in range(args.start, args.steps):
    x, y = data[i]
    # Each process hands over only its own rows of the global batch.
    x, y = sharding.shard_process_batch((x[rows], y[rows]), BATCH, mesh,
                                        'data')
    losses.append(run.step(x, y))
    if i == args.start:
      # After a step, gloo's connections and the coordinator are all up.
      check_coordinator_on_loopback()
    if args.die_at is not None and i + 1 == args.die_at and (
        process == args.die_process):
      print(f'process {process}: dying on purpose after step {i + 1}',
            flush=True)
      os._exit(7)  # pylint: disable=protected-access
    if args.save_at is not None and i + 1 == args.save_at:
      with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.abspath(args.save_dir), run.state())
      print(f'saved {args.save_dir} after step {i + 1}', flush=True)

  results = {}
  for name, tree in run.results().items():
    results.update(flatten(tree, name))
  results['losses'] = np.asarray(losses)
  if process == 0 and args.out:
    np.savez(args.out, **results)
    print(f'wrote {args.out}: final loss {float(losses[-1]):.17g}', flush=True)


if __name__ == '__main__':
  main()
  sys.stdout.flush()
