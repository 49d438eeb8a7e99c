"""M2 on the models people train: stacks, attention, one-call centering, refusals.

Every exactness check runs in float64: record means on an input far from
centered, transport with ``mean_decay=0`` (``mu`` jumps to the batch mean, the
largest possible move), and compare the model's outputs before and after.
"""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import cbp_optax as cbp
from cbp_optax import centering as core
from cbp_optax import linen as cbp_linen
from cbp_optax import nnx as cbp_nnx
from tests import numpy_reference as ref

F64_TOLERANCE = 1e-12


def inputs(shape, seed, offset=2.0, dtype=jnp.float64):
  return jnp.asarray(
      np.random.default_rng(seed).standard_normal(shape) + offset, dtype)


def max_relative(a, b):
  return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def nnx_transport_change(model, forward, x_record, x_eval):
  """Max relative output change when ``model``'s means jump to ``x_record``'s."""
  before = forward(model, x_eval)
  forward(model, x_record)  # training mode: records batch means
  cbp_nnx.transport(model, 0.0)
  model.eval()
  after = forward(model, x_eval)
  model.train()
  return max_relative(after, before)


def nnx_means(model):
  return [m.mean[...] for m in cbp_nnx.centered_layers(model)]


# ----------------------------------------------------------------------------
# NNX layer stacks

class Stack(nnx.Module):
  """``depth`` centered layers built by ``nnx.vmap``, run by ``nnx.scan``.

  The partition name records the stack axis in the means: a stack as long as
  a feature size (three convolutions of three channels) is ambiguous from
  shapes alone, and refused without it (tests/test_checks.py).
  """

  def __init__(self, make_layer, depth, rngs, out_axes=0):

    @nnx.split_rngs(splits=depth)
    @nnx.vmap(in_axes=0, out_axes=out_axes,
              transform_metadata={nnx.PARTITION_NAME: 'layers'})
    def create(rngs):
      return cbp_nnx.Centered(make_layer(rngs))

    self.out_axes = out_axes
    self.layers = create(rngs)

  def __call__(self, x):

    @nnx.scan(in_axes=(nnx.Carry, self.out_axes), out_axes=nnx.Carry)
    def body(x, layer):
      return jnp.tanh(layer(x))

    return body(x, self.layers)


STACKS = [
    ('dense', lambda r: nnx.Linear(5, 5, param_dtype=jnp.float64, rngs=r),
     (8, 5), 0),
    ('dense_axis1', lambda r: nnx.Linear(5, 5, param_dtype=jnp.float64,
                                         rngs=r), (8, 5), 1),
    ('conv', lambda r: nnx.Conv(3, 3, (3, 3), padding='SAME',
                                param_dtype=jnp.float64, rngs=r),
     (2, 6, 6, 3), 0),
    ('conv_grouped_masked', lambda r: nnx.Conv(
        4, 4, (3, 3), feature_group_count=2, padding='SAME',
        mask=jnp.asarray(np.random.default_rng(0).integers(0, 2, (3, 3, 2, 4)),
                         jnp.float64),
        param_dtype=jnp.float64, rngs=r), (2, 6, 6, 4), 0),
    ('conv_transpose_axis1', lambda r: nnx.ConvTranspose(
        4, 4, (3, 3), padding='CIRCULAR', transpose_kernel=True,
        param_dtype=jnp.float64, rngs=r), (2, 6, 6, 4), 1),
]


@pytest.mark.parametrize('name, make_layer, shape, out_axes', STACKS,
                         ids=[s[0] for s in STACKS])
def test_nnx_stack_transport_is_exact(name, make_layer, shape, out_axes):
  del name
  with jax.enable_x64(True):
    depth = 3
    model = Stack(make_layer, depth, nnx.Rngs(0), out_axes=out_axes)
    change = nnx_transport_change(
        model, lambda m, x: m(x), inputs(shape, 1, 5.0), inputs(shape, 2))
    assert change <= F64_TOLERANCE, change
    means = np.asarray(nnx_means(model)[0])
    # Each slice moved to its own layer's recorded mean, not a shared one.
    assert means.shape[out_axes] == depth
    if depth > 1:
      first, second = np.take(means, 0, out_axes), np.take(means, 1, out_axes)
      assert not np.allclose(first, second)


def test_nnx_stack_of_centered_conv_transports_each_slice():
  # The bug report: a stacked centered conv crashed in transport.
  with jax.enable_x64(True):
    model = Stack(STACKS[2][1], 3, nnx.Rngs(1))
    change = nnx_transport_change(
        model, lambda m, x: m(x), inputs((2, 6, 6, 3), 3, 4.0),
        inputs((2, 6, 6, 3), 4))
  assert change <= F64_TOLERANCE


# ----------------------------------------------------------------------------
# Linen layer stacks

class LinenBody(nn.Module):

  @nn.compact
  def __call__(self, x, _):
    return jnp.tanh(cbp_linen.Centered(nn.Dense(5, param_dtype=jnp.float64))(
        x)), None


class LinenScanned(nn.Module):
  depth: int = 3

  @nn.compact
  def __call__(self, x):
    body = nn.scan(LinenBody, variable_axes={'params': 0, 'centering': 0},
                   split_rngs={'params': True}, length=self.depth)
    x, _ = body()(x, None)
    return x


class PlainBody(nn.Module):

  @nn.compact
  def __call__(self, x, _):
    x = nn.Conv(3, (3, 3), param_dtype=jnp.float64)(x)
    return jnp.tanh(nn.Dense(3, param_dtype=jnp.float64)(x)), None


class PlainScanned(nn.Module):

  @nn.compact
  def __call__(self, x):
    body = nn.scan(PlainBody, variable_axes={'params': 0, 'centering': 0},
                   split_rngs={'params': True}, length=3)
    x, _ = body()(x, None)
    return x


class PlainVmapped(nn.Module):

  @nn.compact
  def __call__(self, x):
    dense = nn.vmap(nn.Dense, in_axes=0, out_axes=0,
                    variable_axes={'params': 0, 'centering': 0},
                    split_rngs={'params': True})
    return dense(4, param_dtype=jnp.float64)(x)


def linen_transport_change(model, x_record, x_eval):
  variables = model.init(jax.random.key(0), x_eval)
  params, centering = variables['params'], variables['centering']
  before = model.apply(variables, x_eval)
  _, mutated = model.apply(variables, x_record, mutable=['centering'])
  params, centering = cbp_linen.transport(params, mutated['centering'], 0.0)
  after = model.apply({'params': params, 'centering': centering}, x_eval)
  return max_relative(after, before), params, centering


@pytest.mark.parametrize('make, shape', [
    (lambda: LinenScanned(), (8, 5)),
    (lambda: cbp_linen.center(PlainScanned()), (2, 5, 5, 3)),
    (lambda: cbp_linen.center(PlainVmapped()), (3, 6, 5)),
], ids=['wrapped_scan', 'center_scan_conv_dense', 'center_vmap'])
def test_linen_stack_transport_is_exact(make, shape):
  with jax.enable_x64(True):
    change, _, centering = linen_transport_change(
        make(), inputs(shape, 1, 5.0), inputs(shape, 2))
  assert change <= F64_TOLERANCE, change
  boxes = jax.tree.leaves(
      centering, is_leaf=lambda x: isinstance(x, cbp_linen.CenteringMean))
  boxes = [b for b in boxes if isinstance(b, cbp_linen.CenteringMean)]
  assert boxes and all(b.stack_axes == (0,) for b in boxes)


# ----------------------------------------------------------------------------
# Attention and general dense layers

def test_nnx_center_attention_is_exact():
  with jax.enable_x64(True):
    attention = nnx.MultiHeadAttention(
        num_heads=2, in_features=8, qkv_features=8, decode=False,
        param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    wrapper = nnx.Sequential(attention)
    report = cbp_nnx.center(wrapper)
    assert report.centered == ['layers/0/key', 'layers/0/out',
                               'layers/0/query', 'layers/0/value']
    forward = lambda m, x: m(x)
    change = nnx_transport_change(wrapper, forward, inputs((2, 5, 8), 1, 3.0),
                                  inputs((2, 5, 8), 2))
  assert change <= F64_TOLERANCE, change


@pytest.mark.parametrize('module', [
    nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8,
                                    param_dtype=jnp.float64),
    nn.SelfAttention(num_heads=2, qkv_features=8, param_dtype=jnp.float64),
], ids=['mhdpa', 'self_attention'])
def test_linen_center_attention_is_exact(module):
  with jax.enable_x64(True):
    model = cbp_linen.center(module)
    x = inputs((2, 5, 8), 2)
    centered, _ = model.report(jax.random.key(0), x)
    assert centered == ['key', 'out', 'query', 'value']
    change, _, _ = linen_transport_change(model, inputs((2, 5, 8), 1, 3.0), x)
  assert change <= F64_TOLERANCE, change


@pytest.mark.parametrize('axis', [(-1, -2), (-2, -1), (1, 2)])
def test_linen_dense_general_any_axis_order(axis):
  # The kernel's input axes follow the ascending input axes, whatever order
  # `axis` was given in; the mean must be laid out the same way.
  with jax.enable_x64(True):
    model = cbp_linen.Centered(nn.DenseGeneral(4, axis=axis,
                                               param_dtype=jnp.float64))
    change, _, _ = linen_transport_change(
        model, inputs((5, 3, 2), 1, 4.0), inputs((5, 3, 2), 2))
  assert change <= F64_TOLERANCE, change


# ----------------------------------------------------------------------------
# One-call centering of unmodified models

class TutorialCNN(nnx.Module):
  """The Flax NNX MNIST tutorial's CNN, with BatchNorm and dropout."""

  def __init__(self, rngs, dtype=jnp.float32):
    kw = dict(param_dtype=dtype, rngs=rngs)
    self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), **kw)
    self.batch_norm1 = nnx.BatchNorm(8, **kw)
    self.conv2 = nnx.Conv(8, 16, kernel_size=(3, 3), **kw)
    self.batch_norm2 = nnx.BatchNorm(16, **kw)
    self.avg_pool = lambda x: nnx.avg_pool(x, (2, 2), strides=(2, 2))
    self.linear1 = nnx.Linear(7 * 7 * 16, 32, **kw)
    self.dropout = nnx.Dropout(0.3)
    self.linear2 = nnx.Linear(32, 10, **kw)

  def __call__(self, x, rngs=None):
    x = self.avg_pool(nnx.relu(self.batch_norm1(self.conv1(x))))
    x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
    x = x.reshape(x.shape[0], -1)
    x = self.dropout(nnx.relu(self.linear1(x)), rngs=rngs)
    return self.linear2(x)


def test_nnx_center_tutorial_cnn_computes_the_same():
  with jax.enable_x64(True):
    model = TutorialCNN(nnx.Rngs(0), jnp.float64)
    x = inputs((4, 28, 28, 1), 0)
    model.eval()
    before = model(x)
    report = cbp_nnx.center(model)
    assert report.centered == ['conv1', 'conv2', 'linear1', 'linear2']
    skipped = dict(report.skipped)
    assert set(skipped) == {'batch_norm1', 'batch_norm2'}
    assert skipped['batch_norm1'].startswith('BatchNorm: not a layer type')
    model.eval()
    np.testing.assert_array_equal(model(x), before)
    # Centering twice changes nothing.
    assert cbp_nnx.center(model).centered == []


def test_nnx_center_where_filters_by_type_and_path():
  model = TutorialCNN(nnx.Rngs(0))
  report = cbp_nnx.center(model, where=nnx.Linear)
  assert report.centered == ['linear1', 'linear2']
  assert ('conv1', 'not selected by where') in report.skipped
  model = TutorialCNN(nnx.Rngs(0))
  report = cbp_nnx.center(model, where=lambda path, _: path == 'conv2')
  assert report.centered == ['conv2']


class Block(nnx.Module):
  """A pre-LayerNorm transformer block."""

  def __init__(self, width, rngs):
    kw = dict(param_dtype=jnp.float64, rngs=rngs)
    self.norm1 = nnx.LayerNorm(width, **kw)
    self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=width,
                                       decode=False, **kw)
    self.norm2 = nnx.LayerNorm(width, **kw)
    self.up = nnx.Linear(width, 2 * width, **kw)
    self.down = nnx.Linear(2 * width, width, **kw)

  def __call__(self, x):
    mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
    x = x + self.attn(self.norm1(x), mask=mask)
    return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class Transformer(nnx.Module):

  def __init__(self, width, depth, rngs):

    @nnx.split_rngs(splits=depth)
    @nnx.vmap(in_axes=0, out_axes=0)
    def create(rngs):
      return Block(width, rngs)

    self.embed = nnx.Linear(3, width, param_dtype=jnp.float64, rngs=rngs)
    self.blocks = create(rngs)
    self.head = nnx.Linear(width, 3, param_dtype=jnp.float64, rngs=rngs)

  def __call__(self, x):

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(x, block):
      return block(x)

    return self.head(body(self.embed(x), self.blocks))


def test_nnx_center_scanned_transformer_is_exact_and_stack_blocks_found():
  with jax.enable_x64(True):
    model = Transformer(8, 3, nnx.Rngs(0))
    x = inputs((2, 5, 3), 2)
    before = model(x)
    report = cbp_nnx.center(model)
    assert 'blocks/attn/query' in report.centered
    assert 'blocks/down' in report.centered
    np.testing.assert_array_equal(model(x), before)
    change = nnx_transport_change(model, lambda m, x: m(x),
                                  inputs((2, 5, 3), 1, 4.0), x)
    assert change <= F64_TOLERANCE, change

    stacked = cbp_nnx.stacked_blocks(model)
    params = nnx.state(model, nnx.Param)
    names = cbp.block_names(params, stacked=stacked)
    # One M1 block per layer slice of every stacked layer, none for others.
    assert sum(n.startswith('blocks/down') for n in names) == 3
    assert sum(n.startswith('blocks/norm1') for n in names) == 3
    assert sum(n.startswith('head') for n in names) == 1
    assert stacked == cbp_nnx.stacked_blocks(model, 'blocks')


def test_linen_center_reports_and_preserves_params():
  class CNN(nn.Module):

    @nn.compact
    def __call__(self, x, train: bool = False):
      x = nn.Conv(4, (3, 3))(x)
      x = nn.BatchNorm(use_running_average=not train)(x)
      x = nn.Embed(5, 4)(jnp.zeros(x.shape[:1], jnp.int32))[:, None, None] + x
      return nn.Dense(3)(nn.relu(x).reshape(x.shape[0], -1))

  x = inputs((2, 6, 6, 1), 0, dtype=jnp.float32)
  plain = CNN().init(jax.random.key(0), x)
  model = cbp_linen.center(CNN())
  variables = model.init(jax.random.key(0), x)
  chex.assert_trees_all_equal(variables['params'], plain['params'])
  assert sorted(variables['centering']) == ['Conv_0', 'Dense_0']
  np.testing.assert_array_equal(model.apply(variables, x),
                                CNN().apply(plain, x))
  centered, skipped = model.report(jax.random.key(0), x)
  assert centered == ['Conv_0', 'Dense_0']
  assert [path for path, _ in skipped] == ['BatchNorm_0', 'Embed_0']


class NnxDecoder(nnx.Module):
  """Conv down, transposed convolutions up: a small convolutional decoder."""

  def __init__(self, rngs):
    kw = dict(param_dtype=jnp.float64, rngs=rngs)
    self.down = nnx.Conv(2, 6, (3, 3), strides=2, **kw)  # 8 -> 4
    self.up = nnx.ConvTranspose(6, 4, (3, 3), padding='VALID',
                                transpose_kernel=True, **kw)  # 4 -> 6
    self.upsample = nnx.ConvTranspose(4, 4, (2, 2), strides=2, **kw)  # -> 12
    self.out = nnx.ConvTranspose(4, 1, (3, 3), padding='CIRCULAR',
                                 kernel_dilation=2, **kw)

  def __call__(self, x):
    x = nnx.relu(self.up(nnx.relu(self.down(x))))
    return self.out(nnx.relu(self.upsample(x)))


class LinenDecoder(nn.Module):

  @nn.compact
  def __call__(self, x):
    kw = dict(param_dtype=jnp.float64)
    x = nn.relu(nn.Conv(6, (3, 3), strides=2, **kw)(x))
    x = nn.relu(nn.ConvTranspose(4, (3, 3), padding='VALID',
                                 transpose_kernel=True, **kw)(x))
    x = nn.relu(nn.ConvTranspose(4, (2, 2), strides=2, **kw)(x))
    return nn.ConvTranspose(1, (3, 3), padding='CIRCULAR', kernel_dilation=2,
                            **kw)(x)


def decoder_loss(apply, x, target):
  return jnp.mean((apply(x) - target) ** 2)


DECODER_TX = cbp.cbp(3e-2)


def test_nnx_conv_decoder_is_centered_and_a_fused_step_stays_exact():
  """The stride-1 transposed convolutions are centered, the strided one is
  reported left with its reason; one fused CBP step (mu jumps to the batch
  means, the biases move by the updated kernels) computes what the same
  update does at the old means."""
  with jax.enable_x64(True):
    model = NnxDecoder(nnx.Rngs(0))
    x, target = inputs((4, 8, 8, 2), 0), inputs((4, 12, 12, 1), 1, 0.0)
    x_eval = inputs((4, 8, 8, 2), 2, 3.0)
    model.eval()
    before = model(x_eval)
    report = cbp_nnx.center(model)
    assert report.centered == ['down', 'out', 'up']
    assert [path for path, _ in report.skipped] == ['upsample']
    assert 'strides 2' in report.skipped[0][1]
    model.eval()
    np.testing.assert_array_equal(model(x_eval), before)
    model.train()
    loss_fn = lambda m, x, t: decoder_loss(m, x, t)
    reference = nnx.clone(model)
    params = nnx.state(reference, nnx.Param)
    loss, grads = nnx.value_and_grad(loss_fn)(reference, x, target)
    updates, _ = DECODER_TX.update(grads, DECODER_TX.init(params), params)
    nnx.update(reference, optax.apply_updates(params, updates))
    optimizer = cbp_nnx.Optimizer(model, DECODER_TX)
    step = cbp_nnx.train_step(loss_fn, mean_decay=0.0, donate=False)
    out = step(model, optimizer, x, target)
    assert not bool(out.skipped)
    assert abs(float(out.loss) - float(loss)) <= F64_TOLERANCE * float(loss)
    for name in ('down', 'up', 'out'):
      assert float(jnp.max(jnp.abs(getattr(model, name).mean[...]))) > 0.1
    model.eval()
    reference.eval()
    change = max_relative(model(x_eval), reference(x_eval))
  assert change <= F64_TOLERANCE, change


def test_linen_conv_decoder_is_centered_and_a_fused_step_stays_exact():
  with jax.enable_x64(True):
    model = cbp_linen.center(LinenDecoder())
    x, target = inputs((4, 8, 8, 2), 0), inputs((4, 12, 12, 1), 1, 0.0)
    x_eval = inputs((4, 8, 8, 2), 2, 3.0)
    report = model.report(jax.random.key(0), x)
    assert report.centered == ['ConvTranspose_0', 'ConvTranspose_2', 'Conv_0']
    assert [path for path, _ in report.skipped] == ['ConvTranspose_1']
    assert 'strides 2' in report.skipped[0][1]
    variables = model.init(jax.random.key(0), x)
    assert sorted(variables['centering']) == [
        'ConvTranspose_0', 'ConvTranspose_2', 'Conv_0']
    params, centering = variables['params'], variables['centering']
    np.testing.assert_array_equal(
        model.apply(variables, x_eval),
        LinenDecoder().apply({'params': params}, x_eval))

    def loss_fn(apply, x, target):
      return decoder_loss(apply, x, target)

    loss, grads = jax.value_and_grad(lambda p: loss_fn(
        lambda x: model.apply({'params': p, 'centering': centering}, x),
        x, target))(params)
    updates, _ = DECODER_TX.update(grads, DECODER_TX.init(params), params)
    reference = optax.apply_updates(params, updates)
    state = cbp_linen.TrainState.create(
        apply_fn=model.apply, params=params, centering=centering,
        tx=DECODER_TX)
    step = cbp_linen.train_step(loss_fn, mean_decay=0.0, donate=False)
    state, out = step(state, x, target)
    assert not bool(out.skipped)
    assert abs(float(out.loss) - float(loss)) <= F64_TOLERANCE * float(loss)
    for name in ('Conv_0', 'ConvTranspose_0', 'ConvTranspose_2'):
      mean = state.centering[name]['mean'].value
      assert float(jnp.max(jnp.abs(mean))) > 0.1
    change = max_relative(
        model.apply({'params': state.params, 'centering': state.centering},
                    x_eval),
        model.apply({'params': reference, 'centering': centering}, x_eval))
  assert change <= F64_TOLERANCE, change


# ----------------------------------------------------------------------------
# Refusals

class ScaledLinear(nnx.Linear):

  def __call__(self, x, **kwargs):
    return 2.0 * super().__call__(x, **kwargs)


class ScaledDense(nn.Dense):

  def __call__(self, x):
    return 2.0 * super().__call__(x)


@pytest.mark.parametrize('make', [
    lambda: nnx.Embed(10, 4, rngs=nnx.Rngs(0)),
    lambda: ScaledLinear(3, 4, rngs=nnx.Rngs(0)),
    lambda: nn.ConvLocal(4, (3, 3)),
    lambda: ScaledDense(4),
], ids=['nnx_embed', 'nnx_subclass', 'linen_conv_local', 'linen_subclass'])
def test_unknown_layer_types_are_refused_by_name(make):
  layer = make()
  wrapper = cbp_nnx.Centered if isinstance(layer, nnx.Module) else (
      cbp_linen.Centered)
  with pytest.raises(TypeError, match=type(layer).__qualname__):
    wrapper(layer)


@pytest.mark.parametrize('make, match', [
    (lambda: nnx.Linear(3, 4, use_bias=False, rngs=nnx.Rngs(0)), 'bias'),
    (lambda: nnx.Conv(3, 4, (3, 3), use_bias=False, rngs=nnx.Rngs(0)), 'bias'),
    (lambda: nnx.Conv(3, 4, (3, 3), input_dilation=2, rngs=nnx.Rngs(0)),
     'dilation'),
    (lambda: nnx.LinearGeneral(3, 4, batch_axis={0: 2}, rngs=nnx.Rngs(0)),
     'batch axes'),
    (lambda: nn.Dense(4, use_bias=False), 'bias'),
    (lambda: nn.Conv(4, (3, 3), input_dilation=2), 'dilation'),
    (lambda: nn.DenseGeneral(4, batch_dims=(0,)), 'batch axes'),
    # A strided transposed convolution inserts zeros between its inputs:
    # each output phase sums its own kernel taps, so W mu is no per-channel
    # bias.
    (lambda: nnx.ConvTranspose(3, 4, (3, 3), strides=2, rngs=nnx.Rngs(0)),
     'strides 2'),
    (lambda: nnx.ConvTranspose(3, 4, (3, 3), use_bias=False,
                               rngs=nnx.Rngs(0)), 'bias'),
    (lambda: nn.ConvTranspose(4, (4, 4), strides=(1, 2), padding='CIRCULAR'),
     r'strides \(1, 2\)'),
], ids=['nnx_linear_no_bias', 'nnx_conv_no_bias', 'nnx_input_dilation',
        'nnx_batch_axis', 'linen_no_bias', 'linen_input_dilation',
        'linen_batch_dims', 'nnx_conv_transpose_strided',
        'nnx_conv_transpose_no_bias', 'linen_conv_transpose_strided'])
def test_inexact_configurations_are_refused(make, match):
  layer = make()
  wrapper = cbp_nnx.Centered if isinstance(layer, nnx.Module) else (
      cbp_linen.Centered)
  with pytest.raises(core.CannotCenterError, match=match):
    wrapper(layer)


def test_linen_conv_mask_is_transported_exactly():
  mask = jnp.asarray(np.random.default_rng(0).integers(0, 2, (3, 3, 2, 4)),
                     jnp.float64)
  with jax.enable_x64(True):
    model = cbp_linen.Centered(nn.Conv(4, (3, 3), mask=mask,
                                       param_dtype=jnp.float64))
    change, _, _ = linen_transport_change(
        model, inputs((2, 6, 6, 2), 1, 4.0), inputs((2, 6, 6, 2), 2))
  assert change <= F64_TOLERANCE, change


@pytest.mark.parametrize('bad', [float('nan'), 1.0, 1.5, -0.1])
def test_mean_decay_is_validated_at_construction(bad):
  for build in (cbp_nnx.train_step, cbp_linen.train_step):
    with pytest.raises(ValueError, match='mean_decay'):
      build(lambda *a: 0.0, mean_decay=bad)
  with pytest.raises(ValueError, match='mean_decay'):
    cbp_nnx.transport(nnx.Sequential(), bad)
  with pytest.raises(ValueError, match='mean_decay'):
    cbp_linen.transport({}, {}, bad)


# ----------------------------------------------------------------------------
# The fused steps take what a Flax train step takes

def nnx_cnn_step_setup(seed=0):
  model = TutorialCNN(nnx.Rngs(seed))
  cbp_nnx.center(model)
  optimizer = cbp_nnx.Optimizer(model, cbp.cbp(1e-3))

  def loss_fn(model, rngs, images, labels):
    logits = model(images, rngs)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, labels).mean()

  rng = np.random.default_rng(seed)
  images = jnp.asarray(rng.standard_normal((8, 28, 28, 1)), jnp.float32)
  labels = jnp.asarray(rng.integers(0, 10, 8))
  return model, optimizer, loss_fn, images, labels


def test_nnx_step_takes_rngs_and_updates_batch_stats():
  model, optimizer, _, images, labels = nnx_cnn_step_setup()
  rngs = nnx.Rngs(dropout=1)

  def loss_fn(model, images, labels, rngs):
    logits = model(images, rngs)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, labels).mean()

  step = cbp_nnx.train_step(loss_fn)
  stats_before = np.asarray(model.batch_norm1.mean[...])
  count_before = int(rngs.dropout.count[...])
  out = step(model, optimizer, images, labels, rngs)
  assert not bool(out.skipped)
  assert int(rngs.dropout.count[...]) == count_before + 1
  assert not np.allclose(model.batch_norm1.mean[...], stats_before)
  assert float(jnp.abs(model.conv1.mean[...]).max()) > 0


def as_numpy(x):
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  return np.asarray(x)


def test_nnx_skipped_step_leaves_rng_counts_and_batch_stats():
  model, optimizer, _, images, labels = nnx_cnn_step_setup()
  rngs = nnx.Rngs(dropout=1)

  def loss_fn(model, images, labels, rngs):
    return optax.softmax_cross_entropy_with_integer_labels(
        model(images, rngs), labels).mean()

  step = cbp_nnx.train_step(loss_fn, donate=False)
  before = jax.tree.map(as_numpy, nnx.state((model, optimizer)))
  count_before = int(rngs.dropout.count[...])
  out = step(model, optimizer, images.at[0, 0, 0, 0].set(jnp.nan), labels,
             rngs)
  assert bool(out.skipped)
  assert int(optimizer.skipped_steps[...]) == 1
  assert int(rngs.dropout.count[...]) == count_before
  after = nnx.state((model, optimizer))
  after = jax.tree.map(as_numpy, after)
  before[1]['skipped_steps'] = after[1]['skipped_steps']
  chex.assert_trees_all_equal(after, before)


def test_nnx_step_refuses_a_model_in_eval_mode():
  model, optimizer, loss_fn, images, labels = nnx_cnn_step_setup()
  model.eval()
  with pytest.raises(ValueError, match='model.train()'):
    cbp_nnx.train_step(loss_fn)(model, optimizer, nnx.Rngs(0), images, labels)


class LinenCNN(nn.Module):

  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Conv(4, (3, 3))(x)
    x = nn.BatchNorm(use_running_average=not train)(x)
    x = nn.Dropout(0.5, deterministic=not train)(nn.relu(x))
    return nn.Dense(10)(x.reshape(x.shape[0], -1))


def test_linen_step_takes_rngs_and_batch_stats():
  model = cbp_linen.center(LinenCNN())
  x = inputs((4, 6, 6, 1), 0, dtype=jnp.float32)
  labels = jnp.arange(4)
  variables = model.init(jax.random.key(0), x, train=False)
  state = cbp_linen.TrainState.create(
      apply_fn=model.apply, params=variables['params'],
      centering=variables['centering'],
      model_state={'batch_stats': variables['batch_stats']},
      tx=cbp.cbp(1e-2))

  def loss_fn(apply, x, labels, key):
    logits = apply(x, train=True, rngs={'dropout': key})
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, labels).mean()

  step = cbp_linen.train_step(loss_fn, donate=False)
  new_state, out = step(state, x, labels, jax.random.key(1))
  assert not bool(out.skipped)
  assert not np.allclose(
      new_state.model_state['batch_stats']['BatchNorm_0']['mean'],
      state.model_state['batch_stats']['BatchNorm_0']['mean'])
  assert float(jnp.abs(new_state.centering['Dense_0']['mean'].value).max()) > 0

  skipped_state, out = step(state, x.at[0].set(jnp.nan), labels,
                            jax.random.key(1))
  assert bool(out.skipped)
  chex.assert_trees_all_equal(skipped_state.model_state, state.model_state)
  chex.assert_trees_all_equal(skipped_state.params, state.params)

  def twice(apply, x, labels, key):
    return loss_fn(apply, x, labels, key) + loss_fn(apply, x, labels, key)

  with pytest.raises(ValueError, match='twice'):
    cbp_linen.train_step(twice)(state, x, labels, jax.random.key(1))


def test_linen_step_without_centering_in_state_says_so():
  model = cbp_linen.center(nn.Dense(3))
  variables = model.init(jax.random.key(0), jnp.ones((2, 4)))
  state = cbp_linen.TrainState.create(
      apply_fn=model.apply, params=variables['params'], tx=optax.sgd(0.1))
  step = cbp_linen.train_step(lambda apply, x: apply(x).sum())
  with pytest.raises(ValueError, match='centering=variables'):
    step(state, jnp.ones((2, 4)))


# ----------------------------------------------------------------------------
# Full CBP on a stacked MLP equals the float64 NumPy reference

WIDTH, DEPTH, STEPS, LR, MEAN_DECAY = 6, 3, 15, 3e-2, 0.9
HPARAMS = dict(b1=0.9, b2=0.99, damping=1e-3)


class StackedMLP(nnx.Module):

  def __init__(self, rngs):
    kw = dict(param_dtype=jnp.float64)
    self.inp = nnx.Linear(5, WIDTH, rngs=rngs, **kw)

    @nnx.split_rngs(splits=DEPTH)
    @nnx.vmap(in_axes=0, out_axes=0)
    def create(rngs):
      return nnx.Linear(WIDTH, WIDTH, rngs=rngs, **kw)

    self.hidden = create(rngs)
    self.out = nnx.Linear(WIDTH, 4, rngs=rngs, **kw)

  def __call__(self, x):

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(x, layer):
      return nnx.relu(layer(x))

    return self.out(body(nnx.relu(self.inp(x)), self.hidden))


def test_stacked_mlp_full_cbp_step_matches_numpy_reference():
  rng = np.random.default_rng(3)
  x = rng.standard_normal((32, 5)) + 1.5
  labels = rng.integers(0, 4, 32)
  with jax.enable_x64(True):
    model = StackedMLP(nnx.Rngs(0))
    cbp_nnx.center(model)
    layers = ([model.inp.layer]
              + [(i, model.hidden.layer) for i in range(DEPTH)]
              + [model.out.layer])

    def kernel(layer):
      return (np.asarray(layer[1].kernel[...][layer[0]])
              if isinstance(layer, tuple) else np.asarray(layer.kernel[...]))

    def bias(layer):
      return (np.asarray(layer[1].bias[...][layer[0]])
              if isinstance(layer, tuple) else np.asarray(layer.bias[...]))

    reference = ref.CenteredMLPReference(
        [kernel(l) for l in layers], [bias(l) for l in layers], lr=LR,
        rho=MEAN_DECAY, **HPARAMS)
    stacked = cbp_nnx.stacked_blocks(model)
    optimizer = nnx.Optimizer(
        model, cbp.cbp(LR, decay=MEAN_DECAY, stacked=stacked, **HPARAMS),
        wrt=nnx.Param)
    assert len(cbp.block_names(nnx.state(model, nnx.Param),
                               stacked=stacked)) == DEPTH + 2
    step = cbp_nnx.train_step(
        lambda m, x, y: optax.softmax_cross_entropy_with_integer_labels(
            m(x), y).mean(), mean_decay=MEAN_DECAY)
    worst = 0.0
    for _ in range(STEPS):
      out = step(model, optimizer, jnp.asarray(x), jnp.asarray(labels))
      loss = reference.step(x, labels)
      worst = max(worst, abs(float(out.loss) - loss) / abs(loss))
      for l, layer in enumerate(layers):
        worst = max(
            worst,
            float(np.max(np.abs(kernel(layer) - reference.kernels[l]))
                  / np.max(np.abs(reference.kernels[l]))),
            float(np.max(np.abs(bias(layer) - reference.biases[l]))
                  / np.max(np.abs(reference.biases[l]))))
  assert worst <= 1e-9, worst
