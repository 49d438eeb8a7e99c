"""The recommended recipe: schedule-free CBP M3 for a centered model
(cbp.recommended)."""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import cbp_optax as cbp


def _tree():
  keys = jax.random.split(jax.random.key(0), 4)
  return {'dense': {'kernel': jax.random.normal(keys[0], (6, 4)),
                    'bias': jax.random.normal(keys[1], (4,))},
          'norm': {'scale': jax.random.normal(keys[3], (4,))},
          'conv': {'kernel': jax.random.normal(keys[2], (3, 3, 2, 4))}}


def _run(tx, params, steps=6):
  state = tx.init(params)
  out = []
  for i in range(steps):
    grads = jax.tree.map(lambda x, i=i: jnp.sin(x * (i + 1)) * 10.0 ** i,
                         params)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    out.append(updates)
  state = getattr(state, 'inner_state', state)  # inject_hyperparams'
  return out, optax.contrib.schedule_free_eval_params(state, params)


def _spelled_out(peak, warmup, weight_decay, mask, b1=0.9):
  rate = (optax.warmup_constant_schedule(0.0, peak, warmup) if warmup
          else peak)
  return optax.contrib.schedule_free(optax.chain(
      cbp.precondition(b1=0.0, b2=0.999, damping=1e-8,
                       zero_moment='normalized'),
      optax.clip(3.0),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(rate)), learning_rate=rate, b1=b1)


KERNELS = {'dense': {'kernel': True, 'bias': False},
           'norm': {'scale': False}, 'conv': {'kernel': True}}


@pytest.mark.parametrize('warmup', [0, 3])
def test_recommended_is_schedule_free_around_robust_m3(warmup):
  # The default mask decays the kernels only; the gradients grow tenfold a
  # step, so the clip at 3 is reached (g_t / sqrt(v_{t-1}) >> 3).
  params = _tree()
  got = _run(cbp.recommended(1e-2, warmup_steps=warmup, weight_decay=0.05),
             params)
  want = _run(_spelled_out(1e-2, warmup, 0.05, KERNELS), params)
  chex.assert_trees_all_equal(got, want)
  unclipped = _run(optax.contrib.schedule_free(optax.chain(
      cbp.precondition(b1=0.0, b2=0.999, damping=1e-8,
                       zero_moment='normalized'),
      optax.add_decayed_weights(0.05, KERNELS),
      optax.scale_by_learning_rate(1e-2)), learning_rate=1e-2), params)
  if not warmup:  # the clip acted: without it the steps differ
    assert not jnp.allclose(got[0][3]['dense']['bias'],
                            unclipped[0][3]['dense']['bias'])


def test_recommended_takes_a_mask_b1_and_a_schedule():
  params = _tree()
  mask = jax.tree.map(lambda x: x.ndim == 1, params)
  schedule = optax.linear_schedule(1e-2, 1e-3, 5)
  got = _run(cbp.recommended(schedule, b1=0.7, mask=mask), params)
  want = _run(_spelled_out(schedule, 0, 0.01, mask, b1=0.7), params)
  chex.assert_trees_all_equal(got, want)


def test_recommended_under_inject_hyperparams_is_the_plain_call():
  params = _tree()
  injected = optax.inject_hyperparams(cbp.recommended,
                                      static_args=('warmup_steps',))
  got = _run(injected(learning_rate=1e-2, warmup_steps=2), params)[0]
  # The injected rate is a float32 array, the plain one a Python float: the
  # steps agree to float32 rounding (as optax's schedule_free_adamw's do).
  chex.assert_trees_all_close(
      got, _run(cbp.recommended(1e-2, warmup_steps=2), params)[0],
      rtol=1e-4, atol=1e-6)
  with pytest.raises(TypeError, match="static_args=\\('warmup_steps',\\)"):
    optax.inject_hyperparams(cbp.recommended)(
        learning_rate=1e-2, warmup_steps=2).init(params)
  # A dtype is callable: inject_hyperparams takes it for a schedule.
  with pytest.raises(TypeError, match="static_args=\\('state_dtype',\\)"):
    optax.inject_hyperparams(cbp.recommended)(
        learning_rate=1e-2, state_dtype=jnp.float32).init(params)
  kept = optax.inject_hyperparams(cbp.recommended, static_args=(
      'state_dtype',))(learning_rate=1e-2, state_dtype=jnp.float32)
  assert kept.init(params).inner_state.z['dense']['kernel'].dtype == (
      jnp.float32)
  # A scheduled b1 names the one argument that takes a schedule.
  with pytest.raises(TypeError, match='Only learning_rate takes a schedule '
                     r'directly.*cbp.recommended\)\(learning_rate, b1='):
    cbp.recommended(1e-2, b1=optax.constant_schedule(0.9))


@pytest.mark.parametrize('kwargs, error, match', [
    (dict(learning_rate=-1e-3), ValueError, 'learning_rate'),
    (dict(learning_rate='1e-3'), TypeError, 'learning_rate'),
    (dict(learning_rate=float('nan')), ValueError, 'learning_rate'),
    (dict(learning_rate=1e-3, weight_decay=-0.1), ValueError, 'weight_decay'),
    (dict(learning_rate=1e-3, weight_decay=True), TypeError, 'weight_decay'),
    (dict(learning_rate=1e-3, weight_decay=optax.constant_schedule(0.1)),
     TypeError, 'weight_decay'),
    (dict(learning_rate=1e-3, warmup_steps=-1), ValueError, 'warmup_steps'),
    (dict(learning_rate=1e-3, warmup_steps=2.5), TypeError, 'warmup_steps'),
    (dict(learning_rate=1e-3, warmup_steps=True), TypeError, 'warmup_steps'),
    (dict(learning_rate=optax.constant_schedule(1e-3), warmup_steps=10),
     ValueError, 'put the warm-up in the schedule'),
    (dict(learning_rate=1e-3, b1=0.0), ValueError, 'b1'),
    (dict(learning_rate=1e-3, b1=1.0), ValueError, 'b1'),
    (dict(learning_rate=1e-3, b1=optax.constant_schedule(0.9)), TypeError,
     'b1'),
    (dict(learning_rate=1e-3, mask=True), TypeError, 'mask'),
    (dict(learning_rate=1e-3, state_dtype=jnp.int32), TypeError,
     'state_dtype'),
    (dict(learning_rate=1e-3, state_dtype='float17'), TypeError,
     'state_dtype'),
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


def test_recommended_trains_a_centered_conv_model_and_evaluates_at_x():
  model = _ConvNet(nnx.Rngs(0))
  cbp.nnx.center(model)
  optimizer = cbp.nnx.Optimizer(model, cbp.recommended(3e-2, warmup_steps=3))

  def loss_fn(m, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

  step = cbp.nnx.train_step(loss_fn)
  x = jax.random.normal(jax.random.key(1), (16, 6, 6, 1))
  y = jnp.arange(16) % 3
  first = float(loss_fn(cbp.nnx.eval_model(model, optimizer), x, y))
  for _ in range(30):
    step(model, optimizer, x, y)
  # Scored at schedule-free's evaluation point x, not at the model's y.
  evaluated = cbp.nnx.eval_model(model, optimizer)
  assert float(loss_fn(evaluated, x, y)) < 0.5 * first
  assert not jnp.array_equal(evaluated.head.layer.kernel[...],
                             model.head.layer.kernel[...])
  # The centering means moved: the recipe's model side ran.
  assert float(jnp.abs(model.conv.mean[...]).max()) > 0


def test_recommended_keeps_16_bit_models_copy_in_float32_on_request():
  model = nnx.Sequential(
      nnx.Linear(4, 8, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)),
      nnx.relu, nnx.Linear(8, 2, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(1)))
  cbp.nnx.center(model)
  with pytest.raises(ValueError, match='state_dtype=jnp.float32'):
    cbp.nnx.Optimizer(model, cbp.recommended(1e-3))
  optimizer = cbp.nnx.Optimizer(
      model, cbp.recommended(1e-3, state_dtype=jnp.float32))
  step = cbp.nnx.train_step(lambda m, x: jnp.mean(m(x) ** 2))
  assert not bool(step(model, optimizer, jnp.ones((3, 4))).skipped)


def test_a_scheduled_b1_moves_the_evaluation_point_with_it():
  # The refusal of b1=schedule names inject_hyperparams: there, the
  # evaluation point (y - (1 - b1) z) / b1 uses the b1 of the latest update.
  b1 = optax.linear_schedule(0.9, 0.5, 10)
  with jax.enable_x64(True):
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), _tree())
    tx = optax.inject_hyperparams(cbp.recommended)(learning_rate=0.1, b1=b1)
    state = tx.init(params)
    for i in range(6):
      grads = jax.tree.map(lambda x, i=i: jnp.sin(x * (i + 1)), params)
      updates, state = jax.jit(tx.update)(grads, state, params)
      params = optax.apply_updates(params, updates)
    # The sixth update's (inject_hyperparams keeps it in float32).
    used = float(state.hyperparams['b1'])
    assert used == pytest.approx(float(b1(5)), rel=1e-7)
    x = jax.tree.map(lambda y, z: (y - (1 - used) * z) / used, params,
                     state.inner_state.z)
    chex.assert_trees_all_close(
        cbp.linen.eval_params(params, state), x, rtol=1e-14, atol=0)
