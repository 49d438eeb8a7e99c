"""M2 centering: exactness of the transport, gradients (eq. 9), modes, refusals."""

import functools

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

from cbp_optax import linen as cbp_linen
from cbp_optax import nnx as cbp_nnx

MASK_1D = np.random.default_rng(0).integers(0, 2, (4, 3, 4)).astype(np.float32)

# (name, input shape, NNX constructor, Linen constructor)
LAYERS = [
    ('dense', (5, 7),
     lambda d, r: nnx.Linear(7, 4, param_dtype=d, rngs=r),
     lambda d: nn.Dense(4, param_dtype=d)),
    ('dense_general_trailing', (5, 3, 4),
     lambda d, r: nnx.LinearGeneral((3, 4), (2, 3), axis=(-2, -1),
                                    param_dtype=d, rngs=r),
     lambda d: nn.DenseGeneral((2, 3), axis=(-2, -1), param_dtype=d)),
    ('dense_general_inner_axis', (5, 3, 4),
     lambda d, r: nnx.LinearGeneral(3, 6, axis=1, param_dtype=d, rngs=r),
     lambda d: nn.DenseGeneral(6, axis=1, param_dtype=d)),
    ('conv_same_strided', (2, 9, 8, 4),
     lambda d, r: nnx.Conv(4, 6, (3, 3), strides=(2, 2), padding='SAME',
                           param_dtype=d, rngs=r),
     lambda d: nn.Conv(6, (3, 3), strides=(2, 2), padding='SAME',
                       param_dtype=d)),
    ('conv_valid', (2, 7, 7, 3),
     lambda d, r: nnx.Conv(3, 5, (3, 3), padding='VALID', param_dtype=d,
                           rngs=r),
     lambda d: nn.Conv(5, (3, 3), padding='VALID', param_dtype=d)),
    ('conv_explicit_int', (2, 6, 6, 3),
     lambda d, r: nnx.Conv(3, 5, (3, 3), padding=2, param_dtype=d, rngs=r),
     lambda d: nn.Conv(5, (3, 3), padding=2, param_dtype=d)),
    ('conv_explicit_pairs_dilated', (2, 9, 10, 3),
     lambda d, r: nnx.Conv(3, 5, (3, 2), padding=((1, 2), (0, 1)),
                           kernel_dilation=(2, 1), param_dtype=d, rngs=r),
     lambda d: nn.Conv(5, (3, 2), padding=((1, 2), (0, 1)),
                       kernel_dilation=(2, 1), param_dtype=d)),
    ('conv_grouped', (2, 8, 8, 6),
     lambda d, r: nnx.Conv(6, 9, (3, 3), padding='SAME',
                           feature_group_count=3, param_dtype=d, rngs=r),
     lambda d: nn.Conv(9, (3, 3), padding='SAME', feature_group_count=3,
                       param_dtype=d)),
    ('conv_circular', (2, 6, 6, 3),
     lambda d, r: nnx.Conv(3, 4, (3, 3), padding='CIRCULAR', param_dtype=d,
                           rngs=r),
     lambda d: nn.Conv(4, (3, 3), padding='CIRCULAR', param_dtype=d)),
    ('conv_reflect', (2, 6, 6, 3),
     lambda d, r: nnx.Conv(3, 4, (3, 3), padding='REFLECT', param_dtype=d,
                           rngs=r),
     lambda d: nn.Conv(4, (3, 3), padding='REFLECT', param_dtype=d)),
    ('conv1d_causal', (2, 10, 3),
     lambda d, r: nnx.Conv(3, 4, (3,), padding='CAUSAL', kernel_dilation=2,
                           param_dtype=d, rngs=r),
     lambda d: nn.Conv(4, (3,), padding='CAUSAL', kernel_dilation=2,
                       param_dtype=d)),
    # Stride-1 transposed convolutions: convolutions, centered as Conv is.
    ('conv_transpose_same', (2, 7, 6, 4),
     lambda d, r: nnx.ConvTranspose(4, 6, (3, 3), padding='SAME',
                                    param_dtype=d, rngs=r),
     lambda d: nn.ConvTranspose(6, (3, 3), padding='SAME', param_dtype=d)),
    ('conv_transpose_valid_transposed_kernel', (2, 5, 5, 3),
     lambda d, r: nnx.ConvTranspose(3, 5, (3, 2), padding='VALID',
                                    transpose_kernel=True, param_dtype=d,
                                    rngs=r),
     lambda d: nn.ConvTranspose(5, (3, 2), padding='VALID',
                                transpose_kernel=True, param_dtype=d)),
    ('conv_transpose_explicit_pairs_dilated', (2, 8, 9, 3),
     lambda d, r: nnx.ConvTranspose(3, 5, (3, 2), strides=(1, 1),
                                    padding=((1, 2), (0, 1)),
                                    kernel_dilation=(2, 1), param_dtype=d,
                                    rngs=r),
     lambda d: nn.ConvTranspose(5, (3, 2), strides=(1, 1),
                                padding=((1, 2), (0, 1)),
                                kernel_dilation=(2, 1), param_dtype=d)),
    ('conv_transpose_explicit_int_transposed_kernel', (2, 6, 6, 3),
     lambda d, r: nnx.ConvTranspose(3, 4, (3, 3), padding=2,
                                    transpose_kernel=True, param_dtype=d,
                                    rngs=r),
     lambda d: nn.ConvTranspose(4, (3, 3), padding=2, transpose_kernel=True,
                                param_dtype=d)),
    ('conv_transpose_circular_dilated', (2, 6, 7, 3),
     lambda d, r: nnx.ConvTranspose(3, 4, (3, 3), padding='CIRCULAR',
                                    kernel_dilation=2, param_dtype=d, rngs=r),
     lambda d: nn.ConvTranspose(4, (3, 3), padding='CIRCULAR',
                                kernel_dilation=2, param_dtype=d)),
    ('conv_transpose_circular_transposed_kernel', (2, 6, 6, 3),
     lambda d, r: nnx.ConvTranspose(3, 4, (4, 3), padding='CIRCULAR',
                                    transpose_kernel=True, param_dtype=d,
                                    rngs=r),
     lambda d: nn.ConvTranspose(4, (4, 3), padding='CIRCULAR',
                                transpose_kernel=True, param_dtype=d)),
    ('conv_transpose_1d_cropped_dilated_masked', (2, 10, 3),
     lambda d, r: nnx.ConvTranspose(3, 4, (4,), strides=1,
                                    padding=((-1, 2),), kernel_dilation=2,
                                    mask=MASK_1D, param_dtype=d, rngs=r),
     lambda d: nn.ConvTranspose(4, (4,), strides=1, padding=((-1, 2),),
                                kernel_dilation=2, mask=MASK_1D,
                                param_dtype=d)),
]
IDS = [layer[0] for layer in LAYERS]
TOLERANCE = {jnp.float32: 2e-5, jnp.float64: 1e-12}


def inputs(shape, seed, dtype, offset=2.0):
  return jnp.asarray(
      np.random.default_rng(seed).standard_normal(shape) + offset, dtype)


def max_relative(a, b):
  return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


class NnxCentered:
  """One centered NNX layer behind the interface both frameworks' tests use."""

  def __init__(self, make_nnx, make_linen, dtype, x):
    del make_linen
    self.layer = make_nnx(dtype, nnx.Rngs(0))
    self.plain = self.layer(x)
    self.centered = cbp_nnx.Centered(self.layer)

  def evaluate(self, x):
    self.centered.eval()
    out = self.centered(x)
    self.centered.train()
    return out

  def record(self, x):
    self.centered(x)

  def transport(self, mean_decay):
    cbp_nnx.transport(self.centered, mean_decay)

  def mean(self):
    return self.centered.mean[...]


class LinenCentered:
  """One centered Linen layer behind the same interface."""

  def __init__(self, make_nnx, make_linen, dtype, x):
    del make_nnx
    self.model = cbp_linen.Centered(make_linen(dtype))
    variables = self.model.init(jax.random.key(0), x)
    self.params, self.centering = variables['params'], variables['centering']
    self.plain = make_linen(dtype).apply(
        {'params': next(iter(self.params.values()))}, x)

  def evaluate(self, x):
    return self.model.apply(
        {'params': self.params, 'centering': self.centering}, x,
        use_running_average=True)

  def record(self, x):
    _, mutated = self.model.apply(
        {'params': self.params, 'centering': self.centering}, x,
        mutable=['centering'])
    self.centering = mutated['centering']

  def transport(self, mean_decay):
    self.params, self.centering = cbp_linen.transport(
        self.params, self.centering, mean_decay)

  def mean(self):
    return self.centering['mean'].value


@pytest.mark.parametrize('framework', [NnxCentered, LinenCentered],
                         ids=['nnx', 'linen'])
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.float64])
@pytest.mark.parametrize('name, shape, make_nnx, make_linen', LAYERS, ids=IDS)
def test_transport_is_exact(name, shape, make_nnx, make_linen, dtype,
                            framework):
  del name
  with jax.enable_x64(dtype == jnp.float64):
    x = inputs(shape, 0, dtype)
    layer = framework(make_nnx, make_linen, dtype, x)
    # mu = 0: exactly the wrapped layer, border included.
    np.testing.assert_array_equal(layer.evaluate(x), layer.plain)
    for seed, mean_decay in ((1, 0.0), (2, 0.5)):
      before = layer.evaluate(x)
      layer.record(inputs(shape, seed, dtype, offset=5.0 * seed))
      layer.transport(mean_decay)
      assert max_relative(layer.evaluate(x), before) <= TOLERANCE[dtype]
    assert float(jnp.min(jnp.abs(layer.mean()))) > 1.0


def explicit_pads(layer, spatial_shape):
  """Flax's padding of ``layer`` as explicit ``(low, high)`` pads and a mode."""
  rank = len(layer.kernel_size)
  as_tuple = lambda v: (1,) * rank if v is None else (
      (v,) * rank if isinstance(v, int) else tuple(v))
  dilation = as_tuple(layer.kernel_dilation)
  dilated = [(k - 1) * d + 1 for k, d in zip(layer.kernel_size, dilation)]
  padding = layer.padding
  if isinstance(padding, str):
    name = padding.upper()
    if name in ('SAME', 'VALID'):
      pads = lax.padtype_to_pads(spatial_shape, dilated,
                                 as_tuple(layer.strides), name)
      return [tuple(p) for p in pads], 'constant'
    if name in ('CIRCULAR', 'REFLECT'):
      return ([((k - 1) // 2, k // 2) for k in dilated],
              {'CIRCULAR': 'wrap', 'REFLECT': 'reflect'}[name])
    assert name == 'CAUSAL'
    return [(dilation[0] * (layer.kernel_size[0] - 1), 0)], 'constant'
  if isinstance(padding, int):
    return [(padding, padding)] * rank, 'constant'
  return [(p, p) if isinstance(p, int) else tuple(p) for p in padding], \
      'constant'


def explicit_centered_conv(layer, kernel, bias, mu, x):
  """The definition: pad, subtract ``mu`` everywhere, convolve unpadded."""
  rank = len(layer.kernel_size)
  pads, mode = explicit_pads(layer, x.shape[1:1 + rank])
  padded = jnp.pad(x, [(0, 0)] + list(pads) + [(0, 0)], mode=mode)
  spatial = ''.join('HWD'[:rank])
  numbers = ('N' + spatial + 'C', spatial + 'IO', 'N' + spatial + 'C')
  strides = layer.strides
  strides = (strides,) * rank if isinstance(strides, int) else strides
  dilation = layer.kernel_dilation or 1
  dilation = (dilation,) * rank if isinstance(dilation, int) else dilation
  out = lax.conv_general_dilated(
      padded - mu, kernel, tuple(strides), 'VALID',
      rhs_dilation=tuple(dilation), dimension_numbers=numbers,
      feature_group_count=layer.feature_group_count,
      precision=lax.Precision.HIGHEST)
  return out + bias


CONVS = [layer for layer in LAYERS
         if layer[0].startswith('conv') and 'transpose' not in layer[0]]
CONV_TRANSPOSES = [layer for layer in LAYERS if 'transpose' in layer[0]]


def check_matches_definition(definition, shape, make_nnx, make_linen):
  """Values and gradients of both frameworks' centered layer equal those of
  ``definition(layer, kernel, bias, mu, x)`` (float64)."""
  with jax.enable_x64(True):
    dtype = jnp.float64
    x = inputs(shape, 0, dtype)
    mu = inputs(shape[-1:], 3, dtype, offset=1.5)
    layer = make_nnx(dtype, nnx.Rngs(0))
    kernel, bias = layer.kernel[...], layer.bias[...]
    # With mu = 0 the definition is the plain layer (its pads are right).
    np.testing.assert_allclose(definition(layer, kernel, bias, 0 * mu, x),
                               layer(x), rtol=1e-12, atol=1e-12)
    centered = cbp_nnx.Centered(layer)
    centered.mean[...] = mu
    centered.eval()
    out = centered(x)
    delta = inputs(out.shape, 4, dtype, offset=0.0)

    def reference(kernel, bias, x):
      return jnp.sum(definition(layer, kernel, bias, mu, x) * delta)

    expected = definition(layer, kernel, bias, mu, x)
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)
    want = jax.grad(reference, argnums=(0, 1, 2))(kernel, bias, x)
    grads, grad_x = nnx.grad(lambda m, x: jnp.sum(m(x) * delta),
                             argnums=(0, 1))(centered, x)
    got = (grads['layer']['kernel'][...], grads['layer']['bias'][...], grad_x)
    for g, w in zip(got, want):
      assert max_relative(g, w) <= 1e-12

    module = cbp_linen.Centered(make_linen(dtype))
    variables = module.init(jax.random.key(0), x)
    params = variables['params']['conv']
    centering = dict(variables['centering'], mean=mu)

    def linen_loss(params, x):
      out = module.apply({'params': {'conv': params}, 'centering': centering},
                         x, use_running_average=True)
      return jnp.sum(out * delta), out

    (_, out), got = jax.value_and_grad(linen_loss, argnums=(0, 1),
                                       has_aux=True)(params, x)
    expected = definition(layer, params['kernel'], params['bias'], mu, x)
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)
    want = jax.grad(reference, argnums=(0, 1, 2))(
        params['kernel'], params['bias'], x)
    for g, w in zip((got[0]['kernel'], got[0]['bias'], got[1]), want):
      assert max_relative(g, w) <= 1e-12


@pytest.mark.parametrize('name, shape, make_nnx, make_linen', CONVS,
                         ids=[c[0] for c in CONVS])
def test_centered_conv_matches_the_explicit_definition(
    name, shape, make_nnx, make_linen):
  """Values and gradients (eq. 9: dW = (pad(a) - mu)^T delta, border
  included) equal those of pad -> subtract mu -> unpadded convolution, for
  every padding mode, stride, dilation and grouping (float64)."""
  del name
  check_matches_definition(explicit_centered_conv, shape, make_nnx,
                           make_linen)


def conv_transpose_pads(layer):
  """The ``(low, high)`` pads of the stride-1 convolution a non-circular
  ``ConvTranspose`` runs (``lax.conv_transpose``'s, for strides 1)."""
  rank = len(layer.kernel_size)
  dilation = layer.kernel_dilation or 1
  dilation = (dilation,) * rank if isinstance(dilation, int) else dilation
  dilated = [(k - 1) * d + 1 for k, d in zip(layer.kernel_size, dilation)]
  if layer.padding == 'VALID':
    return [(k - 1, k - 1) for k in dilated]
  if layer.padding == 'SAME':
    return [(-(-(k - 1) // 2), (k - 1) // 2) for k in dilated]
  if isinstance(layer.padding, int):
    return [(layer.padding, layer.padding)] * rank
  return [(p, p) if isinstance(p, int) else tuple(p) for p in layer.padding]


def explicit_centered_conv_transpose(layer, kernel, bias, mu, x):
  """The definition: pad (or crop), subtract ``mu`` everywhere, run the
  unpadded transposed convolution; a circular one (no border) runs on
  ``a - mu``."""
  params = {'params': {'kernel': kernel, 'bias': bias}}
  twin = functools.partial(
      nn.ConvTranspose, layer.out_features, layer.kernel_size,
      kernel_dilation=layer.kernel_dilation,
      transpose_kernel=layer.transpose_kernel, mask=layer.mask,
      precision=lax.Precision.HIGHEST)
  if layer.padding == 'CIRCULAR':
    return twin(padding='CIRCULAR').apply(params, x - mu)
  pads = [(lo, hi, 0) for lo, hi in conv_transpose_pads(layer)]
  padded = lax.pad(x, jnp.zeros((), x.dtype), [(0, 0, 0)] + pads + [(0, 0, 0)])
  return twin(padding=[(0, 0)] * len(pads)).apply(params, padded - mu)


@pytest.mark.parametrize('name, shape, make_nnx, make_linen', CONV_TRANSPOSES,
                         ids=[c[0] for c in CONV_TRANSPOSES])
def test_centered_conv_transpose_matches_the_explicit_definition(
    name, shape, make_nnx, make_linen):
  """A stride-1 transposed convolution is a convolution, centered as Conv
  is: values and gradients equal those of pad -> subtract mu -> unpadded
  transposed convolution, for every padding (circular: no border), kernel
  dilation and kernel layout (float64)."""
  del name
  check_matches_definition(explicit_centered_conv_transpose, shape, make_nnx,
                           make_linen)


def test_gradient_is_centered_outer_product():
  """Eq. (9): dL/dW = delta (a - mu)^T, i.e. (a - mu)^T delta for (in, out)."""
  layer = cbp_nnx.Centered(nnx.Linear(5, 3, rngs=nnx.Rngs(0)))
  mu = jnp.arange(5.0) - 1.0
  layer.mean[...] = mu
  x = inputs((8, 5), 0, jnp.float32)
  delta = inputs((8, 3), 1, jnp.float32, offset=0.0)
  grads = nnx.grad(lambda m: jnp.sum(m(x) * delta))(layer)
  np.testing.assert_allclose(grads['layer']['kernel'][...],
                             (x - mu).T @ delta, rtol=1e-5)
  np.testing.assert_allclose(grads['layer']['bias'][...], delta.sum(0),
                             rtol=1e-5)
  assert 'mean' not in grads and 'batch_mean' not in grads


def test_means_are_not_parameters():
  model = cbp_nnx.Centered(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
  params = nnx.state(model, nnx.Param)
  assert set(jax.tree.leaves(jax.tree.map(lambda _: 1, params))) == {1}
  assert len(jax.tree.leaves(params)) == 2  # kernel and bias only
  stats = nnx.state(model, nnx.BatchStat)
  assert len(jax.tree.leaves(stats)) == 3  # mean, batch_mean, batch_count
  assert isinstance(model.mean, cbp_nnx.CenteringMean)
  variables = cbp_linen.Centered(nn.Dense(2)).init(
      jax.random.key(0), jnp.ones((3, 4)))
  assert set(variables['centering']) == {'mean', 'batch_mean', 'batch_count'}
  assert set(variables['params']) == {'dense'}


def test_forward_records_but_never_moves_mu():
  model = cbp_nnx.Centered(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
  x = inputs((6, 4), 0, jnp.float32)
  model(x)
  np.testing.assert_array_equal(model.mean[...], jnp.zeros(4))
  np.testing.assert_allclose(model.batch_mean[...], x.mean(0), rtol=1e-6)


def test_eval_mode_records_nothing():
  model = nnx.Sequential(cbp_nnx.Centered(nnx.Linear(4, 2, rngs=nnx.Rngs(0))))
  model.eval()
  model(inputs((6, 4), 0, jnp.float32))
  np.testing.assert_array_equal(model.layers[0].batch_mean[...], 0.0)
  viewed = nnx.view(model, use_running_average=False)
  viewed(inputs((6, 4), 0, jnp.float32))
  assert not np.allclose(model.layers[0].batch_mean[...], 0.0)
  model.train()
  assert not model.layers[0].use_running_average


def test_linen_records_only_when_mutable_and_training():
  model = cbp_linen.Centered(nn.Dense(2))
  x = inputs((6, 4), 0, jnp.float32)
  variables = model.init(jax.random.key(0), x)
  np.testing.assert_array_equal(variables['centering']['batch_mean'], 0.0)
  _, mutated = model.apply(variables, x, use_running_average=True,
                           mutable=['centering'])
  np.testing.assert_array_equal(mutated['centering']['batch_mean'], 0.0)
  _, mutated = model.apply(variables, x, mutable=['centering'])
  np.testing.assert_allclose(mutated['centering']['batch_mean'], x.mean(0),
                             rtol=1e-6)
  np.testing.assert_array_equal(mutated['centering']['mean'].value, 0.0)
  model.apply(variables, x)  # immutable: evaluates, records nothing


class CompactParent(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.relu(cbp_linen.Centered(nn.Dense(8))(x))
    return cbp_linen.Centered(nn.Dense(2, name='head'))(x)


class SetupParent(nn.Module):

  def setup(self):
    self.hidden = cbp_linen.Centered(nn.Dense(8))
    self.head = cbp_linen.Centered(nn.Dense(2))

  def __call__(self, x):
    return self.head(nn.relu(self.hidden(x)))


class UnboundParent(nn.Module):
  layers: tuple

  @nn.compact
  def __call__(self, x):
    for layer in self.layers:
      x = layer(x)
    return x


@pytest.mark.parametrize('parent', [
    CompactParent(),
    SetupParent(),
    UnboundParent((cbp_linen.Centered(nn.Dense(8)), nn.relu,
                   cbp_linen.Centered(nn.Dense(2)))),
], ids=['compact', 'setup', 'unbound'])
def test_linen_spellings_pair_params_with_means(parent):
  x = inputs((6, 3), 0, jnp.float32)
  variables = parent.init(jax.random.key(0), x)
  # Every centering entry has its layer's parameters beside it.
  for path in variables['centering']:
    assert set(variables['params'][path]) == {'dense'}
  assert len(variables['centering']) == 2
  before = parent.apply(variables, x)
  _, mutated = parent.apply(variables, x + 3.0, mutable=['centering'])
  params, centering = cbp_linen.transport(
      variables['params'], mutated['centering'], 0.0)
  after = parent.apply({'params': params, 'centering': centering}, x)
  np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-6)


def test_linen_transport_keeps_frozen_dicts():
  model = cbp_linen.Centered(nn.Dense(2))
  variables = flax.core.freeze(
      model.init(jax.random.key(0), jnp.ones((2, 3))))
  params, centering = cbp_linen.transport(
      variables['params'], variables['centering'])
  assert isinstance(params, flax.core.FrozenDict)
  assert isinstance(centering, flax.core.FrozenDict)


def test_linen_transport_refuses_mismatched_collections():
  a = CompactParent().init(jax.random.key(0), jnp.ones((2, 3)))
  with pytest.raises(ValueError, match='same model'):
    cbp_linen.transport({'Centered_9': a['params']['Centered_0']},
                        a['centering'])


# Refusals of unsupported and inexact layers: tests/test_centering_models.py.


def test_axis_name_averages_recorded_means_across_mapped_batches():
  """Inside vmap / shard_map / pmap each replica sees part of the batch:
  with axis_name the recorded mean is the global one."""
  x = inputs((4, 6, 5), 0, jnp.float32)  # 4 replicas x 6 examples
  model = cbp_linen.Centered(nn.Dense(3), axis_name='replica')
  variables = model.init(jax.random.key(0), x[0])

  def record(x):
    _, mutated = model.apply(variables, x, mutable=['centering'])
    return mutated['centering']['batch_mean']

  recorded = jax.vmap(record, axis_name='replica')(x)
  for replica in recorded:
    np.testing.assert_allclose(replica, x.reshape(-1, 5).mean(0), rtol=1e-6)

  layer = cbp_nnx.Centered(nnx.Linear(5, 3, rngs=nnx.Rngs(0)),
                           axis_name='replica')

  @nnx.vmap(in_axes=(None, 0), out_axes=None, axis_name='replica')
  def record_nnx(layer, x):
    layer(x)

  record_nnx(layer, x)
  np.testing.assert_allclose(layer.batch_mean[...], x.reshape(-1, 5).mean(0),
                             rtol=1e-6)
