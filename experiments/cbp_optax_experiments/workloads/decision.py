"""The rule that picks the recommended recipe from a dev run, fixed before it.

Written down before any run at ten seeds, so that the run cannot shape it.
``recommend(results)`` applies it to the dev split's results.json and returns
the recommendation with its reason; the test split only reports
(``splits``), and ``recommend`` refuses its results.

1. **What decides: the profile of time to target in steps.** Steps to target
   are device-independent: a seed reaches the target at the same step on a
   CPU and on a GPU. The wall-clock profile multiplies them by step costs
   measured on this CPU, which misstate what a GPU user pays (Muon's
   Newton-Schulz products cost 2-7x an AdamW step here, while an accelerator
   runs them on its matrix units) and which moved a score by up to 0.3
   between two runs of the same code. It is reported, not used to decide;
   the cost of a step enters the rule only through the tie-break below, as
   a class read from the algorithm (``CANDIDATES``), not a timing.
2. **What margin counts.** Candidate X beats candidate Y only if all three
   hold: (a) the pooled paired comparison of steps to target
   (``statistics``: the log2 ratio per (workload, seed), Wilcoxon
   signed-rank, Holm-corrected over every pair of candidates) says X is
   significantly better than Y at ``statistics.ALPHA``; (b) the pooled
   median paired speedup (``2 ** median`` of those log2 ratios) is at least
   ``MIN_SPEEDUP``; and (c) the lower end of X's 95% bootstrap interval of
   the steps score is above Y's score. (a) asks that X is faster seed for
   seed across the workloads; (b) that it is faster by more than the
   measure resolves: steps to target are read at evaluations every 1/20 to
   1/12 of the budget, so one evaluation late in a run is 5-10% of the
   steps; (c) that the gain shows in the headline score and is not one
   workload's outlier among the pooled pairs.
3. **Who is left:** the candidates no other candidate beats (every
   candidate must have run every workload of the results, on at least
   ``MIN_SEEDS`` seeds shared with the others; one that did not is left out,
   and said so).
4. **Tie-break among them:** the cheaper step (``cost_class``: 1 for
   elementwise updates, a few reads and writes per parameter; 2 for an
   update that multiplies each matrix by itself, Muon's Newton-Schulz), then
   fewer hyperparameters (``hyperparameters``: the optimizer's own constants
   a user may set; the schedule and the centering are shared by every
   candidate and not counted), then the higher steps score, then the name.
   A costlier or more elaborate candidate must therefore beat the simpler
   ones to be recommended.
"""

from __future__ import annotations

import itertools
from typing import Any, Mapping, NamedTuple, Optional, Sequence

from cbp_optax_experiments.workloads import scoring
from cbp_optax_experiments.workloads import statistics

MIN_SEEDS = 10
MIN_SPEEDUP = 1.1
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


def recommend(results: Mapping[str, Any],
              candidates: Sequence[Candidate] = CANDIDATES,
              min_seeds: int = MIN_SEEDS, min_speedup: float = MIN_SPEEDUP,
              require_dev: bool = True,
              resamples: int = statistics.RESAMPLES
              ) -> Recommendation:
  """The recipe the rule (module docstring) picks from a dev run.

  Args:
    results: the dev split's results.json (``report``'s shape).
    candidates: the candidates (default ``CANDIDATES``).
    min_seeds: the fewest evaluation seeds a candidate may have run.
    min_speedup: the smallest pooled median paired speedup that counts.
    require_dev: refuse results that are not the dev split's.
    resamples: bootstrap resamples of the score intervals.

  Returns:
    The ``Recommendation``.

  Raises:
    ValueError: results of another split (or of none), or no candidate left
      to choose from.
  """
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
  names = [c.arm for c in eligible]
  all_scores = steps_scores(results)
  intervals = statistics.score_intervals(results, resamples=resamples)
  scores = {n: (all_scores[n], intervals[n]) for n in names}
  pairs = list(itertools.combinations(names, 2))
  pooled = [c for c in (statistics.compare(results, pairs,
                                           resamples=resamples)
                        if pairs else []) if c['workload'] == 'pooled']
  beaten_by: dict[str, list[str]] = {n: [] for n in names}
  for c in pooled:
    a, b, speedup = c['a'], c['b'], c['speedup']
    if c['verdict'] == statistics.WORSE:
      a, b, speedup = b, a, 1.0 / speedup
    if (c['verdict'] != statistics.NO_DIFFERENCE and speedup >= min_speedup
        and intervals[a][0] > all_scores[b]):
      beaten_by[b].append(a)
  by_name = {c.arm: c for c in eligible}
  undominated = sorted(
      (n for n in names if not beaten_by[n]),
      key=lambda n: (by_name[n].cost_class, len(by_name[n].hyperparameters),
                     -all_scores[n], n))
  chosen = undominated[0]
  reason = _reason(chosen, undominated, beaten_by, by_name, scores,
                   left_out)
  return Recommendation(chosen, reason, tuple(undominated),
                        {n: tuple(b) for n, b in beaten_by.items()},
                        left_out, scores)


def fmt(score: tuple[float, list[float]]) -> str:
  """A score and its interval as every page prints them: ``0.700 [0.600,
  0.800]``."""
  value, (low, high) = score
  return f'{value:.3f} [{low:.3f}, {high:.3f}]'


def _reason(chosen: str, undominated: Sequence[str],
            beaten_by: Mapping[str, Sequence[str]],
            by_name: Mapping[str, Candidate],
            scores: Mapping[str, tuple[float, list[float]]],
            left_out: Mapping[str, str]) -> str:
  c = by_name[chosen]
  parts = [f'{chosen} (steps score {fmt(scores[chosen])}): ']
  if len(undominated) == 1:
    parts.append('the only candidate no other beat (significantly faster '
                 f'in the pooled paired test, by at least {MIN_SPEEDUP:g}x, '
                 'and above its score)')
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


