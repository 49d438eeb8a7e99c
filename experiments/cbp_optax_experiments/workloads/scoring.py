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
