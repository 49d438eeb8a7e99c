"""``cbp-optax workloads``: time to target of optimizer arms on fixed workloads.

``cbp-optax workloads [--quick] [--split dev|test] [--workloads a,b]
[--arms a,b] [--seeds N] [--out DIR] [--arm NAME=module:function [--centered
NAME]] [--score-only]``

Each arm tunes its learning rate on the workload's grid (tuning seed), then
runs on the evaluation seeds; the report compares the time to each
workload's target (AlgoPerf's: the best median of the tuned baselines, which
run first) over all workloads with AlgoPerf's performance profile. Running
into an ``--out`` that already holds results.json replaces the (workload,
arm) pairs measured now and keeps the others; every run is also saved as
its own file under ``--out``/runs, so the same command started again after
an interruption resumes where it stopped. ``--score-only`` rewrites
results.md and the profiles from results.json without training (with the
targets now fixed in the code, for a full-size run).
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import sys
import time
import traceback
from typing import Optional, Sequence


def parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog='cbp-optax workloads',
      formatter_class=argparse.ArgumentDefaultsHelpFormatter,
      description='Time to target of optimizer arms (AdamW, NAdamW, Muon, '
      'schedule-free AdamW, centered AdamW, CBP variants, your own) on fixed '
      'small workloads, scored with AlgoPerf\'s performance profile.')
  parser.add_argument('--quick', action='store_true',
                      help='tiny sizes (a smoke test; targets from the '
                      'run\'s own baselines)')
  parser.add_argument('--split', choices=('dev', 'test'), default=None,
                      help='run the split\'s workloads (splits.py: dev '
                      'chooses the defaults, test only reports; default: '
                      'both)')
  parser.add_argument('--workloads', default=None,
                      help='comma-separated workloads (default: all, or the '
                      '--split\'s)')
  parser.add_argument('--arms', default=None,
                      help='comma-separated arms (default: every built-in '
                      'arm and every --arm)')
  parser.add_argument('--arm', action='append', default=[],
                      metavar='NAME=module:function',
                      help='a user arm: function(schedule) returns an optax '
                      'GradientTransformation (repeatable)')
  parser.add_argument('--centered', action='append', default=[],
                      metavar='NAME',
                      help='train the user arm NAME on the centered model '
                      '(M2) with the transport after each update')
  parser.add_argument('--seeds', type=int, default=None,
                      help='evaluation seeds (default 3; 2 with --quick)')
  parser.add_argument('--out', type=pathlib.Path, default=None,
                      help='output folder (results.json there is merged; '
                      'default: workloads, or workloads/SPLIT with --split, '
                      'so that the splits are scored apart)')
  parser.add_argument('--set-targets', action='store_true',
                      help='ignore the targets fixed in the code and set '
                      'each workload\'s from this run\'s baselines (how the '
                      'fixed targets are made)')
  parser.add_argument('--score-only', action='store_true',
                      help='rescore --out/results.json into results.md and '
                      'the profile PNG; no training')
  parser.add_argument('--data-dir', type=pathlib.Path, default=None,
                      help='MNIST IDX files (default: $CBP_OPTAX_MNIST, '
                      'then the bundled subset)')
  parser.add_argument('--no-progress', action='store_true',
                      help='hide the progress bar')
  return parser.parse_args(argv)


def _split(text: Optional[str]) -> Optional[list[str]]:
  return None if text is None else [t for t in text.split(',') if t]


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = parse(argv)
  # pylint: disable=g-import-not-at-top
  from cbp_optax_experiments.reproduce import cli as reproduce_cli
  reproduce_cli._prefer_fast_cpu_convolutions()  # pylint: disable=protected-access
  import os
  if args.data_dir is not None:
    os.environ['CBP_OPTAX_MNIST'] = str(args.data_dir)
  import jax
  import tqdm
  from cbp_optax_experiments.workloads import arms as arms_lib
  from cbp_optax_experiments.workloads import definitions
  from cbp_optax_experiments.workloads import protocol
  from cbp_optax_experiments.workloads import report
  from cbp_optax_experiments.workloads import splits
  # pylint: enable=g-import-not-at-top

  out = args.out or (pathlib.Path('workloads') / args.split if args.split
                     else pathlib.Path('workloads'))
  if args.score_only:
    results = report.load(out)
    if results is None:
      raise SystemExit(f'--score-only: no {out / report.RESULTS}')
    if not results.get('meta', {}).get('quick'):
      report.use_code_targets(results)
    report.write(out, results)
    print(f'rescored {out / report.RESULTS} -> results.md, '
          'performance_profile.png')
    return 0

  available = arms_lib.builtin_arms()
  try:
    for spec in args.arm:
      name = spec.partition('=')[0]
      available[name] = arms_lib.user_arm(spec, name in args.centered)
    names = _split(args.workloads) or list(
        splits.workloads(args.split) if args.split else definitions.NAMES)
    if args.split:
      outside = [n for n in names if n not in splits.SPLITS[args.split]]
      if outside:
        raise ValueError(f'{", ".join(outside)} not in the {args.split} '
                         'split (splits.py)')
    for name in names:
      definitions.workload(name, args.quick)
  except ValueError as e:
    raise SystemExit(f'cbp-optax workloads: {e}') from e
  chosen = _split(args.arms) or [
      n for n in available if n in arms_lib.builtin_arms() or
      any(spec.startswith(n + '=') for spec in args.arm)]
  unknown = [a for a in chosen if a not in available]
  if unknown:
    raise SystemExit(f'cbp-optax workloads: unknown arm(s) {unknown}; '
                     f'choose from {", ".join(available)} or add --arm')
  # The baselines first: they set the targets of a run without fixed ones.
  chosen.sort(key=lambda a: a not in arms_lib.BASELINES)
  reference = available[arms_lib.REFERENCE]
  seeds = list(range(args.seeds or (2 if args.quick else 3)))

  data = definitions.mnist_data(args.quick).description
  meta = {'quick': args.quick, 'seeds': seeds, 'split': args.split,
          'tuning_seeds': list(protocol.TUNING_SEEDS), 'data': data,
          'jax': jax.__version__, 'platform': jax.devices()[0].platform,
          'started': datetime.datetime.now(datetime.timezone.utc).isoformat(
              timespec='seconds')}
  results = report.load(out)
  if results is not None and results.get('meta', {}).get('quick') != args.quick:
    print(f'{out / report.RESULTS} holds a {"non-" if args.quick else ""}'
          'quick run: starting a new one there')
    results = None
  if results is not None and results.get('meta', {}).get(
      'split') != args.split:
    # One score per split: a dev run never merges into a test one.
    print(f'{out / report.RESULTS} holds a run of split '
          f'{results["meta"].get("split")}: starting a new one there (the '
          'runs stored there are reused)')
    results = None
  if results is None:
    results = report.empty(meta)
  else:
    results['meta'].update({k: v for k, v in meta.items() if k != 'started'})

  store = protocol.RecordStore(out / 'runs',
                               {'quick': args.quick, 'data': data})
  window = (protocol.QUICK_COST_WINDOW_SECONDS if args.quick else
            protocol.COST_WINDOW_SECONDS)
  workloads = [definitions.workload(n, args.quick) for n in names]
  per_arm = lambda w: (len(w.grid) + 1) * len(protocol.TUNING_SEEDS) + len(
      seeds)
  bar = tqdm.tqdm(total=sum(per_arm(w) for w in workloads) * len(chosen),
                  unit='run', disable=args.no_progress)
  start = time.perf_counter()
  for workload in workloads:
    old = results['workloads'].get(workload.name, {})
    entry = report.workload_entry(workload, workload.target,
                                  'fixed in code (definitions.TARGETS)')
    entry['arms'] = dict(old.get('arms', {}))
    from_baselines = workload.target is None or args.set_targets
    if from_baselines:
      # Baselines of an earlier run into --out count too.
      report.set_baseline_target(entry)
    results['workloads'][workload.name] = entry
    for name in chosen:
      arm = available[name]
      bar.set_description(f'{workload.name} / {name}')
      before = bar.n
      try:
        outcome = protocol.evaluate_arm(
            workload, arm, reference, entry['target'], seeds,
            on_run=lambda: bar.update(1), store=store, cost_window=window)
      except Exception as e:  # pylint: disable=broad-except
        # A broken arm (a user factory that raises, say) loses its own row,
        # not the run: divergence is recorded, errors are reported.
        traceback.print_exc()
        print(f'{workload.name} / {name}: failed ({e!r}); skipped',
              file=sys.stderr)
        continue
      bar.update(per_arm(workload) - (bar.n - before))
      entry['arms'][name] = report.arm_entry(arm, outcome, entry)
      if name in arms_lib.BASELINES and from_baselines:
        report.set_baseline_target(entry)
      report.apply_target(entry)
      results['meta']['wall_seconds'] = time.perf_counter() - start
      report.write(out, results)  # saved after every arm and workload
  bar.close()
  print(report.score_table(results))
  print(f'wrote {out / "results.md"}, {report.RESULTS}, '
        f'performance_profile.png ({time.perf_counter() - start:.0f} s)')
  return 0


if __name__ == '__main__':
  sys.exit(main())
