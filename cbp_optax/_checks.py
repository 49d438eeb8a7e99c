"""Construction-time validation of hyperparameters.

Hyperparameters may arrive as tracers or arrays (``optax.inject_hyperparams``
turns numeric arguments into state); only concrete values can be checked, and
those are checked eagerly so that a bad value fails at construction time with
a message naming the argument, never deep inside ``jit``.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import jax
import numpy as np


def concrete_float(value: Any) -> Optional[float]:
  """Returns ``value`` as a Python float, or None when it is not concrete."""
  if callable(value) or isinstance(value, jax.core.Tracer):
    return None
  try:
    array = np.asarray(value)
  except Exception:  # pylint: disable=broad-except
    return None
  if array.shape != () or not np.issubdtype(array.dtype, np.number):
    return None
  return float(array)


def check_in_range(
    name: str,
    value: Any,
    low: float,
    high: float,
    *,
    low_inclusive: bool = True,
    high_inclusive: bool = False,
) -> None:
  """Raises ValueError unless ``value`` lies in the given interval."""
  number = concrete_float(value)
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


def check_positive(name: str, value: Any) -> None:
  check_in_range(name, value, 0.0, math.inf, low_inclusive=False)


def check_callable(name: str, value: Any) -> None:
  if value is not None and not callable(value):
    raise ValueError(
        f'{name} must be a callable or None, got {type(value).__name__}.'
    )


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
