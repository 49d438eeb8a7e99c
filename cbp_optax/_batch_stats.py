"""Precise BatchNorm statistics, shared by ``cbp_optax.nnx`` and ``.linen``.

BatchNorm's running averages are an EMA of per-batch statistics taken while
the network changed; after training (or after a run too short for the EMA
to catch up) they can lag the final network. The remedy is to recompute
them with the parameters frozen, as the population statistics over a set of
training batches: every BatchNorm's input mean, and the variance of all its
inputs pooled, not an average of per-batch variances.
"""

from __future__ import annotations

from typing import Any, Iterable

import jax
import jax.numpy as jnp


def as_args(batch: Any) -> tuple[Any, ...]:
  """A batch as positional arguments: a tuple or list is spread, else one."""
  return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)


def batch_size(batch: Any) -> int:
  """The number of examples in ``batch``: its first array's leading axis."""
  leaves = jax.tree.leaves(batch)
  if not leaves or not jnp.ndim(leaves[0]):
    raise ValueError(
        'recalibrate_batch_stats: each batch must hold arrays with a leading '
        'batch axis (an array, or a tuple of model arguments).'
    )
  return int(jnp.shape(leaves[0])[0])


def pool(moments: Iterable[tuple[int, Any, Any]]) -> tuple[Any, Any]:
  """Mean and variance of pooled data from per-batch ``(n, mean, var)``.

  ``mean`` and ``var`` are trees of per-feature batch statistics (variance
  biased, as BatchNorm's). Batches are weighted by their number of examples;
  the variance is that of all the examples together (within-batch variance
  plus the spread of the batch means), combined one batch at a time as in
  Chan, Golub and LeVeque's parallel algorithm, which keeps float32 free of
  the cancellation of ``E[x^2] - E[x]^2``.

  Raises:
    ValueError: no batches.
  """
  total, mean, m2 = 0, None, None
  for n, batch_mean, batch_var in moments:
    if mean is None:
      mean = batch_mean
      m2 = jax.tree.map(lambda v, n=n: v * n, batch_var)
    else:
      new_total = total + n
      delta = jax.tree.map(jnp.subtract, batch_mean, mean)
      mean = jax.tree.map(lambda m, d, n=n: m + d * (n / new_total), mean,
                          delta)
      m2 = jax.tree.map(
          lambda s, v, d, n=n: s + v * n + d * d * (total * n / new_total),
          m2, batch_var, delta)
    total += n
  if mean is None:
    raise ValueError('recalibrate_batch_stats: batches is empty.')
  return mean, jax.tree.map(lambda s: s / total, m2)
