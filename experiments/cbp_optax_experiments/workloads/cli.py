"""``cbp-optax workloads``: time to target of optimizer arms on fixed workloads.

``cbp-optax workloads [--quick] [--split dev|test] [--workloads all|a,b]
[--arms default|all|a,b] [--seeds N] [--out DIR] [--arm NAME=module:function
[--centered NAME]] [--set-targets] [--score-only] [--vmap auto|on|off]``;
``cbp-optax workloads --compare-runs A/results.json B/results.json``

The arms are ``arms.default_arms()`` unless ``--arms`` names others. Each
arm tunes its learning rate on the workload's grid (tuning seed), then
runs on the evaluation seeds 0..N-1 (``DEFAULT_SEEDS``, paired across arms;
``--quick`` alone runs a small subset, ``QUICK_WORKLOADS`` x ``QUICK_ARMS``
on ``QUICK_SEEDS`` seeds); the report gives each score its bootstrap
interval and the paired comparisons (``statistics``), and on a dev run with
enough seeds the decision rule's recommendation (``decision``). It compares
the time to each workload's target (AlgoPerf's rule: the best median of the
tuned baselines ``arms.BASELINES``, which run first) over all workloads with
AlgoPerf's performance profile, in steps (the headline) and in wall-clock,
beside the normalized final metric. ``--split`` runs one split of ``splits.SPLITS``
(dev chooses the defaults, test only reports) into its own folder,
``workloads/<split>``: each split is scored on its own. Running into an
``--out`` that already holds results.json replaces the (workload, arm) pairs
measured now and keeps the others (one that holds the results of
``cbp-optax compare`` is refused); every run is also saved as its own file
under ``--out``/runs, so the same command started again after an
interruption resumes where it stopped (a stored run is used only while the
code that made it is unchanged: the suite's, and an ``--arm``'s function and
module, ``arms.code_fingerprint``). ``--score-only`` rewrites results.md
and the profiles from results.json without training (with the targets now
fixed in the code, for a full-size run). ``--compare-runs A B`` trains
nothing either: it prints whether two runs of the same split (the same code
and seeds at another float32 rounding, say) reach the same seed-level
conclusions (``statistics.stability``): per arm, whether its intervals
overlap, and every pooled paired verdict that flips between better and
worse.

Every argument is checked before anything trains (names against the
registries ``definitions.REGISTRY``, ``splits.SPLITS`` and
``arms.builtin_arms``, the seed count, ``--out`` and the results.json there,
which must be of the same size, seeds and split): a bad one exits with
status 2 and one ``error:`` line naming it. A (workload, arm) that raises
loses its own row, not the run; the run then exits with status 1 and lists
the failures (see ``EPILOG_EXIT``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import os
import pathlib
import re
import shutil
import sys
import textwrap
import time
import traceback
from typing import Any, Optional, Sequence

from cbp_optax_experiments import outputs
from cbp_optax_experiments import datasets
from cbp_optax_experiments.reproduce import cli as reproduce_cli
from cbp_optax_experiments.workloads import arms as arms_lib
from cbp_optax_experiments.workloads import definitions
from cbp_optax_experiments.workloads import protocol
from cbp_optax_experiments.workloads import report
from cbp_optax_experiments.workloads import splits
from cbp_optax_experiments.workloads import statistics

ALL = 'all'
DEFAULT = 'default'  # --arms: arms.default_arms() and every --arm
RUNS = 'runs'  # under --out: one file per run (protocol.RecordStore)
EXIT_FAILED = 1  # some (workload, arm) failed, or results.json not written
# A user arm's name is a results.json key, a markdown table cell and an item
# of the comma-separated --arms.
_ARM_NAME = re.compile(r'[A-Za-z0-9_][A-Za-z0-9_.+-]*')
# What a workload's results must share with its rerun to be compared in one
# table (its budget, evaluation interval, grid and metric).
_WORKLOAD_IDENTITY = ('metric', 'higher_is_better', 'budget_steps',
                      'eval_every', 'grid')

# Evaluation seeds of a full run: the paper's standard for a paired test
# (statistics.py) is at least ten; every arm runs the same seeds.
DEFAULT_SEEDS = 10
# ``--quick`` without --workloads/--arms/--seeds: a smoke test of every stage
# (tuning, seeds, targets, scores, intervals, paired tests) in about two
# minutes on two CPU cores: the two cheapest scanned workloads, the
# reference AdamW (a baseline: it sets the targets), its centered twin (a
# centered-vs-plain pair) and the recommended recipe, on three seeds.
QUICK_WORKLOADS = ('spiral', 'breast-cancer-raw')
QUICK_ARMS = ('adamw', 'adamw_centered', 'schedule_free_cbp_robust')
QUICK_SEEDS = 3
FULL_RUN_HINT = ('the full suite: cbp-optax workloads --split dev (then '
                 '--split test), {seeds} paired seeds, the default arms; see '
                 'cbp-optax workloads --help')

EPILOG_EXIT = (
    'exit status: 0 when every (workload, arm) ran and the results were '
    'written; 1 when some or all of them failed (those that ran are written, '
    'the failures are listed last on stderr; nothing is written when all '
    'failed) or the results could not be written; 2 for a bad argument or '
    'an unreadable --out/results.json, found before anything trains.')


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter,
                     argparse.RawDescriptionHelpFormatter):
  """Each flag's default as "(default: X)", except where it is None: those
  flags say in their own text what happens without them. The epilog (the
  workload and arm lists) keeps its lines."""

  def _get_help_string(self, action):
    if action.default is None:
      return action.help
    return super()._get_help_string(action)


def _listing(title: str, rows: Sequence[tuple[str, str]]) -> str:
  """``title`` and one entry per row, ``name  text``, wrapped under the
  text's column."""
  width = _width()
  column = min(max(len(name) for name, _ in rows) + 4, 28)
  lines = [title]
  for name, text in rows:
    lines.append(textwrap.fill(
        text or '(no description)', width, initial_indent=f'  {name:<{column - 4}}  ',
        subsequent_indent=' ' * column, break_on_hyphens=False))
  return '\n'.join(lines)


def target_setters() -> tuple[str, ...]:
  """The arms whose tuned runs set a workload's target where the code fixes
  none (``--quick``, ``--set-targets``): ``arms.BASELINES`` (AlgoPerf's
  rule: the best of their tuned medians, ``report.baseline_target``)."""
  return tuple(arms_lib.BASELINES)


def _help_line(name: str) -> str:
  """The workload's line of ``--help``: its split and the registry's
  summary. Read from the registries, not from a built workload: building
  one loads its data (MNIST for most), which --help should neither wait for
  nor fail on."""
  entry = definitions.REGISTRY.get(name)
  text = entry.summary if entry and entry.summary else '(no description)'
  split = [s for s, names in splits.SPLITS.items() if name in names]
  return f'[{split[0]}] {text}' if len(split) == 1 else text


def _width() -> int:
  return max(40, shutil.get_terminal_size().columns - 2)  # argparse's


def epilog() -> str:
  """The workloads and arms, read from their registries, and the exit
  status."""
  workloads = [(name, _help_line(name)) for name in definitions.NAMES]
  arms = [(arm.name, arm.description + (
      ' (sets the targets of a --quick or --set-targets run)'
      if arm.name in target_setters() else '') + (
          ' (not in the default arms)'
          if arm.name in arms_lib.NOT_BY_DEFAULT else ''))
          for arm in arms_lib.builtin_arms().values()]
  width = _width()
  return '\n\n'.join([
      _listing("workloads (--workloads; 'all' runs them in this order; "
               '[split], --split):', workloads),
      _listing("built-in arms (--arms; 'all' runs these and every --arm, "
               "'default' all but those marked):", arms),
      textwrap.fill(EPILOG_EXIT, width, break_on_hyphens=False)])


def make_parser() -> argparse.ArgumentParser:
  """The ``cbp-optax workloads`` parser; its --help lists every workload
  and arm."""
  parser = argparse.ArgumentParser(
      prog='cbp-optax workloads',
      formatter_class=_HelpFormatter,
      description=textwrap.fill(
          'Optimizer arms (AdamW, NAdamW, Muon, schedule-free AdamW, PSGD '
          'Kron, each plain and centered; CBP variants; your own) on fixed '
          'small workloads, scored by the any-time score over a ladder of '
          'targets per workload, with AlgoPerf\'s time to one target as a '
          'second view.', _width()),
      epilog=epilog())
  parser.add_argument('--quick', action='store_true',
                      help='tiny sizes (a smoke test; targets from the '
                      'run\'s own baselines)')
  parser.add_argument('--split', type=_split_name, default=None,
                      metavar='|'.join(splits.SPLITS),
                      help='run the split\'s workloads only (splits.py: '
                      'dev chooses the defaults, test only reports), into '
                      'its own --out; without it: every workload')
  parser.add_argument('--workloads', default=None, metavar='NAMES',
                      help="'all' (with --split: the split's) or "
                      'comma-separated workloads (listed below; with '
                      '--split, of that split); without it: all, or '
                      f'{",".join(QUICK_WORKLOADS)} with --quick and no '
                      '--split')
  parser.add_argument('--workload', action='append', default=None,
                      metavar='NAME=module:function',
                      help='a workload of your own: function(quick) returns '
                      'a Workload built like the suite\'s (definitions.'
                      'Workload: an NNX or Linen model via nnx_task / '
                      'linen_task, a metric, a budget and a rate grid); '
                      'NAME must not be a built-in workload\'s, and must be '
                      'in --workloads when --workloads is given (repeatable; '
                      'without --workloads, only these run). Its target and '
                      'ladder come from the run\'s baselines (include adamw '
                      'in --arms)')
  parser.add_argument('--arms', default=None, metavar='NAMES',
                      help=f"'{DEFAULT}' (every built-in arm but "
                      f'{", ".join(arms_lib.NOT_BY_DEFAULT)}, and every '
                      f"--arm), '{ALL}' (every built-in arm and every --arm) "
                      'or comma-separated arms (listed below, or --arm '
                      f'names); without it: {DEFAULT} (with --set-targets, '
                      'and the baselines), or '
                      f'{",".join(QUICK_ARMS)} with --quick and no --arm')
  parser.add_argument('--arm', action='append', default=None,
                      metavar='NAME=module:function',
                      help='a user arm: function(schedule) returns an optax '
                      'GradientTransformation; NAME (letters, digits, '
                      '_.+-) must not be a built-in arm\'s, and must be in '
                      '--arms when --arms is given (repeatable; none '
                      'without it)')
  parser.add_argument('--centered', action='append', default=None,
                      metavar='NAME',
                      help='train the --arm arm NAME on the centered model '
                      '(M2) with the transport after each update '
                      '(repeatable; built-in arms are centered or not by '
                      'definition, e.g. adamw_centered)')
  parser.add_argument('--seeds', type=_seed_count, default=None, metavar='N',
                      help='evaluate on the seeds 0..N-1, N >= 1 (without '
                      f'it: {DEFAULT_SEEDS}, or {QUICK_SEEDS} with --quick); '
                      'seeds are paired across arms; an --out that holds '
                      'results must hold them on the same seeds')
  parser.add_argument('--out', type=pathlib.Path, metavar='DIR',
                      default=None,
                      help='output folder, created if missing (without it: '
                      'workloads, or workloads/SPLIT with --split); its '
                      'results.json is merged (same --quick, --seeds and '
                      '--split) and its runs/ are reused (an --arm\'s only '
                      'while its function and module are unchanged)')
  parser.add_argument('--set-targets', action='store_true',
                      help='ignore the targets fixed in the code and set '
                      'each workload\'s from this run\'s baselines (how '
                      'the fixed targets are made)')
  parser.add_argument('--score-only', action='store_true',
                      help='rescore --out/results.json into results.md and '
                      'the profile PNGs; no training (takes only --out, '
                      '--split and --no-progress)')
  parser.add_argument('--compare-runs', type=pathlib.Path, nargs=2,
                      default=None, metavar=('A', 'B'),
                      help='no training: whether two results.json (files, '
                      'or folders holding one) reach the same seed-level '
                      'conclusions: per arm, whether its score and '
                      'steps-to-target intervals overlap, and each pooled '
                      'paired verdict that flips between better and worse '
                      '(takes no other flag but --no-progress; exit status '
                      '0 either way)')
  parser.add_argument('--data-dir', type=pathlib.Path, default=None,
                      metavar='DIR',
                      help='folder with the MNIST IDX files (without it: '
                      '$CBP_OPTAX_MNIST, then the bundled subset)')
  parser.add_argument('--vmap', choices=('auto', 'on', 'off'),
                      default='auto',
                      help='train the grid\'s runs and the seeds of each '
                      '(workload, arm) as one vmapped program where the '
                      'workload allows (protocol.batchable); auto: on an '
                      'accelerator, off on a CPU (protocol.vmap_by_default)')
  parser.add_argument('--no-progress', action='store_true',
                      help='hide the progress bar')
  return parser


def default_out(split: Optional[str]) -> pathlib.Path:
  """The ``--out`` of a run without one: each split in its own folder, so
  that the splits are scored apart."""
  return pathlib.Path('workloads') / split if split else pathlib.Path(
      'workloads')


def parse(argv: Optional[Sequence[str]],
          parser: Optional[argparse.ArgumentParser] = None
          ) -> argparse.Namespace:
  """The arguments, with ``--out`` defaulted (``default_out``)."""
  args = (parser or make_parser()).parse_args(argv)
  args.out_given = args.out is not None
  if args.out is None:
    args.out = default_out(args.split)
  if args.workloads is None:
    args.workloads = (
        ','.join(spec.partition('=')[0] for spec in args.workload)
        if args.workload else
        ','.join(QUICK_WORKLOADS) if args.quick and args.split is None
        else ALL)
  if args.arms is None:
    args.arms = (','.join(QUICK_ARMS) if args.quick and not args.arm else
                 DEFAULT)
  return args


def _split_name(text: str) -> str:
  if text not in splits.SPLITS:
    raise argparse.ArgumentTypeError(
        f'expected one of {", ".join(splits.SPLITS)} (splits.py), got '
        f'{text!r}')
  return text


def _seed_count(text: str) -> int:
  try:
    count = int(text)
  except ValueError:
    count = 0
  if count < 1:
    raise argparse.ArgumentTypeError(
        f'expected a count N >= 1 (evaluation seeds 0..N-1), got {text!r}')
  return count


# ---------------------------------------------------------------------------
# Validation: everything below raises ValueError('--flag value: why'), before
# anything trains.


@dataclasses.dataclass(frozen=True)
class Plan:
  """A training run with every argument checked.

  Attributes:
    workloads: the workloads, in run order.
    arms: the arms to run, those of ``target_setters()`` first (they set
      the targets of a ``--quick`` / ``--set-targets`` run).
    reference: the reference arm (``arms.REFERENCE``), run or not.
    seeds: the evaluation seeds.
    results: the ``--out`` results.json being merged into (checked), or
      None for a new one.
  """
  workloads: tuple[definitions.Workload, ...]
  arms: tuple[arms_lib.Arm, ...]
  reference: arms_lib.Arm
  seeds: tuple[int, ...]
  results: Optional[dict[str, Any]]

  @property
  def sets_targets(self) -> bool:
    """Whether an arm of ``target_setters()`` runs."""
    return any(arm.name in target_setters() for arm in self.arms)


def _names(flag: str, text: str, known: Sequence[str], what: str
           ) -> list[str]:
  """``'all'``: ``known``; otherwise each comma-separated name, once each,
  all of them in ``known``."""
  if text.strip() == ALL:
    return list(known)
  names = [name.strip() for name in text.split(',')]
  if not all(names):
    raise ValueError(f'{flag} {text!r}: an empty name (a stray comma?); give '
                     f"'{ALL}' or names separated by commas")
  unknown = [name for name in names if name not in known]
  if unknown:
    raise ValueError(f'{flag} {text!r}: unknown {what} '
                     f'{", ".join(map(repr, unknown))}; choose from '
                     f'{", ".join(known)} (or {ALL!r} alone)')
  repeated = [n for n, count in collections.Counter(names).items()
              if count > 1]
  if repeated:
    raise ValueError(f'{flag} {text!r}: {", ".join(map(repr, repeated))} '
                     'named more than once')
  return names


def _check_arm_names(specs: Sequence[str], names: Sequence[str],
                     builtin: dict[str, arms_lib.Arm]) -> None:
  for spec, name in zip(specs, names):
    if '=' not in spec:
      raise ValueError(f'--arm expects NAME=module:function, got {spec!r}')
    if name in builtin:
      raise ValueError(
          f'--arm {spec!r}: {name!r} is a built-in arm'
          + (' (it sets the targets)' if name in target_setters() else '')
          + '; give your arm another name')
    if name in (ALL, DEFAULT) or (name and not _ARM_NAME.fullmatch(name)):
      raise ValueError(f'--arm {spec!r}: the name {name!r} must be letters, '
                       f"digits and _.+- (and not {ALL!r} or {DEFAULT!r})")
  repeated = [n for n, count in collections.Counter(names).items()
              if count > 1]
  if repeated:
    raise ValueError(f'--arm: {", ".join(map(repr, repeated))} given more '
                     'than once')


def _check_centered(centered: Sequence[str], names: Sequence[str],
                    builtin: dict[str, arms_lib.Arm]) -> None:
  for name, count in collections.Counter(centered).items():
    if count > 1:
      raise ValueError(f'--centered {name}: given more than once')
    if name in builtin:
      raise ValueError(
          f'--centered {name}: a built-in arm, centered or not by its '
          'definition (centered: '
          + ', '.join(a.name for a in builtin.values() if a.centered)
          + '); --centered names an --arm')
    if name not in names:
      raise ValueError(f'--centered {name}: no --arm of that name ('
                       + (f'--arm names: {", ".join(names)}' if names else
                          'no --arm given') + ')')


def _user_arms(specs: Sequence[str], centered: Sequence[str]
               ) -> dict[str, arms_lib.Arm]:
  """The ``--arm`` arms by name; ``--centered`` names some of them."""
  builtin = arms_lib.builtin_arms()
  names = [spec.partition('=')[0] for spec in specs]
  _check_arm_names(specs, names, builtin)
  _check_centered(centered, names, builtin)
  arms = {name: arms_lib.user_arm(spec, name in centered)
          for spec, name in zip(specs, names)}
  for spec, arm in zip(specs, arms.values()):
    _check_builds(spec, arm)
  return arms


def _check_builds(spec: str, arm: arms_lib.Arm) -> None:
  """The user's function, called on a schedule, returns an optax
  transformation (building one is cheap; training it is not)."""
  try:
    tx = arm.make(1e-3, arms_lib.Context(steps=100))
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f'--arm {spec!r}: calling it on a schedule raised '
                     f'{type(e).__name__}: {e}') from e
  if not (callable(getattr(tx, 'init', None))
          and callable(getattr(tx, 'update', None))):
    raise ValueError(f'--arm {spec!r}: it returned {type(tx).__name__}, not '
                     'an optax GradientTransformation')


def _chosen_arms(args: argparse.Namespace) -> list[arms_lib.Arm]:
  """The arms to run, those that set targets first."""
  user = _user_arms(args.arm or [], args.centered or [])
  available = {**arms_lib.builtin_arms(), **user}
  if args.arms.strip() == DEFAULT:
    # A run that sets its targets trains the arms that set them.
    wanted = {*arms_lib.default_arms(), *user,
              *(target_setters() if args.set_targets else ())}
    names = [name for name in available if name in wanted]
  else:
    names = _names('--arms', args.arms, list(available), 'arm')
  left_out = [name for name in user if name not in names]
  if left_out:
    raise ValueError(f'--arms {args.arms!r} leaves out the --arm '
                     f'{", ".join(left_out)}: add it to --arms or drop it')
  # They set the targets of a --quick / --set-targets run (a stable sort).
  names.sort(key=lambda name: name not in target_setters())
  return [available[name] for name in names]


def _user_workloads(specs: Sequence[str], quick: bool
                    ) -> dict[str, definitions.Workload]:
  """The ``--workload`` workloads by name, each built once here (a bad one
  is refused before anything trains)."""
  out = {}
  for spec in specs:
    name = spec.partition('=')[0]
    if name in definitions.FACTORIES or name == ALL:
      raise ValueError(f'--workload {spec!r}: {name!r} is a built-in '
                       'workload\'s name; choose another')
    if name in out:
      raise ValueError(f'--workload {spec!r}: {name!r} given twice')
    out[name] = definitions.user_workload(spec, quick)
  return out


def _chosen_workloads(args: argparse.Namespace,
                      user: Sequence[str] = ()) -> list[str]:
  """The workloads to run: ``--workloads`` (the built-in ones and the
  ``user`` names of ``--workload``), within ``--split`` when given (its
  workloads, in registry order, for 'all')."""
  names = _names('--workloads', args.workloads,
                 list(definitions.NAMES) + list(user), 'workload')
  left_out = [name for name in user if name not in names]
  if left_out:
    raise ValueError(f'--workloads {args.workloads!r} leaves out the '
                     f'--workload {", ".join(left_out)}: add it to '
                     '--workloads or drop it')
  if args.split is None:
    return names
  if user:
    raise ValueError(f'--workload {", ".join(user)}: a workload of your own '
                     'is in no split; run it without --split')
  if args.workloads.strip() == ALL:
    return list(splits.workloads(args.split))
  outside = [name for name in names if name not in splits.SPLITS[args.split]]
  if outside:
    raise ValueError(
        f'--workloads {args.workloads!r}: '
        + ', '.join(f'{name!r} ({_split_of(name)})' for name in outside)
        + f' not in the {args.split} split (splits.py): each split is '
        'scored on its own; run it with its --split')
  return names


def _split_of(name: str) -> str:
  try:
    return f'{splits.split_of(name)} split'
  except ValueError:
    return 'in no split'


def _check_seeds(seeds: Sequence[int]) -> None:
  shared = sorted(set(seeds) & set(protocol.TUNING_SEEDS))
  if shared:
    raise ValueError(f'--seeds {len(seeds)}: the evaluation seeds would '
                     f'include the tuning seed(s) {shared}; give at most '
                     f'{min(shared)}')


def _check_merge(results: dict[str, Any], args: argparse.Namespace,
                 workloads: Sequence[definitions.Workload],
                 seeds: Sequence[int]) -> None:
  """The results already in ``--out`` can share tables with this run's."""
  path = args.out / report.RESULTS
  measured = {(w, a): arm for w, entry in results['workloads'].items()
              for a, arm in entry['arms'].items()}
  if not measured:
    return
  if results['meta']['quick'] != args.quick:
    kinds = ('a --quick run', 'a full-size run')
    raise ValueError(
        f'--out {args.out}: {path} holds {kinds[args.quick]}\'s results and '
        f'this is {kinds[not args.quick]}; use another --out (the two '
        'sizes do not share a table)')
  _check_split(results, args)
  other = sorted({a for (_, a), arm in measured.items()
                  if arm['seeds'] != list(seeds)})
  if other:
    held = sorted({tuple(arm['seeds']) for arm in measured.values()})
    same = (f'--seeds {len(held[0])}' if len(held) == 1 and list(held[0]) == (
        list(range(len(held[0])))) else 'the same seeds')
    raise ValueError(
        f'--seeds {len(seeds)}: {path} holds {", ".join(other)} on the '
        f'evaluation seeds {" / ".join(map(str, map(list, held)))}, not '
        f'{list(seeds)}: give {same}, or another --out (seeds are paired '
        'across arms)')
  for workload in workloads:
    old = results['workloads'].get(workload.name)
    if not old or not old['arms']:
      continue
    new = report.workload_entry(workload, None, '')
    changed = [key for key in _WORKLOAD_IDENTITY if old[key] != new[key]]
    if changed:
      raise ValueError(
          f'--out {args.out}: {path} holds {workload.name} with another '
          + ', '.join(f'{key} ({old[key]} there, {new[key]} now)'
                      for key in changed)
          + '; use another --out, or drop the workload there')


def _split_run(split: Optional[str]) -> str:
  return (f'the {split} split' if split else
          'both splits (a run without --split)')


def _check_split(results: dict[str, Any], args: argparse.Namespace) -> None:
  """One score per split: results of another split (or of both, a run
  without --split) are not merged into, nor rescored as this one's."""
  held = results['meta'].get('split')
  if held != args.split:
    raise ValueError(
        f'--out {args.out}: {args.out / report.RESULTS} holds results of '
        f'{_split_run(held)} and this run is of {_split_run(args.split)}: '
        + (f'give --split {held}' if held else 'drop --split')
        + ' to use them, or another --out (each split is scored on its own'
        + (f'; --split {args.split} defaults to {default_out(args.split)}'
           if args.split else '') + ')')


def _needs_run_target(workload: definitions.Workload,
                      args: argparse.Namespace) -> bool:
  """Whether the workload's target comes from this run's
  ``target_setters()``."""
  return workload.target is None or args.set_targets


def _check_targets(plan_arms: Sequence[arms_lib.Arm],
                   workloads: Sequence[definitions.Workload],
                   results: Optional[dict[str, Any]],
                   args: argparse.Namespace) -> None:
  """Every workload has a target to race to."""
  setters = target_setters()
  if any(arm.name in setters for arm in plan_arms):
    return
  for workload in workloads:
    old = (results or {}).get('workloads', {}).get(workload.name, {})
    if _needs_run_target(workload, args) and old.get('target') is None:
      why = ('--set-targets' if args.set_targets else
             '--quick' if args.quick else 'no target is fixed in the code')
      raise ValueError(
          f'--arms {args.arms!r}: {workload.name} has no target to race to '
          f'({why}: {" or ".join(setters)} sets it in this run, and '
          f'{args.out / report.RESULTS} holds none); add '
          f'{" or ".join(setters)} to --arms')


def _check_data_dir(data_dir: Optional[pathlib.Path]) -> None:
  if data_dir is None:
    return
  try:
    datasets.load_mnist(data_dir)
  except datasets.DataError as e:
    raise ValueError(f'--data-dir {data_dir}: {e}') from e


def plan(args: argparse.Namespace) -> Plan:
  """Checks every argument of a training run, and the results.json it
  merges into.

  Raises:
    ValueError: a bad argument; the message starts with the flag and its
      value. ``report.ResultsError``: an unreadable results.json.
  """
  outputs.check_out_dir(args.out)
  outputs.check_out_dir(args.out / RUNS)
  outputs.check_results_owner(args.out, outputs.WORKLOADS)
  arms = _chosen_arms(args)
  user = _user_workloads(args.workload or [], args.quick)
  names = _chosen_workloads(args, list(user))
  seeds = list(range(args.seeds or (QUICK_SEEDS if args.quick else
                                    DEFAULT_SEEDS)))
  _check_seeds(seeds)
  _check_data_dir(args.data_dir)
  if args.data_dir is not None:
    # Before a workload is built: building one loads (and caches) MNIST
    # for its validation size, from wherever $CBP_OPTAX_MNIST says.
    os.environ['CBP_OPTAX_MNIST'] = str(args.data_dir)
  workloads = [user[name] if name in user else
               definitions.workload(name, args.quick) for name in names]
  results = report.load(args.out)
  if results is not None:
    _check_merge(results, args, workloads, seeds)
  _check_targets(arms, workloads, results, args)
  return Plan(tuple(workloads), tuple(arms),
              arms_lib.builtin_arms()[arms_lib.REFERENCE], tuple(seeds),
              results)


def _check_score_only(args: argparse.Namespace) -> dict[str, Any]:
  """The results.json to rescore; a training flag beside --score-only is an
  error (it would be ignored)."""
  # --split is taken: it names the default --out (and checks the split).
  given = [flag for flag, value in (
      ('--quick', args.quick), ('--workloads', args.workloads != ALL),
      ('--arms', args.arms != DEFAULT), ('--arm', args.arm),
      ('--workload', args.workload),
      ('--centered', args.centered), ('--seeds', args.seeds is not None),
      ('--set-targets', args.set_targets),
      ('--data-dir', args.data_dir is not None),
      ('--vmap', args.vmap != 'auto')) if value]
  if given:
    raise ValueError(f'--score-only rescores {args.out / report.RESULTS} as '
                     f'it stands: it takes no {", ".join(given)}')
  outputs.check_out_dir(args.out)
  outputs.check_results_owner(args.out, outputs.WORKLOADS)
  results = report.load(args.out)
  if results is None:
    raise ValueError(f'--score-only: no {args.out / report.RESULTS}')
  if args.split is not None:
    _check_split(results, args)
  return results


def _results_path(path: pathlib.Path) -> pathlib.Path:
  return path / report.RESULTS if path.is_dir() else path


def _check_compare_runs(args: argparse.Namespace
                        ) -> tuple[dict[str, Any], dict[str, Any]]:
  """The two results.json to compare; a training or scoring flag beside
  --compare-runs is an error (it would be ignored)."""
  given = [flag for flag, value in (
      ('--quick', args.quick), ('--split', args.split is not None),
      ('--workloads', args.workloads != ALL),
      ('--arms', args.arms != DEFAULT),
      ('--arm', args.arm), ('--workload', args.workload),
      ('--centered', args.centered),
      ('--seeds', args.seeds is not None), ('--out', args.out_given),
      ('--set-targets', args.set_targets), ('--score-only', args.score_only),
      ('--data-dir', args.data_dir is not None),
      ('--vmap', args.vmap != 'auto')) if value]
  if given:
    raise ValueError('--compare-runs compares two results.json as they '
                     f'stand: it takes no {", ".join(given)}')
  loaded = []
  for path in args.compare_runs:
    file = _results_path(path)
    if not (file.exists() or file.is_symlink()):
      raise ValueError(f'--compare-runs {path}: no '
                       + (f'{report.RESULTS} in that folder' if path.is_dir()
                          else 'such file'))
    loaded.append(report.load_file(file))
  return loaded[0], loaded[1]


def compare_runs_text(first_name: str, second_name: str,
                      first: dict[str, Any], second: dict[str, Any]) -> str:
  """``statistics.stability`` of two results, as ``--compare-runs`` prints
  it: per arm, whether its intervals overlap (and which do not), the pooled
  verdicts that flip between better and worse, and the other changes."""
  check = statistics.stability(first, second)
  arms = check['arms']
  lines = [f'A: {first_name}', f'B: {second_name}',
           'Intervals (score in both profiles, steps to target per '
           'workload), per arm:']
  width = max((len(arm) for arm in arms), default=0)
  for arm, disjoint in arms.items():
    lines.append(f'  {arm:<{width}}  '
                 + ('overlap' if not disjoint else
                    f'DISJOINT ({len(disjoint)})'))
    lines += [f'      {line}' for line in disjoint]
  if not arms:
    lines.append('  (no arm in both)')
  for label, a, b in (('A', first, second), ('B', second, first)):
    only = sorted({arm for e in a['workloads'].values() for arm in e['arms']}
                  - set(arms))
    if only:
      lines.append(f'  only in {label} (not compared): {", ".join(only)}')
  lines.append('Paired verdicts (pooled) that flip between '
               f'{statistics.BETTER} and {statistics.WORSE}:')
  lines += [f'  {line}' for line in check['flips']] or ['  none']
  other = [line for line in check['changed'] if line not in check['flips']]
  if other:
    lines.append('Other pooled verdicts that changed:')
    lines += [f'  {line}' for line in other]
  lines.append('Stable: ' + ('yes (every interval overlaps, no verdict '
                             'flips)' if check['stable'] else 'no'))
  return '\n'.join(lines)


# ---------------------------------------------------------------------------
# The run


def _write(out: pathlib.Path, results: dict[str, Any]) -> None:
  try:
    report.write(out, results)
  except OSError as e:
    raise SystemExit(f'cbp-optax workloads: error: cannot write the results '
                     f'into {out} ({e}); stopped') from e


def _score_only(args: argparse.Namespace, results: dict[str, Any]) -> int:
  if not results['meta']['quick']:
    report.use_code_targets(results)
  _write(args.out, results)
  print(f'rescored {args.out / report.RESULTS} -> results.md, '
        f'{", ".join(_PROFILE_PNGS)}')
  return 0


_PROFILE_PNGS = ('performance_profile.png',
                 'performance_profile_wall_clock.png')  # report.write's


def _runs_per_arm(workload: definitions.Workload, seeds) -> int:
  return (len(workload.grid) + 1) * len(protocol.TUNING_SEEDS) + len(seeds)


def _new_entry(workload: definitions.Workload, old: dict[str, Any],
               args: argparse.Namespace, plan_: Plan) -> dict[str, Any]:
  """The workload's results entry before this run's arms: its earlier arms,
  and the target: from the baselines among them (AlgoPerf's rule counts an
  earlier run's baselines too), else the earlier target where no arm of
  this run can set one."""
  entry = report.workload_entry(workload, workload.target,
                                'fixed in code (definitions.TARGETS)')
  entry['arms'] = dict(old.get('arms', {}))
  if _needs_run_target(workload, args):
    report.set_baseline_target(entry)
    if (entry['target'] is None and old.get('target') is not None
        and not plan_.sets_targets):
      entry['target'] = old['target']
      entry['target_source'] = old.get('target_source', 'earlier run')
  return entry


_VMAP = {'auto': None, 'on': True, 'off': False}


def _evaluate(workload: definitions.Workload, arm: arms_lib.Arm,
              plan_: Plan, bar,
              store: protocol.RecordStore, window: float,
              args_vmap: str = 'auto'
              ) -> tuple[Optional[protocol.ArmOutcome], Optional[str]]:
  """(outcome, None), or (None, what failed) when the arm raised; the runs
  in ``store`` are loaded, the others computed and saved there."""
  runs = 0

  def on_run():
    nonlocal runs
    runs += 1
    bar.update(1)

  bar.set_description(f'{workload.name} / {arm.name}')
  try:
    return protocol.evaluate_arm(
        workload, arm, plan_.reference, list(plan_.seeds),
        on_run=on_run, store=store, cost_window=window,
        vmap=_VMAP[args_vmap]), None
  except Exception as e:  # pylint: disable=broad-except
    # A broken arm (a user factory that raises, say) loses its own row,
    # not the run: divergence is recorded, errors are reported.
    traceback.print_exc()
    print(f'{workload.name} / {arm.name}: failed ({e!r}); skipped',
          file=sys.stderr)
    return None, (f'{workload.name} / {arm.name}: {type(e).__name__}: {e} '
                  f'(after {runs} completed runs)')
  finally:
    bar.update(_runs_per_arm(workload, plan_.seeds) - runs)


def _meta(args: argparse.Namespace, plan_: Plan) -> dict[str, Any]:
  import jax  # pylint: disable=g-import-not-at-top
  return {'quick': args.quick, 'seeds': list(plan_.seeds),
          'split': args.split,
          'tuning_seeds': list(protocol.TUNING_SEEDS),
          'data': definitions.mnist_data(args.quick).description,
          'jax': jax.__version__, 'platform': jax.devices()[0].platform,
          'vmap': (protocol.vmap_by_default() if args.vmap == 'auto'
                   else args.vmap == 'on'),
          'started': datetime.datetime.now(datetime.timezone.utc).isoformat(
              timespec='seconds')}


def _train(args: argparse.Namespace, plan_: Plan) -> int:
  """Runs the plan, saving after every arm; the exit status."""
  import tqdm  # pylint: disable=g-import-not-at-top
  meta = _meta(args, plan_)
  results = plan_.results
  if results is None or not any(e['arms']
                                for e in results['workloads'].values()):
    results = report.empty(meta)
  else:
    results['meta'].update({k: v for k, v in meta.items() if k != 'started'})
  bar = tqdm.tqdm(total=sum(_runs_per_arm(w, plan_.seeds)
                            for w in plan_.workloads) * len(plan_.arms),
                  unit='run', disable=args.no_progress)
  # The records are keyed on the code, the definitions and this context.
  store = protocol.RecordStore(args.out / RUNS,
                               {'quick': args.quick, 'data': meta['data']})
  window = (protocol.QUICK_COST_WINDOW_SECONDS if args.quick else
            protocol.COST_WINDOW_SECONDS)
  start = time.perf_counter()
  setters = target_setters()
  failures: list[str] = []
  written = 0
  for workload in plan_.workloads:
    entry = _new_entry(workload, results['workloads'].get(workload.name, {}),
                       args, plan_)
    for i, arm in enumerate(plan_.arms):
      outcome, failure = _evaluate(workload, arm, plan_,
                                   bar, store, window, args.vmap)
      if failure:
        failures.append(failure)
        rest = plan_.arms[i + 1:]
        if (entry['target'] is None and arm.name in setters
            and not any(a.name in setters for a in rest)):
          # Nothing else on this workload has a target to race to.
          failures += [f'{workload.name} / {a.name}: not run (no target: '
                       f'{arm.name}, which sets it, failed)' for a in rest]
          bar.update(_runs_per_arm(workload, plan_.seeds) * len(rest))
          break
        continue
      entry['arms'][arm.name] = report.arm_entry(arm, outcome, entry)
      if arm.name in setters and _needs_run_target(workload, args):
        report.set_baseline_target(entry)
      report.apply_target(entry)
      # The entry replaces the earlier one only once one of its arms ran.
      results['workloads'][workload.name] = entry
      results['meta']['wall_seconds'] = time.perf_counter() - start
      _write(args.out, results)  # saved after every arm and workload
      written += 1
  bar.close()
  status = _summary(args.out, results, written, failures,
                    len(plan_.workloads) * len(plan_.arms),
                    time.perf_counter() - start)
  if args.quick:
    print('This was a smoke test (--quick); '
          + FULL_RUN_HINT.format(seeds=DEFAULT_SEEDS))
  return status


def _summary(out: pathlib.Path, results: dict[str, Any], written: int,
             failures: Sequence[str], total: int, seconds: float) -> int:
  """Prints the score and what was written, then the failures; the exit
  status."""
  if written:
    print(report.anytime_table(results))
    print(report.anytime_comparison_table(results))
    print(f'wrote {out / "results.md"}, {report.RESULTS}, '
          f'{", ".join(_PROFILE_PNGS)} ({seconds:.0f} s)')
  if not failures:
    return 0
  print(f'cbp-optax workloads: error: {len(failures)} of {total} (workload, '
        'arm) failed' + ('' if written else '; nothing was written') + ':\n'
        + '\n'.join(f'  {line}' for line in failures), file=sys.stderr)
  return EXIT_FAILED


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Runs ``cbp-optax workloads``; returns the exit status (``EPILOG_EXIT``).

  Args:
    argv: the command's arguments (default: ``sys.argv[1:]``).
  """
  # Before anything makes JAX create its backend, which reads the flag.
  reproduce_cli._prefer_fast_cpu_convolutions()  # pylint: disable=protected-access
  parser = make_parser()
  args = parse(argv, parser)
  try:
    if args.compare_runs:
      first, second = _check_compare_runs(args)
    else:
      checked = _check_score_only(args) if args.score_only else plan(args)
  except ValueError as e:  # report.ResultsError included
    parser.error(str(e))
  if args.compare_runs:
    print(compare_runs_text(*map(str, map(_results_path, args.compare_runs)),
                            first, second))
    return 0
  if args.score_only:
    return _score_only(args, checked)
  return _train(args, checked)


if __name__ == '__main__':
  sys.exit(main())
