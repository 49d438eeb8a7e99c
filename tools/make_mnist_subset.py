"""Builds ``experiments/cbp_optax_experiments/data/mnist_subset.npz``, the MNIST subset shipped with the package.

Usage::

  python tools/make_mnist_subset.py DIR

``DIR`` holds the MNIST test set in IDX format (``t10k-images-idx3-ubyte`` and
``t10k-labels-idx1-ubyte``, gzipped or not). A fixed permutation (seed 0) of
its 10,000 images gives 2,000 training and 500 test images, stored as uint8
with their indices into the MNIST test set. Rerunning it on the same files
writes the same arrays.
"""

import pathlib
import sys

import numpy as np

from cbp_optax_experiments import datasets

TRAIN, TEST, SEED = 2000, 500, 0
TARGET = (pathlib.Path(__file__).resolve().parents[1] / 'experiments'
          / 'cbp_optax_experiments' / 'data' / 'mnist_subset.npz')


def main(argv: list[str]) -> int:
  if len(argv) != 1:
    print(__doc__)
    return 2
  directory = pathlib.Path(argv[0])
  images = datasets._read_idx(  # pylint: disable=protected-access
      datasets._find(directory, 't10k-images-idx3-ubyte'), 2051)  # pylint: disable=protected-access
  labels = datasets._read_idx(  # pylint: disable=protected-access
      datasets._find(directory, 't10k-labels-idx1-ubyte'), 2049)  # pylint: disable=protected-access
  assert images.shape == (10000, 28, 28) and labels.shape == (10000,)
  order = np.random.default_rng(SEED).permutation(len(labels))
  train, test = order[:TRAIN], order[TRAIN:TRAIN + TEST]
  np.savez_compressed(
      TARGET,
      train_images=images[train], train_labels=labels[train],
      test_images=images[test], test_labels=labels[test],
      train_index=train.astype(np.int16), test_index=test.astype(np.int16))
  print(f'{TARGET}: {TARGET.stat().st_size:,} bytes')
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
