"""The recommended recipe: Muon for a centered model (cbp.recommended)."""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import cbp_optax as cbp
from cbp_optax_experiments.workloads import arms as arms_lib


def _tree():
  keys = jax.random.split(jax.random.key(0), 3)
  return {'dense': {'kernel': jax.random.normal(keys[0], (6, 4)),
                    'bias': jax.random.normal(keys[1], (4,))},
          'conv': {'kernel': jax.random.normal(keys[2], (3, 3, 2, 4))}}


def _run(tx, params, steps=3):
  state = tx.init(params)
  out = []
  for i in range(steps):
    grads = jax.tree.map(lambda x, i=i: jnp.sin(x * (i + 1)), params)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    out.append(updates)
  return out


def test_recommended_is_muon_with_the_suites_settings():
  params = _tree()
  mask = jax.tree.map(lambda x: x.ndim > 1, params)
  dims = {'dense': {'kernel': optax.contrib.MuonDimensionNumbers(0, 1),
                    'bias': None},
          'conv': {'kernel': optax.contrib.MuonDimensionNumbers((0, 1, 2), 3)}}
  got = _run(cbp.recommended(1e-2, weight_decay=0.05, mask=mask,
                             dimension_numbers=dims), params)
  want = _run(optax.contrib.muon(
      1e-2, weight_decay=0.05, weight_decay_mask=mask, adam_weight_decay=0.0,
      muon_weight_dimension_numbers=dims, consistent_rms=0.2), params)
  chex.assert_trees_all_equal(got, want)


@pytest.mark.parametrize('kwargs, error, match', [
    (dict(learning_rate=-1e-3), ValueError, 'learning_rate'),
    (dict(learning_rate='1e-3'), TypeError, 'learning_rate'),
    (dict(learning_rate=1e-3, weight_decay=-0.1), ValueError, 'weight_decay'),
    (dict(learning_rate=1e-3, weight_decay=True), TypeError, 'weight_decay'),
    (dict(learning_rate=1e-3, weight_decay=optax.constant_schedule(0.1)),
     TypeError, 'weight_decay'),
])
def test_recommended_refuses_bad_arguments_at_construction(kwargs, error,
                                                           match):
  with pytest.raises(error, match=match):
    cbp.recommended(**kwargs)


class _ConvNet(nnx.Module):

  def __init__(self, rngs):
    self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
    self.head = nnx.Linear(4 * 6 * 6, 3, rngs=rngs)

  def __call__(self, x):
    return self.head(nnx.relu(self.conv(x)).reshape(x.shape[0], -1))


def test_recommended_trains_a_centered_conv_model_through_the_fused_step():
  model = _ConvNet(nnx.Rngs(0))
  cbp.nnx.center(model)
  tx = cbp.recommended(3e-2,
                       dimension_numbers=cbp.nnx.muon_dimension_numbers(model))
  optimizer = cbp.nnx.Optimizer(model, tx)
  step = cbp.nnx.train_step(
      lambda m, x, y: optax.softmax_cross_entropy_with_integer_labels(
          m(x), y).mean())
  x = jax.random.normal(jax.random.key(1), (16, 6, 6, 1))
  y = jnp.arange(16) % 3
  losses = [float(step(model, optimizer, x, y).loss) for _ in range(30)]
  assert losses[-1] < 0.5 * losses[0], losses
  # The centering means moved: the recipe's model side ran.
  assert float(jnp.abs(model.conv.mean[...]).max()) > 0


def test_the_recommended_arm_is_muon_centered_but_for_batch_norm_models():
  builtin = arms_lib.builtin_arms()
  recommended, muon = builtin['recommended'], builtin['muon_centered']
  assert recommended.centered and not recommended.center_batch_norm_models
  ctx = arms_lib.Context(steps=20, muon_dims=None)
  params = {'w': jnp.ones((3, 2)), 'b': jnp.zeros(2)}
  chex.assert_trees_all_equal(_run(recommended.make(1e-2, ctx), params),
                              _run(muon.make(1e-2, ctx), params))
