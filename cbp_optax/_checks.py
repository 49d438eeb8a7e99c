"""Construction-time validation of hyperparameters and input trees.

Hyperparameters may arrive as tracers or arrays (``optax.inject_hyperparams``
turns numeric arguments into state); only concrete values can be checked, and
those are checked eagerly so that a bad value fails at construction time with
a message naming the argument, never deep inside ``jit``. What is static even
for a tracer (its shape and dtype) is checked always.
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


def check_scalar(
    name: str, value: Any, *, schedule_ok: bool = False
) -> Optional[float]:
  """Refuses anything but one real number (or a tracer of one).

  Args:
    name: the argument's name, for the message.
    value: a Python int or float, a real scalar NumPy or JAX array, a tracer
      of one (from ``optax.inject_hyperparams``), or, when ``schedule_ok``, a
      callable schedule.
    schedule_ok: whether a callable (an optax schedule) is accepted.

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
    raise TypeError(
        f'{name} must be a number, got the callable {value!r}. Only '
        'learning_rate takes a schedule directly; to schedule '
        f'{name}, wrap the factory: optax.inject_hyperparams(cbp.cbp)('
        f'learning_rate=..., {name}=schedule), which evaluates the schedule '
        'at every step and passes its value in.'
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
) -> None:
  """Raises unless ``value`` is one real number in the given interval.

  Raises:
    TypeError: ``value`` is not a number (see :func:`check_scalar`).
    ValueError: a non-scalar array, or a concrete value outside the interval
      (NaN included).
  """
  if callable(value) and not isinstance(value, (jax.Array, np.ndarray)):
    check_scalar(name, value, schedule_ok=schedule_ok)
    return
  if isinstance(value, numbers.Real) and not isinstance(value, bool):
    number = float(value)  # NaN and infinities are judged by the interval
  else:
    number = check_scalar(name, value)
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


def check_decay(name: str, value: Any) -> None:
  check_in_range(name, value, 0.0, 1.0)


def check_mean_decay(value: Any) -> None:
  """M2's mean EMA decay: one number in ``[0, 1)``, a tracer of one, no
  schedule (no optax factory takes it, so inject_hyperparams cannot)."""
  if callable(value) and not isinstance(value, (jax.Array, np.ndarray)):
    raise TypeError(
        f'mean_decay must be a number in [0, 1), got the callable {value!r}. '
        'The centering means take one decay per transport; cbp.cbp has no '
        'mean_decay, so optax.inject_hyperparams cannot schedule it. To '
        'schedule it, run the transport yourself after the optimizer update '
        'with this step\'s value: cbp.nnx.transport(model, '
        'mean_decay=schedule(step)) or cbp.linen.transport(params, '
        'centering, mean_decay=schedule(step)); inside jit a traced value '
        'is accepted.'
    )
  check_decay('mean_decay', value)


def check_positive(name: str, value: Any) -> None:
  check_in_range(name, value, 0.0, math.inf, low_inclusive=False)


def check_nonnegative(name: str, value: Any, *, schedule_ok: bool = False):
  check_in_range(name, value, 0.0, math.inf, schedule_ok=schedule_ok)


def check_count(name: str, value: Any, *, minimum: int = 0,
                maximum: Optional[int] = None) -> int:
  """A count or size: a Python or NumPy integer (not a bool, float or
  string) in ``[minimum, maximum]``; returned as an int."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(
      value, (numbers.Integral, np.integer)):
    raise TypeError(
        f'{name} must be an integer >= {minimum}, got the '
        f'{type(value).__name__} {value!r}.'
    )
  value = int(value)
  if value < minimum or (maximum is not None and value > maximum):
    bound = (f'in [{minimum}, {maximum}]' if maximum is not None
             else f'>= {minimum}')
    raise ValueError(f'{name} must be an integer {bound}, got {value}.')
  return value


def check_function(name: str, value: Any) -> None:
  """A required callable (a loss function)."""
  if not callable(value):
    raise TypeError(
        f'{name} must be a function, got the {type(value).__name__} '
        f'{value!r}.')


def check_callable(name: str, value: Any) -> None:
  if value is not None and not callable(value):
    raise ValueError(
        f'{name} must be a callable or None, got {type(value).__name__}.'
    )


def check_bool(name: str, value: Any) -> None:
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f'{name} must be True or False, got {value!r}.')


def check_stats_dtype(value: Any) -> Optional[jnp.dtype]:
  """``stats_dtype`` as a dtype; None stays None; only real floats pass."""
  if value is None:
    return None
  try:
    dtype = jnp.dtype(value)
  except TypeError as e:
    raise TypeError(
        f'stats_dtype must be a floating-point dtype, got {value!r}.'
    ) from e
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
        f'stats_dtype must be a real floating-point dtype (float32, float64, '
        f'bfloat16...), got {dtype}: the statistics are square roots and '
        'ratios of squared gradients.'
    )
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
