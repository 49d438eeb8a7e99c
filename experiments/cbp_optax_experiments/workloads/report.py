"""results.json (merged across runs), results.md and the profile PNGs.

``results.json`` keeps every (workload, arm) measured into the output folder:
a later run replaces the (workload, arm) pairs it measures and keeps the
others, so one more arm can be added without rerunning the rest; the scores
are recomputed over everything there (``rescore``), after every arm.

Three scores (``PROFILES``): the performance profile of time to target in
steps (device-independent; the headline, ``HEADLINE``), the one in
wall-clock (steps times the step cost relative to AdamW measured on this
machine), and the final metric at the budget normalized per workload.

Each score has its 95% bootstrap interval over the evaluation seeds, each
(workload, arm) the median and interval of its steps to target and final
metric, and the paired comparisons (centered vs plain, the recipe vs every
arm) their Wilcoxon tests and verdicts (``statistics``); a dev run that the
decision rule applies to gets its recommendation (``decision``).

``load`` checks what it reads back (a damaged file is a ``ResultsError``
that names the file and the field), and ``write`` replaces results.json in
one step (``protocol.write_atomically``), so that an interrupted write
leaves the previous file whole.
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any, Callable, Optional, Sequence

import numpy as np

from cbp_optax_experiments.reproduce import plotting
from cbp_optax_experiments.workloads import arms as arms_lib
from cbp_optax_experiments.workloads import decision
from cbp_optax_experiments.workloads import definitions
from cbp_optax_experiments.workloads import protocol
from cbp_optax_experiments.workloads import scoring
from cbp_optax_experiments.workloads import splits
from cbp_optax_experiments.workloads import statistics

RESULTS = 'results.json'
STEPS, WALL_CLOCK, FINAL = 'steps', 'wall_clock', 'final_metric'
ANYTIME, ANYTIME_WALL_CLOCK = 'anytime', 'anytime_wall_clock'
PROFILES = {
    ANYTIME: ('any-time score over a ladder of targets, in steps '
              '(device-independent)'),
    ANYTIME_WALL_CLOCK: ('any-time score over a ladder of targets, in '
                         'wall-clock (AdamW steps on this machine)'),
    STEPS: 'time to target in steps (device-independent)',
    WALL_CLOCK: 'time to target in wall-clock (AdamW steps on this machine)',
    FINAL: 'final metric at the budget, normalized per workload',
}
# The headline: the any-time score in steps (``scoring``), which reads every
# evaluation of every run against targets from easy to hard; steps are
# deterministic and the same on every device, while a CPU's step costs are
# not what a GPU user pays (Muon's Newton-Schulz costs 2-7x an AdamW step
# here) and move between runs: the wall-clock twin is reported beside it.
# The single-target profiles (AlgoPerf's) stay as views.
HEADLINE = ANYTIME


class ResultsError(ValueError):
  """A results.json that cannot be used; the message names the file and the
  field."""


def _is_number(value) -> bool:
  return (isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value))


def _is_positive(value) -> bool:
  return _is_number(value) and value > 0


def _is_count(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_integer(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _optional(check):
  return lambda value: value is None or check(value)


def _list_of(check):
  return lambda value: isinstance(value, list) and all(map(check, value))


def _is(kind):
  return lambda value: isinstance(value, kind)


_NUMBERS_OR_NULLS = (_list_of(_optional(_is_number)),
                     'a list of numbers or nulls')

# Key -> (check, what the value must be): the fields that ``write``,
# ``use_code_targets`` and a resumed run read back. Other keys are kept as
# they are, unchecked.
_META_FIELDS = {
    'quick': (_is(bool), 'true or false'),
    'split': (lambda value: value is None or value in splits.SPLITS,
              f'null or one of {", ".join(map(json.dumps, splits.SPLITS))}'),
}
_WORKLOAD_FIELDS = {
    'metric': (_is(str), 'a string'),
    'target': (_optional(_is_number), 'a number or null'),
    'higher_is_better': (_is(bool), 'true or false'),
    'budget_steps': (_is_count, 'a positive integer'),
    'eval_every': (_is_count, 'a positive integer'),
    'grid': (_list_of(_is_positive), 'a list of positive learning rates'),
    'description': (_is(str), 'a string'),
    'target_source': (_is(str), 'a string'),
    'arms': (_is(dict), 'an object (arm name -> record)'),
    'family': (_is(str), 'a string'),
    'validation_size': (_optional(_is_count), 'a positive integer or null'),
    'target_setter': (_optional(_is(str)), 'an arm name or null'),
}
_ARM_FIELDS = {
    'learning_rate': (_is_positive, 'a positive number'),
    'seeds': (_list_of(_is_integer), 'a list of integers'),
    'steps_to_target': (_list_of(_optional(_is_count)),
                        'a list of positive integers or nulls'),
    'diverged': (_list_of(_is(bool)), 'a list of true or false'),
    'final_metric': _NUMBERS_OR_NULLS,
    'best_metric': _NUMBERS_OR_NULLS,
    'curves': (_list_of(_NUMBERS_OR_NULLS[0]),
               'a list of lists of numbers or nulls'),
    'cost_vs_adamw': (_is_positive, 'a positive number'),
    'initial_metric': _NUMBERS_OR_NULLS,
}
# One value per evaluation seed.
_PER_SEED = ('seeds', 'steps_to_target', 'diverged', 'final_metric',
             'best_metric', 'curves', 'initial_metric')
# Written since the dev/test split: the results.json of an earlier run lacks
# them and stays readable (the report reads each with a default); where
# present they are checked like the others. ``normalized_final`` and
# ``resolution`` are not read back (``rescore`` recomputes them).
_SINCE_THE_SPLIT = frozenset({'split', 'family', 'validation_size',
                              'target_setter', 'initial_metric'})


def _shown(value) -> str:
  text = json.dumps(value) if not isinstance(value, float) else repr(value)
  return text if len(text) <= 60 else text[:57] + '...'


def _check_fields(record, fields, where: str) -> None:
  """``where``: the record's dotted path in the file ('' at the top)."""
  for key, (check, what) in fields.items():
    field = f'{where}.{key}' if where else key
    if key not in record:
      if key in _SINCE_THE_SPLIT:
        continue
      raise ResultsError(f'{field} is missing')
    if not check(record[key]):
      raise ResultsError(f'{field} must be {what}, got '
                         f'{_shown(record[key])}')


def validate(results) -> None:
  """Raises ``ResultsError`` (naming the field) unless ``results`` has the
  shape that ``write`` gives results.json."""
  if not isinstance(results, dict):
    raise ResultsError(f'the top level must be an object, got '
                       f'{_shown(results)}')
  _check_fields(results, {'meta': (_is(dict), 'an object'),
                          'workloads': (_is(dict), 'an object')}, '')
  _check_fields(results['meta'], _META_FIELDS, 'meta')
  for name, entry in results['workloads'].items():
    where = f'workloads.{name}'
    if not isinstance(entry, dict):
      raise ResultsError(f'{where} must be an object, got {_shown(entry)}')
    _check_fields(entry, _WORKLOAD_FIELDS, where)
    for arm_name, arm in entry['arms'].items():
      arm_where = f'{where}.arms.{arm_name}'
      if not isinstance(arm, dict):
        raise ResultsError(f'{arm_where} must be an object, got '
                           f'{_shown(arm)}')
      _check_fields(arm, _ARM_FIELDS, arm_where)
      lengths = {key: len(arm[key]) for key in _PER_SEED if key in arm}
      if not arm['seeds'] or len(set(lengths.values())) > 1:
        raise ResultsError(
            f'{arm_where} must hold one value per evaluation seed (at least '
            'one) in each of ' + ', '.join(lengths) + '; lengths '
            + ', '.join(f'{k} {n}' for k, n in lengths.items()))


def load(out: pathlib.Path) -> Optional[dict[str, Any]]:
  """``out/results.json``, checked; None when there is none.

  Raises:
    ResultsError: the file cannot be read, is not JSON, or lacks a field (or
      has one of the wrong type) that the report reads: the message names
      the file, the field and the value.
  """
  path = pathlib.Path(out) / RESULTS
  if not (path.exists() or path.is_symlink()):
    return None
  return load_file(path)


def load_file(path: pathlib.Path) -> dict[str, Any]:
  """The results.json at ``path``, checked (as ``load``).

  Raises:
    ResultsError: as ``load``, and when there is no file at ``path``.
  """
  path = pathlib.Path(path)
  try:
    results = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ResultsError(f'{path} is damaged: not valid JSON ({e.msg} at line '
                       f'{e.lineno}, column {e.colno})') from e
  except (OSError, UnicodeDecodeError) as e:
    raise ResultsError(f'{path} cannot be read ({e})') from e
  try:
    validate(results)
  except ResultsError as e:
    raise ResultsError(f'{path} is damaged: {e}') from e
  return results


def empty(meta: dict[str, Any]) -> dict[str, Any]:
  return {'workloads': {}, 'score': {}, 'meta': meta}


def workload_entry(workload: definitions.Workload, target: Optional[float],
                   target_source: str) -> dict[str, Any]:
  return {'metric': workload.metric, 'target': target,
          'budget_steps': workload.steps,
          'higher_is_better': workload.higher_is_better,
          'eval_every': workload.eval_every, 'grid': list(workload.grid),
          'description': workload.description, 'family': workload.family,
          'validation_size': workload.validation_size,
          'target_source': target_source, 'arms': {}}


def _floats(values) -> list[Optional[float]]:
  return [float(v) if math.isfinite(v) else None for v in values]


def arm_entry(arm: arms_lib.Arm, outcome: protocol.ArmOutcome,
              entry: dict[str, Any]) -> dict[str, Any]:
  """The arm's results.json record (steps to target filled by ``apply``)."""
  return {
      'learning_rate': outcome.learning_rate,
      'seeds': [r.seed for r in outcome.runs],
      'steps_to_target': [None] * len(outcome.runs),
      'diverged': [r.diverged for r in outcome.runs],
      'final_metric': _floats([r.metrics[-1] for r in outcome.runs]),
      'best_metric': _floats([protocol.best_metric(r.metrics.tolist(),
                                                   entry['higher_is_better'])
                              for r in outcome.runs]),
      'initial_metric': _floats([r.initial_metric for r in outcome.runs]),
      'curves': [_floats(r.metrics) for r in outcome.runs],
      'cost_vs_adamw': outcome.cost_vs_reference,
      'ms_per_step': 1e3 * outcome.seconds_per_step,
      'adamw_ms_per_step_same_process': 1e3 * outcome.reference_seconds_per_step,
      'tuning': {
          f'{lr:g}': {'seeds': [r.seed for r in runs],
                      'diverged': [r.diverged for r in runs],
                      'best_metric': _floats([protocol.best_metric(
                          r.metrics.tolist(), entry['higher_is_better'])
                                              for r in runs])}
          for lr, runs in sorted(outcome.tuning.items())},
      'centered': outcome.centered,
      'description': arm.description,
      'wall_seconds': outcome.wall_seconds,
      # A user arm's code (arms.code_fingerprint): which version ran.
      **({'code_fingerprint': arm.fingerprint} if arm.fingerprint else {}),
  }


def apply_target(entry: dict[str, Any]) -> None:
  """Steps to target of every arm from its stored curves and the target."""
  for arm in entry['arms'].values():
    arm['steps_to_target'] = [
        protocol.steps_to_target(curve, entry['target'], entry['eval_every'],
                                 entry['higher_is_better'], bad)
        for curve, bad in zip(arm['curves'], arm['diverged'])]


def use_code_targets(results: dict[str, Any]) -> None:
  """Each workload's target from ``definitions.TARGETS`` where it has one;
  steps to target recomputed from the stored curves."""
  for name, entry in results['workloads'].items():
    if name in definitions.TARGETS:
      entry['target'] = definitions.TARGETS[name]
      entry['target_source'] = 'fixed in code (definitions.TARGETS)'
      apply_target(entry)


def baseline_target(entry: dict[str, Any]
                    ) -> tuple[Optional[float], str, Optional[str]]:
  """AlgoPerf's target from the baselines in ``entry`` (``scoring.target``):
  ``(target, source, baseline)``; ``(None, ..., None)`` when none has
  run."""
  present = [b for b in arms_lib.BASELINES if b in entry['arms']]
  if not present:
    return None, 'none (no baseline has run)', None
  # A diverged seed counts as the worst metric, whatever it reached first.
  value, best = scoring.target(
      {b: [None if bad else v for v, bad in zip(
          entry['arms'][b]['best_metric'], entry['arms'][b]['diverged'])]
           for b in present},
      entry['higher_is_better'])
  missing = [b for b in arms_lib.BASELINES if b not in present]
  source = (f'best median of the tuned baselines ({", ".join(present)}): '
            f'{best}\'s' if best else 'no baseline reached a finite metric')
  if missing:
    source += f'; {", ".join(missing)} not run'
  return (value if math.isfinite(value) else None), source, best


def set_baseline_target(entry: dict[str, Any]) -> None:
  """``entry``'s target (and its source and setter) from its baselines."""
  value, source, setter = baseline_target(entry)
  entry['target'], entry['target_source'] = value, (
      f'set from this run: {source}')
  entry['target_setter'] = setter


# ---------------------------------------------------------------------------
# Scores


def arm_time(arm: dict[str, Any], profile: str) -> float:
  cost = arm['cost_vs_adamw'] if profile == WALL_CLOCK else 1.0
  return scoring.arm_time(arm['steps_to_target'], cost)


def times(results: dict[str, Any], profile: str = WALL_CLOCK
          ) -> dict[str, dict[str, float]]:
  return {name: {arm: arm_time(a, profile) for arm, a in w['arms'].items()}
          for name, w in results['workloads'].items()}


def initial_metric(entry: dict[str, Any]) -> float:
  """Median over every run of the metric at initialization (every arm
  starts from the same one; a centered model computes the same function)."""
  values = [v for arm in entry['arms'].values()
            for v in arm.get('initial_metric', []) if v is not None]
  return float(np.median(values)) if values else math.nan


def normalized_finals(entry: dict[str, Any]) -> dict[str, float]:
  initial = initial_metric(entry)
  finals = {a: scoring.final_value(r['final_metric'], r['diverged'], initial)
            for a, r in entry['arms'].items()}
  return scoring.normalized_finals(finals, initial, entry['higher_is_better'])


def resolution(entry: dict[str, Any]) -> dict[str, Any]:
  """How well the workload resolves its target: the seed-to-seed standard
  deviation of the final metric (of the baseline that set the target, and
  the median over every arm), the gap between the target and where training
  starts, and that gap in standard deviations."""
  setter = entry.get('target_setter')
  if setter not in entry['arms']:
    setter = next((b for b in arms_lib.BASELINES if b in entry['arms']),
                  None)

  def std(arm):
    values = [v for v in arm['final_metric'] if v is not None]
    return float(np.std(values, ddof=1)) if len(values) > 1 else math.nan
  per_arm = [std(a) for a in entry['arms'].values()]
  per_arm = [s for s in per_arm if math.isfinite(s)]
  sigma = std(entry['arms'][setter]) if setter else math.nan
  start = initial_metric(entry)
  target = entry.get('target')
  gap = abs(target - start) if target is not None else math.nan
  return {'target_setter': setter, 'seed_std': sigma,
          'median_arm_seed_std': (float(np.median(per_arm)) if per_arm
                                  else math.nan),
          'initial_metric': start, 'target_gap': gap,
          'gap_in_std': gap / sigma if sigma and math.isfinite(sigma)
                        else math.nan,
          'validation_size': entry.get('validation_size')}


def workload_ladder(entry: dict[str, Any]) -> dict[str, Any]:
  """The workload's ladder of targets (``scoring.ladder``) from its
  reference arm's curves and every arm's best metrics, and per arm the
  fraction of its seeds that reach each target. No reference arm (or no
  curve): no targets, and no any-time value on this workload."""
  arms = entry['arms']
  higher = entry['higher_is_better']
  reference = arms.get(arms_lib.REFERENCE)
  if reference is not None and not reference.get('curves'):
    reference = None  # no stored curves (a hand-made record): no ladder
  targets = [] if reference is None else scoring.ladder(
      reference['curves'], reference['diverged'],
      {name: arm['best_metric'] for name, arm in arms.items()}, higher)
  return {
      'targets': targets,
      'reference': arms_lib.REFERENCE if reference is not None else None,
      'fractions': list(scoring.LADDER_FRACTIONS),
      'hard': scoring.HARD_TARGETS,
      'reach': {name: scoring.reach_fractions(
          arm.get('curves') or [], arm['diverged'], targets, higher)
                for name, arm in arms.items()}}


def rescore(results: dict[str, Any]) -> dict[str, Any]:
  """Fills, per workload, ``ladder`` (``workload_ladder``), ``resolution``,
  ``normalized_final`` and ``statistics`` (per arm: median and interval of
  the steps to target and of the final metric, and the mean any-time value
  and its interval); then ``profiles`` (each of ``PROFILES``, with its 95%
  bootstrap intervals), ``score`` and ``score_interval`` (the headline's:
  the any-time score in steps), ``speedup_vs_adamw``, ``reached`` and
  ``ratios`` (of the single-target profile in steps), ``comparisons``
  (steps to the single target, ``statistics.compare``),
  ``anytime_comparisons`` (``statistics.compare_anytime``) and
  ``recommendation`` (``decision.recommend`` of a dev run that it applies
  to, else None). Everything is read from the stored curves: rescoring an
  earlier results.json recomputes all of it."""
  for entry in results['workloads'].values():
    entry['ladder'] = workload_ladder(entry)
  profiles = {}
  for profile in (ANYTIME, ANYTIME_WALL_CLOCK):
    found = statistics.anytime_scores(
        results, wall_clock=profile == ANYTIME_WALL_CLOCK)
    profiles[profile] = {
        'score': {arm: f['score'] for arm, f in found.items()},
        'score_interval': {arm: f['interval'] for arm, f in found.items()}}
  for profile in (STEPS, WALL_CLOCK):
    all_times = times(results, profile)
    found = scoring.scores(all_times, arms_lib.REFERENCE)
    profiles[profile] = {
        'score': {arm: s['score'] for arm, s in found.items()},
        'score_interval': statistics.score_intervals(
            results, wall_clock=profile == WALL_CLOCK),
        'speedup_vs_adamw': {arm: s['speedup_vs_reference']
                             for arm, s in found.items()},
        'reached': {arm: s['reached'] for arm, s in found.items()},
        'ratios': {arm: {w: (r if math.isfinite(r) else None)
                         for w, r in rs.items()}
                   for arm, rs in scoring.ratios(all_times).items()},
    }
  normalized = {}
  for name, entry in results['workloads'].items():
    normalized[name] = normalized_finals(entry)
    entry['normalized_final'] = normalized[name]
    entry['resolution'] = resolution(entry)
    entry['statistics'] = statistics.arm_intervals(entry)
    if entry['ladder']['targets']:
      for arm, cell in entry['statistics'].items():
        if entry['arms'][arm].get('curves'):
          cell['anytime'] = statistics.anytime_cell(entry, arm)
  profiles[FINAL] = {'score': scoring.final_scores(normalized)}
  results['profiles'] = profiles
  results['headline'] = HEADLINE
  headline = profiles[HEADLINE]
  results['score'] = headline['score']
  results['score_interval'] = headline['score_interval']
  results['comparisons'] = statistics.compare(results)
  results['anytime_comparisons'] = statistics.compare_anytime(results)
  found = decision.maybe_recommend(results)
  results['recommendation'] = None if found is None else {
      'arm': found.arm, 'reason': found.reason,
      'undominated': list(found.undominated), 'rule': decision.VERSION}
  target_view = profiles[STEPS]
  results['speedup_vs_adamw'] = target_view['speedup_vs_adamw']
  results['reached'] = target_view['reached']
  results['ratios'] = target_view['ratios']
  results['r_max'] = scoring.R_MAX
  return results


# ---------------------------------------------------------------------------
# results.md


def _fmt_metric(value: Optional[float], metric: str) -> str:
  del metric
  return 'nan' if value is None else f'{value:.3f}'


def _steps_cell(arm: dict[str, Any]) -> str:
  cells = []
  for steps, bad in zip(arm['steps_to_target'], arm['diverged']):
    cells.append('diverged' if bad else ('missed' if steps is None
                                         else str(steps)))
  return ', '.join(cells)


def _time_cell(t: float) -> str:
  return f'{t:.0f}' if math.isfinite(t) else 'missed'


def _ratio_cell(t: float, best: float) -> str:
  return f'{t / best:.2f}' if math.isfinite(t) else '∞'


def _best(per_arm: dict[str, float]) -> float:
  finite = [t for t in per_arm.values() if math.isfinite(t)]
  return min(finite) if finite else math.inf


def workload_table(name: str, entry: dict[str, Any]) -> str:
  steps = {a: arm_time(r, STEPS) for a, r in entry['arms'].items()}
  wall = {a: arm_time(r, WALL_CLOCK) for a, r in entry['arms'].items()}
  best_steps, best_wall = _best(steps), _best(wall)
  normalized = entry.get('normalized_final') or normalized_finals(entry)
  stats = entry.get('statistics') or statistics.arm_intervals(entry)
  rows = []
  for arm, r in entry['arms'].items():
    rows.append([
        arm, f'{r["learning_rate"]:g}', _steps_cell(r),
        _steps_interval_cell(stats.get(arm, {}).get('steps_to_target')),
        _ratio_cell(steps[arm], best_steps),
        f'{r["cost_vs_adamw"]:.2f}', _time_cell(wall[arm]),
        _ratio_cell(wall[arm], best_wall),
        ', '.join(_fmt_metric(v, entry['metric']) for v in r['final_metric']),
        _final_interval_cell(stats.get(arm, {}).get('final_metric')),
        f'{normalized.get(arm, 0.0):.2f}',
        f'{sum(r["diverged"])}/{len(r["diverged"])}',
    ])
  header = ['arm', 'lr', 'steps to target (per seed)',
            'median steps [95% interval]',
            'ratio (steps)', 'cost vs AdamW', 'wall-clock (AdamW steps)',
            'ratio (wall-clock)', f'final {entry["metric"]} (per seed)',
            'final, median [95% interval]',
            'final, normalized', 'diverged']
  target = entry['target']
  res = entry.get('resolution') or resolution(entry)
  fmt = lambda v: f'{v:.3g}' if v is not None and math.isfinite(v) else 'n/a'
  return (f'### {name}\n\n{entry["description"]} (family '
          f'{entry.get("family") or "?"}). Target: {entry["metric"]} '
          f'{"≥" if entry["higher_is_better"] else "≤"} '
          f'{target if target is not None else "none"} '
          f'({entry["target_source"]}); budget {entry["budget_steps"]} '
          f'steps, evaluated every {entry["eval_every"]}; grid '
          f'{entry["grid"]}.\n\nResolution: {res["validation_size"]} '
          f'validation examples; seed-to-seed std of the final metric '
          f'{fmt(res["seed_std"])} ({res["target_setter"]}; median over '
          f'arms {fmt(res["median_arm_seed_std"])}); the target is '
          f'{fmt(res["target_gap"])} from the initial '
          f'{fmt(res["initial_metric"])}, {fmt(res["gap_in_std"])} std.\n\n'
          + plotting.markdown_table(header, rows) + '\n\n'
          + verdict(name, entry))


def _winner(per_arm: dict[str, float], unit: str) -> str:
  ranked = sorted((t, a) for a, t in per_arm.items() if math.isfinite(t))
  if not ranked:
    return f'in {unit}, no arm reached the target'
  best_t, best = ranked[0]
  text = f'in {unit}, {best} wins ({best_t:.0f}'
  if len(ranked) > 1:
    text += f'; {ranked[1][0] / best_t:.2f}x faster than the next, ' \
            f'{ranked[1][1]}'
  adamw = per_arm.get(arms_lib.REFERENCE, math.inf)
  if best != arms_lib.REFERENCE and math.isfinite(adamw):
    text += f'; {adamw / best_t:.2f}x faster than AdamW'
  return text + ')'


def verdict(name: str, entry: dict[str, Any]) -> str:
  """The winner in steps and in wall-clock, by how much, and where the CBP
  arms stand (in steps)."""
  steps = {a: arm_time(r, STEPS) for a, r in entry['arms'].items()}
  wall = {a: arm_time(r, WALL_CLOCK) for a, r in entry['arms'].items()}
  parts = [f'**Verdict ({name}):** ' + _winner(steps, 'steps') + '; '
           + _winner(wall, 'wall-clock (AdamW steps)')]
  best = _best(steps)
  for cbp_arm in ('cbp', 'cbp_robust', 'schedule_free_cbp_robust'):
    if cbp_arm in steps and math.isfinite(best):
      t = steps[cbp_arm]
      parts.append(f'; {cbp_arm}: ' + (f'{t / best:.2f}x the best in steps'
                                        if math.isfinite(t) else
                                        _miss_reason(entry['arms'][cbp_arm])))
  return ''.join(parts) + '.'


def _miss_reason(arm: dict[str, Any]) -> str:
  n = len(arm['diverged'])
  diverged = sum(arm['diverged'])
  reached = sum(s is not None for s in arm['steps_to_target'])
  return (f'missed (reached on {reached}/{n} seeds, diverged on '
          f'{diverged}/{n})')


def anytime_table(results: dict[str, Any]) -> str:
  """One row per arm, best first: the any-time score (the headline) and its
  wall-clock twin, each with its 95% interval, and the workloads it ran."""
  profiles = results.get('profiles') or rescore(results)['profiles']
  steps, wall = profiles[ANYTIME], profiles[ANYTIME_WALL_CLOCK]
  rows = []
  for arm, score in sorted(steps['score'].items(),
                           key=lambda kv: (-kv[1], kv[0])):
    rows.append([arm, f'{score:.3f}',
                 _interval_cell(steps['score_interval'].get(arm)),
                 f'{wall["score"][arm]:.3f}',
                 _interval_cell(wall['score_interval'].get(arm))])
  return plotting.markdown_table(
      ['arm', 'any-time score, steps (headline)', '95% interval',
       'any-time score, wall-clock', '95% interval'], rows)


def ladder_table(name: str, entry: dict[str, Any]) -> str:
  """The workload's ladder of targets and, per arm, the fraction of its
  seeds that reach each, with its mean any-time value [95% interval]."""
  ladder = entry.get('ladder') or workload_ladder(entry)
  targets = ladder['targets']
  if not targets:
    return (f'Ladder ({name}): none (no {arms_lib.REFERENCE} run on this '
            'workload): no any-time value here.')
  stats = entry.get('statistics') or {}
  rows = []
  for arm, reach in ladder['reach'].items():
    cell = (stats.get(arm) or {}).get('anytime')
    if cell is None and entry['arms'][arm].get('curves'):
      cell = statistics.anytime_cell(entry, arm)
    rows.append([arm] + [f'{r:.1f}' for r in reach] + [
        '—' if cell is None else
        f'{cell["mean"]:.3f} {_interval_cell(cell["interval"])}'])
  fractions = ', '.join(f'{f:g}' for f in ladder['fractions'])
  header = ['arm'] + [f'{_fmt_metric(t, entry["metric"])}' for t in targets]
  return (f'Ladder: {entry["metric"]} {"≥" if entry["higher_is_better"] else "≤"}'
          f' each target, easiest first ({ladder["reference"]}\'s median '
          f'best-so-far at {fractions} of the budget, then {ladder["hard"]} '
          'steps up to the best median of any arm); fraction of seeds '
          'reaching each, and the mean any-time value [95% interval].\n\n'
          + plotting.markdown_table(header + ['any-time value'], rows))


def anytime_comparison_table(results: dict[str, Any],
                             pooled: bool = True) -> str:
  """The paired comparisons of any-time values
  (``statistics.compare_anytime``): pooled, or per workload."""
  comparisons = results.get('anytime_comparisons')
  if comparisons is None:
    comparisons = statistics.compare_anytime(results)
  return _paired_table(
      comparisons, pooled, ['mean difference (A - B)'],
      lambda c, low, high: [f'{c["difference"]:+.3f}',
                            f'[{low:+.3f}, {high:+.3f}]'],
      '(no pairs in the family among these arms)')


def _paired_table(comparisons: Sequence[dict[str, Any]], pooled: bool,
                  effect: list[str],
                  cells: Callable[[dict[str, Any], float, float], list[str]],
                  empty: str) -> str:
  """One row per pooled (or per-workload) comparison: the pair, the pairs
  counted, ``cells`` (the effect and its interval), the tests."""
  rows = [[c['a'], c['b']] + ([] if pooled else [c['workload']])
          + [str(c['n'])] + cells(c, *c['interval'])
          + [f'{c["p"]:.3g}', f'{c["p_holm"]:.3g}', c['verdict']]
          for c in comparisons if (c['workload'] == 'pooled') == pooled]
  if not rows:
    return empty
  return plotting.markdown_table(
      ['arm A', 'vs arm B'] + ([] if pooled else ['workload'])
      + ['pairs (workload, seed)'] + effect
      + ['95% paired bootstrap', 'Wilcoxon p', 'Holm p',
         f'A is ... (alpha {statistics.ALPHA:g})'], rows)


def score_table(results: dict[str, Any]) -> str:
  """One row per arm: the single-target scores, workloads reached,
  speedups."""
  profiles = results.get('profiles') or rescore(results)['profiles']
  n = len(results['workloads'])
  steps, wall = profiles[STEPS], profiles[WALL_CLOCK]
  final = profiles[FINAL]['score']
  rows = []
  fmt = lambda s: '—' if s is None else f'{s:.2f}x'
  interval = lambda profile, arm: _interval_cell(
      profile.get('score_interval', {}).get(arm))
  for arm, score in sorted(steps['score'].items(),
                           key=lambda kv: (-kv[1], kv[0])):
    rows.append([arm, f'{score:.3f}', interval(steps, arm),
                 f'{wall["score"][arm]:.3f}', interval(wall, arm),
                 f'{final.get(arm, 0.0):.3f}',
                 f'{steps["reached"][arm]}/{n}',
                 fmt(steps['speedup_vs_adamw'].get(arm)),
                 fmt(wall['speedup_vs_adamw'].get(arm))])
  return plotting.markdown_table(
      ['arm', f'score, steps (r_max = {scoring.R_MAX:g}; headline)',
       '95% interval', 'score, wall-clock', '95% interval',
       'final metric, normalized',
       'workloads reached', 'speedup vs AdamW, steps (both reach)',
       'speedup vs AdamW, wall-clock'], rows)


def _interval_cell(interval) -> str:
  if not interval:
    return '—'
  fmt = lambda v: '∞' if v is None or not math.isfinite(v) else f'{v:.3f}'
  return f'[{fmt(interval[0])}, {fmt(interval[1])}]'


def _steps_interval_cell(stat: Optional[dict[str, Any]]) -> str:
  if not stat:
    return '—'
  fmt = lambda v: 'missed' if v is None else f'{v:.0f}'
  low, high = stat['interval']
  return (f'{fmt(stat["median"])} [{fmt(low)}, '
          f'{"∞" if high is None else fmt(high)}]')


def _final_interval_cell(stat: Optional[dict[str, Any]]) -> str:
  if not stat or stat['median'] is None:
    return '—'
  low, high = stat['interval']
  return f'{stat["median"]:.3f} [{low:.3f}, {high:.3f}]'


def comparison_table(results: dict[str, Any], pooled: bool = True) -> str:
  """The paired comparisons (``statistics.compare``): pooled, or per
  workload."""
  comparisons = results.get('comparisons')
  if comparisons is None:
    comparisons = statistics.compare(results)
  return _paired_table(
      comparisons, pooled, ['median speedup of A (steps)'],
      lambda c, low, high: [f'{2.0 ** c["median"]:.2f}x',
                            f'[{2.0 ** low:.2f}x, {2.0 ** high:.2f}x]'],
      '(no pairs: the family needs <peer>_centered with <peer>, or '
      f'{statistics.RECIPE} with another arm)')


ANYTIME_NOTE = (
    'Any-time score (scoring.py): per workload a ladder of targets from '
    'easy to hard (the reference\'s median best-so-far at fixed fractions of '
    'the budget, then equal steps up to the best median quality of any '
    'arm); per (workload, target, seed) the share of the evaluations at or '
    'past the target (0 when never reached or diverged); an arm\'s score is '
    'the mean over workloads of its mean over targets and seeds. Wall-clock: '
    'reaching at evaluation k costs the arm\'s step cost times k of AdamW\'s '
    'evaluation times. Intervals: 95% bootstrap over the evaluation seeds '
    '(resampled within each workload, one draw for every arm). Paired '
    'comparisons: per (workload, seed), A\'s value minus B\'s; the mean '
    'difference (workloads weighted equally) with its paired bootstrap '
    'interval; Wilcoxon signed-rank (zeros split), Holm-corrected within the '
    'pooled family and within each pair\'s workloads.')


STATISTICS_NOTE = (
    'Intervals: 95% percentile bootstrap ({resamples} resamples, fixed '
    'seed) over the evaluation seeds; a seed that missed the target counts '
    'as infinite (an interval ending in ∞: not reached in that share of '
    'resamples). Score intervals resample the seeds of every workload (the '
    'same draw for every arm: seeds are paired) and recompute the whole '
    'profile. Paired comparisons: per (workload, seed), log2 of B\'s steps '
    'to target over A\'s (a miss counted as {factor:g}x the budget; two '
    'misses tie), shown as the median speedup of A; Wilcoxon signed-rank '
    '(two-sided, zeros split), Holm-corrected within the pooled family and '
    'within the per-workload family; verdict at alpha {alpha:g}.')


def write(out: pathlib.Path, results: dict[str, Any]) -> None:
  """results.json, results.md and the profile PNGs in ``out``.

  Raises:
    OSError: ``out`` cannot be written; results.json is then the previous
      one (or absent), never a part of the new one.
  """
  out = pathlib.Path(out)
  rescore(results)
  protocol.write_atomically(
      out / RESULTS,
      json.dumps(plotting._jsonable(results), indent=1) + '\n')  # pylint: disable=protected-access
  meta = results.get('meta', {})
  split = meta.get('split')
  lines = [
      ('**QUICK RUN (--quick): tiny sizes, targets set from this run\'s '
       'baselines; the numbers say nothing about the optimizers.**\n'
       if meta.get('quick') else ''),
      (f'Split: **{split}** ({"chooses the defaults" if split == "dev" else "reports only, never chooses"}).'
       if split in ('dev', 'test') else ''),
      f'Data: {meta.get("data", "?")}. jax {meta.get("jax", "?")} on '
      f'{meta.get("platform", "?")}. Evaluation seeds {meta.get("seeds")}, '
      f'tuning seed(s) {meta.get("tuning_seeds")}.',
      'Targets: AlgoPerf\'s rule, the best over the tuned baselines '
      f'({", ".join(arms_lib.BASELINES)}) of the median over the evaluation '
      'seeds of the best validation metric within the budget. Time to '
      'target = median over the evaluation seeds of the steps to the target '
      '(a missed or diverged seed counts as infinite); in wall-clock, times '
      'the arm\'s step cost relative to AdamW (measured in the same process, '
      'compiled chunks of the two alternating for '
      f'{protocol.COST_WINDOW_SECONDS:g} s each, medians). Scores: '
      f'AlgoPerf performance profile, rho(tau) integrated over [1, '
      f'{scoring.R_MAX:g}] and divided by {scoring.R_MAX - 1:g}, in steps '
      '(the headline: device-independent and deterministic) and in '
      'wall-clock; and the final metric at the budget, normalized per '
      'workload from the initial metric (0) to the best arm\'s (1), averaged '
      'over workloads.',
  ]
  sections = ['\n'.join(l for l in lines if l), '## Score',
              anytime_table(results), ANYTIME_NOTE,
              '## Paired comparisons (any-time values)',
              '### Pooled over workloads', anytime_comparison_table(results),
              '### Per workload',
              anytime_comparison_table(results, pooled=False),
              '## Single-target view (AlgoPerf)', score_table(results),
              '![performance profile, steps](performance_profile.png)\n'
              '![performance profile, wall-clock]'
              '(performance_profile_wall_clock.png)',
              '### Paired comparisons (steps to the single target)',
              STATISTICS_NOTE.format(resamples=statistics.RESAMPLES,
                                     factor=statistics.CENSORED_FACTOR,
                                     alpha=statistics.ALPHA),
              '#### Pooled over workloads', comparison_table(results),
              '#### Per workload', comparison_table(results, pooled=False),
              '## Workloads']
  recommendation = results.get('recommendation')
  if recommendation:
    sections.insert(4, f'**Decision rule (decision.py, version '
                    f'{recommendation.get("rule", 1)}):** '
                    f'{recommendation["reason"]}')
  for name, entry in results['workloads'].items():
    sections.append(workload_table(name, entry))
    sections.append(ladder_table(name, entry))
  title = 'Workloads: any-time score' + (f' ({split} split)' if split else '')
  plotting.write_markdown(out / 'results.md', title, sections)
  plot_profile(out / 'performance_profile.png', results, STEPS)
  plot_profile(out / 'performance_profile_wall_clock.png', results,
               WALL_CLOCK)


def plot_profile(path: pathlib.Path, results: dict[str, Any],
                 profile: str = STEPS) -> None:
  all_ratios = scoring.ratios(times(results, profile))
  scores = results['profiles'][profile]['score']
  fig, ax = plotting.new_axes()
  taus = np.linspace(1.0, scoring.R_MAX, 301)
  for i, (arm, rs) in enumerate(sorted(all_ratios.items())):
    values = [scoring.rho(rs, t) for t in taus]
    ax.step(taus, values, where='post', color=f'C{i % 10}',
            ls=('-', '--', ':')[(i // 10) % 3],
            label=f'{arm} ({scores[arm]:.2f})')
  ax.set_xlabel('tau (time to target / best arm\'s)')
  ax.set_ylabel('fraction of workloads')
  ax.set_ylim(-0.02, 1.02)
  ax.set_title(f'performance profile, {PROFILES[profile]} (score in '
               'legend)', fontsize=8)
  ax.legend(fontsize=5)
  plotting.save(fig, path)
