"""Precise BatchNorm: cbp_optax_experiments.recalibrate gives population statistics."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import cbp_optax as cbp
from cbp_optax_experiments import recalibrate
from tests.test_center import KeywordCalls

SIZES = (8, 8, 5)  # unequal: batches are weighted by their size
EPS = 1e-5


def shifted_inputs(shape, seed=0, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, dtype) + 1.5


def make_batches(features=3):
  rng = np.random.default_rng(0)
  return [rng.standard_normal((n, features)) * 2.0 + 1.5 for n in SIZES]


def normalize(h, scale, bias):
  """BatchNorm in training mode: the batch's own statistics."""
  return (h - h.mean(0)) / np.sqrt(h.var(0) + EPS) * scale + bias


def dense(x, kernel, bias, mean=0.0):
  return (x - np.asarray(mean)) @ np.asarray(kernel) + np.asarray(bias)


def relative_error(actual, expected):
  actual, expected = np.asarray(actual), np.asarray(expected)
  return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


def pooled(per_batch):
  """Mean and variance of the per-batch arrays concatenated."""
  everything = np.concatenate(per_batch)
  return everything.mean(0), everything.var(0)


class NnxNet(nnx.Module):

  def __init__(self, rngs):
    self.l1 = nnx.Linear(3, 5, param_dtype=jnp.float64, rngs=rngs)
    self.bn1 = nnx.BatchNorm(5, param_dtype=jnp.float64, momentum=0.9,
                             rngs=rngs)
    self.dropout = nnx.Dropout(0.5, rngs=rngs)
    self.l2 = nnx.Linear(5, 4, param_dtype=jnp.float64, rngs=rngs)
    self.bn2 = nnx.BatchNorm(4, param_dtype=jnp.float64, rngs=rngs)

  def __call__(self, x):
    x = self.dropout(nnx.relu(self.bn1(self.l1(x))))
    return self.bn2(self.l2(x))


def float64_statistics(model):
  """NNX BatchNorm keeps its statistics in float32: store them in float64."""
  for _, module in nnx.iter_modules(model):
    if isinstance(module, nnx.BatchNorm):
      for stat in (module.mean, module.var):
        stat.set_value(jnp.asarray(stat.get_value(), jnp.float64))


def linear_of(layer):
  """Kernel, bias and centering mean (0 for a plain layer)."""
  mean = layer.mean[...] if isinstance(layer, cbp.nnx.Centered) else 0.0
  layer = getattr(layer, 'layer', layer)
  return layer.kernel[...], layer.bias[...], mean


def snapshot(tree):
  return [np.array(jax.random.key_data(x) if jnp.issubdtype(
      x.dtype, jax.dtypes.prng_key) else x) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize('centered', [False, True], ids=['plain', 'centered'])
def test_nnx_statistics_equal_the_pooled_inputs_in_float64(centered):
  with jax.enable_x64(True):
    model = NnxNet(nnx.Rngs(0))
    float64_statistics(model)
    if centered:
      assert cbp.nnx.center(model).centered == ['l1', 'l2']
      model(jnp.asarray(make_batches()[0]) + 3.0)  # record a batch mean
      cbp.nnx.transport(model, mean_decay=0.5)    # mu != 0
    batches = make_batches()
    before = snapshot(nnx.state(model, nnx.Not(nnx.Any(
        nnx.PathContains('bn1'), nnx.PathContains('bn2')))))
    paths = recalibrate.nnx_batch_stats(
        model, [jnp.asarray(b) for b in batches])
    assert paths == ['bn1', 'bn2']
    h1 = [dense(x, *linear_of(model.l1)) for x in batches]
    a1 = [np.maximum(normalize(h, model.bn1.scale[...], model.bn1.bias[...]),
                     0) for h in h1]
    h2 = [dense(a, *linear_of(model.l2)) for a in a1]
    for norm, inputs in ((model.bn1, h1), (model.bn2, h2)):
      mean, var = pooled(inputs)
      assert norm.mean.dtype == jnp.float64
      assert relative_error(norm.mean[...], mean) <= 1e-12
      assert relative_error(norm.var[...], var) <= 1e-12
      assert not norm.use_running_average and norm.momentum in (0.9, 0.99)
    # Parameters, centering means, dropout's RNG state: untouched.
    after = snapshot(nnx.state(model, nnx.Not(nnx.Any(
        nnx.PathContains('bn1'), nnx.PathContains('bn2')))))
    for a, b in zip(before, after, strict=True):
      np.testing.assert_array_equal(a, b)


class Block(nnx.Module):

  def __init__(self, rngs):
    self.linear = nnx.Linear(4, 4, param_dtype=jnp.float64, rngs=rngs)
    self.norm = nnx.BatchNorm(4, param_dtype=jnp.float64, rngs=rngs)

  def __call__(self, x):
    return nnx.relu(self.norm(self.linear(x)))


class Stack(nnx.Module):

  def __init__(self, rngs):
    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key):
      return Block(nnx.Rngs(key))

    self.blocks = make(jax.random.split(rngs.params(), 3))

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def run(x, block):
      return block(x)

    return run(x, self.blocks)


def test_nnx_stacked_blocks_get_per_slice_statistics():
  with jax.enable_x64(True):
    model = Stack(nnx.Rngs(0))
    float64_statistics(model)
    cbp.nnx.center(model)
    batches = make_batches(4)
    assert recalibrate.nnx_batch_stats(
        model, [jnp.asarray(b) for b in batches]) == ['blocks/norm']
    norm = model.blocks.norm
    assert norm.mean.shape == (3, 4)
    inputs = batches
    for l in range(3):
      kernel, bias, mu = (np.asarray(a)[l]
                          for a in linear_of(model.blocks.linear))
      h = [dense(x, kernel, bias, mu) for x in inputs]
      mean, var = pooled(h)
      assert relative_error(norm.mean[...][l], mean) <= 1e-12
      assert relative_error(norm.var[...][l], var) <= 1e-12
      inputs = [np.maximum(normalize(x, norm.scale[...][l],
                                     norm.bias[...][l]), 0) for x in h]


class LinenNet(nn.Module):

  @nn.compact
  def __call__(self, x, train: bool = True):
    norm = lambda: nn.BatchNorm(use_running_average=not train,
                                param_dtype=jnp.float64,
                                force_float32_reductions=False)
    x = nn.Dense(5, param_dtype=jnp.float64, name='l1')(x)
    x = nn.relu(norm()(x))
    x = nn.Dropout(0.5, deterministic=not train)(x)
    x = nn.Dense(4, param_dtype=jnp.float64, name='l2')(x)
    return norm()(x)


@pytest.mark.parametrize('centered', [False, True], ids=['plain', 'centered'])
def test_linen_statistics_equal_the_pooled_inputs_in_float64(centered):
  with jax.enable_x64(True):
    model = cbp.linen.center(LinenNet()) if centered else LinenNet()
    batches = make_batches()
    variables = model.init(jax.random.key(0), jnp.asarray(batches[0]),
                           train=False)
    new = recalibrate.linen_batch_stats(
        model.apply, variables, [jnp.asarray(b) for b in batches],
        train=False)
    params = variables['params']
    stats = new['batch_stats']
    h1 = [dense(x, params['l1']['kernel'], params['l1']['bias'])
          for x in batches]
    norm1 = params['BatchNorm_0']
    a1 = [np.maximum(normalize(h, norm1['scale'], norm1['bias']), 0)
          for h in h1]
    h2 = [dense(a, params['l2']['kernel'], params['l2']['bias']) for a in a1]
    for name, inputs in (('BatchNorm_0', h1), ('BatchNorm_1', h2)):
      mean, var = pooled(inputs)
      assert stats[name]['mean'].dtype == jnp.float64
      assert relative_error(stats[name]['mean'], mean) <= 1e-12
      assert relative_error(stats[name]['var'], var) <= 1e-12
    for key in set(variables) - {'batch_stats'}:
      for a, b in zip(snapshot(variables[key]), snapshot(new[key]),
                      strict=True):
        np.testing.assert_array_equal(a, b)


class ScannedBlock(nn.Module):

  @nn.compact
  def __call__(self, x, _):
    x = nn.Dense(4, param_dtype=jnp.float64)(x)
    x = nn.BatchNorm(use_running_average=True, param_dtype=jnp.float64,
                     force_float32_reductions=False)(x)
    return nn.relu(x), None


class LinenStack(nn.Module):

  @nn.compact
  def __call__(self, x):
    layers = nn.scan(ScannedBlock, length=3,
                     variable_axes={'params': 0, 'batch_stats': 0,
                                    'centering': 0},
                     split_rngs={'params': True})
    x, _ = layers(name='layers')(x, None)
    return x


def test_linen_scanned_stack_gets_per_slice_statistics():
  with jax.enable_x64(True):
    model = cbp.linen.center(LinenStack())
    batches = make_batches(4)
    variables = model.init(jax.random.key(0), jnp.asarray(batches[0]))
    stats = recalibrate.linen_batch_stats(
        model.apply, variables, [jnp.asarray(b) for b in batches]
    )['batch_stats']['layers']['BatchNorm_0']
    params = variables['params']['layers']
    assert stats['mean'].shape == (3, 4)
    inputs = batches
    for l in range(3):
      h = [dense(x, params['Dense_0']['kernel'][l],
                 params['Dense_0']['bias'][l]) for x in inputs]
      mean, var = pooled(h)
      assert relative_error(stats['mean'][l], mean) <= 1e-12
      assert relative_error(stats['var'][l], var) <= 1e-12
      norm = params['BatchNorm_0']
      inputs = [np.maximum(normalize(x, norm['scale'][l], norm['bias'][l]), 0)
                for x in h]


def test_recalibration_refuses_what_it_cannot_do():
  with pytest.raises(ValueError, match='no nnx.BatchNorm'):
    recalibrate.nnx_batch_stats(nnx.Linear(2, 2, rngs=nnx.Rngs(0)),
                                    [jnp.ones((2, 2))])
  model = nnx.BatchNorm(2, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='batches is empty'):
    recalibrate.nnx_batch_stats(model, [])
  with pytest.raises(ValueError, match='no batch_stats'):
    recalibrate.linen_batch_stats(nn.Dense(2).apply, {'params': {}},
                                      [jnp.ones((2, 2))])


def test_docstring_examples():
  import doctest  # pylint: disable=g-import-not-at-top
  from cbp_optax_experiments.recalibrate import linen as linen_module  # pylint: disable=g-import-not-at-top
  from cbp_optax_experiments.recalibrate import nnx as nnx_module  # pylint: disable=g-import-not-at-top
  for module in (nnx_module, linen_module):
    failures, tried = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert tried and not failures, module.__name__


# --- center's items 2 and 3: recalibration pools every call and
# weighs by what each call normalized ----------------------------------------------------


class NnxNormTwice(nnx.Module):

  def __init__(self, axis=-1):
    self.norm = nnx.BatchNorm(1, axis=axis, rngs=nnx.Rngs(0))

  def __call__(self, x):
    return self.norm(x) + self.norm(x + 10.0)


class LinenNormTwice(nn.Module):

  @nn.compact
  def __call__(self, x):
    norm = nn.BatchNorm(use_running_average=True)
    return norm(x) + norm(x + 10.0)


def linen_recalibrated(module, batches, sample=None):
  sample = batches[0] if sample is None else sample
  variables = module.init(jax.random.key(0), sample)
  return recalibrate.linen_batch_stats(module.apply, variables, batches)


def test_a_batchnorm_applied_twice_pools_both_calls():
  # Kept the last call only: 12.5 where the mean of all its inputs is 7.5.
  x = jnp.arange(6.0).reshape(6, 1)
  inputs = np.concatenate([np.asarray(x), np.asarray(x) + 10.0])
  model = NnxNormTwice()
  assert recalibrate.nnx_batch_stats(model, [x]) == ['norm']
  stats = linen_recalibrated(LinenNormTwice(), [x])['batch_stats']
  for mean, var in ((model.norm.mean[...], model.norm.var[...]),
                    (stats['BatchNorm_0']['mean'],
                     stats['BatchNorm_0']['var'])):
    np.testing.assert_allclose(mean, [7.5], rtol=1e-6)
    np.testing.assert_allclose(var, inputs.var(0), rtol=1e-6)


def test_a_zero_example_batch_weighs_nothing():
  # Every statistic became NaN, and the NNX model then output NaN.
  full = shifted_inputs((8, 1))
  empty = jnp.zeros((0, 1))
  model = NnxNormTwice()
  recalibrate.nnx_batch_stats(model, [full, empty])
  reference = NnxNormTwice()
  recalibrate.nnx_batch_stats(reference, [full])
  chex.assert_trees_all_close(nnx.state(model, nnx.BatchStat),
                              nnx.state(reference, nnx.BatchStat), rtol=1e-6)
  model.eval()
  assert np.all(np.isfinite(model(full)))
  stats = linen_recalibrated(LinenNormTwice(), [empty, full],
                             sample=full)['batch_stats']
  chex.assert_trees_all_close(
      stats['BatchNorm_0'],
      linen_recalibrated(LinenNormTwice(), [full])['batch_stats']
      ['BatchNorm_0'], rtol=1e-6)


def test_only_empty_batches_are_refused_and_change_nothing():
  model = NnxNormTwice()
  before = jax.tree.map(np.asarray, nnx.state(model, nnx.BatchStat))
  with pytest.raises(ValueError, match="'norm' normalized no example"):
    recalibrate.nnx_batch_stats(model, [jnp.zeros((0, 1))] * 2)
  chex.assert_trees_all_equal(nnx.state(model, nnx.BatchStat), before)
  with pytest.raises(ValueError, match="'BatchNorm_0' normalized no example"):
    linen_recalibrated(LinenNormTwice(), [jnp.zeros((0, 1))],
                       sample=jnp.ones((2, 1)))


def test_time_major_batches_weigh_the_examples_they_hold():
  # Both (T, B, F) batches weighed 5 (their leading axis): 0.5, not 0.99.
  few, many = jnp.zeros((5, 1, 1)), jnp.ones((5, 99, 1))
  model = nnx.Sequential(nnx.BatchNorm(1, rngs=nnx.Rngs(0)))
  recalibrate.nnx_batch_stats(model, [few, many])
  np.testing.assert_allclose(model.layers[0].mean[...], [0.99], rtol=1e-6)
  np.testing.assert_allclose(model.layers[0].var[...], [0.99 * 0.01],
                             rtol=1e-5)
  stats = linen_recalibrated(nn.BatchNorm(use_running_average=False),
                             [few, many])['batch_stats']
  np.testing.assert_allclose(stats['mean'], [0.99], rtol=1e-6)
  np.testing.assert_allclose(stats['var'], [0.99 * 0.01], rtol=1e-5)


def test_masked_calls_weigh_the_positions_the_mask_keeps():
  x = jnp.array([[0.0], [0.0], [9.0], [4.0]])
  mask = jnp.array([[True], [False], [False], [True]])

  class Masked(nnx.Module):

    def __init__(self):
      self.norm = nnx.BatchNorm(1, rngs=nnx.Rngs(0))

    def __call__(self, x):
      return self.norm(x, mask=mask) + self.norm(x[2:3])

  model = Masked()
  recalibrate.nnx_batch_stats(model, [x])
  kept = np.array([0.0, 4.0, 9.0])  # the mask's two positions and 9
  np.testing.assert_allclose(model.norm.mean[...], [kept.mean()], rtol=1e-6)
  np.testing.assert_allclose(model.norm.var[...], [kept.var()], rtol=1e-6)


def test_a_batchnorm_the_forward_pass_never_calls_keeps_its_statistics():
  class Unused(nnx.Module):

    def __init__(self):
      self.used = nnx.BatchNorm(1, rngs=nnx.Rngs(0))
      self.unused = nnx.BatchNorm(1, rngs=nnx.Rngs(0))

    def __call__(self, x):
      return self.used(x)

  model = Unused()
  # It became mean 0 and variance 0 (every later output was x / sqrt(eps)).
  assert recalibrate.nnx_batch_stats(model, [jnp.ones((4, 1))]) == [
      'used']
  np.testing.assert_array_equal(model.unused.var[...], [1.0])


def test_non_finite_statistics_are_refused():
  model = NnxNormTwice()
  with pytest.raises(ValueError, match="'norm' are not finite"):
    recalibrate.nnx_batch_stats(model, [jnp.full((2, 1), jnp.nan)])
  np.testing.assert_array_equal(model.norm.var[...], [1.0])


# --- center's item 12: keyword calls of intercepted Linen layers --------------


def test_linen_layers_called_with_keyword_inputs_are_recalibrated():
  # IndexError: tuple index out of range, in center and in recalibration
  # (tests/test_center.py checks the centering).
  with jax.enable_x64(True):
    model = cbp.linen.center(KeywordCalls())
    x = shifted_inputs((8, 3), dtype=jnp.float64)
    variables = model.init(jax.random.key(0), x)
    new = recalibrate.linen_batch_stats(model.apply, variables, [x])
    h = model.apply(variables, x, capture_intermediates=True,
                    mutable=['intermediates'])[1]['intermediates']
    conv_out = np.asarray(h['Conv_0']['__call__'][0]).reshape(-1, 2)
    # (BatchNorm's statistics are float32.)
    np.testing.assert_allclose(new['batch_stats']['BatchNorm_0']['mean'],
                               conv_out.mean(0), rtol=1e-6)


# --- at schedule-free's evaluation point (cbp.nnx.eval_model, eval_params) ---

F64 = jnp.float64


def inputs(shape, seed, offset=2.0, dtype=F64):
  """Normal inputs far from centered (float64 unless asked: call it inside
  ``jax.enable_x64`` for float64)."""
  return jnp.asarray(
      np.random.default_rng(seed).standard_normal(shape) + offset, dtype)


class BatchNormNet(nnx.Module):

  def __init__(self, rngs):
    self.hidden = nnx.Linear(3, 4, param_dtype=F64, rngs=rngs)
    self.norm = nnx.BatchNorm(4, param_dtype=F64, momentum=0.5, rngs=rngs)
    self.out = nnx.Linear(4, 2, param_dtype=F64, rngs=rngs)

  def __call__(self, x):
    return self.out(jnp.tanh(self.norm(self.hidden(x))))


def test_nnx_recalibrate_the_eval_model_at_the_evaluation_point():
  with jax.enable_x64(True):
    model = BatchNormNet(nnx.Rngs(0))
    cbp.nnx.center(model)
    optimizer = cbp.nnx.Optimizer(
        model, optax.contrib.schedule_free_adamw(0.1, b1=0.8))
    step = cbp.nnx.train_step(lambda m, x: jnp.mean((m(x) - 1.0) ** 2))
    batches = [inputs((8, 3), seed, 2.0) for seed in range(3)]
    for batch in batches:
      step(model, optimizer, batch)
    trained_stats = np.asarray(model.norm.mean[...])
    evaluated = cbp.nnx.eval_model(model, optimizer)
    recalibrate.nnx_batch_stats(evaluated, batches)
    # The statistics are those of the BatchNorm's input at x, not at y.
    hidden = evaluated.hidden(jnp.concatenate(batches))
    # (BatchNorm keeps its statistics in float32.)
    np.testing.assert_allclose(evaluated.norm.mean[...], hidden.mean(0),
                               rtol=1e-6)
    np.testing.assert_allclose(evaluated.norm.var[...], hidden.var(0),
                               rtol=1e-6)
    assert not np.allclose(evaluated.norm.mean[...],
                           model.hidden(jnp.concatenate(batches)).mean(0))
    np.testing.assert_array_equal(model.norm.mean[...], trained_stats)


def test_linen_recalibrate_at_the_evaluation_point():
  # float32: Linen's BatchNorm keeps its statistics in float32.
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
      x = nn.Dense(4, name='hidden')(x)
      x = nn.BatchNorm(use_running_average=not train)(x)
      return nn.Dense(2)(jnp.tanh(x))

  model = cbp.linen.center(Net())
  batches = [inputs((8, 3), seed, 2.0, jnp.float32) for seed in range(3)]
  variables = model.init(jax.random.key(0), batches[0])
  state = cbp.linen.TrainState.create(
      apply_fn=model.apply, params=variables['params'],
      centering=variables['centering'],
      model_state={'batch_stats': variables['batch_stats']},
      tx=optax.contrib.schedule_free_adamw(0.1, b1=0.8))
  step = cbp.linen.train_step(lambda apply, x: jnp.mean((apply(x) - 1.) ** 2))
  for batch in batches:
    state, _ = step(state, batch)
  params = cbp.linen.eval_params(state.params, state.opt_state)
  recalibrated = recalibrate.linen_batch_stats(
      model.apply, {'params': params, 'centering': state.centering,
                    **state.model_state}, batches, train=False)
  # The BatchNorm's input at x: the centered hidden layer's output.
  hidden = nn.Dense(4).apply(
      {'params': params['hidden']}, jnp.concatenate(batches)) - (
          state.centering['hidden']['mean'].value @ params['hidden']['kernel'])
  np.testing.assert_allclose(
      recalibrated['batch_stats']['BatchNorm_0']['mean'], hidden.mean(0),
      rtol=1e-5)
  trained = state.model_state['batch_stats']['BatchNorm_0']['mean']
  assert not np.allclose(trained, hidden.mean(0), rtol=1e-3)
