"""Train a centered MLP on MNIST with the recommended recipe, Flax NNX.

  python examples/mnist_nnx.py [--data-dir DIR] [--epochs 3] [--checkpoint-dir DIR]
  python examples/mnist_nnx.py --optimizer cbp   # Algorithm 1 (full CBP)

Every Dense layer is wrapped in ``cbp_optax.nnx.Centered`` (M2); the optimizer
is the recommended recipe's, ``cbp_optax.recommended`` (schedule-free CBP M3,
warmed up over the first 10% of the steps and evaluated at schedule-free's
evaluation point, ``cbp_optax.nnx.eval_model``), or with
``--optimizer cbp`` Algorithm 1's ``cbp_optax.cbp`` (M1 + M3);
``cbp_optax.nnx.train_step`` fuses forward, backward, update, mean refresh and
bias transport into one ``nnx.jit`` step. With ``--checkpoint-dir`` the state
of the model and the optimizer is saved after every epoch with Orbax's
``CheckpointManager`` and a rerun resumes from the latest epoch (see
docs/checkpointing.md).

Which optimizer: the workload suite's answer, with its scores and intervals, is
in the README and docs/reproduction/workloads.md.
"""

import argparse
import os

import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tqdm import tqdm

import cbp_optax as cbp
from cbp_optax_experiments import datasets


class MLP(nnx.Module):

  def __init__(self, rngs: nnx.Rngs, width: int = 256, depth: int = 2):
    sizes = [784] + [width] * depth + [10]
    self.layers = nnx.List([
        cbp.nnx.Centered(nnx.Linear(a, b, rngs=rngs))
        for a, b in zip(sizes, sizes[1:])
    ])

  def __call__(self, x):
    x = x.reshape(x.shape[0], -1)
    for layer in self.layers[:-1]:
      x = nnx.relu(layer(x))
    return self.layers[-1](x)


def loss_fn(model, images, labels):
  logits = model(images)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  return loss, {'accuracy': jnp.mean(jnp.argmax(logits, -1) == labels)}


@nnx.jit
def predict(model, images):
  return jnp.argmax(model(images), -1)


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
  parser.add_argument('--checkpoint-dir', default=None,
                      help='save after every epoch; resume from the latest')
  args = parser.parse_args()

  data = datasets.find_mnist(args.data_dir, bundled=True)
  print(f'data: {data.source}')
  if not 1 <= args.batch_size <= len(data.train_labels):
    parser.error(f'--batch-size {args.batch_size} must be between 1 and the '
                 f'{len(data.train_labels):,} training images')

  def build():
    model = MLP(nnx.Rngs(args.seed))
    if args.optimizer == 'recommended':
      steps = args.epochs * (len(data.train_labels) // args.batch_size)
      tx = cbp.recommended(args.learning_rate,
                           warmup_steps=max(1, steps // 10))
    else:
      tx = cbp.cbp(args.learning_rate)
    return model, cbp.nnx.Optimizer(model, tx)

  step = cbp.nnx.train_step(loss_fn)
  first_epoch = 0
  manager = None
  if args.checkpoint_dir:
    manager = ocp.CheckpointManager(os.path.abspath(args.checkpoint_dir))
    first_epoch = manager.latest_step() or 0
  if first_epoch:
    # Restore into the abstract state of a fresh pair (nothing initialized).
    graphdef, abstract = nnx.split(nnx.eval_shape(build))
    restored = manager.restore(first_epoch,
                               args=ocp.args.StandardRestore(abstract))
    model, optimizer = nnx.merge(graphdef, restored)
    print(f'resumed from epoch {first_epoch} in {args.checkpoint_dir}')
  else:
    model, optimizer = build()
  steps_per_epoch = len(data.train_labels) // args.batch_size
  for epoch in range(first_epoch, args.epochs):
    # The data order depends on (seed, epoch) alone, so a resumed run sees
    # the same batches as an uninterrupted one.
    order = np.random.default_rng([args.seed, epoch]).permutation(
        len(data.train_labels))
    bar = tqdm(range(steps_per_epoch), desc=f'epoch {epoch + 1}')
    for i in bar:
      idx = order[i * args.batch_size:(i + 1) * args.batch_size]
      out = step(model, optimizer, data.train_images[idx],
                 data.train_labels[idx])
      if i % 10 == 0:
        bar.set_postfix(loss=f'{float(out.loss):.4f}',
                        skipped=bool(out.skipped))
    # A copy in eval mode, at schedule-free's evaluation point if any.
    evaluated = cbp.nnx.eval_model(model, optimizer)
    accuracy = np.mean(np.asarray(predict(evaluated, data.test_images))
                       == data.test_labels)
    print(f'epoch {epoch + 1}: train loss {float(out.loss):.4f}, '
          f'test accuracy {accuracy:.4f}, skipped steps '
          f'{int(optimizer.skipped_steps[...])}')
    if manager:
      manager.save(epoch + 1, args=ocp.args.StandardSave(
          nnx.state((model, optimizer))))
  if manager:
    manager.wait_until_finished()
    manager.close()


if __name__ == '__main__':
  main()
