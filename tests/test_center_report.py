"""center's report: the same rules in NNX and Linen, one line per layer type."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import cbp_optax as cbp


class NnxModel(nnx.Module):

  def __init__(self, rngs):
    self.scale = nnx.Param(jnp.ones(4))  # the model's own parameter
    self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
    self.norm1 = nnx.BatchNorm(4, rngs=rngs)
    self.norm2 = nnx.BatchNorm(4, rngs=rngs)
    self.no_bias = nnx.Linear(4, 4, use_bias=False, rngs=rngs)
    self.embed = nnx.Embed(5, 4, rngs=rngs)
    self.head = nnx.Linear(4, 2, rngs=rngs)


class LinenModel(nn.Module):

  @nn.compact
  def __call__(self, x, tokens):
    x = nn.Conv(4, (3, 3), name='conv')(x) * self.param(
        'scale', nn.initializers.ones, (4,))
    x = nn.BatchNorm(use_running_average=True, name='norm1')(x)
    x = nn.BatchNorm(use_running_average=True, name='norm2')(x)
    x = nn.Dense(4, use_bias=False, name='no_bias')(x)
    x = x.mean((1, 2)) + nn.Embed(5, 4, name='embed')(tokens)
    return nn.Dense(2, name='head')(x)


def linen_report():
  return cbp.linen.center(LinenModel()).report(
      jax.random.key(0), jnp.ones((2, 6, 6, 1)), jnp.zeros(2, jnp.int32))


def test_nnx_and_linen_report_the_same_layers_for_the_same_reasons():
  """Linen used to omit norms and embeddings; NNX named the root '' and
  repeated a ~400-character message for each layer."""
  nnx_report = cbp.nnx.center(NnxModel(nnx.Rngs(0)))
  for report in (nnx_report, linen_report()):
    assert report.centered == ['conv', 'head']
    assert [p for p, _ in report.skipped] == [
        '(model)', 'embed', 'no_bias', 'norm1', 'norm2']
    reasons = dict(report.skipped)
    assert reasons['norm1'] == reasons['norm2']
    assert reasons['norm1'].startswith('BatchNorm: not a layer type')
    assert reasons['embed'].startswith('Embed: ')
    assert 'use_bias=False' in reasons['no_bias']
    assert all(len(r) <= 120 for r in reasons.values()), reasons
    lines = str(report).splitlines()
    assert lines[0] == 'centered (2): conv, head'
    assert lines[4].startswith(
        'left as is (2): norm1, norm2 - BatchNorm: not a layer')
    assert len(lines) == 5  # one per layer type (and reason)


def test_where_filters_supported_layers_only():
  report = cbp.nnx.center(NnxModel(nnx.Rngs(0)), where=nnx.Conv)
  reasons = dict(report.skipped)
  assert report.centered == ['conv']
  assert reasons['head'] == 'not selected by where'
  assert reasons['norm1'].startswith('BatchNorm: ')


@pytest.mark.parametrize('strides, centered', [
    (None, True), (1, True), ((1, 1), True),
    (2, False), ((1, 2), False), ((2, 1), False),
])
def test_conv_transpose_is_centered_at_strides_1_and_reported_left_else(
    strides, centered):
  """A strided transposed convolution is no per-channel-bias transport
  (each output phase sums its own kernel taps): left, with that reason."""
  nnx_report = cbp.nnx.center(nnx.Sequential(
      nnx.ConvTranspose(2, 3, (3, 3), strides=strides, rngs=nnx.Rngs(0))))
  linen_report_ = cbp.linen.center(nn.Sequential(
      [nn.ConvTranspose(3, (3, 3), strides=strides)])).report(
          jax.random.key(0), jnp.ones((1, 5, 5, 2)))
  for report, path in ((nnx_report, 'layers/0'),
                       (linen_report_, 'layers_0')):
    if centered:
      assert (report.centered, report.skipped) == ([path], [])
      continue
    assert report.centered == []
    [(left, reason)] = report.skipped
    assert left == path
    assert f'ConvTranspose has strides {strides}: ' in reason
    assert 'output phase' in reason and len(reason) <= 120, reason
