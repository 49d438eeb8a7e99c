"""BatchNorm statistics of an NNX model recomputed at its current parameters.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import jax
from flax import nnx

from cbp_optax_experiments.recalibrate import _batch_stats


def _path_str(path: Any) -> str:
  return '/'.join(str(p) for p in path)


def _norm_layers(model: nnx.Module) -> list[tuple[str, nnx.BatchNorm]]:
  return [(_path_str(p), m) for p, m in nnx.iter_modules(model)
          if isinstance(m, nnx.BatchNorm)]


def _call_model(model: nnx.Module, batch: Any) -> Any:
  return model(*_batch_stats.as_args(batch))


# How many positions, and in how many calls, a BatchNorm of the throw-away
# copy has normalized so far in one batch (attributes of the copy only).
_COUNT, _CALLS = 'cbp_recalibration_count', 'cbp_recalibration_calls'


_POOLING_TYPES: dict[type, type] = {}


def _pooling_type(norm_type: type) -> type:
  """``norm_type`` whose every call's moments are pooled (for a copy).

  The layer normalizes with its batch's statistics, as in training,
  whatever its flags; its ``mean`` and ``var`` accumulate the moments of
  every call of the forward pass, weighted by the positions each call
  normalized (a layer applied twice counts both inputs). A subclass, not a
  wrapper, so that paths, attributes and layer stacks stay as they are.
  """
  if norm_type in _POOLING_TYPES:
    return _POOLING_TYPES[norm_type]

  def __call__(self, x, use_running_average=None, *, mask=None, **kwargs):
    del use_running_average
    so_far = _batch_stats.Moments(
        getattr(self, _COUNT)[...], self.mean[...], self.var[...],
        getattr(self, _CALLS)[...])
    out, pooled = _batch_stats.pooled_call(
        self, x, mask, so_far,
        lambda: norm_type.__call__(self, x, use_running_average=False,
                                   mask=mask, **kwargs))
    getattr(self, _COUNT)[...] = pooled.count
    getattr(self, _CALLS)[...] = pooled.calls
    self.mean[...], self.var[...] = pooled.mean, pooled.var
    return out

  # No mixin base: CPython allows __class__ assignment to a plain subclass.
  pooling = type(f'_Pooling{norm_type.__name__}', (norm_type,),
                 {'__call__': __call__, '__module__': __name__})
  _POOLING_TYPES[norm_type] = pooling
  return pooling


def nnx_batch_stats(
    model: nnx.Module, batches: Iterable[Any], *,
    forward: Optional[Callable[[nnx.Module, Any], Any]] = None,
) -> list[str]:
  """Sets every BatchNorm's running averages to population statistics.

  "Precise BatchNorm": the parameters frozen, each ``nnx.BatchNorm``'s
  running mean and variance become the mean and the (biased) variance of
  all its inputs over ``batches``, pooled (the variance of the pooled
  inputs, not an average of batch variances), instead of an EMA over a
  network that kept changing. Every call counts: a BatchNorm applied
  several times in one forward pass pools all its inputs, and each call is
  weighted by the positions it normalized (the product of its reduced axes'
  sizes, or its mask's sum), so time-major batches weigh what they hold and
  an empty batch weighs nothing. Each BatchNorm sees what it sees in
  training: it normalizes with its batch's statistics (whatever
  ``use_running_average`` it is given); dropout is off, centered layers
  record nothing. Nothing else in the model changes (parameters, centering
  means, RNG state); layer stacks (``nnx.vmap``/``nnx.scan``) get per-slice
  statistics. Use it before evaluating with running averages after a short
  run, a large learning rate, or a BatchNorm momentum close to 1, where
  they lag the network; a few dozen training batches suffice.

  Args:
    model: the model (centered or not); its BatchNorm statistics are set in
      place.
    batches: an iterable of training batches, each an array or a tuple of
      positional arguments of ``model``.
    forward: ``forward(model, batch)`` runs the model on one batch (for
      batches that hold labels or keyword arguments); by default
      ``model(*batch)``.

  Returns:
    The paths of the BatchNorm layers recalibrated: all those the forward
    pass calls (one it never calls keeps its statistics). The statistics
    themselves are set in the model, as NNX's own updates are;
    ``cbp_optax_experiments.recalibrate.linen_batch_stats`` runs the same algorithm but is
    functional, as Linen is, and returns the new variables instead.

  Raises:
    ValueError: a model without ``nnx.BatchNorm``, no batches, a BatchNorm
      that normalized no example in any batch (all empty), or statistics
      that are not finite; the model is then left as it was.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> from cbp_optax_experiments import recalibrate
    >>> model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)),
    ...                        nnx.BatchNorm(3, rngs=nnx.Rngs(0)))
    >>> batches = [jnp.ones((4, 2)), jnp.zeros((4, 2))]
    >>> recalibrate.nnx_batch_stats(model, batches)
    ['layers/1']
    >>> outputs = model.layers[0](jnp.concatenate(batches))  # the BN input
    >>> bool(jnp.allclose(model.layers[1].mean[...], outputs.mean(0)))
    True
    >>> bool(jnp.allclose(model.layers[1].var[...], outputs.var(0)))
    True
  """
  norms = _norm_layers(model)
  if not norms:
    raise ValueError(
        'nnx_batch_stats: the model has no nnx.BatchNorm layer.')
  forward = forward or _call_model
  graphdef, state = nnx.split(model)

  @jax.jit
  def batch_moments(state, batch):
    copy = nnx.view(nnx.merge(graphdef, state), deterministic=True,
                    use_running_average=True, raise_if_not_found=False)
    for _, norm in _norm_layers(copy):
      # The copy is thrown away: its BatchNorms become pooling ones, their
      # statistics the accumulators (a count beside them, stacked alike).
      norm.__class__ = _pooling_type(type(norm))
      empty = _batch_stats.empty_like(norm.mean[...], norm.var[...])
      setattr(norm, _COUNT, norm.mean.replace(empty.count))
      setattr(norm, _CALLS, norm.mean.replace(empty.calls))
      norm.mean[...], norm.var[...] = empty.mean, empty.var
    forward(copy, batch)
    return {p: _batch_stats.Moments(getattr(n, _COUNT)[...], n.mean[...],
                                    n.var[...], getattr(n, _CALLS)[...])
            for p, n in _norm_layers(copy)}

  stats = _batch_stats.population(lambda batch: batch_moments(state, batch),
                                  batches)
  for path, norm in norms:
    if path in stats:
      mean, var = stats[path]
      norm.mean[...] = mean.astype(norm.mean.dtype)
      norm.var[...] = var.astype(norm.var.dtype)
  return [path for path, _ in norms if path in stats]
