"""cbp_optax_experiments: the experiments around cbp_optax, not the optimizer.

This package holds everything that is not part of the optimizer itself:

* :mod:`cbp_optax_experiments.reproduce` - the reproduction suite of the
  paper's studies (``cbp-optax reproduce``, ``python -m
  cbp_optax_experiments.reproduce``; see REPRODUCTION.md).
* :mod:`cbp_optax_experiments.cli` - the ``cbp-optax`` command
  (``compare``, ``reproduce``, ``--version``).
* :mod:`cbp_optax_experiments.datasets` - the MNIST IDX and CIFAR-10 readers
  and the small bundled MNIST subset used by the examples and benchmarks.

The core package ``cbp_optax`` never imports this one. It is a distribution
of its own (``cbp-optax-experiments``, not in the library's wheel), installed
from the repository root with its plotting, statistics and data
dependencies::

  pip install ./experiments
"""
