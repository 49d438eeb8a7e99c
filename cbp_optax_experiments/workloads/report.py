"""results.json (merged across runs), results.md and the profile PNG.

``results.json`` keeps every (workload, arm) measured into the output folder:
a later run replaces the (workload, arm) pairs it measures and keeps the
others, so one more arm can be added without rerunning the rest; the score is
recomputed over everything there (``rescore``), after every workload.
``load`` checks what it reads back (a damaged file is a ``ResultsError``
that names the file and the field), and ``write`` replaces results.json in
one step, so that an interrupted write leaves the previous file whole.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from typing import Any, Optional

import numpy as np

from cbp_optax_experiments.reproduce import plotting
from cbp_optax_experiments.workloads import arms as arms_lib
from cbp_optax_experiments.workloads import definitions
from cbp_optax_experiments.workloads import protocol
from cbp_optax_experiments.workloads import scoring

RESULTS = 'results.json'


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
_META_FIELDS = {'quick': (_is(bool), 'true or false')}
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
}
# One value per evaluation seed.
_PER_SEED = ('seeds', 'steps_to_target', 'diverged', 'final_metric',
             'best_metric', 'curves')


def _shown(value) -> str:
  text = json.dumps(value) if not isinstance(value, float) else repr(value)
  return text if len(text) <= 60 else text[:57] + '...'


def _check_fields(record, fields, where: str) -> None:
  """``where``: the record's dotted path in the file ('' at the top)."""
  for key, (check, what) in fields.items():
    field = f'{where}.{key}' if where else key
    if key not in record:
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
      lengths = {key: len(arm[key]) for key in _PER_SEED}
      if not arm['seeds'] or len(set(lengths.values())) > 1:
        raise ResultsError(
            f'{arm_where} must hold one value per evaluation seed (at least '
            'one) in each of ' + ', '.join(_PER_SEED) + '; lengths '
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
          'description': workload.description,
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


def median_target(entry: dict[str, Any], arm: str, higher: bool) -> float:
  """The median over seeds of ``arm``'s best metric (for an even count the
  worse of the two middle values, so that at least half the seeds reach it
  and the arm's median time is finite), rounded down to 3 digits (up when
  lower is better) so that those seeds still reach it."""
  worst = -math.inf if higher else math.inf
  best = sorted((worst if v is None else v
                 for v in entry['arms'][arm]['best_metric']),
                reverse=higher)
  value = float(best[len(best) // 2])
  rounded = (math.floor if higher else math.ceil)(value * 1000) / 1000
  return rounded if math.isfinite(value) else value


def times(results: dict[str, Any]) -> dict[str, dict[str, float]]:
  return {name: {arm: scoring.arm_time(a['steps_to_target'],
                                       a['cost_vs_adamw'])
                 for arm, a in w['arms'].items()}
          for name, w in results['workloads'].items()}


def rescore(results: dict[str, Any]) -> dict[str, Any]:
  """Fills ``score``, ``speedup_vs_adamw`` and ``ratios`` from the arms."""
  all_times = times(results)
  found = scoring.scores(all_times, arms_lib.REFERENCE)
  results['score'] = {arm: s['score'] for arm, s in found.items()}
  results['speedup_vs_adamw'] = {arm: s['speedup_vs_reference']
                                 for arm, s in found.items()}
  results['reached'] = {arm: s['reached'] for arm, s in found.items()}
  results['ratios'] = {arm: {w: (r if math.isfinite(r) else None)
                             for w, r in rs.items()}
                       for arm, rs in scoring.ratios(all_times).items()}
  results['r_max'] = scoring.R_MAX
  return results


# ---------------------------------------------------------------------------
# results.md


def _fmt_metric(value: Optional[float], metric: str) -> str:
  if value is None:
    return 'nan'
  return f'{value:.3f}' if metric != definitions.BITS_PER_BYTE else f'{value:.3f}'


def _steps_cell(arm: dict[str, Any]) -> str:
  cells = []
  for steps, bad in zip(arm['steps_to_target'], arm['diverged']):
    cells.append('diverged' if bad else ('missed' if steps is None
                                         else str(steps)))
  return ', '.join(cells)


def _time_cell(t: float) -> str:
  return f'{t:.0f}' if math.isfinite(t) else 'missed'


def workload_table(name: str, entry: dict[str, Any]) -> str:
  per_arm_time = {a: scoring.arm_time(r['steps_to_target'], r['cost_vs_adamw'])
                  for a, r in entry['arms'].items()}
  finite = [t for t in per_arm_time.values() if math.isfinite(t)]
  best = min(finite) if finite else math.inf
  rows = []
  for arm, r in entry['arms'].items():
    t = per_arm_time[arm]
    finals = r['final_metric']
    rows.append([
        arm, f'{r["learning_rate"]:g}', _steps_cell(r),
        f'{r["cost_vs_adamw"]:.2f}', _time_cell(t),
        f'{t / best:.2f}' if math.isfinite(t) else '∞',
        ', '.join(_fmt_metric(v, entry['metric']) for v in finals),
        f'{sum(r["diverged"])}/{len(r["diverged"])}',
    ])
  header = ['arm', 'lr', 'steps to target (per seed)', 'cost vs AdamW',
            'time to target (AdamW steps)', 'ratio to best',
            f'final {entry["metric"]} (per seed)', 'diverged']
  target = entry['target']
  return (f'### {name}\n\n{entry["description"]}. Target: '
          f'{entry["metric"]} {"≥" if entry["higher_is_better"] else "≤"} '
          f'{target if target is not None else "none"} ({entry["target_source"]}); '
          f'budget {entry["budget_steps"]} steps, evaluated every '
          f'{entry["eval_every"]}; grid {entry["grid"]}.\n\n'
          + plotting.markdown_table(header, rows) + '\n\n'
          + verdict(name, entry))


def verdict(name: str, entry: dict[str, Any]) -> str:
  """One line: the winner, by how much, and where CBP stands."""
  per_arm = {a: scoring.arm_time(r['steps_to_target'], r['cost_vs_adamw'])
             for a, r in entry['arms'].items()}
  ranked = sorted((t, a) for a, t in per_arm.items() if math.isfinite(t))
  if not ranked:
    return f'**Verdict ({name}):** no arm reached the target.'
  best_t, best = ranked[0]
  parts = [f'**Verdict ({name}):** {best} wins ({best_t:.0f} AdamW steps']
  if len(ranked) > 1:
    parts.append(f', {ranked[1][0] / best_t:.2f}x faster than the next, '
                 f'{ranked[1][1]}')
  adamw = per_arm.get(arms_lib.REFERENCE, math.inf)
  if best != arms_lib.REFERENCE and math.isfinite(adamw):
    parts.append(f'; {adamw / best_t:.2f}x faster than AdamW')
  parts.append(')')
  for cbp_arm in ('cbp', 'former_cbp_transformer', 'cbp_robust'):
    if cbp_arm in per_arm and cbp_arm != best:
      t = per_arm[cbp_arm]
      parts.append(f'; {cbp_arm}: ' + (f'{t / best_t:.2f}x the best' if
                                        math.isfinite(t) else
                                        _miss_reason(entry['arms'][cbp_arm])))
  return ''.join(parts) + '.'


def _miss_reason(arm: dict[str, Any]) -> str:
  n = len(arm['diverged'])
  diverged = sum(arm['diverged'])
  reached = sum(s is not None for s in arm['steps_to_target'])
  return (f'missed (reached on {reached}/{n} seeds, diverged on '
          f'{diverged}/{n})')


def score_table(results: dict[str, Any]) -> str:
  rows = []
  n = len(results['workloads'])
  for arm, score in sorted(results['score'].items(), key=lambda kv: -kv[1]):
    speed = results['speedup_vs_adamw'].get(arm)
    rows.append([arm, f'{score:.3f}', f'{results["reached"][arm]}/{n}',
                 '—' if speed is None else f'{speed:.2f}x'])
  return plotting.markdown_table(
      ['arm', f'profile score (r_max = {scoring.R_MAX:g})',
       'workloads reached', 'geo-mean speedup vs AdamW (both reach)'], rows)


def write(out: pathlib.Path, results: dict[str, Any]) -> None:
  """results.json, results.md and performance_profile.png in ``out``.

  Raises:
    OSError: ``out`` cannot be written; results.json is then the previous
      one (or absent), never a part of the new one.
  """
  out = pathlib.Path(out)
  rescore(results)
  _replace_json(out / RESULTS, results)
  meta = results.get('meta', {})
  lines = [
      ('**QUICK RUN (--quick): tiny sizes, targets set from this run\'s '
       'AdamW; the numbers say nothing about the optimizers.**\n'
       if meta.get('quick') else ''),
      f'Data: {meta.get("data", "?")}. jax {meta.get("jax", "?")} on '
      f'{meta.get("platform", "?")}. Evaluation seeds {meta.get("seeds")}, '
      f'tuning seed(s) {meta.get("tuning_seeds")}.',
      'Time to target = median over the evaluation seeds of the steps to '
      'the target (a missed or diverged seed counts as infinite) x the arm\'s '
      'step cost relative to AdamW (measured in the same process, '
      'alternating compiled chunks, medians): wall-clock in AdamW steps. '
      f'Score: AlgoPerf performance profile, rho(tau) integrated over [1, '
      f'{scoring.R_MAX:g}] and divided by {scoring.R_MAX - 1:g}.',
  ]
  sections = ['\n'.join(l for l in lines if l), '## Score', score_table(results),
              '![performance profile](performance_profile.png)',
              '## Workloads']
  for name, entry in results['workloads'].items():
    sections.append(workload_table(name, entry))
  plotting.write_markdown(out / 'results.md',
                          'Workloads: time to target vs AdamW', sections)
  plot_profile(out / 'performance_profile.png', results)


def _replace_json(path: pathlib.Path, payload: dict[str, Any]) -> None:
  """Writes a temporary file beside ``path``, then renames it over ``path``:
  a crash or a full disk mid-write leaves the previous file whole (the
  rename is atomic on POSIX and Windows)."""
  partial = path.with_name(f'.{path.name}.partial')
  try:
    plotting.write_json(partial, payload)
    os.replace(partial, path)
  finally:
    partial.unlink(missing_ok=True)


def plot_profile(path: pathlib.Path, results: dict[str, Any]) -> None:
  all_ratios = scoring.ratios(times(results))
  fig, ax = plotting.new_axes()
  taus = np.linspace(1.0, scoring.R_MAX, 301)
  for i, (arm, rs) in enumerate(sorted(all_ratios.items())):
    values = [scoring.rho(rs, t) for t in taus]
    ax.step(taus, values, where='post', color=f'C{i % 10}',
            ls='-' if i < 10 else '--',
            label=f'{arm} ({results["score"][arm]:.2f})')
  ax.set_xlabel('tau (time to target / best arm\'s)')
  ax.set_ylabel('fraction of workloads')
  ax.set_ylim(-0.02, 1.02)
  ax.set_title('performance profile (score in legend)', fontsize=9)
  ax.legend(fontsize=6)
  plotting.save(fig, path)
