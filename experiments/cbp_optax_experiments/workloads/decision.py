"""The rules that pick the recommended recipe from a dev run, fixed before it.

Each version was written down before the runs it reads, so that the runs
cannot shape it. ``recommend(results)`` applies the rule in force (version 2)
to the dev split's results.json and returns the recommendation with its
reason; ``recommend_by_target`` is version 1, kept so that the choices made
with it can be reproduced. The test split only reports (``splits``), and
both refuse its results.

**Version 2** (in force) reads the any-time score (``scoring``: a ladder of
targets per workload, from the reference's runlengths to the best arm's
median quality, and per (workload, target, seed) the share of the budget
spent at or past the target). Version 1 read the steps to one near-ceiling
target, which most runs of most arms missed: two misses tie, so it could not
tell most arms apart. The structure is version 1's:

1. **What decides: the any-time score in steps** (device-independent, as in
   version 1: the wall-clock twin multiplies by step costs measured on this
   CPU, which misstate what a GPU user pays; it is reported, not used).
2. **What margin counts.** Candidate X beats candidate Y only if all three
   hold: (a) the pooled paired comparison of any-time values
   (``statistics.compare_anytime``: X's value minus Y's per (workload,
   seed), Wilcoxon signed-rank, Holm-corrected over every pair of
   candidates) says X is significantly better at ``statistics.ALPHA``; (b)
   the pooled mean paired difference (workloads weighted equally, so the
   difference of the two scores) is at least ``MIN_DIFFERENCE``; and (c)
   the lower end of X's 95% bootstrap interval of the any-time score is
   above Y's score. (b): the suite evaluates every 1/20 to 1/12 of the
   budget, so a run's value on one target moves in steps of 0.05 to 0.08;
   X must reach the ladder's targets, averaged over every target and seed,
   at least half of the finest evaluation interval earlier (or reach
   correspondingly more of them) to count. (a) and (c) as in version 1.
3. **Who is left:** the candidates no other candidate beats (each must have
   run every workload of the results on at least ``MIN_SEEDS`` seeds shared
   with the others; one that did not is left out, and said so).
4. **Tie-break among them:** the cheaper step (``cost_class``), then fewer
   hyperparameters, then the higher any-time score, then the name, as in
   version 1.

**Version 1** (``recommend_by_target``): the same four steps on the
performance profile of time to one target per workload (AlgoPerf's), the
margin (a) on the log2 ratio of steps to that target, (b) a pooled median
paired speedup of at least ``MIN_SPEEDUP``, (c) on the steps score's
interval.
"""

from __future__ import annotations

import itertools
from typing import Any, Mapping, NamedTuple, Optional, Sequence

from cbp_optax_experiments.workloads import scoring
from cbp_optax_experiments.workloads import statistics

MIN_SEEDS = 10
MIN_SPEEDUP = 1.1          # version 1
MIN_DIFFERENCE = 0.025     # version 2
VERSION = 2
ELEMENTWISE, MATRIX = 1, 2


class Candidate(NamedTuple):
  """A recipe the rule may pick.

  Attributes:
    arm: the arm's name in the results (``arms.builtin_arms``).
    cost_class: ``ELEMENTWISE`` or ``MATRIX`` (module docstring, 4).
    hyperparameters: the optimizer's own constants a user may set.
  """
  arm: str
  cost_class: int
  hyperparameters: tuple[str, ...]


_ADAM = ('learning_rate', 'b1', 'b2', 'eps', 'weight_decay')
_MUON = ('learning_rate', 'beta', 'ns_steps', 'consistent_rms',
         'weight_decay', 'adam_b1', 'adam_b2', 'adam_eps')

# cbp_robust and the recipe follow the BatchNorm rule (a model with
# BatchNorm trains plain, ``arms.Arm.centers``); the peers center every model.
CANDIDATES: tuple[Candidate, ...] = (
    Candidate('adamw_centered', ELEMENTWISE, _ADAM),
    Candidate('nadamw_centered', ELEMENTWISE, _ADAM),
    Candidate('schedule_free_adamw_centered', ELEMENTWISE,
              _ADAM + ('weight_lr_power',)),
    Candidate('cbp_robust', ELEMENTWISE,
              ('learning_rate', 'b1', 'b2', 'damping', 'zero_moment',
               'weight_decay')),
    Candidate('schedule_free_cbp_robust', ELEMENTWISE,
              ('learning_rate', 'b1', 'b2', 'damping', 'zero_moment',
               'weight_decay', 'weight_lr_power')),
    Candidate('muon_centered', MATRIX, _MUON),
    # Added before any run of it (the Kronecker-factored M3, §8.2): matrix
    # products and eigendecompositions, so the costlier class.
    Candidate('cbp_kron_centered', MATRIX,
              ('learning_rate', 'b1', 'b2', 'damping', 'zero_moment',
               'every', 'weight_decay')),
)


class Recommendation(NamedTuple):
  """What ``recommend`` found.

  Attributes:
    arm: the recommended candidate's arm.
    reason: the rule's steps, in words.
    undominated: the candidates no other beat, in tie-break order.
    beaten_by: candidate -> the candidates that beat it.
    left_out: candidate -> why it was not considered.
    scores: candidate -> (steps score, [low, high]).
  """
  arm: str
  reason: str
  undominated: tuple[str, ...]
  beaten_by: dict[str, tuple[str, ...]]
  left_out: dict[str, str]
  scores: dict[str, tuple[float, list[float]]]


def _eligible(results: Mapping[str, Any], candidates: Sequence[Candidate],
              min_seeds: int) -> tuple[list[Candidate], dict[str, str]]:
  left_out = {}
  eligible = []
  for candidate in candidates:
    missing = [w for w, entry in results['workloads'].items()
               if candidate.arm not in entry['arms']]
    if missing:
      left_out[candidate.arm] = f'did not run {", ".join(missing)}'
      continue
    few = [w for w, entry in results['workloads'].items()
           if len(entry['arms'][candidate.arm]['steps_to_target']) < min_seeds]
    if few:
      left_out[candidate.arm] = (f'fewer than {min_seeds} seeds on '
                                 f'{", ".join(few)}')
      continue
    eligible.append(candidate)
  return eligible, left_out


def steps_scores(results: Mapping[str, Any]) -> dict[str, float]:
  times = {name: {arm: scoring.arm_time(r['steps_to_target'], 1.0)
                  for arm, r in entry['arms'].items()}
           for name, entry in results['workloads'].items()}
  # The reference only names the speedup's denominator, not read here.
  return {arm: s['score'] for arm, s in scoring.scores(times, '').items()}


def _candidates(results: Mapping[str, Any], candidates: Sequence[Candidate],
                min_seeds: int, require_dev: bool
                ) -> tuple[list[Candidate], dict[str, str]]:
  """The eligible candidates and why the others were left out (step 3)."""
  if require_dev and (results.get('meta') or {}).get('split') != 'dev':
    raise ValueError('the rule chooses on the dev split only; these results '
                     'are of split '
                     f'{(results.get("meta") or {}).get("split")!r}')
  if not results['workloads']:
    raise ValueError('no workloads in the results')
  eligible, left_out = _eligible(results, candidates, min_seeds)
  if not eligible:
    raise ValueError('no candidate to choose from: ' + '; '.join(
        f'{arm} {why}' for arm, why in left_out.items()))
  return eligible, left_out


def _choose(eligible: Sequence[Candidate], left_out: dict[str, str],
            scores: dict[str, tuple[float, list[float]]],
            wins: Sequence[tuple[str, str]], measure: str,
            margin: str) -> Recommendation:
  """Steps 3 and 4: ``wins`` are the ``(winner, loser)`` pairs that met the
  margin (step 2)."""
  names = [c.arm for c in eligible]
  beaten_by: dict[str, list[str]] = {n: [] for n in names}
  for winner, loser in wins:
    beaten_by[loser].append(winner)
  by_name = {c.arm: c for c in eligible}
  undominated = sorted(
      (n for n in names if not beaten_by[n]),
      key=lambda n: (by_name[n].cost_class, len(by_name[n].hyperparameters),
                     -scores[n][0], n))
  chosen = undominated[0]
  reason = _reason(chosen, undominated, beaten_by, by_name, scores,
                   left_out, measure, margin)
  return Recommendation(chosen, reason, tuple(undominated),
                        {n: tuple(b) for n, b in beaten_by.items()},
                        left_out, scores)


def recommend(results: Mapping[str, Any],
              candidates: Sequence[Candidate] = CANDIDATES,
              min_seeds: int = MIN_SEEDS,
              min_difference: float = MIN_DIFFERENCE,
              require_dev: bool = True,
              resamples: int = statistics.RESAMPLES) -> Recommendation:
  """The recipe the rule in force (version 2, module docstring) picks.

  Args:
    results: the dev split's results.json, its workloads holding their
      ``ladder`` (``report.rescore``).
    candidates: the candidates (default ``CANDIDATES``).
    min_seeds: the fewest evaluation seeds a candidate may have run.
    min_difference: the smallest pooled mean paired difference of any-time
      values that counts.
    require_dev: refuse results that are not the dev split's.
    resamples: bootstrap resamples of the intervals.

  Returns:
    The ``Recommendation``; its ``scores`` are any-time scores.

  Raises:
    ValueError: results of another split (or of none), a workload without
      its ladder, or no candidate left to choose from.
  """
  eligible, left_out = _candidates(results, candidates, min_seeds,
                                   require_dev)
  bare = [w for w, e in results['workloads'].items()
          if not statistics.ladder_targets(e)]
  if bare:
    raise ValueError(f'no ladder of targets on {", ".join(bare)}: rescore '
                     'the results first (report.rescore)')
  names = [c.arm for c in eligible]
  found = statistics.anytime_scores(results, resamples=resamples)
  scores = {n: (found[n]['score'], found[n]['interval']) for n in names}
  pairs = list(itertools.combinations(names, 2))
  pooled = [c for c in (statistics.compare_anytime(results, pairs,
                                                   resamples=resamples)
                        if pairs else []) if c['workload'] == 'pooled']
  wins = []
  for c in pooled:
    a, b, difference = c['a'], c['b'], c['difference']
    if c['verdict'] == statistics.WORSE:
      a, b, difference = b, a, -difference
    if (c['verdict'] != statistics.NO_DIFFERENCE
        and difference >= min_difference and scores[a][1][0] > scores[b][0]):
      wins.append((a, b))
  return _choose(eligible, left_out, scores, wins, 'any-time score',
                 f'by a mean paired difference of at least {min_difference:g}')


def recommend_by_target(results: Mapping[str, Any],
                        candidates: Sequence[Candidate] = CANDIDATES,
                        min_seeds: int = MIN_SEEDS,
                        min_speedup: float = MIN_SPEEDUP,
                        require_dev: bool = True,
                        resamples: int = statistics.RESAMPLES
                        ) -> Recommendation:
  """The recipe version 1 of the rule (module docstring) picks.

  Args:
    results: the dev split's results.json (``report``'s shape).
    candidates: the candidates (default ``CANDIDATES``).
    min_seeds: the fewest evaluation seeds a candidate may have run.
    min_speedup: the smallest pooled median paired speedup that counts.
    require_dev: refuse results that are not the dev split's.
    resamples: bootstrap resamples of the score intervals.

  Returns:
    The ``Recommendation``; its ``scores`` are steps scores.

  Raises:
    ValueError: results of another split (or of none), or no candidate left
      to choose from.
  """
  eligible, left_out = _candidates(results, candidates, min_seeds,
                                   require_dev)
  names = [c.arm for c in eligible]
  all_scores = steps_scores(results)
  intervals = statistics.score_intervals(results, resamples=resamples)
  scores = {n: (all_scores[n], intervals[n]) for n in names}
  pairs = list(itertools.combinations(names, 2))
  pooled = [c for c in (statistics.compare(results, pairs,
                                           resamples=resamples)
                        if pairs else []) if c['workload'] == 'pooled']
  wins = []
  for c in pooled:
    a, b, speedup = c['a'], c['b'], c['speedup']
    if c['verdict'] == statistics.WORSE:
      a, b, speedup = b, a, 1.0 / speedup
    if (c['verdict'] != statistics.NO_DIFFERENCE and speedup >= min_speedup
        and intervals[a][0] > all_scores[b]):
      wins.append((a, b))
  return _choose(eligible, left_out, scores, wins, 'steps score',
                 f'by at least {min_speedup:g}x')


def fmt(score: tuple[float, list[float]]) -> str:
  """A score and its interval as every page prints them: ``0.700 [0.600,
  0.800]``."""
  value, (low, high) = score
  return f'{value:.3f} [{low:.3f}, {high:.3f}]'


def _reason(chosen: str, undominated: Sequence[str],
            beaten_by: Mapping[str, Sequence[str]],
            by_name: Mapping[str, Candidate],
            scores: Mapping[str, tuple[float, list[float]]],
            left_out: Mapping[str, str], measure: str, margin: str) -> str:
  c = by_name[chosen]
  parts = [f'{chosen} ({measure} {fmt(scores[chosen])}): ']
  if len(undominated) == 1:
    parts.append('the only candidate no other beat (significantly better '
                 f'in the pooled paired test, {margin}, and above its '
                 'score)')
  else:
    others = [n for n in undominated if n != chosen]
    parts.append(f'no candidate beat it, nor {", ".join(others)}; among '
                 f'these it has the cheapest step (class {c.cost_class}) '
                 f'and then the fewest hyperparameters '
                 f'({len(c.hyperparameters)})')
  beaten = {n: b for n, b in beaten_by.items() if b}
  if beaten:
    parts.append('; beaten: ' + '; '.join(
        f'{n} by {", ".join(b)}' for n, b in sorted(beaten.items())))
  if left_out:
    parts.append('; left out: ' + '; '.join(
        f'{n} ({why})' for n, why in sorted(left_out.items())))
  return ''.join(parts) + '.'


def describe(recommendation: Recommendation) -> str:
  """A markdown paragraph for results.md."""
  return f'**Decision rule (decision.py):** {recommendation.reason}'


def maybe_recommend(results: Mapping[str, Any]) -> Optional[Recommendation]:
  """``recommend`` where the rule applies (a dev run with enough seeds and
  candidates), else None."""
  try:
    return recommend(results)
  except (ValueError, KeyError, StopIteration):
    return None


