"""The classic one-hidden-layer MLP on MNIST: SGD, momentum, Adam and CBP.

  python examples/mlp_classic.py [--data-dir DIR] [--epochs 5]

784 -> 128 ReLU -> 10 with He-normal weights and zero biases; the inputs are
standardized by the training split's per-pixel mean and standard deviation;
6,000 training and 2,000 test images. CBP is ``cbp_optax.cbp`` (M1 + M3) on
the same network with every Dense wrapped in ``cbp_optax.linen.Centered``
(M2), trained with the fused ``cbp_optax.linen.train_step``. After training,
``cbp_optax_experiments.diagnostics`` reports how far each layer moved from its
initialization and the top Hessian eigenvalue of the training loss.
It keeps Algorithm 1 rather than the recommended recipe
(``cbp_optax.recommended``): it reproduces the paper's comparison.
"""

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import cbp_optax as cbp
from cbp_optax_experiments import diagnostics
from cbp_optax_experiments import datasets

N_TRAIN, N_TEST, HIDDEN = 6000, 2000, 128


class MLP(nn.Module):
  centered: bool = False

  @nn.compact
  def __call__(self, x, train: bool = True):
    layers = []
    for width in (HIDDEN, 10):
      dense = nn.Dense(width, kernel_init=nn.initializers.he_normal(),
                       bias_init=nn.initializers.zeros)
      layers.append(cbp.linen.Centered(dense) if self.centered else dense)
    if self.centered:
      x = layers[0](x, use_running_average=not train)
      return layers[1](nn.relu(x), use_running_average=not train)
    return layers[1](nn.relu(layers[0](x)))


def load(data_dir):
  # Offline without data, the small subset shipped with the package (fewer
  # than 6,000 / 2,000 images; the printed counts say so).
  data = datasets.find_mnist(data_dir, bundled=True)
  flat = lambda images: images.reshape(len(images), -1)
  train_x, test_x = flat(data.train_images[:N_TRAIN]), flat(
      data.test_images[:N_TEST])
  mean, std = train_x.mean(0), train_x.std(0)
  std = np.where(std > 0, std, 1.0)  # constant border pixels
  standardize = lambda x: ((x - mean) / std).astype(np.float32)
  return (data.source, standardize(train_x),
          data.train_labels[:N_TRAIN].astype(np.int32), standardize(test_x),
          data.test_labels[:N_TEST].astype(np.int32))


def cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def train(name, tx, centered, data, args):
  _, train_x, train_y, test_x, test_y = data
  model = MLP(centered=centered)
  variables = model.init(jax.random.key(args.seed), train_x[:1])
  # A copy: the fused CBP step donates (and so deletes) the state's buffers.
  params0 = jax.tree.map(jnp.array, variables['params'])

  if centered:
    state = cbp.linen.TrainState.create(
        apply_fn=model.apply, params=variables['params'],
        centering=variables['centering'], tx=tx)
    fused = cbp.linen.train_step(
        lambda apply, x, y: (cross_entropy(apply(x, train=True), y), {}))
    step = lambda state, x, y: fused(state, x, y)[0]
    collections = lambda state: {'centering': state.centering}
  else:
    state = (params0, tx.init(params0))

    @jax.jit
    def step(state, x, y):
      params, opt_state = state
      grads = jax.grad(lambda p: cross_entropy(
          model.apply({'params': p}, x), y))(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    collections = lambda state: {}

  params_of = lambda state: state.params if centered else state[0]
  rng = np.random.default_rng(args.seed)
  n_train = len(train_y)
  steps_per_epoch = n_train // args.batch_size
  for _ in range(args.epochs):
    order = rng.permutation(n_train)
    for i in range(steps_per_epoch):
      idx = order[i * args.batch_size:(i + 1) * args.batch_size]
      state = step(state, train_x[idx], train_y[idx])

  params = params_of(state)
  apply = lambda p, x: model.apply({'params': p, **collections(state)}, x,
                                   train=False)
  accuracy = float(jnp.mean(jnp.argmax(apply(params, test_x), -1) == test_y))
  train_loss = float(cross_entropy(apply(params, train_x), train_y))
  movement = diagnostics.parameter_movement(params, params0)
  sharpness = diagnostics.top_eigenvalue(
      lambda p: cross_entropy(apply(p, train_x[:1000]), train_y[:1000]),
      params, jax.random.key(args.seed), num_iters=30)
  return [name, f'{train_loss:.4f}', f'{accuracy:.4f}',
          ' / '.join(f'{r:.3f}' for r in np.asarray(movement.relative)),
          f'{float(sharpness.eigenvalue):.2f}']


def main():
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument('--data-dir', default=None,
                      help='MNIST IDX directory; else $CBP_OPTAX_MNIST, '
                      'then the user cache, downloading there if missing, '
                      'then the small subset bundled with the package')
  parser.add_argument('--epochs', type=int, default=5,
                      help='passes over the training set')
  parser.add_argument('--batch-size', type=int, default=64,
                      help='images per step')
  parser.add_argument('--seed', type=int, default=0,
                      help='seed of the initialization and the batches')
  args = parser.parse_args()
  data = load(args.data_dir)
  print(f'data: {data[0]}; {len(data[2]):,} training / {len(data[4]):,} '
        'test images, standardized by the training mean and sd')
  runs = [('SGD (lr 0.05)', optax.sgd(0.05), False),
          ('SGD + momentum 0.9 (lr 0.005)', optax.sgd(0.005, 0.9), False),
          ('Adam (lr 1e-3)', optax.adam(1e-3), False),
          ('CBP (lr 1e-3, centered)', cbp.cbp(1e-3), True)]
  rows = [train(name, tx, centered, data, args)
          for name, tx, centered in runs]
  header = ['optimizer', 'train loss', 'test accuracy',
            'movement hidden / output', 'top Hessian eigenvalue']
  print('| ' + ' | '.join(header) + ' |')
  print('|' + '---|' * len(header))
  for row in rows:
    print('| ' + ' | '.join(row) + ' |')


if __name__ == '__main__':
  main()
