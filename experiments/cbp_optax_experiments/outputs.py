"""Output folders of the experiment commands, checked before anything runs."""

import json
import os
import pathlib
from typing import Optional

# The command that writes a folder's results.json and results.md, by what
# each writes: the compare table's title, the workload suite's fields.
COMPARE = 'cbp-optax compare'
WORKLOADS = 'cbp-optax workloads'
_COMPARE_TITLE = '# cbp-optax compare\n'
_COMPARE_FIELDS = frozenset({'config', 'methods'})
_WORKLOADS_FIELDS = frozenset({'workloads', 'score', 'meta'})


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


def results_writer(folder: pathlib.Path) -> Optional[str]:
  """Which command wrote ``folder``'s results.json / results.md.

  Returns:
    :data:`COMPARE` or :data:`WORKLOADS`; ``'another command'`` for a
    results file neither wrote (a study of ``cbp-optax reproduce``, a
    user's); None where there is no results file.
  """
  markdown, data = folder / 'results.md', folder / 'results.json'
  if data.is_file():
    try:
      fields = set(json.loads(data.read_text()))
    except (OSError, ValueError, TypeError):
      fields = set()
    if fields == _COMPARE_FIELDS:
      return COMPARE
    return WORKLOADS if _WORKLOADS_FIELDS <= fields else 'another command'
  if markdown.is_file():
    with open(markdown, encoding='utf-8', errors='replace') as f:
      title = f.read(len(_COMPARE_TITLE))
    return COMPARE if title == _COMPARE_TITLE else 'another command'
  return None


def check_results_owner(folder: pathlib.Path, command: str,
                        flag: str = '--out') -> None:
  """Raises ValueError where ``folder`` holds results another command wrote:
  no command replaces them.

  Args:
    folder: where ``command`` writes its results.json and results.md.
    command: the command about to write, :data:`COMPARE` or :data:`WORKLOADS`
      (which checks an unrecognized results.json itself, as damaged).
    flag: the option that named the folder, for the message.
  """
  writer = results_writer(folder)
  if command == WORKLOADS and writer == 'another command':
    return
  if writer not in (None, command):
    raise ValueError(
        f'{flag} {folder}: its results.json / results.md were written by '
        f'{writer}, which {command} would replace; choose another folder')
