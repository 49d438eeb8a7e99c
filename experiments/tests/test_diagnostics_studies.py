"""The diagnostics studies: their engine on known answers, and --quick runs.

The engine and helper tests run on synthetic data. The two --quick studies
need MNIST (``--data-dir``, ``CBP_OPTAX_MNIST`` or the loader's default
directories) and are skipped with the loader's reason when it is absent; each
compiles three to six small programs (tens of seconds on a loaded 2-core
machine).
"""

import importlib
import json
import pathlib

import jax
import numpy as np
import optax
import pytest

import cbp_optax as cbp
from cbp_optax_experiments import datasets
from cbp_optax_experiments.reproduce import cli
from cbp_optax_experiments.reproduce import flow
from cbp_optax_experiments.reproduce import gradient_flow
from cbp_optax_experiments.reproduce import init_scale
from cbp_optax_experiments.reproduce import normalization
from cbp_optax_experiments.reproduce import training
from cbp_optax_experiments.reproduce.context import StudyContext


def _mnist_missing():
  try:
    datasets.find_mnist(None, download=False)
  except datasets.DataError as error:
    first = str(error).split(';')[0].split('. ')[0]
    return f'MNIST IDX files not available (set CBP_OPTAX_MNIST): {first}'
  return None


needs_mnist = pytest.mark.skipif(_mnist_missing() is not None,
                                 reason=str(_mnist_missing()))


def quick(tmp_path, name):
  return StudyContext(out=tmp_path / name, quick=True, progress=False)


def outputs(folder: pathlib.Path):
  text = (folder / 'results.md').read_text()
  assert text.startswith('# ') and '## Verdicts' in text
  assert list(folder.glob('*.png'))
  return json.loads((folder / 'results.json').read_text())


# --- engine and helpers ----------------------------------------------------------


def test_depth_order_sorts_layers_numerically():
  names = ('layer_0', 'layer_1', 'layer_10', 'layer_2/dense', 'layer_11')
  assert [names[i] for i in flow.depth_order(names)] == [
      'layer_0', 'layer_1', 'layer_2/dense', 'layer_10', 'layer_11']
  with pytest.raises(ValueError, match='layer_<i>'):
    flow.depth_order(('head',))


def test_auc_on_hand_examples():
  labels = np.array([0, 0, 1, 1])
  assert init_scale.auc(np.array([0.1, 0.2, 0.3, 0.4]), labels) == 1.0
  assert init_scale.auc(np.array([0.4, 0.3, 0.2, 0.1]), labels) == 0.0
  assert init_scale.auc(np.zeros(4), labels) == 0.5  # all tied
  # One of four positive/negative pairs misordered.
  assert init_scale.auc(np.array([0.1, 0.35, 0.3, 0.4]), labels) == 0.75
  assert init_scale.auc(np.array([np.nan, 0, 1, 2]), labels) == 0.5


def test_engine_records_sgd_updates_as_lr_times_gradient_profile():
  data = training.spiral(points_per_arm=40)
  model = flow.NormMLP(hidden=(8,) * 11, classes=6)
  method = training.Method('SGD', optax.sgd)
  run = jax.jit(flow.make_run(model, method, data, steps=5, batch_size=16,
                              block_fn=flow.profile_block_fn))
  out = run(jax.random.key(0), 0.1)
  assert out.grad_norms.shape == (5, 12)
  # SGD applies -lr * g: the applied profile is the raw one scaled by lr.
  np.testing.assert_allclose(out.update_norms, 0.1 * out.grad_norms,
                             rtol=1e-5)
  params, _ = training.init_variables(model, jax.random.key(0),
                                      data.train_x[:2])
  names = cbp.block_names(params)
  assert len(names) == 12 and names[2] == 'layer_10'  # tree order
  # The engine reorders by depth (flow.depth_order): the output layer, whose
  # gradient sees the un-attenuated error, is the last column.
  assert out.grad_norms.shape[1] == len(names)
  assert np.isfinite(out.movement) and out.movement > 0
  assert np.isnan(out.hessian_trace)


def test_engine_init_scale_multiplies_every_kernel():
  data = training.spiral(points_per_arm=40)
  model = flow.NormMLP(hidden=(8, 8), classes=6)
  method = training.Method('SGD', optax.sgd)
  run = flow.make_run(model, method, data, steps=1, batch_size=16,
                      block_fn=flow.profile_block_fn)
  one, four = run(jax.random.key(0), 0.0), run(jax.random.key(0), 0.0, 4.0)
  # Zero learning rate: nothing moves, whatever the scale.
  assert float(one.movement) == 0.0 and float(four.movement) == 0.0
  # ReLU, zero biases: the last layer's input is scaled by 4 ** 2 = 16, and
  # its error signal (softmax - one-hot) is bounded, so its gradient grows.
  assert float(four.grad_norms[0, -1]) > 4 * float(one.grad_norms[0, -1])


def test_studies_are_registered_as_real_data_subcommands():
  for name, module in (('gradient-flow', 'gradient_flow'),
                       ('normalization', 'normalization'),
                       ('init-scale', 'init_scale')):
    assert cli.STUDIES[name] == module
    assert name in cli.REAL_DATA
    study = importlib.import_module(f'cbp_optax_experiments.reproduce.{module}')
    assert study.NAME == name and callable(study.run)
  assert 'gradient-flow' not in cli.selected(['synthetic'])


# --- --quick studies on MNIST -------------------------------------------------------


@needs_mnist
@pytest.mark.slow
def test_gradient_flow_quick(tmp_path):
  result = gradient_flow.run(quick(tmp_path, 'gf'))
  payload = outputs(tmp_path / 'gf')
  cells = {f'{i}/{m}' for i in ('ReLU + He', 'ReLU + 1/d_in')
           for m in ('SGD', 'SGD + M1', 'CBP')}
  assert set(result.summary['mean_test_accuracy']) == cells
  assert all(0.0 <= v <= 1.0
             for v in result.summary['mean_test_accuracy'].values())
  # Every disparity is a max/min ratio of finite, positive block norms.
  assert all(v >= 1.0 for v in result.summary['median_raw_disparity'].values())
  assert all(v >= 1.0
             for v in result.summary['median_applied_disparity'].values())
  profile = np.asarray(payload['per_seed']['ReLU + He/SGD']['raw_profile'])
  assert profile.shape == (2, 5)  # seeds x (4 hidden + output) layers
  assert len(payload['verdicts']) == 2


def test_batchnorm_model_uses_batch_statistics_only_in_training():
  data = training.spiral(points_per_arm=40)
  model = flow.NormMLP(hidden=(8, 8), classes=6, norm='batch')
  params, collections = training.init_variables(
      model, jax.random.key(0), data.train_x[:2])
  assert set(collections) == {'batch_stats'}
  x = data.train_x[:32] * 5.0 + 3.0
  _, mutated = model.apply({'params': params, **collections}, x, train=True,
                           mutable=['batch_stats'])
  mean = mutated['batch_stats']['norm_0']['mean']
  assert float(np.abs(mean).max()) > 0  # running mean moved towards the batch
  # The norm's scale and bias join their layer's block in the profiles.
  names = cbp.block_names(params, block_fn=flow.profile_block_fn)
  assert names == ('layer_0', 'layer_1', 'layer_2')


@needs_mnist
@pytest.mark.slow
def test_normalization_quick(tmp_path):
  result = normalization.run(quick(tmp_path, 'norm'))
  outputs(tmp_path / 'norm')
  assert set(result.summary['mean_train_loss']) == {'Adam + BatchNorm',
                                                    'CBP (full)'}
  # 20 steps from log(10) = 2.30: both arms are finite and learning.
  assert all(0.0 < v < 2.3 for v in result.summary['mean_train_loss'].values())


@needs_mnist
@pytest.mark.slow
def test_init_scale_quick(tmp_path):
  result = init_scale.run(quick(tmp_path, 'is'))
  payload = outputs(tmp_path / 'is')
  assert set(result.summary['mean_auc']) == {'SGD/3', 'AdamW/3', 'CBP/3'}
  auc = np.asarray(payload['per_seed']['auc']['AdamW/3'], np.float64)
  assert auc.shape == (2, 2) and np.all((auc >= 0) & (auc <= 1))
  # At alpha = 1 every method learns something within 30 steps.
  assert all(result.summary['mean_auc'][f'{m}/3'][0] > 0.6
             for m in ('SGD', 'AdamW', 'CBP'))
  movement = np.asarray(payload['per_seed']['movement']['AdamW/3'],
                        np.float64)
  assert np.all(movement[:, 0] > 0)


@needs_mnist
@pytest.mark.slow
def test_classic_mlp_example_trains_every_optimizer():
  import re  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  root = pathlib.Path(__file__).resolve().parents[2]
  done = subprocess.run(
      [sys.executable, 'examples/mlp_classic.py', '--epochs', '1'], cwd=root,
      capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  rows = [l for l in done.stdout.splitlines() if l.startswith('| ')][1:]
  assert [r.split('|')[1].split('(')[0].strip() for r in rows] == [
      'SGD', 'SGD + momentum 0.9', 'Adam', 'CBP']
  accuracies = [float(r.split('|')[3]) for r in rows]
  assert all(a > 0.8 for a in accuracies), done.stdout
  assert re.search(r'6,000 training / 2,000 test', done.stdout)
