"""Bytes a compiled XLA program reads and writes, from its optimized HLO text.

A train step's optimizer part is bound by memory traffic, not arithmetic:
every elementwise update reads its operands and writes its results once per
top-level instruction (a fusion, a dot, a copy). Summing, over the entry
computation's instructions, the bytes of their operands and of their
results gives a count that does not depend on the machine's load, so two
compiled steps can be compared without timing noise: an extra pass over
every kernel shows up as that kernel's bytes, a fused one does not.

It is an estimate, and says what it counts: an instruction that reads only
a slice of an operand is charged the whole operand; the bodies of ``while``
loops and conditionals are not entered (their operands and results are
counted once); in-place updates count a read and a write; arithmetic (the
matrix products of the forward and backward passes, which dominate a wide
model's step time) costs nothing here.
"""

from __future__ import annotations

import collections
import re
from typing import NamedTuple

_BYTES = {'pred': 1, 's8': 1, 'u8': 1, 'bf16': 2, 'f16': 2, 's16': 2,
          'u16': 2, 'f32': 4, 's32': 4, 'u32': 4, 'f64': 8, 's64': 8,
          'u64': 8, 'c64': 8, 'c128': 16}
_ARRAY = re.compile(r'\b(' + '|'.join(_BYTES) + r')\[([\d,]*)\]')
_INSTRUCTION = re.compile(
    r'^\s*(?:ROOT )?%([\w.\-]+) = (\(.*?\)|[\w\[\],{}:#*()]+?) '
    r'([\w\-]+)\((.*)$')
_OPERAND = re.compile(r'%([\w.\-]+)')
# Instructions that move no data: views, tuple plumbing, inputs.
_FREE = frozenset({'parameter', 'constant', 'get-tuple-element', 'tuple',
                   'bitcast', 'after-all', 'partition-id', 'replica-id',
                   'opt-barrier', 'add-dependency', 'domain'})


class Traffic(NamedTuple):
  """What the entry computation's instructions read and write.

  Attributes:
    read_bytes: bytes of the operands of every counted instruction.
    written_bytes: bytes of their results.
    instructions: how many instructions were counted.
    by_opcode: instructions counted, per opcode (``fusion``, ``dot``, ...).
  """

  read_bytes: int
  written_bytes: int
  instructions: int
  by_opcode: dict[str, int]

  @property
  def total_bytes(self) -> int:
    return self.read_bytes + self.written_bytes


def array_bytes(hlo_type: str) -> int:
  """Bytes of every array in an HLO type (``f32[8,8]{1,0}``, or a tuple)."""
  total = 0
  for dtype, dims in _ARRAY.findall(hlo_type):
    size = 1
    for d in dims.split(','):
      if d:
        size *= int(d)
    total += size * _BYTES[dtype]
  return total


def _entry_lines(text: str) -> list[str]:
  start = text.index('\nENTRY')
  body = text[start + 1:]
  return body[:body.index('\n}')].splitlines()[1:]


def _operand_list(rest: str) -> str:
  """The operand list of an instruction: ``rest`` up to its closing paren."""
  depth = 1
  for i, char in enumerate(rest):
    depth += {'(': 1, ')': -1}.get(char, 0)
    if depth == 0:
      return rest[:i]
  return rest


def entry_traffic(text: str) -> Traffic:
  """The bytes the entry computation of ``text`` (optimized HLO) moves."""
  sizes: dict[str, int] = {}
  read = written = 0
  opcodes: collections.Counter = collections.Counter()
  for line in _entry_lines(text):
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    name, hlo_type, opcode, rest = match.groups()
    sizes[name] = array_bytes(hlo_type)
    if opcode in _FREE:
      continue
    operands = _OPERAND.findall(_operand_list(rest))
    read += sum(sizes.get(o, 0) for o in operands)
    written += sizes[name]
    opcodes[opcode] += 1
  return Traffic(read, written, sum(opcodes.values()), dict(opcodes))
