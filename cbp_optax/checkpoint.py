"""Save and restore whole CBP training states with orbax-checkpoint.

A training state is any pytree of arrays: a ``cbp_optax.linen.TrainState``
(parameters, optimizer state of any optax chain, the centering collection,
step and skip counts), ``nnx.state((model, optimizer))`` for NNX, or a dict
holding either together with the data-order RNG. Restoring needs a state of
the same structure to restore into (``like``, e.g. a freshly initialized
one); a checkpoint written for another model or optimizer configuration is
refused with a list of what differs, before any array is read.

Typed PRNG keys (``jax.random.key``, the ``RngKey`` variables of NNX models
with ``Dropout(rngs=...)``) are stored as their key data and rebuilt with the
implementation of the key in ``like``. Every array is stored with its SHA-256
digest and verified on restore, so a damaged data file is refused rather
than restored as different numbers. Every problem with a checkpoint (missing,
empty, damaged, another structure) raises :class:`CheckpointError` (whose
subclass :class:`CheckpointMismatchError` is the structural mismatch) with a
message that names the directory.

Example (Linen)::

  cbp_optax.checkpoint.save(path, {'train': state, 'rng': key_data})
  restored = cbp_optax.checkpoint.restore(path, {'train': state,
                                                 'rng': key_data})

Example (NNX)::

  cbp_optax.checkpoint.save(path, nnx.state((model, optimizer)))
  nnx.update((model, optimizer),
             cbp_optax.checkpoint.restore(path, nnx.state((model, optimizer))))
"""

from __future__ import annotations

import hashlib
import os
import pathlib
from typing import Any, Union

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from cbp_optax.blocks import path_name

PathLike = Union[str, os.PathLike]

# The saved tree: the state, and one SHA-256 digest per state array (in
# ``jax.tree.leaves`` order of the state dict). A checkpoint without these two
# keys (written before digests) is restored without verification.
_STATE, _DIGESTS = 'cbp_optax_state', 'cbp_optax_sha256'
_DIGEST_BYTES = 32


class CheckpointError(ValueError):
  """The checkpoint is missing, damaged, or does not fit the state."""


class CheckpointMismatchError(CheckpointError):
  """The checkpoint does not hold a state of the expected structure."""


def _is_key(leaf: Any) -> bool:
  return hasattr(leaf, 'dtype') and jnp.issubdtype(
      leaf.dtype, jax.dtypes.prng_key
  )


def _storable(leaf: Any) -> Any:
  # Typed keys have no NumPy dtype; their uint32 key data does.
  if _is_key(leaf):
    return jax.random.key_data(leaf)
  array = jnp.asarray(leaf)
  # orbax refuses zero-size arrays (M1's energies when no leaf is in a block,
  # e.g. cbp_transformer or an empty tree). They hold no data: stored as an
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


def _as_state_dict(tree: Any) -> Any:
  # Python scalars (TrainState.create's step = 0) become the arrays a trained
  # state holds, so a fresh state and a trained one compare equal.
  return jax.tree.map(_storable, _raw_state_dict(tree))


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


def _digest(leaf: Any) -> np.ndarray:
  """SHA-256 of an array's dtype, shape and bytes; zeros where this process
  cannot see the whole array (multi-process sharding), which skips it."""
  if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
    return np.zeros(_DIGEST_BYTES, np.uint8)
  array = np.ascontiguousarray(np.asarray(leaf))
  h = hashlib.sha256(f'{array.dtype.str}{array.shape}'.encode())
  h.update(array.tobytes())
  return np.frombuffer(h.digest(), np.uint8)


def _digests(state_dict: Any) -> np.ndarray:
  leaves = jax.tree.leaves(state_dict)
  if not leaves:
    return np.zeros((0, _DIGEST_BYTES), np.uint8)
  return np.stack([_digest(leaf) for leaf in leaves])


def save(directory: PathLike, state: Any, *, force: bool = False) -> pathlib.Path:
  """Writes ``state`` to ``directory`` (a new folder; ``force`` replaces it).

  Blocks until the checkpoint is complete on disk; orbax writes to a
  temporary folder and renames it, so an interrupted save never leaves a
  half-written checkpoint under ``directory``. Each array is stored with its
  SHA-256 digest, which :func:`restore` verifies.

  Args:
    directory: the checkpoint folder; it must not exist unless ``force``.
    state: any pytree of arrays (an NNX state, a Linen ``TrainState``, a
      dict of them); typed PRNG keys are stored as their key data.
    force: replace an existing checkpoint at ``directory``.

  Returns:
    The absolute path of the checkpoint.

  Examples:
    A whole CBP optimizer state (M1 energies, M3 moments, step counters):

    >>> import tempfile
    >>> import jax.numpy as jnp
    >>> import cbp_optax as cbp
    >>> from cbp_optax import checkpoint
    >>> params = {'w': jnp.arange(3.0)}
    >>> tx = cbp.cbp(1e-3)
    >>> opt_state = tx.init(params)
    >>> _, opt_state = tx.update(params, opt_state, params)
    >>> path = checkpoint.save(tempfile.mkdtemp() + '/step_1',
    ...                        {'params': params, 'opt': opt_state})
    >>> path.name
    'step_1'
    >>> import shutil; shutil.rmtree(path.parent)
  """
  directory = pathlib.Path(directory).absolute()
  state_dict = _as_state_dict(state)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(
      directory,
      {_STATE: state_dict, _DIGESTS: _digests(state_dict)},
      force=force,
  )
  checkpointer.wait_until_finished()
  return directory


def _saved_tree(checkpointer: Any, directory: pathlib.Path) -> Any:
  if not directory.exists():
    raise CheckpointError(f'No checkpoint at {directory}: it does not exist.')
  if not directory.is_dir():
    raise CheckpointError(
        f'No checkpoint at {directory}: it is a file, not a checkpoint '
        'directory.'
    )
  try:
    metadata = checkpointer.metadata(directory)
    tree = None if metadata is None else metadata.item_metadata
    tree = None if tree is None else tree.tree
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(
        f'Checkpoint {directory} is damaged: its metadata cannot be read '
        f'({type(e).__name__}: {str(e)[:300]}).'
    ) from e
  if not tree:
    contents = sorted(p.name for p in directory.iterdir())
    raise CheckpointError(
        f'Checkpoint {directory} has no readable metadata (found '
        f'{contents[:10] or "an empty directory"}); it was not written by '
        'cbp_optax.checkpoint.save, or is damaged or incomplete.'
    )
  return tree


def _verify(directory: pathlib.Path, restored: Any, digests: Any) -> None:
  leaves = jax.tree_util.tree_flatten_with_path(restored)[0]
  digests = np.asarray(digests)
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
    return jax.random.wrap_key_data(
        restored, impl=jax.random.key_impl(like_leaf)
    )
  if _is_empty_node(restored):  # a zero-size array, see _storable
    return jnp.zeros(jnp.shape(like_leaf), jnp.result_type(like_leaf))
  return restored


def _replicate_single_device_leaves(abstract: Any) -> Any:
  """Places one-device leaves (counters) on the mesh the other leaves use.

  A step counter created on one device beside parameters sharded on a mesh
  would come back pinned to that device, and the next step on the mesh would
  fail with incompatible devices; restored replicated on the mesh, it is
  where a jitted step would have put it.
  """
  leaves = jax.tree.leaves(abstract)
  meshes = {
      leaf.sharding.mesh for leaf in leaves
      if isinstance(getattr(leaf, 'sharding', None), jax.sharding.NamedSharding)
      and leaf.sharding.mesh.size > 1
  }
  if len(meshes) != 1:
    return abstract
  replicated = jax.sharding.NamedSharding(
      meshes.pop(), jax.sharding.PartitionSpec())

  def place(leaf):
    if isinstance(getattr(leaf, 'sharding', None),
                  jax.sharding.SingleDeviceSharding):
      return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=replicated)
    return leaf

  return jax.tree.map(place, abstract)


def restore(directory: PathLike, like: Any) -> Any:
  """Reads the checkpoint in ``directory`` into the structure of ``like``.

  Args:
    directory: a folder written by :func:`save`.
    like: a state of the expected structure (values are ignored; shapes,
      dtypes and tree structure must match the checkpoint). Typed PRNG keys
      in ``like`` are restored with ``like``'s key implementation.

  Returns:
    A state of the same type as ``like`` with the saved values.

  Raises:
    CheckpointMismatchError: the checkpoint holds another structure; the
      message lists the missing, unexpected and reshaped entries.
    CheckpointError: no checkpoint at ``directory``, or one that is empty,
      incomplete or damaged (unreadable metadata or data, or data that does
      not match its digest). Every message names ``directory``.

  Leaves of ``like`` on one device (step counters) beside leaves sharded
  on a mesh come back replicated on that mesh.

  Examples:
    Restore into a freshly initialized state of the same structure; a
    state of another structure is refused:

    >>> import tempfile
    >>> import jax.numpy as jnp
    >>> import cbp_optax as cbp
    >>> from cbp_optax import checkpoint
    >>> params = {'w': jnp.arange(3.0)}
    >>> tx = cbp.cbp(1e-3)
    >>> opt_state = tx.init(params)
    >>> _, opt_state = tx.update(params, opt_state, params)
    >>> path = checkpoint.save(tempfile.mkdtemp() + '/step_1',
    ...                        {'params': params, 'opt': opt_state})
    >>> fresh = {'params': {'w': jnp.zeros(3)}, 'opt': tx.init(params)}
    >>> restored = checkpoint.restore(path, fresh)
    >>> restored['params']['w']
    Array([0., 1., 2.], dtype=float32)
    >>> int(restored['opt'][1].count), restored['opt'][0].energy.shape
    (1, (1,))
    >>> checkpoint.restore(path, {'params': {'w': jnp.zeros(4)}})
    Traceback (most recent call last):
      ...
    cbp_optax.checkpoint.CheckpointMismatchError: Checkpoint ... does not match the state to restore into ...
    >>> import shutil; shutil.rmtree(path.parent)
  """
  directory = pathlib.Path(directory).absolute()
  raw_like = _raw_state_dict(like)
  target = jax.tree.map(_storable, raw_like)
  checkpointer = ocp.StandardCheckpointer()
  saved = _saved_tree(checkpointer, directory)
  with_digests = isinstance(saved, dict) and set(saved) == {_STATE, _DIGESTS}
  saved_state = saved[_STATE] if with_digests else saved
  mismatch = differences(saved_state, target)
  if mismatch:
    raise CheckpointMismatchError(
        f'Checkpoint {directory} does not match the state to restore into '
        '(a different model or optimizer configuration?):\n  '
        + '\n  '.join(mismatch)
    )
  abstract = _replicate_single_device_leaves(
      jax.tree.map(ocp.utils.to_shape_dtype_struct, target))
  if with_digests:
    digest_meta = saved[_DIGESTS]
    abstract = {
        _STATE: abstract,
        _DIGESTS: jax.ShapeDtypeStruct(tuple(digest_meta.shape), np.uint8),
    }
  try:
    restored = checkpointer.restore(directory, abstract)
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(
        f'Checkpoint {directory} is damaged: its data cannot be read '
        f'({type(e).__name__}: {str(e)[:300]}).'
    ) from e
  if with_digests:
    _verify(directory, restored[_STATE], restored[_DIGESTS])
    restored = restored[_STATE]
  restored = jax.tree.map(_from_storable, raw_like, restored)
  if isinstance(like, nnx.State):
    like = jax.tree.map(lambda x: x, like)  # a new State; `like` is untouched
    nnx.replace_by_pure_dict(like, restored)
    return like
  return flax.serialization.from_state_dict(like, restored)
