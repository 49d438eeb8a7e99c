"""Decoupled weight decay: the default mask, and the checks of its arguments.

One convention for :func:`cbp_optax.cbp`, :func:`cbp_optax.cbp_robust` and
:func:`cbp_optax.recommended`: ``weight_decay=None`` leaves the decay out of
the chain; ``mask=None`` decays the matrices (:func:`matrices`) of any
parameter tree; a mask is a tree of bools or a function of the parameters,
as in ``optax.add_decayed_weights``.
"""

from __future__ import annotations

from typing import Any, Optional

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


def mask_error(factory: str, value: Any) -> Optional[str]:
  """What is wrong with a ``mask`` that is one leaf (a bool, a number, an
  array, e.g. a mask function ``inject_hyperparams`` called with the step
  count), or None for a tree or a function."""
  if value is None or callable(value):
    return None
  leaves = jax.tree.leaves(value)
  if len(leaves) != 1 or leaves[0] is not value:
    return None
  return (
      f'mask must be a tree of booleans shaped like the parameters or a '
      f'function of the parameters returning one, got the '
      f'{type(value).__name__} {_checks.short_repr(value)}. Leave mask out '
      f'to decay {DEFAULT}; pass weight_decay=None to decay nothing. If a '
      'function was passed: '
      + _checks.static_args_remedy(factory, ('mask',))
  )


def check_pair(factory: str, weight_decay: Any, mask: Any) -> None:
  """Refuses a ``mask`` without ``weight_decay``.

  Raises:
    ValueError: ``mask`` given with ``weight_decay=None``.
  """
  if mask is not None and weight_decay is None:
    raise ValueError(
        f'{factory}: mask selects the parameters that weight_decay applies '
        'to, but weight_decay is None (no decay). Pass weight_decay=..., or '
        'leave mask out.')


def decayed_weights(weight_decay: Any, mask: Any
                    ) -> list[optax.GradientTransformation]:
  """The chain's decay: none for ``weight_decay=None``, else
  ``optax.add_decayed_weights`` on ``mask`` (None: :func:`matrices`)."""
  if weight_decay is None:
    return []
  return [optax.add_decayed_weights(weight_decay,
                                    matrices if mask is None else mask)]
