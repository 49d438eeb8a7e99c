"""Real MNIST for the tests that need it: ``$CBP_OPTAX_MNIST``.

A directory with the IDX test files (``t10k-*-idx?-ubyte.gz``); a test marked
``needs_mnist`` skips, saying why, when it is not set or the directory lacks
them. The library's tests (test_examples.py) and the experiments' tests
(experiments/tests/test_datasets.py) share it.
"""

import os
import pathlib

import pytest

MNIST_DIR = (pathlib.Path(os.environ['CBP_OPTAX_MNIST']).expanduser()
             if os.environ.get('CBP_OPTAX_MNIST') else None)
needs_mnist = pytest.mark.skipif(
    MNIST_DIR is None
    or not (MNIST_DIR / 't10k-images-idx3-ubyte.gz').is_file(),
    reason=('real MNIST: set CBP_OPTAX_MNIST to a directory with the IDX test '
            'files (t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz)'
            if MNIST_DIR is None else
            f'real MNIST: CBP_OPTAX_MNIST={MNIST_DIR} has no '
            't10k-images-idx3-ubyte.gz'))
