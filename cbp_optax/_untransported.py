"""A warning for a centered model that trains without ever being transported.

On the host only: an NNX layer counts the concrete writes of its
``batch_count`` and reads the ``CALLS * 2**k``-th; above zero with no
transport of the layer ever run or traced (a write of its ``mu``), it warns.
An eager Linen call warns at :data:`CALLS` calls' worth with ``mu`` at zero
(a Linen ``jax.jit`` loop returns to no library code: unchecked).
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import numpy as np

CALLS = 1000  # training calls (NNX: count writes) without a transport
_FIXES = {
    'nnx': ('call cbp.nnx.transport(model, optimizer=optimizer) after '
            'optimizer.update(model, grads) in the training step, or use '
            'cbp.nnx.train_step'),
    'linen': ('call params, centering, opt_state = cbp.linen.transport('
              "params, centering, opt_state=opt_state) after the update (with "
              "the 'centering' collection the forward pass returned), or use "
              'cbp.linen.train_step'),
}
_warned: set[str] = set()


class UntransportedWarning(UserWarning):
  """A centered layer trained for many calls without a transport: its ``mu``
  has not moved, so centering does nothing."""


def _warn(framework: str) -> None:
  warnings.warn(
      f'cbp_optax.{framework}: a centered layer recorded {CALLS} training '
      'calls without a transport: its mu has not moved, so centering does '
      'nothing (never transported, the model trains exactly as the plain '
      f'one). To center it, {_FIXES[framework]}.', UntransportedWarning,
      stacklevel=3)
  _warned.add(framework)  # after: an error filter leaves the once unspent


def _concrete(*values: Any) -> bool:
  return not any(isinstance(v, jax.core.Tracer) or not getattr(
      v, 'is_fully_addressable', True) for v in values)


def check(framework: str, before: Any, after: Any, mean: Any) -> None:
  """An eager call's check: warns once the count ``after`` holds ``CALLS``
  calls of ``after - before`` positions with ``mean`` (``mu``) at zero."""
  if (framework not in _warned and _concrete(before, after, mean)
      and not np.any(mean)
      and np.any((after > before) & (after >= CALLS * (after - before)))):
    _warn(framework)


class LayerKey:
  """An NNX layer's count writes and whether a transport of it ran or was
  traced, in its count's and mean's ``untransported`` metadata (shared by
  the copies transforms make; all equal, as equal models' graphs are)."""
  __slots__ = ('writes', 'transported')
  __eq__ = lambda self, other: isinstance(other, LayerKey)
  __hash__ = lambda self: hash(LayerKey)
  __repr__ = lambda self: 'LayerKey()'

  def __init__(self):
    self.writes, self.transported = 0, False


def _recorded(count: Any) -> bool:  # the check's one read of the device
  return bool(np.any(np.asarray(count) > 0))


def _written(key: Any, count: Any) -> None:
  if key and not key.transported and 'nnx' not in _warned and _concrete(count):
    key.writes += 1
    steps, rest = divmod(key.writes, CALLS)
    if not rest and not steps & (steps - 1) and _recorded(count):
      _warn('nnx')


class CountWrites:
  """Mixin of NNX's count variable: counts its concrete writes."""

  def set_value(self, *args: Any, **kwargs: Any) -> None:
    super().set_value(*args, **kwargs)
    _written(self.get_metadata('untransported', None), self.get_raw_value())

  def set_raw_value(self, *args: Any, **kwargs: Any) -> None:
    super().set_raw_value(*args, **kwargs)
    _written(self.get_metadata('untransported', None), self.get_raw_value())


class MarksTransport:
  """Mixin of NNX's mean variable: a write (a transport) marks the layer."""

  def set_value(self, *args: Any, **kwargs: Any) -> None:
    super().set_value(*args, **kwargs)
    if (key := self.get_metadata('untransported', None)) is not None:
      key.transported = True
