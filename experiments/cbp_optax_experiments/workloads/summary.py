"""What the docs say, computed from the committed results files.

``answer(dev, test)`` is the recommendation in the words every page gives
it (the dev split's choice, its dev and test scores, what test found faster);
``dev_ties(dev)`` the candidates the rule could not separate from it;
``results_table`` and ``centering_sentence`` the README's table and its
centered-versus-plain verdicts. A test compares each page with these, so a
number in the docs is always the results file's.
"""

from __future__ import annotations

from typing import Any, Mapping

from cbp_optax_experiments.workloads import decision
from cbp_optax_experiments.workloads import statistics



# Each candidate in a user's words: what to build and what to center.
RECIPES: dict[str, str] = {
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


def _decision(dev: Mapping[str, Any]) -> Mapping[str, Any]:
  """The rule's choice on ``dev`` (``arm``, ``undominated``): as
  ``report.rescore`` stored it, else ``decision.recommend`` applied once."""
  stored = dev.get('recommendation')
  if stored:
    return stored
  found = decision.recommend(dev)
  return {'arm': found.arm, 'undominated': found.undominated}


def _pooled(results: Mapping[str, Any], arm: str) -> list[dict[str, Any]]:
  """The pooled paired comparisons of ``arm`` (as arm A) with every other:
  the stored ones, else the family of ``arm`` as the recipe."""
  def of_arm(comparisons):
    return [c for c in comparisons
            if c['workload'] == 'pooled' and c['a'] == arm]
  found = of_arm(results.get('comparisons') or [])
  if found:
    return found
  arms = sorted({a for entry in results['workloads'].values()
                 for a in entry['arms']})
  return of_arm(statistics.compare(
      results, statistics.comparison_pairs(arms, recipe=arm)))


def answer(dev: Mapping[str, Any], test: Mapping[str, Any]) -> str:
  """The recommendation in the words every page gives it: the dev rule's
  choice (``recommend``), its dev and test steps scores with their 95%
  bootstrap intervals, and the arms paired tests on test found faster (or
  that none were).

  Args:
    dev: the dev split's results.json.
    test: the test split's (run after the choice; it only reports).

  Returns:
    One paragraph of plain text (names without markup).
  """
  if (test.get('meta') or {}).get('split') != 'test':
    raise ValueError('the second results must be the test split\'s')
  chosen = _decision(dev)['arm']
  text = (f'Use {RECIPES[chosen]}. The decision rule, written before the '
          f'runs, chose it on the dev split: steps score '
          f'{decision.fmt(_score(dev, chosen))} (95% interval, '
          f'{_seed_count(dev, chosen)} paired seeds). On the test split, run '
          f'after the choice, it scores {decision.fmt(_score(test, chosen))}')
  faster = sorted((c for c in _pooled(test, chosen)
                   if c['verdict'] == statistics.WORSE),
                  key=lambda c: (-_score(test, c['b'])[0], c['b']))
  if not faster:
    return text + ', and no arm is significantly faster than it there.'
  slower = [f'{_label(c["b"])} ({decision.fmt(_score(test, c["b"]))}, '
            f'median paired speedup {c["speedup"]:.2f}x)' for c in faster]
  listed = (', '.join(slower[:-1]) + ' and ' + slower[-1] if len(slower) > 1
            else slower[0])
  return (text + '; there, paired over seeds and workloads, it is '
          f'significantly slower than {listed}, and than no other arm.')


def _label(arm: str) -> str:
  """An arm in words: a peer's label, ``centered`` after it, or the name."""
  peer = arm.removesuffix(statistics.CENTERED_SUFFIX)
  if arm == 'muon_centered_batchnorm_plain':
    return 'Muon centered (BatchNorm models plain)'
  if peer in PEER_LABELS:
    return PEER_LABELS[peer] + (' centered' if peer != arm else '')
  return arm


def centering_sentence(results: Mapping[str, Any]) -> str:
  """Centered against plain for each peer, in words: the pooled paired
  verdicts (Holm-corrected) and the per-workload counts."""
  # The comparisons once: stored by report.rescore, else computed here.
  results = {**results, 'comparisons': (results.get('comparisons')
                                        or statistics.compare(results))}
  verdicts = centering_verdicts(results)
  split = (results.get('meta') or {}).get('split') or 'this run'
  by_verdict: dict[str, list[str]] = {}
  for peer, label in PEER_LABELS.items():
    if peer in verdicts:
      by_verdict.setdefault(verdicts[peer]['verdict'], []).append(label)
  def names(verdict):
    found = by_verdict.get(verdict)
    return ' and '.join(found) if found else 'none'
  pairs = {c['n'] for c in results['comparisons']
           if c['workload'] == 'pooled'}
  counts = [verdicts[p]['counts'] for p in PEER_LABELS if p in verdicts]
  per = [sum(c[v] for c in counts) for v in (
      statistics.BETTER, statistics.NO_DIFFERENCE, statistics.WORSE)]
  return (f'On {split}, pooled over the {max(pairs)} (workload, seed) pairs, '
          f'centering is significantly better than plain for '
          f'{names(statistics.BETTER)}, shows no detectable difference for '
          f'{names(statistics.NO_DIFFERENCE)}, and is significantly worse '
          f'for {names(statistics.WORSE)}; per workload, of the '
          f'{sum(per)} (peer, workload) pairs, {per[0]} are significantly '
          f'better, {per[1]} show no detectable difference and {per[2]} are '
          'significantly worse.')


def dev_ties(dev: Mapping[str, Any]) -> str:
  """The candidates the decision rule could not separate from its choice on
  the dev split, which the tie-break decided (empty when there were none).

  Args:
    dev: the dev split's results.json (its stored ``recommendation``, else
      ``decision.recommend``).

  Returns:
    One sentence of plain text, or ''.
  """
  stored = _decision(dev)
  others = [a for a in stored['undominated'] if a != stored['arm']]
  if not others:
    return ''
  return ('On the dev split no candidate beat it by the rule\'s margin; nor '
          'did any beat these, whose steps cost more (the tie-break takes the '
          'cheaper step): ' + '; '.join(
              f'{RECIPES[a]}, {decision.fmt(_score(dev, a))}'
              for a in others) + '.')


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


def _rounding(results: Mapping[str, Any]) -> str:
  return 'vmapped' if (results.get('meta') or {}).get('vmap') else 'looped'


def stability_table(first: Mapping[str, Any], second: Mapping[str, Any]
                    ) -> str:
  """Two runs of one split at two float32 roundings, side by side: each
  arm's steps score [interval] in both and whether the intervals overlap,
  then the per-(workload, arm) intervals, the pooled paired verdicts that
  changed or flipped, and the decision rule's choice in each
  (``statistics.stability``).

  Args:
    first, second: results.json of the same split; each is labelled by its
      ``meta.vmap`` (vmapped or looped).

  Returns:
    Markdown: a table and a list.
  """
  report = statistics.stability(first, second)
  a, b = _rounding(first), _rounding(second)
  if a == b:
    a, b = f'{a} (A)', f'{b} (B)'
  (sa, ia), (sb, ib) = _steps(first), _steps(second)
  lines = [f'| arm | steps score, {a} | steps score, {b} | every interval '
           'of the arm overlaps |', '|---|---|---|---|']
  for arm in sorted(set(sa) & set(sb), key=lambda x: (-sa[x], x)):
    lines.append(f'| {arm} | {decision.fmt((sa[arm], ia[arm]))} | '
                 f'{decision.fmt((sb[arm], ib[arm]))} | '
                 f'{"no" if report["arms"].get(arm) else "yes"} |')
  pairs = sum(1 for name in set(first['workloads']) & set(second['workloads'])
              for arm in set(first['workloads'][name]['arms'])
              & set(second['workloads'][name]['arms']))
  disjoint = [d for d in report['disjoint'] if d.startswith('steps to')]
  verdicts = statistics.pooled_verdicts(
      first.get('comparisons') or statistics.compare(first))
  def choice(results):
    found = ((results.get('recommendation') or {}).get('arm')
             or getattr(decision.maybe_recommend(results), 'arm', None))
    return found or 'nothing (the rule does not apply)'
  choices = [choice(first), choice(second)]
  lines += [
      '',
      f'- Steps-to-target intervals per (workload, arm): '
      f'{pairs - len(disjoint)} of {pairs} overlap'
      + (': disjoint ' + '; '.join(disjoint) if disjoint else '') + '.',
      f'- Pooled paired verdicts: {len(report["changed"])} of '
      f'{len(verdicts)} changed'
      + (' (' + '; '.join(report['changed']) + ')' if report['changed']
         else '') + f', {len(report["flips"])} flipped between significantly '
      'better and significantly worse.',
      f'- The decision rule chose {choices[0]} on the {a} run and '
      f'{choices[1]} on the {b} run.',
      f'- Stable (every interval overlaps, no verdict flips): '
      f'{"yes" if report["stable"] else "no"}.']
  return '\n'.join(lines)
