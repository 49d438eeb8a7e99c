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
  # means (eq. 10 reads mu_old after mu_new is formed); the skip select
  # (keep the old state on a non-finite batch) reads the old first moment
  # too. The parameters are never copied. If this count drops to zero, XLA's
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
                                           '_mean_', '__count'))
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
