"""Precise BatchNorm: cbp_optax_experiments.recalibrate gives population statistics."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import cbp_optax as cbp
from cbp_optax_experiments import recalibrate

SIZES = (8, 8, 5)  # unequal: batches are weighted by their size
EPS = 1e-5


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
