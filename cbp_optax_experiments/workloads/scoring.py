"""AlgoPerf's score: performance profiles over workloads, and speedups.

An arm's time on a workload is the median over its evaluation seeds of the
steps to the target (a missed or diverged seed counts as infinite) times its
step cost relative to AdamW: wall-clock to target in AdamW steps. Its ratio
on a workload is that time over the best arm's (infinite when it missed).
The performance profile ``rho(tau)`` is the fraction of workloads with
ratio at most ``tau``; the score is its integral over ``[1, r_max]``
divided by ``r_max - 1`` (1: best everywhere; 0: never within ``r_max`` of
the best). ``speedup`` is the geometric mean of AdamW's time over the arm's
on the workloads both reach.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

import numpy as np

R_MAX = 4.0


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
