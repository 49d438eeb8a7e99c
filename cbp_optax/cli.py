"""``cbp-optax``: the command-line entry point.

``cbp-optax compare`` trains the paper's MNIST MLP (§6.6: 4 hidden layers of
width 256, batch 256) with optax.adam, Adam + Center and full CBP side by side
and prints a comparison table.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import cbp_optax as cbp
from cbp_optax import datasets
from cbp_optax import nnx as cbp_nnx
from cbp_optax.reproduce import cli as reproduce_cli


class MLP(nnx.Module):
  """784 -> width x depth (ReLU) -> 10, every Dense optionally centered."""

  def __init__(self, *, width: int, depth: int, centered: bool,
               rngs: nnx.Rngs):
    wrap = cbp_nnx.Centered if centered else (lambda layer: layer)
    sizes = [784] + [width] * depth + [10]
    self.layers = nnx.List([
        wrap(nnx.Linear(a, b, rngs=rngs)) for a, b in zip(sizes, sizes[1:])
    ])

  def __call__(self, x):
    x = jnp.reshape(x, (x.shape[0], -1))
    for layer in self.layers[:-1]:
      x = nnx.relu(layer(x))
    return self.layers[-1](x)


def _loss_fn(model, images, labels):
  logits = model(images)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  return loss, {'accuracy': jnp.mean(jnp.argmax(logits, -1) == labels)}


@nnx.jit
def _accuracy(model, images, labels):
  return jnp.mean(jnp.argmax(model(images), -1) == labels)


def _evaluate(model, images, labels, batch=2000):
  model.eval()
  correct = 0.0
  for start in range(0, len(labels), batch):
    chunk = slice(start, start + batch)
    correct += float(_accuracy(model, images[chunk], labels[chunk])) * len(
        labels[chunk])
  model.train()
  return correct / len(labels)


def _methods(lr_adam: float, lr_cbp: float):
  return {
      'Adam': (False, lambda: optax.adam(lr_adam)),
      'Adam + Center': (True, lambda: optax.adam(lr_adam)),
      'CBP (M1+M2+M3)': (True, lambda: cbp.cbp(lr_cbp)),
  }


def compare(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(
      prog='cbp-optax compare',
      description='Train the paper\'s MNIST MLP with Adam, Adam + Center and '
      'CBP side by side.')
  parser.add_argument('--data-dir', default=None,
                      help='directory with the MNIST IDX files (default: '
                      '$CBP_OPTAX_MNIST, ../shared/data/mnist, or a download '
                      'into ~/.cache/cbp_optax/mnist)')
  parser.add_argument('--steps', type=int, default=300)
  parser.add_argument('--batch-size', type=int, default=256)
  parser.add_argument('--width', type=int, default=256)
  parser.add_argument('--depth', type=int, default=4)
  parser.add_argument('--lr-adam', type=float, default=1e-3)
  parser.add_argument('--lr-cbp', type=float, default=3e-3)
  parser.add_argument('--seed', type=int, default=0)
  args = parser.parse_args(argv)

  data = datasets.find_mnist(args.data_dir)
  print(f'data: {data.source}')
  print(f'model: MLP 784 -> {args.width} x {args.depth} -> 10, batch '
        f'{args.batch_size}, {args.steps} steps, seed {args.seed}, '
        f'jax {jax.__version__} on {jax.devices()[0].platform}')
  print(f'learning rates: Adam {args.lr_adam:g}, CBP {args.lr_cbp:g} '
        '(--lr-adam / --lr-cbp); ms / step excludes compilation')
  rng = np.random.default_rng(args.seed)
  batches = [rng.integers(0, len(data.train_labels), args.batch_size)
             for _ in range(args.steps)]
  rows = []
  for name, (centered, make_tx) in _methods(args.lr_adam,
                                            args.lr_cbp).items():
    model = MLP(width=args.width, depth=args.depth, centered=centered,
                rngs=nnx.Rngs(args.seed))
    optimizer = nnx.Optimizer(model, make_tx(), wrt=nnx.Param)
    step = cbp_nnx.train_step(_loss_fn)
    smoothed, losses = None, []
    start = None
    for i, idx in enumerate(batches):
      if i == 1:
        jax.block_until_ready(nnx.state(model))
        start = time.perf_counter()  # excludes compilation
      out = step(model, optimizer, data.train_images[idx],
                 data.train_labels[idx])
      losses.append(out.loss)
    jax.block_until_ready(nnx.state(model))
    seconds = time.perf_counter() - start
    for loss in losses:
      loss = float(loss)
      smoothed = loss if smoothed is None else 0.9 * smoothed + 0.1 * loss
    accuracy = _evaluate(model, data.test_images, data.test_labels)
    rows.append((name, smoothed, accuracy,
                 1e3 * seconds / max(args.steps - 1, 1)))
  print()
  print(f'| {"method":<16} | {"train loss (EMA)":>16} | {"test accuracy":>13} '
        f'| {"ms / step":>9} |')
  print(f'|{"-" * 18}|{"-" * 17}:|{"-" * 14}:|{"-" * 10}:|')
  for name, loss, accuracy, ms in rows:
    print(f'| {name:<16} | {loss:>16.4f} | {accuracy:>13.4f} | {ms:>9.2f} |')
  return 0


_COMMANDS: dict[str, Callable[[Optional[Sequence[str]]], int]] = {
    'compare': compare,
    'reproduce': reproduce_cli.main,
}


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] in ('-h', '--help') or argv[0] not in _COMMANDS:
    print('usage: cbp-optax {' + ','.join(_COMMANDS) + '} [options]\n\n'
          '  compare   Adam vs Adam + Center vs CBP on the MNIST MLP (§6.6)\n'
          '  reproduce the paper\'s studies: reproduce <study|all> [--quick]')
    return 0 if argv and argv[0] in ('-h', '--help') else 2
  return _COMMANDS[argv[0]](argv[1:])


if __name__ == '__main__':
  sys.exit(main())
