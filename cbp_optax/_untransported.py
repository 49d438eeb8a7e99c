"""A warning for a centered model that trains without ever being transported.

A centered layer records the mean of its training inputs and counts the
positions it pooled (``batch_count``); the transport uses the mean and sets
the count back to zero. A step that forgets the transport leaves ``mu`` at
zero, and the model trains exactly as the plain one. Its count then only
grows: :func:`check` passes the count through a ``lax.cond`` whose taken
branch, once, in the call whose count crosses :data:`CALLS` calls' worth of
positions without a transport, is a ``pure_callback`` that warns and returns
the count as it was. No computed number changes; a step that transports
every step (or every few steps) never crosses it, and a step that transports
in the same program discards the count, so XLA removes the check. The
fused train steps keep no count the forward pass wrote (their transport
sets it to zero): a count they kept, or read in their finiteness check,
would keep a host callback per centered layer and step, measured at
1.4-1.5x AdamW's step on a centered 784-512-512-10 MLP on CPU, against
1.0-1.1x without it.

The check works under ``jit``, ``vmap`` (a ``custom_vmap`` rule reduces the
predicate over the mapped axes, so a batched predicate never turns the
``cond`` into a select that calls back every time), ``scan`` and sharding
(under ``shard_map`` each device may call back; the warning is raised once
per process). Host callbacks cannot be serialized: a program traced while
:class:`UntransportedWarning` is ignored (``warnings`` filters) has no
check, which is the way to ``jax.export`` a training-mode forward pass
(``jit`` caches a trace per function: ignore it before the first trace).
Evaluation records nothing and so has no check either.

An eager call (no trace) decides in Python, and a ``warnings`` filter that
turns the warning into an error raises :class:`UntransportedWarning` itself.
In a compiled program the warning is raised inside the host callback, so
such a filter surfaces as the runtime's callback error, whose message holds
the warning: no exception raised in a callback reaches the caller as itself.
"""

from __future__ import annotations

import functools
import threading
import warnings

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

# Training calls without a transport after which a layer warns: far above any
# transport interval or number of calls per step in practice, far below the
# length of a training run.
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
  """A centered layer trained for many calls without a transport.

  Its ``mu`` has not moved since the last transport (from zero if there was
  none), so centering does nothing. Ignoring this category with
  ``warnings.filterwarnings`` before tracing also removes the check from the
  compiled program (needed to ``jax.export`` a training-mode forward pass).
  """


def message(framework: str) -> str:
  return (
      f'cbp_optax.{framework}: a centered layer recorded {CALLS} training '
      'calls without a transport: its mu has not moved, so centering does '
      'nothing (never transported, the model trains exactly as the plain '
      f'one). To center it, {_FIXES[framework]}.'
  )


_warned: set[str] = set()
_lock = threading.Lock()


def _warn_once(framework: str) -> None:
  with _lock:
    if framework in _warned:
      return
    _warned.add(framework)
  warnings.warn(message(framework), UntransportedWarning, stacklevel=2)


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
  """``pass_through(crossed, count)``: ``count``; warns when any is crossed.

  The warning comes from a ``pure_callback`` that returns the count as it
  is, in the branch of a ``cond`` taken once: its result is the count the
  layer stores, so XLA keeps it, and the program has no effect (a
  ``debug.callback`` is one, and effects take every call of ``jit`` off its
  C++ fast path: 10 times the dispatch time of a small step on CPU).
  """

  def warn(count):
    shape = jax.ShapeDtypeStruct(count.shape, count.dtype)
    return jax.pure_callback(functools.partial(_warn_and_return, framework),
                             shape, count)

  @jax.custom_batching.custom_vmap
  def pass_through(crossed: jax.Array, count: jax.Array) -> jax.Array:
    return lax.cond(jnp.any(crossed), warn, lambda count: count, count)

  @pass_through.def_vmap
  def _vmap(axis_size, in_batched, crossed, count):
    # Once over the whole batch: a batched predicate would turn the cond
    # into a select, which calls back at every call.
    if not in_batched[1]:
      count = jnp.broadcast_to(count, (axis_size,) + count.shape)
    return pass_through(crossed, count), True

  # The identity to differentiation (a pure_callback has no JVP), for
  # gradients taken with respect to every variable collection.
  @jax.custom_jvp
  def differentiable(crossed: jax.Array, count: jax.Array) -> jax.Array:
    return pass_through(crossed, count)

  @differentiable.defjvp
  def _jvp(primals, tangents):
    return differentiable(*primals), tangents[1]

  return differentiable


def check(before: jax.Array, after: jax.Array, positions: int,
          framework: str) -> jax.Array:
  """``after``, with a warning once it crosses :data:`CALLS` calls' worth.

  Store the result as the layer's count: the check lives as long as the
  count does (a step that transports discards it, and XLA the check).

  Args:
    before: the layer's ``batch_count`` before this call.
    after: after this call (``before + positions``).
    positions: the input positions this call pooled (static).
    framework: ``'nnx'`` or ``'linen'``, for the fix the warning names.
  """
  if positions <= 0 or _ignored(framework):
    return after
  threshold = CALLS * positions
  if not any(isinstance(x, jax.core.Tracer) for x in (before, after)):
    # An eager call: decided here, in Python, so that a filter turning the
    # warning into an error raises it as itself (raised in a host callback,
    # it reaches the caller as the runtime's callback error).
    if bool(jnp.any((before < threshold) & (after >= threshold))):
      _warn_once(framework)
    return after
  return _pass_through(framework)(
      (before < threshold) & (after >= threshold), after)
