"""Flax's trees as the transport's optimizer-state walks see them: NNX
``Variable`` boxes, ``nnx.State`` and ``FrozenDict`` mappings (adapters only)."""

from typing import Any

import flax
from flax import nnx

from cbp_optax import _opt_state


def _rebuild(tree: Any, key: Any, child: Any) -> Any:
  """``tree`` with ``child`` at ``key``, for Flax's mappings; else None."""
  if isinstance(tree, flax.core.FrozenDict):
    return tree.copy({key: child})
  if isinstance(tree, nnx.State):
    # Keep raw nested dicts: State's wrappers would change the pytree.
    raw = tree.raw_mapping
    if isinstance(child, nnx.State) and not isinstance(raw[key], nnx.State):
      child = child.raw_mapping
    return type(tree)({**raw, key: child})
  return None


FLAX = _opt_state.TreeKind(
    is_box=lambda node: isinstance(node, nnx.Variable),
    unbox=nnx.Variable.get_value,
    store=lambda variable, value: variable.set_value(value, index=...),
    mappings=(nnx.State, flax.core.FrozenDict), rebuild=_rebuild)
