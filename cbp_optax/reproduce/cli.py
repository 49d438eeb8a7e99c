"""``cbp-optax reproduce <study|all> [--seeds N] [--quick] [--out DIR] [--data-dir DIR]``.

Runs the studies in order, each into ``<out>/<study>/``, and writes
``<out>/summary.md`` / ``summary.json`` with every study's wall time.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pathlib
import sys
import time
from typing import Optional, Sequence

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
}
REAL_DATA = ('mnist', 'resnet', 'gradient-flow', 'normalization',
             'init-scale')
_CONV_FLAG = '--xla_cpu_experimental_ynn_fusion_type=-individual_convolution'


def _prefer_fast_cpu_convolutions() -> None:
  """Adds the XLA:CPU flag of STYLE.md before JAX creates its backend."""
  flags = os.environ.get('XLA_FLAGS', '')
  if 'ynn_fusion_type' not in flags:
    os.environ['XLA_FLAGS'] = (flags + ' ' + _CONV_FLAG).strip()


def parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog='cbp-optax reproduce',
      description='Reproduce the studies of the CBP paper (§5.6, §6).')
  parser.add_argument('study', nargs='+',
                      choices=list(STUDIES) + ['all', 'synthetic'],
                      help="studies, 'all', or 'synthetic' (all but the "
                      'real-data tables)')
  parser.add_argument('--seeds', type=int, default=None,
                      help="seeds per configuration (default: the paper's)")
  parser.add_argument('--quick', action='store_true',
                      help='reduced smoke-test version of each study')
  parser.add_argument('--out', type=pathlib.Path,
                      default=pathlib.Path('reproduction'),
                      help='output folder (default ./reproduction)')
  parser.add_argument('--data', type=pathlib.Path, default=None,
                      help='transformer: a text file or a directory of text '
                      'files (default: the Python standard library)')
  parser.add_argument('--data-dir', type=pathlib.Path, default=None,
                      help='MNIST IDX / CIFAR-10 binary files')
  parser.add_argument('--no-progress', action='store_true')
  return parser.parse_args(argv)


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
    from cbp_optax.reproduce import plotting  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise SystemExit(
        f'cbp-optax reproduce needs matplotlib to write its figures ({e}). '
        "Install the extra: pip install 'cbp-optax[experiments]'") from e
  from cbp_optax.reproduce.context import StudyContext  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top

  rows, summary = [], {}
  for name in selected(args.study):
    module = importlib.import_module(f'cbp_optax.reproduce.{STUDIES[name]}')
    ctx = StudyContext(out=args.out / name, seeds=args.seeds, quick=args.quick,
                       data_dir=args.data_dir, data=args.data,
                       progress=not args.no_progress)
    print(f'== {name}: {module.TITLE}', flush=True)
    start = time.perf_counter()
    result = module.run(ctx)
    seconds = time.perf_counter() - start
    # The machine may be shared: the load average (1, 5, 15 min) at the end
    # of each study says how contended its wall time was.
    load = os.getloadavg()
    print(f'   done in {seconds:.1f} s -> {ctx.out} (load average '
          f'{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f})', flush=True)
    rows.append([name, module.TITLE, f'{seconds:.1f}',
                 ' / '.join(f'{v:.1f}' for v in load)])
    summary[name] = {'seconds': seconds, 'load_average': load,
                     'summary': result.summary}
    # Rewritten after every study, so an interrupted run keeps its times.
    _write_summary(plotting, args, rows, summary, jax)
  return 0


def _write_summary(plotting, args, rows, summary, jax) -> None:
  header = (f'Run: `cbp-optax reproduce {" ".join(args.study)}'
            f'{" --quick" if args.quick else ""}'
            f'{f" --seeds {args.seeds}" if args.seeds else ""}`, jax '
            f'{jax.__version__} on {jax.devices()[0].platform}, '
            f'{os.cpu_count()} CPU(s) visible.')
  plotting.write_markdown(args.out / 'summary.md', 'Reproduction run', [
      header, plotting.markdown_table(
          ['study', 'paper item', 'wall time (s)',
           'load average at the end (1 / 5 / 15 min)'], rows)])
  plotting.write_json(args.out / 'summary.json', summary)


if __name__ == '__main__':
  sys.exit(main())
