"""``center`` (NNX and Linen): tied variables, repeated calls, keyword calls, stacks.

Tied variables (item 1), a layer called several times in one forward pass
(item 2), keyword calls of intercepted Linen layers (item 12) and the message
for an ``nn.scan`` without the centering collection (item 13). Each test here
failed before the fix it names. Recalibration's part of items 2, 3 and 12
(zero-example and time-major batches) is tested with the experiments
(experiments/tests/test_experiments_recalibrate.py).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import cbp_optax as cbp
from cbp_optax import centering


def linear(din, dout, seed):
  """An ``nnx.Linear`` in float64 under ``jax.enable_x64``, else float32."""
  return nnx.Linear(din, dout, param_dtype=jnp.result_type(float),
                    rngs=nnx.Rngs(seed))


def shifted_inputs(shape, seed=0, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, dtype) + 1.5


def assert_transport_keeps_the_function(model, x):
  """One recording forward pass, a full transport, the same outputs."""
  model.train()
  model(x)
  model.eval()
  before = model(x)
  cbp.nnx.transport(model, mean_decay=0.0)
  np.testing.assert_allclose(model(x), before, rtol=0, atol=1e-12)
  model.train()


# --- item 1: tied variables --------------------------------------------------


class Tied(nnx.Module):

  def __init__(self, tie):
    self.a = linear(3, 3, 0)
    self.b = linear(3, 3, 1)
    if 'kernel' in tie:
      self.b.kernel = self.a.kernel
    if 'bias' in tie:
      self.b.bias = self.a.bias

  def __call__(self, x):
    return self.b(jnp.tanh(self.a(x)))


@pytest.mark.parametrize('tie', [('bias',), ('kernel', 'bias')])
def test_center_refuses_layers_that_share_a_bias(tie):
  # The output moved by 2.26 (bias) and 2.18 (kernel and bias) at the
  # first transport, float64, evaluation mode.
  model = Tied(tie)
  with pytest.raises(centering.CannotCenterError,
                     match=r"'a/bias' and 'b/bias'.*where=lambda path, "
                           r"layer: path not in \['a', 'b'\]"):
    cbp.nnx.center(model)
  assert type(model.a) is nnx.Linear and type(model.b) is nnx.Linear


def test_sharing_only_the_kernel_stays_allowed_and_exact():
  with jax.enable_x64(True):
    model = Tied(('kernel',))
    assert cbp.nnx.center(model).centered == ['a', 'b']
    assert_transport_keeps_the_function(
        model, shifted_inputs((16, 3), dtype=jnp.float64))


def test_leaving_every_holder_of_a_tied_bias_out_is_accepted():
  class Three(Tied):

    def __init__(self):
      super().__init__(('bias',))
      self.c = linear(3, 1, 2)

    def __call__(self, x):
      return self.c(super().__call__(x))

  with jax.enable_x64(True):
    model = Three()
    report = cbp.nnx.center(
        model, where=lambda path, _: path not in ['a', 'b'])
    assert report.centered == ['c']
    assert_transport_keeps_the_function(
        model, shifted_inputs((16, 3), dtype=jnp.float64))
    # Leaving out one holder only is not enough: the other still moves it.
    with pytest.raises(centering.CannotCenterError, match="'b'"):
      cbp.nnx.center(Three(), where=lambda path, _: path != 'a')


def test_a_bias_another_module_reads_is_refused():
  # Not only two layers: any other holder of the Variable would compute
  # with the transported bias b~ instead of the layer's bias.
  class Offset(nnx.Module):

    def __init__(self, param):
      self.offset = param

    def __call__(self, x):
      return x + self.offset[...]

  class Model(nnx.Module):

    def __init__(self):
      self.dense = linear(3, 3, 0)
      self.offset = Offset(self.dense.bias)
      self.aliases = nnx.List([self.dense.bias])

  with pytest.raises(centering.CannotCenterError,
                     match="'aliases/0' and 'dense/bias' and 'offset/offset'"):
    cbp.nnx.center(Model())


def test_an_existing_centered_layer_with_a_tied_bias_is_refused():
  class Model(nnx.Module):

    def __init__(self):
      self.a = cbp.nnx.Centered(linear(3, 3, 0))
      self.b = linear(3, 3, 1)
      self.b.bias = self.a.layer.bias

  with pytest.raises(centering.CannotCenterError,
                     match="'a/layer/bias' and 'b/bias'"):
    cbp.nnx.center(Model(), where=lambda path, _: path != 'b')


def test_a_refused_layer_leaves_the_whole_model_as_it_was():
  # The layers before the refused one were already wrapped: the model was
  # left half centered.
  shared = nnx.Linear(3, 3, rngs=nnx.Rngs(1))
  model = nnx.Sequential(nnx.Linear(3, 3, rngs=nnx.Rngs(0)), shared,
                         jnp.tanh, shared)
  with pytest.raises(ValueError, match="'layers/1' and 'layers/3'"):
    cbp.nnx.center(model)
  assert type(model.layers[0]) is nnx.Linear
  tied = Tied(('bias',))
  tied.first = nnx.Linear(3, 3, rngs=nnx.Rngs(2))
  with pytest.raises(centering.CannotCenterError):
    cbp.nnx.center(tied)
  assert type(tied.first) is nnx.Linear


class MaskedByMapVariables(nn.Module):
  """``nn.map_variables``, Linen's way to tie or mask weights."""

  def upper(self, variables):
    if self.is_initializing():
      return variables
    return jax.tree_util.tree_map_with_path(
        lambda path, w: (w * jnp.triu(jnp.ones_like(w))
                         if 'kernel' in str(path[-1]) else w), variables)

  @nn.compact
  def __call__(self, x):
    masked = nn.map_variables(nn.Dense, 'params', self.upper,
                              init=self.is_initializing())
    return masked(3, param_dtype=jnp.float64, name='masked')(
        nn.Dense(3, param_dtype=jnp.float64, name='plain')(x))


def test_linen_layers_under_map_variables_are_left_as_they_are():
  # The transport moved the stored bias by the unmasked kernel: the output
  # moved by 0.31.
  with jax.enable_x64(True):
    model = cbp.linen.center(MaskedByMapVariables())
    x = shifted_inputs((16, 3), dtype=jnp.float64)
    report = model.report(jax.random.key(0), x)
    assert report.centered == ['plain']
    assert dict(report.skipped)['masked'].startswith(
        'inside nn.map_variables')
    variables = model.init(jax.random.key(0), x)
    assert list(variables['centering']) == ['plain']
    y, changed = model.apply(variables, x, mutable=['centering'])
    params, centering_ = cbp.linen.transport(
        variables['params'], changed['centering'], 0.0)
    assert not np.allclose(centering_['plain']['mean'].value, 0.0)
    y_new = model.apply({'params': params, 'centering': centering_}, x)
    np.testing.assert_allclose(y_new, y, rtol=0, atol=1e-12)


# --- item 2: a layer called several times in one forward pass -----------------

# Time step t has mean t (and a spread, so the pooled mean is not trivial).
STEPS = jnp.stack([jnp.full((4, 2), float(t)) for t in range(4)]
                  ) + jnp.array([[[-1.0], [1.0], [0.0], [0.0]]])


class NnxCell(nnx.Module):

  def __init__(self):
    self.cell = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

  def __call__(self, xs):
    h = jnp.zeros((xs.shape[1], 2))
    for x in xs:  # unrolled
      h = jnp.tanh(self.cell(x) + h)
    return h


class LinenCell(nn.Module):

  @nn.compact
  def __call__(self, xs):
    cell, h = nn.Dense(2), jnp.zeros((xs.shape[1], 2))
    for x in xs:
      h = jnp.tanh(cell(x) + h)
    return h


def test_nnx_unrolled_cell_records_the_mean_over_every_call():
  # Recorded 3.0 (the last step's mean) where 1.5 is the mean of the inputs.
  model = NnxCell()
  cbp.nnx.center(model)
  model(STEPS)
  np.testing.assert_allclose(model.cell.batch_mean[...], [1.5, 1.5])
  np.testing.assert_array_equal(model.cell.batch_count[...], [16.0])
  model.eval()
  before = model(STEPS)
  cbp.nnx.transport(model, mean_decay=0.0)
  np.testing.assert_allclose(model.cell.mean[...], [1.5, 1.5])
  np.testing.assert_allclose(model(STEPS), before, atol=1e-6)
  # The transport restarts the recording: the next forward pass records
  # only its own calls.
  np.testing.assert_array_equal(model.cell.batch_count[...], [0.0])
  model.train()
  model(STEPS[:1])
  np.testing.assert_allclose(model.cell.batch_mean[...], [0.0, 0.0])


def test_linen_unrolled_cell_records_the_mean_over_every_call():
  model = cbp.linen.center(LinenCell())
  variables = model.init(jax.random.key(0), STEPS)
  y, changed = model.apply(variables, STEPS, mutable=['centering'])
  entry = changed['centering']['Dense_0']
  np.testing.assert_allclose(entry['batch_mean'], [1.5, 1.5])
  np.testing.assert_array_equal(entry['batch_count'], [16.0])
  params, centering_ = cbp.linen.transport(
      variables['params'], changed['centering'], 0.0)
  np.testing.assert_allclose(centering_['Dense_0']['mean'].value, [1.5, 1.5])
  np.testing.assert_array_equal(centering_['Dense_0']['batch_count'], [0.0])
  y_new = model.apply({'params': params, 'centering': centering_}, STEPS)
  np.testing.assert_allclose(y_new, y, atol=1e-6)


def test_calls_are_weighted_by_the_positions_each_saw():
  # One example of 0 and three of 4: the mean of the inputs is 3, not 2.
  small, large = jnp.zeros((1, 2)), jnp.full((3, 2), 4.0)
  layer = cbp.nnx.Centered(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
  layer(small)
  layer(large)
  np.testing.assert_allclose(layer.batch_mean[...], [3.0, 3.0])

  class Twice(nn.Module):

    @nn.compact
    def __call__(self, a, b):
      dense = nn.Dense(2)
      return dense(a).sum() + dense(b).sum()

  model = cbp.linen.center(Twice())
  variables = model.init(jax.random.key(0), small, large)
  _, changed = model.apply(variables, small, large, mutable=['centering'])
  np.testing.assert_allclose(changed['centering']['Dense_0']['batch_mean'],
                             [3.0, 3.0])
  # A convolution weighs each call by its batch and spatial positions.
  conv = cbp.nnx.Centered(nnx.Conv(1, 1, (1, 1), rngs=nnx.Rngs(0)))
  conv(jnp.zeros((1, 4, 4, 1)))  # 16 positions of 0
  conv(jnp.full((1, 2, 2, 1), 5.0))  # 4 positions of 5
  np.testing.assert_allclose(conv.batch_mean[...], [1.0])


def test_a_call_without_input_positions_records_nothing():
  layer = cbp.nnx.Centered(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
  layer(jnp.ones((3, 2)))
  layer(jnp.ones((0, 2)))
  np.testing.assert_array_equal(layer.batch_mean[...], [1.0, 1.0])
  np.testing.assert_array_equal(layer.batch_count[...], [3.0])


class Block(nnx.Module):
  """A block that applies its one layer twice."""

  def __init__(self, rngs):
    self.linear = nnx.Linear(2, 2, rngs=rngs)

  def __call__(self, x):
    # Calls at x and x + 2; passes x + 2 on.
    return x + 2.0 + 0.0 * self.linear(self.linear(x) * 0.0 + x + 2.0)


class Blocks(nnx.Module):

  def __init__(self):
    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key):
      return Block(nnx.Rngs(key))

    self.blocks = make(jax.random.split(jax.random.key(0), 3))

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def run(x, block):
      return block(x)

    return run(x, self.blocks)


def test_nnx_stacked_layer_called_twice_pools_both_calls_per_slice():
  model = Blocks()
  cbp.nnx.center(model)
  x = jnp.ones((4, 2))

  @nnx.jit
  def forward(model, x):
    return model(x)

  forward(model, x)
  layer = model.blocks.linear
  # Slice l sees x_l and x_l + 2, with x_0 = 1 and x_{l+1} = x_l + 2.
  np.testing.assert_allclose(layer.batch_mean[...],
                             [[2.0, 2.0], [4.0, 4.0], [6.0, 6.0]])
  assert layer.batch_count.shape == (3, 1)
  np.testing.assert_array_equal(layer.batch_count[...], [[8.0]] * 3)
  before = forward(model, x)
  cbp.nnx.transport(model, mean_decay=0.0)
  np.testing.assert_array_equal(layer.batch_count[...], [[0.0]] * 3)
  np.testing.assert_allclose(layer.mean[...],
                             [[2.0, 2.0], [4.0, 4.0], [6.0, 6.0]])
  model.eval()
  np.testing.assert_allclose(forward(model, x), before, atol=1e-5)


class LinenBlock(nn.Module):

  @nn.compact
  def __call__(self, x, _):
    dense = nn.Dense(2)
    return x + 2.0 + 0.0 * dense(dense(x) * 0.0 + x + 2.0), None


class LinenBlocks(nn.Module):

  @nn.compact
  def __call__(self, x):
    layers = nn.scan(LinenBlock, length=3, split_rngs={'params': True},
                     variable_axes={'params': 0, 'centering': 0})
    return layers(name='layers')(x, None)[0]


def test_linen_scanned_layer_called_twice_pools_both_calls_per_slice():
  model = cbp.linen.center(LinenBlocks())
  x = jnp.ones((4, 2))
  variables = model.init(jax.random.key(0), x)
  y, changed = jax.jit(
      lambda v, x: model.apply(v, x, mutable=['centering']))(variables, x)
  entry = changed['centering']['layers']['Dense_0']
  np.testing.assert_allclose(entry['batch_mean'],
                             [[2.0, 2.0], [4.0, 4.0], [6.0, 6.0]])
  np.testing.assert_array_equal(entry['batch_count'], [[8.0]] * 3)
  params, centering_ = cbp.linen.transport(
      variables['params'], changed['centering'], 0.0)
  y_new = model.apply({'params': params, 'centering': centering_}, x)
  np.testing.assert_allclose(y_new, y, atol=1e-5)


def test_fused_steps_transport_the_mean_over_every_call():
  # Both train_steps: mu moves toward the mean over all the calls, and the
  # next step records afresh (the count is back to zero after each).
  def nnx_loss(model, xs):
    return jnp.mean(model(xs) ** 2)

  model = NnxCell()
  cbp.nnx.center(model)
  optimizer = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)
  step = cbp.nnx.train_step(nnx_loss, mean_decay=0.5)
  step(model, optimizer, STEPS)
  np.testing.assert_allclose(model.cell.mean[...], [0.75, 0.75])
  np.testing.assert_array_equal(model.cell.batch_count[...], [0.0])
  step(model, optimizer, STEPS)
  np.testing.assert_allclose(model.cell.mean[...], [1.125, 1.125])

  linen = cbp.linen.center(LinenCell())
  variables = linen.init(jax.random.key(0), STEPS)
  state = cbp.linen.TrainState.create(
      apply_fn=linen.apply, params=variables['params'],
      centering=variables['centering'], tx=optax.sgd(0.0))
  linen_step = cbp.linen.train_step(
      lambda apply, xs: jnp.mean(apply(xs) ** 2), mean_decay=0.5)
  state, _ = linen_step(state, STEPS)
  state, _ = linen_step(state, STEPS)
  np.testing.assert_allclose(state.centering['Dense_0']['mean'].value,
                             [1.125, 1.125])
  np.testing.assert_array_equal(state.centering['Dense_0']['batch_count'],
                                [0.0])


def test_a_linen_collection_without_a_count_records_the_last_call():
  # Collections built before the count existed keep working as they did.
  model = cbp.linen.center(LinenCell())
  variables = model.init(jax.random.key(0), STEPS)
  old = {'Dense_0': {k: v for k, v in variables['centering']['Dense_0'].items()
                     if k != 'batch_count'}}
  _, changed = model.apply({'params': variables['params'], 'centering': old},
                           STEPS, mutable=['centering'])
  assert set(changed['centering']['Dense_0']) == {'mean', 'batch_mean'}
  np.testing.assert_allclose(changed['centering']['Dense_0']['batch_mean'],
                             [3.0, 3.0])
  params, centering_ = cbp.linen.transport(variables['params'],
                                           changed['centering'], 0.0)
  assert set(centering_['Dense_0']) == {'mean', 'batch_mean'}


# --- item 12: keyword calls of intercepted Linen layers ----------------------


class KeywordCalls(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(3, param_dtype=jnp.float64)(inputs=x)
    x = nn.DenseGeneral(3, param_dtype=jnp.float64)(inputs=x)
    x = nn.Conv(2, (1,), param_dtype=jnp.float64)(inputs=x[:, None, :])
    return nn.BatchNorm(use_running_average=True)(x=x)


def test_linen_layers_called_with_keyword_inputs_are_centered():
  # IndexError: tuple index out of range, in center and in recalibration
  # (experiments/tests/test_experiments_recalibrate.py).
  with jax.enable_x64(True):
    model = cbp.linen.center(KeywordCalls())
    x = shifted_inputs((8, 3), dtype=jnp.float64)
    assert model.report(jax.random.key(0), x).centered == [
        'Conv_0', 'DenseGeneral_0', 'Dense_0']
    variables = model.init(jax.random.key(0), x)
    y, changed = model.apply(variables, x, mutable=['centering'])
    params, centering_ = cbp.linen.transport(variables['params'],
                                             changed['centering'], 0.0)
    y_new = model.apply(dict(variables, params=params, centering=centering_),
                        x)
    np.testing.assert_allclose(y_new, y, rtol=0, atol=1e-12)


# --- item 13 (part): nn.scan without the centering collection -----------------


def test_linen_scan_without_centering_axes_says_what_to_add():
  # Flax's "Tried to access "mean" from collection "centering" ... but the
  # collection is empty".
  class Scanned(nn.Module):

    @nn.compact
    def __call__(self, x):
      layers = nn.scan(LinenBlock, length=3, split_rngs={'params': True},
                       variable_axes={'params': 0})
      return layers(name='layers')(x, None)[0]

  model = cbp.linen.center(Scanned())
  with pytest.raises(ValueError,
                     match=r"'layers/Dense_0' finds no 'centering' collection"
                           r".*variable_axes=\{'params': 0, 'centering': 0\}"):
    model.init(jax.random.key(0), jnp.ones((2, 2)))
  ok = cbp.linen.center(LinenBlocks())
  variables = ok.init(jax.random.key(0), jnp.ones((2, 2)))
  with pytest.raises(ValueError, match='pass it with the parameters'):
    ok.apply({'params': variables['params']}, jnp.ones((2, 2)))
