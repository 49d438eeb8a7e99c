"""Precise BatchNorm: running statistics recomputed at the current parameters.

After training, or after a run too short for BatchNorm's EMA to catch up,
the running averages lag the network. These functions recompute them with
the parameters frozen, as the population statistics over a set of training
batches (the variance of the pooled inputs, not an average of batch
variances). They work on any model, centered with ``cbp_optax`` or not:

* :func:`nnx_batch_stats` - an NNX model's ``nnx.BatchNorm`` statistics,
  set in place.
* :func:`linen_batch_stats` - a Linen model's ``batch_stats``, returned as
  new variables.
"""

from cbp_optax_experiments.recalibrate.linen import linen_batch_stats
from cbp_optax_experiments.recalibrate.nnx import nnx_batch_stats

__all__ = ('linen_batch_stats', 'nnx_batch_stats')
