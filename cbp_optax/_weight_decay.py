"""Decoupled weight decay: the default mask, and the checks of its arguments.

One convention for :func:`cbp_optax.cbp`, :func:`cbp_optax.cbp_robust` and
:func:`cbp_optax.recommended`: ``weight_decay=None`` leaves the decay out of
the chain; ``mask=None`` decays the matrices (:func:`matrices`) of any
parameter tree; a mask is a tree of bools or a function of the parameters,
as in ``optax.add_decayed_weights``.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from cbp_optax import _checks
from cbp_optax._paths import path_names

# Leaves of rank >= 2 that are not matrices by name: a stacked (or
# multi-head) bias, a stacked norm scale, and an embedding table.
_NOT_MATRICES = frozenset({'bias', 'scale', 'embedding'})

DEFAULT = ('every leaf of rank >= 2 but those named bias, scale or embedding '
           '(stacked biases and norm scales, embedding tables)')


def matrices(params: Any) -> Any:
  """The default mask: True on every leaf of rank >= 2 (dense and
  convolution kernels of any framework, stacked or not, low-rank factors),
  False on vectors and scalars and on the leaves named ``bias``, ``scale``
  or ``embedding``."""
  def is_matrix(path, leaf):
    names = [n for n in path_names(path) if n != 'value']
    return jax.numpy.ndim(leaf) >= 2 and not (
        names and names[-1] in _NOT_MATRICES)
  return jax.tree_util.tree_map_with_path(is_matrix, params)


class Mask(_checks.Constraint):
  """A tree of bools or a function of the parameters, as in
  ``optax.add_decayed_weights``, or None; not one leaf (a bool, a number,
  an array: what a mask function that ``inject_hyperparams`` called with
  the step count returns)."""

  def arrived_as_value(self, value: Any) -> bool:
    if value is None or callable(value):
      return False
    leaves = jax.tree.leaves(value)
    return len(leaves) == 1 and leaves[0] is value

  def judge(self, spec: _checks.Spec, name: str, value: Any) -> None:
    if self.arrived_as_value(value):
      raise spec.error(TypeError, (
          f'{name} must be a tree of booleans shaped like the parameters or a'
          f' function of them, got {_checks.describe(value)}. Leave {name} out to'
          f' decay {DEFAULT}, or pass weight_decay=None to decay nothing; if '
          'a function was passed, ' + _checks.static_args_remedy(spec, (name,))))


# mask only with a weight decay: without one it would be silently unused.
MASK_NEEDS_DECAY = _checks.needs(
    'mask', 'weight_decay',
    'mask selects the parameters that weight_decay applies to')


def decayed_weights(weight_decay: Any, mask: Any
                    ) -> list[optax.GradientTransformation]:
  """The chain's decay: none for ``weight_decay=None``, else
  ``optax.add_decayed_weights`` on ``mask`` (None: :func:`matrices`)."""
  if weight_decay is None:
    return []
  return [optax.add_decayed_weights(weight_decay,
                                    matrices if mask is None else mask)]
