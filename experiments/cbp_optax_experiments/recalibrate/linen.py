"""BatchNorm statistics of a Linen model recomputed at its current parameters.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import inspect

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from cbp_optax_experiments.recalibrate import _batch_stats


# Beside every BatchNorm's statistics during recalibration only: how many
# positions, and in how many calls, it normalized so far in one batch.
_POOL_COUNT, _POOL_CALLS = 'cbp_recalibration_count', 'cbp_recalibration_calls'


def _input_name(module_type: type) -> Optional[str]:
  """The name of the first argument of ``module_type.__call__`` after self."""
  try:
    parameters = list(
        inspect.signature(module_type.__call__).parameters.values())[1:]
  except (TypeError, ValueError):
    return None
  if parameters and parameters[0].kind in (
      inspect.Parameter.POSITIONAL_ONLY,
      inspect.Parameter.POSITIONAL_OR_KEYWORD):
    return parameters[0].name
  return None


def _call_input(
    module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any],
) -> tuple[bool, Any, tuple[Any, ...], dict[str, Any]]:
  """``(found, input, other args, other kwargs)`` of an intercepted call.

  The input is the call's first argument, given by position or by its name
  (``nn.BatchNorm()(x=h)``).
  """
  kwargs = dict(kwargs)
  if args:
    return True, args[0], tuple(args[1:]), kwargs
  name = _input_name(type(module))
  if name is not None and name in kwargs:
    return True, kwargs.pop(name), (), kwargs
  return False, None, tuple(args), kwargs


def _is_norm_entry(tree: Any) -> bool:
  return (isinstance(tree, Mapping) and {'mean', 'var'} <= set(tree)
          and not any(isinstance(v, Mapping) for v in tree.values()))


def _with_counts(stats: Any) -> Any:
  """``batch_stats`` with empty accumulators beside every mean (stacked alike)."""
  if _is_norm_entry(stats):
    empty = _batch_stats.empty_like(stats['mean'], stats['var'])
    return dict(stats, **{_POOL_COUNT: empty.count, _POOL_CALLS: empty.calls})
  if isinstance(stats, Mapping):
    return {k: _with_counts(v) for k, v in stats.items()}
  return stats


def _counted_entries(stats: Any, path: tuple[str, ...] = ()) -> dict[str, Any]:
  if isinstance(stats, Mapping) and _POOL_COUNT in stats:
    return {'/'.join(path): _batch_stats.Moments(
        stats[_POOL_COUNT], stats['mean'], stats['var'], stats[_POOL_CALLS])}
  found = {}
  if isinstance(stats, Mapping):
    for key, sub in stats.items():
      found.update(_counted_entries(sub, path + (str(key),)))
  return found


def _replace_entries(stats: Any, new: Mapping[str, Any],
                     path: tuple[str, ...] = ()) -> Any:
  if not isinstance(stats, Mapping):
    return stats
  key = '/'.join(path)
  if _is_norm_entry(stats) and key in new:
    mean, var = new[key]
    return dict(stats, mean=mean.astype(jnp.result_type(stats['mean'])),
                var=var.astype(jnp.result_type(stats['var'])))
  return {k: _replace_entries(v, new, path + (str(k),))
          for k, v in stats.items()}


def linen_batch_stats(
    apply_fn: Callable[..., Any], variables: Any, batches: Any,
    **apply_kwargs: Any,
) -> Any:
  """Sets every BatchNorm's running averages to population statistics.

  "Precise BatchNorm": the parameters frozen, each ``nn.BatchNorm``'s
  running mean and variance (``batch_stats``) become the mean and the
  (biased) variance of all its inputs over ``batches``, pooled (the
  variance of the pooled inputs, not an average of batch variances),
  instead of an EMA over a network that kept changing. Every call counts: a
  BatchNorm applied several times in one forward pass pools all its inputs,
  and each call is weighted by the positions it normalized (the product of
  its reduced axes' sizes, or its mask's sum), so time-major batches weigh
  what they hold and an empty batch weighs nothing. Every BatchNorm
  normalizes with its batch's statistics, as in training, whatever its
  ``use_running_average``; pass the model's evaluation flags in
  ``apply_kwargs`` (``train=False``) so that dropout is off. Only
  ``batch_stats`` changes (the ``'centering'`` collection is not mutable:
  nothing is recorded), and only for the BatchNorms the forward pass calls;
  ``nn.scan``/``nn.vmap`` stacks get per-slice statistics. Use it before
  evaluating with running averages after a short run, a large learning
  rate, or a BatchNorm momentum close to 1, where they lag the network; a
  few dozen training batches suffice.

  Args:
    apply_fn: ``model.apply`` (of a centered model or not).
    variables: the model's variables, with ``batch_stats``.
    batches: an iterable of training batches, each an array or a tuple of
      positional arguments of ``apply_fn`` after the variables.
    **apply_kwargs: keyword arguments of every ``apply_fn`` call.

  Returns:
    ``variables`` with new ``batch_stats`` (same container type); a
    BatchNorm the forward pass never calls keeps its statistics. Functional,
    as Linen is: ``cbp_optax_experiments.recalibrate.nnx_batch_stats`` runs the same algorithm
    but sets an NNX model's statistics in place and returns the paths of the
    layers it recalibrated instead.

  Raises:
    ValueError: ``variables`` without ``batch_stats``, no batches, a
      BatchNorm that normalized no example in any batch (all empty), or
      statistics that are not finite.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import flax.linen as nn
    >>> from cbp_optax_experiments import recalibrate
    >>> class Net(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x, train: bool = True):
    ...     x = nn.Dense(3, name='dense')(x)
    ...     return nn.BatchNorm(use_running_average=not train)(x)
    >>> model = Net()
    >>> batches = [jnp.ones((4, 2)), jnp.zeros((4, 2))]
    >>> variables = model.init(jax.random.key(0), batches[0], train=False)
    >>> variables = recalibrate.linen_batch_stats(
    ...     model.apply, variables, batches, train=False)
    >>> inputs = nn.Dense(3).apply(
    ...     {'params': variables['params']['dense']}, jnp.concatenate(batches))
    >>> stats = variables['batch_stats']['BatchNorm_0']
    >>> bool(jnp.allclose(stats['mean'], inputs.mean(0)))
    True
    >>> bool(jnp.allclose(stats['var'], inputs.var(0)))
    True
  """
  if 'batch_stats' not in variables:
    raise ValueError(
        'linen_batch_stats: variables has no batch_stats collection '
        '(no BatchNorm layer).')

  def interceptor(next_fun, args, kwargs, context):
    module = context.module
    if not (type(module) is nn.BatchNorm  # pylint: disable=unidiomatic-typecheck
            and context.method_name == '__call__'
            and module.has_variable('batch_stats', _POOL_COUNT)):
      return next_fun(*args, **kwargs)
    found, x, _, kwargs = _call_input(module, args, kwargs)
    if not found:
      return next_fun(*args, **kwargs)
    so_far = _batch_stats.Moments(*(
        module.get_variable('batch_stats', name)
        for name in (_POOL_COUNT, 'mean', 'var', _POOL_CALLS)))

    def call():
      # Batch statistics whatever the constructor or the call says (Linen
      # refuses the flag in both places, so clear the constructor's; a
      # positional flag is dropped with the other positional arguments).
      constructed = module.use_running_average
      object.__setattr__(module, 'use_running_average', None)
      try:
        return next_fun(x, **dict(kwargs, use_running_average=False))
      finally:
        object.__setattr__(module, 'use_running_average', constructed)

    out, pooled = _batch_stats.pooled_call(module, x, kwargs.get('mask'),
                                           so_far, call)
    for name, value in ((_POOL_COUNT, pooled.count), ('mean', pooled.mean),
                        ('var', pooled.var), (_POOL_CALLS, pooled.calls)):
      module.put_variable('batch_stats', name, value)
    return out

  @jax.jit
  def batch_moments(variables, batch):
    with nn.intercept_methods(interceptor):
      _, changed = apply_fn(variables, *_batch_stats.as_args(batch),
                            mutable=['batch_stats'], **apply_kwargs)
    return _counted_entries(flax.core.unfreeze(changed['batch_stats']))

  plain = flax.core.unfreeze(variables)
  counted = dict(plain, batch_stats=_with_counts(plain['batch_stats']))
  stats = _batch_stats.population(lambda batch: batch_moments(counted, batch),
                                  batches)
  new = dict(plain, batch_stats=_replace_entries(plain['batch_stats'], stats))
  if isinstance(variables, flax.core.FrozenDict):
    return flax.core.freeze(new)
  return new
