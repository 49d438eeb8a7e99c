"""Times one arm's full grid and seeds on workloads: sizing the full runs.

``python -m cbp_optax_experiments.workloads.timing NAME[,NAME...] [ARM]``
(default arm ``adamw``) runs ``protocol.evaluate_arm`` for each workload at
its full size, as a full run would (the grid on the tuning seed, the edge
extension, the evaluation seeds 0, 1, 2 and the cost window; compiling
included, no target: the rate with the best metric), and prints one JSON
line each: wall seconds, runs, the chosen rate, ms per step, the final
metrics, the initial metric and the best metric at each rate tried.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Optional, Sequence

from cbp_optax_experiments.workloads import arms as arms_lib
from cbp_optax_experiments.workloads import definitions
from cbp_optax_experiments.workloads import protocol


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv:
    print(__doc__)
    return 2
  names = argv[0].split(',')
  arm_name = argv[1] if len(argv) > 1 else arms_lib.REFERENCE
  arms = arms_lib.builtin_arms()
  for name in names:
    workload = definitions.workload(name, quick=False)
    runs = []
    start = time.perf_counter()
    outcome = protocol.evaluate_arm(
        workload, arms[arm_name], arms[arms_lib.REFERENCE], [0, 1, 2],
        on_run=lambda: runs.append(1))
    wall = time.perf_counter() - start
    print(json.dumps({
        'workload': name, 'arm': arm_name, 'wall_s': round(wall, 1),
        'runs': len(runs), 'lr': outcome.learning_rate,
        'ms_per_step': round(1e3 * outcome.seconds_per_step, 2),
        'finals': [round(float(r.metrics[-1]), 4) for r in outcome.runs],
        'initial': round(outcome.runs[0].initial_metric, 4),
        'tuning_best': {
            f'{lr:g}': round(protocol.best_metric(
                r[0].metrics.tolist(), workload.higher_is_better), 4)
            for lr, r in sorted(outcome.tuning.items())}}), flush=True)
  return 0


if __name__ == '__main__':
  sys.exit(main())
