"""A training state as the tree orbax stores, and back.

Typed PRNG keys become their key data and zero-size arrays empty nodes (orbax
refuses both); every array gets its SHA-256 digest, verified on restore; and
two trees of arrays (or of orbax's metadata) are compared entry by entry for
the mismatch messages (re-exported by :mod:`cbp_optax.checkpoint`).
"""

from __future__ import annotations

import hashlib
import math
import pathlib
from typing import Any

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from cbp_optax import _checks
from cbp_optax.blocks import path_name
from cbp_optax._checkpoint_io import CheckpointError

_DIGEST_BYTES = 32


def _is_key(leaf: Any) -> bool:
  return hasattr(leaf, 'dtype') and jnp.issubdtype(
      leaf.dtype, jax.dtypes.prng_key
  )


def _is_abstract(leaf: Any) -> bool:
  return isinstance(leaf, jax.ShapeDtypeStruct)


def _key_impl(leaf: Any) -> Any:
  if not _is_abstract(leaf):
    return jax.random.key_impl(leaf)
  impl = []
  jax.eval_shape(lambda key: impl.append(jax.random.key_impl(key)), leaf)
  return impl[0]


def _storable(leaf: Any) -> Any:
  # Typed keys have no NumPy dtype; their uint32 key data does.
  if _is_key(leaf):
    if _is_abstract(leaf):
      return jax.eval_shape(jax.random.key_data, leaf)
    return jax.random.key_data(leaf)
  if _is_abstract(leaf):
    # An abstract target (jax.eval_shape, nnx.eval_shape): shape, dtype and
    # sharding are all restore needs.
    return {} if math.prod(leaf.shape) == 0 else leaf
  array = jnp.asarray(leaf)
  # orbax refuses zero-size arrays (M1's energies when no leaf is in a block,
  # e.g. block_fn=no_blocks or an empty tree). They hold no data: stored as an
  # empty node, they are rebuilt from `like` at restore.
  return {} if array.size == 0 else array


def _raw_state_dict(tree: Any) -> Any:
  # Dataclasses (TrainState), NamedTuples (optax states) and NNX States
  # become nested dicts keyed by field names, which orbax stores and which
  # name every difference readably.
  state = flax.serialization.to_state_dict(tree)
  if hasattr(state, 'to_pure_dict'):
    state = state.to_pure_dict()
  return state


def _is_empty_node(x: Any) -> bool:
  return isinstance(x, (dict, list, tuple)) and not x


def _flat_shapes(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
  flat = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=_is_empty_node
  )[0]:
    if _is_empty_node(leaf):
      # An empty optimizer state (EmptyState, a stateless transform) has no
      # array but is part of the structure orbax checks.
      flat[path_name(path)] = ((), 'empty')
      continue
    # Arrays and orbax's ArrayMetadata both carry shape and dtype.
    shape = tuple(leaf.shape)
    dtype = leaf.dtype
    # orbax stores integer keys (NNX layer lists, optax chain indices) as
    # strings; naming both sides by key names alone makes them compare.
    flat[path_name(path)] = (shape, str(np.dtype(dtype)))
  return flat


def differences(saved: Any, expected: Any, *, limit: int = 20) -> list[str]:
  """What differs between two trees of arrays (or array metadata)."""
  limit = _checks.check_count('limit', limit, minimum=0)
  saved_flat, expected_flat = _flat_shapes(saved), _flat_shapes(expected)
  lines = []
  for key in sorted(set(expected_flat) - set(saved_flat)):
    lines.append(f'missing from the checkpoint: {key}')
  for key in sorted(set(saved_flat) - set(expected_flat)):
    lines.append(f'not expected, in the checkpoint: {key}')
  for key in sorted(set(saved_flat) & set(expected_flat)):
    if saved_flat[key] != expected_flat[key]:
      (s_shape, s_dtype), (e_shape, e_dtype) = saved_flat[key], expected_flat[key]
      lines.append(f'{key}: checkpoint has {s_dtype}{list(s_shape)}, expected '
                   f'{e_dtype}{list(e_shape)}')
  if len(lines) > limit:
    lines = lines[:limit] + [f'... and {len(lines) - limit} more']
  return lines


def mismatch_summary(saved: Any, expected: Any) -> str:
  """One line counting what :func:`differences` lists, e.g. ``3 arrays
  missing from the checkpoint, 0 not expected, 1 of another shape or dtype
  (of 12 expected)``."""
  saved_flat, expected_flat = _flat_shapes(saved), _flat_shapes(expected)
  missing = len(set(expected_flat) - set(saved_flat))
  extra = len(set(saved_flat) - set(expected_flat))
  changed = sum(saved_flat[k] != expected_flat[k]
                for k in set(saved_flat) & set(expected_flat))
  return (f'{missing} array(s) missing from the checkpoint, {extra} not '
          f'expected, {changed} of another shape or dtype (of '
          f'{len(expected_flat)} expected, {len(saved_flat)} saved)')


def _digest(leaf: Any) -> np.ndarray:
  """SHA-256 of an array's dtype, shape and bytes; zeros where this process
  cannot see the whole array (multi-process sharding), which skips it."""
  if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
    return np.zeros(_DIGEST_BYTES, np.uint8)
  array = np.ascontiguousarray(np.asarray(leaf))
  h = hashlib.sha256(f'{array.dtype.str}{array.shape}'.encode())
  h.update(array.tobytes())
  return np.frombuffer(h.digest(), np.uint8)


def _digests(state_dict: Any) -> Any:
  leaves = jax.tree.leaves(state_dict)
  if not leaves:
    return {}  # no arrays: stored as an empty node, like a zero-size array
  return np.stack([_digest(leaf) for leaf in leaves])


def _storable_entry(directory: pathlib.Path, path: Any, leaf: Any) -> Any:
  try:
    return _storable(leaf)
  except (TypeError, ValueError, OverflowError) as e:
    raise TypeError(
        f'Cannot save to {directory}: the state\'s entry '
        f'{jax.tree_util.keystr(path) or "(the whole state)"} is a '
        f'{type(leaf).__name__}, not an array orbax can store ({e}).'
    ) from e


def _state_dict_to_save(directory: pathlib.Path, state: Any) -> Any:
  """``state`` as the nested dict of arrays orbax writes, or a clear error
  (before anything is written) where it cannot be stored."""
  try:
    jax.tree_util.tree_structure(state)
  except (TypeError, ValueError) as e:
    raise TypeError(
        f'Cannot save to {directory}: the state is not a pytree JAX can '
        f'flatten ({e}); give dict keys of one type.') from e
  try:
    raw = _raw_state_dict(state)
  except ValueError as e:  # flax: keys 1 and '1' in one dict
    raise CheckpointError(
        f'Cannot save to {directory}: {str(e).split(" vs given")[0]}; '
        'orbax stores keys as strings. Rename one of them.') from e
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf: _storable_entry(directory, path, leaf), raw)


def _check_storage_names(directory: pathlib.Path, tree: Any) -> None:
  """Refuses two arrays orbax would store under one name.

  orbax names an array by its keys joined with ``'.'`` (``{'a.b': x}`` and
  ``{'a': {'b': y}}`` are both ``a.b``, and ``{'a': [x]}`` is ``a.0``), and
  tensorstore drops a trailing ``'/'``: the second array would overwrite
  the first, found only by restore's digest check.
  """
  paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  names = jax.tree.leaves(
      ocp.tree.get_param_names(tree, include_empty_nodes=False))
  seen = {}
  for path, name in zip(paths, names):
    key = jax.tree_util.keystr(path[1:])
    first = seen.setdefault(name.rstrip('/'), key)
    if first != key:
      raise CheckpointError(
          f"Cannot save to {directory}: the state's entries {first} and "
          f"{key} would be stored under one name ({name.partition('.')[2]!r}"
          ": orbax joins keys with '.'), and one would overwrite the other. "
          'Rename one of them.'
      )


def _verify(directory: pathlib.Path, restored: Any, digests: Any) -> None:
  leaves = jax.tree_util.tree_flatten_with_path(restored)[0]
  digests = (np.zeros((0, _DIGEST_BYTES), np.uint8) if _is_empty_node(digests)
             else np.asarray(digests))
  if digests.shape != (len(leaves), _DIGEST_BYTES):
    raise CheckpointError(
        f'Checkpoint {directory} is damaged: {digests.shape[0]} digests for '
        f'{len(leaves)} arrays.'
    )
  damaged = []
  for (path, leaf), expected in zip(leaves, digests):
    if not expected.any():
      continue  # not digested at save time (multi-process sharded array)
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
      continue
    if not np.array_equal(_digest(leaf), expected):
      damaged.append(path_name(path))
  if damaged:
    raise CheckpointError(
        f'Checkpoint {directory} is damaged: the data of '
        f'{", ".join(damaged[:10])}{" ..." if len(damaged) > 10 else ""} '
        'does not match the SHA-256 digest written at save time.'
    )


def _from_storable(like_leaf: Any, restored: Any) -> Any:
  if _is_key(like_leaf):
    return jax.random.wrap_key_data(restored, impl=_key_impl(like_leaf))
  if _is_empty_node(restored):  # a zero-size array, see _storable
    if _is_abstract(like_leaf):
      return jnp.zeros(like_leaf.shape, like_leaf.dtype)
    return jnp.zeros(jnp.shape(like_leaf), jnp.result_type(like_leaf))
  return restored
