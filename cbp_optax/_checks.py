"""Construction-time validation of hyperparameters and input trees.

Concrete values are checked eagerly, with a message naming the argument;
tracers (``optax.inject_hyperparams``) by their shape and dtype only.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np


def concrete_float(value: Any) -> Optional[float]:
  """Returns ``value`` as a Python float, or None when it is not concrete."""
  if callable(value) or isinstance(value, jax.core.Tracer):
    return None
  if isinstance(value, (bool, np.bool_)):
    return None
  try:
    array = np.asarray(value)
  except Exception:  # pylint: disable=broad-except
    return None
  if array.shape != () or not np.issubdtype(array.dtype, np.number):
    return None
  if np.issubdtype(array.dtype, np.complexfloating):
    return None
  return float(array)


# The factories whose first argument is the learning rate.
_WITH_LEARNING_RATE = ('cbp.cbp', 'cbp.cbp_robust', 'cbp.recommended')
# What of theirs takes a schedule directly.
_SCHEDULED = {'cbp.recommended': 'Only learning_rate takes a schedule '
                                 'directly'}


def _arguments(factory: str, *arguments: str) -> str:
  """The argument list of an example call of ``factory``."""
  if factory in _WITH_LEARNING_RATE:
    arguments = ('learning_rate',) + arguments
  return ', '.join(arguments + ('...',))


def check_scalar(
    name: str, value: Any, *, schedule_ok: bool = False,
    factory: str = 'cbp.cbp',
) -> Optional[float]:
  """Refuses anything but one real number (or a tracer of one).

  Args:
    name: the argument's name, for the message.
    value: a real number, a real scalar array or a tracer of one, or, when
      ``schedule_ok``, a callable schedule.
    schedule_ok: whether a callable (an optax schedule) is accepted.
    factory: the public factory that takes ``name``, for the message.

  Returns:
    The value as a Python float when it is concrete, else None.

  Raises:
    TypeError: a bool, a string, a complex or integer-less non-number, or a
      callable where no schedule is supported.
    ValueError: an array that is not a scalar.
  """
  if callable(value) and not isinstance(value, (jax.Array, np.ndarray)):
    if schedule_ok:
      return None
    direct = _SCHEDULED.get(factory) or (
        'Only learning_rate and weight_decay take a schedule directly'
        if factory in _WITH_LEARNING_RATE
        else f'{factory} takes no schedule directly')
    raise TypeError(
        f'{name} must be a number, got the callable {value!r}. {direct}; to '
        f'schedule {name}, wrap the factory: optax.inject_hyperparams('
        f'{factory})({_arguments(factory, f"{name}=schedule")}), which '
        'evaluates the schedule at every step and passes its value in.'
    )
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f'{name} must be a number, got the bool {value!r}.')
  if isinstance(value, numbers.Real):
    number = float(value)
  elif isinstance(value, (jax.Array, np.ndarray, np.generic)):
    dtype = value.dtype
    if jnp.issubdtype(dtype, jnp.bool_) or not (
        jnp.issubdtype(dtype, jnp.floating)
        or jnp.issubdtype(dtype, jnp.integer)
    ):
      raise TypeError(
          f'{name} must be a real number, got an array of dtype {dtype}.'
      )
    if np.shape(value) != ():
      raise ValueError(
          f'{name} must be a scalar, got an array of shape {np.shape(value)}; '
          'a per-parameter hyperparameter would broadcast the parameters to '
          'its shape.'
      )
    number = concrete_float(value)
  else:
    raise TypeError(
        f'{name} must be a real number, got {type(value).__name__} '
        f'{value!r}.'
    )
  if number is not None and not math.isfinite(number):
    raise ValueError(f'{name} must be finite, got {value!r}.')
  return number


def check_in_range(
    name: str,
    value: Any,
    low: float,
    high: float,
    *,
    low_inclusive: bool = True,
    high_inclusive: bool = False,
    schedule_ok: bool = False,
    factory: str = 'cbp.cbp',
) -> None:
  """Raises unless ``value`` is one real number in the given interval.

  Raises:
    TypeError: ``value`` is not a number (see :func:`check_scalar`).
    ValueError: a non-scalar array, or a concrete value outside the interval
      (NaN included).
  """
  if callable(value) and not isinstance(value, (jax.Array, np.ndarray)):
    check_scalar(name, value, schedule_ok=schedule_ok, factory=factory)
    return
  if isinstance(value, numbers.Real) and not isinstance(value, bool):
    number = float(value)  # NaN and infinities are judged by the interval
  else:
    number = check_scalar(name, value, factory=factory)
  if number is None:
    return
  above = number >= low if low_inclusive else number > low
  below = number <= high if high_inclusive else number < high
  if not (above and below) or math.isnan(number):
    interval = (
        ('[' if low_inclusive else '(')
        + f'{low}, {high}'
        + (']' if high_inclusive else ')')
    )
    raise ValueError(f'{name} must lie in {interval}, got {value!r}.')


def check_decay(name: str, value: Any, *, factory: str = 'cbp.cbp') -> None:
  check_in_range(name, value, 0.0, 1.0, factory=factory)


def check_mean_decay(value: Any) -> None:
  """M2's mean EMA decay: one number in ``[0, 1)``, a tracer of one, no
  schedule (no optax factory takes it, so inject_hyperparams cannot)."""
  if callable(value) and not isinstance(value, (jax.Array, np.ndarray)):
    raise TypeError(
        f'mean_decay must be a number in [0, 1), got the callable {value!r}. '
        'The centering means take one decay per transport; cbp.cbp has no '
        'mean_decay, so optax.inject_hyperparams cannot schedule it. To '
        'schedule it, run the transport yourself after the optimizer update '
        'with this step\'s value, transport(..., '
        'mean_decay=schedule(step)) of your framework\'s package; inside '
        'jit a traced value is accepted.'
    )
  check_decay('mean_decay', value)


def check_positive(name: str, value: Any, *, factory: str = 'cbp.cbp') -> None:
  check_in_range(name, value, 0.0, math.inf, low_inclusive=False,
                 factory=factory)


def check_nonnegative(name: str, value: Any, *, schedule_ok: bool = False,
                      factory: str = 'cbp.cbp') -> None:
  check_in_range(name, value, 0.0, math.inf, schedule_ok=schedule_ok,
                 factory=factory)


def short_repr(value: Any, limit: int = 80) -> str:
  text = repr(value)
  return text if len(text) <= limit else text[:limit - 3] + '...'


def is_array(value: Any) -> bool:
  """A JAX or NumPy array, or a tracer of one."""
  return isinstance(value, (jax.Array, np.ndarray, jax.core.Tracer))


def is_injected_value(value: Any) -> bool:
  """Whether ``value`` is what ``optax.inject_hyperparams`` passes a factory
  for a function it took for a schedule: the function's value at the step
  count, a number or an array (a tracer under ``jit``)."""
  return isinstance(value, (numbers.Number, np.generic)) or is_array(value)


def static_args_remedy(factory: Optional[str], names: Any) -> str:
  """Why a function argument arrived as a value, and the call that fixes it.

  ``factory`` is the factory ``inject_hyperparams`` wrapped, or None where
  it is not known (the call then names a placeholder).
  """
  names = tuple(names)
  them = 'it' if len(names) == 1 else 'them'
  passed = tuple(f'{n}=...' for n in names)
  call = (f'optax.inject_hyperparams({factory or "factory"}, '
          f'static_args={names!r})({_arguments(factory or "", *passed)})')
  if factory is None:
    call += (', where factory is the one you wrapped (cbp.cbp, '
             'cbp.cbp_robust, cbp.equalize, ...)')
  return (
      'optax.inject_hyperparams calls every function argument that is not '
      'in its static_args as a schedule of the step count and passes the '
      f'factory what the function returned. Name {them} there: {call}.'
  )


def check_function(
    name: str, value: Any, *, optional: bool = False,
    factory: Optional[str] = None,
) -> None:
  """A callable argument, or None when ``optional``; with ``factory``, a
  number or array (``inject_hyperparams``' value of a function) gets the
  ``static_args`` remedy.

  Raises:
    TypeError: ``value`` is not callable (nor None, when ``optional``).
  """
  if callable(value) or (optional and value is None):
    return
  what = 'a function or None' if optional else 'a function'
  message = (f'{name} must be {what}, got the {type(value).__name__} '
             f'{short_repr(value)}.')
  if factory is not None and is_injected_value(value):
    message += ' ' + static_args_remedy(factory, (name,))
  raise TypeError(message)


def check_callable(
    name: str, value: Any, *, factory: Optional[str] = None
) -> None:
  """An optional callable: :func:`check_function` with ``optional=True``."""
  check_function(name, value, optional=True, factory=factory)


def schedule_call_error(argument: str, function: str, value: Any) -> TypeError:
  """The error of a ``(path, leaf)`` preset called with one argument: the
  step count, from ``optax.inject_hyperparams`` taking it for a schedule."""
  return TypeError(
      f'{function} takes (path, leaf) but was called with one argument, '
      f'{short_repr(value)}, as {argument}. '
      + static_args_remedy(None, (argument,))
  )


def check_params_match(name: str, updates: Any, params: Any) -> None:
  """Refuses ``params`` (when given) without the leaves and shapes of
  ``updates``, in leaf order: they are what the updates apply to."""
  if params is None:
    return
  paths_and_leaves = jax.tree_util.tree_flatten_with_path(updates)[0]
  got = [tuple(jnp.shape(g)) for _, g in paths_and_leaves]
  expected = [tuple(jnp.shape(p)) for p in jax.tree.leaves(params)]
  if got == expected:
    return
  if len(got) != len(expected):
    detail = f'{len(got)} gradient leaves, {len(expected)} parameters'
  else:
    lines = [
        f'gradient {jax.tree_util.keystr(path)} has shape {g}, its '
        f'parameter {e}'
        for (path, _), g, e in zip(paths_and_leaves, got, expected) if g != e
    ]
    if len(lines) > 5:
      lines = lines[:5] + [f'... and {len(lines) - 5} more']
    detail = '; '.join(lines)
  raise ValueError(
      f'{name}: the gradients do not match the parameters passed to update '
      f'({detail}). update(updates, state, params) takes the parameters the '
      'updates apply to, leaf for leaf.'
  )


def check_bool(name: str, value: Any) -> None:
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f'{name} must be True or False, got {value!r}.')


def check_stats_dtype(
    value: Any, *, factory: str = 'cbp.cbp'
) -> Optional[jnp.dtype]:
  """``stats_dtype`` as a dtype; None stays None; only real floats pass."""
  if value is None:
    return None
  if is_array(value):
    # jnp.float32 is callable: inject_hyperparams took it for a schedule.
    raise TypeError(
        f'stats_dtype must be a floating-point dtype, got the array '
        f'{short_repr(value)}. Pass it as a string (stats_dtype=\'float32\', '
        '\'float64\', \'bfloat16\'), '
        'which optax.inject_hyperparams leaves alone, or: '
        + static_args_remedy(factory, ('stats_dtype',))
    )
  return float_dtype('stats_dtype', value, ': the statistics are square '
                     'roots and ratios of squared gradients.')


def float_dtype(name: str, value: Any, why: str = '.') -> jnp.dtype:
  """``value`` as a real floating-point dtype, or a ``TypeError`` that names
  ``name`` and ends with ``why``."""
  try:
    dtype = jnp.dtype(value)
  except TypeError as e:
    raise TypeError(
        f'{name} must be a floating-point dtype, got {value!r}.') from e
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
        f'{name} must be a real floating-point dtype (float32, float64, '
        f'bfloat16...), got {dtype}{why}')
  return dtype


def check_float_leaves(name: str, tree: Any) -> None:
  """Refuses non-floating leaves, which a scaled update would truncate."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    dtype = jax.numpy.result_type(leaf)
    if not jax.numpy.issubdtype(dtype, jax.numpy.floating):
      raise ValueError(
          f'{name}: parameter {jax.tree_util.keystr(path)} has dtype {dtype}; '
          'CBP updates real floating-point parameters only. Keep integer, '
          'boolean or complex leaves out of the optimizer with optax.masked '
          'or optax.partition.'
      )


def check_real_gradients(name: str, tree: Any) -> None:
  """Refuses complex gradients: CBP would silently drop the imaginary part."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    dtype = jax.numpy.result_type(leaf)
    if jax.numpy.issubdtype(dtype, jax.numpy.complexfloating):
      raise TypeError(
          f'{name}: gradient {jax.tree_util.keystr(path)} is complex '
          f'({dtype}) but CBP optimizes real parameters; the imaginary part '
          'would be dropped. Differentiate a real loss of real parameters '
          '(for a complex model, split each parameter into real and '
          'imaginary float leaves).'
      )


def output_dtype(grad: Any, param: Any = None) -> jnp.dtype:
  """The dtype of an update: the gradient's; for a non-float gradient, the
  parameter's (when given) or float32 promoted with the gradient's."""
  dtype = jnp.result_type(grad)
  if jnp.issubdtype(dtype, jnp.floating):
    return dtype
  if param is not None:
    param_dtype = jnp.result_type(param)
    if jnp.issubdtype(param_dtype, jnp.floating):
      return param_dtype
  return jnp.promote_types(dtype, jnp.float32)
