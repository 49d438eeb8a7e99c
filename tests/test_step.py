"""The fused step under faults: bad batches, poisoned gradients, overflow,
corrupted data streams, and mixed precision."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

import cbp_optax as cbp
from cbp_optax import _step


def spiral(n_per_arm=100, arms=6, noise=0.15, seed=0):
  """A standardized six-arm noisy spiral in R^2 (the paper's §6.3 task)."""
  rng = np.random.default_rng(seed)
  t = rng.uniform(0.2, 1.0, (arms, n_per_arm))
  angle = 4.0 * t + 2.0 * np.pi * np.arange(arms)[:, None] / arms
  x = np.stack([t * np.cos(angle), t * np.sin(angle)], -1).reshape(-1, 2)
  x = x + noise * rng.standard_normal(x.shape) * 0.2
  x = (x - x.mean(0)) / x.std(0)
  y = np.repeat(np.arange(arms), n_per_arm)
  return x.astype(np.float32), y.astype(np.int32)


class Net(nnx.Module):

  def __init__(self, rngs, dtype=jnp.float32, width=48, depth=3):
    sizes = [2] + [width] * depth + [6]
    self.layers = nnx.List([
        cbp.nnx.Centered(
            nnx.Linear(a, b, dtype=dtype, param_dtype=dtype, rngs=rngs),
            mean_dtype=jnp.float32)
        for a, b in zip(sizes, sizes[1:])
    ])

  def __call__(self, x):
    x = x.astype(self.layers[0].layer.param_dtype)
    for layer in self.layers[:-1]:
      x = nnx.relu(layer(x))
    return self.layers[-1](x).astype(jnp.float32)


def cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def loss_fn(model, x, y):
  return cross_entropy(model(x), y)


def train(model, steps, batches, lr=3e-3, loss=loss_fn):
  optimizer = cbp.nnx.Optimizer(model, cbp.cbp(lr))
  step = cbp.nnx.train_step(loss)
  losses = []
  for i in range(steps):
    x, y = batches(i)
    losses.append(float(step(model, optimizer, x, y).loss))
  return losses, optimizer


def spiral_batches(x, y, batch=64, corrupt=()):
  def batches(i):
    idx = np.random.default_rng(i).choice(len(y), batch, replace=False)
    xb = x[idx].copy()
    if i in corrupt:
      xb[i % batch, i % 2] = np.nan if i % 3 else np.inf
    return xb, y[idx]
  return batches


def full_loss(model, x, y):
  model.eval()
  value = float(loss_fn(model, x, y))
  model.train()
  return value


@pytest.mark.slow
def test_one_percent_corrupted_batches_still_converge():
  x, y = spiral()
  corrupt = set(range(7, 600, 100))  # 6 of 600 batches carry a NaN or Inf
  clean_model, bad_model = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
  _, _ = train(clean_model, 600, spiral_batches(x, y))
  losses, optimizer = train(bad_model, 600, spiral_batches(x, y, corrupt=corrupt))
  assert int(optimizer.skipped_steps[...]) == len(corrupt)
  assert int(optimizer.step[...]) == 600 - len(corrupt)
  assert all(not np.isfinite(losses[i]) for i in corrupt)
  chex.assert_tree_all_finite(nnx.state(bad_model))
  clean, bad = full_loss(clean_model, x, y), full_loss(bad_model, x, y)
  assert bad < 0.6 * np.log(6), bad  # far below chance
  assert abs(bad - clean) < 0.15, (bad, clean)


@jax.custom_vjp
def poison_gradient(w):
  return w


poison_gradient.defvjp(lambda w: (w, None),
                       lambda _, g: (jnp.full_like(g, jnp.nan),))


def test_nan_gradient_of_one_layer_with_finite_loss_skips_the_step():
  x, y = spiral()

  def poisoned_loss(model, x, y):
    # The forward value is untouched; only layer 1's kernel gets NaN grads.
    kernel = model.layers[1].layer.kernel
    kernel[...] = poison_gradient(kernel[...])
    return loss_fn(model, x, y)

  model = Net(nnx.Rngs(0))
  optimizer = cbp.nnx.Optimizer(model, cbp.cbp(3e-3))
  before = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
  out = cbp.nnx.train_step(poisoned_loss)(model, optimizer, x[:64], y[:64])
  assert np.isfinite(float(out.loss)) and bool(out.skipped)
  after = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
  chex.assert_trees_all_equal(after, before)
  assert int(optimizer.skipped_steps[...]) == 1


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16, jnp.float16,
                                   jnp.complex64])
@pytest.mark.parametrize('bad', [np.nan, np.inf, -np.inf])
def test_the_finiteness_check_finds_every_non_finite_entry(dtype, bad):
  check = jax.jit(_step.all_finite)
  finite_max = float(jnp.finfo(dtype).max)
  tree = {'w': jnp.full((37, 5), finite_max, dtype),
          'b': jnp.full((5,), -finite_max, dtype), 'step': jnp.int32(3)}
  assert bool(check(tree))
  for name in ('w', 'b'):
    size = tree[name].size
    for position in (0, size // 2, size - 1):
      values = np.array(tree[name]).ravel()
      values[position] = bad
      poisoned = dict(tree, **{name: jnp.asarray(values).reshape(
          tree[name].shape)})
      assert not bool(check(poisoned)), (name, position)
  assert bool(check({})) and bool(check({'step': jnp.int32(1)}))
  # A product with a constant overflowing to inf must not fold away.
  overflowing = jax.jit(lambda x: _step.all_finite(x * jnp.float32(3e38)))
  assert not bool(overflowing(jnp.float32(2.0)))


def test_bfloat16_gradient_overflow_skips_the_step():
  x, y = spiral()
  model = Net(nnx.Rngs(0), dtype=jnp.bfloat16)
  optimizer = cbp.nnx.Optimizer(model, cbp.cbp(3e-3))
  huge = lambda m, x, y: loss_fn(m, x, y) * jnp.float32(3e38)
  before = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
  out = cbp.nnx.train_step(huge)(model, optimizer, x[:64], y[:64])
  assert bool(out.skipped)
  after = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
  chex.assert_trees_all_equal(after, before)


@jax.custom_vjp
def with_gradient(w, gradient):
  return w


with_gradient.defvjp(lambda w, gradient: (w, gradient),
                     lambda gradient, _: (gradient, jnp.zeros_like(gradient)))


def gradient_step(tx, leaf='kernel'):
  """A fused step whose gradient of layer 1's ``leaf`` is an argument."""
  model = Net(nnx.Rngs(0))
  optimizer = cbp.nnx.Optimizer(model, tx)

  def loss(model, x, y, gradient):
    variable = getattr(model.layers[1].layer, leaf)
    variable[...] = with_gradient(variable[...], gradient)
    return loss_fn(model, x, y)

  step = cbp.nnx.train_step(loss)
  x, y = spiral()
  shape = getattr(model.layers[1].layer, leaf).shape

  def run(gradient):
    before = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(
        (model, optimizer), nnx.Not(nnx.PathContains('skipped_steps')))))
    out = step(model, optimizer, x[:64], y[:64],
               jnp.asarray(gradient, jnp.float32).reshape(shape))
    after = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(
        (model, optimizer), nnx.Not(nnx.PathContains('skipped_steps')))))
    if bool(out.skipped):
      chex.assert_trees_all_equal(after, before)
    return bool(out.skipped)

  return run, optimizer, int(np.prod(shape))


OPTIMIZERS = {'cbp': lambda: cbp.cbp(3e-3),
              'cbp_robust': lambda: cbp.cbp_robust(3e-3),
              'adamw': lambda: optax.adamw(3e-3)}


@pytest.mark.parametrize('leaf', ['kernel', 'bias'])
@pytest.mark.parametrize('name', sorted(OPTIMIZERS))
def test_every_non_finite_gradient_entry_skips_the_fused_step(name, leaf):
  # cbp's chains read the check off M1's energies, the others entry by entry.
  run, optimizer, size = gradient_step(OPTIMIZERS[name](), leaf)
  assert not run(np.full(size, 0.5))
  skips = 0
  for bad in (np.nan, np.inf, -np.inf):
    for position in (0, size // 2, size - 1):
      gradient = np.full(size, 0.5)
      gradient[position] = bad
      assert run(gradient), (bad, position)
      skips += 1
  assert int(optimizer.skipped_steps[...]) == skips
  assert not run(np.full(size, -0.5))  # and training goes on


def test_a_leaf_in_no_m1_block_is_checked_entry_by_entry():
  def kernels_only(path, leaf):
    return None if 'bias' in jax.tree_util.keystr(path) else (
        cbp.blocks.default_block_key(path, leaf))

  run, _, size = gradient_step(cbp.cbp(3e-3, block_fn=kernels_only), 'bias')
  assert not run(np.full(size, 0.5))
  gradient = np.full(size, 0.5)
  gradient[-1] = np.nan
  assert run(gradient)


def test_a_block_norm_beyond_float32_is_a_finite_gradient_not_a_skip():
  # Finite entries whose squared sum overflows float32: M1 stores its energy
  # without the overflow (at most float32's largest value), so the step is
  # taken, as AdamW's is, and every later scale (eq. 6) is finite.
  huge = lambda size: np.full(size, 1e20)
  for tx in (cbp.cbp(3e-3), optax.adamw(3e-3)):
    run, optimizer, size = gradient_step(tx)
    assert not run(huge(size))
  run, optimizer, size = gradient_step(cbp.cbp(3e-3))
  assert not run(huge(size))
  energy = np.asarray(optimizer.opt_state[0].energy[...])
  assert np.isfinite(energy).all() and energy.max() > 1e38


def test_a_state_holding_a_non_finite_energy_skips_every_step():
  run, optimizer, size = gradient_step(cbp.cbp_robust(3e-3))
  assert not run(np.full(size, 0.5))
  energy = optimizer.opt_state[0].energy
  energy[...] = energy[...].at[1].set(jnp.inf)
  assert run(np.full(size, 0.5)) and run(np.full(size, 0.5))
  assert int(optimizer.skipped_steps[...]) == 2


def test_states_beginning_with_m1_witness_the_gradients_and_others_do_not():
  params = {'w': jnp.ones(3)}

  def witnessed(tx):
    return _step.gradients_finite(tx.init(params), lambda s: s) is not None

  assert witnessed(cbp.cbp(1e-3)) and witnessed(cbp.cbp_robust(1e-3))
  assert witnessed(cbp.equalize())
  assert witnessed(optax.chain(cbp.equalize(), optax.sgd(1e-3)))
  assert witnessed(optax.chain(cbp.cbp(1e-3), optax.clip(1.0)))
  # M1 no longer sees the raw gradients (a clip could hide an inf), or the
  # state is not a chain's: entry by entry.
  assert not witnessed(optax.chain(optax.clip(1.0), cbp.cbp(1e-3)))
  assert not witnessed(optax.inject_hyperparams(cbp.cbp)(learning_rate=1e-3))
  assert not witnessed(optax.MultiSteps(cbp.cbp(1e-3), 2))
  assert not witnessed(optax.adamw(1e-3))
  assert _step.gradients_finite(None, lambda s: s) is None


def test_leaves_in_no_block_are_witnessed_by_the_state():
  # kernel_blocks leaves the bias out of M1: its squared norm is recorded
  # apart, so a NaN there is seen without the layout.
  params = {'d': {'kernel': jnp.ones((2, 2)), 'bias': jnp.zeros(2)}}
  tx = cbp.cbp(1e-3, block_fn=cbp.kernel_blocks)
  state = tx.init(params)
  check = _step.gradients_finite(state, lambda s: s)
  grads = jax.tree.map(jnp.ones_like, params)
  _, good = tx.update(grads, state, params)
  assert bool(check(grads, good))
  bad_grads = {'d': {'kernel': grads['d']['kernel'],
                     'bias': jnp.array([1.0, jnp.nan])}}
  _, bad = tx.update(bad_grads, state, params)
  assert jnp.isfinite(bad[0].energy).all()  # the kernel's block is fine
  assert not bool(check(bad_grads, bad))


@pytest.mark.slow
def test_bfloat16_training_tracks_float32():
  """bf16 parameters and activations, float32 statistics (moments, energies,
  centering means): within 0.1 nats of the float32 run on the spiral."""
  x, y = spiral()
  runs = {}
  for dtype in (jnp.float32, jnp.bfloat16):
    model = Net(nnx.Rngs(0), dtype=dtype)
    _, optimizer = train(model, 500, spiral_batches(x, y))
    state = optimizer.opt_state
    assert state[0].energy[...].dtype == jnp.float32
    assert model.layers[0].mean[...].dtype == jnp.float32
    assert model.layers[0].layer.kernel[...].dtype == dtype
    runs[dtype] = full_loss(model, x, y)
  assert runs[jnp.float32] < 0.6 * np.log(6)
  assert abs(runs[jnp.bfloat16] - runs[jnp.float32]) < 0.1, runs


# --- property-based: random trees, shapes, dtypes, gradient sequences --------


@st.composite
def trees_and_gradients(draw):
  dtype = draw(st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16]))
  num_leaves = draw(st.integers(1, 5))
  shapes = [tuple(draw(st.lists(st.integers(1, 3), max_size=3)))
            for _ in range(num_leaves)]
  nesting = draw(st.lists(st.integers(0, 2), min_size=num_leaves,
                          max_size=num_leaves))
  steps = draw(st.integers(1, 6))
  seed = draw(st.integers(0, 2**31 - 1))
  log_scales = draw(st.lists(st.floats(-4, 4), min_size=steps, max_size=steps))
  zero_steps = draw(st.sets(st.integers(0, steps - 1)))
  rng = np.random.default_rng(seed)

  def tree(values):
    return {f'group{k}': {f'leaf{i}': v for i, (v, n) in
                          enumerate(zip(values, nesting)) if n == k}
            for k in range(3)}

  params = tree([jnp.asarray(rng.standard_normal(s), dtype) for s in shapes])
  grads = [tree([jnp.asarray(np.zeros(s) if t in zero_steps else
                             10.0**scale * rng.standard_normal(s), dtype)
                 for s in shapes])
           for t, scale in enumerate(log_scales)]
  return params, grads


@settings(max_examples=20, deadline=None)
@given(trees_and_gradients(), st.sampled_from(['cbp', 'equalize', 'precondition']))
def test_finite_inputs_give_finite_outputs_and_a_fixed_state(problem, name):
  params, grads = problem
  tx = {'cbp': functools.partial(cbp.cbp, 1e-2), 'equalize': cbp.equalize,
        'precondition': cbp.precondition}[name]()
  state = tx.init(params)
  shapes = jax.tree.map(lambda a: (a.shape, a.dtype), state)
  structure = jax.tree.structure(state)
  update = jax.jit(tx.update)  # One compilation, not per-op dispatch.
  for g in grads:
    updates, state = update(g, state, params)
    chex.assert_tree_all_finite((updates, state))
    assert jax.tree.structure(state) == structure
    assert jax.tree.map(lambda a: (a.shape, a.dtype), state) == shapes
    for u, p in zip(jax.tree.leaves(updates), jax.tree.leaves(params)):
      # Updates keep the parameter dtype (optax's contract); a float16
      # direction beyond float16's range saturates instead of overflowing.
      assert u.dtype == p.dtype and u.shape == p.shape
