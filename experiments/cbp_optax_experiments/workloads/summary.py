"""What the docs say, computed from the committed results files.

``dev_answer(dev)`` is the dev split's choice in the words the README, the
FAQ and the workloads page give it; ``answer(dev, test)`` adds the test
split's score; ``results_table`` is the README's table. A test compares each
page with these, so a number in the docs is always the results file's.
"""

from __future__ import annotations

from typing import Any, Mapping

from cbp_optax_experiments.workloads import decision
from cbp_optax_experiments.workloads import statistics



# The arm whose recipe ``cbp_optax.recommended`` builds.
RECOMMENDED_ARM = 'schedule_free_cbp_robust'

# Each candidate in a user's words: what to build and what to center.
RECIPES: dict[str, str] = {
    'muon_centered_batchnorm_plain': (
        'Muon (optax.contrib.muon) on the centered model, a model with '
        'BatchNorm left plain'),
    'muon_centered': 'Muon (optax.contrib.muon) on the centered model',
    'adamw_centered': 'AdamW (optax.adamw) on the centered model',
    'nadamw_centered': 'NAdamW (optax.nadamw) on the centered model',
    'schedule_free_adamw_centered': (
        'schedule-free AdamW (optax.contrib.schedule_free_adamw) on the '
        'centered model'),
    'cbp_robust': 'cbp.cbp_robust on the centered model',
    'schedule_free_cbp_robust': (
        'cbp.recommended (cbp_robust\'s preconditioner, M3 without momentum '
        'and each coordinate clipped to 3, inside optax.contrib.schedule_free) '
        'on the centered model, a model with BatchNorm left plain'),
}


def _steps(results: Mapping[str, Any]
           ) -> tuple[dict[str, float], dict[str, list[float]]]:
  """Every arm's steps score and its interval: as stored by
  ``report.rescore``, else computed."""
  stored = (results.get('profiles') or {}).get('steps') or {}
  if stored.get('score') and stored.get('score_interval'):
    return stored['score'], stored['score_interval']
  return (decision.steps_scores(results),
          statistics.score_intervals(results))


def _score(results: Mapping[str, Any], arm: str) -> tuple[float, list[float]]:
  scores, intervals = _steps(results)
  return scores[arm], intervals[arm]


def _seed_count(results: Mapping[str, Any], arm: str) -> int:
  return min(len(entry['arms'][arm]['steps_to_target'])
             for entry in results['workloads'].values())


def answer(dev: Mapping[str, Any], test: Mapping[str, Any]) -> str:
  """The recommendation in the words every page gives it: the dev rule's
  choice (``recommend``), its dev steps score and its test steps score, each
  with its 95% bootstrap interval.

  Args:
    dev: the dev split's results.json.
    test: the test split's (run after the choice; it only reports).

  Returns:
    One paragraph of plain text (names without markup).
  """
  stored = dev.get('recommendation') or {}
  chosen = stored.get('arm') or decision.recommend(dev).arm
  if (test.get('meta') or {}).get('split') != 'test':
    raise ValueError('the second results must be the test split\'s')
  return (f'Use {RECIPES[chosen]}. The decision rule, written before the '
          f'runs, chose it on the dev split (steps score '
          f'{decision.fmt(_score(dev, chosen))}, 95% interval, '
          f'{_seed_count(dev, chosen)} paired seeds); on the test split, '
          f'run after the choice, it scores {decision.fmt(_score(test, chosen))}.')


def dev_answer(dev: Mapping[str, Any]) -> str:
  """What the decision rule chose on the dev split, with the other
  candidates no candidate beat: the answer before the test split reports.

  Args:
    dev: the dev split's results.json (its stored ``recommendation``, else
      ``decision.recommend``).

  Returns:
    One paragraph of plain text.
  """
  stored = dev.get('recommendation')
  if not stored:
    found = decision.recommend(dev)
    stored = {'arm': found.arm, 'undominated': found.undominated}
  chosen, undominated = stored['arm'], stored['undominated']
  text = (f'On the dev split, the decision rule (written before the runs) '
          f'chose {RECIPES[chosen]}: steps score '
          f'{decision.fmt(_score(dev, chosen))}, 95% interval, '
          f'{_seed_count(dev, chosen)} paired seeds.')
  others = [a for a in undominated if a != chosen]
  if others:
    text += (' No candidate beat it by the rule\'s margin; nor did any beat '
             'these, whose steps cost more (the tie-break takes the cheaper '
             'step): ' + '; '.join(
                 f'{RECIPES[a]}, {decision.fmt(_score(dev, a))}'
                 for a in others) + '.')
  return text


def centering_verdicts(results: Mapping[str, Any]
                       ) -> dict[str, dict[str, Any]]:
  """``<peer>_centered`` against ``<peer>``, for each peer with both.

  Returns:
    peer -> ``verdict`` (pooled over workloads and seeds, Holm-corrected),
    ``speedup`` and ``interval`` (the pooled median paired speedup in steps
    and its 95% bootstrap interval), and ``counts``: how many workloads gave
    each per-workload verdict.
  """
  comparisons = results.get('comparisons') or statistics.compare(results)
  out: dict[str, dict[str, Any]] = {}
  for c in comparisons:
    a, b = c['a'], c['b']
    if a != b + statistics.CENTERED_SUFFIX:
      continue
    entry = out.setdefault(b, {'counts': {statistics.BETTER: 0,
                                          statistics.NO_DIFFERENCE: 0,
                                          statistics.WORSE: 0}})
    if c['workload'] == 'pooled':
      entry.update(verdict=c['verdict'], speedup=c['speedup'],
                   interval=[2.0 ** v for v in c['interval']])
    else:
      entry['counts'][c['verdict']] += 1
  return out


# The README's labels: peers (plain and centered columns), then the arms
# that exist only on the centered model, in this order.
PEER_LABELS: dict[str, str] = {
    'schedule_free_adamw': 'schedule-free AdamW', 'muon': 'Muon',
    'nadamw': 'NAdamW', 'adamw': 'AdamW'}
CENTERED_ONLY_LABELS: dict[str, str] = {
    'schedule_free_cbp_robust': '`cbp.recommended`',
    'muon_centered_batchnorm_plain': 'Muon, BatchNorm models plain',
    'cbp_robust': '`cbp.cbp_robust`',
    'cbp': '`cbp.cbp`'}


def results_table(results: Mapping[str, Any]) -> str:
  """The README's table: each peer's steps score [95% interval] plain and
  centered, the pooled paired verdict of centered against plain (median
  speedup in steps [interval]) and the per-workload verdict counts; then the
  arms that exist only on the centered model."""
  scores, intervals = _steps(results)
  verdicts = centering_verdicts(results)
  cell = lambda arm: (decision.fmt((scores[arm], intervals[arm]))
                      if arm in scores else '')
  lines = ['| optimizer | plain | centered | centered vs plain (pooled, '
           'median speedup in steps) | workloads: better / no difference / '
           'worse |', '|---|---|---|---|---|']
  for peer, label in PEER_LABELS.items():
    v = verdicts.get(peer)
    if v is None:
      continue
    low, high = v['interval']
    counts = v['counts']
    lines.append(
        f'| {label} | {cell(peer)} | {cell(peer + "_centered")} | '
        f'{v["verdict"]}, {v["speedup"]:.2f}x [{low:.2f}x, {high:.2f}x] | '
        f'{counts[statistics.BETTER]} / {counts[statistics.NO_DIFFERENCE]} '
        f'/ {counts[statistics.WORSE]} |')
  for arm, label in CENTERED_ONLY_LABELS.items():
    if arm in scores:
      lines.append(f'| {label} | | {cell(arm)} | | |')
  return '\n'.join(lines)
