"""Compile time of ``jax.jit(tx.update)`` for cbp, cbp_robust and AdamW.

``python benchmarks/compile_time.py [LEAVES ...]`` (default 200 2000) times
trace + lower + compile of each optimizer's update from cold caches on
trees of kernel/bias pairs (:func:`benchmarks.user_path.leaf_tree`),
interleaved per round (:func:`benchmarks.user_path.run_compile`), and prints
the median and IQR of the wall seconds and of the per-round ratio to AdamW,
with the load average before and after.
"""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

from benchmarks import user_path  # noqa: E402


def main():
  leaves = [int(x) for x in sys.argv[1:]] or [200, 2000]
  load0 = os.getloadavg()
  result = user_path.run_compile(
      leaves, optimizers=('adamw', 'cbp', 'cbp_robust'), log=print)
  load1 = os.getloadavg()
  print(f'load average before {load0[0]:.2f} {load0[1]:.2f}, after '
        f'{load1[0]:.2f} {load1[1]:.2f}')
  print('| leaves | rounds | optimizer | wall s median [IQR] | / adamw '
        'median [IQR] |')
  print('|---|---|---|---|---|')
  for row in result['rows']:
    for name, entry in row['optimizers'].items():
      wall, ratio = entry['wall_s'], entry['wall_ratio']
      print(f"| {row['leaves']} | {row['rounds']} | {name} | "
            f"{wall['median']:.2f} [{wall['q1']:.2f}, {wall['q3']:.2f}] | "
            f"{ratio['median']:.3f} [{ratio['q1']:.3f}, {ratio['q3']:.3f}] |")


if __name__ == '__main__':
  main()
