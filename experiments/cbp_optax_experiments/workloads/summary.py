"""What the docs say, computed from the committed results files.

``answer(dev, test)`` is the recommendation in the words every page gives
it (the dev split's choice under the rule in force, its dev and test
any-time scores, what test found better or worse); ``dev_ties(dev)`` the
candidates the rule could not separate from it; ``results_table(dev,
test)`` and ``centering_sentence`` the README's table and its
centered-versus-plain verdicts. A test compares each page with these, so a
number in the docs is always the results file's.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

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
    'cbp_kron_centered': ('cbp.cbp_kron (cbp_robust with the '
                          'Kronecker-factored M3) on the centered model'),
    'schedule_free_cbp_robust': (
        'cbp.recommended (cbp_robust\'s preconditioner, M3 without momentum '
        'and each coordinate clipped to 3, inside optax.contrib.schedule_free) '
        'on the centered model, a model with BatchNorm left plain'),
}


def _steps(results: Mapping[str, Any]
           ) -> tuple[dict[str, float], dict[str, list[float]]]:
  """Every arm's single-target steps score and its interval (the view
  version 1 of the rule read): as stored by ``report.rescore``, else
  computed."""
  stored = (results.get('profiles') or {}).get('steps') or {}
  if stored.get('score') and stored.get('score_interval'):
    return stored['score'], stored['score_interval']
  return (decision.steps_scores(results),
          statistics.score_intervals(results))


def _anytime(results: Mapping[str, Any]
             ) -> tuple[dict[str, float], dict[str, list[float]]]:
  """Every arm's any-time score (steps) and its interval: as stored by
  ``report.rescore``, else computed (the results' workloads must hold their
  ladders)."""
  stored = (results.get('profiles') or {}).get('anytime') or {}
  if stored.get('score') and stored.get('score_interval'):
    return stored['score'], stored['score_interval']
  found = statistics.anytime_scores(results)
  return ({a: f['score'] for a, f in found.items()},
          {a: f['interval'] for a, f in found.items()})


def _score(results: Mapping[str, Any], arm: str) -> tuple[float, list[float]]:
  scores, intervals = _anytime(results)
  return scores[arm], intervals[arm]


def _seed_count(results: Mapping[str, Any], arm: str) -> int:
  return min(len(entry['arms'][arm]['curves'])
             for entry in results['workloads'].values())


def _decision(dev: Mapping[str, Any]) -> Mapping[str, Any]:
  """The rule's choice on ``dev`` (``arm``, ``undominated``): as
  ``report.rescore`` stored it under the rule in force, else
  ``decision.recommend`` applied once."""
  stored = dev.get('recommendation')
  if stored and stored.get('rule') == decision.VERSION:
    return stored
  found = decision.recommend(dev)
  return {'arm': found.arm, 'undominated': found.undominated}


def _comparisons(results: Mapping[str, Any]) -> list[dict[str, Any]]:
  """The any-time comparisons: stored by ``report.rescore``, else
  computed."""
  return list(results.get('anytime_comparisons')
              or statistics.compare_anytime(results))


def _pooled(results: Mapping[str, Any], arm: str) -> list[dict[str, Any]]:
  """The pooled any-time comparisons of ``arm`` with every other arm, each
  oriented with ``arm`` as A: the stored family's where it holds them all,
  else ``arm`` tested against every other arm."""
  arms = sorted({a for entry in results['workloads'].values()
                 for a in entry['arms']})
  found = {}
  for c in _comparisons(results):
    if c['workload'] != 'pooled' or arm not in (c['a'], c['b']):
      continue
    found[c['b'] if c['a'] == arm else c['a']] = c
  if set(found) != set(arms) - {arm}:
    return [c for c in statistics.compare_anytime(
        results, statistics.anytime_pairs(arms, recipe=arm))
            if c['workload'] == 'pooled' and c['a'] == arm]
  out = []
  for other, c in sorted(found.items()):
    if c['a'] != arm:  # flip to arm's side
      flip = {statistics.BETTER: statistics.WORSE,
              statistics.WORSE: statistics.BETTER}
      low, high = c['interval']
      c = {**c, 'a': arm, 'b': other, 'difference': -c['difference'],
           'interval': [-high, -low], 'direction': -c['direction'],
           'verdict': flip.get(c['verdict'], c['verdict'])}
    out.append(c)
  return out


def _listed(names: list[str]) -> str:
  return (', '.join(names[:-1]) + ' and ' + names[-1] if len(names) > 1
          else names[0])


def answer(dev: Mapping[str, Any], test: Mapping[str, Any]) -> str:
  """The recommendation in the words every page gives it: the dev rule's
  choice (``decision.recommend``, the rule in force), its dev and test
  any-time scores with their 95% bootstrap intervals, and the arms the
  paired tests on test found better or worse (or that none were).

  Args:
    dev: the dev split's results.json.
    test: the test split's (it only reports).

  Returns:
    One paragraph of plain text (names without markup).
  """
  if (test.get('meta') or {}).get('split') != 'test':
    raise ValueError('the second results must be the test split\'s')
  chosen = _decision(dev)['arm']
  text = (f'Use {RECIPES[chosen]}. Version {decision.VERSION} of the '
          'decision rule, written before it read any any-time score, '
          f'chooses it on the dev split: any-time score '
          f'{decision.fmt(_score(dev, chosen))} (95% interval, '
          f'{_seed_count(dev, chosen)} paired seeds). On the test split, '
          f'which only reports, it scores {decision.fmt(_score(test, chosen))}')
  pooled = _pooled(test, chosen)
  def named(verdict):
    found = sorted((c for c in pooled if c['verdict'] == verdict),
                   key=lambda c: (-_score(test, c['b'])[0], c['b']))
    return [f'{_label(c["b"])} ({decision.fmt(_score(test, c["b"]))}, '
            f'mean paired difference {c["difference"]:+.3f})' for c in found]
  better, worse = named(statistics.WORSE), named(statistics.BETTER)
  if not better and not worse:
    return text + '; there, paired over seeds and workloads, no arm is ' \
        'significantly better or worse than it.'
  parts = []
  if better:
    parts.append(f'significantly worse than {_listed(better)}')
  if worse:
    parts.append(f'significantly better than {_listed(worse)}')
  return (text + '; there, paired over seeds and workloads, it is '
          + ' and '.join(parts) + ', and no different from the rest.')


def _label(arm: str) -> str:
  """An arm in words: a peer's label, ``centered`` after it, or the name."""
  peer = arm.removesuffix(statistics.CENTERED_SUFFIX)
  if arm == 'muon_centered_batchnorm_plain':
    return 'Muon centered (BatchNorm models plain)'
  if arm == 'sgd_nesterov':
    return 'SGD with Nesterov momentum'
  if arm in CENTERED_ONLY_LABELS:
    return CENTERED_ONLY_LABELS[arm].replace('`', '')
  if peer in PEER_LABELS:
    return PEER_LABELS[peer].replace('`', '') + (
        ' centered' if peer != arm else '')
  return arm


def centering_sentence(results: Mapping[str, Any]) -> str:
  """Centered against plain for each peer, in words: the pooled paired
  any-time verdicts (Holm-corrected) and the per-workload counts."""
  verdicts = centering_verdicts(results)
  split = (results.get('meta') or {}).get('split') or 'this run'
  if not verdicts:
    return f'On {split}, no peer ran both plain and centered.'
  by_verdict: dict[str, list[str]] = {}
  for peer, label in PEER_LABELS.items():
    if peer in verdicts:
      by_verdict.setdefault(verdicts[peer]['verdict'], []).append(label)
  def names(verdict):
    found = by_verdict.get(verdict)
    return ' and '.join(found) if found else 'none'
  pairs = {verdicts[p]['n'] for p in verdicts}
  counts = [verdicts[p]['counts'] for p in PEER_LABELS if p in verdicts]
  per = [sum(c[v] for c in counts) for v in (
      statistics.BETTER, statistics.NO_DIFFERENCE, statistics.WORSE)]
  return (f'On {split}, pooled over the {max(pairs)} (workload, seed) pairs '
          f'of the any-time score, centering is significantly better than '
          f'plain for {names(statistics.BETTER)}, shows no detectable '
          f'difference for {names(statistics.NO_DIFFERENCE)}, and is '
          f'significantly worse for {names(statistics.WORSE)}; per workload, '
          f'of the {sum(per)} (peer, workload) pairs, {per[0]} are '
          f'significantly better, {per[1]} show no detectable difference and '
          f'{per[2]} are significantly worse.')


def dev_ties(dev: Mapping[str, Any]) -> str:
  """The candidates the decision rule could not separate from its choice on
  the dev split, which the tie-break decided (empty when there were none).

  Args:
    dev: the dev split's results.json (its stored ``recommendation`` under
      the rule in force, else ``decision.recommend``).

  Returns:
    One sentence of plain text, or ''.
  """
  stored = _decision(dev)
  others = [a for a in stored['undominated'] if a != stored['arm']]
  if not others:
    return ''
  return ('On the dev split no candidate beat it by the rule\'s margin; nor '
          'did any beat these, which the tie-break (the cheaper step, then '
          'fewer hyperparameters) put after it: ' + '; '.join(
              f'{RECIPES[a]}, {decision.fmt(_score(dev, a))}'
              for a in others) + '.')


def centering_verdicts(results: Mapping[str, Any]
                       ) -> dict[str, dict[str, Any]]:
  """``<peer>_centered`` against ``<peer>``, for each peer with both, on the
  any-time score.

  Returns:
    peer -> ``verdict`` (pooled over workloads and seeds, Holm-corrected),
    ``difference`` and ``interval`` (the pooled mean paired difference of
    any-time values, centered minus plain, and its 95% bootstrap interval),
    ``n`` (pairs) and ``counts``: how many workloads gave each per-workload
    verdict.
  """
  out: dict[str, dict[str, Any]] = {}
  for c in _comparisons(results):
    a, b = c['a'], c['b']
    if a != b + statistics.CENTERED_SUFFIX:
      continue
    entry = out.setdefault(b, {'counts': {statistics.BETTER: 0,
                                          statistics.NO_DIFFERENCE: 0,
                                          statistics.WORSE: 0}})
    if c['workload'] == 'pooled':
      entry.update(verdict=c['verdict'], difference=c['difference'],
                   interval=list(c['interval']), n=c['n'])
    else:
      entry['counts'][c['verdict']] += 1
  return out


# The README's labels: peers (plain and centered columns), then the arms
# that exist only on the centered model, in this order, each with the arm
# its paired row compares it against (``statistics.anytime_pairs``).
PEER_LABELS: dict[str, str] = {
    'adamw': 'AdamW', 'nadamw': 'NAdamW',
    'schedule_free_adamw': 'schedule-free AdamW', 'muon': 'Muon',
    'cbp_kron': '`cbp.cbp_kron`', 'psgd_kron': 'PSGD Kron'}
CENTERED_ONLY_LABELS: dict[str, str] = {
    'cbp': '`cbp.cbp`',
    'cbp_robust': '`cbp.cbp_robust`',
    'schedule_free_cbp_robust': '`cbp.recommended`'}
AGAINST: dict[str, str] = {
    'cbp': 'adamw', 'cbp_robust': 'adamw_centered',
    'schedule_free_cbp_robust': 'adamw'}


def _verdict_cell(c: Optional[Mapping[str, Any]]) -> str:
  if c is None:
    return ''
  low, high = c['interval']
  return f'{c["verdict"]}, {c["difference"]:+.3f} [{low:+.3f}, {high:+.3f}]'


def results_table(dev: Mapping[str, Any], test: Mapping[str, Any]) -> str:
  """The README's table: for each peer its any-time score [95% interval]
  plain and centered and the pooled paired verdict of centered against
  plain (mean difference [interval]), on dev and on test; then the CBP
  arms, each against the arm its paired family compares it with."""
  columns = []
  for results in (dev, test):
    scores, intervals = _anytime(results)
    pooled = {(c['a'], c['b']): c for c in _comparisons(results)
              if c['workload'] == 'pooled'}
    columns.append((scores, intervals, pooled))

  def cell(arm, scores, intervals):
    return (decision.fmt((scores[arm], intervals[arm])) if arm in scores
            else '')

  lines = ['| optimizer | dev: plain | dev: centered | dev: centered vs '
           'plain | test: plain | test: centered | test: centered vs plain |',
           '|---|---|---|---|---|---|---|']
  for peer, label in PEER_LABELS.items():
    if not any(peer in scores for scores, _, _ in columns):
      continue
    row = [label]
    for scores, intervals, pooled in columns:
      row += [cell(peer, scores, intervals),
              cell(peer + statistics.CENTERED_SUFFIX, scores, intervals),
              _verdict_cell(pooled.get(
                  (peer + statistics.CENTERED_SUFFIX, peer)))]
    lines.append('| ' + ' | '.join(row) + ' |')
  for arm, label in CENTERED_ONLY_LABELS.items():
    if not any(arm in scores for scores, _, _ in columns):
      continue
    against = AGAINST[arm]
    row = [label]
    for scores, intervals, pooled in columns:
      c = pooled.get((arm, against))
      row += ['', cell(arm, scores, intervals),
              (f'vs {_label(against)}: ' + _verdict_cell(c)) if c else '']
    lines.append('| ' + ' | '.join(row) + ' |')
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
