"""The reproduction suite: statistics on known answers, and every study's
--quick mode with the qualitative facts that must hold.

The synthetic studies take about a minute together on an idle 2-core machine
(measured: the 21 default tests of this file in 58 s at load average ~2; 14
of them took 77 s at load average 5). The
real-data and timing studies (mnist, resnet, overhead) take longer in --quick
mode (resnet: 45-55 s, five compilations, at load 5); they are marked slow and
run with ``CBP_OPTAX_SLOW=1 pytest -m slow experiments/tests/test_reproduce.py``.
"""

import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats as scipy_stats

import cbp_optax as cbp

from cbp_optax_experiments.reproduce import conditioning
from cbp_optax_experiments.reproduce import depth_training
from cbp_optax_experiments.reproduce import disparity
from cbp_optax_experiments.reproduce import factorial
from cbp_optax_experiments.reproduce import gradient_norms
from cbp_optax_experiments.reproduce import head_to_head
from cbp_optax_experiments.reproduce import protocol
from cbp_optax_experiments.reproduce import quadratic
from cbp_optax_experiments.reproduce import resnet
from cbp_optax_experiments.reproduce import stats
from cbp_optax_experiments.reproduce import training
from cbp_optax_experiments.reproduce.context import StudyContext

ROOT = pathlib.Path(__file__).resolve().parents[2]
slow = [pytest.mark.slow, pytest.mark.skipif(
    os.environ.get('CBP_OPTAX_SLOW') != '1',
    reason='minutes on 2 cores; set CBP_OPTAX_SLOW=1')]


def quick(tmp_path, name):
  return StudyContext(out=tmp_path / name, quick=True, progress=False)


def outputs(folder: pathlib.Path):
  assert (folder / 'results.md').read_text().startswith('# ')
  payload = json.loads((folder / 'results.json').read_text())
  assert list(folder.glob('*.png'))
  return payload


# --- statistics on known answers ---------------------------------------------


def test_paired_t_test_by_hand_and_against_scipy():
  a = np.array([3.0, 5.0, 4.0, 6.0, 7.0])
  b = np.array([2.0, 3.0, 3.0, 4.0, 4.0])
  # d = [1, 2, 1, 2, 3]: mean 1.8, sd sqrt(0.7), t = 1.8 / (sqrt(0.7)/sqrt(5)).
  t, p = stats.paired_t_test(a, b)
  assert t == pytest.approx(1.8 / (math.sqrt(0.7) / math.sqrt(5)))
  assert p == pytest.approx(2 * scipy_stats.t.sf(t, 4))
  reference = scipy_stats.ttest_rel(a, b)
  assert (t, p) == pytest.approx((reference.statistic, reference.pvalue))


def test_paired_t_test_degenerate_cases():
  assert stats.paired_t_test([1, 2], [1, 2]) == (0.0, 1.0)
  t, p = stats.paired_t_test([2, 3, 4], [1, 2, 3])
  assert t == math.inf and p == 0.0


def test_wilcoxon_exact_small_sample():
  # Five positive differences: the exact two-sided p is 2 / 2^5.
  assert stats.wilcoxon_pvalue([2, 3, 4, 5, 6], [1, 1, 1, 1, 1]) == \
      pytest.approx(2 / 32)
  # Ranks of |d| = 1..4 with one negative of rank 1: W- = 1; P(W <= 1) = 2/16.
  assert stats.wilcoxon_pvalue([0, 2, 3, 4], [1, 0, 0, 0]) == \
      pytest.approx(2 * 2 / 16)
  assert stats.wilcoxon_pvalue([1, 2], [1, 2]) == 1.0


def test_cohens_d_of_paired_differences():
  # d = [1, 2, 3]: mean 2, sd 1.
  assert stats.cohens_d_paired([2, 4, 6], [1, 2, 3]) == pytest.approx(2.0)
  assert stats.cohens_d_paired([1, 2, 3], [2, 4, 6]) == pytest.approx(-2.0)


def test_bootstrap_ci_known_answers():
  assert stats.bootstrap_ci([0.5] * 7) == (0.5, 0.5)
  rng = np.random.default_rng(1)
  x = rng.normal(3.0, 2.0, size=400)
  low, high = stats.bootstrap_ci(x)
  half = 1.96 * x.std(ddof=1) / math.sqrt(x.size)
  assert low == pytest.approx(x.mean() - half, abs=0.05)
  assert high == pytest.approx(x.mean() + half, abs=0.05)
  assert stats.bootstrap_ci(x) == (low, high)  # seeded: reproducible


def test_summary_and_paired_test_fields():
  s = stats.summarize([1.0, 2.0, 3.0])
  assert (s.mean, s.std, s.n) == (2.0, 1.0, 3)
  assert 1.0 <= s.ci_low <= s.ci_high <= 3.0
  test = stats.paired_test([2, 4, 6], [1, 2, 3])
  assert test.mean_difference == 2.0 and test.n == 3
  assert stats.format_mean_std([1.0, 3.0]) == '2.000 ± 1.414'
  with pytest.raises(ValueError):
    stats.paired_test([1, 2], [1, 2, 3])


def test_smoothed_loss_and_iterations_to_threshold():
  losses = np.array([[1.0, 1.0, 0.0, 0.0, 0.0], [1.0] * 5])
  smooth = training.smoothed(losses, decay=0.5)
  # Debiased EMA: a constant sequence stays constant.
  np.testing.assert_allclose(smooth[1], 1.0)
  # EMA 0.5, 0.75, 0.375, 0.1875; debiased by 1 - 0.5^t.
  assert smooth[0, 2] == pytest.approx(0.375 / 0.875)
  assert smooth[0, 3] == pytest.approx(0.1875 / 0.9375)
  iters = training.iterations_to(losses, 0.3, decay=0.5)
  assert iters[0] == 4 and iters[1] == math.inf


def test_spiral_is_standardized_and_split_60_20_20():
  data = training.spiral(points_per_arm=100)
  assert len(data.train_y) == 360 and len(data.val_y) == 120
  assert len(data.test_y) == 120
  np.testing.assert_allclose(data.train_x.mean(0), 0, atol=1e-5)
  np.testing.assert_allclose(data.train_x.std(0), 1, atol=1e-4)


# --- the studies, --quick --------------------------------------------------


def test_quadratic_equalized_count_does_not_grow_with_depth(tmp_path):
  result = quadratic.run(StudyContext(out=tmp_path / 'q', progress=False))
  s = result.summary
  assert len(set(s['equalized'].tolist())) == 1  # flat: 10 at every depth
  assert s['equalized'][0] == 10
  assert s['gd'][0] == 6 and s['gd'][-1] == 2416  # the paper's exact counts
  assert s['exponent'] == pytest.approx(math.log(1.5), abs=0.02)
  # Theorem 5: the clipped equalizer is flat up to L* and grows after it.
  depths, clipped = s['depths'], s['clipped']
  assert set(clipped[depths <= s['crossover_depth'] + 1].tolist()) == {10}
  assert clipped[-1] > 10
  outputs(tmp_path / 'q')


def test_gradient_norms_m1_lowers_the_fig2_disparity(tmp_path):
  result = gradient_norms.run(quick(tmp_path, 'g'))
  payload = outputs(tmp_path / 'g')
  raw, m1 = np.array(payload['disparity_raw']), np.array(payload['disparity_m1'])
  assert np.all(m1 < raw)
  assert result.summary['disparity_m1_mean'] < 0.5 * result.summary[
      'disparity_raw_mean']


def test_conditioning_centering_lowers_lambda_max(tmp_path):
  result = conditioning.run(quick(tmp_path, 'c'))
  outputs(tmp_path / 'c')
  assert result.summary['centering_lowers_lambda_max_everywhere']
  assert result.summary['median_lambda_ratio'] > 1.5
  assert result.summary['median_cosine'] > 0.9  # the aligned regime


def test_conditioning_spectra_on_a_known_factor():
  # Activations +-1 around mean (3, 0): A = [[10, 0], [0, 1]], Cov = diag(1, 1).
  hidden = np.array([[4.0, 1.0], [2.0, -1.0], [4.0, -1.0], [2.0, 1.0]])
  out = conditioning.factor_spectra(hidden, zeta=1e-3)
  assert out['mu_norm'] == pytest.approx(3.0)
  assert out['lambda_raw'] == pytest.approx(10.0)
  assert out['lambda_cen'] == pytest.approx(1.0)
  assert out['cosine'] == pytest.approx(1.0)
  assert out['kappa_raw'] == pytest.approx(10.001 / 1.001)


@pytest.mark.slow
def test_disparity_grows_with_depth_and_m1_lowers_it(tmp_path):
  result = disparity.run(quick(tmp_path, 'd'))
  outputs(tmp_path / 'd')
  raw, m1 = result.summary['median_raw'], result.summary['median_m1']
  assert raw[-1] > raw[0]
  assert np.all(m1 < raw)


@pytest.mark.slow
def test_head_to_head_quick(tmp_path):
  result = head_to_head.run(quick(tmp_path, 'h'))
  payload = outputs(tmp_path / 'h')
  loss = result.summary['mean_train_loss']
  assert set(loss) == set(head_to_head.QUICK_ARMS)
  # Adaptive and CBP steps beat plain SGD at this budget.
  assert loss['CBP (full)'] < loss['SGD']
  assert loss['Adam'] < loss['SGD']
  assert 'CBP (full)' in payload['paired_tests_vs_adam']
  assert 'Validation profile' in (tmp_path / 'h' / 'results.md').read_text()


@pytest.mark.slow
def test_factorial_quick_preconditioning_buys_speed(tmp_path):
  result = factorial.run(quick(tmp_path, 'f'))
  outputs(tmp_path / 'f')
  loss = result.summary['mean_train_loss']
  assert loss['M3'] < loss['base']
  assert len(result.summary['sensitivity']) == 1
  default = result.summary['sensitivity']['damping ζ=1e-3 *']
  assert np.isfinite(default['mean_train_loss'])


@pytest.mark.slow
def test_sensitivity_settings_share_one_program_and_match_separate_runs():
  # Table 8's vmapped settings give what one setting run alone gives.
  data = training.spiral(points_per_arm=40)
  model_for = lambda centered: training.MLP(hidden=(8, 8), classes=6,
                                            centered=centered)
  config = training.TrainConfig(steps=20, batch_size=16, eval_every=20)
  settings = factorial.SETTINGS[3:5]  # damping 0.1, rho 0.9
  ctx = StudyContext(out=pathlib.Path('.'), progress=False)
  rows = factorial.run_sensitivity(ctx, model_for, data, config, 0.01, [0])
  for setting, (_, loss, _) in zip(settings, rows[3:5]):
    alone = training.Method(
        'alone', lambda lr, s=setting: cbp.cbp(
            lr, damping=s.damping, decay=s.rho, min_scale=s.clip[0],
            max_scale=s.clip[1], b1=s.b1, b2=s.b2), centered=True)
    single = training.run_grid(
        model_for(True), alone, data,
        dataclasses.replace(config, centering_decay=setting.rho), [0], [0.01])
    np.testing.assert_allclose(loss, single.train_loss[:, 0, -1], rtol=1e-4)


def test_factorial_has_all_eight_cells_in_the_papers_order():
  names = [m.name for m in factorial.factorial_methods()]
  assert names == list(factorial.PAPER_T7)
  centered = [m.centered for m in factorial.factorial_methods()]
  assert centered == ['M2' in n for n in names]


@pytest.mark.slow
def test_depth_training_quick(tmp_path):
  result = depth_training.run(quick(tmp_path, 't'))
  outputs(tmp_path / 't')
  iters = result.summary['median_iterations']
  assert set(iters) == {'4/SGD', '4/SGD + M1'}
  assert all(v <= 200 for v in iters.values())


def test_cli_runs_a_study_and_writes_the_summary(tmp_path):
  done = subprocess.run(
      [sys.executable, '-m', 'cbp_optax_experiments.cli', 'reproduce', 'quadratic',
       '--quick', '--no-progress', '--out', str(tmp_path)],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  assert (tmp_path / 'quadratic' / 'fig5_quadratic.png').exists()
  summary = json.loads((tmp_path / 'summary.json').read_text())
  assert summary['quadratic']['seconds'] > 0


def test_resnet8_has_the_papers_parameter_count():
  rgb, gray = np.zeros((1, 32, 32, 3)), np.zeros((1, 32, 32, 1))
  assert resnet.parameter_count(resnet.ResNet8(), rgb) == 77_706
  assert resnet.parameter_count(resnet.ResNet8(centered=True), rgb) == 77_706
  assert resnet.parameter_count(resnet.ResNet8(), gray) == 77_418


@slow[0]
@slow[1]
def test_resnet_quick_runs_every_arm_and_labels_the_substitute(tmp_path):
  # ~45 s on a loaded 2-core machine (five compilations), hence slow.
  result = resnet.run(quick(tmp_path, 'resnet'))
  payload = outputs(tmp_path / 'resnet')
  assert set(result.summary['final_loss']) == set(resnet.PAPER)
  assert all(np.isfinite(v) for v in result.summary['final_loss'].values())
  if not result.summary['cifar10']:
    assert 'not CIFAR-10' in payload['setup']
    assert 'Offline substitute' in (tmp_path / 'resnet' /
                                    'results.md').read_text()
  assert result.summary['params']['CBP (full)'] == result.summary['params'][
      'Adam']


@pytest.mark.parametrize('study', ['mnist', 'overhead'])
@slow[0]
@slow[1]
def test_real_data_and_timing_studies_quick(tmp_path, study):
  import importlib  # pylint: disable=g-import-not-at-top
  module = importlib.import_module(f'cbp_optax_experiments.reproduce.{study}')
  module.run(quick(tmp_path, study))
  outputs(tmp_path / study)


def test_runs_with_the_same_recipe_are_computed_once(monkeypatch):
  # Table 7's M1 + M2 + M3 cell is Table 6's CBP (full): one training run.
  data = training.spiral(points_per_arm=40)
  model_for = lambda centered: training.MLP(hidden=(8,), classes=6,
                                            centered=centered)
  config = training.TrainConfig(steps=10, batch_size=16, eval_every=10)
  calls = []
  run_grid = training.run_grid
  monkeypatch.setattr(training, 'run_grid',
                      lambda *a, **k: calls.append(1) or run_grid(*a, **k))
  arms = {m.name: m for m in head_to_head.methods()}
  cells = {m.name: m for m in factorial.factorial_methods()}
  first = protocol.run_method(arms['CBP (full)'], model_for, data, config,
                              [0], [0.01], 0.3)
  second = protocol.run_method(cells['M1 + M2 + M3'], model_for, data,
                               config, [0], [0.01], 0.3)
  assert len(calls) == 1 and second.name == 'M1 + M2 + M3'
  np.testing.assert_array_equal(first.train_loss, second.train_loss)
  protocol.run_method(cells['M1 + M3'], model_for, data, config, [0], [0.01],
                      0.3)  # uncentered: a different run
  assert len(calls) == 2
