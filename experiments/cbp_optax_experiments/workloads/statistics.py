"""Seed statistics of a workloads run: intervals, paired tests, stability.

Everything here reads a ``results.json`` (``report``'s shape) and is pure
NumPy/SciPy; every resampling draws from ``np.random.default_rng(SEED)``, so
the same results give the same intervals.

Censoring. A seed that missed the target (or diverged) has no steps to
target: it counts as infinite, as in the score (``scoring.arm_time``). A
median is then infinite when at least half the seeds missed (for an even
count: when the upper middle value is a miss, ``np.median``'s mean of the
two middle values), and a bootstrap bound is infinite when that share of
resamples had an infinite median: an interval ``[low, inf]`` reads "reached
within ``low`` steps, or not at all". Bounds are order statistics of the
resampled medians (``method='lower'`` for the low one, ``'higher'`` for the
high one), never interpolated, so an infinite one is never NaN.

The final metric of a diverged or non-finite seed counts as the initial
metric (no progress), as in ``scoring.final_value``.

Paired comparisons. Seeds are paired across arms: a seed fixes the
initialization, the minibatches and the dropout masks (``protocol.seed_keys``),
so arm A and arm B on seed s differ only by the optimizer. The paired
difference on (workload, seed) is ``log2(steps_B / steps_A)`` (positive: A
reached the target faster; 1.0: twice as fast), with a missed or diverged
seed counted as ``CENSORED_FACTOR`` times the budget, beyond every value a
reached seed can have: a reach against a miss is a large positive or negative
difference, two misses are a tie (0). Logarithms make workloads of different
budgets comparable, so the pooled comparison takes every (workload, seed) pair
of the workloads both arms ran. For each comparison:

* the median paired difference and its 95% paired-bootstrap interval (the
  pairs resampled, within each workload for the pooled one);
* the Wilcoxon signed-rank p-value, two-sided (``scipy.stats.wilcoxon``,
  ``zero_method='zsplit'``: a zero difference -- both missed, or both reached
  at the same evaluation -- counts half for each side, so ties pull towards no
  difference instead of being dropped; ``method='auto'``, the normal
  approximation with tie correction once there are ties or zeros). All-zero
  differences give p = 1;
* Holm's step-down correction over a family: the pooled comparisons are one
  family (the decisions, ``decision.py``), the per-workload ones another;
* a verdict at ``ALPHA``: ``BETTER`` / ``WORSE`` when the Holm-corrected p is
  below ``ALPHA``, in the direction of the signed-rank sum (which side holds
  the larger ranks), else ``NO_DIFFERENCE``.

The family of comparisons (``comparison_pairs``): every ``<peer>_centered``
against ``<peer>``, and the recommended recipe (``RECIPE``) against every
other arm.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import scipy.stats

from cbp_optax_experiments.workloads import scoring

SEED = 0
RESAMPLES = 2000
ALPHA = 0.05
LEVEL = 0.95
CENSORED_FACTOR = 2.0
RECIPE = 'schedule_free_cbp_robust'
CENTERED_SUFFIX = '_centered'
BETTER = 'significantly better'
WORSE = 'significantly worse'
NO_DIFFERENCE = 'no detectable difference'


def _rng(seed: int = SEED) -> np.random.Generator:
  return np.random.default_rng(seed)


def _bounds(samples: np.ndarray, level: float = LEVEL
            ) -> tuple[float, float]:
  """The percentile interval of ``samples`` (order statistics, no
  interpolation: infinite samples give infinite bounds, not NaN)."""
  tail = (1.0 - level) / 2.0
  low = np.quantile(samples, tail, method='lower')
  high = np.quantile(samples, 1.0 - tail, method='higher')
  return float(low), float(high)


def steps_values(steps: Sequence[Optional[int]]) -> np.ndarray:
  """Steps to target per seed, a miss (None) as infinity."""
  return np.asarray([math.inf if s is None else float(s) for s in steps],
                    np.float64)


def median_interval(values: Sequence[float], resamples: int = RESAMPLES,
                    seed: int = SEED, level: float = LEVEL
                    ) -> tuple[float, float, float]:
  """``(median, low, high)``: the median of ``values`` and its percentile
  bootstrap interval (``resamples`` resamples of the seeds with
  replacement). Infinite values (censored) are kept as such."""
  values = np.asarray(values, np.float64)
  if values.size == 0:
    raise ValueError('median_interval needs at least one value')
  index = _rng(seed).integers(0, values.size, (resamples, values.size))
  medians = np.median(values[index], axis=1)
  low, high = _bounds(medians, level)
  return float(np.median(values)), low, high


def final_values(arm: Mapping[str, Any], initial: float) -> np.ndarray:
  """The arm's final metric per seed; a diverged or non-finite seed as
  ``initial`` (no progress, ``scoring.final_value``)."""
  return np.asarray([initial if bad or v is None or not math.isfinite(v)
                     else v for v, bad in zip(arm['final_metric'],
                                              arm['diverged'])], np.float64)


def initial_metric(entry: Mapping[str, Any]) -> float:
  values = [v for arm in entry['arms'].values()
            for v in arm.get('initial_metric', []) if v is not None]
  return float(np.median(values)) if values else math.nan


def _interval(median: float, low: float, high: float) -> dict[str, Any]:
  fix = lambda v: v if math.isfinite(v) else None  # JSON: null = infinite
  return {'median': fix(median), 'interval': [fix(low), fix(high)]}


def arm_intervals(entry: Mapping[str, Any], resamples: int = RESAMPLES,
                  seed: int = SEED) -> dict[str, dict[str, Any]]:
  """Per arm of one workload: ``steps_to_target`` and ``final_metric``, each
  ``{'median', 'interval': [low, high]}`` (null: infinite, a censored
  median or bound)."""
  initial = initial_metric(entry)
  out = {}
  for name, arm in entry['arms'].items():
    steps = median_interval(steps_values(arm['steps_to_target']), resamples,
                            seed)
    finals = final_values(arm, initial)
    if np.all(np.isnan(finals)):
      final = {'median': None, 'interval': [None, None]}
    else:
      final = _interval(*median_interval(finals, resamples, seed))
    out[name] = {'steps_to_target': _interval(*steps), 'final_metric': final}
  return out


# ---------------------------------------------------------------------------
# The performance profile's score, resampled


def _seeds(arm: Mapping[str, Any]) -> list[int]:
  """The arm's evaluation seeds (their positions where none are stored)."""
  seeds = arm.get('seeds')
  return list(seeds) if seeds else list(range(len(arm['steps_to_target'])))


def _budget(entry: Mapping[str, Any]) -> float:
  """The workload's budget; where none is stored, the most steps any seed
  took (a miss then counts as twice that)."""
  if entry.get('budget_steps'):
    return float(entry['budget_steps'])
  steps = [s for arm in entry['arms'].values()
           for s in arm['steps_to_target'] if s is not None]
  return float(max(steps, default=1))


def _seed_index(entry: Mapping[str, Any], rng: np.random.Generator,
                resamples: int) -> dict[str, np.ndarray]:
  """Per arm, ``(resamples, n_seeds)`` indices into its seeds: one draw
  shared by the arms that ran the same seeds (paired), its own draw for an
  arm on other seeds."""
  draws: dict[tuple[int, ...], np.ndarray] = {}
  out = {}
  for name, arm in entry['arms'].items():
    seeds = tuple(_seeds(arm))
    if seeds not in draws:
      draws[seeds] = rng.integers(0, len(seeds), (resamples, len(seeds)))
    out[name] = draws[seeds]
  return out


def _profile_scores(times: Mapping[str, Mapping[str, np.ndarray]],
                    arms: Sequence[str], r_max: float) -> dict[str, np.ndarray]:
  """``times[workload][arm]``: arrays of B times -> per arm, B scores
  (``scoring.profile_score`` of ``scoring.ratios``, vectorized; an arm that
  did not run a workload is absent from it, as in ``scoring.ratios``)."""
  sums = {arm: 0.0 for arm in arms}
  counts = {arm: 0 for arm in arms}
  for per_arm in times.values():
    stacked = np.stack(list(per_arm.values()))  # (arms, B)
    finite = np.where(np.isfinite(stacked), stacked, np.inf)
    best = finite.min(axis=0)
    for arm, t in per_arm.items():
      with np.errstate(invalid='ignore', divide='ignore'):
        ratio = np.where(np.isfinite(t) & (best > 0), t / best,
                         np.where((t == 0) & (best == 0), 1.0, np.inf))
      sums[arm] = sums[arm] + np.where(ratio <= r_max,
                                       (r_max - ratio) / (r_max - 1.0), 0.0)
      counts[arm] += 1
  return {arm: np.asarray(sums[arm], np.float64) / counts[arm]
          for arm in arms if counts[arm]}


def score_intervals(results: Mapping[str, Any], wall_clock: bool = False,
                    resamples: int = RESAMPLES, seed: int = SEED,
                    r_max: float = scoring.R_MAX, level: float = LEVEL
                    ) -> dict[str, list[float]]:
  """Per arm, the 95% percentile-bootstrap interval ``[low, high]`` of its
  performance-profile score (``scoring.scores``).

  Each resample draws the seeds of every workload with replacement (the same
  draw for the arms that ran the same seeds: they are paired), recomputes
  every arm's time on every workload (median steps to target, a miss
  infinite, times the step cost for the wall-clock profile; the cost is a
  measurement, not resampled) and the whole profile: the best arm, the
  ratios and the scores.
  """
  rng = _rng(seed)
  times: dict[str, dict[str, np.ndarray]] = {}
  arms: list[str] = []
  for name, entry in results['workloads'].items():
    if not entry['arms']:
      continue
    index = _seed_index(entry, rng, resamples)
    times[name] = {}
    for arm_name, arm in entry['arms'].items():
      if arm_name not in arms:
        arms.append(arm_name)
      steps = steps_values(arm['steps_to_target'])
      cost = arm['cost_vs_adamw'] if wall_clock else 1.0
      medians = np.median(steps[index[arm_name]], axis=1)
      times[name][arm_name] = np.where(np.isfinite(medians), medians * cost,
                                       np.inf)
  scores = _profile_scores(times, arms, r_max)
  return {arm: list(_bounds(values, level)) for arm, values in scores.items()}


# ---------------------------------------------------------------------------
# Paired comparisons


def log_ratios(steps_a: Sequence[Optional[int]],
               steps_b: Sequence[Optional[int]], budget: int) -> np.ndarray:
  """``log2(steps_b / steps_a)`` per seed, a miss (None) counted as
  ``CENSORED_FACTOR * budget``: positive where A was faster."""
  censored = CENSORED_FACTOR * budget
  a = np.asarray([censored if s is None else s for s in steps_a], np.float64)
  b = np.asarray([censored if s is None else s for s in steps_b], np.float64)
  return np.log2(b / a)


def paired_steps(entry: Mapping[str, Any], a: str, b: str
                 ) -> Optional[np.ndarray]:
  """The (seed-matched) log-ratios of ``a`` vs ``b`` on one workload; None
  when either did not run it or they share no seed. A diverged seed is a
  miss (its steps to target are None)."""
  arms = entry['arms']
  if a not in arms or b not in arms:
    return None
  steps_b = dict(zip(_seeds(arms[b]), arms[b]['steps_to_target']))
  shared = [(s, t) for s, t in zip(_seeds(arms[a]),
                                   arms[a]['steps_to_target'])
            if s in steps_b]
  if not shared:
    return None
  return log_ratios([t for _, t in shared], [steps_b[s] for s, _ in shared],
                    _budget(entry))


def wilcoxon_p(differences: np.ndarray) -> float:
  """Two-sided Wilcoxon signed-rank p-value (``zero_method='zsplit'``); 1.0
  when every difference is zero."""
  d = np.asarray(differences, np.float64)
  if d.size == 0 or np.all(d == 0):
    return 1.0
  return float(scipy.stats.wilcoxon(d, zero_method='zsplit',
                                    alternative='two-sided').pvalue)


def signed_rank_direction(differences: np.ndarray) -> int:
  """+1 when the positive differences hold the larger rank sum, -1 when the
  negative ones do, 0 on a tie (zeros split, as in ``wilcoxon_p``)."""
  d = np.asarray(differences, np.float64)
  if d.size == 0:
    return 0
  ranks = scipy.stats.rankdata(np.abs(d))
  total = float(np.sum(ranks[d > 0]) - np.sum(ranks[d < 0]))
  return int(np.sign(total))


def paired_interval(groups: Sequence[np.ndarray], resamples: int = RESAMPLES,
                    seed: int = SEED, level: float = LEVEL
                    ) -> tuple[float, float, float]:
  """``(median, low, high)`` of the pooled paired differences: each
  resample draws the pairs of every group (workload) with replacement, within
  the group."""
  rng = _rng(seed)
  pooled = np.concatenate(groups)
  draws = [g[rng.integers(0, g.size, (resamples, g.size))] for g in groups]
  medians = np.median(np.concatenate(draws, axis=1), axis=1)
  low, high = _bounds(medians, level)
  return float(np.median(pooled)), low, high


def holm(p_values: Sequence[float]) -> list[float]:
  """Holm's step-down adjusted p-values (same order as given): the i-th
  smallest times ``(m - i)``, made monotone, capped at 1."""
  p = np.asarray(p_values, np.float64)
  m = p.size
  order = np.argsort(p, kind='stable')
  adjusted = np.empty(m)
  running = 0.0
  for rank, i in enumerate(order):
    running = max(running, min(1.0, (m - rank) * p[i]))
    adjusted[i] = running
  return adjusted.tolist()


def verdict(p_holm: float, direction: int, alpha: float = ALPHA) -> str:
  if p_holm < alpha and direction > 0:
    return BETTER
  if p_holm < alpha and direction < 0:
    return WORSE
  return NO_DIFFERENCE


def comparison_pairs(arms: Sequence[str], recipe: str = RECIPE
                     ) -> list[tuple[str, str]]:
  """``(a, b)`` pairs, a tested against b: each ``<peer>_centered`` against
  ``<peer>`` (both present), then ``recipe`` against every other arm."""
  present = set(arms)
  pairs = [(name, name[:-len(CENTERED_SUFFIX)]) for name in arms
           if name.endswith(CENTERED_SUFFIX)
           and name[:-len(CENTERED_SUFFIX)] in present]
  if recipe in present:
    pairs += [(recipe, other) for other in arms if other != recipe
              and (recipe, other) not in pairs]
  return pairs


def _arm_names(results: Mapping[str, Any]) -> list[str]:
  names: list[str] = []
  for entry in results['workloads'].values():
    names += [a for a in entry['arms'] if a not in names]
  return names


def compare(results: Mapping[str, Any],
            pairs: Optional[Sequence[tuple[str, str]]] = None,
            resamples: int = RESAMPLES, seed: int = SEED,
            alpha: float = ALPHA) -> list[dict[str, Any]]:
  """The paired comparisons of steps to target (module docstring).

  Args:
    results: a results.json.
    pairs: ``(a, b)`` arm pairs; default ``comparison_pairs``.
    resamples, seed, alpha: the bootstrap and the test level.

  Returns:
    One record per (pair, workload) and per pair pooled (``workload``:
    ``'pooled'``): ``a``, ``b``, ``workload``, ``n`` (pairs), ``median``
    (median log2 ratio; positive: a faster), ``interval`` ([low, high]),
    ``speedup`` (``2 ** median``), ``p`` (Wilcoxon), ``p_holm`` and
    ``verdict`` (a vs b). Holm's families: the pooled records, and the
    per-workload records.
  """
  if pairs is None:
    pairs = comparison_pairs(_arm_names(results))
  return _paired_tests(results, pairs, paired_steps, _record, False,
                       resamples, seed, alpha)


def _paired_tests(results: Mapping[str, Any],
                  pairs: Sequence[tuple[str, str]],
                  paired: Callable[..., Optional[np.ndarray]],
                  record: Callable[..., dict[str, Any]], per_pair: bool,
                  resamples: int, seed: int, alpha: float
                  ) -> list[dict[str, Any]]:
  """``record`` of ``paired`` differences per (pair, workload) and per pair
  pooled, Holm-corrected over the pooled records and over the per-workload
  records (all of them, or each pair's when ``per_pair``)."""
  per_workload, pooled = [], []
  for a, b in pairs:
    groups = []
    for name, entry in results['workloads'].items():
      d = paired(entry, a, b)
      if d is None:
        continue
      groups.append(d)
      per_workload.append(record(a, b, name, [d], resamples, seed))
    if groups:
      pooled.append(record(a, b, 'pooled', groups, resamples, seed))
  families = [pooled] + (
      [[r for r in per_workload if (r['a'], r['b']) == pair]
       for pair in pairs] if per_pair else [per_workload])
  for family in families:
    for r, adjusted in zip(family, holm([r['p'] for r in family])):
      r['p_holm'] = adjusted
      r['verdict'] = verdict(adjusted, r['direction'], alpha)
  return pooled + per_workload


def _record(a: str, b: str, workload: str, groups: Sequence[np.ndarray],
            resamples: int, seed: int) -> dict[str, Any]:
  d = np.concatenate(groups)
  median, low, high = paired_interval(groups, resamples, seed)
  return {'a': a, 'b': b, 'workload': workload, 'n': int(d.size),
          'median': median, 'interval': [low, high],
          'speedup': float(2.0 ** median), 'p': wilcoxon_p(d),
          'direction': signed_rank_direction(d)}


def pooled_verdicts(comparisons: Sequence[Mapping[str, Any]]
                    ) -> dict[tuple[str, str], str]:
  return {(c['a'], c['b']): c['verdict'] for c in comparisons
          if c['workload'] == 'pooled'}


# ---------------------------------------------------------------------------
# Stability across float32 roundings


def _overlap(x: Sequence[Optional[float]], y: Sequence[Optional[float]]
             ) -> bool:
  """Whether two intervals (null: infinite) share a point."""
  inf = lambda v: math.inf if v is None else v
  return max(inf(x[0]), inf(y[0])) <= min(inf(x[1]), inf(y[1]))


def stability(first: Mapping[str, Any], second: Mapping[str, Any]
              ) -> dict[str, Any]:
  """Two results.json of the same split run at two float32 roundings (the
  same code and seeds, a different order of summation): whether the
  seed-level conclusions survive it.

  Returns:
    ``intervals_overlap``: every arm's score intervals (both profiles, as
    stored by ``report.rescore`` or recomputed) overlap between the runs,
    and so do the per-(workload, arm) steps-to-target intervals;
    ``disjoint``: the ones that do not; ``arms``: for each arm in both
    runs, the lines of ``disjoint`` that are its own (none: its intervals
    overlap); ``flips``: the pooled comparisons significantly better in one
    run and significantly worse in the other; ``changed``: pooled verdicts
    that differ in any way; ``stable``: overlap everywhere and no flip.
  """
  disjoint: list[str] = []
  per_arm: dict[str, list[str]] = {}

  def check(arm: str, x, y, line: str) -> None:
    per_arm.setdefault(arm, [])
    if not _overlap(x, y):
      disjoint.append(line)
      per_arm[arm].append(line)

  for profile, wall in (('steps', False), ('wall_clock', True)):
    a, b = (_stored_intervals(r, profile, wall) for r in (first, second))
    for arm in sorted(set(a) & set(b)):
      check(arm, a[arm], b[arm],
            f'score ({profile}) of {arm}: {a[arm]} vs {b[arm]}')
  for name in sorted(set(first['workloads']) & set(second['workloads'])):
    a, b = (arm_intervals(r['workloads'][name]) for r in (first, second))
    for arm in sorted(set(a) & set(b)):
      x = a[arm]['steps_to_target']['interval']
      y = b[arm]['steps_to_target']['interval']
      check(arm, x, y, f'steps to target of {arm} on {name}: {x} vs {y}')
  va, vb = (pooled_verdicts(r.get('comparisons') or compare(r))
            for r in (first, second))
  flips, changed = [], []
  for pair in sorted(set(va) & set(vb)):
    if va[pair] != vb[pair]:
      changed.append(f'{pair[0]} vs {pair[1]}: {va[pair]} -> {vb[pair]}')
    if {va[pair], vb[pair]} == {BETTER, WORSE}:
      flips.append(f'{pair[0]} vs {pair[1]}: {va[pair]} -> {vb[pair]}')
  return {'intervals_overlap': not disjoint, 'disjoint': disjoint,
          'arms': dict(sorted(per_arm.items())),
          'flips': flips, 'changed': changed,
          'stable': not disjoint and not flips}


def _stored_intervals(results: Mapping[str, Any], profile: str,
                      wall: bool) -> dict[str, list[Optional[float]]]:
  stored = (results.get('profiles') or {}).get(profile, {}).get(
      'score_interval')
  return stored if stored is not None else score_intervals(results, wall)


# ---------------------------------------------------------------------------
# The any-time score (``scoring``'s ladder of targets): per-seed values,
# intervals and paired comparisons
#
# A run's any-time value (``scoring.anytime_value``) is already a mean over
# the workload's targets, so every (workload, seed) gives one number per arm
# and two arms pair on it directly: the paired difference is A's value minus
# B's (positive: A reached the ladder's targets earlier, or more of them).
# The effect reported is the mean difference, pooled with every workload
# weighted equally, which is exactly the difference of the two arms' scores;
# its interval resamples the seeds within each workload. The test is the
# Wilcoxon signed-rank test on the differences, as for steps to target
# (zeros split), Holm-corrected within the pooled family (every pair), and
# per workload within each pair's own workloads: with ten seeds the smallest
# two-sided p-value is 2/1024, so one family of every (pair, workload) test
# (17 pairs x 9 workloads) could never reject, whatever the runs showed.

M3_PAIR = ('cbp_robust', 'adamw_centered')   # M3's own contribution
ALGORITHM_1_PAIR = ('cbp', 'adamw')          # Algorithm 1 against AdamW
# The Kronecker-factored M3 on the centered model against the diagonal M3
# it replaces and the matrix methods a user would pick instead (paper §8.2).
KRON_PAIRS = (('cbp_kron_centered', 'cbp_robust'),
              ('cbp_kron_centered', 'muon_centered'),
              ('cbp_kron_centered', 'psgd_kron_centered'),
              ('cbp_kron_centered', 'psgd_kron'))


def ladder_targets(entry: Mapping[str, Any]) -> list[float]:
  """The workload's ladder of targets as ``report.rescore`` stored it."""
  return list((entry.get('ladder') or {}).get('targets') or [])


def anytime_values(entry: Mapping[str, Any], arm: str,
                   wall_clock: bool = False) -> np.ndarray:
  """The arm's any-time value per evaluation seed on one workload (the
  stored ladder; in wall-clock, charged its step cost)."""
  record = entry['arms'][arm]
  targets = ladder_targets(entry)
  cost = float(record.get('cost_vs_adamw') or 1.0) if wall_clock else 1.0
  higher = entry['higher_is_better']
  return np.asarray([scoring.anytime_value(curve, targets, higher, bad, cost)
                     for curve, bad in zip(record.get('curves') or [],
                                           record['diverged'])], np.float64)


def anytime_scores(results: Mapping[str, Any], wall_clock: bool = False,
                   resamples: int = RESAMPLES, seed: int = SEED,
                   level: float = LEVEL) -> dict[str, dict[str, Any]]:
  """Per arm, its any-time score and 95% bootstrap interval.

  The score is the mean over the workloads the arm ran of its mean value
  over seeds (``anytime_values``). Each resample draws the seeds of every
  workload with replacement, one draw shared by the arms that ran the same
  seeds (paired), and recomputes every arm's score.

  Returns:
    arm -> ``{'score', 'interval': [low, high], 'workloads'}``.
  """
  rng = _rng(seed)
  sums: dict[str, Any] = {}
  means: dict[str, float] = {}
  counts: dict[str, int] = {}
  for entry in results['workloads'].values():
    if not entry['arms'] or not ladder_targets(entry):
      continue
    index = _seed_index(entry, rng, resamples)
    for arm in entry['arms']:
      values = anytime_values(entry, arm, wall_clock)
      if values.size == 0:
        continue
      sums[arm] = sums.get(arm, 0.0) + values[index[arm]].mean(axis=1)
      means[arm] = means.get(arm, 0.0) + float(values.mean())
      counts[arm] = counts.get(arm, 0) + 1
  out = {}
  for arm, total in sums.items():
    low, high = _bounds(np.asarray(total) / counts[arm], level)
    out[arm] = {'score': means[arm] / counts[arm], 'interval': [low, high],
                'workloads': counts[arm]}
  return out


def anytime_cell(entry: Mapping[str, Any], arm: str,
                 resamples: int = RESAMPLES, seed: int = SEED,
                 level: float = LEVEL) -> dict[str, Any]:
  """One (workload, arm): the mean any-time value over seeds and its
  bootstrap interval, in steps."""
  values = anytime_values(entry, arm)
  index = _rng(seed).integers(0, values.size, (resamples, values.size))
  low, high = _bounds(values[index].mean(axis=1), level)
  return {'mean': float(values.mean()), 'interval': [low, high]}


def anytime_pairs(arms: Sequence[str], recipe: str = RECIPE
                  ) -> list[tuple[str, str]]:
  """The any-time family, A tested against B: every ``<peer>_centered``
  against ``<peer>``; M3's own contribution (``cbp_robust`` against
  ``adamw_centered``); Algorithm 1 (``cbp``) against AdamW; the
  Kronecker-factored M3 (``KRON_PAIRS``); ``recipe`` against every other
  arm. Pairs whose arms did not both run are left out."""
  present = set(arms)
  pairs = [(name, name[:-len(CENTERED_SUFFIX)]) for name in arms
           if name.endswith(CENTERED_SUFFIX)
           and name[:-len(CENTERED_SUFFIX)] in present]
  for pair in (M3_PAIR, ALGORITHM_1_PAIR, *KRON_PAIRS):
    if set(pair) <= present:
      pairs.append(pair)
  if recipe in present:
    pairs += [(recipe, other) for other in arms if other != recipe
              and (recipe, other) not in pairs
              and (other, recipe) not in pairs]
  return pairs


def paired_anytime(entry: Mapping[str, Any], a: str, b: str
                   ) -> Optional[np.ndarray]:
  """A's any-time value minus B's on each seed both ran (one workload);
  None when either did not run it or they share no seed."""
  arms = entry['arms']
  if a not in arms or b not in arms or not ladder_targets(entry):
    return None
  values_b = dict(zip(_seeds(arms[b]), anytime_values(entry, b)))
  shared = [(s, v) for s, v in zip(_seeds(arms[a]), anytime_values(entry, a))
            if s in values_b]
  if not shared:
    return None
  return np.asarray([v - values_b[s] for s, v in shared], np.float64)


def mean_interval(groups: Sequence[np.ndarray], resamples: int = RESAMPLES,
                  seed: int = SEED, level: float = LEVEL
                  ) -> tuple[float, float, float]:
  """``(mean, low, high)``: the mean over groups (workloads) of each group's
  mean, and its bootstrap interval (pairs resampled within each group)."""
  rng = _rng(seed)
  draws = [g[rng.integers(0, g.size, (resamples, g.size))].mean(axis=1)
           for g in groups]
  low, high = _bounds(np.mean(draws, axis=0), level)
  return float(np.mean([g.mean() for g in groups])), low, high


def compare_anytime(results: Mapping[str, Any],
                    pairs: Optional[Sequence[tuple[str, str]]] = None,
                    resamples: int = RESAMPLES, seed: int = SEED,
                    alpha: float = ALPHA) -> list[dict[str, Any]]:
  """The paired comparisons of the any-time value (section comment).

  Args:
    results: a results.json whose workloads hold their ``ladder``.
    pairs: ``(a, b)`` arm pairs; default ``anytime_pairs``.
    resamples, seed, alpha: the bootstrap and the test level.

  Returns:
    One record per (pair, workload) and per pair pooled (``workload``:
    ``'pooled'``): ``a``, ``b``, ``workload``, ``n`` (pairs), ``difference``
    (mean of A's value minus B's; pooled, workloads weighted equally),
    ``interval``, ``p`` (Wilcoxon), ``direction``, ``p_holm`` and
    ``verdict`` (A vs B). Holm's families: the pooled records, and each
    pair's per-workload records.
  """
  if pairs is None:
    pairs = anytime_pairs(_arm_names(results))
  return _paired_tests(results, pairs, paired_anytime, _anytime_record, True,
                       resamples, seed, alpha)


def _anytime_record(a: str, b: str, workload: str,
                    groups: Sequence[np.ndarray], resamples: int,
                    seed: int) -> dict[str, Any]:
  d = np.concatenate(groups)
  mean, low, high = mean_interval(groups, resamples, seed)
  return {'a': a, 'b': b, 'workload': workload, 'n': int(d.size),
          'difference': mean, 'interval': [low, high], 'p': wilcoxon_p(d),
          'direction': signed_rank_direction(d)}
