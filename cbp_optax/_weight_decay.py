"""Decoupled weight decay: the default mask, and the checks of its arguments."""

from __future__ import annotations

from typing import Any

import jax
import optax

from cbp_optax import _checks
from cbp_optax._paths import path_names

# Leaves of rank >= 2 that are not matrices by name.
_NOT_MATRICES = frozenset({'bias', 'scale', 'embedding'})

DEFAULT = ('every leaf of rank >= 2 but those named bias, scale or embedding '
           '(stacked biases and norm scales, embedding tables)')


def matrices(params: Any) -> Any:
  """The default mask: True on every leaf of rank >= 2 but those named
  ``bias``, ``scale`` or ``embedding``."""
  def is_matrix(path, leaf):
    names = [n for n in path_names(path) if n != 'value']
    return jax.numpy.ndim(leaf) >= 2 and not (
        names and names[-1] in _NOT_MATRICES)
  return jax.tree_util.tree_map_with_path(is_matrix, params)


class Mask(_checks.Constraint):
  """A tree of bools or a function of the parameters, or None; not one leaf
  (what a mask function ``inject_hyperparams`` called returns)."""

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


MASK_NEEDS_DECAY = _checks.needs('mask', 'weight_decay', 'mask selects the '
                                 'parameters that weight_decay applies to')


def decayed_weights(weight_decay: Any, mask: Any
                    ) -> list[optax.GradientTransformation]:
  """``optax.add_decayed_weights`` on ``mask`` (None: :func:`matrices`), or
  nothing for ``weight_decay=None``."""
  if weight_decay is None:
    return []
  return [optax.add_decayed_weights(weight_decay,
                                    matrices if mask is None else mask)]
