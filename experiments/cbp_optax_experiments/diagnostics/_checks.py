"""Argument checks and the statistics dtype of the diagnostics.

Local copies of the library's rules, so the diagnostics use only the public
API of ``cbp_optax``: counts are Python or NumPy integers (never bools),
flags are bools, and statistics are float32 unless a leaf is float64.
"""

from __future__ import annotations

import numbers
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np


def check_count(name: str, value: Any, *, minimum: int = 0,
                maximum: Optional[int] = None) -> int:
  """Checks a count: an integer (not a bool) in ``[minimum, maximum]``.

  Args:
    name: the argument's name, for the error message.
    value: the value given.
    minimum: the smallest allowed value.
    maximum: the largest allowed value, or None for no bound.

  Returns:
    ``value`` as an int.
  """
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


def check_bool(name: str, value: Any) -> None:
  """Raises TypeError unless ``value`` is a Python or NumPy bool."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f'{name} must be True or False, got {value!r}.')


def stats_dtype_for(tree: Any) -> jnp.dtype:
  """Float32 statistics, or float64 when any leaf is float64.

  Args:
    tree: the pytree whose floating leaves set the dtype.

  Returns:
    The promoted floating dtype, at least float32.
  """
  dtype = jnp.dtype(jnp.float32)
  for leaf in jax.tree.leaves(tree):
    leaf_dtype = jnp.result_type(leaf)
    if jnp.issubdtype(leaf_dtype, jnp.floating):
      dtype = jnp.promote_types(dtype, leaf_dtype)
  return dtype
