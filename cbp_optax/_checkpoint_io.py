"""Checkpoint directories on disk: the errors, the per-directory lock, the
atomic swap of a finished save into place, and the recovery of a save that
was killed (re-exported by :mod:`cbp_optax.checkpoint`).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import pathlib
import re
import shutil
import threading
from typing import Optional

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils



# The saved tree: the state, and one SHA-256 digest per state array (in
# ``jax.tree.leaves`` order of the state dict). A checkpoint without these two
# keys (written before digests) is restored without verification.
_STATE, _DIGESTS = 'cbp_optax_state', 'cbp_optax_sha256'


class CheckpointError(ValueError):
  """The checkpoint is missing, damaged, or does not fit the state."""


class CheckpointMismatchError(CheckpointError):
  """The checkpoint does not hold a state of the expected structure."""


class CheckpointBusyError(CheckpointError):
  """Another save to the same checkpoint directory is in progress."""


# Public as cbp_optax.checkpoint.*: tracebacks and reprs name that module.
for _error in (CheckpointError, CheckpointMismatchError, CheckpointBusyError):
  _error.__module__ = 'cbp_optax.checkpoint'
del _error


# orbax's checkpointers share process-wide state (the OCDBT writer, the
# temporary-folder handling): two saves or restores in threads of one process
# corrupt each other even for different directories. One at a time per
# process; different processes write different directories in parallel.
_ORBAX_LOCK = threading.RLock()


def _sibling(directory: pathlib.Path, role: str) -> pathlib.Path:
  """``<parent>/.<name>.cbp-<role>``: a hidden file beside the checkpoint."""
  return directory.parent / f'.{directory.name}.cbp-{role}'


def _open_lock_file(path: pathlib.Path, create: bool) -> tuple[int, bool]:
  """An fd open on ``path`` and whether this call created the file; -1 when
  ``create`` is False and there is no file."""
  while True:
    if create:
      try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
      except FileExistsError:
        pass
    try:
      return os.open(path, os.O_RDWR if create else os.O_RDONLY), False
    except FileNotFoundError:
      if not create:
        return -1, False
      # Removed by a failing save between the two opens: create it again.


def _names_file(path: pathlib.Path, fd: int) -> bool:
  try:
    st = os.stat(path)
  except FileNotFoundError:
    return False
  fst = os.fstat(fd)
  return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


@contextlib.contextmanager
def _file_lock(path: pathlib.Path, *, shared: bool, wait: bool,
               create: bool = True):
  """``flock`` on ``path``: released when the holder ends, even if killed.

  Per open file, so it excludes threads of one process as well as other
  processes. Yields False when ``wait`` is False and another holds it, or
  when ``create`` is False and there is no file (nothing to wait for).

  A lock file this call created is removed again if the body raises, so a
  failed save leaves the directory as it was. It is removed while held, and
  a lock counts only while ``path`` still names the locked file, so no two
  holders ever hold the same lock.
  """
  while True:
    fd, created = _open_lock_file(path, create)
    if fd < 0:
      yield False
      return
    try:
      mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
      try:
        fcntl.flock(fd, mode if wait else mode | fcntl.LOCK_NB)
      except BlockingIOError:
        yield False
        return
      if _names_file(path, fd):
        try:
          yield True
        except BaseException:
          if created:
            with contextlib.suppress(FileNotFoundError):
              os.unlink(path)
          raise
        return
      # Locked a file a failing save removed meanwhile: try the new one.
    finally:
      os.close(fd)  # releases the lock


def _is_primary() -> bool:
  return jax.process_index() == 0


def _sync(name: str) -> None:
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(f'cbp_optax.checkpoint.{name}')


def _complete(path: pathlib.Path) -> bool:
  # orbax writes into `<path>.orbax-checkpoint-tmp...` and renames it to
  # `<path>` once every file is written: a folder at `<path>` is complete.
  return path.is_dir()


def _interrupted_swap(directory: pathlib.Path) -> Optional[pathlib.Path]:
  """The checkpoint to use when a save was killed between its two renames.

  Then ``<name>`` is missing and ``.<name>.cbp-old`` exists; the new
  checkpoint was complete before the first rename, so it is the newest
  complete one (the old one where it is gone too).
  """
  old = _sibling(directory, 'old')
  if directory.exists() or not old.is_dir():
    return None
  new = _sibling(directory, 'new')
  return new if _complete(new) else old


def _recover(directory: pathlib.Path) -> None:
  """Finishes the swap of a save that was killed (writer lock held).

  A save writes the new checkpoint to ``.<name>.cbp-new``, renames the old
  one to ``.<name>.cbp-old``, the new one to ``<name>``, then deletes the old
  one. Killed between the renames, ``<name>`` is missing: the newest
  complete checkpoint is moved back into place. Leftovers of an unfinished
  write are deleted.
  """
  interrupted = _interrupted_swap(directory)
  if interrupted is not None:
    os.rename(interrupted, directory)
  _remove(_sibling(directory, 'old'))
  _remove_unfinished(directory)


def _remove_unfinished(directory: pathlib.Path) -> None:
  """Deletes the new checkpoint of an unfinished save (writer lock held)."""
  new = _sibling(directory, 'new')
  for leftover in (new, *directory.parent.glob(
      f'{glob.escape(new.name)}{_ORBAX_TMP}*')):
    _remove(leftover)


def _remove(path: pathlib.Path) -> None:
  if path.is_dir() and not path.is_symlink():
    shutil.rmtree(path)
  elif path.exists() or path.is_symlink():
    path.unlink()


# What orbax writes at the top of a checkpoint folder: its metadata files
# (`_METADATA`, `_CHECKPOINT_METADATA`, `_sharding`, ...), the OCDBT
# database and its per-process parts. A folder holding anything else is not
# replaced.
_ORBAX_ENTRY = re.compile(
    r'_[A-Z][A-Z_]*|_sharding|d|manifest\.ocdbt|commit_success\.txt'
    r'|array_metadatas|descriptor|ocdbt\.process_\d+')


def _written_by_save(directory: pathlib.Path) -> bool:
  try:
    tree = ocp.StandardCheckpointer().metadata(directory).item_metadata.tree
  except Exception:  # pylint: disable=broad-except
    return False  # no orbax metadata, or unreadable
  return isinstance(tree, dict) and set(tree) == {_STATE, _DIGESTS}


def _foreign(directory: pathlib.Path) -> Optional[str]:
  """What is at ``directory`` if save may not replace it; None if it is a
  checkpoint save wrote (and nothing else) or an empty directory."""
  if directory.is_symlink():
    return f'a symbolic link (to {os.readlink(directory)})'
  if not directory.is_dir():
    return 'a file' if directory.is_file() else 'not a directory'
  names = sorted((p.name for p in directory.iterdir()),
                 key=lambda n: (n.startswith('.'), n))  # hidden ones last
  others = [n for n in names if not _ORBAX_ENTRY.fullmatch(n)]
  if others:
    shown = ', '.join(map(repr, others[:5]))
    more = f' and {len(others) - 5} more' if len(others) > 5 else ''
    return f'a directory holding {shown}{more}'
  if names and not _written_by_save(directory):
    return ('a checkpoint that cbp_optax.checkpoint.save did not write (or '
            'whose metadata cannot be read)')
  return None


def _refusal(directory: pathlib.Path,
             force: bool) -> Optional[CheckpointError]:
  """Why ``save(directory, force=force)`` may not put a checkpoint there."""
  if not os.path.lexists(directory):
    return None
  what = _foreign(directory)
  if what is not None:
    return CheckpointError(
        f'Cannot save to {directory}: it is {what}. save replaces only a '
        'checkpoint it wrote itself (with force=True) or an empty '
        'directory, and deletes nothing else: save to a new directory, or '
        'move that one away yourself.'
    )
  if not force:
    return CheckpointError(
        f'Cannot save to {directory}: it exists. Pass force=True to '
        'replace it (the old checkpoint is kept until the new one is '
        'complete), or save to a new directory.'
    )
  return None


def _swap_in(directory: pathlib.Path, new: pathlib.Path, force: bool) -> None:
  """Puts the complete checkpoint ``new`` at ``directory`` (writer lock held).

  The old checkpoint is kept until the new one is in place; readers wait
  while the two renames run, so a restore sees the old or the new one.
  What is at ``directory`` is checked again first: it may have changed
  while the new checkpoint was written.
  """
  old = _sibling(directory, 'old')
  with _file_lock(_sibling(directory, 'swap'), shared=False, wait=True):
    refusal = _refusal(directory, force)
    if refusal is not None:
      raise refusal
    if os.path.lexists(directory):
      os.rename(directory, old)
    try:
      os.rename(new, directory)
    except BaseException:
      if os.path.lexists(old):
        os.rename(old, directory)
      raise
  _remove(old)


# orbax writes `<new>.orbax-checkpoint-tmp`, renamed to `<new>` when complete.
_ORBAX_TMP = '.orbax-checkpoint-tmp'
