"""Center an unmodified Flax Linen model in one call; train it as the recipe says.

  python examples/center_linen.py [--data-dir DIR] [--steps 250]
  python examples/center_linen.py --optimizer cbp   # centered, Algorithm 1

The default is the recommended recipe: ``cbp_optax.recommended``
(schedule-free CBP M3, warmed up over the first 10% of the steps, evaluated
at schedule-free's evaluation point, ``cbp_optax.linen.eval_params``) on a
model that, having BatchNorm, the recipe leaves plain (``--center`` centers
it anyway). Every other ``--optimizer`` centers the model unless
``--no-center``; ``cbp`` is Algorithm 1 (full CBP).

The model is a plain Linen CNN (conv -> BatchNorm -> relu, dropout) written
without any knowledge of CBP. ``cbp_optax.linen.center(model)`` returns a
model whose ``init`` adds the ``'centering'`` collection and whose ``apply``
centers every Dense and Conv; its parameters are the model's own, at the same
paths. The fused ``cbp_optax.linen.train_step`` carries BatchNorm's
``batch_stats`` in ``TrainState.model_state`` and the dropout key through
``apply``. With the recipe, evaluation reads the parameters at schedule-free's
evaluation point and BatchNorm's running averages as gathered during training
(at the training iterate), as the workload suite does.
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


class CNN(nn.Module):
  """A Linen CNN with BatchNorm and dropout, as the Flax examples write one."""

  @nn.compact
  def __call__(self, x, train: bool):
    pool = lambda x: nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
    for features in (32, 64):
      x = nn.Conv(features, kernel_size=(3, 3))(x)
      x = nn.BatchNorm(use_running_average=not train)(x)
      x = pool(nn.relu(x))
    x = x.reshape(x.shape[0], -1)
    x = nn.Dropout(0.5, deterministic=not train)(nn.relu(nn.Dense(256)(x)))
    return nn.Dense(10)(x)


def loss_fn(apply, images, labels, dropout_key):
  logits = apply(images, train=True, rngs={'dropout': dropout_key})
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def main():
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument('--data-dir', default=None,
                      help='MNIST IDX directory; else $CBP_OPTAX_MNIST, '
                      'then the user cache, downloading if allowed')
  parser.add_argument('--steps', type=int, default=250, help='training steps')
  parser.add_argument('--batch-size', type=int, default=32,
                      help='images per step')
  parser.add_argument('--learning-rate', type=float, default=1e-3,
                      help='learning rate')
  parser.add_argument('--optimizer',
                      choices=('recommended', 'cbp', 'adam', 'adamw'),
                      default='recommended', help='recommended: '
                      'cbp.recommended (schedule-free CBP M3; the recipe leaves '
                      'this BatchNorm model plain, --center centers it); cbp: '
                      'Algorithm 1 (full CBP); adam: Adam + Center; adamw: '
                      'AdamW')
  centering = parser.add_mutually_exclusive_group()
  centering.add_argument('--no-center', action='store_true',
                         help='leave the model as it is')
  centering.add_argument('--center', action='store_true',
                         help='center the model with --optimizer recommended '
                         'too (the others center it unless --no-center)')
  parser.add_argument('--seed', type=int, default=0, help='random seed')
  args = parser.parse_args()

  data = datasets.find_mnist(args.data_dir, bundled=True)
  print(f'data: {data.source}')
  if not 1 <= args.batch_size <= len(data.train_labels):
    parser.error(f'--batch-size {args.batch_size} must be between 1 and the '
                 f'{len(data.train_labels):,} training images')
  images = data.train_images.reshape(-1, 28, 28, 1)
  test_images = data.test_images.reshape(-1, 28, 28, 1)

  center = args.center or (not args.no_center
                           and args.optimizer != 'recommended')
  model = cbp.linen.center(CNN()) if center else CNN()
  key = jax.random.key(args.seed)
  variables = model.init(key, images[:2], train=False)
  if center:
    centered, _ = model.report(key, images[:2], train=False)
    print(f'centered: {", ".join(centered)}')
  tx = {
      'recommended': lambda: cbp.recommended(
          args.learning_rate, warmup_steps=max(1, args.steps // 10)),
      'cbp': lambda: cbp.cbp(args.learning_rate),
      'adam': lambda: optax.adam(args.learning_rate),
      'adamw': lambda: optax.adamw(args.learning_rate),
  }[args.optimizer]()
  state = cbp.linen.TrainState.create(
      apply_fn=model.apply, params=variables['params'],
      centering=variables.get('centering', {}),
      model_state={'batch_stats': variables['batch_stats']}, tx=tx)
  step = cbp.linen.train_step(loss_fn)

  @jax.jit
  def predict(state, images):
    # At schedule-free's evaluation point where the optimizer has one.
    params = cbp.linen.eval_params(state.params, state.opt_state)
    variables = {'params': params, 'centering': state.centering,
                 **state.model_state}
    return jnp.argmax(model.apply(variables, images, train=False), -1)

  order = np.random.default_rng(args.seed).permutation(len(data.train_labels))
  per_epoch = len(order) // args.batch_size
  losses = []
  bar = tqdm(range(args.steps), desc=args.optimizer)
  for i in bar:
    start = (i % per_epoch) * args.batch_size
    idx = order[start:start + args.batch_size]
    state, out = step(state, images[idx], data.train_labels[idx],
                      jax.random.fold_in(key, i))
    losses.append(float(out.loss))
    if i % 10 == 0:
      bar.set_postfix(loss=f'{np.mean(losses[-10:]):.4f}')
  accuracy = np.mean(np.asarray(predict(state, test_images))
                     == data.test_labels)
  print(f'{args.optimizer}{" (centered)" if center else " (plain)"}: mean '
        f'train loss of the last 50 steps {np.mean(losses[-50:]):.4f}, test '
        f'accuracy {accuracy:.4f} (BatchNorm running averages), skipped steps '
        f'{int(state.skipped_steps)}')


if __name__ == '__main__':
  main()
