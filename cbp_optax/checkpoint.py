"""Save and restore whole CBP training states with orbax-checkpoint.

A training state is any pytree of arrays: a ``cbp_optax.linen.TrainState``
(parameters, optimizer state of any optax chain, the centering collection,
step and skip counts), ``nnx.state((model, optimizer))`` for NNX, or a dict
holding either together with the data-order RNG. Restoring needs a state of
the same structure to restore into (``like``, e.g. a freshly initialized
one); a checkpoint written for another model or optimizer configuration is
refused with a list of what differs, before any array is read.

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

import os
import pathlib
from typing import Any, Union

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from cbp_optax.equalize import path_name

PathLike = Union[str, os.PathLike]


class CheckpointMismatchError(ValueError):
  """The checkpoint does not hold a state of the expected structure."""


def _as_state_dict(tree: Any) -> Any:
  # Dataclasses (TrainState), NamedTuples (optax states) and NNX States
  # become nested dicts of arrays keyed by field names, which orbax stores
  # and which name every difference readably.
  state = flax.serialization.to_state_dict(tree)
  if hasattr(state, 'to_pure_dict'):
    state = state.to_pure_dict()
  # Python scalars (TrainState.create's step = 0) become the arrays a trained
  # state holds, so a fresh state and a trained one compare equal.
  return jax.tree.map(jnp.asarray, state)


def _flat_shapes(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
  flat = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
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


def save(directory: PathLike, state: Any, *, force: bool = False) -> pathlib.Path:
  """Writes ``state`` to ``directory`` (a new folder; ``force`` replaces it).

  Blocks until the checkpoint is complete on disk; orbax writes to a
  temporary folder and renames it, so an interrupted save never leaves a
  half-written checkpoint under ``directory``.
  """
  directory = pathlib.Path(directory).absolute()
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(directory, _as_state_dict(state), force=force)
  checkpointer.wait_until_finished()
  return directory


def restore(directory: PathLike, like: Any) -> Any:
  """Reads the checkpoint in ``directory`` into the structure of ``like``.

  Args:
    directory: a folder written by :func:`save`.
    like: a state of the expected structure (values are ignored; shapes,
      dtypes and tree structure must match the checkpoint).

  Returns:
    A state of the same type as ``like`` with the saved values.

  Raises:
    CheckpointMismatchError: the checkpoint holds another structure; the
      message lists the missing, unexpected and reshaped entries.
  """
  directory = pathlib.Path(directory).absolute()
  target = _as_state_dict(like)
  checkpointer = ocp.StandardCheckpointer()
  saved = checkpointer.metadata(directory).item_metadata.tree
  mismatch = differences(saved, target)
  if mismatch:
    raise CheckpointMismatchError(
        f'Checkpoint {directory} does not match the state to restore into '
        '(a different model or optimizer configuration?):\n  '
        + '\n  '.join(mismatch)
    )
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
  restored = checkpointer.restore(directory, abstract)
  if isinstance(like, nnx.State):
    like = jax.tree.map(lambda x: x, like)  # a new State; `like` is untouched
    nnx.replace_by_pure_dict(like, restored)
    return like
  return flax.serialization.from_state_dict(like, restored)
