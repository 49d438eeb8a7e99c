"""``cbp-optax reproduce <study|all> [--seeds N] [--quick] [--out DIR] [--data-dir DIR]``.

Runs the studies in order, each into ``<out>/<study>/``, and adds each
study's wall time to ``<out>/summary.md`` / ``summary.json``: studies run
earlier into the same ``<out>`` stay listed (a rerun replaces its own row).
``--download`` lets the real-data studies fetch MNIST first.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import pathlib
import sys
import time
from typing import Optional, Sequence

from cbp_optax_experiments import outputs

# Study name -> module, in the paper's order. The real-data studies come last.
STUDIES = {
    'gradient-norms': 'gradient_norms',   # §6.1, Fig. 2
    'conditioning': 'conditioning',       # §6.2, Table 5, Fig. 3
    'head-to-head': 'head_to_head',       # §6.3, Table 6, Fig. 4
    'factorial': 'factorial',             # §6.4, Tables 7-8
    'quadratic': 'quadratic',             # §6.5, Fig. 5
    'disparity': 'disparity',             # §6.5, Table 9, Fig. 6
    'depth-training': 'depth_training',   # §6.5, Fig. 7
    'overhead': 'overhead',               # §5.6, Table 4
    'mnist': 'mnist',                     # §6.6, Table 10
    'resnet': 'resnet',                   # §6.6, Table 11
    'gradient-flow': 'gradient_flow',     # diagnostics: depth 40, MNIST
    'normalization': 'normalization',     # diagnostics: depth 12, MNIST
    'init-scale': 'init_scale',           # diagnostics: alpha x depth, MNIST
    'transformer': 'transformer',         # beyond the paper: byte-level LM
    'transformer-ablation': 'transformer_ablation',  # #17: CBP vs AdamW
}
REAL_DATA = ('mnist', 'resnet', 'gradient-flow', 'normalization',
             'init-scale')
_CONV_FLAG = '--xla_cpu_experimental_ynn_fusion_type=-individual_convolution'


def _prefer_fast_cpu_convolutions() -> None:
  """Adds the XLA:CPU convolution flag before JAX creates its backend.

  XLA:CPU sends weight-gradient convolutions to a slow library fusion by
  default; the flag keeps them on the individual-convolution path (~2.4x
  faster ResNet-8 steps), with the same results to ~1e-7.
  """
  flags = os.environ.get('XLA_FLAGS', '')
  if 'ynn_fusion_type' not in flags:
    os.environ['XLA_FLAGS'] = (flags + ' ' + _CONV_FLAG).strip()


def parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog='cbp-optax reproduce',
      formatter_class=argparse.ArgumentDefaultsHelpFormatter,
      description='Reproduce the studies of the CBP paper (§5.6, §6).')
  parser.add_argument('study', nargs='+',
                      choices=list(STUDIES) + ['all', 'synthetic'],
                      help="studies, 'all', or 'synthetic' (all but the "
                      'real-data tables)')
  parser.add_argument('--seeds', type=int, default=None,
                      help="seeds per configuration; None: the paper's")
  parser.add_argument('--quick', action='store_true',
                      help='reduced smoke-test version of each study')
  parser.add_argument('--out', type=pathlib.Path,
                      default=pathlib.Path('reproduction'),
                      help='output folder; summary.md there accumulates '
                      'the studies run into it')
  parser.add_argument('--data', type=pathlib.Path, default=None,
                      help='transformer: a text file or a directory of text '
                      'files; None: the Python standard library')
  parser.add_argument('--data-dir', type=pathlib.Path, default=None,
                      help='MNIST IDX / CIFAR-10 binary files; None: '
                      '$CBP_OPTAX_MNIST, then ~/.cache/cbp_optax/mnist')
  parser.add_argument('--download', action='store_true',
                      help='before real-data studies, download MNIST into '
                      '--data-dir (or ~/.cache/cbp_optax/mnist) if it is '
                      'not there (CIFAR-10 is never downloaded)')
  parser.add_argument('--no-progress', action='store_true',
                      help='hide the progress bars')
  args = parser.parse_args(argv)
  for name in selected(args.study):
    writer = outputs.results_writer(args.out / name)
    if writer in (outputs.COMPARE, outputs.WORKLOADS):
      parser.error(f'--out {args.out}: {args.out / name} holds the results '
                   f'of {writer}, which the study {name} would replace; '
                   'choose another folder')
  return args


QUICK_NOTE = ('> Quick run (`--quick`): the reduced smoke-test version of '
              'this study (fewer seeds, steps and sizes), not the paper\'s '
              'protocol; its numbers are not the reported ones.')


def _mark_quick(results: pathlib.Path) -> None:
  """Says under the title of a --quick run's results.md that it was quick."""
  if not results.exists():
    return
  title, _, rest = results.read_text().partition('\n')
  results.write_text(f'{title}\n\n{QUICK_NOTE}\n{rest}')


def selected(studies: Sequence[str]) -> list[str]:
  names = []
  for study in studies:
    if study == 'all':
      names += list(STUDIES)
    elif study == 'synthetic':
      names += [s for s in STUDIES if s not in REAL_DATA]
    else:
      names.append(study)
  return list(dict.fromkeys(names))


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = parse(argv)
  _prefer_fast_cpu_convolutions()
  # Imported after the flag is set: JAX reads XLA_FLAGS at backend creation.
  try:
    # import_module, not `from ... import`: it goes through sys.modules, so
    # a missing matplotlib is detected even after plotting was imported.
    plotting = importlib.import_module(
        'cbp_optax_experiments.reproduce.plotting')
    importlib.import_module('scipy.stats')
    importlib.import_module('tqdm')
  except ImportError as e:
    raise SystemExit(
        'cbp-optax reproduce needs matplotlib (its figures), scipy (its '
        f'statistics) and tqdm (progress bars) ({e}). '
        "Install the experiments with their dependencies: pip install ./experiments") from e
  from cbp_optax_experiments.reproduce.context import StudyContext  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top

  names = selected(args.study)
  if args.download and any(name in REAL_DATA for name in names):
    _download_mnist(args.data_dir)
  for name in names:
    module = importlib.import_module(
        f'cbp_optax_experiments.reproduce.{STUDIES[name]}')
    ctx = StudyContext(out=args.out / name, seeds=args.seeds, quick=args.quick,
                       data_dir=args.data_dir, data=args.data,
                       progress=not args.no_progress)
    print(f'== {name}: {module.TITLE}', flush=True)
    start = time.perf_counter()
    result = module.run(ctx)
    seconds = time.perf_counter() - start
    if args.quick:
      _mark_quick(ctx.out / 'results.md')
    # The machine may be shared: the load average (1, 5, 15 min) at the end
    # of each study says how contended its wall time was.
    load = os.getloadavg()
    print(f'   done in {seconds:.1f} s -> {ctx.out} (load average '
          f'{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f})', flush=True)
    command = (f'cbp-optax reproduce {name}'
               f'{" --quick" if args.quick else ""}'
               f'{f" --seeds {args.seeds}" if args.seeds else ""}')
    entry = {
        'seconds': seconds, 'load_average': load, 'summary': result.summary,
        'title': module.TITLE, 'command': command,
        'finished': datetime.datetime.now(datetime.timezone.utc).strftime(
            '%Y-%m-%d %H:%M UTC'),
        'jax': jax.__version__, 'platform': jax.devices()[0].platform,
        'cpus': os.cpu_count(),
    }
    # Written after every study, so an interrupted run keeps its times.
    _write_summary(plotting, args.out, name, entry)
  return 0


def _download_mnist(data_dir: Optional[pathlib.Path]) -> None:
  """Fetches MNIST where the real-data studies will look for it."""
  from cbp_optax_experiments import datasets  # pylint: disable=g-import-not-at-top
  try:
    print(f'data: {datasets.find_mnist(data_dir, download=True).source}',
          flush=True)
  except datasets.DataError as e:
    print(f'warning: --download: {e}', file=sys.stderr, flush=True)


def _write_summary(plotting, out: pathlib.Path, name: str, entry) -> None:
  """Adds (or replaces) ``name`` in ``out/summary.json`` and rewrites
  ``out/summary.md`` from all the studies recorded there."""
  summary = {}
  try:
    summary = json.loads((out / 'summary.json').read_text())
  except FileNotFoundError:
    pass
  except (OSError, ValueError) as e:
    print(f'warning: {out / "summary.json"} unreadable ({e}); starting a new '
          'summary', file=sys.stderr)
  if not isinstance(summary, dict):  # valid JSON, but not a summary
    print(f'warning: {out / "summary.json"} is not a study summary; starting '
          'a new summary', file=sys.stderr)
    summary = {}
  # A rerun replaces its own entry in place; new studies are appended.
  summary[name] = entry
  plotting.write_json(out / 'summary.json', summary)
  rows = [[study, e.get('title', ''), f'{e["seconds"]:.1f}',
           ' / '.join(f'{v:.1f}' for v in e.get('load_average', ())),
           f'`{e.get("command", "")}`', e.get('finished', ''),
           f'jax {e.get("jax", "?")} on {e.get("platform", "?")}, '
           f'{e.get("cpus", "?")} CPU(s)']
          for study, e in summary.items()]
  plotting.write_markdown(out / 'summary.md', 'Reproduction run', [
      plotting.markdown_table(
          ['study', 'paper item', 'wall time (s)',
           'load average at the end (1 / 5 / 15 min)', 'command', 'finished',
           'environment'], rows)])


if __name__ == '__main__':
  sys.exit(main())
