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

import contextlib
import os
import pathlib
from typing import Any, Optional, Union

import flax.serialization
import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils

from cbp_optax import _checks
from cbp_optax._checkpoint_io import CheckpointBusyError
from cbp_optax._checkpoint_io import CheckpointError
from cbp_optax._checkpoint_io import CheckpointMismatchError
from cbp_optax._checkpoint_io import _DIGESTS
from cbp_optax._checkpoint_io import _ORBAX_LOCK
from cbp_optax._checkpoint_io import _ORBAX_TMP
from cbp_optax._checkpoint_io import _STATE
from cbp_optax._checkpoint_io import _file_lock
from cbp_optax._checkpoint_io import _interrupted_swap
from cbp_optax._checkpoint_io import _is_primary
from cbp_optax._checkpoint_io import _recover
from cbp_optax._checkpoint_io import _refusal
from cbp_optax._checkpoint_io import _remove_unfinished
from cbp_optax._checkpoint_io import _sibling
from cbp_optax._checkpoint_io import _swap_in
from cbp_optax._checkpoint_io import _sync
from cbp_optax._checkpoint_tree import _check_storage_names
from cbp_optax._checkpoint_tree import _digests
from cbp_optax._checkpoint_tree import _from_storable
from cbp_optax._checkpoint_tree import _is_empty_node
from cbp_optax._checkpoint_tree import _raw_state_dict
from cbp_optax._checkpoint_tree import _state_dict_to_save
from cbp_optax._checkpoint_tree import _storable
from cbp_optax._checkpoint_tree import _verify
from cbp_optax._checkpoint_tree import differences
from cbp_optax._checkpoint_tree import mismatch_summary

PathLike = Union[str, os.PathLike]


def _directory(directory: Any) -> pathlib.Path:
  if not isinstance(directory, (str, os.PathLike)):
    raise TypeError(
        'directory must be a path (a str or os.PathLike), got the '
        f'{type(directory).__name__} {directory!r}.')
  return pathlib.Path(directory).absolute()


# orbax reads the path of the folder it writes as a glob pattern (it lists
# `<path>/ocdbt.process_*` to assemble the checkpoint): `step[1]` matches
# `step1` only, so the data is never assembled and restore finds none; `*`
# and `?` also match the folders of saves to other names being written
# beside it. tensorstore reads a backslash as a separator.
_UNSAFE_PATH_CHARACTERS = '[]*?\\'


def _name_max(directory: pathlib.Path) -> int:
  try:
    return os.pathconf(directory, 'PC_NAME_MAX')
  except (OSError, ValueError):  # pragma: no cover - no pathconf here
    return 255


def _check_target(directory: pathlib.Path) -> None:
  """Refuses, before anything is written, a path save cannot write to."""
  text = str(directory)
  if '\0' in text:
    raise CheckpointError(f'Cannot save to {directory!r}: it contains a NUL '
                          'byte, which no file name can hold.')
  unsafe = [c for c in _UNSAFE_PATH_CHARACTERS if c in text]
  if unsafe:
    raise CheckpointError(
        f'Cannot save to {directory}: it contains {" ".join(unsafe)}, which '
        "orbax reads as a pattern ('[', ']', '*', '?' are glob patterns, "
        "'\\' a separator), so the checkpoint would not restore. Use a path "
        'without them (e.g. lr_0.1/step_1 for lr[0.1]/step_1).'
    )
  if directory.name in ('', '..'):
    raise CheckpointError(
        f'Cannot save to {directory}: give the checkpoint folder its own '
        f'name (e.g. {directory / "step_1"}).')
  ancestor = directory.parent
  while not os.path.lexists(ancestor):
    ancestor = ancestor.parent
  if not ancestor.is_dir():
    raise CheckpointError(
        f'Cannot save to {directory}: {ancestor} is '
        f'{"a file" if ancestor.is_file() else "not a directory"}, not a '
        'directory to hold it.')
  longest = len(os.fsencode(f'.{directory.name}.cbp-new{_ORBAX_TMP}'))
  limit = _name_max(ancestor)
  if longest > limit:
    raise CheckpointError(
        f'Cannot save to {directory}: its name is {longest - 30} bytes '
        f'long, and save writes beside it .<name>.cbp-new{_ORBAX_TMP}, '
        f'{longest} bytes where this file system allows {limit}. Use a name '
        f'of at most {limit - 30} bytes.')


@contextlib.contextmanager
def _made_parents(directory: pathlib.Path, primary: bool):
  """Creates the folders above ``directory``; removes them again, if still
  empty, when the body raises."""
  missing = []
  parent = directory.parent
  while primary and not os.path.lexists(parent):
    missing.append(parent)
    parent = parent.parent
  if missing:
    directory.parent.mkdir(parents=True, exist_ok=True)
  try:
    yield
  except BaseException:
    for folder in missing:  # deepest first
      with contextlib.suppress(OSError):
        folder.rmdir()
    raise


_MESSAGE_BYTES = 2048


def _agree(directory: pathlib.Path, error: Optional[BaseException]) -> None:
  """Raises ``error`` (process 0's) on every process, or returns on all.

  Process 0 alone looks at the files; the others get its message (as a
  :class:`CheckpointError`, or the busy error) instead of waiting for it at
  the next barrier.
  """
  if jax.process_count() > 1:
    text = np.zeros(_MESSAGE_BYTES + 1, np.uint8)
    if error is not None:
      message = f'{error} (raised on process 0)'.encode()[:_MESSAGE_BYTES]
      text[0] = 2 if isinstance(error, CheckpointBusyError) else 1
      text[1:1 + len(message)] = np.frombuffer(message, np.uint8)
    text = np.asarray(multihost_utils.broadcast_one_to_all(text))
    if text[0] and error is None:
      kind = CheckpointBusyError if text[0] == 2 else CheckpointError
      error = kind(bytes(text[1:]).rstrip(b'\0').decode(errors='replace'))
  if error is not None:
    raise error


def _primary_step(primary: bool, step, *args) -> Optional[BaseException]:
  """Runs ``step(*args)`` on process 0; returns what it raised."""
  if not primary:
    return None
  try:
    step(*args)
  except Exception as e:  # pylint: disable=broad-except
    return e
  return None


def _prepare(directory: pathlib.Path, force: bool, acquired: bool) -> None:
  if not acquired:
    raise CheckpointBusyError(
        f'Cannot save to {directory}: another save to it is in progress '
        f'(it holds {_sibling(directory, "lock")}). Save to another '
        'directory, or wait for that save to finish.'
    )
  _recover(directory)
  refusal = _refusal(directory, force)
  if refusal is not None:
    raise refusal


def _write(directory: pathlib.Path, tree: Any, force: bool,
           primary: bool) -> None:
  """Writes ``tree`` beside ``directory`` and swaps it in (lock held); a
  failure deletes what was written."""
  new = _sibling(directory, 'new')
  try:
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(new, tree, force=True)
    checkpointer.wait_until_finished()
    _sync('save_written')
    _agree(directory, _primary_step(primary, _swap_in, directory, new, force))
  except BaseException:
    if primary:
      _remove_unfinished(directory)
    raise


def save(directory: PathLike, state: Any, *, force: bool = False) -> pathlib.Path:
  """Writes ``state`` to ``directory`` (a new folder; ``force`` replaces it).

  Blocks until the checkpoint is complete on disk. The checkpoint is written
  beside ``directory`` (``.<name>.cbp-new``) and moved into place only once
  complete; with ``force`` the previous checkpoint stays until then. A save
  killed at any point leaves the previous checkpoint or the new one, each
  complete, which :func:`restore` reads (and the next save tidies up). Each
  array is stored with its SHA-256 digest, which :func:`restore` verifies.

  ``force`` replaces only a checkpoint that ``save`` wrote (recognized by
  its metadata, holding nothing but orbax's files) or an empty directory:
  a folder with anything else in it, a file or a symbolic link at
  ``directory`` is refused and nothing is deleted. A save that is refused
  or fails leaves the directory as it was (the folders it created, its lock
  file and what it wrote are removed).

  Refused before anything is written: a path with ``[``, ``]``, ``*``,
  ``?`` or ``\\`` (orbax reads it as a pattern, and the checkpoint would
  not restore), a name too long for the file system once ``save`` adds its
  suffixes, a state orbax would store two arrays of under one name
  (``{'a.b': x, 'a': {'b': y}}``: orbax joins keys with ``'.'``), and
  entries that are not arrays. A state with no arrays (``{}``) is saved and
  restores as itself.

  One save at a time per checkpoint: a second writer to the same
  ``directory`` (another thread or process) gets a
  :class:`CheckpointBusyError` at once, while saves to different
  directories run side by side (within one process, one after the other:
  orbax's writers share state). The lock is ``flock`` on the hidden file
  ``.<name>.cbp-lock`` beside the checkpoint; it is released when its
  holder ends, even if killed. In a multi-process run every process calls
  ``save``, and the first process does the file operations (and its
  refusals are raised on every process).

  Args:
    directory: the checkpoint folder; it must not exist unless ``force``.
    state: any pytree of arrays (an NNX state, a Linen ``TrainState``, a
      dict of them); typed PRNG keys are stored as their key data.
    force: replace a checkpoint ``save`` wrote at ``directory``.

  Returns:
    The absolute path of the checkpoint.

  Raises:
    CheckpointError: ``directory`` exists and ``force`` is False, or holds
      something other than a checkpoint ``save`` wrote; or the path or the
      state's keys cannot be stored (see above).
    CheckpointBusyError: another save to ``directory`` is in progress.
    TypeError: an entry of ``state`` is not an array.

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
  _checks.check_bool('force', force)
  directory = _directory(directory)
  _check_target(directory)
  state_dict = _state_dict_to_save(directory, state)
  tree = {_STATE: state_dict, _DIGESTS: _digests(state_dict)}
  _check_storage_names(directory, tree)
  primary = _is_primary()
  lock = (_file_lock(_sibling(directory, 'lock'), shared=False, wait=False)
          if primary else contextlib.nullcontext(True))
  with _ORBAX_LOCK, _made_parents(directory, primary), lock as acquired:
    _agree(directory,
           _primary_step(primary, _prepare, directory, force, acquired))
    _write(directory, tree, force, primary)
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


def _read(source: pathlib.Path, directory: pathlib.Path, target: Any):
  """Reads the checkpoint at ``source`` into ``target``'s structure;
  messages name ``directory`` (``source`` is it, or what a killed save left
  beside it)."""
  checkpointer = ocp.StandardCheckpointer()
  try:
    saved = _saved_tree(checkpointer, source)
  except CheckpointError as e:
    raise CheckpointError(str(e).replace(str(source), str(directory))) from e
  with_digests = isinstance(saved, dict) and set(saved) == {_STATE, _DIGESTS}
  saved_state = saved[_STATE] if with_digests else saved
  mismatch = differences(saved_state, target)
  if mismatch:
    raise CheckpointMismatchError(
        f'Checkpoint {directory} does not match the state to restore into '
        '(a different model or optimizer configuration?): '
        f'{mismatch_summary(saved_state, target)}:\n  '
        + '\n  '.join(mismatch)
    )
  abstract = _replicate_single_device_leaves(
      jax.tree.map(ocp.utils.to_shape_dtype_struct, target))
  if with_digests:
    digest_meta = saved[_DIGESTS]
    abstract = {
        _STATE: abstract,
        _DIGESTS: {} if _is_empty_node(digest_meta) else jax.ShapeDtypeStruct(
            tuple(digest_meta.shape), np.uint8),
    }
  try:
    restored = checkpointer.restore(source, abstract)
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(
        f'Checkpoint {directory} is damaged: its data cannot be read '
        f'({type(e).__name__}: {str(e)[:300]}).'
    ) from e
  return restored, with_digests


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
  directory = _directory(directory)
  raw_like = _raw_state_dict(like)
  target = jax.tree.map(_storable, raw_like)
  # Wait while a save swaps this checkpoint in (its two renames): the lock
  # file exists once a save has run here. A reader never creates it (the
  # storage may be read-only).
  swap = _file_lock(_sibling(directory, 'swap'), shared=True, wait=True,
                    create=False)
  with _ORBAX_LOCK, swap:
    source = _interrupted_swap(directory) or directory
    restored, with_digests = _read(source, directory, target)
  if with_digests:
    _verify(directory, restored[_STATE], restored[_DIGESTS])
    restored = restored[_STATE]
  restored = jax.tree.map(_from_storable, raw_like, restored)
  if isinstance(like, nnx.State):
    like = jax.tree.map(lambda x: x, like)  # a new State; `like` is untouched
    nnx.replace_by_pure_dict(like, restored)
    return like
  return flax.serialization.from_state_dict(like, restored)
