"""Markdown tables from the suite's JSON results."""

from __future__ import annotations

from typing import Any, Optional

PAPER_TABLE4 = {  # Architecture: (SGD ms, Adam ms, CBP ms, x Adam), batch 128.
    'MLP-256': (2.2, 3.8, 7.8, 2.1),
    'MLP-1024': (23.2, 36.5, 69.5, 1.9),
    'MLP-4096': (281, 654, 1061, 1.6),
    'ResNet-8': (147, 146, 252, 1.7),
}


def _ms(seconds: Optional[float]) -> str:
  if seconds is None:
    return '-'
  ms = 1e3 * seconds
  return f'{ms:.3g}' if ms < 100 else f'{ms:.0f}'


def _time(stats: Optional[dict]) -> str:
  if not stats:
    return '-'
  return f"{_ms(stats['median'])} ({_ms(stats['iqr'])})"


def _ratio(stats: Optional[dict]) -> str:
  if not stats:
    return '-'
  return f"{stats['median']:.2f} [{stats['q1']:.2f}-{stats['q3']:.2f}]"


def _mb(nbytes: Optional[float]) -> str:
  return '-' if nbytes is None else f'{nbytes / 2**20:.2f}'


def step_table(groups: list[dict], variants: list[str]) -> str:
  """Table-4-style: median ms (IQR) per variant, CBP / Adam pairwise.

  ``load`` is the 1-minute load average before and after the group: the
  suite alone drives it toward 2 on 2 cores; clearly above, another process
  shared the machine.
  """
  head = ['Arch', 'API', 'batch', 'params', 'rounds', 'load'] + [
      f'{v} ms' for v in variants] + [f'{v} / Adam' for v in variants
                                      if v not in ('Adam',)]
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for g in groups:
    rounds = str(g['rounds']) + (' (step > 0.5 s)' if g['reduced_rounds']
                                 else '')
    load = g.get('load_average')
    load = (f"{load['start'][0]:.1f}-{load['end'][0]:.1f}" if load else '-')
    cells = [g['arch'], g['api'], str(g['batch']),
             f"{g['params'] / 1e6:.2f}M", rounds, load]
    for v in variants:
      cells.append(_time(g['variants'].get(v, {}).get('time')))
    for v in variants:
      if v == 'Adam':
        continue
      cells.append(_ratio(g['variants'].get(v, {}).get('ratio_to_adam')))
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


# Issue 5: full CBP / Adam per step, medians on the 2-core machine.
STEP_TARGETS = {'MLP-256': 1.10, 'MLP-1024': 1.05, 'MLP-4096': 1.05,
                'ResNet-8': 1.05}


def _other_cbp(groups: list[dict]) -> str:
  """The CBP variant compiled with the copy-insertion option flipped."""
  for g in groups:
    if 'CBP (no RA)' in g['variants']:
      return 'CBP (no RA)'
  return 'CBP (RA)'


def summary_table(groups: list[dict]) -> str:
  """Full CBP / Adam against the issue's targets, every arch and batch."""
  other = _other_cbp(groups)
  head = ['Arch', 'API', 'batch', 'target', 'CBP / Adam', 'met',
          f'{other} / Adam', f'met ({other[5:-1]})', 'CBP M1+M3 / Adam',
          'Adam+Center / Adam']
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for g in groups:
    target = STEP_TARGETS.get(g['arch'])
    v = g['variants']

    def met(name):
      stats = v.get(name, {}).get('ratio_to_adam')
      if not stats or target is None:
        return '-'
      return 'yes' if stats['median'] <= target else 'no'

    cells = [g['arch'], g['api'], str(g['batch']),
             '-' if target is None else f'<= {target:.2f}',
             _ratio(v.get('CBP', {}).get('ratio_to_adam')), met('CBP'),
             _ratio(v.get(other, {}).get('ratio_to_adam')),
             met(other),
             _ratio(v.get('CBP M1+M3', {}).get('ratio_to_adam')),
             _ratio(v.get('Adam+Center', {}).get('ratio_to_adam'))]
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def side_by_side(groups: list[dict], torch: Optional[dict]) -> str:
  """Paper's PyTorch ratio, the PyTorch peer here, and ours, batch 128."""
  other = _other_cbp(groups)
  head = ['Arch', 'paper Adam ms', 'paper CBP ms', 'paper x Adam',
          'torch Adam ms', 'torch CBP ms', 'torch x Adam',
          'ours Adam ms', 'ours CBP ms', 'ours x Adam', f'ours {other} ms',
          f'ours {other} x Adam']
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  peer = {r['arch']: r for r in (torch or {}).get('groups', [])}
  for g in groups:
    if g['batch'] != 128 or g['api'] != 'linen':
      continue
    paper = PAPER_TABLE4.get(g['arch'], (None,) * 4)
    t = peer.get(g['arch'], {}).get('variants', {})
    ours = g['variants']
    cells = [g['arch'],
             '-' if paper[1] is None else str(paper[1]),
             '-' if paper[2] is None else str(paper[2]),
             '-' if paper[3] is None else str(paper[3]),
             _time(t.get('Adam', {}).get('time')),
             _time(t.get('CBP', {}).get('time')),
             _ratio(t.get('CBP', {}).get('ratio_to_adam')),
             _time(ours.get('Adam', {}).get('time')),
             _time(ours.get('CBP', {}).get('time')),
             _ratio(ours.get('CBP', {}).get('ratio_to_adam')),
             _time(ours.get(other, {}).get('time')),
             _ratio(ours.get(other, {}).get('ratio_to_adam'))]
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def optimizer_table(results: list[dict], bandwidth: dict) -> str:
  head = ['Arch', 'update', 'ms (IQR)', 'x Adam [IQR]', 'MB moved',
          'bound ms', 'measured / bound', 'bound x Adam',
          'copies >= 1024 elements (per step)']
  lines = [f"Copy bandwidth: {bandwidth['bytes_per_s'] / 1e9:.1f} GB/s "
           f"(in-place stream over {bandwidth['bytes'] / 2 / 2**20:.0f} MiB, "
           'read + write).', '',
           '| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for r in results:
    for name, row in r['rows'].items():
      copies = row['copies'].get('entry', {})
      cells = [r['arch'], name, _time(row['time']),
               _ratio(row['ratio_to_adam']), _mb(row['bytes_moved']),
               _ms(row['bound_s']), f"{row['measured_over_bound']:.2f}",
               f"{row['bound_ratio_to_adam']:.2f}",
               ', '.join(f'{k} x{n}' for k, n in copies.items()) or 'none']
      lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def memory_table(groups: list[dict]) -> str:
  head = ['Arch', 'API', 'batch', 'variant', 'opt state MB',
          '2P+L floats MB', 'counters B', 'centering MB',
          'XLA args+temp MB', 'compile s',
          'param-sized copies (entry+apply / skip)']
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for g in groups:
    for name, v in g['variants'].items():
      mem = v.get('xla_memory') or {}
      footprint = None
      if mem:
        footprint = (mem['argument_size_in_bytes']
                     + mem['temp_size_in_bytes'])
      expected = v.get('expected_cbp_state_bytes')
      counters = (None if expected is None
                  else v['opt_state_bytes'] - expected)
      cells = [g['arch'], g['api'], str(g['batch']), name,
               _mb(v['opt_state_bytes']), _mb(expected),
               '-' if counters is None else str(counters),
               _mb(v['centering_bytes']), _mb(footprint),
               f"{v['compile_s']:.2f}",
               f"{v['param_copies_per_step']} / {v['param_copies_skip']}"]
      lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def rss_table(rss: Optional[dict]) -> str:
  if not rss:
    return 'Not measured in this run (`--sections rss`).'
  head = ['Arch', 'API', 'batch', 'variant', 'peak RSS MB',
          'over the no-model baseline MB']
  lines = [f"Each variant in its own process (build, compile, 5 steps); "
           f"baseline (imports and batch only): "
           f"{_mb(rss['baseline_bytes'])} MB.", '',
           '| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for row in rss['rows']:
    cells = [row['arch'], row['api'], str(row['batch']), row['variant'],
             _mb(row['peak_rss_bytes']),
             _mb(row['peak_rss_bytes'] - rss['baseline_bytes'])]
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def torch_table(torch: Optional[dict]) -> str:
  if not torch or not torch.get('groups'):
    return (torch or {}).get('skipped', 'PyTorch peer not run.')
  names = torch['variants']
  head = ['Arch', 'batch', 'rounds'] + [f'{n} ms' for n in names] + [
      f'{n} / Adam' for n in names if n != 'Adam']
  lines = [f"PyTorch {torch['version']}, {torch['threads']} threads.", '',
           '| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for g in torch['groups']:
    cells = [g['arch'], str(g['batch']), str(g['rounds'])]
    cells += [_time(g['variants'][n]['time']) for n in names]
    cells += [_ratio(g['variants'][n]['ratio_to_adam']) for n in names
              if n != 'Adam']
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def peer_table(peer: Optional[dict]) -> str:
  """Ours and PyTorch interleaved in one process: ratios to PyTorch's Adam."""
  if not peer:
    return 'Not run (`--sections peer`).'
  if 'skipped' in peer:
    return peer['skipped']
  names = ['ours Adam', 'ours CBP', 'torch Adam', 'torch CBP']
  head = (['Arch', 'batch', 'rounds', 'load'] + [f'{n} ms' for n in names]
          + [f'{n} / torch Adam' for n in names if n != 'torch Adam'])
  lines = [f"PyTorch {peer['torch_version']}, {peer['threads']} threads; "
           'every round runs the four steps once (rotating order).', '',
           '| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for g in peer['groups']:
    load = g['load_average']
    cells = [g['arch'], str(g['batch']),
             str(g['rounds']) + (' (step > 0.5 s)' if g['reduced_rounds']
                                 else ''),
             f"{load['start'][0]:.1f}-{load['end'][0]:.1f}"]
    cells += [_time(g['variants'][n]['time']) for n in names]
    cells += [_ratio(g['variants'][n]['ratio_to_torch_adam']) for n in names
              if n != 'torch Adam']
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def mnist_table(mnist: Optional[dict]) -> str:
  """Wall clock to the smoothed-loss threshold, each method at its rate."""
  if not mnist:
    return 'Not run (`--sections mnist`).'
  if 'skipped' in mnist:
    return mnist['skipped']
  lines = [
      f"Data: {mnist['source']}. MLP 784 -> {mnist['width']} x 4 -> 10, "
      f"batch {mnist['batch']}, time until the smoothed training loss "
      f"(debiased EMA 0.9 of the minibatch loss) < {mnist['threshold']}; "
      f"rate per method from {mnist['grid']} (fewest median iterations "
      'among the rates where every seed gets there), seconds = median over '
      f"seeds of {mnist.get('timing_repeats', 1)} interleaved timed runs, "
      f"seeds {mnist['seeds']}, at most {mnist['max_steps']} steps; "
      f"load {mnist['load_average']['start'][0]:.1f}-"
      f"{mnist['load_average']['end'][0]:.1f}.", '',
      '| method | lr | iterations (median) | seconds (median) | ms / step |',
      '|---|---|---|---|---|']
  for method, row in mnist['summary'].items():
    its = '-' if row['iterations'] is None else f"{row['iterations']:.0f}"
    secs = '-' if row['seconds'] is None else f"{row['seconds']:.2f}"
    per = ('-' if row['seconds_per_step'] is None
           else f"{1e3 * row['seconds_per_step']:.2f}")
    lines.append(f"| {method} | {row['lr']} | {its} | {secs} | {per} |")
  ratio = mnist.get('time_ratio_cbp_to_adam')
  per_seed = mnist.get('median_per_seed_time_ratio')
  lines += ['', 'CBP / Adam time to the threshold: '
            + ('-' if ratio is None else f'{ratio:.2f}')
            + ' (ratio of medians); median of per-seed ratios: '
            + ('-' if per_seed is None else f'{per_seed:.2f}')
            + '. Target (issue 5): <= 0.80; the paper: about 1.5.', '',
            'Selection runs (iterations to the threshold, or censored: '
            'diverged or out of steps):', '',
            '| method | lr | seed | iterations | seconds |',
            '|---|---|---|---|---|']
  for method, runs in mnist['runs'].items():
    for r in runs:
      lines.append(
          f"| {method} | {r['lr']} | {r['seed']} | "
          f"{r['iterations'] or 'censored'} | "
          f"{'-' if r['seconds'] is None else format(r['seconds'], '.2f')} |")
  return '\n'.join(lines)


def render(results: dict[str, Any]) -> str:
  """The whole markdown report."""
  env = results['environment']
  parts = [
      '# cbp_optax benchmark results', '',
      f"- date: {env['date']}", f"- machine: {env['machine']}",
      f"- jax {env['jax']}, jaxlib {env['jaxlib']}, flax {env['flax']}, "
      f"optax {env['optax']}, backend {env['backend']}",
      f"- XLA_FLAGS: `{env['xla_flags'] or '(none)'}`",
      f"- commit {env.get('revision', {}).get('commit', '?')}; library files "
      'differing from it: '
      f"{', '.join(env.get('revision', {}).get('library_uncommitted', [])) or 'none'}",
      f"- mode: {env['mode']}; per-round order rotates; times are median "
      '(IQR) of per-iteration wall time of the whole jitted step; ratios are '
      'the median [q1-q3] of per-round ratios to Adam.',
      "- 'RA' = compiled with "
      '`xla_cpu_copy_insertion_use_region_analysis=True`, "no RA" = with it '
      'False (per executable; buffer assignment only, results bitwise '
      'identical: '
      f"{results.get('region_analysis_bitwise_identical', 'not checked')}).",
      '',
  ]
  user = results.get('user')
  if user and user.get('groups'):
    from benchmarks import user_path  # pylint: disable=g-import-not-at-top
    parts += ["## The user's path / the AdamW step a user writes", '',
              user_path.steps_table(user['groups']), '',
              user_path.targets_table(user['groups']), '']
    if user.get('compile'):
      parts += ['## Optimizer-update compile time / optax.adamw', '',
                user_path.compile_table(user['compile']), '']
  groups = results.get('steps', [])
  if groups:
    variants = results['step_variants']
    parts += ['## CBP / Adam per step against the issue-5 targets', '',
              summary_table(groups), '',
              '## Full train step', '', step_table(groups, variants), '',
              '## Side by side with the paper (batch 128)', '',
              side_by_side(groups, results.get('torch')), '']
  if results.get('optimizer'):
    parts += ['## Optimizer only (gradients given)', '',
              optimizer_table(results['optimizer'], results['bandwidth']), '']
  if groups:
    parts += ['## Memory, compile time, copies', '',
              'opt state: bytes of the optimizer state; for CBP the '
              "'2P+L floats' column is the paper's 2P + L and 'counters' the "
              'rest (int32 step counters). centering: mu and the recorded '
              'mean of every centered layer (2A floats). XLA args+temp: '
              'the executable\'s arguments (state, batch) plus its temporary '
              'buffers. param-sized copies: copy instructions of a '
              'kernel-shaped buffer, on every step / only on a skipped step.',
              '', memory_table(groups), '']
  if results.get('rss'):
    parts += ['## Peak resident memory', '', rss_table(results['rss']), '']
  parts += ['## PyTorch peer', '', torch_table(results.get('torch')), '']
  if results.get('peer'):
    parts += ['## Ours and PyTorch, interleaved in one process', '',
              peer_table(results['peer']), '']
  if results.get('mnist'):
    parts += ['## MNIST: wall clock to the threshold', '',
              mnist_table(results['mnist']), '']
  return '\n'.join(parts)
