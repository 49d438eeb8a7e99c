"""Output folders of the experiment commands, checked before anything runs."""

import os
import pathlib


def check_out_dir(out: pathlib.Path, flag: str = '--out') -> None:
  """Raises ValueError unless ``out`` is a folder or can be made one (so a
  command fails before it trains, not when it writes).

  Args:
    out: the output folder.
    flag: the option that named it, for the message.
  """
  if out.exists() and not out.is_dir():
    raise ValueError(f'{flag} {out}: a file, not a folder')
  parent = out
  while not parent.exists():
    if parent.is_symlink():
      raise ValueError(f'{flag} {out}: {parent} is a broken link')
    parent = parent.parent
  if not parent.is_dir():
    raise ValueError(f'{flag} {out}: {parent} is a file, not a folder')
  if not os.access(parent, os.W_OK | os.X_OK):
    raise ValueError(f'{flag} {out}: {parent} is not writable')
