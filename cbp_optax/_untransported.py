"""A warning for a centered model that trains without ever being transported.

The transport zeroes a layer's ``batch_count``; without it the count only
grows, and :func:`check` warns once it crosses :data:`CALLS` calls' worth
at another step (another kernel) than the layer started recording at (a
``pure_callback`` in a ``lax.cond``, returning the count unchanged). A
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


class LayerKey:
  """A layer's key for :func:`check`, kept as a static attribute of the
  module: the copies a transform makes of it (an eager ``nnx.grad`` works on
  a new module at every call) share the object, so the start it records
  survives them. Any two compare equal, so that the graph definitions of two
  otherwise equal models stay equal."""

  __slots__ = ('started',)

  def __init__(self):
    self.started = None

  def __eq__(self, other: Any) -> bool:
    return isinstance(other, LayerKey)

  def __hash__(self) -> int:
    return hash(LayerKey)

  def __repr__(self) -> str:
    return 'LayerKey()'


# A layer's step token when it last started recording with mu at zero: its
# kernel fingerprint (the sum of its entries, which the optimizer changes
# between steps only), or, where the kernel is traced by an eager transform
# (nnx.grad), a weak reference to the module instance the call ran on (one
# per call). Kept on a LayerKey, else here by key.
_started: dict[Any, Any] = {}


def _same_step(started: Any, token: Any) -> bool:
  if isinstance(started, weakref.ref) or isinstance(token, weakref.ref):
    return (isinstance(started, weakref.ref) and isinstance(token, weakref.ref)
            and started() is not None and started() is token())
  return np.array_equal(started, token)


def _decide(framework: str, layer: Any, start: np.ndarray,
            token: Any) -> np.ndarray:
  """Warns when ``layer`` fired at another step than it started at; 0."""
  if not isinstance(token, weakref.ref):
    token = np.asarray(token)
  with _lock:
    keyed = isinstance(layer, LayerKey)
    started = layer.started if keyed else _started.get(layer)
    if bool(np.any(start)) or started is None:
      if keyed:
        layer.started = token
      else:
        _started[layer] = token
      return np.int32(0)
  if not _same_step(started, token):
    _warn_once(framework)
  return np.int32(0)


def _pass_through(framework: str, layer: Any):
  """``pass_through(fires, start, kernel, count)``: ``count``; calls
  :func:`_decide` back when any fires."""

  def fire(start, kernel, count):
    # An int32 zero added: a float64 result would fail the callback's dtype
    # check outside an x64 context.
    zero = jax.pure_callback(
        functools.partial(_decide, framework, layer),
        jax.ShapeDtypeStruct((), jnp.int32), start,
        jnp.sum(kernel, dtype=jnp.float32))
    return count + zero.astype(count.dtype)

  @jax.custom_batching.custom_vmap
  def pass_through(fires, start, kernel, count):
    return lax.cond(jnp.any(fires), fire, lambda s, k, count: count, start,
                    kernel, count)

  @pass_through.def_vmap
  def _vmap(axis_size, in_batched, fires, start, kernel, count):
    # Once over the whole batch (a batched predicate would call back always).
    if not in_batched[3]:
      count = jnp.broadcast_to(count, (axis_size,) + count.shape)
    return pass_through(fires, start, kernel, count), True

  # The identity to differentiation (a pure_callback has no JVP).
  @jax.custom_jvp
  def differentiable(fires, start, kernel, count):
    return pass_through(fires, start, kernel, count)

  @differentiable.defjvp
  def _jvp(primals, tangents):
    return differentiable(*primals), tangents[3]

  return differentiable


def _level(count: jax.Array, threshold: int) -> jax.Array:
  """-1 below ``threshold``; ``k`` from ``2**k * threshold`` on."""
  ratio = jnp.maximum(count, threshold) / threshold
  return jnp.where(count >= threshold, jnp.floor(jnp.log2(ratio)), -1.0)


def check(before: jax.Array, after: jax.Array, positions: int,
          framework: str, layer: Any, mean: jax.Array,
          kernel: jax.Array, instance: Any = None) -> jax.Array:
  """``after`` (store it as the layer's count), warning once it crosses
  :data:`CALLS` calls' worth at another step than it started recording.

  While ``mu`` is at zero (never transported), the first recording call and
  each crossing of ``2**k`` times the threshold fire; a firing with another
  kernel than at the start (the optimizer moved it: another step) warns. A
  layer applied many times in one forward pass (a recurrence, unrolled or in
  a ``lax.scan``) fires with the kernel it started with, and a loop that
  transports records no start after its first.

  Args:
    before: the layer's ``batch_count`` before this call.
    after: after this call (``before + positions``).
    positions: the input positions this call pooled (static).
    framework: ``'nnx'`` or ``'linen'``, for the fix the warning names.
    layer: a key of the layer (static): a :class:`LayerKey`, or a hashable
      that every call of the layer gives alike.
    mean: the layer's ``mu``.
    kernel: the layer's kernel.
    instance: the module object this call runs on, which tells the steps
      apart where the kernel is traced but the count is not (an eager
      ``nnx.grad`` or ``jax.grad``: a new module at every call).
  """
  if positions <= 0 or _ignored(framework):
    return after
  threshold = CALLS * positions
  start = (before == 0) & (after > 0)
  fires = jnp.all(mean == 0) & jnp.any(
      start | (_level(after, threshold) > _level(before, threshold)))
  if not any(isinstance(x, jax.core.Tracer) for x in (before, after, mean)):
    # Eager: decided in Python, so an error filter raises the warning itself.
    if bool(fires):
      if not isinstance(kernel, jax.core.Tracer):
        token = jnp.sum(kernel, dtype=jnp.float32)
      elif instance is not None:
        token = weakref.ref(instance)
      else:
        return _pass_through(framework, layer)(fires, start, kernel, after)
      _decide(framework, layer, start, token)
    return after
  return _pass_through(framework, layer)(fires, start, kernel, after)
