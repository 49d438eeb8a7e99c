"""A warning for a centered model that trains without ever being transported.

The transport zeroes a layer's ``batch_count``; without it the count only
grows, and :func:`check` warns once it crosses :data:`CALLS` calls' worth
(a ``pure_callback`` in a ``lax.cond``, returning the count unchanged). A
program that transports discards the count, so XLA removes the check. A
program traced while :class:`UntransportedWarning` is ignored has none (to
``jax.export`` it); in a compiled program an error filter surfaces as the
runtime's callback error (its message ends with the warning's text), in an
eager call as the warning itself; either leaves the warn-once unspent.
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

# Training calls without a transport after which a layer warns.
CALLS = 1000

_FIXES = {
    'nnx': ('call cbp.nnx.transport(model, optimizer=optimizer) after '
            'optimizer.update(model, grads) in the training step, or use '
            'cbp.nnx.train_step'),
    'linen': ('call params, centering, opt_state = cbp.linen.transport('
              "params, centering, opt_state=opt_state) after the update (with "
              "the 'centering' collection the forward pass returned), or use "
              'cbp.linen.train_step'),
}


class UntransportedWarning(UserWarning):
  """A centered layer trained for many calls without a transport: its ``mu``
  has not moved, so centering does nothing."""


def message(framework: str) -> str:
  return (
      f'cbp_optax.{framework}: a centered layer recorded {CALLS} training '
      'calls without a transport: its mu has not moved, so centering does '
      'nothing (never transported, the model trains exactly as the plain '
      f'one). To center it, {_FIXES[framework]}.')


_warned: set[str] = set()
_lock = threading.Lock()


def _warn_once(framework: str) -> None:
  with _lock:
    if framework in _warned:
      return
    # An error filter raises here: that shows no warning, so the once stays.
    warnings.warn(message(framework), UntransportedWarning, stacklevel=2)
    _warned.add(framework)


def _ignored(framework: str) -> bool:
  """Whether the ``warnings`` filters in force ignore the warning."""
  text = message(framework)
  for action, pattern, category, module, lineno in warnings.filters:
    if (issubclass(UntransportedWarning, category)
        and (pattern is None or pattern.match(text))
        and (module is None or module.match(__name__))
        and lineno == 0):
      return action == 'ignore'
  return False


def _warn_and_return(framework: str, count: np.ndarray) -> np.ndarray:
  _warn_once(framework)
  return np.asarray(count)


@functools.cache
def _pass_through(framework: str):
  """``pass_through(crossed, count)``: ``count``; warns when any is crossed."""

  def warn(count):
    shape = jax.ShapeDtypeStruct(count.shape, count.dtype)
    return jax.pure_callback(functools.partial(_warn_and_return, framework),
                             shape, count)

  @jax.custom_batching.custom_vmap
  def pass_through(crossed: jax.Array, count: jax.Array) -> jax.Array:
    return lax.cond(jnp.any(crossed), warn, lambda count: count, count)

  @pass_through.def_vmap
  def _vmap(axis_size, in_batched, crossed, count):
    # Once over the whole batch (a batched predicate would call back always).
    if not in_batched[1]:
      count = jnp.broadcast_to(count, (axis_size,) + count.shape)
    return pass_through(crossed, count), True

  # The identity to differentiation (a pure_callback has no JVP).
  @jax.custom_jvp
  def differentiable(crossed: jax.Array, count: jax.Array) -> jax.Array:
    return pass_through(crossed, count)

  @differentiable.defjvp
  def _jvp(primals, tangents):
    return differentiable(*primals), tangents[1]

  return differentiable


# A count ``check`` returned in the trace in progress -> the count the
# layer's first use in that trace read (its uses in one program chain).
_entries: dict[int, tuple[weakref.ref, Any]] = {}


def _entry(before: jax.Array) -> jax.Array:
  """The count this program read before its first use of the layer."""
  found = _entries.get(id(before))
  return found[1] if found is not None and found[0]() is before else before


def _remember(after: jax.Array, entry: jax.Array) -> None:
  key = id(after)

  def forget(ref):
    if _entries.get(key, (None,))[0] is ref:
      del _entries[key]

  _entries[key] = (weakref.ref(after, forget), entry)


def check(before: jax.Array, after: jax.Array, positions: int,
          framework: str) -> jax.Array:
  """``after`` (store it as the layer's count), warning once it crosses
  :data:`CALLS` calls' worth.

  In a traced program the uses of one layer chain (a recurrence unrolled in
  one forward pass): the count the program read first decides, so that one
  program warns, and only when calls before it left the count high. (A
  ``lax.scan`` body reads its carry: each step is one call.)

  Args:
    before: the layer's ``batch_count`` before this call.
    after: after this call (``before + positions``).
    positions: the input positions this call pooled (static).
    framework: ``'nnx'`` or ``'linen'``, for the fix the warning names.
  """
  if positions <= 0 or _ignored(framework):
    return after
  if not any(isinstance(x, jax.core.Tracer) for x in (before, after)):
    # Eager: decided in Python, so an error filter raises the warning itself.
    threshold = CALLS * positions
    if bool(jnp.any((before < threshold) & (after >= threshold))):
      _warn_once(framework)
    return after
  entry = _entry(before)
  # The program whose entry count first reaches CALLS - 1 calls' worth.
  start = (CALLS - 1) * positions
  crossed = (entry >= start) & (entry < start + (after - entry))
  after = _pass_through(framework)(crossed, after)
  _remember(after, entry)
  return after
