"""Center an unmodified Flax NNX model in one call; train it as the recipe says.

  python examples/center_nnx.py [--data-dir DIR] [--steps 250]
  python examples/center_nnx.py --optimizer cbp   # centered, Algorithm 1

The default is the recommended recipe: ``cbp_optax.recommended``
(schedule-free CBP M3, warmed up over the first 10% of the steps, evaluated
at schedule-free's evaluation point, ``cbp_optax.nnx.eval_model``) on a model
that, having BatchNorm, the recipe leaves plain (``--center`` centers it
anyway). Every other ``--optimizer`` centers the model unless
``--no-center``; ``cbp`` is Algorithm 1 (full CBP).

The model is the Flax NNX MNIST tutorial's CNN (conv -> BatchNorm -> relu,
dropout), written without any knowledge of CBP. ``cbp_optax.nnx.center``
wraps its convolutions and linear layers in place; the fused
``cbp_optax.nnx.train_step`` takes the tutorial's ``nnx.Rngs`` for dropout and
updates BatchNorm's statistics as a plain ``nnx.jit`` step would. Evaluation
uses BatchNorm's running averages, on ``cbp_optax.nnx.eval_model(model,
optimizer)`` (the model itself in eval mode unless the optimizer is
schedule-free). Those running averages were gathered at the training iterate,
not at schedule-free's evaluation point; ``--recalibrate N`` recomputes them
there, as the workload suite does not.
"""

import argparse

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

import cbp_optax as cbp
from cbp_optax_experiments import datasets
from cbp_optax_experiments import recalibrate


class CNN(nnx.Module):
  """The Flax NNX MNIST tutorial's CNN, with BatchNorm and dropout."""

  def __init__(self, *, rngs: nnx.Rngs, momentum: float = 0.99,
               dropout: float = 0.5):
    self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm1 = nnx.BatchNorm(32, momentum=momentum, rngs=rngs)
    self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm2 = nnx.BatchNorm(64, momentum=momentum, rngs=rngs)
    self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
    self.dropout = nnx.Dropout(rate=dropout)
    self.linear2 = nnx.Linear(256, 10, rngs=rngs)

  def __call__(self, x, rngs: nnx.Rngs | None = None):
    pool = lambda x: nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
    x = pool(nnx.relu(self.batch_norm1(self.conv1(x))))
    x = pool(nnx.relu(self.batch_norm2(self.conv2(x))))
    x = x.reshape(x.shape[0], -1)
    x = self.dropout(nnx.relu(self.linear1(x)), rngs=rngs)
    return self.linear2(x)


def loss_fn(model, images, labels, rngs):
  logits = model(images, rngs)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@nnx.jit
def predict(model, images):
  return jnp.argmax(model(images), -1)


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
                      help='peak learning rate')
  parser.add_argument('--optimizer',
                      choices=('recommended', 'cbp', 'cbp_robust', 'adam',
                               'adamw'),
                      default='recommended', help='recommended: '
                      'cbp.recommended (schedule-free CBP M3; the recipe leaves '
                      'this BatchNorm model plain, --center centers it); cbp: '
                      'Algorithm 1 '
                      '(full CBP); cbp_robust; adam: Adam + Center; adamw: '
                      'the tutorial\'s AdamW')
  centering = parser.add_mutually_exclusive_group()
  centering.add_argument('--no-center', action='store_true',
                         help='leave the model as it is')
  centering.add_argument('--center', action='store_true',
                         help='center the model with --optimizer recommended '
                         'too (the others center it unless --no-center)')
  parser.add_argument('--batchnorm-momentum', type=float, default=0.99,
                      help='momentum of BatchNorm\'s running averages')
  parser.add_argument('--dropout', type=float, default=0.5,
                      help='dropout rate after the first Linear layer')
  parser.add_argument('--recalibrate', type=int, default=0,
                      help='after training, recompute BatchNorm\'s running '
                      'averages over this many training batches '
                      '(cbp_optax_experiments.recalibrate.nnx_batch_stats) '
                      'and evaluate again; 0: off')
  parser.add_argument('--seed', type=int, default=0, help='random seed')
  args = parser.parse_args()

  data = datasets.find_mnist(args.data_dir, bundled=True)
  print(f'data: {data.source}')
  if not 1 <= args.batch_size <= len(data.train_labels):
    parser.error(f'--batch-size {args.batch_size} must be between 1 and the '
                 f'{len(data.train_labels):,} training images')
  images = data.train_images.reshape(-1, 28, 28, 1)
  test_images = data.test_images.reshape(-1, 28, 28, 1)

  model = CNN(rngs=nnx.Rngs(args.seed), momentum=args.batchnorm_momentum,
              dropout=args.dropout)
  center = args.center or (not args.no_center
                           and args.optimizer != 'recommended')
  if center:
    report = cbp.nnx.center(model)
    print(f'centered: {", ".join(report.centered)}')
    for path, reason in report.skipped:
      print(f'left as is: {path} ({reason.split(":")[0]})')
  tx = {
      'recommended': lambda: cbp.recommended(
          args.learning_rate, warmup_steps=max(1, args.steps // 10)),
      'cbp': lambda: cbp.cbp(args.learning_rate),
      'cbp_robust': lambda: cbp.cbp_robust(args.learning_rate),
      'adam': lambda: optax.adam(args.learning_rate),
      'adamw': lambda: optax.adamw(args.learning_rate),
  }[args.optimizer]()
  optimizer = cbp.nnx.Optimizer(model, tx)
  step = cbp.nnx.train_step(loss_fn)
  rngs = nnx.Rngs(dropout=args.seed + 1)

  order = np.random.default_rng(args.seed).permutation(len(data.train_labels))
  per_epoch = len(order) // args.batch_size
  losses = []
  bar = tqdm(range(args.steps), desc=args.optimizer)
  for i in bar:
    start = (i % per_epoch) * args.batch_size
    idx = order[start:start + args.batch_size]
    out = step(model, optimizer, images[idx], data.train_labels[idx], rngs)
    losses.append(float(out.loss))
    if i % 10 == 0:
      bar.set_postfix(loss=f'{np.mean(losses[-10:]):.4f}')
  # A copy in eval mode, at schedule-free's evaluation point if any.
  evaluated = cbp.nnx.eval_model(model, optimizer)
  accuracy = np.mean(np.asarray(predict(evaluated, test_images))
                     == data.test_labels)
  for norm in (evaluated.batch_norm1, evaluated.batch_norm2):
    norm.use_running_average = False
  batch_accuracy = np.mean(np.asarray(predict(evaluated, test_images))
                           == data.test_labels)
  print(f'{args.optimizer}{" (centered)" if center else " (plain)"}: mean '
        f'train loss of the last 50 steps {np.mean(losses[-50:]):.4f}, test '
        f'accuracy {accuracy:.4f} (BatchNorm running averages; '
        f'{batch_accuracy:.4f} with the test batch statistics), skipped '
        f'steps {int(optimizer.skipped_steps[...])}')
  if args.recalibrate:
    # Precise BatchNorm: population statistics over training batches.
    starts = [(i % per_epoch) * args.batch_size
              for i in range(args.steps, args.steps + args.recalibrate)]
    recalibrate.nnx_batch_stats(
        evaluated, (images[order[s:s + args.batch_size]] for s in starts))
    evaluated.eval()
    recalibrated = np.mean(np.asarray(predict(evaluated, test_images))
                           == data.test_labels)
    print(f'recalibrated over {args.recalibrate} training batches: test '
          f'accuracy {recalibrated:.4f} (BatchNorm running averages)')


if __name__ == '__main__':
  main()
