"""``cbp-optax``: the command-line entry point.

``cbp-optax compare`` trains the paper's MNIST MLP (§6.6: 4 hidden layers of
width 256, batch 256) with optax.adam, Adam + Center, full CBP and the
recommended recipe (``cbp.recommended``, schedule-free CBP M3, on the
centered model) side by side, prints a comparison table and the
recommendation (``--out DIR`` also writes results.md,
results.json and a loss-curve PNG). ``cbp-optax reproduce`` runs the paper's
studies (``cbp_optax_experiments.reproduce``). ``cbp-optax workloads`` races
optimizer arms to fixed targets on small workloads and scores them with
AlgoPerf's performance profile (``cbp_optax_experiments.workloads``). ``cbp-optax --version``; every
command has ``--help`` listing each flag with its default.

``compare`` needs only numpy and JAX; its ``--out`` figure and ``reproduce``
need the ``experiments`` extra (matplotlib, scipy, tqdm). When one of those is
missing, the command exits with a one-line message naming the extra instead
of a traceback.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import pathlib
import sys
import textwrap
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import cbp_optax as cbp
from cbp_optax_experiments import datasets
from cbp_optax_experiments import outputs
from cbp_optax import nnx as cbp_nnx


class MLP(nnx.Module):
  """784 -> width x depth (ReLU) -> 10, every Dense optionally centered."""

  def __init__(self, *, width: int, depth: int, centered: bool,
               rngs: nnx.Rngs):
    wrap = cbp_nnx.Centered if centered else (lambda layer: layer)
    sizes = [784] + [width] * depth + [10]
    self.layers = nnx.List([
        wrap(nnx.Linear(a, b, rngs=rngs)) for a, b in zip(sizes, sizes[1:])
    ])

  def __call__(self, x):
    x = jnp.reshape(x, (x.shape[0], -1))
    for layer in self.layers[:-1]:
      x = nnx.relu(layer(x))
    return self.layers[-1](x)


def _loss_fn(model, images, labels):
  logits = model(images)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  return loss, {'accuracy': jnp.mean(jnp.argmax(logits, -1) == labels)}


@nnx.jit
def _accuracy(model, images, labels):
  return jnp.mean(jnp.argmax(model(images), -1) == labels)


def _evaluate(model, images, labels, batch=2000):
  model.eval()
  correct = 0.0
  for start in range(0, len(labels), batch):
    chunk = slice(start, start + batch)
    correct += float(_accuracy(model, images[chunk], labels[chunk])) * len(
        labels[chunk])
  model.train()
  return correct / len(labels)


# The answer every page gives (summary.answer on the committed results;
# test_recommendation.py keeps them equal).
RECOMMENDATION = (
    'Use schedule-free AdamW (optax.contrib.schedule_free_adamw) on the '
    'centered model. Version 2 of the decision rule, written before it read'
    ' any any-time score, chooses it on the dev split: any-time score 0.513'
    ' [0.492, 0.535] (95% interval, 10 paired seeds). On the test split, '
    'which only reports, it scores 0.469 [0.450, 0.487]; there, paired over'
    ' seeds and workloads, it is significantly better than NAdamW centered '
    '(0.421 [0.400, 0.443], mean paired difference +0.048), NAdamW (0.407 '
    '[0.390, 0.425], mean paired difference +0.062), cbp.cbp_robust (0.400 '
    '[0.383, 0.418], mean paired difference +0.068), AdamW centered (0.397 '
    '[0.379, 0.417], mean paired difference +0.071), cbp.cbp (0.368 [0.349,'
    ' 0.387], mean paired difference +0.101), AdamW (0.352 [0.334, 0.369], '
    'mean paired difference +0.117) and SGD with Nesterov momentum (0.280 '
    '[0.271, 0.289], mean paired difference +0.189), and no different from '
    'the rest.')


RECOMMENDED = 'Recommended (cbp.recommended + Center)'


def _methods(lr_adam: float, lr_cbp: float, steps: int):
  return {
      'Adam': (False, lambda: optax.adam(lr_adam)),
      'Adam + Center': (True, lambda: optax.adam(lr_adam)),
      'CBP (M1+M2+M3)': (True, lambda: cbp.cbp(lr_cbp)),
      # The recommended recipe at Adam's rate, warmed up over the first 10%
      # of the steps as in the workload suite; evaluated at schedule-free's
      # evaluation point.
      RECOMMENDED: (True, lambda: cbp.recommended(
          lr_adam, warmup_steps=max(1, steps // 10))),
  }


_EMA = 0.9  # smoothing of the reported training loss


def _integer(minimum: int, why: str = ''):
  """An argparse ``type``: an integer at least ``minimum``."""
  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      value = minimum - 1
    if value < minimum:
      raise argparse.ArgumentTypeError(
          f'expected an integer >= {minimum}{why}, got {text!r}')
    return value
  return parse


def _learning_rate(text: str) -> float:
  """An argparse ``type``: a finite number > 0."""
  try:
    value = float(text)
  except ValueError:
    value = math.nan
  if not (math.isfinite(value) and value > 0):
    raise argparse.ArgumentTypeError(
        f'expected a finite learning rate > 0, got {text!r}')
  return value


def compare_parser() -> argparse.ArgumentParser:
  """The ``cbp-optax compare`` argument parser (every flag with its default)."""
  parser = argparse.ArgumentParser(
      prog='cbp-optax compare',
      formatter_class=argparse.ArgumentDefaultsHelpFormatter,
      description='Train the paper\'s MNIST MLP (§6.6) with Adam, Adam + '
      'Center and CBP from the same initialization on the same batches, and '
      'print final training loss, test accuracy and time per step.')
  parser.add_argument(
      '--data-dir', type=pathlib.Path, default=None,
      help='directory with the MNIST IDX files; if not given: '
      '$CBP_OPTAX_MNIST, then ~/.cache/cbp_optax/mnist (downloading there '
      'unless --no-download), then the small MNIST subset bundled with the '
      'package')
  parser.add_argument('--no-download', action='store_true',
                      help='never download MNIST')
  parser.add_argument(
      '--steps', type=_integer(2, ' (the first step compiles and is not '
                               'timed)'), default=300,
      help='training steps per method')
  parser.add_argument('--batch-size', type=_integer(1), default=256,
                      help='images per step (sampled with replacement)')
  parser.add_argument('--width', type=_integer(1), default=256,
                      help='units per hidden layer')
  parser.add_argument('--depth', type=_integer(0), default=4,
                      help='number of hidden layers (0: a linear model)')
  parser.add_argument('--lr-adam', type=_learning_rate, default=1e-3,
                      help='learning rate of Adam and Adam + Center')
  parser.add_argument('--lr-cbp', type=_learning_rate, default=3e-3,
                      help='learning rate of CBP')
  parser.add_argument('--seed', type=_integer(0), default=0,
                      help='seed of the initialization and the batches')
  parser.add_argument(
      '--out', type=pathlib.Path, default=None,
      help='also write results.md, results.json (per-step losses) and '
      'loss_curves.png into this directory (the PNG needs matplotlib: pip '
      "install ./experiments); a directory holding another command's "
      'results is refused')
  return parser


def _require_matplotlib():
  """pyplot, or a SystemExit that names the extra to install."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise SystemExit(
        f'cbp-optax compare --out needs matplotlib for loss_curves.png ({e}). '
        'Install the experiments with their dependencies: '
        'pip install ./experiments') from e
  return plt


def _quartiles(values) -> list[float]:
  """25th, 50th and 75th percentiles (NaN for no values)."""
  if not len(values):
    return [float('nan')] * 3
  return [float(q) for q in np.percentile(values, [25, 50, 75])]


def _table(rows) -> list[str]:
  width = max([len('method')] + [len(row['method']) for row in rows])
  lines = [f'| {"method":<{width}} | {"train loss (EMA)":>16} | '
           f'{"test accuracy":>13} | {"ms / step":>9} | '
           f'{"/ Adam, median [IQR]":>20} |',
           f'|{"-" * (width + 2)}|{"-" * 17}:|{"-" * 14}:|{"-" * 10}:|'
           f'{"-" * 21}:|']
  for row in rows:
    low, mid, high = row['ratio_to_adam_quartiles']
    ratio = f'{mid:.2f} [{low:.2f}, {high:.2f}]'
    lines.append(f'| {row["method"]:<{width}} | '
                 f'{row["train_loss_ema"]:>16.4f} | '
                 f'{row["test_accuracy"]:>13.4f} | {row["ms_per_step"]:>9.2f} '
                 f'| {ratio:>20} |')
  return lines


def _write_results(out: pathlib.Path, plt, header: list[str], config: dict,
                   rows: list[dict]) -> None:
  """results.md, results.json and loss_curves.png in ``out``."""
  out.mkdir(parents=True, exist_ok=True)
  (out / 'results.md').write_text(
      '# cbp-optax compare\n\n' + '\n'.join(f'{line}  ' for line in header)
      + '\n\n' + '\n'.join(_table(rows)) + '\n\n'
      f'Train loss (EMA): exponential moving average (weight {1 - _EMA:g} on '
      'the newest step) of the minibatch loss at the last step. Per-step '
      'losses: results.json; curves: loss_curves.png.\n')
  (out / 'results.json').write_text(json.dumps(
      {'config': config, 'methods': rows}, indent=1) + '\n')
  figure, axis = plt.subplots(figsize=(7, 4.5))
  for row in rows:
    line, = axis.plot(row['train_loss'], alpha=0.3, linewidth=0.8)
    axis.plot(row['train_loss_ema_curve'], color=line.get_color(),
              label=f'{row["method"]} (test acc. {row["test_accuracy"]:.3f})')
  axis.set_xlabel('step')
  axis.set_ylabel('training loss (minibatch; bold: EMA)')
  axis.set_yscale('log')
  axis.set_title(f'MNIST MLP 784 -> {config["width"]} x {config["depth"]} '
                 f'-> 10, batch {config["batch_size"]}', fontsize=10)
  axis.legend()
  axis.grid(alpha=0.3)
  figure.tight_layout()
  figure.savefig(out / 'loss_curves.png', dpi=120)
  plt.close(figure)


def compare(argv: Optional[Sequence[str]] = None) -> int:
  """``cbp-optax compare``: Adam, Adam + Center, CBP and the recommended
  recipe on the MNIST MLP, then the recommendation.

  Args:
    argv: the command's arguments (see ``cbp-optax compare --help``).

  Returns:
    The exit status, 0. A bad argument exits with status 2 before any
    data is read; MNIST not found in ``--data-dir`` exits with status 1 and
    one line saying why.
  """
  parser = compare_parser()
  args = parser.parse_args(argv)
  try:
    if args.out is not None:
      outputs.check_out_dir(args.out)
      outputs.check_results_owner(args.out, outputs.COMPARE)
    if args.data_dir is not None and args.data_dir.exists() and (
        not args.data_dir.is_dir()):
      raise ValueError(f'--data-dir {args.data_dir}: a file, not a folder')
  except ValueError as e:
    parser.error(str(e))
  plt = _require_matplotlib() if args.out is not None else None
  try:
    data = datasets.find_mnist(args.data_dir, download=not args.no_download,
                               bundled=True)
  except datasets.DataError as e:
    raise SystemExit(f'cbp-optax compare: error: {e}') from e
  header = [
      f'data: {data.source}',
      f'model: MLP 784 -> {args.width} x {args.depth} -> 10, batch '
      f'{args.batch_size}, {args.steps} steps, seed {args.seed}, '
      f'jax {jax.__version__} on {jax.devices()[0].platform}',
      f'learning rates: Adam {args.lr_adam:g}, CBP {args.lr_cbp:g} '
      '(--lr-adam / --lr-cbp); ms / step: median over steps, compilation '
      'excluded; / Adam: per-step time ratios, the methods taking turns step '
      'by step',
  ]
  print('\n'.join(header))
  rng = np.random.default_rng(args.seed)
  batches = [rng.integers(0, len(data.train_labels), args.batch_size)
             for _ in range(args.steps)]
  runs = []
  for name, (centered, make_tx) in _methods(args.lr_adam, args.lr_cbp,
                                            args.steps).items():
    model = MLP(width=args.width, depth=args.depth, centered=centered,
                rngs=nnx.Rngs(args.seed))
    optimizer = nnx.Optimizer(model, make_tx(), wrt=nnx.Param)
    runs.append((name, model, optimizer, cbp_nnx.train_step(_loss_fn), [],
                 []))
  # The methods take turns, step by step, so that each step of one is timed
  # beside the same step of the others: on a shared machine the load changes
  # over seconds, and ratios of steps taken together are what is comparable.
  for i, idx in enumerate(batches):
    images, labels = data.train_images[idx], data.train_labels[idx]
    for _, model, optimizer, step, losses, seconds in runs:
      start = time.perf_counter()
      out = step(model, optimizer, images, labels)
      jax.block_until_ready(out.loss)
      if i:  # step 0 compiles
        seconds.append(time.perf_counter() - start)
      losses.append(out.loss)
  rows = []
  reference = np.asarray(runs[0][5])
  for name, model, optimizer, _, losses, seconds in runs:
    losses = [float(loss) for loss in losses]
    smoothed = []
    for loss in losses:
      smoothed.append(loss if not smoothed else
                      _EMA * smoothed[-1] + (1 - _EMA) * loss)
    ms = 1e3 * np.asarray(seconds)
    ratios = np.asarray(seconds) / reference if len(reference) else ms
    rows.append({
        'method': name,
        'train_loss_ema': smoothed[-1] if smoothed else float('nan'),
        # At schedule-free's evaluation point where there is one.
        'test_accuracy': _evaluate(cbp_nnx.eval_model(model, optimizer),
                                   data.test_images, data.test_labels),
        'ms_per_step': _quartiles(ms)[1],
        'ms_per_step_quartiles': _quartiles(ms),
        'ratio_to_adam_quartiles': _quartiles(ratios),
        'train_loss': losses,
        'train_loss_ema_curve': smoothed,
    })
  print()
  print('\n'.join(_table(rows)))
  print('\nWhich optimizer (the workload suite, README "Which optimizer"):')
  print(textwrap.fill(RECOMMENDATION, 79, break_long_words=False,
                      break_on_hyphens=False))
  if args.out is not None:
    config = {key: (str(value) if isinstance(value, pathlib.Path) else value)
              for key, value in vars(args).items()}
    config.update(data_source=data.source, jax=jax.__version__,
                  platform=jax.devices()[0].platform)
    _write_results(args.out, plt, header, config, rows)
    print(f'\nwrote {args.out / "results.md"}, results.json and '
          'loss_curves.png')
  return 0


def _reproduce(argv: Optional[Sequence[str]] = None) -> int:
  # Imported on use: the experiments are not needed by `compare`.
  from cbp_optax_experiments.reproduce import cli as reproduce_cli  # pylint: disable=g-import-not-at-top
  return reproduce_cli.main(argv)


def _workloads(argv: Optional[Sequence[str]] = None) -> int:
  from cbp_optax_experiments.workloads import cli as workloads_cli  # pylint: disable=g-import-not-at-top
  return workloads_cli.main(argv)


# The top-level modules of the `experiments` extra (pyproject.toml).
EXTRA_MODULES = ('matplotlib', 'scipy', 'tqdm')

# Command -> (entry point taking the command's own arguments, one-line help).
_COMMANDS: dict[str, tuple[Callable[[Optional[Sequence[str]]], int], str]] = {
    'compare': (compare, 'Adam, Adam + Center, CBP and the recommended recipe '
                '(cbp.recommended + Center) on the MNIST MLP (§6.6); see '
                'cbp-optax compare --help'),
    'reproduce': (_reproduce, "the paper's studies: reproduce <study|all> "
                  '[--quick] [--download]; see cbp-optax reproduce --help'),
    'workloads': (_workloads, 'time to target of AdamW, NAdamW, Muon, '
                  'schedule-free AdamW, CBP and your own arms on fixed '
                  'workloads (AlgoPerf-style); see cbp-optax workloads '
                  '--help'),
}


def _version() -> str:
  try:
    return importlib.metadata.version('cbp-optax')
  except importlib.metadata.PackageNotFoundError:  # a source tree, not installed
    return getattr(cbp, '__version__', 'unknown')


def parser() -> argparse.ArgumentParser:
  """The top-level ``cbp-optax`` parser: ``--version`` and the commands."""
  top = argparse.ArgumentParser(
      prog='cbp-optax',
      formatter_class=argparse.ArgumentDefaultsHelpFormatter,
      description='Conditioned Backpropagation (CBP) for JAX, Optax and Flax: '
      'command-line tools. Each command has its own --help.')
  top.add_argument('--version', action='version',
                   version=f'%(prog)s {_version()}')
  commands = top.add_subparsers(
      dest='command', metavar='{' + ','.join(_COMMANDS) + '}', required=True)
  for name, (_, help_text) in _COMMANDS.items():
    # The command parses its own arguments (and its own --help).
    commands.add_parser(name, help=help_text, add_help=False)
  return top


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Runs ``cbp-optax <command> [options]``; returns the exit status.

  Args:
    argv: the arguments after ``cbp-optax`` (default: ``sys.argv[1:]``).

  Returns:
    The command's exit status. An unknown command, or no command, exits
    with status 2 and a message naming the commands.
  """
  argv = list(sys.argv[1:] if argv is None else argv)
  top = parser()
  args, _ = top.parse_known_args(argv)
  position = argv.index(args.command)
  if position:
    top.error(f'unrecognized arguments before the command: '
              f'{" ".join(argv[:position])}')
  try:
    return _COMMANDS[args.command][0](argv[position + 1:])
  except ImportError as e:
    # A dependency of the experiments extra missing deeper than the commands'
    # own checks: one line naming the extra, not a traceback.
    missing = (e.name or '').partition('.')[0]
    if missing not in EXTRA_MODULES:
      raise
    raise SystemExit(
        f'cbp-optax {args.command} needs {missing}, which is not installed '
        f'({e}). Install the experiments with their dependencies: '
        'pip install ./experiments'
    ) from e


if __name__ == '__main__':
  sys.exit(main())
