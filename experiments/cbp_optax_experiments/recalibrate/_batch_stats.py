"""Precise BatchNorm statistics, one algorithm for NNX and Linen models.

BatchNorm's running averages are an EMA of per-batch statistics taken while
the network changed; after training (or after a run too short for the EMA
to catch up) they can lag the final network. The remedy is to recompute
them with the parameters frozen, as the population statistics over a set of
training batches: every BatchNorm's input mean, and the variance of all its
inputs pooled, not an average of per-batch variances.

One algorithm for both frameworks, which differ only in how they reach a
BatchNorm call and where the statistics go. Every call of every BatchNorm
runs through :func:`pooled_call`, which takes that call's :func:`moments`
(with the number of positions it normalized over) and folds them into the
layer's accumulators with :func:`combine`; :func:`population` then folds the
batches together the same way and checks the statistics. A layer called
twice in one forward pass, a time-major batch and a zero-example batch all
follow from the counts.
"""

from __future__ import annotations

import math
from typing import (Any, Callable, Iterable, Mapping, NamedTuple, Optional,
                    Sequence)

import jax
import jax.numpy as jnp
from jax import lax


class Moments(NamedTuple):
  """Per-feature statistics of a set of input positions.

  Attributes:
    count: how many positions (the product of the reduced axes' sizes, or
      the mask's sum), per feature.
    mean: their mean.
    var: their biased variance, as BatchNorm's.
    calls: how many layer calls they came from (0: the layer was never
      called, which is not the same as called on empty inputs).
  """

  count: Any
  mean: Any
  var: Any
  calls: Any = 1


def as_args(batch: Any) -> tuple[Any, ...]:
  """A batch as positional arguments: a tuple or list is spread, else one."""
  return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)


def feature_axes(axis: Any, ndim: int) -> tuple[int, ...]:
  """A BatchNorm's ``axis`` (an int or a sequence) as non-negative indices."""
  axes = (axis,) if isinstance(axis, int) else tuple(axis)
  return tuple(sorted(a % ndim for a in axes))


def moments(
    x: jax.Array,
    axis: Any,
    *,
    mask: Optional[jax.Array] = None,
    axis_name: Optional[Any] = None,
    axis_index_groups: Any = None,
) -> Moments:
  """The :class:`Moments` of one BatchNorm call's input ``x``.

  Over every axis but the feature axes ``axis``, in at least float32, as
  BatchNorm computes them (``mask`` selects positions, ``axis_name`` pools
  across devices). The count is that of the positions actually normalized,
  so a time-major ``(T, B, F)`` input counts ``T * B`` and an empty one 0
  (its mean and variance are then 0, not NaN). Across devices the sums are
  added, so unequal per-device counts are weighted correctly.
  """
  dtype = jnp.promote_types(jnp.result_type(x), jnp.float32)
  x = jnp.asarray(x, dtype)
  features = feature_axes(axis, x.ndim)
  reduced = tuple(a for a in range(x.ndim) if a not in features)
  keep = [x.shape[a] if a in features else 1 for a in range(x.ndim)]

  def total(value):
    value = jnp.sum(value, reduced, dtype=dtype)
    if axis_name is not None:
      value = lax.psum(value, axis_name, axis_index_groups=axis_index_groups)
    return value

  if mask is None:
    where = None
    count = jnp.full(tuple(x.shape[a] for a in features),
                     math.prod(x.shape[a] for a in reduced), dtype)
    if axis_name is not None:
      count = lax.psum(count, axis_name, axis_index_groups=axis_index_groups)
  else:
    where = jnp.broadcast_to(jnp.asarray(mask, bool), x.shape)
    count = total(where)
  safe = jnp.maximum(count, 1)
  mean = total(x if where is None else jnp.where(where, x, 0)) / safe
  deviation = jnp.square(x - jnp.reshape(mean, keep))
  if where is not None:
    deviation = jnp.where(where, deviation, 0)
  return Moments(count, mean, total(deviation) / safe)


def pooled_call(
    norm: Any, x: jax.Array, mask: Optional[jax.Array], so_far: Moments,
    call: Callable[[], Any],
) -> tuple[Any, Moments]:
  """One BatchNorm call, and ``so_far`` with its input's moments folded in.

  ``norm`` is an ``nnx.BatchNorm`` or an ``nn.BatchNorm`` (both name their
  feature axes ``axis`` and their device pooling ``axis_name`` and
  ``axis_index_groups``); ``call()`` runs it on ``x`` with its batch's
  statistics, as in training.
  """
  moments_of_call = moments(
      x, norm.axis, mask=mask, axis_name=norm.axis_name,
      axis_index_groups=norm.axis_index_groups)
  out = call()
  return out, combine(so_far, moments_of_call)


def empty_like(mean: jax.Array, var: jax.Array) -> Moments:
  """Accumulators that have seen nothing, shaped (and so stacked) as ``mean``."""
  count = jnp.zeros(jnp.shape(mean),
                    jnp.promote_types(jnp.result_type(mean), jnp.float32))
  return Moments(count, jnp.zeros_like(mean), jnp.zeros_like(var),
                 jnp.zeros(jnp.shape(mean), jnp.int32))


def combine(a: Moments, b: Moments) -> Moments:
  """The moments of two disjoint sets of positions together.

  Chan, Golub and LeVeque's pairwise update: the pooled variance is the
  within-set variances plus the spread of the set means, without the
  cancellation of ``E[x^2] - E[x]^2``. A set with count 0 changes nothing
  (and brings no NaN); the result has ``a``'s dtypes.
  """
  count = a.count + b.count
  safe = jnp.where(count > 0, count, 1)
  weight = b.count / safe
  delta = b.mean - a.mean
  mean = a.mean + delta * weight
  var = (a.var * a.count + b.var * b.count
         + jnp.square(delta) * a.count * weight) / safe
  mean = jnp.where(a.count > 0, mean, b.mean)
  var = jnp.where(a.count > 0, var, b.var)
  mean = jnp.where(b.count > 0, mean, a.mean)
  var = jnp.where(b.count > 0, var, a.var)
  return Moments(count.astype(jnp.result_type(a.count)),
                 mean.astype(jnp.result_type(a.mean)),
                 var.astype(jnp.result_type(a.var)),
                 a.calls + b.calls)


def pool(batches: Iterable[Mapping[str, Moments]]) -> dict[str, Moments]:
  """Every layer's :class:`Moments` over all batches, from per-batch ones.

  Each batch gives ``{layer path: Moments}`` (every call of the layer in
  that batch already combined); the batches are combined the same way, so
  each is weighted by the positions it really had.

  Raises:
    ValueError: no batches.
  """
  pooled = None
  for batch in batches:
    batch = {path: Moments(*m) for path, m in batch.items()}
    if pooled is None:
      pooled = batch
    else:
      pooled = {path: combine(pooled[path], batch[path]) for path in pooled}
  if pooled is None:
    raise ValueError('recalibration: batches is empty.')
  return pooled


def population(
    batch_moments: Callable[[Any], Mapping[str, Moments]],
    batches: Iterable[Any],
) -> dict[str, tuple[Any, Any]]:
  """``{path: (mean, var)}`` over all ``batches``, checked (:func:`finish`).

  ``batch_moments(batch)`` runs the forward pass on one batch and returns
  every called layer's accumulated :class:`Moments`.
  """
  return finish(pool(batch_moments(batch) for batch in batches))


def finish(pooled: Mapping[str, Moments]) -> dict[str, tuple[Any, Any]]:
  """``{path: (mean, var)}`` from :func:`pool`, refusing what has no answer.

  A layer the forward pass never called is left out (its statistics stay
  as they are).

  Raises:
    ValueError: a BatchNorm called only on empty inputs (every batch had
      zero examples), or whose statistics are not finite.
  """
  pooled = {p: m for p, m in pooled.items() if jnp.any(m.calls > 0)}
  empty = sorted(p for p, m in pooled.items() if not jnp.all(m.count > 0))
  if empty:
    raise ValueError(
        f'recalibration: the BatchNorm layers {_listed(empty)} '
        'normalized no example in any batch (every batch was empty), so '
        'there are no statistics to take; the running averages were left '
        'as they were. Pass batches with examples.'
    )
  bad = sorted(p for p, m in pooled.items()
               if not (jnp.all(jnp.isfinite(m.mean))
                       and jnp.all(jnp.isfinite(m.var))))
  if bad:
    raise ValueError(
        f'recalibration: the statistics of the BatchNorm layers '
        f'{_listed(bad)} are not finite (non-finite inputs: check the '
        'batches and the parameters); the running averages were left as '
        'they were.'
    )
  return {p: (m.mean, m.var) for p, m in pooled.items()}


def _listed(paths: Sequence[str], limit: int = 5) -> str:
  shown = ', '.join(repr(p) for p in paths[:limit])
  more = len(paths) - limit
  return shown + (f' and {more} more' if more > 0 else '')
