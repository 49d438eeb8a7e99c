"""Counting the ``copy`` instructions of a compiled XLA module, by shape and place.

A donated train step should update every state buffer in place. When XLA
cannot prove that the last read of an old buffer precedes the write of its
new value, its copy insertion keeps a full ``copy`` of the buffer: that is
the cost of M3's lag when ``v_{t-1}`` is read after ``v_t`` is produced.

The fused steps of ``cbp_optax`` skip non-finite batches with an elementwise
select of the old and new state (until December 2026 with a conditional,
``lax.cond`` / ``nnx.cond``). For a program that has a conditional, copies
inside its skip branch run only on a skipped step, so they are reported
apart from the ones every step pays (the entry computation and the apply
branch).
"""

from __future__ import annotations

import collections
import re
from typing import Iterable, NamedTuple

ENTRY = 'entry'
APPLY = 'apply-branch'
SKIP = 'skip-branch'
OTHER = 'other'

_HEADER = re.compile(r'^(ENTRY )?(%[\w.\-]+) ')
_COPY = re.compile(r'= (\w+)\[([\d,]*)\]\{[^}]*\} copy\(')
_BRANCHES = re.compile(r'branch_computations=\{([^}]*)\}')
_TRUE_FALSE = re.compile(
    r'true_computation=(%[\w.\-]+), false_computation=(%[\w.\-]+)')


class Copy(NamedTuple):
  """One ``copy`` instruction: where it runs and what it copies."""

  place: str
  dtype: str
  shape: tuple[int, ...]


def _branch_roles(text: str) -> dict[str, str]:
  """Maps branch computation names to APPLY / SKIP.

  ``lax.cond(ok, apply, skip)`` lowers to a conditional on the integer
  ``ok``: branch 0 is taken when it is False (skip), branch 1 when True.
  """
  roles = {}
  for match in _BRANCHES.finditer(text):
    names = [name.strip() for name in match.group(1).split(',')]
    if len(names) == 2:
      roles[names[0]], roles[names[1]] = SKIP, APPLY
  for match in _TRUE_FALSE.finditer(text):
    roles[match.group(1)], roles[match.group(2)] = APPLY, SKIP
  return roles


def copies(text: str) -> list[Copy]:
  """Every ``copy`` instruction of an HLO module text, with its place."""
  roles = _branch_roles(text)
  place = OTHER
  found = []
  for line in text.splitlines():
    if line and not line.startswith(' ') and line.rstrip().endswith('{'):
      header = _HEADER.match(line)
      if header:
        name = header.group(2)
        place = ENTRY if header.group(1) else roles.get(name, OTHER)
    match = _COPY.search(line)
    if match:
      shape = tuple(int(d) for d in match.group(2).split(',') if d)
      found.append(Copy(place, match.group(1), shape))
  return found


def count_by_shape(
    found: Iterable[Copy],
    shapes: Iterable[tuple[int, ...]],
    places: Iterable[str] = (ENTRY, APPLY),
) -> collections.Counter:
  """How many copies of each of ``shapes`` run in ``places``."""
  wanted, places = set(map(tuple, shapes)), set(places)
  return collections.Counter(
      c.shape for c in found if c.place in places and c.shape in wanted)


def summary(found: Iterable[Copy], min_elements: int = 1) -> dict[str, dict]:
  """``{place: {'f32[1024,1024]': count, ...}}`` for copies of at least
  ``min_elements`` elements."""
  table: dict[str, collections.Counter] = collections.defaultdict(
      collections.Counter)
  for c in found:
    size = 1
    for d in c.shape:
      size *= d
    if size >= min_elements:
      table[c.place][f'{c.dtype}[{",".join(map(str, c.shape))}]'] += 1
  return {place: dict(counter) for place, counter in table.items()}


_ROOT_TUPLE = re.compile(r'ROOT %[\w.\-]+ = .* tuple\((.*)\)')
_COPY_NAME = re.compile(r'^\s*(%[\w.\-]+) = \w+\[[\d,]*\]\{[^}]*\} copy\(')


def entry_output_copies(text: str) -> list[int]:
  """Positions in the entry's output tuple that are produced by a ``copy``.

  Together with the flattened output tree of the jitted function, this names
  the state buffers XLA copies in the entry computation.
  """
  entry = text[text.index('\nENTRY'):]
  body = entry[:entry.index('\n}')]
  copy_names = {m.group(1) for m in map(_COPY_NAME.match, body.splitlines())
                if m}
  root = next(line for line in body.splitlines() if 'ROOT' in line)
  match = _ROOT_TUPLE.search(root)
  if not match:
    return []
  operands = re.sub(r'/\*[^*]*\*/', '', match.group(1)).split(',')
  return [i for i, name in enumerate(op.strip() for op in operands)
          if name in copy_names]


_PARAMETER_COPY = re.compile(r'= \w+\[[\d,]*\]\{[^}]*\} copy\(%([\w.\-]+)\)')


def entry_parameter_copies(text: str) -> list[str]:
  """Names of the entry computation's parameters that it copies whole.

  XLA names an entry parameter after the jitted function's argument path
  (``state_opt_state_1__nu__...``), so the names say which state buffers are
  copied before the step can update them in place.
  """
  entry = text[text.index('\nENTRY'):]
  body = entry[:entry.index('\n}')]
  header = body.lstrip('\n').splitlines()[0]
  parameters = set(re.findall(r'([\w.\-]+): ', header))
  return [m.group(1) for m in map(_PARAMETER_COPY.search, body.splitlines())
          if m and m.group(1) in parameters]
