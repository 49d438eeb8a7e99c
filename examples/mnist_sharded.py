"""Train the centered MNIST MLP with full CBP on a device mesh: data-parallel and FSDP.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
      python examples/mnist_sharded.py [--data-dir DIR] [--epochs 1]

Uses every device present (8 simulated CPU devices with the flag above, or
your accelerators) on a one-axis mesh ``('data',)``:

* ``data``: the batch is split over the devices; parameters, optimizer state
  and centering means are replicated.
* ``fsdp``: the batch is split the same way, and the parameters, both CBP
  moments and the centering means are split over the same axis too
  (``fsdp_sharding`` below, plain JAX); only M1's per-block energies and the
  counters stay replicated.

The train step is the library's own ``cbp_optax.linen.train_step``, unchanged:
under ``jax.jit`` the shardings of its inputs decide the layout and XLA adds
the collectives. Both layouts compute the same CBP iteration as one device
(the centering means are means over the global batch), so the script ends by
comparing their final parameters. It keeps Algorithm 1 (``cbp_optax.cbp``)
rather than the recommended recipe: what it shows is that Algorithm 1 on a
mesh is the same computation as on one device.
"""

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
from tqdm import tqdm

import cbp_optax as cbp
from cbp_optax_experiments import datasets


# Placement helpers, plain JAX and optax (docs/sharding.md gives and tests
# the same code).


def optimizer_sharding(tx, params):
  """The sharding of ``tx.init(params)``: each moment like its parameter,
  the rest (counters, M1's per-block energies) replicated."""
  param_sharding = jax.tree.map(lambda p: p.sharding, params)
  replicated = NamedSharding(jax.tree.leaves(param_sharding)[0].mesh,
                             PartitionSpec())

  def is_masked(x):
    return isinstance(x, optax.MaskedNode)

  return optax.tree_map_params(
      tx, lambda leaf, sharding: leaf if is_masked(leaf) else sharding,
      jax.eval_shape(tx.init, params), param_sharding,
      transform_non_params=lambda _: replicated, is_leaf=is_masked)


def fsdp_sharding(tree, mesh, axis='data'):
  """Each array split over ``axis`` along its largest dimension the axis
  size divides (the last on ties), replicated when none does."""
  size = mesh.shape[axis]

  def rule(leaf):
    shape = np.shape(leaf)
    dims = [d for d in range(len(shape)) if shape[d] % size == 0]
    spec = [None] * len(shape)
    if dims:
      spec[max(dims, key=lambda d: (shape[d], d))] = axis
    return NamedSharding(mesh, PartitionSpec(*spec))

  return jax.tree.map(rule, tree)


class MLP(nn.Module):
  width: int = 256
  depth: int = 2

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = x.reshape(x.shape[0], -1)
    for _ in range(self.depth):
      x = cbp.linen.Centered(nn.Dense(self.width))(
          x, use_running_average=not train)
      x = nn.relu(x)
    return cbp.linen.Centered(nn.Dense(10))(x, use_running_average=not train)


def loss_fn(apply, images, labels):
  logits = apply(images, train=True)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def place(layout, mesh, model, variables, tx):
  """The train state with every array on ``mesh`` as ``layout`` wants it."""
  params, centering = variables['params'], variables['centering']
  if layout == 'fsdp':
    params = jax.device_put(params, fsdp_sharding(params, mesh))
    centering = jax.device_put(
        centering, fsdp_sharding(centering, mesh))
  else:
    replicated = NamedSharding(mesh, PartitionSpec())
    params, centering = jax.device_put((params, centering), replicated)
  # The moments follow their parameters; M1's energies are replicated.
  opt_state = jax.jit(
      tx.init, out_shardings=optimizer_sharding(tx, params)
  )(params)
  return cbp.linen.TrainState(
      step=0, apply_fn=model.apply, params=params, tx=tx,
      opt_state=opt_state, centering=centering)



def train(layout, mesh, data, args):
  model = MLP()
  variables = model.init(jax.random.key(args.seed), data.train_images[:1])
  tx = cbp.cbp(args.learning_rate)
  state = place(layout, mesh, model, variables, tx)
  step = cbp.linen.train_step(loss_fn)

  @jax.jit
  def predict(params, centering, images):
    logits = model.apply({'params': params, 'centering': centering}, images,
                         train=False)
    return jnp.argmax(logits, -1)

  rng = np.random.default_rng(args.seed)
  steps_per_epoch = len(data.train_labels) // args.batch_size
  for epoch in range(args.epochs):
    order = rng.permutation(len(data.train_labels))
    bar = tqdm(range(steps_per_epoch), desc=f'{layout} epoch {epoch + 1}')
    for i in bar:
      idx = order[i * args.batch_size:(i + 1) * args.batch_size]
      # Refuses a batch the data axis does not divide, with the reason.
      # The batch split over 'data' along its first dimension.
      images, labels = jax.device_put(
          (data.train_images[idx], data.train_labels[idx]),
          NamedSharding(mesh, PartitionSpec('data')))
      state, out = step(state, images, labels)
      if i % 10 == 0:
        bar.set_postfix(loss=f'{float(out.loss):.4f}')
  kernel = state.params['Centered_0']['dense']['kernel']
  print(f'{layout}: first kernel {kernel.shape} laid out as '
        f'{kernel.sharding.spec}, {len(kernel.addressable_shards)} shards of '
        f'{kernel.addressable_shards[0].data.shape}')
  accuracy = np.mean(np.asarray(
      predict(state.params, state.centering, data.test_images))
                     == data.test_labels)
  print(f'{layout}: train loss {float(out.loss):.4f}, '
        f'test accuracy {accuracy:.4f}')
  return state, accuracy


def main():
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument('--data-dir', default=None,
                      help='MNIST IDX directory; else $CBP_OPTAX_MNIST, '
                      'then the user cache, downloading there if missing, '
                      'then the small subset bundled with the package')
  parser.add_argument('--epochs', type=int, default=1,
                      help='passes over the training set')
  parser.add_argument('--batch-size', type=int, default=256,
                      help='images per step')
  parser.add_argument('--learning-rate', type=float, default=3e-3,
                      help='learning rate of CBP')
  parser.add_argument('--seed', type=int, default=0,
                      help='seed of the initialization and the batches')
  parser.add_argument('--layouts', default='data,fsdp',
                      help='comma-separated layouts to train, from data, fsdp')
  args = parser.parse_args()

  data = datasets.find_mnist(args.data_dir, bundled=True)
  print(f'data: {data.source}')
  devices = jax.device_count()
  # Auto axes: XLA's partitioner places the collectives (GSPMD).
  mesh = jax.make_mesh((devices,), ('data',), axis_types=(AxisType.Auto,))
  print(f'mesh: {dict(mesh.shape)} over {devices} {jax.devices()[0].platform}'
        ' device(s)')
  finals = {}
  for layout in args.layouts.split(','):
    finals[layout], accuracy = train(layout, mesh, data, args)
  if len(finals) == 2:
    first, second = (jax.device_get(s.params) for s in finals.values())
    worst = max(
        float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
        for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)))
    print(f'data-parallel vs FSDP final parameters: max relative difference '
          f'{worst:.1e} (float32 rounding; the iteration is the same)')
  print(f'test accuracy {accuracy:.4f}')


if __name__ == '__main__':
  main()
