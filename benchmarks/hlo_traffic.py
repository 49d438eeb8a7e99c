"""Bytes a compiled XLA program reads and writes, from its optimized HLO text.

A train step's optimizer part is bound by memory traffic, not arithmetic:
every elementwise update reads its operands and writes its results once per
top-level instruction (a fusion, a dot, a copy). Summing, over the
instructions the program executes, the bytes of their operands and of their
results gives a count that does not depend on the machine's load, so two
compiled steps can be compared without timing noise: an extra pass over
every kernel shows up as that kernel's bytes, a fused one does not.

It is an estimate, and says what it counts: a fusion that reads an
operand only through slices (a scanned layer's weights out of the stack) is
charged those slices (at most the operand); one whose result is an operand
updated in place by dynamic-update-slices is charged the updates written
and that operand's slices read (any other instruction that reads part of
an operand is charged the whole operand); a ``while`` loop is
charged its body and condition once per iteration (its known trip count;
once, and counted in ``unknown_trip_counts``, where XLA does not know it), a
conditional its largest branch (and every branch's unknown trip counts), a
``call`` its callee; other in-place updates count a read and a write;
arithmetic (the matrix products of the forward
and backward passes, which dominate a wide model's step time) costs
nothing here. A fusion is one kernel: its operands and results, never the
instructions inside it.
"""

from __future__ import annotations

import collections
import re
from typing import NamedTuple

_BITS = {'pred': 8, 's2': 2, 'u2': 2, 's4': 4, 'u4': 4, 's8': 8, 'u8': 8,
         'f4e2m1fn': 4, 'f8e3m4': 8, 'f8e4m3': 8, 'f8e4m3fn': 8,
         'f8e4m3fnuz': 8, 'f8e4m3b11fnuz': 8, 'f8e5m2': 8, 'f8e5m2fnuz': 8,
         'f8e8m0fnu': 8, 'bf16': 16, 'f16': 16, 's16': 16, 'u16': 16,
         'f32': 32, 's32': 32, 'u32': 32, 'f64': 64, 's64': 64, 'u64': 64,
         'c64': 64, 'c128': 128, 'token': 0}
# A bounded dynamic dimension (``<=8``) is charged its bound; an unbounded
# one (``?``) has no size to charge.
_ARRAY = re.compile(r'\b([a-z][a-z0-9]*)\[([\d,<=?]*)\]')
_COMPUTATION = re.compile(r'^(?:ENTRY )?%([\w.\-]+) .*\{$')
# Without the ``%``: HLO printed in another style, which is refused.
_INSTRUCTION_START = re.compile(r'^\s*(?:ROOT )?%?[\w.\-]+ = ')
_INSTRUCTION = re.compile(
    r'^\s*(?:ROOT )?%([\w.\-]+) = (\(.*?\)|[\w\[\],{}:#*()<=]+?) '
    r'([\w\-]+)\((.*)$')
_OPERAND = re.compile(r'%([\w.\-]+)')
_CALLEE = re.compile(r'\b(condition|body|to_apply|true_computation|'
                     r'false_computation)=%([\w.\-]+)')
_BRANCHES = re.compile(r'\bbranch_computations=\{([^}]*)\}')
_FUSED = re.compile(r'\bcalls=%([\w.\-]+)')
_SLICES = frozenset({'slice', 'dynamic-slice'})
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
# Instructions that move no data: views, tuple plumbing, inputs.
_FREE = frozenset({'parameter', 'constant', 'get-tuple-element', 'tuple',
                   'bitcast', 'after-all', 'partition-id', 'replica-id',
                   'opt-barrier', 'add-dependency', 'domain'})
# Instructions charged by the computations they run, not by their operands.
_CONTROL = frozenset({'while', 'conditional', 'call'})


class Traffic(NamedTuple):
  """What the instructions a program executes read and write.

  Attributes:
    read_bytes: bytes of the operands of every counted instruction.
    written_bytes: bytes of their results.
    instructions: how many instructions were counted (each loop iteration
      counts its body's again).
    by_opcode: instructions counted, per opcode (``fusion``, ``dot``, ...).
    unknown_trip_counts: ``while`` loops whose trip count XLA does not
      know, charged one iteration.
  """

  read_bytes: int
  written_bytes: int
  instructions: int
  by_opcode: dict[str, int]
  unknown_trip_counts: int = 0

  @property
  def total_bytes(self) -> int:
    return self.read_bytes + self.written_bytes


def array_bytes(hlo_type: str) -> int:
  """Bytes of every array in an HLO type (``f32[8,8]{1,0}``, or a tuple).

  Each array takes whole bytes (sub-byte elements are packed within one).

  Raises:
    ValueError: an element type this module does not know the width of,
      or an unbounded dynamic dimension.
  """
  total = 0
  for dtype, dims in _ARRAY.findall(hlo_type):
    if dtype not in _BITS:
      raise ValueError(f'unknown HLO element type {dtype!r} in {hlo_type!r}')
    if '?' in dims:
      raise ValueError(f'unbounded dynamic dimension in {hlo_type!r}')
    size = 1
    for d in dims.split(','):
      if d:
        size *= int(d.removeprefix('<='))
    total += (size * _BITS[dtype] + 7) // 8
  return total


def _computations(text: str) -> tuple[dict[str, list[str]], str]:
  """Every computation's instruction lines, by name, and the entry's name."""
  computations: dict[str, list[str]] = {}
  entry = None
  current: list[str] | None = None
  for line in text.splitlines():
    if current is None:
      match = _COMPUTATION.match(line)
      if match:
        current = computations.setdefault(match.group(1), [])
        if line.startswith('ENTRY '):
          entry = match.group(1)
    elif line.startswith('}'):
      current = None
    else:
      current.append(line)
  if entry is None:
    raise ValueError('no ENTRY computation in the HLO text')
  return computations, entry


def _operand_list(rest: str) -> str:
  """The operand list of an instruction: ``rest`` up to its closing paren."""
  depth = 1
  for i, char in enumerate(rest):
    depth += {'(': 1, ')': -1}.get(char, 0)
    if depth == 0:
      return rest[:i]
  return rest


class _Count(NamedTuple):
  read: int
  written: int
  opcodes: collections.Counter
  unknown_trip_counts: int

  def __add__(self, other):  # type: ignore[override]
    return _Count(self.read + other.read, self.written + other.written,
                  self.opcodes + other.opcodes,
                  self.unknown_trip_counts + other.unknown_trip_counts)

  def times(self, n: int) -> '_Count':
    return _Count(self.read * n, self.written * n,
                  collections.Counter({k: v * n
                                       for k, v in self.opcodes.items()}),
                  self.unknown_trip_counts)


_NOTHING = _Count(0, 0, collections.Counter(), 0)


class _Instruction(NamedTuple):
  name: str
  nbytes: int
  opcode: str
  operand_text: str
  attributes: str
  root: bool

  @property
  def operands(self) -> list[str]:
    return _OPERAND.findall(self.operand_text)


def _instructions(lines: list[str]) -> list[_Instruction]:
  """The instructions of a computation's lines, in order."""
  out = []
  for line in lines:
    match = _INSTRUCTION.match(line)
    if not match:
      if _INSTRUCTION_START.match(line):
        raise ValueError(f'cannot parse the HLO instruction {line.strip()!r}')
      continue
    name, hlo_type, opcode, rest = match.groups()
    operand_list = _operand_list(rest)
    out.append(_Instruction(name, array_bytes(hlo_type), opcode,
                            operand_list, rest[len(operand_list):],
                            line.lstrip().startswith('ROOT ')))
  return out


class _FusionAccess(NamedTuple):
  """How a fused computation touches its operands and its result.

  Attributes:
    reads: per operand index, the bytes it reads where that is only slices
      of the operand, or the buffer that dynamic-update-slices at the root
      update in place (0 for that use); an operand not listed is read whole.
    written: the bytes the fusion writes where (an element of) its root
      updates an operand in place, else None (its whole result).
  """

  reads: dict[int, int]
  written: int | None


def _fusion_access(lines: list[str]) -> _FusionAccess:
  instructions = _instructions(lines)
  by_name = {i.name: i for i in instructions}
  users: dict[str, list[_Instruction]] = collections.defaultdict(list)
  for inst in instructions:
    for operand in inst.operands:
      users[operand].append(inst)

  def through_views(name: str) -> list[tuple[_Instruction, str]]:
    """(user, operand name) pairs of ``name``, looking through bitcasts."""
    found = []
    for user in users[name]:
      if user.opcode == 'bitcast':
        found += through_views(user.name)
      else:
        found.append((user, name))
    return found

  def source(name: str) -> _Instruction | None:
    inst = by_name.get(name)
    while inst is not None and inst.opcode == 'bitcast':
      inst = by_name.get(inst.operands[0])
    return inst

  # The root's elements (a tuple's, looked through); each that is a chain
  # of dynamic-update-slices into a parameter writes only its updates, and
  # its links' reads of the buffer they update are free.
  root = source(next((i.name for i in instructions if i.root), ''))
  elements = ([source(o) for o in root.operands] if root is not None
              and root.opcode == 'tuple' else [root])
  in_place: set[str] = set()  # the chains' dynamic-update-slices
  written, any_in_place = 0, False
  for element in elements:
    chain, link = [], element
    while link is not None and link.opcode == 'dynamic-update-slice':
      chain.append(link)
      link = source(link.operands[0])
    if chain and link is not None and link.opcode == 'parameter':
      in_place.update(c.name for c in chain)
      any_in_place = True
      written += sum(by_name[c.operands[1]].nbytes
                     if c.operands[1] in by_name else c.nbytes
                     for c in chain)
    elif element is not None:
      written += element.nbytes

  reads: dict[int, int] = {}
  for inst in instructions:
    if inst.opcode != 'parameter':
      continue
    uses = through_views(inst.name)
    # No use seen (a fused computation this module cannot see into): whole.
    sliced, whole = 0, not uses
    for user, via in uses:
      if user.operands and user.operands[0] == via:
        if user.opcode in _SLICES:
          sliced += user.nbytes
          continue
        if user.name in in_place:
          continue
      whole = True
    if not whole:
      reads[int(inst.operand_text)] = min(sliced, inst.nbytes)
  return _FusionAccess(reads, written if any_in_place else None)


def _control_traffic(opcode: str, attributes: str,
                     count_of) -> _Count:
  """What a ``while``, ``conditional`` or ``call`` runs."""
  callees = dict(_CALLEE.findall(attributes))
  if opcode == 'while':
    trip = _TRIP_COUNT.search(attributes)
    once = count_of(callees['body']) + count_of(callees['condition'])
    if trip is None:
      return once + _Count(0, 0, collections.Counter(), 1)
    # The condition runs once more than the body, to exit.
    return (once.times(int(trip.group(1)))
            + count_of(callees['condition']))
  if opcode == 'call':
    return count_of(callees['to_apply'])
  branches = _BRANCHES.search(attributes)
  names = (_OPERAND.findall(branches.group(1)) if branches else
           [callees['true_computation'], callees['false_computation']])
  counts = [count_of(n) for n in names]
  largest = max(counts, key=lambda c: c.read + c.written)
  # A loop of unknown length in any branch may be the one that runs.
  return largest._replace(
      unknown_trip_counts=sum(c.unknown_trip_counts for c in counts))


def _lines(computations: dict[str, list[str]], name: str) -> list[str]:
  if name not in computations:
    raise ValueError(f'the HLO text calls %{name}, which it does not define')
  return computations[name]


def _traffic_of(name: str, computations: dict[str, list[str]],
                memo: dict[str, _Count]) -> _Count:
  if name in memo:
    return memo[name]
  sizes: dict[str, int] = {}
  total = _NOTHING
  for inst in _instructions(_lines(computations, name)):
    sizes[inst.name] = inst.nbytes
    if inst.opcode in _FREE:
      continue
    if inst.opcode in _CONTROL:
      total += _control_traffic(
          inst.opcode, inst.attributes,
          lambda callee: _traffic_of(callee, computations, memo))
      continue
    reads, written = {}, None
    fused = _FUSED.search(inst.attributes)
    if inst.opcode == 'fusion' and fused:
      reads, written = _fusion_access(_lines(computations, fused.group(1)))
    read = sum(reads.get(i, sizes.get(o, 0))
               for i, o in enumerate(inst.operands))
    total += _Count(read, inst.nbytes if written is None else written,
                    collections.Counter([inst.opcode]), 0)
  memo[name] = total
  return total


def entry_traffic(text: str) -> Traffic:
  """The bytes the program of ``text`` (optimized HLO) moves in one run.

  Raises:
    ValueError: ``text`` has no entry computation, or an instruction line
      or element type this module cannot read.
  """
  computations, entry = _computations(text)
  count = _traffic_of(entry, computations, {})
  return Traffic(count.read, count.written, sum(count.opcodes.values()),
                 dict(count.opcodes), count.unknown_trip_counts)
