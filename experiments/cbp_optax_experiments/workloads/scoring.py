"""AlgoPerf's score: targets, performance profiles over workloads, speedups.

A workload's target is AlgoPerf's: the best, over the tuned baselines, of
the baseline's median over its evaluation seeds of its best validation
metric within the budget (``target``).

An arm's time on a workload is the median over its evaluation seeds of the
steps to the target (a missed or diverged seed counts as infinite), times a
step cost: 1 for the profile in steps (device-independent), the arm's step
cost relative to AdamW for the wall-clock profile (in AdamW steps). Its
ratio on a workload is that time over the best arm's (infinite when it
missed). The performance profile ``rho(tau)`` is the fraction of workloads
with ratio at most ``tau``; the score is its integral over ``[1, r_max]``
divided by ``r_max - 1`` (1: best everywhere; 0: never within ``r_max`` of
the best). ``speedup`` is the geometric mean of AdamW's time over the arm's
on the workloads both reach.

The third score needs no target: ``final_scores`` averages over workloads
each arm's final metric at the budget, normalized per workload from where
training starts (0) to the best arm's (1).
"""

from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

import numpy as np

R_MAX = 4.0


def median_best(values: Sequence[Optional[float]], higher: bool) -> float:
  """The median over seeds of a best metric (None: the seed diverged, the
  worst value); for an even count the worse of the two middle values, so
  that at least half the seeds reach it."""
  worst = -math.inf if higher else math.inf
  ordered = sorted((worst if v is None or not math.isfinite(v) else v
                    for v in values), reverse=higher)
  return float(ordered[len(ordered) // 2]) if ordered else worst


def round_target(value: float, higher: bool) -> float:
  """Rounded to 3 digits towards the easier side (down when higher is
  better), so that the seeds that reached ``value`` still reach it."""
  if not math.isfinite(value):
    return value
  return (math.floor if higher else math.ceil)(value * 1000) / 1000


def target(best_metrics: Mapping[str, Sequence[Optional[float]]],
           higher: bool) -> tuple[float, Optional[str]]:
  """AlgoPerf's target rule: ``(target, baseline)``.

  Args:
    best_metrics: baseline name -> its best metric within the budget on
      each evaluation seed (None where it diverged).
    higher: the metric's direction.

  Returns:
    The best of the baselines' median best metrics, rounded
    (``round_target``), and the baseline it came from (None, and a
    non-finite target, when no baseline has a finite median).
  """
  medians = {name: median_best(values, higher)
             for name, values in best_metrics.items()}
  finite = {n: m for n, m in medians.items() if math.isfinite(m)}
  if not finite:
    return (-math.inf if higher else math.inf), None
  best = (max if higher else min)(finite, key=finite.get)
  return round_target(finite[best], higher), best


def arm_time(steps: Sequence[Optional[int]], cost: float) -> float:
  """Median steps to target (None = inf) times the relative step cost."""
  if not steps:
    return math.inf
  median = float(np.median([math.inf if s is None else float(s)
                            for s in steps]))
  return median * cost if math.isfinite(median) else math.inf


def ratios(times: Mapping[str, Mapping[str, float]]
           ) -> dict[str, dict[str, float]]:
  """``times[workload][arm]`` -> ``ratio[arm][workload]`` to the best arm."""
  out: dict[str, dict[str, float]] = {}
  for workload, per_arm in times.items():
    finite = [t for t in per_arm.values() if math.isfinite(t)]
    best = min(finite) if finite else math.inf
    for arm, t in per_arm.items():
      out.setdefault(arm, {})[workload] = (
          t / best if math.isfinite(t) and best > 0 else
          (1.0 if t == best == 0 else math.inf))
  return out


def rho(arm_ratios: Mapping[str, float], tau: float) -> float:
  """Fraction of workloads on which the arm is within ``tau`` of the best."""
  values = list(arm_ratios.values())
  return sum(r <= tau for r in values) / len(values) if values else 0.0


def profile_score(arm_ratios: Mapping[str, float],
                  r_max: float = R_MAX) -> float:
  """``1 / (r_max - 1) * integral_1^r_max rho(tau) d tau`` (exact: rho is a
  step function, each workload adds ``(r_max - r) / (r_max - 1)``)."""
  values = list(arm_ratios.values())
  if not values:
    return 0.0
  total = sum((r_max - r) / (r_max - 1.0) for r in values if r <= r_max)
  return total / len(values)


def speedup(times: Mapping[str, Mapping[str, float]], arm: str,
            reference: str) -> Optional[float]:
  """Geometric mean of reference time / arm time where both are finite."""
  logs = []
  for per_arm in times.values():
    a, b = per_arm.get(arm, math.inf), per_arm.get(reference, math.inf)
    if math.isfinite(a) and math.isfinite(b) and a > 0 and b > 0:
      logs.append(math.log(b / a))
  return math.exp(sum(logs) / len(logs)) if logs else None


def scores(times: Mapping[str, Mapping[str, float]], reference: str,
           r_max: float = R_MAX) -> dict[str, dict[str, Optional[float]]]:
  """Per arm: profile score, geometric-mean speedup over ``reference``, the
  number of workloads it reached and the number both reached."""
  all_ratios = ratios(times)
  out = {}
  for arm, arm_ratios in all_ratios.items():
    both = sum(1 for per_arm in times.values()
               if math.isfinite(per_arm.get(arm, math.inf))
               and math.isfinite(per_arm.get(reference, math.inf)))
    out[arm] = {
        'score': profile_score(arm_ratios, r_max),
        'speedup_vs_reference': speedup(times, arm, reference),
        'reached': sum(math.isfinite(r) for r in arm_ratios.values()),
        'reached_with_reference': both,
    }
  return out


# ---------------------------------------------------------------------------
# Final metric at the budget, normalized per workload


def final_value(finals: Sequence[Optional[float]],
                diverged: Sequence[bool], initial: float) -> float:
  """Median over seeds of the final metric; a diverged or non-finite seed
  counts as the initial metric (no progress)."""
  values = [initial if bad or v is None or not math.isfinite(v) else v
            for v, bad in zip(finals, diverged)]
  return float(np.median(values)) if values else initial


def normalized_finals(finals: Mapping[str, float], initial: float,
                      higher: bool) -> dict[str, float]:
  """``(final - initial) / (best final - initial)`` clipped to [0, 1]: 1 for
  the best arm, 0 for an arm that ended where training starts or worse."""
  if not finals:
    return {}
  best = (max if higher else min)(finals.values())
  span = best - initial
  if not math.isfinite(span) or span == 0.0:
    return {arm: 0.0 for arm in finals}
  return {arm: min(1.0, max(0.0, (value - initial) / span))
          for arm, value in finals.items()}


def final_scores(normalized: Mapping[str, Mapping[str, float]]
                 ) -> dict[str, float]:
  """``normalized[workload][arm]`` -> per arm, the mean over workloads (a
  workload the arm has not run counts as 0)."""
  arms = sorted({arm for per_arm in normalized.values() for arm in per_arm})
  n = len(normalized)
  return {arm: sum(per_arm.get(arm, 0.0) for per_arm in normalized.values())
          / n for arm in arms} if n else {}


# ---------------------------------------------------------------------------
# The any-time score: a ladder of targets per workload (COCO's runlength
# targets), and per (workload, target, seed) the share of the budget spent at
# or past the target.
#
# Why. One target near the ceiling (``target``) is reached by about half of
# its own setter's seeds, late in the budget: most runs miss it, two misses
# tie, and time to it records mostly whether a seed crossed a threshold
# before the budget ran out. A ladder from easy to hard keeps resolution
# everywhere: its easy end is what the reference optimizer (AdamW on the
# plain model, the one users compare against) reaches at fixed fractions of
# the budget (``LADDER_FRACTIONS``; the median over its evaluation seeds of
# the best-so-far metric, the worse middle value for an even count, so that
# at least half of the reference's seeds reach each), and its hard end runs
# past the reference's final quality in ``HARD_TARGETS`` equal steps up to
# the best median best-within-budget of any arm (COCO's hard targets). No arm
# sets its own bar alone: the reference sets the easy end, every arm
# together the hard one.
#
# The value of one run on one target is ``(n - k + 1) / n`` when the run's
# best-so-far metric first reaches the target at evaluation ``k`` of ``n``
# (1 at the first evaluation, 1/n at the last), and 0 when it never does or
# the run diverged: the fraction of the evaluations at which the target has
# been reached, i.e. the area under the run's empirical runtime distribution
# on a linear step axis, sampled where the suite evaluates. Averaged over a
# dense ladder it is the area under the best-so-far curve between the
# ladder's ends; averaged over this one, it rewards early progress (the easy
# targets, reached by most runs, resolve how early) and final quality (the
# hard targets, reached by few, resolve how far). A linear axis rather than
# COCO's logarithmic one: the budgets are fixed and evaluated evenly, and a
# log axis would weight the first one or two evaluations, the noisiest, as
# much as the last half of the budget.
#
# The wall-clock twin charges the arm's step cost relative to AdamW
# (``cost``): reached at evaluation ``k`` costs ``cost * k`` evaluations of
# AdamW time, and the value is the share of the n evaluation times of AdamW's
# budget from that point on, ``(n - ceil(cost * k) + 1) / n`` (0 below).
#
# An arm's any-time score is the mean over workloads of the mean over its
# (target, seed) pairs: 1 when every seed is at every target from the first
# evaluation, 0 when no seed reaches any.

LADDER_FRACTIONS = (0.125, 0.25, 0.5, 0.75, 1.0)
HARD_TARGETS = 3


def best_so_far(curve: Sequence[Optional[float]], higher: bool) -> np.ndarray:
  """The running best of a curve of metrics (a missing or non-finite value
  counts as the worst, so it never improves the best)."""
  worst = -math.inf if higher else math.inf
  values = np.asarray([worst if v is None or not math.isfinite(v) else v
                       for v in curve], np.float64)
  if values.size == 0:
    return values
  return (np.maximum if higher else np.minimum).accumulate(values)


def ladder(reference_curves: Sequence[Sequence[Optional[float]]],
           reference_diverged: Sequence[bool],
           best_metrics: Mapping[str, Sequence[Optional[float]]],
           higher: bool,
           fractions: Sequence[float] = LADDER_FRACTIONS,
           hard: int = HARD_TARGETS) -> list[float]:
  """A workload's targets, from easiest to hardest (section comment above).

  Args:
    reference_curves: the reference arm's metric at every evaluation, per
      evaluation seed.
    reference_diverged: per seed, whether the reference's run diverged (its
      curve then reaches nothing).
    best_metrics: arm name -> its best metric within the budget per seed
      (None where it diverged); the reference among them.
    higher: the metric's direction.
    fractions: the budget fractions of the easy end.
    hard: how many targets past the reference's final quality.

  Returns:
    ``len(fractions) + hard`` targets, each at least as hard as the one
    before (equal ones where nothing is harder); empty when the reference
    has no curve.
  """
  worst = -math.inf if higher else math.inf
  curves = [np.full(len(c), worst) if bad else best_so_far(c, higher)
            for c, bad in zip(reference_curves, reference_diverged)]
  if not curves or not len(curves[0]):
    return []
  n = len(curves[0])
  easy = [median_best([float(c[max(0, math.ceil(f * n) - 1)])
                       for c in curves], higher) for f in fractions]
  medians = [median_best(v, higher) for v in best_metrics.values()]
  better = max if higher else min
  top = better([m for m in medians + [easy[-1]] if math.isfinite(m)],
               default=easy[-1])
  last = easy[-1]
  if not math.isfinite(last):
    return [top] * (len(easy) + hard)
  steps = [last + (top - last) * (i + 1) / hard for i in range(hard)]
  targets = easy + steps
  # Monotone from easy to hard (median best-so-far is, up to the even-count
  # rule; the hard steps are, by construction).
  for i in range(1, len(targets)):
    targets[i] = better(targets[i], targets[i - 1])
  return [float(t) for t in targets]


def first_reach(curve: Sequence[Optional[float]], target: float,
                higher: bool) -> Optional[int]:
  """The 1-based evaluation at which ``curve`` first reaches ``target``
  (None: never)."""
  for k, value in enumerate(curve, 1):
    if value is None or not math.isfinite(value):
      continue
    if (value >= target) if higher else (value <= target):
      return k
  return None


def anytime_value(curve: Sequence[Optional[float]], targets: Sequence[float],
                  higher: bool, diverged: bool, cost: float = 1.0) -> float:
  """One run's any-time value: the mean over ``targets`` of the share of the
  budget's evaluations at which the target has been reached (section
  comment above), charged ``cost`` AdamW steps per step (1: in steps)."""
  n = len(curve)
  if not targets or n == 0:
    return 0.0
  if diverged:
    return 0.0
  total = 0.0
  for t in targets:
    k = first_reach(curve, t, higher)
    if k is not None:
      charged = k if cost == 1.0 else math.ceil(cost * k - 1e-9)
      total += max(0, n - charged + 1) / n
  return total / len(targets)


def reach_fractions(curves: Sequence[Sequence[Optional[float]]],
                    diverged: Sequence[bool], targets: Sequence[float],
                    higher: bool) -> list[float]:
  """Per target, the fraction of the seeds that reach it within the budget
  (a diverged seed reaches none)."""
  if not curves:
    return [0.0 for _ in targets]
  return [sum(not bad and first_reach(c, t, higher) is not None
              for c, bad in zip(curves, diverged)) / len(curves)
          for t in targets]
