"""The benchmark suite runs, and the compiled fused steps copy no parameters.

No timing assertions here: the suite prints tables, the tests only check that
it runs and that the compiled steps keep the buffer behaviour we rely on.
"""

import collections
import functools
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from benchmarks import hlo_copies
from benchmarks import models
from benchmarks import steps

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Small, so eight compilations stay fast; five kernels of three shapes.
ARCH = models.mlp(64)
BATCH = 16


# Minutes of training on 2 cores: the benchmarks are run by hand (see
# CONTRIBUTING.md, test tiers); the default tier keeps the HLO checks.
@pytest.mark.slow
def test_quick_suite_runs_and_prints_its_table(tmp_path):
  done = subprocess.run(
      [sys.executable, os.path.join(REPO, 'benchmarks', 'run.py'), '--quick',
       '--out', str(tmp_path)],
      capture_output=True, text=True, timeout=300, cwd=REPO)
  assert done.returncode == 0, done.stderr[-3000:]
  assert '## Full train step' in done.stdout
  assert '| MLP-256 | linen | 32 |' in done.stdout
  assert '## Optimizer only' in done.stdout
  assert "## The user's path" in done.stdout
  assert (tmp_path / 'results.json').exists()
  assert (tmp_path / 'results.md').exists()


def _runner(api: str, variant: steps.Variant) -> steps.Runner:
  """One compiled step per (API, variant) for the whole module: compiling
  dominates these tests, and they only read the HLO or run a few steps."""
  return _cached_runner(api, variant.name)


@functools.lru_cache(maxsize=None)
def _cached_runner(api: str, variant_name: str) -> steps.Runner:
  variant = next(v for v in steps.VARIANTS if v.name == variant_name)
  return steps.make_runner(api, ARCH, variant, BATCH)


def _kernel_copies_per_step(runner: steps.Runner) -> collections.Counter:
  """Copies of kernel-shaped buffers that run on every (non-skipped) step."""
  found = hlo_copies.copies(runner.hlo)
  return hlo_copies.count_by_shape(found, models.kernel_shapes(runner.params))


def _one_per_kernel(runner: steps.Runner) -> collections.Counter:
  return collections.Counter(models.kernel_shapes(runner.params))


@pytest.mark.parametrize('api', ['linen', 'nnx'])
@pytest.mark.parametrize('variant', [steps.ADAM, steps.ADAM_CENTER])
def test_adam_fused_step_copies_no_parameter_buffer(api, variant):
  runner = _runner(api, variant)
  assert _kernel_copies_per_step(runner) == collections.Counter()


@pytest.mark.parametrize('api', ['linen', 'nnx'])
@pytest.mark.parametrize('variant', [steps.CBP_M1M3, steps.CBP_FULL])
def test_cbp_fused_step_copies_no_parameter_buffer(api, variant):
  # The library compiles its fused steps with region-analysis copy insertion
  # on CPU, which removes M3's lag copy (one full copy of every second-moment
  # leaf per step). This locks the fix in: any parameter-sized copy that
  # comes back is a regression.
  runner = _runner(api, variant)
  assert _kernel_copies_per_step(runner) == collections.Counter()


def test_default_copy_insertion_copies_exactly_the_read_after_write_state():
  # The known cause, kept visible: with XLA's default copy insertion the lag
  # costs one copy of every second-moment leaf per step -- one per kernel
  # here -- plus the M1 energies (eq. 6 reads q_{t-1}) and the centering
  # means (eq. 10 reads mu_old after mu_new is formed) and their recording
  # counts (reset by the transport); the skip select (keep the old state on
  # a non-finite batch) reads the old first moment too. The parameters are
  # never copied. If this count drops to zero, XLA's
  # default got smarter and the library's option may go.
  runner = _runner('linen', steps.CBP_FULL_NO_RA)
  assert _kernel_copies_per_step(runner) == _two_per_kernel(runner)
  copied = hlo_copies.entry_parameter_copies(runner.hlo)
  kernel_moments = [name for name in copied
                    if 'kernel' in name and '__count' not in name]
  assert sorted(n.split('__', 2)[1] for n in kernel_moments) == (
      ['mu'] * 5 + ['nu'] * 5), copied
  assert not any('params' in name for name in copied), copied
  assert all(any(part in name for part in ('__mu__', '__nu__', 'energy',
                                           '_mean_', '__count', 'batch_count'))
             for name in copied), copied


def _two_per_kernel(runner: steps.Runner) -> collections.Counter:
  return collections.Counter({k: 2 * v for k, v in
                              _one_per_kernel(runner).items()})


@pytest.mark.parametrize('api', ['linen', 'nnx'])
def test_region_analysis_removes_the_lag_copy_without_changing_results(api):
  shipped = _runner(api, steps.CBP_FULL)
  default_xla = _runner(api, steps.CBP_FULL_NO_RA)
  assert _kernel_copies_per_step(default_xla) == _two_per_kernel(default_xla)
  for _ in range(3):
    shipped.step()
    default_xla.step()
  for a, b in zip(jax.tree.leaves(shipped.read_state()),
                  jax.tree.leaves(default_xla.read_state())):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_mnist_section_skips_without_data(tmp_path):
  from benchmarks import mnist
  result = mnist.run(str(tmp_path / 'absent'), quick=True)
  assert 'skipped' in result
  assert 'no MNIST data' in result['skipped']


# Minutes of training on 2 cores: the benchmarks are run by hand (see
# CONTRIBUTING.md, test tiers); the default tier keeps the HLO checks.
@pytest.mark.slow
def test_mnist_section_quick_run_reports_both_methods():
  from benchmarks import mnist
  if not os.path.isdir(mnist.DEFAULT_DATA_DIR):
    pytest.skip(f'no MNIST copy at {mnist.DEFAULT_DATA_DIR}')
  result = mnist.run(None, quick=True, log=lambda message: None)
  if 'skipped' in result:
    pytest.skip(result['skipped'])
  assert set(result['summary']) == {'Adam', 'CBP'}
  for runs in result['runs'].values():
    assert len(runs) == len(result['grid']) * len(result['seeds'])
    for run in runs:
      assert run['steps_run'] >= 1
      assert run['iterations'] is None or run['seconds'] > 0


# ------------------------------------------------ the user-path section

# One hidden layer of 8: fourteen step compilations (seven rows, two APIs)
# stay a few seconds.
TINY = models.mlp(8, depth=1)
TINY_BATCH = 4


def _params(runner):
  return [np.asarray(x) for x in jax.tree.leaves(runner.params())]


def _assert_same_params(a, b, **tolerance):
  for x, y in zip(_params(a), _params(b), strict=True):
    np.testing.assert_allclose(x, y, **tolerance)


def _check_user_rows(api, names):
  """Builds ``names`` of the section's rows, steps and times each."""
  from benchmarks import user_path
  rows = [r for r in user_path.ROWS if r.name in names]
  assert [r.name for r in rows] == list(names)
  runners = user_path.build(api, TINY, TINY_BATCH, rows)
  assert list(runners) == list(names)

  def same(a, b):
    if a in runners and b in runners:
      _assert_same_params(runners[a], runners[b], rtol=1e-6, atol=1e-7)

  # The rows train what their names say, after their first (compiling)
  # call: the fused AdamW step the user's AdamW step, nested the direct
  # fused step, and the two CBP configurations are different optimizers.
  same('AdamW fused', 'AdamW, user jit')
  same('AdamW, user jit, donated', 'AdamW, user jit')
  same('cbp_robust nested, centered', 'cbp_robust fused, centered')
  if {'cbp fused, centered', 'cbp_robust fused, centered'} <= set(runners):
    with pytest.raises(AssertionError):
      _assert_same_params(runners['cbp fused, centered'],
                          runners['cbp_robust fused, centered'], rtol=1e-3)
  layers = TINY.depth + 1
  for row in rows:
    runner = runners[row.name]
    assert runner.centered_layers == (layers if row.centered else 0), row
    before = _params(runner)
    loss = runner.step()
    runner.sync()
    assert np.isfinite(np.asarray(getattr(loss, 'loss', loss))), row
    assert any(not np.array_equal(a, b)
               for a, b in zip(before, _params(runner))), row
  timed = user_path.time_runners(runners, rounds=2, window_s=1e-3)
  assert list(timed) == list(runners)
  base = timed[user_path.BASELINE.name]
  assert base['ratio']['median'] == base['ratio']['min'] == 1.0
  for name, row in timed.items():
    assert row['steps_per_window'] >= 1
    assert row['time']['n'] == 2 and row['time']['min'] > 0, name
    assert row['ratio']['min'] <= row['ratio']['median'] <= row['ratio']['max']
  group = {'arch': TINY.name, 'kind': 'mlp', 'width': TINY.width, 'api': api,
           'batch': TINY_BATCH, 'params': 1, 'rounds': 2, 'window_s': 1e-3,
           'load_average': {'start': (1.0,), 'end': (1.0,)}, 'rows': timed}
  table = user_path.steps_table([group])
  for row in rows[1:]:
    assert f'{row.name} / baseline' in table
  assert f'| {TINY.name} | {api} | {TINY_BATCH} |' in table


def _row_names():
  from benchmarks import user_path
  return [r.name for r in user_path.ROWS]


# Each branch of the Linen builder (the user's jit, the fused step direct
# and nested, centered); every row is the slow test's.
LINEN_DEFAULT_ROWS = ('AdamW, user jit', 'AdamW fused',
                      'cbp_robust nested, centered')


def test_user_section_builds_steps_and_times_every_nnx_row():
  _check_user_rows('nnx', _row_names())


def test_user_section_builds_steps_and_times_linen_rows():
  _check_user_rows('linen', LINEN_DEFAULT_ROWS)


# Seven more compilations; the default tier covers every builder branch.
@pytest.mark.slow
def test_user_section_builds_steps_and_times_every_linen_row():
  _check_user_rows('linen', _row_names())


def test_user_section_times_the_update_compile_of_every_optimizer():
  from benchmarks import user_path
  result = user_path.run_compile([4], rounds=1)
  (row,) = result['rows']
  assert row['leaves'] == 4
  assert set(row['optimizers']) == set(user_path.OPTIMIZERS)
  assert row['optimizers']['adamw']['wall_ratio']['median'] == 1.0
  for entry in row['optimizers'].values():
    assert entry['wall_s']['min'] > 0 and entry['cpu_s']['min'] > 0
    assert entry['lower_wall_s']['min'] <= entry['wall_s']['min']
  assert '| 4 | 1 |' in user_path.compile_table(result)


def test_leaf_tree_has_the_leaves_asked_for():
  from benchmarks import user_path
  tree = user_path.leaf_tree(200)
  assert len(jax.tree.leaves(tree)) == 200
  assert len(cbp_blocks(tree)) == 100  # one M1 block per kernel/bias pair
  for bad in (0, 1, 7):
    with pytest.raises(ValueError, match='even'):
      user_path.leaf_tree(bad)


def cbp_blocks(tree):
  import cbp_optax as cbp
  return cbp.block_names(tree)


def _group(kind, width, baseline_s, ratios, name='m'):
  rows = {'AdamW, user jit': {'path': 'user', 'optimizer': 'adamw',
                              'time': {'median': baseline_s},
                              'ratio': {'median': 1.0, 'min': 1.0,
                                        'max': 1.0}}}
  for row_name, (path, ratio) in ratios.items():
    rows[row_name] = {'path': path, 'optimizer': row_name.split()[0],
                      'time': {'median': baseline_s * ratio},
                      'ratio': {'median': ratio, 'min': ratio, 'max': ratio}}
  return {'arch': name, 'kind': kind, 'width': width, 'api': 'nnx',
          'rows': rows}


@pytest.mark.parametrize('kind, width, baseline_s, path, target', [
    ('mlp', 512, 5e-3, 'direct', 1.05),
    ('mlp', 4096, 0.1, 'direct', 1.05),
    ('mlp', 1024, 5e-3, 'nested', 1.10),
    ('cnn', 32, 0.02, 'direct', 1.05),
    ('cnn', 32, 0.02, 'nested', 1.10),
    ('mlp', 128, 0.5e-3, 'direct', 1.15),  # under 1 ms: the fast bound
    ('mlp', 128, 0.5e-3, 'nested', 1.15),
    ('mlp', 128, 2e-3, 'direct', None),  # narrower than 512, not fast
    ('mlp', 8192, 0.5, 'direct', None),
    ('transformer', 128, 0.4, 'direct', None),
])
def test_user_section_targets_follow_the_issue(kind, width, baseline_s, path,
                                               target):
  from benchmarks import user_path
  assert user_path.target_for(_group(kind, width, baseline_s, {}),
                              path) == target


def test_user_section_targets_table_says_met_or_not():
  from benchmarks import user_path
  group = _group('mlp', 1024, 8e-3, {
      'cbp fused, centered': ('direct', 1.05),
      'cbp_robust fused, centered': ('direct', 1.06),
      'cbp_robust nested, centered': ('nested', 1.09)}, name='MLP-2x1024')
  table = user_path.targets_table([group])
  line = next(x for x in table.splitlines() if x.startswith('| MLP-2x1024'))
  assert line == ('| MLP-2x1024 | nnx | 8 | 1.05 (<= 1.05, yes) | '
                  '1.06 (<= 1.05, no) | 1.09 (<= 1.10, yes) |')


def _marked(section):
  from benchmarks import user_path
  return f'{user_path.BEGIN}\n{section}\n{user_path.END}'


def test_benchmarks_md_writer_replaces_only_its_own_section():
  from benchmarks import user_path
  before = '# Benchmarks\n\nIntro.\n\n'
  after = '\n\n## How to rerun\n\nold text <!-- other -->\n'
  text = before + _marked('## Old\n\nold numbers') + after
  new = user_path.replace_section(text, '## New\n\nnew numbers\n')
  assert new == before + _marked('## New\n\nnew numbers') + after
  assert user_path.replace_section(new, '## New\n\nnew numbers') == new


def test_benchmarks_md_writer_puts_a_new_section_on_top():
  from benchmarks import user_path
  text = '# Benchmarks\n\nIntro.\n\n## How to rerun\n\nx\n\n## More\n'
  new = user_path.replace_section(text, '## New')
  assert new == ('# Benchmarks\n\nIntro.\n\n' + _marked('## New')
                 + '\n\n## How to rerun\n\nx\n\n## More\n')
  assert user_path.replace_section('', '## New') == _marked('## New') + '\n'
  assert user_path.replace_section('# T', '## New') == (
      '# T\n' + _marked('## New') + '\n')


@pytest.mark.parametrize('text', [
    'a <!-- user-path:begin --> b',
    'a <!-- user-path:end --> b',
    '<!-- user-path:end --> a <!-- user-path:begin -->',
    ('<!-- user-path:begin --> a <!-- user-path:end --> '
     '<!-- user-path:begin --> b <!-- user-path:end -->'),
])
def test_benchmarks_md_writer_refuses_damaged_markers(text):
  from benchmarks import user_path
  with pytest.raises(ValueError, match='user-path'):
    user_path.replace_section(text, '## New')


def test_benchmarks_md_writer_keeps_the_repository_file_outside_its_markers(
    tmp_path):
  from benchmarks import user_path
  with open(os.path.join(REPO, 'BENCHMARKS.md')) as f:
    original = f.read()
  path = tmp_path / 'BENCHMARKS.md'
  path.write_text(original)
  user_path.write_section(str(path), '## Generated\n\n| a |\n|---|\n')
  written = path.read_text()
  head, _, rest = written.partition(user_path.BEGIN)
  inside, _, tail = rest.partition(user_path.END)
  assert inside == '\n## Generated\n\n| a |\n|---|\n'
  if user_path.BEGIN in original:
    o_head, _, o_rest = original.partition(user_path.BEGIN)
    assert (head, tail) == (o_head, o_rest.partition(user_path.END)[2])
  else:
    assert head + tail.removeprefix('\n\n') == original


def test_run_writes_benchmarks_md_only_where_asked():
  from benchmarks import run
  repo_file = os.path.join(REPO, 'BENCHMARKS.md')
  assert run.benchmarks_md_path(run.parse_args([])) == repo_file
  assert run.benchmarks_md_path(run.parse_args(['--quick'])) is None
  assert run.benchmarks_md_path(
      run.parse_args(['--quick', '--benchmarks-md', 'x.md'])) == 'x.md'
  assert run.benchmarks_md_path(
      run.parse_args(['--no-benchmarks-md'])) is None
  assert 'user' in run.SECTIONS and 'user' in run.QUICK_SECTIONS


def test_user_section_parses_model_names():
  from benchmarks import user_path
  got = user_path.select_archs(
      'MLP-2x512,MLP-1024,CNN,CNN-8,ResNet-8,Transformer,'
      'Transformer-2x32-ctx16')
  assert [a.name for a in got] == [
      'MLP-2x512', 'MLP-1024', 'CNN', 'CNN-8', 'ResNet-8', 'Transformer',
      'Transformer-2x32-ctx16']
  assert (got[0].depth, got[0].width) == (2, 512)
  assert (got[1].depth, got[1].width) == (models.MLP_DEPTH, 1024)
  assert (got[6].depth, got[6].width, got[6].context) == (2, 32, 16)
  with pytest.raises(ValueError, match='Unknown model'):
    user_path.select_archs('VGG')


def test_tutorial_cnn_has_the_tutorials_parameter_count():
  from flax import nnx
  arch = models.cnn()
  model = nnx.eval_shape(lambda: models.nnx_model(arch, False))
  nnx_count = models.count_params(nnx.state(model, nnx.Param))
  images = jax.ShapeDtypeStruct(arch.input_shape(2), jax.numpy.float32)
  linen = jax.eval_shape(models.linen_model(arch, False).init,
                         jax.random.key(0), images)
  assert nnx_count == models.count_params(linen['params']) == 824_458


# The section end to end on every model kind, tiny: minutes of compiling on
# a busy 2-core machine.
@pytest.mark.slow
def test_quick_user_section_runs_every_model_kind_and_writes_its_section(
    tmp_path):
  md = tmp_path / 'BENCHMARKS.md'
  md.write_text('# Benchmarks\n\nIntro.\n\n## Kept\n\nkept\n')
  done = subprocess.run(
      [sys.executable, os.path.join(REPO, 'benchmarks', 'run.py'), '--quick',
       '--sections', 'user', '--out', str(tmp_path), '--benchmarks-md',
       str(md), '--user-archs', 'MLP-2x16,CNN-4,Transformer-2x32-ctx16'],
      capture_output=True, text=True, timeout=1200, cwd=REPO)
  assert done.returncode == 0, done.stderr[-3000:]
  for line in ('| MLP-2x16 | nnx |', '| MLP-2x16 | linen |', '| CNN-4 | nnx |',
               '| CNN-4 | linen |', '| Transformer-2x32-ctx16 | nnx |'):
    assert line in done.stdout
  assert '| Transformer-2x32-ctx16 | linen |' not in done.stdout
  written = md.read_text()
  assert written.startswith('# Benchmarks\n\nIntro.\n\n<!-- user-path:begin')
  assert written.endswith('<!-- user-path:end -->\n\n## Kept\n\nkept\n')
  assert '| 50 | 1 |' in written  # the compile-time table


_HAND_HLO = """HloModule m

%fused (p0: f32[4,4], p1: f32[4]) -> f32[4,4] {
  %p0 = f32[4,4]{1,0} parameter(0)
}

ENTRY %main (a: f32[4,4], b: f32[4], c: bf16[8]) -> (f32[4,4], f32[4]) {
  %a = f32[4,4]{1,0} parameter(0), metadata={op_name="a"}
  %b = f32[4]{0} parameter(1)
  %c = bf16[8]{0} parameter(2)
  %constant.1 = f32[] constant(0)
  %multiply_fusion = (f32[4,4]{1,0}, f32[4]{0}) fusion(%a, %b), kind=kLoop, calls=%fused
  %get-tuple-element.1 = f32[4,4]{1,0} get-tuple-element(%multiply_fusion), index=0
  %bitcast.2 = f32[16]{0} bitcast(%get-tuple-element.1)
  %dot.3 = f32[4]{0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %convert = f32[8]{0} convert(%c)
  ROOT %tuple = (f32[4,4]{1,0}, f32[4]{0}) tuple(%get-tuple-element.1, %dot.3)
}
"""


def test_hlo_traffic_counts_operands_and_results_of_the_entry_only():
  from benchmarks import hlo_traffic
  traffic = hlo_traffic.entry_traffic(_HAND_HLO)
  # fusion: reads a (64) and b (16), writes 64 + 16; dot: reads 80, writes
  # 16; convert: reads 16 (bf16[8]), writes 32. Views, tuples, parameters
  # and the fused computation's own lines move nothing.
  assert traffic.read_bytes == 80 + 80 + 16
  assert traffic.written_bytes == 80 + 16 + 32
  assert traffic.by_opcode == {'fusion': 1, 'dot': 1, 'convert': 1}
  assert traffic.instructions == 3
  assert traffic.total_bytes == traffic.read_bytes + traffic.written_bytes
  assert hlo_traffic.array_bytes('(f32[2,3]{1,0}, pred[5], s32[])') == 33


def test_hlo_traffic_of_a_compiled_elementwise_step_is_one_pass():
  from benchmarks import hlo_traffic
  x = jax.numpy.ones(1000, jax.numpy.float32)
  text = jax.jit(lambda x, y: x * 2 + y).lower(x, x).compile().as_text()
  traffic = hlo_traffic.entry_traffic(text)
  assert (traffic.read_bytes, traffic.written_bytes) == (8000, 4000)


_LOOP_HLO = """HloModule m

%body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[8]{0} get-tuple-element(%t), index=1
  %x2 = f32[8]{0} add(%x, %x)
  %i2 = s32[] add(%i, %i)
  ROOT %out = (s32[], f32[8]{0}) tuple(%i2, %x2)
}

%cond (t: (s32[], f32[8])) -> pred[] {
  %t = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %lt = pred[] compare(%i, %i), direction=LT
}

%small (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %n = f32[8]{0} negate(%x)
}

%large (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %e = f32[8]{0} exponential(%x)
  ROOT %n = f32[8]{0} negate(%e)
}

%row (stack: f32[4,8], i: s32[]) -> f32[8] {
  %stack = f32[4,8]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = f32[1,8]{1,0} dynamic-slice(%stack, %i, %z), dynamic_slice_sizes={1,8}
  ROOT %b = f32[8]{0} bitcast(%ds)
}

%put (stack: f32[4,8], i: s32[], v: f32[1,8]) -> f32[4,8] {
  %stack = f32[4,8]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %v = f32[1,8]{1,0} parameter(2)
  %z = s32[] constant(0)
  ROOT %dus = f32[4,8]{1,0} dynamic-update-slice(%stack, %v, %i, %z)
}

ENTRY %main (x: f32[8], p: pred[], s: f32[4,8], i: s32[], v: f32[1,8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %p = pred[] parameter(1)
  %s = f32[4,8]{1,0} parameter(2)
  %i = s32[] parameter(3)
  %v = f32[1,8]{1,0} parameter(4)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]{0}) tuple(%zero, %x)
  %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %w2 = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body
  %c = f32[8]{0} conditional(%p, %x, %x), branch_computations={%small, %large}
  %r = f32[8]{0} fusion(%s, %i), kind=kLoop, calls=%row
  %u = f32[4,8]{1,0} fusion(%s, %i, %v), kind=kLoop, calls=%put
  ROOT %y = f32[8]{0} call(%x), to_apply=%small
}
"""


def test_hlo_traffic_enters_loops_branches_and_calls():
  from benchmarks import hlo_traffic
  traffic = hlo_traffic.entry_traffic(_LOOP_HLO)
  body = (2 * 32 + 2 * 4, 32 + 4)  # the two adds: read, written
  cond = (4 + 4, 1)
  # w: 3 bodies and 4 conditions (the last one exits); w2: its trip count
  # unknown, one of each; c: the larger branch (exp then negate); r: the one
  # row it slices; u: the row it writes in place; y: the callee.
  read = (3 * body[0] + 4 * cond[0]) + (body[0] + cond[0]) + 2 * 32 \
      + (32 + 4) + (0 + 4 + 32) + 32
  written = (3 * body[1] + 4 * cond[1]) + (body[1] + cond[1]) + 2 * 32 \
      + 32 + 32 + 32
  assert (traffic.read_bytes, traffic.written_bytes) == (read, written)
  assert traffic.unknown_trip_counts == 1
  assert traffic.by_opcode == {'add': 8, 'compare': 5, 'exponential': 1,
                               'negate': 2, 'fusion': 2}


def test_hlo_traffic_refuses_what_it_cannot_read():
  from benchmarks import hlo_traffic
  with pytest.raises(ValueError, match="element type 'q7'"):
    hlo_traffic.array_bytes('q7[4]')
  assert hlo_traffic.array_bytes('(s4[3], token[])') == 2
  with pytest.raises(ValueError, match='cannot parse'):
    hlo_traffic.entry_traffic(_HAND_HLO.replace(
        '%convert = f32[8]{0} convert(%c)', '%convert = f32[8]{0} convert'))
  with pytest.raises(ValueError, match='no ENTRY'):
    hlo_traffic.entry_traffic('HloModule m\n')
  with pytest.raises(ValueError, match='does not define'):
    hlo_traffic.entry_traffic(_LOOP_HLO.replace('calls=%row', 'calls=%gone'))
  with pytest.raises(ValueError, match='cannot parse'):
    hlo_traffic.entry_traffic(_HAND_HLO.replace(
        '%convert = f32[8]{0} convert(%c)', 'convert = f32[8]{0} convert(%c)'))


def _one_fusion(fused_lines: str, result: str, operands: str) -> str:
  """A program of one fusion of a 6x1000 buffer ``a``, an index ``i`` and
  a row ``u`` (entry parameters)."""
  return f"""HloModule m

%f (p: f32[6,1000]) -> f32[6,1000] {{
{fused_lines}
}}

ENTRY %main (a: f32[6,1000], i: s32[], u: f32[1,1000]) -> f32[6,1000] {{
  %a = f32[6,1000]{{1,0}} parameter(0)
  %i = s32[] parameter(1)
  %u = f32[1,1000]{{1,0}} parameter(2)
  ROOT %r = {result} fusion({operands}), kind=kLoop, calls=%f
}}
"""


_BUFFER = """  %p0 = f32[6,1000]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %p2 = f32[1,1000]{1,0} parameter(2)
  %z = s32[] constant(0)"""
_STACK, _ROW = 'f32[6,1000]{1,0}', 'f32[1,1000]{1,0}'

# (fused lines, result type, operands, bytes read, bytes written); rows are
# 4,000 bytes, the buffer 24,000, the index 4.
_FUSION_CASES = {
    # x.at[i].add(y) in a loop: read the row, write it back in place.
    'read-modify-write': (_BUFFER + """
  %ds = f32[1,1000]{1,0} dynamic-slice(%p0, %p1, %z), dynamic_slice_sizes={1,1000}
  %n = f32[1,1000]{1,0} add(%ds, %p2)
  ROOT %dus = f32[6,1000]{1,0} dynamic-update-slice(%p0, %n, %p1, %z)""",
                          _STACK, '%a, %i, %u', 4000 + 4 + 4000, 4000),
    'two in-place outputs': (_BUFFER + """
  %p3 = f32[6,1000]{1,0} parameter(3)
  %d0 = f32[6,1000]{1,0} dynamic-update-slice(%p0, %p2, %p1, %z)
  %n = f32[1,1000]{1,0} negate(%p2)
  %d1 = f32[6,1000]{1,0} dynamic-update-slice(%p3, %n, %p1, %z)
  ROOT %t = (f32[6,1000]{1,0}, f32[6,1000]{1,0}) tuple(%d0, %d1)""",
                             f'({_STACK}, {_STACK})', '%a, %i, %u, %a',
                             4 + 4000, 2 * 4000),
    'chained updates': (_BUFFER + """
  %d0 = f32[6,1000]{1,0} dynamic-update-slice(%p0, %p2, %p1, %z)
  %n = f32[1,1000]{1,0} negate(%p2)
  ROOT %d1 = f32[6,1000]{1,0} dynamic-update-slice(%d0, %n, %z, %z)""",
                        _STACK, '%a, %i, %u', 4 + 4000, 2 * 4000),
    # Not in place: an update read by another instruction reads and writes
    # the buffer whole; one of a fresh buffer writes it whole (and an
    # operand with no use in sight is charged whole).
    'update then negate': (_BUFFER + """
  %d0 = f32[6,1000]{1,0} dynamic-update-slice(%p0, %p2, %p1, %z)
  ROOT %n = f32[6,1000]{1,0} negate(%d0)""",
                           _STACK, '%a, %i, %u', 24000 + 4 + 4000, 24000),
    'update of a fresh buffer': (_BUFFER + """
  %zeros = f32[6,1000]{1,0} broadcast(%p2), dimensions={0,1}
  ROOT %d0 = f32[6,1000]{1,0} dynamic-update-slice(%zeros, %p2, %p1, %z)""",
                                 _STACK, '%a, %i, %u', 24000 + 4 + 4000, 24000),
    'overlapping slices': (_BUFFER + """
  %s0 = f32[5,1000]{1,0} slice(%p0), slice={[0:5], [0:1000]}
  %s1 = f32[5,1000]{1,0} slice(%p0), slice={[1:6], [0:1000]}
  %s2 = f32[5,1000]{1,0} slice(%p0), slice={[0:5], [0:1000]}
  %a0 = f32[5,1000]{1,0} add(%s0, %s1)
  ROOT %a1 = f32[5,1000]{1,0} add(%a0, %s2)""",
                           'f32[5,1000]{1,0}', '%a', 24000, 20000),
}


@pytest.mark.parametrize('case', sorted(_FUSION_CASES))
def test_hlo_traffic_charges_in_place_fusions_their_slices(case):
  from benchmarks import hlo_traffic
  lines, result, operands, read, written = _FUSION_CASES[case]
  traffic = hlo_traffic.entry_traffic(_one_fusion(lines, result, operands))
  assert (traffic.read_bytes, traffic.written_bytes) == (read, written)


def test_hlo_traffic_of_a_compiled_loop_updates_one_row_per_iteration():
  from benchmarks import hlo_traffic
  rows, width = 6, 1000
  buffer = jax.numpy.zeros((rows, width), jax.numpy.float32)

  def accumulate(buffer, values):
    return jax.lax.fori_loop(
        0, rows, lambda i, b: b.at[i].add(values[i]), buffer)

  text = jax.jit(accumulate).lower(buffer, buffer).compile().as_text()
  traffic = hlo_traffic.entry_traffic(text)
  row = 4 * width
  # Each iteration reads its row of both buffers and writes one row; were
  # the updated buffer charged whole, over rows * rows rows would be read.
  assert rows * 2 * row <= traffic.read_bytes < rows * (rows + 3) * row // 2
  assert rows * row <= traffic.written_bytes < rows * rows * row // 2


_BRANCHES_HLO = """HloModule m

%body (t: (s32[], f32[1])) -> (s32[], f32[1]) {
  %t = (s32[], f32[1]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[1]{0} get-tuple-element(%t), index=1
  %n = f32[1]{0} negate(%x)
  ROOT %out = (s32[], f32[1]{0}) tuple(%i, %n)
}

%cond (t: (s32[], f32[1])) -> pred[] {
  %t = (s32[], f32[1]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%looping (t: (s32[], f32[1])) -> (s32[], f32[1]) {
  %t = (s32[], f32[1]{0}) parameter(0)
  ROOT %w = (s32[], f32[1]{0}) while(%t), condition=%cond, body=%body
}

%wide (t: (s32[], f32[1])) -> (s32[], f32[1]) {
  %t = (s32[], f32[1]{0}) parameter(0)
  %z = f32[] constant(0)
  %b = f32[1000]{0} broadcast(%z), dimensions={}
  %e = f32[1000]{0} exponential(%b)
  ROOT %same = (s32[], f32[1]{0}) parameter(0)
}

ENTRY %main (p: pred[], t: (s32[], f32[1])) -> (s32[], f32[1]) {
  %p = pred[] parameter(0)
  %t = (s32[], f32[1]{0}) parameter(1)
  ROOT %c = (s32[], f32[1]{0}) conditional(%p, %t, %t), true_computation=%looping, false_computation=%wide
}
"""


def test_hlo_traffic_counts_unknown_loops_in_every_branch():
  from benchmarks import hlo_traffic
  traffic = hlo_traffic.entry_traffic(_BRANCHES_HLO)
  # The wide branch moves more (one iteration of the loop is 8 bytes); the
  # loop of unknown length in the other may be what runs.
  assert traffic.by_opcode == {'broadcast': 1, 'exponential': 1}
  assert traffic.unknown_trip_counts == 1


def test_hlo_traffic_sizes_packed_and_bounded_arrays():
  from benchmarks import hlo_traffic
  # Sub-byte elements are packed within each array, not across a tuple.
  assert hlo_traffic.array_bytes('(s4[3]{0:E(4)}, s4[3]{0:E(4)})') == 4
  assert hlo_traffic.array_bytes('(f32[<=8]{0}, s32[])') == 36
  with pytest.raises(ValueError, match='unbounded dynamic dimension'):
    hlo_traffic.array_bytes('(f32[?]{0}, s32[])')


def test_hlo_traffic_of_a_compiled_scan_reads_each_layer_once():
  from benchmarks import hlo_traffic
  layers, width = 6, 1000
  stack = jax.numpy.ones((layers, width), jax.numpy.float32)

  def scanned(stack):
    return jax.lax.scan(lambda c, w: (c * w + 1.0, None), stack[0], stack)[0]

  text = jax.jit(scanned).lower(stack).compile().as_text()
  traffic = hlo_traffic.entry_traffic(text)
  row = 4 * width
  # Every iteration reads its row of the stack and the carry and writes the
  # carry: at least layers * 2 rows read; were each iteration charged the
  # whole stack, over layers * layers rows.
  assert traffic.read_bytes >= layers * 2 * row
  assert traffic.read_bytes < layers * (layers + 1) * row // 2
  assert traffic.written_bytes >= layers * row
  assert traffic.unknown_trip_counts == 0


def test_traffic_section_compiles_each_row_as_it_runs():
  from benchmarks import step_traffic, user_path
  names = ('AdamW, user jit', 'AdamW fused', 'cbp_robust nested, centered')
  rows = [r for r in user_path.ROWS if r.name in names]
  groups = step_traffic.run([TINY], ['nnx', 'linen'], quick=True, rows=rows)
  assert [(g['api'], list(g['rows'])) for g in groups] == [
      ('nnx', list(names)), ('linen', list(names))]
  for group in groups:
    params_bytes = 4 * group['params']
    for name, row in group['rows'].items():
      # Every step reads each parameter and writes its new value.
      assert row['read_bytes'] > params_bytes, (group['api'], name)
      assert row['written_bytes'] >= params_bytes, (group['api'], name)
    # The fused AdamW step also checks every gradient entry for finiteness.
    assert group['rows']['AdamW fused']['total_ratio'] > 1.0
    assert group['rows'][user_path.BASELINE.name]['total_ratio'] == 1.0
  table = step_traffic.table(groups)
  assert f'| {TINY.name} | linen | 8 |' in table
  assert 'cbp_robust nested, centered / baseline' in table


def test_traffic_section_writes_between_its_own_markers(tmp_path):
  from benchmarks import step_traffic, user_path
  path = tmp_path / 'BENCHMARKS.md'
  path.write_text('# B\n\n' + _marked('## User\n\nuser numbers') + '\n\n'
                  f'{step_traffic.BEGIN}\nold\n{step_traffic.END}\n\n## Kept\n')
  user_path.write_section(str(path), '## Traffic\n\nbytes',
                          step_traffic.BEGIN, step_traffic.END)
  assert path.read_text() == (
      '# B\n\n' + _marked('## User\n\nuser numbers') + '\n\n'
      f'{step_traffic.BEGIN}\n## Traffic\n\nbytes\n{step_traffic.END}\n\n'
      '## Kept\n')


def test_a_new_section_never_lands_inside_another_generated_one(tmp_path):
  from benchmarks import step_traffic, user_path
  path = tmp_path / 'BENCHMARKS.md'
  user = _marked('## User\n\nuser numbers')
  path.write_text('# B\n\n' + user + '\n\n## Kept\n')
  user_path.write_section(str(path), '## Traffic\n\nbytes',
                          step_traffic.BEGIN, step_traffic.END)
  user_path.write_section(str(path), '## User\n\nnew numbers')
  assert path.read_text() == (
      '# B\n\n' + _marked('## User\n\nnew numbers') + '\n\n'
      f'{step_traffic.BEGIN}\n## Traffic\n\nbytes\n{step_traffic.END}\n\n'
      '## Kept\n')
