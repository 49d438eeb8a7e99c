"""Interleaved timing: every variant runs once per round, in one process.

Interleaving spreads slow drifts of the machine (other processes, frequency,
memory state) evenly over the variants, and a ratio taken inside one round
compares two steps measured seconds apart; the median of those pairwise
ratios is what the tables report as "x Adam".
"""

from __future__ import annotations

import gc
import time
from typing import Callable, Mapping, Sequence

import numpy as np

# A step slower than this may run fewer timed rounds (the paper's protocol
# asks for >= 60; the tables flag every reduced count).
SLOW_STEP_S = 0.5


def quartiles(values: Sequence[float]) -> dict[str, float]:
  """Median, first and third quartile and IQR of ``values``."""
  q1, median, q3 = np.percentile(np.asarray(values, float), [25, 50, 75])
  return {'median': float(median), 'q1': float(q1), 'q3': float(q3),
          'iqr': float(q3 - q1), 'n': len(values)}


def warm_up(steps: Mapping[str, Callable[[], None]], count: int) -> dict:
  """Runs each step ``count`` times (2 when a step is slow, > SLOW_STEP_S);
  returns the median seconds of each."""
  medians = {}
  for name, step in steps.items():
    times = []
    for i in range(count):
      if i >= 2 and min(times) > SLOW_STEP_S:
        break
      start = time.perf_counter()
      step()
      times.append(time.perf_counter() - start)
    medians[name] = float(np.median(times)) if times else 0.0
  return medians


def interleaved(steps: Mapping[str, Callable[[], None]],
                rounds: int) -> dict[str, list[float]]:
  """Seconds per step of each variant, one step each per round.

  The order rotates every round so no variant always runs first (right
  after the others' memory traffic) or last. The garbage collector is
  paused while timing: a collection landing inside one step would be noise.
  """
  return windowed(steps, {name: _no_sync for name in steps},
                  {name: 1 for name in steps}, rounds)


def _no_sync() -> None:
  """Each step of :func:`interleaved` blocks on its own result."""


def pairwise_ratios(times: Mapping[str, Sequence[float]],
                    reference: str) -> dict[str, dict[str, float]]:
  """Per-round ratio of each variant to ``reference``, summarized."""
  if reference not in times:
    return {}
  ref = np.asarray(times[reference], float)
  return {name: quartiles(np.asarray(values, float) / ref)
          for name, values in times.items()}


def rounds_for(warm_medians: Mapping[str, float], full_rounds: int,
               slow_rounds: int) -> tuple[int, bool]:
  """``full_rounds``, or ``slow_rounds`` when a step takes > SLOW_STEP_S."""
  slow = max(warm_medians.values(), default=0.0) > SLOW_STEP_S
  return (min(slow_rounds, full_rounds) if slow else full_rounds), slow


def steps_per_window(step: Callable[[], object], sync: Callable[[], None],
                     window_s: float, max_probe: int = 2**14) -> int:
  """How many calls of ``step`` fill ``window_s`` (at least one).

  Times back-to-back calls the way a training loop issues them (dispatched
  without waiting, synced once), doubling their number until they fill an
  eighth of the window, so a sub-millisecond step is not sized from one
  noisy call.
  """
  count = 1
  while True:
    start = time.perf_counter()
    for _ in range(count):
      step()
    sync()
    elapsed = time.perf_counter() - start
    if elapsed >= window_s / 8 or count >= max_probe:
      break
    count *= 2
  per_step = elapsed / count
  return max(1, int(round(window_s / max(per_step, 1e-9))))


def windowed(steps: Mapping[str, Callable[[], object]],
             syncs: Mapping[str, Callable[[], None]],
             counts: Mapping[str, int],
             rounds: int) -> dict[str, list[float]]:
  """Seconds per step of each variant, one window of steps each per round.

  A window is ``counts[name]`` calls issued back to back and one sync at the
  end, as a training loop runs them: the next step's Python work (NNX's
  graph traversal, argument flattening) overlaps the previous step's
  computation, and is only exposed when it is the longer of the two. The
  order rotates every round and the garbage collector is paused, as in
  :func:`interleaved`.
  """
  names = list(steps)
  times: dict[str, list[float]] = {name: [] for name in names}
  was_enabled = gc.isenabled()
  gc.disable()
  try:
    for r in range(rounds):
      shift = r % len(names)
      for name in names[shift:] + names[:shift]:
        step, count = steps[name], counts[name]
        start = time.perf_counter()
        for _ in range(count):
          step()
        syncs[name]()
        times[name].append((time.perf_counter() - start) / count)
  finally:
    if was_enabled:
      gc.enable()
  return times


def spread(values: Sequence[float]) -> dict[str, float]:
  """:func:`quartiles` plus the minimum and maximum."""
  out = quartiles(values)
  out.update(min=float(np.min(values)), max=float(np.max(values)))
  return out
