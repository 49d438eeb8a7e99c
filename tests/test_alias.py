"""The optimizer factories (``cbp``, ``cbp_robust``): arguments, stats and checks.

Arguments that ``optax.inject_hyperparams`` turns into something else, the
scales ``equalize_stats`` reports and the checks of ``params`` at update (the
experiments' diagnostics: experiments/tests/test_experiments_diagnostics.py).
A test of a fix failed on the code before it (its comment says how); the
others guard what was already right.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import cbp_optax as cbp


def two_layers():
  """A layer with a matrix and a bias, a layer with a vector; energies apart."""
  params = {'a': {'kernel': jnp.array([[1.0, 2.0], [3.0, 4.0]]),
                  'bias': jnp.array([0.5, -0.5])},
            'b': {'kernel': jnp.array([2.0, -1.0, 3.0])}}
  grads = {'a': {'kernel': jnp.full((2, 2), 0.01),
                 'bias': jnp.array([0.02, -0.01])},
           'b': {'kernel': jnp.array([3.0, -2.0, 1.0])}}
  return params, grads


def kernels_only(params):
  """A mask function: decay the matrices. Given the step count (a scalar),
  it returns the single bool False."""
  return jax.tree.map(lambda x: jnp.ndim(x) > 1, params)


KERNEL_MASK = {'a': {'kernel': True, 'bias': False}, 'b': {'kernel': False}}
FACTORIES = {'cbp': cbp.cbp, 'cbp_robust': cbp.cbp_robust}
# cbp_robust is functools.partial(cbp, ...): its messages name cbp.cbp.
MESSAGE_NAME = {'cbp': 'cbp', 'cbp_robust': 'cbp'}


# --- item 5: weight decay and its mask under inject_hyperparams ---------------


def decay_ways(factory):
  """Every way of passing a mask: (transform, decayed leaves), or the error
  that refuses it."""
  inject = optax.inject_hyperparams
  return {
      'tree': (factory(1e-2, weight_decay=0.5, mask=KERNEL_MASK),
               KERNEL_MASK),
      'function': (factory(1e-2, weight_decay=0.5, mask=kernels_only),
                   KERNEL_MASK),
      # The default: the matrices (the leaves of rank >= 2).
      'no mask': (factory(1e-2, weight_decay=0.5), KERNEL_MASK),
      'injected tree': (inject(factory)(1e-2, weight_decay=0.5,
                                        mask=KERNEL_MASK), KERNEL_MASK),
      'injected function in static_args': (
          inject(factory, static_args=('mask',))(
              1e-2, weight_decay=0.5, mask=kernels_only), KERNEL_MASK),
      'injected scheduled decay': (
          inject(factory, static_args=('mask',))(
              1e-2, weight_decay=optax.constant_schedule(0.5),
              mask=kernels_only), KERNEL_MASK),
  }


@pytest.mark.parametrize('way', sorted(decay_ways(cbp.cbp)))
@pytest.mark.parametrize('name', sorted(FACTORIES))
def test_weight_decay_is_applied_as_masked_for_every_way_of_passing_it(
    name, way):
  factory = FACTORIES[name]
  tx, decayed = decay_ways(factory)[way]
  plain = factory(1e-2)
  params, grads = two_layers()
  updates, _ = tx.update(grads, tx.init(params), params)
  expected, _ = plain.update(grads, plain.init(params), params)
  # Decoupled decay adds -lr * wd * param to the decayed leaves only.
  expected = jax.tree.map(lambda u, p, d: u - 1e-2 * 0.5 * p * d, expected,
                          params, decayed)
  chex.assert_trees_all_close(updates, expected, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize('name', sorted(FACTORIES))
def test_mask_function_not_in_static_args_is_refused_naming_the_call(name):
  # Item 5: the function got the step count, returned False, and the decay
  # was silently dropped (cbp_robust: -0.0100 where -0.0350 is expected).
  factory = FACTORIES[name]
  tx = optax.inject_hyperparams(factory)(1e-2, weight_decay=0.5,
                                         mask=kernels_only)
  params, _ = two_layers()
  with pytest.raises(TypeError, match=(
      rf"got the bool False.*optax.inject_hyperparams\(cbp.{MESSAGE_NAME[name]}, "
      r"static_args=\('mask',\)\)\(learning_rate, mask=\.\.\., \.\.\.\)")):
    tx.init(params)


@pytest.mark.parametrize('mask', [True, False, np.bool_(True),
                                  jnp.asarray(True), 1])
def test_a_single_bool_mask_is_refused(mask):
  # mask=False decayed nothing and mask=True everything, silently; what a
  # mask function returns under inject_hyperparams is exactly such a value.
  with pytest.raises(TypeError, match='mask must be a tree of booleans'):
    cbp.cbp(1e-2, weight_decay=0.5, mask=mask)


@pytest.mark.parametrize('injected', [False, True])
def test_mask_without_weight_decay_is_refused(injected):
  # The mask was silently unused.
  factory = optax.inject_hyperparams(cbp.cbp_robust) if injected else (
      cbp.cbp_robust)
  with pytest.raises(ValueError, match='mask selects .* weight_decay is None'):
    factory(1e-2, mask=KERNEL_MASK).init(two_layers()[0])


# --- item 13: function arguments under inject_hyperparams ---------------------


PRESETS = [cbp.layer_blocks, cbp.leaf_blocks, cbp.kernel_blocks,
           cbp.no_blocks]


@pytest.mark.parametrize('factory', [cbp.cbp, cbp.cbp_robust, cbp.equalize])
@pytest.mark.parametrize('preset', PRESETS, ids=lambda f: f.__name__)
def test_block_fn_preset_not_in_static_args_names_static_args(factory,
                                                              preset):
  # Item 13: "leaf_blocks() missing 1 required positional argument: 'leaf'".
  args = (1e-2,) if factory is not cbp.equalize else ()
  tx = optax.inject_hyperparams(factory)(*args, block_fn=preset)
  with pytest.raises(TypeError, match=(
      rf"cbp.{preset.__name__} takes \(path, leaf\) but was called with one "
      r"argument.*static_args=\('block_fn',\)")) as caught:
    tx.init(two_layers()[0])
  # The preset cannot know the factory: it named cbp.cbp for cbp_robust.
  assert 'inject_hyperparams(cbp.' not in str(caught.value)
  assert 'inject_hyperparams(factory, ' in str(caught.value)


@pytest.mark.parametrize('factory', [cbp.cbp, cbp.equalize])
def test_stacked_predicate_not_in_static_args_names_static_args(factory):
  args = (1e-2,) if factory is cbp.cbp else ()
  stacked = cbp.blocks.stacked_predicate([('a',)])
  tx = optax.inject_hyperparams(factory)(*args, stacked=stacked)
  with pytest.raises(TypeError, match=r"static_args=\('stacked',\)"):
    tx.init(two_layers()[0])


@pytest.mark.parametrize('name', sorted(FACTORIES))
def test_function_arguments_that_arrive_as_values_are_refused_together(name):
  # A (path, leaf=None) function returns a value for the step count: it was
  # refused as "block_fn must be a callable or None" (a ValueError) with no
  # word of static_args; the three at once get one call that fixes all.
  block_fn = lambda path, leaf=None: path  # noqa: E731
  stacked = lambda path, leaf=None: False  # noqa: E731
  tx = optax.inject_hyperparams(FACTORIES[name])(
      1e-2, weight_decay=0.1, mask=kernels_only, block_fn=block_fn,
      stacked=stacked)
  with pytest.raises(TypeError, match=(
      rf"cbp.{MESSAGE_NAME[name]}: got block_fn=Array\(0.*stacked=False, "
      rf"mask=False.*inject_hyperparams\(cbp.{MESSAGE_NAME[name]}, static_args=\('block_fn', "
      r"'stacked', 'mask'\)\)")):
    tx.init(two_layers()[0])


@pytest.mark.parametrize('factory', [cbp.cbp, cbp.equalize, cbp.precondition])
def test_callable_dtype_not_in_static_args_is_refused(factory):
  # jnp.float32 is callable: the statistics' dtype became the dtype of
  # jnp.float32(step) (np.float64 gave float32) through a deprecated
  # array-to-dtype conversion.
  args = (1e-2,) if factory is cbp.cbp else ()
  tx = optax.inject_hyperparams(factory)(*args, stats_dtype=jnp.bfloat16)
  with pytest.raises(TypeError, match="stats_dtype='float32'.*static_args"):
    tx.init(two_layers()[0])
  # A string is no callable: inject_hyperparams leaves it alone.
  tx = optax.inject_hyperparams(factory)(*args, stats_dtype='bfloat16')
  state = tx.init(two_layers()[0])
  assert {x.dtype for x in jax.tree.leaves(state.inner_state)
          if jnp.ndim(x) > 0} == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.parametrize('static', [
    ('block_fn',), ('stacked',), ('mask',), ('stats_dtype',)])
def test_function_arguments_in_static_args_match_the_plain_factory(static):
  kwargs = {'block_fn': dict(block_fn=cbp.leaf_blocks),
            'stacked': dict(stacked=cbp.blocks.stacked_predicate([('a',)])),
            'mask': dict(weight_decay=0.5, mask=kernels_only),
            'stats_dtype': dict(stats_dtype=jnp.float32)}[static[0]]
  params, grads = two_layers()
  tx = optax.inject_hyperparams(cbp.cbp_robust, static_args=static)(
      1e-2, **kwargs)
  plain = cbp.cbp_robust(1e-2, **kwargs)
  state, plain_state = tx.init(params), plain.init(params)
  for _ in range(2):
    updates, state = tx.update(grads, state, params)
    expected, plain_state = plain.update(grads, plain_state, params)
  # Injected hyperparameters are float32 arrays, not Python floats: the
  # bias corrections differ in the last bits.
  chex.assert_trees_all_close(updates, expected, rtol=1e-4)


@pytest.mark.parametrize('factory, name, call', [
    (cbp.cbp, 'b1', r'inject_hyperparams\(cbp.cbp\)\('
     r'learning_rate, b1=schedule'),
    (cbp.cbp, 'update_clip', r'inject_hyperparams\(cbp.cbp\)\('
     r'learning_rate, update_clip=schedule'),
    (cbp.equalize, 'decay', r'cbp.equalize takes no schedule directly.*'
     r'inject_hyperparams\(cbp.equalize\)\(decay=schedule'),
    (cbp.precondition, 'damping', r'inject_hyperparams\(cbp.precondition\)'
     r'\(damping=schedule'),
])
def test_a_schedule_names_the_factory_it_was_passed_to(factory, name, call):
  # A b1 schedule passed to cbp_robust suggested inject_hyperparams(cbp.cbp).
  args = (1e-2,) if factory in (cbp.cbp, cbp.cbp_robust) else ()
  with pytest.raises(TypeError, match=f'{name} must be a number.*{call}'):
    factory(*args, **{name: optax.constant_schedule(0.5)})


# --- item 6: the scales equalize_stats reports ---------------------------------


def without_m1(state):
  """``state`` with equalize's count at zero: the next step applies s = 1."""
  is_eq = lambda x: isinstance(x, cbp.EqualizeState)  # noqa: E731
  return jax.tree.map(
      lambda x: x._replace(count=jnp.zeros_like(x.count)) if is_eq(x) else x,
      state, is_leaf=is_eq)


inject = optax.inject_hyperparams
# Transforms read by equalize_stats(state, params) alone. b1 = 0 and no clip
# bind, so the update is linear in s_l g_l and the ratio of the updates with
# and without M1 is the scale the step applies.
SCALE_CONFIGS = {
    'cbp': lambda: cbp.cbp(1e-2, b1=0.0),
    'cbp [0.5, 2]': lambda: cbp.cbp(1e-2, b1=0.0, min_scale=0.5,
                                    max_scale=2.0),
    'cbp_robust': lambda: cbp.cbp_robust(1e-2, b1=0.0),
    'cbp_robust with M1': lambda: cbp.cbp_robust(
        1e-2, b1=0.0, min_scale=0.1, max_scale=4.0, update_clip=None),
    'equalize': lambda: cbp.equalize(min_scale=0.2),
    'injected cbp_robust': lambda: inject(cbp.cbp_robust)(1e-2, b1=0.0),
    'injected cbp [0.3, 3]': lambda: inject(cbp.cbp)(
        1e-2, b1=0.0, min_scale=0.3, max_scale=3.0),
    'injected equalize': lambda: inject(cbp.equalize)(max_scale=2.0),
    'chain with another injected transform': lambda: optax.chain(
        inject(cbp.cbp)(1e-2, b1=0.0, max_scale=2.0),
        inject(optax.scale)(step_size=1.0)),
}


@pytest.mark.parametrize('config', sorted(SCALE_CONFIGS))
def test_reported_scales_are_the_scales_the_next_step_applies(config):
  # Item 6: after cbp_robust it reported 4.0 and 0.707 while 1.0 is applied
  # (the injected configurations here were read with Algorithm 1's clip).
  tx = SCALE_CONFIGS[config]()
  params, grads = two_layers()
  state = tx.init(params)
  for _ in range(3):
    _, state = tx.update(grads, state, params)
  stats = cbp.equalize_stats(state, params)
  with_m1, _ = tx.update(grads, state, params)
  plain, _ = tx.update(grads, without_m1(state), params)
  for name in ('a', 'b'):
    applied = np.ravel(with_m1[name]['kernel'] / plain[name]['kernel'])
    np.testing.assert_allclose(applied, float(stats[name].scale), rtol=1e-5)
  if config.startswith(('cbp_robust', 'injected cbp_robust')):
    if 'with M1' not in config:
      assert [float(s.scale) for s in stats.values()] == [1.0, 1.0]


def test_bounds_set_by_hand_in_the_injected_state_are_the_ones_read():
  tx = inject(cbp.cbp)(1e-2, b1=0.0)
  params, grads = two_layers()
  state = tx.init(params)
  _, state = tx.update(grads, state, params)
  state.hyperparams['max_scale'] = 1.5  # as optax's docs show
  stats = cbp.equalize_stats(state, params)
  with_m1, _ = tx.update(grads, state, params)
  plain, _ = tx.update(grads, without_m1(state), params)
  np.testing.assert_allclose(with_m1['a']['kernel'] / plain['a']['kernel'],
                             float(stats['a'].scale), rtol=1e-5)
  assert float(stats['a'].scale) == 1.5


def test_equalize_stats_without_blocks_needs_no_bounds():
  # The bounds matter only for a scale; no_blocks has none to report.
  tx = cbp.cbp_robust(1e-2, block_fn=cbp.no_blocks)
  params, _ = two_layers()
  assert cbp.equalize_stats(tx.init(params), params,
                            block_fn=cbp.no_blocks) == {}


def test_a_scheduled_bound_is_the_one_of_the_latest_update():
  params, grads = two_layers()
  schedule = optax.linear_schedule(4.0, 1.0, 10)
  tx = inject(cbp.cbp)(1e-2, max_scale=schedule)
  state = tx.init(params)
  for step in range(3):
    _, state = tx.update(grads, state, params)
    assert float(state.inner_state[0].max_scale) == pytest.approx(
        float(schedule(step)))
  stats = cbp.equalize_stats(state, params)
  applied = cbp.equalize_stats(
      state.inner_state, params)  # the same state, outside the injection
  chex.assert_trees_all_equal(stats, applied)


def test_state_records_the_bounds_with_stable_shapes():
  params, grads = two_layers()
  tx = cbp.cbp(1e-2, min_scale=0.5, max_scale=2.0)
  state = tx.init(params)
  _, new_state = tx.update(grads, state, params)
  chex.assert_trees_all_equal_shapes_and_dtypes(state, new_state)
  assert float(state[0].min_scale) == 0.5 == float(new_state[0].min_scale)
  assert float(state[0].max_scale) == 2.0 == float(new_state[0].max_scale)


def test_equalize_stats_of_an_nnx_optimizer_reads_its_injected_bounds():
  model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)),
                         nnx.Linear(4, 1, rngs=nnx.Rngs(1)))
  optimizer = cbp.nnx.Optimizer(model, inject(cbp.cbp_robust)(1e-2))
  optimizer.update(model, nnx.state(model, nnx.Param))  # any gradient
  stats = cbp.equalize_stats(optimizer.opt_state, nnx.state(model, nnx.Param))
  assert [float(s.scale) for s in stats.values()] == [1.0, 1.0]
  assert all(float(s.energy) > 0 for s in stats.values())


def test_equalize_stats_without_the_optimizers_stacked_names_the_argument():
  # Item 13: "the gradient tree has 2 blocks ... The updates must have ...".
  params = {'layers': {'kernel': jnp.ones((3, 2, 2))}, 'head': {'w': jnp.ones(2)}}
  stacked = cbp.blocks.stacked_predicate([('layers',)])
  tx = cbp.cbp(1e-2, stacked=stacked)
  state = tx.init(params)
  with pytest.raises(ValueError, match=(
      r'params have 2 blocks \(with block_fn=None, stacked=None\) but the '
      'optimizer state holds the energies of 4. Pass the block_fn= and '
      'stacked= the optimizer was built with')):
    cbp.equalize_stats(state, params)
  stats = cbp.equalize_stats(state, params, stacked=stacked)
  assert list(stats) == ['head', 'layers[0]', 'layers[1]', 'layers[2]']


def test_equalize_stats_of_a_state_without_equalize_says_what_it_reads():
  params, _ = two_layers()
  with pytest.raises(ValueError, match='found none in the ScaleByAdamState.*'
                     'cbp.cbp_robust'):
    cbp.equalize_stats(optax.scale_by_adam().init(params), params)
  with pytest.raises(ValueError, match=r"found 2.*inner_states\['label'\]"):
    cbp.equalize_stats((cbp.equalize().init(params),) * 2, params)


# --- params at update ------------------------------------------------------------


@pytest.mark.parametrize('name', ['equalize', 'precondition', 'cbp',
                                  'precondition_kron'])
def test_params_that_do_not_match_the_gradients_are_refused(name):
  # precondition silently ignored them (equalize refused them).
  tx = {'equalize': cbp.equalize, 'precondition': cbp.precondition,
        'precondition_kron': cbp.precondition_kron,
        'cbp': lambda: cbp.cbp(1e-2)}[name]()
  params, grads = two_layers()
  state = tx.init(params)
  shorter = {'a': params['a']}
  reshaped = jax.tree.map(lambda x: jnp.ones(x.size + 1), params)
  with pytest.raises(ValueError, match=(
      f'{name if name != "cbp" else "equalize"}: the gradients do not match '
      r'the parameters passed to update \(3 gradient leaves, 2 parameters\)')):
    tx.update(grads, state, shorter)
  with pytest.raises(ValueError, match=(
      r"gradient \['a'\]\['bias'\] has shape \(2,\), its parameter \(3,\)")):
    tx.update(grads, state, reshaped)


def test_equalize_keeps_no_record_of_the_trees_it_was_initialized_on():
  # equalize kept a growing set of every tree init saw: an update without
  # params passed or failed depending on that history (a restored state,
  # never init-ed on this instance, passed).
  params, _ = two_layers()
  other = {'x': {'k': jnp.ones((5, 5))}, 'y': {'k': jnp.ones(7)}}
  used, fresh = cbp.equalize(), cbp.equalize()
  state = used.init(params)
  used.init({'p': {'q': jnp.ones(3)}, 'r': {'s': jnp.ones(1)}})
  chex.assert_trees_all_equal(used.update(other, state),
                              fresh.update(other, state))


def test_precondition_accepts_nnx_variables_at_init_and_arrays_at_update():
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, cbp.precondition(), wrt=nnx.Param)
  grads = nnx.grad(lambda m: jnp.sum(m(jnp.ones((1, 3)))))(model)
  optimizer.update(model, grads)
  assert int(optimizer.opt_state.count[...]) == 1


# --- one check for a function argument -------------------------------------------


@pytest.mark.parametrize('call, match', [
    (lambda: cbp.block_names({}, block_fn='layer'),
     "block_fn must be a function or None, got the str 'layer'"),
    (lambda: cbp.equalize(stacked=3), 'stacked must be a function or None'),
    (lambda: cbp.cbp_robust(1e-2, block_fn='x'), 'block_fn must be a'),
    (lambda: cbp.nnx.train_step('loss'), 'loss_fn must be a function, got'),
])
def test_a_function_argument_of_the_wrong_type_is_a_type_error(call, match):
  # check_callable raised ValueError and check_function TypeError.
  with pytest.raises(TypeError, match=match):
    call()
