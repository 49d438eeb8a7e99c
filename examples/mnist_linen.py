"""Train a centered MLP on MNIST with the recommended recipe, Flax Linen.

  python examples/mnist_linen.py [--data-dir DIR] [--epochs 3]
  python examples/mnist_linen.py --optimizer cbp   # Algorithm 1 (full CBP)

Every Dense layer is wrapped in ``cbp_optax.linen.Centered`` (M2), whose means
live in the ``'centering'`` collection; the optimizer is the recommended
recipe's, ``cbp_optax.recommended`` (schedule-free CBP M3, warmed up over the
first 10% of the steps and evaluated at schedule-free's evaluation point,
``cbp_optax.linen.eval_params``), or with ``--optimizer cbp``
Algorithm 1's ``cbp_optax.cbp`` (M1 + M3); ``cbp_optax.linen.train_step``
fuses the whole iteration into one ``jax.jit`` step, including the pure
``cbp_optax.linen.transport``.

Which optimizer: the workload suite's answer, with its scores and intervals, is
in the README and docs/reproduction/workloads.md.
"""

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import cbp_optax as cbp
from cbp_optax_experiments import datasets


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
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  return loss, {'accuracy': jnp.mean(jnp.argmax(logits, -1) == labels)}


def main():
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument('--data-dir', default=None,
                      help='MNIST IDX directory; else $CBP_OPTAX_MNIST, '
                      'then the user cache, downloading there if missing, '
                      'then the small subset bundled with the package')
  parser.add_argument('--epochs', type=int, default=3,
                      help='passes over the training set')
  parser.add_argument('--batch-size', type=int, default=256,
                      help='images per step')
  parser.add_argument('--learning-rate', type=float, default=3e-3,
                      help='learning rate')
  parser.add_argument('--optimizer', choices=('recommended', 'cbp'),
                      default='recommended', help='recommended: '
                      'cbp.recommended (schedule-free CBP M3 on the centered '
                      'model); cbp: '
                      'Algorithm 1 (full CBP, M1 + M2 + M3)')
  parser.add_argument('--seed', type=int, default=0,
                      help='seed of the initialization and the batches')
  args = parser.parse_args()

  data = datasets.find_mnist(args.data_dir, bundled=True)
  print(f'data: {data.source}')
  if not 1 <= args.batch_size <= len(data.train_labels):
    parser.error(f'--batch-size {args.batch_size} must be between 1 and the '
                 f'{len(data.train_labels):,} training images')
  model = MLP()
  variables = model.init(jax.random.key(args.seed), data.train_images[:1])
  if args.optimizer == 'recommended':
    steps = args.epochs * (len(data.train_labels) // args.batch_size)
    tx = cbp.recommended(args.learning_rate, warmup_steps=max(1, steps // 10))
  else:
    tx = cbp.cbp(args.learning_rate)
  state = cbp.linen.TrainState.create(
      apply_fn=model.apply, params=variables['params'],
      centering=variables['centering'], tx=tx)
  step = cbp.linen.train_step(loss_fn)

  @jax.jit
  def predict(params, opt_state, centering, images):
    # At schedule-free's evaluation point where the optimizer has one.
    params = cbp.linen.eval_params(params, opt_state)
    logits = model.apply({'params': params, 'centering': centering}, images,
                         train=False)
    return jnp.argmax(logits, -1)

  rng = np.random.default_rng(args.seed)
  steps_per_epoch = len(data.train_labels) // args.batch_size
  for epoch in range(args.epochs):
    order = rng.permutation(len(data.train_labels))
    bar = tqdm(range(steps_per_epoch), desc=f'epoch {epoch + 1}')
    for i in bar:
      idx = order[i * args.batch_size:(i + 1) * args.batch_size]
      state, out = step(state, data.train_images[idx], data.train_labels[idx])
      if i % 10 == 0:
        bar.set_postfix(loss=f'{float(out.loss):.4f}',
                        skipped=bool(out.skipped))
    accuracy = np.mean(np.asarray(predict(state.params, state.opt_state,
                                          state.centering, data.test_images))
                       == data.test_labels)
    print(f'epoch {epoch + 1}: train loss {float(out.loss):.4f}, '
          f'test accuracy {accuracy:.4f}')


if __name__ == '__main__':
  main()
