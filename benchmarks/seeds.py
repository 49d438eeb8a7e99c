"""Seeds per second of the workload suite: vmapped vs looped, side by side.

Usage::

  python benchmarks/seeds.py                      # 3 workloads, 10 seeds
  python benchmarks/seeds.py --workloads spiral,mnist-mlp --seeds 10 \
      --arm adamw --quick

For each workload (full size unless ``--quick``) and one arm, times the
evaluation seeds of one rate run one after the other (``Runner.run``) and as
one vmapped program (``Runner.run_many``), each after a warm-up call that
compiles it (its seconds are reported apart, as compile + first run), and
prints a markdown table: seconds per seed, seeds per second, the speedup,
and the largest difference between the two paths' metrics (float rounding).
A workload that cannot be batched (``protocol.batchable``) is timed looped
only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

import numpy as np  # noqa: E402

from cbp_optax_experiments.workloads import arms as arms_lib  # noqa: E402
from cbp_optax_experiments.workloads import definitions  # noqa: E402
from cbp_optax_experiments.workloads import protocol  # noqa: E402

DEFAULT_WORKLOADS = ('spiral', 'breast-cancer-raw', 'mnist-mlp')


def measure(name: str, arm_name: str, seeds: int, quick: bool
            ) -> dict[str, object]:
  """Looped and vmapped seconds for ``seeds`` seeds of ``arm_name`` on
  ``name``, at the workload grid's second rate."""
  workload = definitions.workload(name, quick)
  arm = arms_lib.builtin_arms()[arm_name]
  runner = protocol.make_runner(workload.build(arm.centers(workload)), arm,
                                workload)
  lr = arm.grid(workload)[min(1, len(workload.grid) - 1)]
  ids = list(range(seeds))
  start = time.perf_counter()
  runner.run(ids[0], lr)
  looped_first = time.perf_counter() - start
  start = time.perf_counter()
  looped = [runner.run(s, lr) for s in ids]
  looped_s = time.perf_counter() - start
  row = {'workload': name, 'arm': arm_name, 'steps': workload.steps,
         'seeds': seeds, 'looped_first_s': looped_first,
         'looped_s': looped_s, 'batchable': protocol.batchable(workload)}
  if not row['batchable'][0]:
    return row
  start = time.perf_counter()
  runner.run_many(ids, [lr] * seeds)
  row['vmapped_first_s'] = time.perf_counter() - start
  start = time.perf_counter()
  batched = runner.run_many(ids, [lr] * seeds)
  row['vmapped_s'] = time.perf_counter() - start
  row['max_metric_diff'] = float(max(
      np.max(np.abs(a[1] - b[1])) for a, b in zip(looped, batched)))
  row['max_loss_rel_diff'] = float(max(
      np.max(np.abs(a[0] - b[0]) / np.maximum(np.abs(a[0]), 1e-12))
      for a, b in zip(looped, batched)))
  return row


def table(rows) -> str:
  lines = ['| workload (steps) | arm | seeds | looped: s/seed | looped: '
           'seeds/s | vmapped: s/seed | vmapped: seeds/s | speedup | '
           'compile + first run: looped / vmapped (s) | max abs. metric diff | '
           'max rel. loss diff |',
           '|:---|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|']
  for r in rows:
    n = r['seeds']
    looped = r['looped_s'] / n
    if 'vmapped_s' in r:
      vmapped = r['vmapped_s'] / n
      cells = [f'{vmapped:.3f}', f'{1 / vmapped:.2f}',
               f'{looped / vmapped:.2f}x',
               f'{r["looped_first_s"]:.1f} / {r["vmapped_first_s"]:.1f}',
               f'{r["max_metric_diff"]:.2g}', f'{r["max_loss_rel_diff"]:.2g}']
    else:
      cells = ['looped', '—', '—', f'{r["looped_first_s"]:.1f} / —', '—',
               '—']
    lines.append('| ' + ' | '.join(
        [f'{r["workload"]} ({r["steps"]})', r['arm'], str(n),
         f'{looped:.3f}', f'{1 / looped:.2f}'] + cells) + ' |')
  return '\n'.join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--workloads', default=','.join(DEFAULT_WORKLOADS))
  parser.add_argument('--arm', default='adamw')
  parser.add_argument('--seeds', type=int, default=10)
  parser.add_argument('--quick', action='store_true',
                      help='the workloads at their --quick sizes')
  args = parser.parse_args(argv)
  rows = []
  for name in args.workloads.split(','):
    row = measure(name, args.arm, args.seeds, args.quick)
    rows.append(row)
    print(f'{name}: {row}', file=sys.stderr, flush=True)
  print(table(rows))
  return 0


if __name__ == '__main__':
  sys.exit(main())
