"""Behaviour of equalize, precondition and cbp: semantics, interop, bad input."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import cbp_optax as cbp
from tests import numpy_reference as ref
from tests.test_reference import BLOCK_SCALES
from tests.test_reference import CLIP
from tests.test_reference import from_tree
from tests.test_reference import LR
from tests.test_reference import max_relative_error
from tests.test_reference import REF_CLIP
from tests.test_reference import SHAPES
from tests.test_reference import to_tree


def make_params(dtype=jnp.float32):
  return {
      'Dense_0': {'kernel': jnp.ones((3, 4), dtype), 'bias': jnp.zeros(4, dtype)},
      'Dense_1': {'kernel': jnp.ones((4, 2), dtype), 'bias': jnp.zeros(2, dtype)},
  }


def make_grads(seed, dtype=jnp.float32, scales=(1.0, 100.0)):
  keys = jax.random.split(jax.random.key(seed), 4)
  params = make_params()
  return {
      name: {
          leaf: (scale * jax.random.normal(k, x.shape)).astype(dtype)
          for (leaf, x), k in zip(sorted(layer.items()), keys[2 * i:2 * i + 2])
      }
      for i, ((name, layer), scale) in enumerate(
          zip(sorted(params.items()), scales)
      )
  }


ALL_TRANSFORMS = {
    'equalize': cbp.equalize,
    'precondition': cbp.precondition,
    'cbp': lambda: cbp.cbp(1e-2),
}


# --- ordering, lag and first step ------------------------------------------


def test_first_step_is_identity_operator():
  """s_l = 1 and P_1 = I: the first update is the bias-corrected momentum, g."""
  grads = make_grads(0)
  tx = optax.chain(cbp.equalize(), cbp.precondition())
  updates, _ = tx.update(grads, tx.init(make_params()))
  chex.assert_trees_all_close(updates, grads, rtol=1e-6)


def test_operator_at_step_t_does_not_depend_on_gradient_t():
  """Theorem 3's measurability: M_t = P_t S_t is a function of the past."""
  tx = cbp.cbp(1.0, b1=0.0)
  params = make_params()
  state = tx.init(params)
  for seed in range(3):
    _, state = tx.update(make_grads(seed), state, params)
  g_a = make_grads(10, scales=(1.0, 1.0))
  g_b = make_grads(11, scales=(1e3, 1e-3))
  u_a, _ = tx.update(g_a, state, params)
  u_b, _ = tx.update(g_b, state, params)
  ratio_a = jax.tree.map(lambda u, g: u / g, u_a, g_a)
  ratio_b = jax.tree.map(lambda u, g: u / g, u_b, g_b)
  chex.assert_trees_all_close(ratio_a, ratio_b, rtol=1e-5)
  # ... whereas the state after the step does depend on it.
  _, s_a = tx.update(g_a, state, params)
  _, s_b = tx.update(g_b, state, params)
  assert not np.allclose(s_a[0].energy, s_b[0].energy)


def test_equalize_refreshes_energy_after_scaling():
  tx = cbp.equalize(decay=0.5)
  grads = make_grads(0)
  state = tx.init(make_params())
  updates, state = tx.update(grads, state)
  chex.assert_trees_all_close(updates, grads)  # s = 1 at t = 1
  expected = 0.5 * np.array([
      sum(float(jnp.sum(x**2)) for x in jax.tree.leaves(grads[name]))
      for name in ('Dense_0', 'Dense_1')
  ])
  np.testing.assert_allclose(state.energy, expected, rtol=1e-6)
  assert int(state.count) == 1


# --- blocks and names ------------------------------------------------------


def test_default_blocks_are_layers():
  assert cbp.block_names(make_params()) == ('Dense_0', 'Dense_1')
  assert cbp.block_names({'w': jnp.ones(2), 'b': {'x': jnp.ones(1)}}) == (
      'b', 'w')


def test_block_fn_one_block_per_leaf():
  names = cbp.block_names(make_params(), block_fn=lambda path, leaf: path)
  assert names == ('Dense_0/bias', 'Dense_0/kernel', 'Dense_1/bias',
                   'Dense_1/kernel')
  state = cbp.equalize(block_fn=lambda p, x: p).init(make_params())
  assert state.energy.shape == (4,)


def test_nnx_value_suffix_gives_same_blocks():
  model = nnx.Sequential(
      nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.Linear(4, 2, rngs=nnx.Rngs(1))
  )
  variables = nnx.state(model, nnx.Param)
  arrays = jax.tree.map(jnp.asarray, nnx.to_pure_dict(variables))
  assert cbp.block_names(variables) == cbp.block_names(arrays)
  assert len(cbp.block_names(variables)) == 2


def test_stacked_layers_are_one_block_per_slice():
  params = {'layers': {'kernel': jnp.ones((3, 4, 4)), 'bias': jnp.ones((3, 4))},
            'head': {'kernel': jnp.ones((4, 1))}}
  stacked = lambda path, leaf: path[0].key == 'layers'
  names = cbp.block_names(params, stacked=stacked)
  assert names == ('head', 'layers[0]', 'layers[1]', 'layers[2]')
  grads = {'layers': {'kernel': jnp.stack([jnp.full((4, 4), 10.0**i)
                                           for i in range(3)]),
                      'bias': jnp.zeros((3, 4))},
           'head': {'kernel': jnp.ones((4, 1))}}
  tx = cbp.equalize(decay=0.0, stacked=stacked)
  state = tx.init(params)
  _, state = tx.update(grads, state)
  np.testing.assert_allclose(state.energy, [4.0, 16.0, 1600.0, 160000.0])
  updates, _ = tx.update(grads, state)
  scales = updates['layers']['kernel'][:, 0, 0] / grads['layers']['kernel'][:, 0, 0]
  energy = np.array([4.0, 16.0, 1600.0, 160000.0])
  expected = np.clip(np.sqrt(energy.mean()) / np.sqrt(energy[1:]), 0.1, 4.0)
  np.testing.assert_allclose(scales, expected, rtol=1e-6)
  assert expected[0] == 4.0 and expected[2] < 1.0  # slices scaled apart


def test_stacked_mismatch_within_block_is_refused():
  params = {'layers': {'kernel': jnp.ones((3, 4)), 'bias': jnp.ones((2,))}}
  with pytest.raises(ValueError, match='different layer stacks'):
    cbp.equalize(stacked=lambda p, x: p[-1].key == 'kernel').init(params)


def test_equalize_stats_by_name_through_chains():
  params = make_params()
  tx = optax.inject_hyperparams(cbp.cbp)(learning_rate=0.1)
  state = tx.init(params)
  for seed in range(3):
    _, state = tx.update(make_grads(seed), state, params)
  stats = cbp.equalize_stats(state, params)
  assert list(stats) == ['Dense_0', 'Dense_1']
  # Dense_1's gradients are 100x larger: lower energy gets the larger scale.
  assert stats['Dense_1'].energy > 1e3 * stats['Dense_0'].energy
  assert stats['Dense_0'].scale > stats['Dense_1'].scale
  with pytest.raises(ValueError, match='exactly one EqualizeState'):
    cbp.equalize_stats((), params)


# --- degenerate inputs -----------------------------------------------------


def test_zero_gradient_block_gets_finite_scale_and_zero_update():
  tx = cbp.cbp(0.1)
  params = make_params()
  state = tx.init(params)
  grads = make_grads(0)
  grads['Dense_0'] = jax.tree.map(jnp.zeros_like, grads['Dense_0'])
  for _ in range(5):
    updates, state = tx.update(grads, state, params)
    chex.assert_tree_all_finite((updates, state))
    chex.assert_trees_all_equal(
        updates['Dense_0'], jax.tree.map(jnp.zeros_like, grads['Dense_0']))
  stats = cbp.equalize_stats(state, params)
  assert float(stats['Dense_0'].scale) == 4.0  # max_scale


def test_all_zero_gradients_give_zero_updates():
  tx = cbp.cbp(0.1)
  params = make_params()
  state = tx.init(params)
  zeros = jax.tree.map(jnp.zeros_like, params)
  for _ in range(3):
    updates, state = tx.update(zeros, state, params)
    chex.assert_trees_all_equal(updates, zeros)
    chex.assert_tree_all_finite(state)


@pytest.mark.parametrize('block_fn', [None, cbp.leaf_blocks])
@pytest.mark.parametrize('factory', [cbp.equalize, lambda **kw: cbp.cbp(
    0.1, **kw)])
def test_zero_size_leaf_is_in_no_block(factory, block_fn):
  # An empty leaf has no energy: as a block it would add a zero to the mean
  # of eq. (6) and move every other block's scale.
  params = make_params()
  with_empty = dict(params, Empty={'kernel': jnp.zeros((0, 3))})
  tx = factory(block_fn=block_fn) if block_fn else factory()
  state, state_e = tx.init(params), tx.init(with_empty)
  for step in range(3):
    grads = make_grads(step)
    grads_e = dict(grads, Empty={'kernel': jnp.zeros((0, 3))})
    updates, state = tx.update(grads, state, params)
    updates_e, state_e = tx.update(grads_e, state_e, with_empty)
    assert updates_e['Empty']['kernel'].shape == (0, 3)
    chex.assert_trees_all_equal(
        {k: v for k, v in updates_e.items() if k != 'Empty'}, updates)
  assert cbp.block_names(with_empty, block_fn=block_fn) == cbp.block_names(
      params, block_fn=block_fn)
  chex.assert_trees_all_equal(
      cbp.equalize_stats(state, params, block_fn=block_fn),
      cbp.equalize_stats(state_e, with_empty, block_fn=block_fn))


@pytest.mark.parametrize('name', sorted(ALL_TRANSFORMS))
def test_empty_tree(name):
  tx = ALL_TRANSFORMS[name]()
  state = tx.init({})
  updates, new_state = jax.jit(tx.update)({}, state, {})
  assert updates == {}
  chex.assert_trees_all_equal_structs(state, new_state)


def test_single_scalar_parameter():
  tx = cbp.cbp(0.1)
  state = tx.init(jnp.array(1.0))
  for _ in range(3):
    updates, state = tx.update(jnp.array(2.0), state, jnp.array(1.0))
  chex.assert_tree_all_finite(updates)
  assert cbp.block_names(jnp.array(1.0)) == ('',)


@pytest.mark.parametrize('name',
                         sorted(ALL_TRANSFORMS) + ['precondition_kron'])
def test_mismatched_tree_is_refused_clearly(name):
  tx = {**ALL_TRANSFORMS, 'precondition_kron': cbp.precondition_kron}[name]()
  state = tx.init(make_params())
  wrong = {'Dense_0': make_params()['Dense_0']}
  with pytest.raises(ValueError, match='initialized'):
    tx.update(wrong, state, wrong)


def test_mismatched_shape_is_refused_clearly():
  tx = cbp.precondition()
  state = tx.init(make_params())
  grads = make_params()
  grads['Dense_0']['kernel'] = jnp.ones((5, 4))
  with pytest.raises(ValueError, match='shape'):
    tx.update(grads, state)


@pytest.mark.parametrize(
    'factory, kwargs, match',
    [
        (cbp.equalize, dict(decay=1.0), 'decay'),
        (cbp.equalize, dict(decay=-0.1), 'decay'),
        (cbp.equalize, dict(min_scale=0.0), 'min_scale'),
        (cbp.equalize, dict(min_scale=2.0, max_scale=1.0), 'max_scale'),
        (cbp.equalize, dict(max_scale=-1.0), 'max_scale'),
        (cbp.precondition, dict(b1=1.0), 'b1'),
        (cbp.precondition, dict(b2=1.5), 'b2'),
        (cbp.precondition, dict(damping=0.0), 'damping'),
        (cbp.precondition, dict(damping=float('nan')), 'damping'),
        (cbp.cbp, dict(learning_rate=1.0, damping=-1.0), 'damping'),
        (cbp.cbp, dict(learning_rate=1.0, decay=1.0), 'decay'),
    ],
)
def test_invalid_hyperparameters_raise_at_construction(factory, kwargs, match):
  with pytest.raises(ValueError, match=match):
    factory(**kwargs)


@pytest.mark.parametrize('kwargs, match', [
    (dict(block_fn='Dense_0'), 'block_fn must be a function or None'),
    (dict(stacked=3), 'stacked must be a function or None'),
])
def test_non_callable_function_argument_is_a_type_error(kwargs, match):
  # A wrong type is a TypeError (optax's and Python's convention); these
  # were ValueErrors until check_callable and check_function became one.
  with pytest.raises(TypeError, match=match):
    cbp.equalize(**kwargs)


# --- dtypes ----------------------------------------------------------------


def test_bfloat16_params_keep_float32_statistics():
  params = make_params(jnp.bfloat16)
  tx = cbp.cbp(1e-2)
  state = tx.init(params)
  updates, state = tx.update(make_grads(0, jnp.bfloat16), state, params)
  for u in jax.tree.leaves(updates):
    assert u.dtype == jnp.bfloat16
  eq_state, pre_state = state[0], state[1]
  assert eq_state.energy.dtype == jnp.float32
  for m in jax.tree.leaves((pre_state.mu, pre_state.nu)):
    assert m.dtype == jnp.float32


def test_stats_dtype_override():
  tx = cbp.cbp(1e-2, stats_dtype=jnp.bfloat16)
  state = tx.init(make_params())
  assert state[0].energy.dtype == jnp.bfloat16
  assert all(m.dtype == jnp.bfloat16 for m in jax.tree.leaves(state[1].mu))


def test_float64_under_x64():
  with jax.enable_x64(True):
    params = make_params(jnp.float64)
    tx = cbp.cbp(1e-2)
    state = tx.init(params)
    updates, state = jax.jit(tx.update)(make_grads(0, jnp.float64), state,
                                        params)
    assert state[0].energy.dtype == jnp.float64
    assert all(u.dtype == jnp.float64 for u in jax.tree.leaves(updates))


# --- interop with optax ----------------------------------------------------


def test_inject_hyperparams_changes_take_effect():
  params = make_params()
  tx = optax.inject_hyperparams(cbp.cbp)(learning_rate=0.1, damping=1e-3)
  state = tx.init(params)
  update = jax.jit(tx.update)
  _, state = update(make_grads(0), state, params)
  _, state = update(make_grads(1), state, params)
  u_small, _ = update(make_grads(2), state, params)
  state.hyperparams['damping'] = jnp.asarray(10.0)
  state.hyperparams['learning_rate'] = jnp.asarray(0.05)
  u_big, _ = update(make_grads(2), state, params)
  g = make_grads(2)
  # With damping 10, |update| <= lr * s_max * |m_hat| / 10: far smaller.
  assert float(optax.tree.norm(u_big)) < 0.2 * float(optax.tree.norm(u_small))
  assert float(optax.tree.norm(g)) > 0


def test_schedule_learning_rate():
  schedule = optax.linear_schedule(1.0, 0.0, 4)
  tx = cbp.cbp(schedule, b1=0.0)
  params = make_params()
  state = tx.init(params)
  norms = []
  for seed in range(5):
    updates, state = tx.update(make_grads(0), state, params)
    norms.append(float(optax.tree.norm(updates)))
  assert norms[-1] == 0.0 and norms[0] > 0.0


def test_masked_frozen_subtree():
  params = make_params()
  mask = {'Dense_0': {'kernel': False, 'bias': False},
          'Dense_1': {'kernel': True, 'bias': True}}
  tx = optax.masked(cbp.cbp(0.1), mask)
  state = tx.init(params)
  assert cbp.equalize_stats(state, {'Dense_1': params['Dense_1']}).keys() == {'Dense_1'}
  grads = make_grads(0)
  updates, state = jax.jit(tx.update)(grads, state, params)
  chex.assert_trees_all_equal(updates['Dense_0'], grads['Dense_0'])
  assert not np.allclose(updates['Dense_1']['kernel'],
                         grads['Dense_1']['kernel'])


def test_partition_frozen_subtree():
  params = make_params()
  labels = {'Dense_0': {'kernel': 'frozen', 'bias': 'frozen'},
            'Dense_1': {'kernel': 'cbp', 'bias': 'cbp'}}
  tx = optax.partition(
      {'cbp': cbp.cbp(0.1), 'frozen': optax.set_to_zero()}, labels)
  state = tx.init(params)
  updates, state = jax.jit(tx.update)(make_grads(0), state, params)
  chex.assert_trees_all_equal(
      updates['Dense_0'], jax.tree.map(jnp.zeros_like, params['Dense_0']))
  chex.assert_tree_all_finite(updates)


def test_multisteps_zero_updates_between_emits():
  params = make_params()
  tx = optax.MultiSteps(cbp.cbp(0.1), every_k_schedule=3)
  state = tx.init(params)
  update = jax.jit(tx.update)
  for step in range(6):
    updates, state = update(make_grads(step), state, params)
    norm = float(optax.tree.norm(updates))
    if step % 3 == 2:
      assert norm > 0
    else:
      assert norm == 0.0


def test_apply_if_finite_nan_leaves_everything_untouched():
  params = make_params()
  tx = optax.apply_if_finite(cbp.cbp(0.1), max_consecutive_errors=5)
  state = tx.init(params)
  update = jax.jit(tx.update)
  _, state = update(make_grads(0), state, params)
  bad = make_grads(1)
  bad['Dense_1']['kernel'] = bad['Dense_1']['kernel'].at[0, 0].set(jnp.nan)
  updates, new_state = update(bad, state, params)
  chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, params))
  chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
  assert int(new_state.notfinite_count) == 1


def test_tree_map_params_over_state():
  params = make_params()
  tx = cbp.cbp(0.1)
  state = tx.init(params)
  mapped = optax.tree_map_params(tx, lambda p: p * 0 + 7, state)
  chex.assert_trees_all_equal_structs(mapped, state)
  assert float(mapped[1].mu['Dense_0']['kernel'][0, 0]) == 7.0
  assert mapped[0].energy.shape == state[0].energy.shape


def test_state_stable_under_lax_cond():
  params = make_params()
  tx = cbp.cbp(0.1)
  state = tx.init(params)

  @jax.jit
  def maybe_update(pred, grads, state):
    return jax.lax.cond(pred, lambda s: tx.update(grads, s, params)[1],
                        lambda s: s, state)

  new_state = maybe_update(True, make_grads(0), state)
  chex.assert_trees_all_equal_shapes_and_dtypes(new_state, state)


def test_jit_with_donation_and_no_retracing():
  params = make_params()
  tx = cbp.cbp(0.1)
  traces = []

  def step(params, state, grads):
    traces.append(1)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(step, donate_argnums=(0, 1))
  state = tx.init(params)
  for i in range(100):
    params, state = step(params, state, make_grads(i % 3))
  assert len(traces) == 1
  assert int(state[0].count) == 100
  chex.assert_tree_all_finite((params, state))


def test_nnx_optimizer_end_to_end():
  model = nnx.Sequential(nnx.Linear(3, 8, rngs=nnx.Rngs(0)), nnx.relu,
                         nnx.Linear(8, 1, rngs=nnx.Rngs(1)))
  optimizer = nnx.Optimizer(model, cbp.cbp(1e-2), wrt=nnx.Param)
  x = jax.random.normal(jax.random.key(0), (32, 3))
  y = jnp.sum(x, axis=1, keepdims=True)

  @nnx.jit
  def step(model, optimizer):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(step(model, optimizer)) for _ in range(60)]
  assert losses[-1] < 0.2 * losses[0]
  stats = cbp.equalize_stats(optimizer.opt_state, nnx.state(model, nnx.Param))
  assert set(stats) == {'layers/0', 'layers/2'}


@pytest.mark.parametrize('name', sorted(ALL_TRANSFORMS))
@pytest.mark.parametrize('dtype', [jnp.int32, jnp.bool_, jnp.complex64])
def test_non_float_leaves_are_refused_at_init(name, dtype):
  params = {'w': jnp.ones(3), 'steps': jnp.zeros(2, dtype)}
  with pytest.raises(ValueError, match=r"\['steps'\].*optax.masked"):
    ALL_TRANSFORMS[name]().init(params)


def test_non_float_leaves_pass_when_masked_out():
  params = {'w': jnp.ones(3), 'steps': jnp.zeros(2, jnp.int32)}
  tx = optax.partition({'cbp': cbp.cbp(0.1), 'none': optax.set_to_zero()},
                       {'w': 'cbp', 'steps': 'none'})
  state = tx.init(params)
  grads = {'w': jnp.ones(3), 'steps': jnp.zeros(2, jnp.int32)}
  updates, _ = tx.update(grads, state, params)
  assert updates['steps'].dtype == jnp.int32
  chex.assert_tree_all_finite(updates['w'])


def many_leaves(n):
  return {f'layer{i:05d}': {'w': jnp.full((2,), 1.0 + i)} for i in range(n)}


def check_many_leaves(n):
  params = many_leaves(n)
  tx = cbp.cbp(0.1)
  state = tx.init(params)
  assert state[0].energy.shape == (n,)
  updates, state = jax.jit(tx.update)(params, state, params)
  chex.assert_tree_all_finite(updates)
  # Every leaf is its own block at the first step: the update is -lr * g.
  np.testing.assert_allclose(updates['layer00007']['w'], -0.1 * 8.0, rtol=1e-6)


def test_hundreds_of_leaves():
  check_many_leaves(200)


def distinct_step_kernels(compiled_text):
  """Fused kernels the entry computation calls: (total, structurally distinct).

  XLA compiles each structurally distinct kernel separately; identical ones
  (same ops on same shapes, names aside) are compiled once.
  """
  computations = {}
  for block in re.split(r'\n\n+', compiled_text):
    match = re.match(r'\s*(?:ENTRY\s+)?%([\w.\-]+)', block)
    if match:
      computations[match.group(1)] = block
  entry = next(
      b for b in computations.values() if b.lstrip().startswith('ENTRY'))
  called = re.findall(r'fusion\(.*calls=%([\w.\-]+)', entry)

  def canonical(body):
    body = body.split('\n', 1)[1]
    body = re.sub(r', metadata=\{[^}]*\}', '', body)
    return re.sub(r'%[\w.\-]+', '%', body)

  return len(called), len({canonical(computations[c]) for c in called})


def test_compiled_kernels_do_not_grow_with_identical_layers():
  # Compile time grows with the number of *distinct* kernels. Reading a
  # layer's scale as a slice of the energy vector inside its parameter-sized
  # kernels made every layer's kernels distinct (minutes of compile time for
  # thousands of leaves); they must be shared between same-shaped layers.
  counts = {}
  for num_layers in (8, 16):
    params = {f'layer{i:03d}': {'w': jnp.ones((4, 3)), 'b': jnp.ones(3)}
              for i in range(num_layers)}
    tx = cbp.cbp(0.1)
    state = tx.init(params)
    text = jax.jit(tx.update).lower(params, state, params).compile().as_text()
    counts[num_layers] = distinct_step_kernels(text)
  (total_8, distinct_8), (total_16, distinct_16) = counts[8], counts[16]
  # Doubling the layers adds kernels, but (fusion decisions aside, which can
  # move a kernel or two) no distinct ones: each added layer used to add ~4.
  added, added_distinct = total_16 - total_8, distinct_16 - distinct_8
  assert added >= 8 * 2, counts
  assert added_distinct <= 2, counts


@pytest.mark.slow
def test_ten_thousand_leaves():
  # XLA's CPU compile time grows superlinearly with the number of buffers:
  # 20 min and 17.7 GB here on 2 shared cores (Adam: 7.6 min, 12.4 GB).
  check_many_leaves(10_000)


# A finite gradient spike: M1's energies (eq. 5) and M3's moment (eq. 11) of
# a block whose squared norm is beyond float32's range stay finite.


def spike_sequence(steps, at, size):
  """Ordinary float64 gradients of the reference's layers, and one entry of
  ``size`` in layer 1's kernel at step ``at``."""
  rng = np.random.default_rng(5)
  grads = ref.gradient_sequence(rng, SHAPES, steps, BLOCK_SCALES)
  grads[at][1][0][0, 0] = size
  return grads


def run_float32(make_tx, grads_seq):
  """Parameters and updates of a float32 jitted optax loop."""
  rng = np.random.default_rng(0)
  params_np = [[rng.standard_normal(s) for s in b] for b in SHAPES]
  tx = make_tx()
  params = jax.tree.map(lambda x: x.astype(jnp.float32), to_tree(params_np))
  state = tx.init(params)
  update = jax.jit(tx.update)
  all_updates = []
  for grads_np in grads_seq:
    grads = jax.tree.map(lambda x: x.astype(jnp.float32), to_tree(grads_np))
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
    all_updates.append(updates)
  return params_np, params, state, all_updates


@pytest.mark.parametrize('guarded', [False, True])
def test_a_finite_gradient_spike_matches_the_float64_reference(guarded):
  # ||g||^2 = 1e40 overflows float32 (q = inf, and every later scale of
  # eq. 6 was NaN: apply_if_finite applied them); (1 - rho) ||g||^2 = 1e38
  # does not, and the reference keeps it.
  grads_seq = spike_sequence(20, 5, 1e20)
  make = lambda: cbp.cbp(LR, **CLIP)
  if guarded:
    make = lambda: optax.apply_if_finite(cbp.cbp(LR, **CLIP), 3)
  params_np, params, state, updates = run_float32(make, grads_seq)
  reference = ref.CBPReference(SHAPES, lr=LR, **REF_CLIP)
  for grads_np in grads_seq:
    params_np = reference.step(params_np, grads_np)
  assert all(bool(jnp.all(jnp.isfinite(u)))
             for step in updates for u in jax.tree.leaves(step))
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(state))
  got = from_tree(jax.tree.map(lambda x: np.asarray(x, np.float64), params))
  assert max_relative_error(got, params_np) < 1e-3


@pytest.mark.parametrize('name', ['cbp', 'cbp_robust', 'recommended'])
def test_a_gradient_spike_beyond_any_float32_energy_leaves_a_finite_state(
    name):
  # 1e30: even (1 - rho) ||g||^2 is beyond float32's range; the energy and
  # the moment saturate at its largest value, and training goes on.
  make = {'cbp': lambda: cbp.cbp(LR), 'cbp_robust': lambda: cbp.cbp_robust(LR),
          'recommended': lambda: cbp.recommended(LR)}[name]
  _, params, state, updates = run_float32(
      lambda: optax.apply_if_finite(make(), 3), spike_sequence(12, 5, 1e30))
  assert all(bool(jnp.all(jnp.isfinite(u)))
             for step in updates for u in jax.tree.leaves(step))
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(state)
             if jnp.issubdtype(x.dtype, jnp.floating))
  assert int(state.notfinite_count) == 0
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params))


def test_an_eager_update_refuses_another_configurations_state():
  params = {'a': {'w': jnp.ones((2, 2))}, 'b': {'w': jnp.ones(3)}}
  grads = jax.tree.map(jnp.ones_like, params)
  robust = cbp.cbp_robust(1e-2)
  _, robust_state = robust.update(grads, robust.init(params), params)
  with pytest.raises(ValueError, match='records min_scale=1'):
    cbp.cbp(1e-2, update_clip=3.0).update(grads, robust_state, params)
  robust.update(grads, robust_state, params)
