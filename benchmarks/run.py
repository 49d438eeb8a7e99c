"""The cbp_optax benchmark suite (issue 5): per-iteration step time, optimizer
cost against its memory-traffic bound, memory, compile time and HLO copies.

Usage::

  python benchmarks/run.py                 # full suite, CPU (~35-40 min, 2 cores)
  python benchmarks/run.py --quick         # smoke run (< 1 min)
  python benchmarks/run.py --device gpu    # the same on a GPU (see gpu.sh)
  python benchmarks/run.py --sections steps,optimizer --archs MLP-1024
  python benchmarks/run.py --sections peer --archs ResNet-8  # ours vs torch, paired
  python benchmarks/run.py --sections mnist --data-dir DIR  # or $CBP_OPTAX_MNIST
  python benchmarks/run.py --sections steps --archs Transformer --api nnx \
      --batches 32                         # scanned LM, also / AdamW
  python benchmarks/run.py --sections user  # the user's path / AdamW, and
      # the update's compile time (issue 32); rewrites its BENCHMARKS.md part
  python benchmarks/run.py --sections traffic  # bytes those steps move, from
      # their compiled HLO (no timing); rewrites its BENCHMARKS.md part

Writes ``results.json`` and ``results.md`` to ``--out`` (default
``results/benchmarks``) and prints the markdown. XLA flags the suite sets are
printed in the header; none changes the results beyond float rounding (the
ynn convolution flag: same results to ~1e-7) or at all (region analysis,
checked bitwise).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from typing import Any, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

# XLA on CPU sends weight-gradient convolutions to a slow library fusion by
# default (~2.4x slower ResNet-8 steps); this flag keeps them on the
# individual-convolution path. Same results to ~1e-7, not bitwise.
YNN_CONV_FLAG = '--xla_cpu_experimental_ynn_fusion_type=-individual_convolution'
SECTIONS = ('steps', 'user', 'traffic', 'optimizer', 'rss', 'torch', 'peer',
            'mnist')
QUICK_SECTIONS = ('steps', 'user', 'optimizer')
FULL_ROUNDS, SLOW_ROUNDS, FULL_WARMUP = 60, 20, 5
QUICK_ROUNDS, QUICK_WARMUP = 5, 1


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--quick', action='store_true',
                      help='smoke run: small shapes, few rounds (< 1 min)')
  parser.add_argument('--device', choices=('cpu', 'gpu'), default='cpu')
  parser.add_argument('--out', default=os.path.join(REPO, 'results',
                                                    'benchmarks'))
  parser.add_argument('--api', choices=('linen', 'nnx', 'both'),
                      default='linen',
                      help='Flax API of the timed steps (both: NNX at the '
                      'first batch size only)')
  parser.add_argument('--sections', default=None,
                      help=f'comma list from {SECTIONS} (default: all; '
                      f'quick: {",".join(QUICK_SECTIONS)})')
  parser.add_argument('--archs', default=None,
                      help='comma list, e.g. MLP-256,ResNet-8')
  parser.add_argument('--batches', default=None, help='e.g. 128,256')
  parser.add_argument('--rounds', type=int, default=None,
                      help='timed rounds (default 60, 20 for steps > 0.5 s)')
  parser.add_argument('--data-dir', default=None,
                      help='MNIST IDX files for the mnist section (default: '
                      '$CBP_OPTAX_MNIST, else ~/.cache/cbp_optax/mnist); '
                      'the section is skipped, saying so, without them')
  parser.add_argument('--no-ynn-flag', action='store_true',
                      help='leave the XLA CPU convolution fusion default')
  user = parser.add_argument_group(
      "user section (issue 32): the user's path against their AdamW step")
  user.add_argument('--user-archs', default=None,
                    help='comma list (default MLP-2x128,MLP-2x512,MLP-2x1024,'
                    'MLP-2x2048,MLP-2x4096,CNN,Transformer; also MLP-1024, '
                    'CNN-8, ResNet-8)')
  user.add_argument('--user-apis', default=None,
                    help='comma list from nnx,linen (default both)')
  user.add_argument('--user-rounds', type=int, default=None,
                    help='interleaved rounds (default 9, quick 3)')
  user.add_argument('--window', type=float, default=None,
                    help='seconds of steps per row and round (default 0.4)')
  user.add_argument('--compile-leaves', default=None,
                    help='leaf counts of the compile-time trees (default '
                    '50,200,2000; add 10000 by hand: minutes; empty: skip)')
  user.add_argument('--compile-rounds', type=int, default=None,
                    help='rounds per leaf count (default 5 up to 500 leaves, '
                    '3 up to 5,000, else 1; quick 1)')
  user.add_argument('--benchmarks-md', default=None,
                    help='file whose user-path (and traffic) section is '
                    'rewritten (default '
                    'BENCHMARKS.md at the repository root; quick runs write '
                    'none unless given)')
  user.add_argument('--no-benchmarks-md', action='store_true',
                    help='write no BENCHMARKS.md section')
  parser.add_argument('--rss-child', nargs=4, default=None,
                      metavar=('API', 'ARCH', 'VARIANT', 'BATCH'),
                      help=argparse.SUPPRESS)
  return parser.parse_args(argv)


def log(message: str) -> None:
  stamp = datetime.datetime.now(datetime.timezone.utc).strftime('%H:%M:%S')
  print(f'[{stamp}] {message}', flush=True)


def configure_environment(args: argparse.Namespace) -> str:
  """Sets platform and XLA flags; must run before jax is imported."""
  if args.device == 'gpu':
    os.environ.setdefault('JAX_PLATFORMS', 'cuda')
  else:
    os.environ['JAX_PLATFORMS'] = 'cpu'
  flags = os.environ.get('XLA_FLAGS', '')
  if args.device == 'cpu' and not args.no_ynn_flag and 'ynn' not in flags:
    flags = (flags + ' ' + YNN_CONV_FLAG).strip()
  os.environ['XLA_FLAGS'] = flags
  return flags


def cpu_model() -> str:
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if line.startswith('model name'):
          return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or 'unknown'


def library_revision() -> dict[str, Any]:
  """The commit measured, and library files that differ from it."""
  def git(*cmd: str) -> str:
    try:
      return subprocess.run(['git', *cmd], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
      return ''
  dirty = git('status', '--short', '--', 'cbp_optax')
  return {'commit': git('rev-parse', '--short', 'HEAD') or 'unknown',
          'library_uncommitted': dirty.splitlines()}


def environment(args: argparse.Namespace, flags: str) -> dict[str, Any]:
  import flax
  import jax
  import jaxlib
  import optax
  return {
      'date': datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec='seconds'),
      'machine': f'{os.cpu_count()} cores, {cpu_model()}, '
                 f'{platform.platform()}',
      'jax': jax.__version__, 'jaxlib': jaxlib.__version__,
      'flax': flax.__version__, 'optax': optax.__version__,
      'backend': jax.default_backend(),
      'devices': [str(d) for d in jax.devices()],
      'xla_flags': flags,
      'mode': 'quick' if args.quick else 'full',
      'load_average_at_start': os.getloadavg(),
      'revision': library_revision(),
  }


# ------------------------------------------------------------------ steps


def time_group(api: str, arch, batch: int, variants, rounds: int,
               warmup: int) -> dict[str, Any]:
  """Compiles, warms up and times every variant of one architecture."""
  import gc

  from benchmarks import hlo_copies, models, steps as steps_lib, timing
  load_at_start = os.getloadavg()
  runners = {v.name: steps_lib.make_runner(api, arch, v, batch)
             for v in variants}
  warm = timing.warm_up({n: r.step for n, r in runners.items()}, warmup)
  slow_rounds = min(rounds, SLOW_ROUNDS)
  n_rounds, reduced = timing.rounds_for(warm, rounds, slow_rounds)
  times = timing.interleaved({n: r.step for n, r in runners.items()},
                             n_rounds)
  ratios = timing.pairwise_ratios(times, 'Adam')
  ratios_adamw = timing.pairwise_ratios(times, 'AdamW')
  params = next(iter(runners.values())).params
  n_params = models.count_params(params)
  kernels = models.kernel_shapes(params)
  n_layers = models.layer_count(params)
  out = {'arch': arch.name, 'api': api, 'batch': batch, 'params': n_params,
         'layers': n_layers, 'rounds': n_rounds, 'reduced_rounds': reduced,
         'warmup_medians_s': warm, 'variants': {},
         'load_average': {'start': load_at_start, 'end': os.getloadavg()}}
  for name, runner in runners.items():
    found = hlo_copies.copies(runner.hlo)
    per_step = sum(hlo_copies.count_by_shape(found, kernels).values())
    on_skip = sum(hlo_copies.count_by_shape(
        found, kernels, (hlo_copies.SKIP,)).values())
    is_cbp = 'CBP' in name
    out['variants'][name] = {
        'time': timing.quartiles(times[name]),
        'ratio_to_adam': ratios.get(name),
        'ratio_to_adamw': ratios_adamw.get(name),
        'compile_s': runner.compile_s,
        'opt_state_bytes': runner.opt_state_bytes,
        'expected_cbp_state_bytes': (4 * (2 * n_params + n_layers)
                                     if is_cbp else None),
        'centering_bytes': runner.centering_bytes,
        'xla_memory': runner.memory,
        'param_copies_per_step': per_step,
        'param_copies_skip': on_skip,
        'copies': hlo_copies.summary(found, min_elements=1024),
    }
  del runners
  gc.collect()
  return out


def region_analysis_identical() -> bool:
  """CBP steps with and without region analysis give bitwise equal states."""
  import jax
  import numpy as np

  from benchmarks import models, steps as steps_lib
  arch = models.mlp(64)
  finals = []
  for variant in (steps_lib.CBP_FULL, steps_lib.CBP_FULL_NO_RA):
    runner = steps_lib.linen_runner(arch, variant, 32)
    for _ in range(3):
      runner.step()
    finals.append(jax.tree.leaves(runner.read_state()))
  return all(np.array_equal(np.asarray(a), np.asarray(b))
             for a, b in zip(*finals))


def run_steps(args, archs, batch: int, rounds: int, warmup: int,
              apis: Sequence[str], results: dict, save) -> None:
  """Times every architecture at ``batch``; saves after each group."""
  from benchmarks import steps as steps_lib
  for api in apis:
    for arch in archs:
      variants = steps_lib.variants_for(arch=arch)
      if args.device != 'cpu':
        variants = [v for v in variants if not v.compiler_options]
      log(f'steps: {api} {arch.name} batch {batch}')
      group = time_group(api, arch, batch, variants, rounds, warmup)
      results.setdefault('steps', []).append(group)
      for name, v in group['variants'].items():
        if v.get('ratio_to_adamw'):
          log(f'  {arch.name} {name}: {1e3 * v["time"]["median"]:.1f} ms, '
              f'/ AdamW {v["ratio_to_adamw"]["median"]:.3f}, compile '
              f'{v["compile_s"]:.1f} s (/ AdamW '
              f'{v["compile_s"] / group["variants"]["AdamW"]["compile_s"]:.2f})'
              f', parameter copies per step {v["param_copies_per_step"]}')
      save(results)


# -------------------------------------------------------------- optimizer


def run_optimizer(archs, rounds, warmup, quick,
                  device: str) -> tuple[list[dict], dict]:
  from benchmarks import optimizer_only
  bandwidth = optimizer_only.copy_bandwidth(
      repeats=5 if quick else 20,
      nbytes=(32 if quick else 256) * 2**20)
  results = []
  for arch in archs:
    log(f'optimizer only: {arch.name}')
    results.append(optimizer_only.run(arch, rounds, warmup, bandwidth,
                                      region_analysis=device == 'cpu'))
  return results, bandwidth


# -------------------------------------------------------------------- rss


def rss_child(api: str, arch_name: str, variant_name: str, batch: int) -> None:
  """In a fresh process: build, compile, run 5 steps, print peak RSS."""
  import resource

  from benchmarks import models, steps as steps_lib
  arch = {a.name: a for a in models.ALL_ARCHS + (models.mlp(64),)}[arch_name]
  if variant_name != 'none':
    variant = {v.name: v for v in steps_lib.VARIANTS}[variant_name]
    runner = steps_lib.make_runner(api, arch, variant, batch)
    for _ in range(5):
      runner.step()
  else:
    models.make_batch(arch, batch)
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  print(json.dumps({'peak_rss_bytes': peak}))


def run_rss(args, archs, batch: int) -> dict:
  from benchmarks import steps as steps_lib

  def child(arch_name: str, variant_name: str) -> int:
    cmd = [sys.executable, os.path.abspath(__file__), '--device', args.device,
           '--rss-child', 'linen', arch_name, variant_name, str(batch)]
    if args.no_ynn_flag:
      cmd.append('--no-ynn-flag')
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])['peak_rss_bytes']

  baseline = child(archs[0].name, 'none')
  rows = []
  for arch in archs:
    for variant in steps_lib.VARIANTS:
      if variant.compiler_options and args.device != 'cpu':
        continue
      log(f'peak RSS: {arch.name} {variant.name}')
      rows.append({'arch': arch.name, 'api': 'linen', 'batch': batch,
                   'variant': variant.name,
                   'peak_rss_bytes': child(arch.name, variant.name)})
  return {'baseline_bytes': baseline, 'rows': rows}


# ------------------------------------------------------------------ torch


def _import_torch_peer(section: str):
  """``(torch_peer, None)``, or ``(None, {'skipped': why})`` without torch."""
  try:
    from benchmarks import torch_peer
  except ImportError as error:
    return None, {'skipped': f'{section} skipped: {error}.'}
  if torch_peer.torch is None:
    return None, {'skipped': f'{section} skipped: torch is not installed '
                             '(pip install torch==2.13.0 for the CPU wheel).'}
  return torch_peer, None


def run_torch(archs, batch: int, rounds: int, warmup: int) -> dict:
  torch_peer, skipped = _import_torch_peer('PyTorch peer')
  if skipped:
    return skipped
  return torch_peer.run(archs, batch, rounds, warmup)


def run_peer(archs, batch: int, rounds: int, warmup: int) -> dict:
  """Ours and the PyTorch peer interleaved round by round, in one process.

  The torch section times the peer after ours, minutes apart; on a shared
  machine that compares two different loads. Here every round runs our Adam
  and full CBP steps and PyTorch's Adam and CBP steps once each (rotating
  order), so "ours / PyTorch Adam" is a per-round ratio like the others.
  """
  torch_peer, skipped = _import_torch_peer('Paired peer')
  if skipped:
    return skipped
  import gc

  from benchmarks import steps as steps_lib, timing
  torch_peer.torch.set_num_threads(torch_peer.THREADS)
  groups = []
  for arch in archs:
    log(f'paired with PyTorch: {arch.name} batch {batch}')
    load_at_start = os.getloadavg()
    steps = {}
    for variant in (steps_lib.ADAM, steps_lib.CBP_FULL):
      steps[f'ours {variant.name}'] = steps_lib.make_runner(
          'linen', arch, variant, batch).step
    for variant in ('Adam', 'CBP'):
      steps[f'torch {variant}'] = torch_peer._make_step(arch, variant, batch)
    warm = timing.warm_up(steps, warmup)
    n_rounds, reduced = timing.rounds_for(warm, rounds,
                                          min(rounds, SLOW_ROUNDS))
    times = timing.interleaved(steps, n_rounds)
    ratios = timing.pairwise_ratios(times, 'torch Adam')
    groups.append({
        'arch': arch.name, 'batch': batch, 'rounds': n_rounds,
        'reduced_rounds': reduced,
        'load_average': {'start': load_at_start, 'end': os.getloadavg()},
        'variants': {name: {'time': timing.quartiles(times[name]),
                            'ratio_to_torch_adam': ratios[name]}
                     for name in steps}})
    del steps
    gc.collect()
  return {'torch_version': torch_peer.torch.__version__,
          'threads': torch_peer.THREADS, 'groups': groups}


# ------------------------------------------------------------------- main


def select_archs(args):
  from benchmarks import models, user_path
  if args.quick:
    default = [models.mlp(256)]
  else:
    default = list(models.ALL_ARCHS)
  if not args.archs:
    return default
  return user_path.select_archs(args.archs)


def benchmarks_md_path(args) -> Optional[str]:
  """Where the user section writes its BENCHMARKS.md part, or None."""
  if args.no_benchmarks_md:
    return None
  if args.benchmarks_md:
    return args.benchmarks_md
  return None if args.quick else os.path.join(REPO, 'BENCHMARKS.md')


def command_line(argv: Optional[Sequence[str]]) -> str:
  words = list(sys.argv[1:] if argv is None else argv)
  return ' '.join(['python benchmarks/run.py'] + words)


def run_user(args, argv, results: dict, save) -> None:
  """The user-path section; rewrites its part of BENCHMARKS.md at the end."""
  from benchmarks import user_path

  def save_user(user: dict) -> None:
    results['user'] = user
    save(results)

  results['user'] = user_path.run(args, log=log, save=save_user)
  path = benchmarks_md_path(args)
  if path:
    section = user_path.render(results['user'], results['environment'],
                               command_line(argv))
    user_path.write_section(path, section)
    log(f'wrote the user-path section of {path}')


def run_traffic(args, argv, results: dict, save) -> None:
  """Bytes the user-path rows move (``--user-archs``, ``--user-apis``);
  rewrites its part of BENCHMARKS.md."""
  from benchmarks import step_traffic, user_path

  archs = (user_path.select_archs(args.user_archs) if args.user_archs
           else user_path.default_archs(bool(args.quick)))
  apis = (args.user_apis.split(',') if args.user_apis
          else list(user_path.APIS))
  results['traffic'] = step_traffic.run(archs, apis, bool(args.quick),
                                        log=log)
  save(results)
  path = benchmarks_md_path(args)
  if path:
    section = step_traffic.render(results['traffic'], results['environment'],
                                  command_line(argv))
    user_path.write_section(path, section, step_traffic.BEGIN,
                            step_traffic.END)
    log(f'wrote the step-traffic section of {path}')


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = parse_args(argv)
  flags = configure_environment(args)
  if args.rss_child:
    api, arch, variant, batch = args.rss_child
    rss_child(api, arch, variant, int(batch))
    return 0
  from benchmarks import report, steps as steps_lib

  sections = (args.sections.split(',') if args.sections
              else list(QUICK_SECTIONS if args.quick else SECTIONS))
  unknown = sorted(set(sections) - set(SECTIONS))
  if unknown:
    raise SystemExit(f'Unknown sections {unknown}; choose from {SECTIONS}.')
  archs = select_archs(args)
  batches = ([int(b) for b in args.batches.split(',')] if args.batches
             else ([32] if args.quick else [128, 256]))
  rounds = args.rounds or (QUICK_ROUNDS if args.quick else FULL_ROUNDS)
  warmup = QUICK_WARMUP if args.quick else FULL_WARMUP
  results: dict[str, Any] = {'environment': environment(args, flags),
                             'step_variants': [v.name for v in
                                               steps_lib.VARIANTS]}
  os.makedirs(args.out, exist_ok=True)

  def save(results: dict) -> str:
    """Writes what is measured so far: a long run interrupted keeps it."""
    markdown = report.render(results)
    with open(os.path.join(args.out, 'results.json'), 'w') as f:
      json.dump(results, f, indent=1, default=str)
    with open(os.path.join(args.out, 'results.md'), 'w') as f:
      f.write(markdown + '\n')
    return markdown

  # The paper's protocol (first batch size) first, the optimizer-only and
  # PyTorch comparisons next, other batch sizes last.
  apis = ['linen', 'nnx'] if args.api == 'both' else [args.api]
  if 'steps' in sections:
    run_steps(args, archs, batches[0], rounds, warmup, apis, results, save)
    if args.device == 'cpu' and not args.quick:
      results['region_analysis_bitwise_identical'] = (
          region_analysis_identical())
  if 'user' in sections:
    run_user(args, argv, results, save)
  if 'traffic' in sections:
    run_traffic(args, argv, results, save)
  if 'optimizer' in sections:
    opt_archs = archs[:1] if args.quick else archs
    results['optimizer'], results['bandwidth'] = run_optimizer(
        opt_archs, rounds, warmup, args.quick, args.device)
    save(results)
  if 'torch' in sections:
    log('PyTorch peer')
    if args.device == 'cpu':
      results['torch'] = run_torch(archs, batches[0], rounds, warmup)
    else:
      results['torch'] = {'skipped': 'PyTorch peer skipped: it is the '
                                     "paper's CPU protocol (2 threads)."}
    save(results)
  if 'peer' in sections:
    log('ours and PyTorch, interleaved')
    if args.device == 'cpu':
      results['peer'] = run_peer(archs, batches[0], rounds, warmup)
    else:
      results['peer'] = {'skipped': 'Paired peer skipped: CPU protocol.'}
    save(results)
  if 'mnist' in sections:
    log('MNIST wall-clock to the threshold')
    from benchmarks import mnist
    results['mnist'] = mnist.run(args.data_dir, quick=args.quick,
                                 log=lambda message: log(message))
    if 'skipped' in results['mnist']:
      log(results['mnist']['skipped'])
    save(results)
  if 'steps' in sections:
    # NNX (with --api both) only at the paper's batch size.
    for batch in batches[1:]:
      run_steps(args, archs, batch, rounds, warmup, ['linen'], results, save)
  if 'rss' in sections:
    results['rss'] = run_rss(args, archs, batches[0])
  results['environment']['load_average_at_end'] = os.getloadavg()
  results['environment']['finished'] = datetime.datetime.now(
      datetime.timezone.utc).isoformat(timespec='seconds')
  markdown = save(results)
  print(markdown)
  print(f'\nWrote {args.out}/results.json and results.md')
  return 0


if __name__ == '__main__':
  sys.exit(main())
