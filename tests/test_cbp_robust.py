"""``zero_moment='normalized'`` and ``cbp_robust`` against the float64 reference.

The option is off by default (tests/test_reference.py checks Algorithm 1,
unchanged); here: the reference match of the option alone and inside
``cbp_robust``, guards that fail when the rule is dropped, Lemma 1's bounds on
random gradients, construction-time validation, ``optax.inject_hyperparams``
under ``jit`` and ``cbp_robust`` spelled out as a chain. With the studies'
relative damping: experiments/tests/test_configurations.py.
"""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cbp_optax as cbp
from tests import numpy_reference as ref
from tests.test_reference import CLIP
from tests.test_reference import from_tree
from tests.test_reference import LR
from tests.test_reference import max_relative_error
from tests.test_reference import REF_CLIP
from tests.test_reference import run_both
from tests.test_reference import SHAPES
from tests.test_reference import spiky_sequence
from tests.test_reference import to_tree


def run_sequence(make_tx, reference, grads_seq, seed=0):
  """``run_both`` on a given gradient sequence (exact zeros included)."""
  rng = np.random.default_rng(seed)
  params_np = [[rng.standard_normal(s) for s in b] for b in SHAPES]
  with jax.enable_x64(True):
    tx = make_tx()
    params = to_tree(params_np)
    state = tx.init(params)
    update = jax.jit(tx.update)
    worst = 0.0
    for grads_np in grads_seq:
      updates, state = update(to_tree(grads_np), state, params)
      params = optax.apply_updates(params, updates)
      params_np = reference.step(params_np, grads_np)
      worst = max(worst, max_relative_error(from_tree(params), params_np))
  return worst


@pytest.mark.parametrize('b1', [0.9, 0.0])
def test_normalized_first_step_matches_numpy_reference(b1):
  # With relative damping (the experiments' configurations):
  # experiments/tests/test_configurations.py.
  kw = dict(b1=b1, b2=0.99, damping=1e-3)
  reference = ref.CBPReference(SHAPES, lr=LR, rho=0.9, **REF_CLIP, **kw,
                               normalized_first_step=True)
  worst, clip_low, clip_high = run_both(
      lambda: cbp.cbp(LR, decay=0.9, **CLIP, **kw, zero_moment='normalized'),
      reference)
  assert clip_low and clip_high
  assert worst <= 1e-10, worst


def test_normalized_first_step_matches_reference_on_sparse_gradients():
  # Coordinates whose gradient is exactly zero for the first half of the run
  # take the rule when they first become non-zero, not only at step 1.
  grads_seq = spiky_sequence(np.random.default_rng(7), 60)
  reference = ref.CBPReference(SHAPES, lr=LR, b2=0.99, rho=0.9, **REF_CLIP,
                               normalized_first_step=True)
  worst = run_sequence(
      lambda: cbp.cbp(LR, b2=0.99, decay=0.9, **CLIP,
                      zero_moment='normalized'), reference, grads_seq)
  assert worst <= 1e-10, worst
  # Guard: the revived coordinates are where the rule matters after step 1.
  plain = ref.CBPReference(SHAPES, lr=LR, b2=0.99, rho=0.9, **REF_CLIP)
  worst = run_sequence(
      lambda: cbp.cbp(LR, b2=0.99, decay=0.9, **CLIP,
                      zero_moment='normalized'), plain, grads_seq)
  assert worst > 1e-3, worst


def test_normalized_first_step_changes_the_update():
  # Guards the reference tests: with the rule dropped, they disagree.
  reference = ref.CBPReference(SHAPES, lr=LR, rho=0.9, **REF_CLIP,
                               normalized_first_step=True)
  worst, _, _ = run_both(lambda: cbp.cbp(LR, decay=0.9, **CLIP), reference)
  assert worst > 1e-3, worst


@pytest.mark.parametrize('scale', [1e-6, 1.0, 1e6])
def test_first_step_is_about_the_learning_rate_whatever_the_scale(scale):
  # Algorithm 1's P_1 = I makes step 1 -lr * g; the option makes it
  # -lr * g / (|g| + damping), about -lr * sign(g), as Adam's first step.
  g = {'w': jnp.array([3.0, -0.5, 2.0]) * scale}
  params = {'w': jnp.zeros(3)}
  tx = cbp.cbp(0.1, damping=1e-12, zero_moment='normalized')
  updates, _ = tx.update(g, tx.init(params), params)
  np.testing.assert_allclose(updates['w'], [-0.1, 0.1, -0.1], rtol=1e-5)
  plain = cbp.cbp(0.1)
  updates, _ = plain.update(g, plain.init(params), params)
  np.testing.assert_allclose(updates['w'], -0.1 * g['w'], rtol=1e-6)


def test_damped_zero_moment_is_algorithm_1_exactly():
  params = {'w': jnp.linspace(-1.0, 1.0, 7)}
  grads = [{'w': jnp.sin(jnp.arange(7.0) * (t + 1))} for t in range(4)]
  plain, explicit = cbp.cbp(1e-2), cbp.cbp(1e-2, zero_moment='damped')
  plain_state, explicit_state = plain.init(params), explicit.init(params)
  for g in grads:
    plain_u, plain_state = plain.update(g, plain_state, params)
    explicit_u, explicit_state = explicit.update(g, explicit_state, params)
    chex.assert_trees_all_equal(plain_u, explicit_u)


def assert_lemma_1_bounds(tx, damping, relative_damping=0.0):
  """``1 / ((1 + relative_damping) G + damping) <= P_t <= 1 / damping`` at
  every step of ``tx`` (b1 = 0: ``P_t = update / g`` coordinatewise),
  including the first and with coordinates revived late."""
  rng = np.random.default_rng(2)
  state = tx.init({'w': jnp.zeros(50)})
  bound = 0.0
  for t in range(30):
    g = rng.standard_normal(50) * np.exp(rng.uniform(-6, 2, 50))
    g[:10] = 0.0 if t < 5 else g[:10]
    bound = max(bound, np.max(np.abs(g)))
    updates, state = tx.update({'w': jnp.asarray(g)}, state)
    nonzero = g != 0
    p = np.asarray(updates['w'])[nonzero] / g[nonzero]
    assert np.all(p <= 1 / damping * (1 + 1e-5))
    lower = 1 / ((1 + relative_damping) * bound + damping)
    assert np.all(p >= lower * (1 - 1e-5)), (t, p.min(), lower)


def test_normalized_first_step_keeps_lemma_1_bounds():
  # With relative damping: experiments/tests/test_configurations.py.
  damping = 1e-3
  assert_lemma_1_bounds(
      cbp.precondition(b1=0.0, damping=damping, zero_moment='normalized'),
      damping)


@pytest.mark.parametrize('bad, error', [
    ('Normalized', ValueError), ('', ValueError), (True, TypeError),
    (None, TypeError), (1, TypeError), (jnp.ones(()), TypeError)])
def test_bad_zero_moment_fails_at_construction(bad, error):
  for make in (lambda: cbp.cbp(1e-2, zero_moment=bad),
               lambda: cbp.cbp_robust(1e-2, zero_moment=bad),
               lambda: cbp.precondition(zero_moment=bad)):
    with pytest.raises(error, match='zero_moment must be one of'):
      make()


@pytest.mark.parametrize('name', ['cbp', 'cbp_robust'])
def test_works_under_inject_hyperparams_and_jit(name):
  make = getattr(cbp, name)
  params = {'a': {'kernel': jnp.ones((3, 2)), 'bias': jnp.zeros(2)}}
  grads = jax.tree.map(lambda x: jnp.cos(x + 1.0), params)
  # zero_moment is a string: inject_hyperparams keeps it static.
  kwargs = dict(learning_rate=1e-2, b1=0.9, damping=1e-3,
                zero_moment='normalized')
  plain = make(**kwargs)
  injected = optax.inject_hyperparams(make)(**kwargs)
  state, injected_state = plain.init(params), injected.init(params)
  for _ in range(3):
    updates, state = jax.jit(plain.update)(grads, state, params)
    injected_updates, injected_state = jax.jit(injected.update)(
        grads, injected_state, params)
    chex.assert_trees_all_close(injected_updates, updates, rtol=1e-5)
  # A hyperparameter can be changed between steps (it is a tracer).
  assert 'zero_moment' not in injected_state.hyperparams
  injected_state.hyperparams['damping'] = jnp.asarray(0.5)
  changed, _ = jax.jit(injected.update)(grads, injected_state, params)
  assert not np.allclose(changed['a']['kernel'], updates['a']['kernel'])


@pytest.mark.parametrize('b1', [0.9, 0.0])
def test_update_clip_matches_numpy_reference(b1):
  # damping 1e-3 against gradients down to 1e-3: many coordinates of the
  # direction exceed 0.5 and are clipped, the others are not.
  kw = dict(b1=b1, b2=0.99, damping=1e-3)
  reference = ref.CBPReference(SHAPES, lr=LR, rho=0.9, **REF_CLIP, **kw,
                               update_clip=0.5)
  worst, _, _ = run_both(
      lambda: cbp.cbp(LR, decay=0.9, **CLIP, **kw, update_clip=0.5),
      reference)
  assert worst <= 1e-10, worst
  # Guard: without the clip the reference disagrees.
  worst, _, _ = run_both(lambda: cbp.cbp(LR, decay=0.9, **CLIP, **kw),
                         reference)
  assert worst > 1e-3, worst


def test_update_clip_bounds_every_coordinate_and_keeps_lemma_1():
  rng = np.random.default_rng(4)
  damping, clip = 1e-3, 2.0
  tx = optax.chain(cbp.precondition(b1=0.0, damping=damping),
                   optax.clip(clip))
  state = tx.init({'w': jnp.zeros(50)})
  bound = 0.0
  clipped = 0
  for t in range(30):
    g = rng.standard_normal(50) * np.exp(rng.uniform(-6, 2, 50))
    g[:10] = 0.0 if t < 5 else g[:10]  # zero history: P = 1 / damping
    bound = max(bound, np.max(np.abs(g)))
    updates, state = tx.update({'w': jnp.asarray(g)}, state)
    u = np.asarray(updates['w'])
    assert np.all(np.abs(u) <= clip * (1 + 1e-6))
    clipped += int(np.sum(np.abs(u) >= clip * (1 - 1e-6)))
    nonzero = g != 0
    p = u[nonzero] / g[nonzero]
    assert np.all(p <= 1 / damping * (1 + 1e-5))
    lower = min(1 / (bound + damping), clip / bound)
    assert np.all(p >= lower * (1 - 1e-5))
  assert clipped > 0  # the clip was exercised


@pytest.mark.parametrize('bad, error', [(0.0, ValueError), (-1.0, ValueError),
                                        (True, TypeError), ('1', TypeError),
                                        (float('inf'), ValueError),
                                        (jnp.ones(2), ValueError)])
def test_bad_update_clip_fails_at_construction(bad, error):
  for make in (cbp.cbp, cbp.cbp_robust):
    with pytest.raises(error, match='update_clip'):
      make(1e-2, update_clip=bad)
  # The clip is optax.clip chained after precondition, not one of its knobs.
  with pytest.raises(TypeError, match="unexpected keyword argument 'update_clip'"):
    cbp.precondition(update_clip=1.0)


def test_update_clip_can_be_injected():
  tx = optax.inject_hyperparams(cbp.cbp)(learning_rate=1.0, update_clip=1.0)
  params = {'w': jnp.zeros(3)}
  state = tx.init(params)
  grads = {'w': jnp.array([1.0, 1e-6, -3.0])}
  _, state = jax.jit(tx.update)({'w': jnp.array([1.0, 0.0, -3.0])}, state,
                                params)
  state.hyperparams['update_clip'] = jnp.asarray(0.25)
  updates, _ = jax.jit(tx.update)(grads, state, params)
  assert np.max(np.abs(updates['w'])) == pytest.approx(0.25)


def test_degenerate_clip_fixes_the_scale_even_when_energies_are_infinite():
  # An infinite stored energy (an infinite gradient, a damaged state):
  # c / sqrt(q) = inf / inf = NaN. A clip [a, a] gives a whatever the ratio
  # (cbp_robust's [1, 1]); a proper interval keeps Algorithm 1's NaN.
  params = {'a': {'w': jnp.ones(3)}, 'b': {'w': jnp.ones(2)}}
  grads = {'a': {'w': jnp.full(3, 1e22)}, 'b': {'w': jnp.full(2, 1.0)}}
  for low, high in ((1.0, 1.0), (0.5, 0.5), (0.1, 4.0)):
    tx = cbp.equalize(decay=0.0, min_scale=low, max_scale=high)
    _, state = tx.update(grads, tx.init(params))
    state = state._replace(energy=state.energy.at[0].set(jnp.inf))
    updates, _ = tx.update(grads, state)
    if low == high:
      np.testing.assert_allclose(updates['a']['w'], low * 1e22, rtol=1e-6)
      np.testing.assert_allclose(updates['b']['w'], low, rtol=1e-6)
    else:
      assert np.all(np.isnan(updates['a']['w']))


ROBUST_REFERENCE = dict(damping=1e-8, relative_damping=0.0,
                        normalized_first_step=True, update_clip=3.0,
                        s_min=1.0, s_max=1.0)


def test_cbp_robust_matches_numpy_reference():
  reference = ref.CBPReference(SHAPES, lr=LR, **ROBUST_REFERENCE)
  worst, _, _ = run_both(lambda: cbp.cbp_robust(LR), reference)
  assert worst <= 1e-10, worst
  assert np.all(reference.last_scales == 1.0)  # S_t = I


def test_cbp_robust_matches_numpy_reference_on_sparse_spiky_gradients():
  grads_seq = spiky_sequence(np.random.default_rng(11), 80)
  reference = ref.CBPReference(SHAPES, lr=LR, **ROBUST_REFERENCE)
  worst = run_sequence(lambda: cbp.cbp_robust(LR), reference, grads_seq)
  assert worst <= 1e-10, worst
  # Guard: each departure matters on this sequence; drop one and the
  # reference disagrees.
  for name, off in [('damping', 1e-3), ('normalized_first_step', False),
                    ('update_clip', None), ('s_min', 0.1)]:
    kw = {**ROBUST_REFERENCE, name: off}
    if name == 's_min':
      kw['s_max'] = 4.0
    dropped = ref.CBPReference(SHAPES, lr=LR, **kw)
    worst = run_sequence(lambda: cbp.cbp_robust(LR), dropped, grads_seq)
    assert worst > 1e-6, (name, worst)


def test_cbp_robust_keeps_lemma_1_bounds():
  # b1 = 0: the direction is P'_t g_t; every P' lies in
  # [min(1 / (G + zeta), c / G), 1 / zeta], c = 3.
  rng = np.random.default_rng(5)
  zeta = 1e-8
  tx = optax.chain(cbp.cbp_robust(1.0, b1=0.0))
  state = tx.init({'w': jnp.zeros(40), 'u': jnp.zeros(10)})
  bound = 0.0
  for t in range(40):
    g = {'w': rng.standard_normal(40) * np.exp(rng.uniform(-8, 3, 40)),
         'u': rng.standard_normal(10) * 10.0 ** rng.uniform(-4, 4)}
    g['w'][:8] = 0.0 if t < 6 else g['w'][:8]
    bound = max(bound, max(np.max(np.abs(x)) for x in g.values()))
    updates, state = tx.update(jax.tree.map(jnp.asarray, g), state)
    for k in g:
      nonzero = g[k] != 0
      p = -np.asarray(updates[k])[nonzero] / g[k][nonzero]
      assert np.all(p <= 1 / zeta * (1 + 1e-5))
      lower = min(1 / (bound + zeta), 3 / bound)
      assert np.all(p >= lower * (1 - 1e-5)), (t, k)
      assert np.all(np.abs(np.asarray(updates[k])) <= 3.0 * (1 + 1e-6))


def test_cbp_robust_is_cbp_with_its_documented_arguments():
  params = {'a': {'kernel': jnp.ones((3, 2)), 'bias': jnp.zeros(2)},
            'b': {'kernel': jnp.ones((2, 2))}}
  grads = [jax.tree.map(lambda x, t=t: jnp.cos(3 * x + t) * 10.0 ** t, params)
           for t in range(4)]
  robust = cbp.cbp_robust(1e-2, weight_decay=0.1)
  spelled = cbp.cbp(1e-2, weight_decay=0.1, damping=1e-8,
                    zero_moment='normalized', update_clip=3.0,
                    min_scale=1.0, max_scale=1.0)
  robust_state, spelled_state = robust.init(params), spelled.init(params)
  for g in grads:
    robust_u, robust_state = robust.update(g, robust_state, params)
    spelled_u, spelled_state = spelled.update(g, spelled_state, params)
    chex.assert_trees_all_equal(robust_u, spelled_u)
  # Passing Algorithm 1's values back gives Algorithm 1, bit for bit.
  algorithm_1 = cbp.cbp_robust(1e-2, damping=1e-3, zero_moment='damped',
                               update_clip=None, min_scale=0.1, max_scale=4.0)
  plain = cbp.cbp(1e-2)
  a_state, p_state = algorithm_1.init(params), plain.init(params)
  for g in grads:
    a_u, a_state = algorithm_1.update(g, a_state, params)
    p_u, p_state = plain.update(g, p_state, params)
    chex.assert_trees_all_equal(a_u, p_u)
  with pytest.raises(TypeError, match='unexpected keyword'):
    cbp.cbp_robust(1e-2, not_an_argument=1)


def cbp_robust_chain(learning_rate, weight_decay=None):
  """``cbp.cbp_robust`` spelled out as an optax chain (README, docs)."""
  return optax.chain(
      cbp.equalize(min_scale=1.0, max_scale=1.0),
      cbp.precondition(damping=1e-8, zero_moment='normalized'),
      optax.clip(3.0),
      *([] if weight_decay is None else [optax.add_decayed_weights(
          weight_decay, lambda p: jax.tree.map(lambda x: x.ndim >= 2, p))]),
      optax.scale_by_learning_rate(learning_rate),
  )


@pytest.mark.parametrize('weight_decay', [None, 0.1])
def test_cbp_robust_is_its_chain_update_for_update(weight_decay):
  params = {'a': {'kernel': jnp.ones((3, 2)), 'bias': jnp.zeros(2)},
            'b': {'kernel': jnp.ones((2, 2))}}
  grads = [jax.tree.map(lambda x, t=t: jnp.cos(3 * x + t) * 10.0 ** t, params)
           for t in range(5)]
  robust = cbp.cbp_robust(1e-2, weight_decay=weight_decay)
  chain = cbp_robust_chain(1e-2, weight_decay)
  robust_state, chain_state = robust.init(params), chain.init(params)
  chex.assert_trees_all_equal_structs(robust_state, chain_state)
  for g in grads:
    robust_u, robust_state = robust.update(g, robust_state, params)
    chain_u, chain_state = chain.update(g, chain_state, params)
    chex.assert_trees_all_equal(robust_u, chain_u)
    chex.assert_trees_all_equal(robust_state, chain_state)
  # The state layout: M1, M3, the clip, [the decay,] the learning rate.
  names = [type(s).__name__ for s in robust_state]
  assert names[:3] == ['EqualizeState', 'PreconditionState', 'EmptyState']
  assert len(names) == (4 if weight_decay is None else 5)


def _kernel_sized_results(tx, shape=(512, 512)):
  """Kernel-shaped arrays the compiled update computes (inputs excluded)."""
  params = {'kernel': jnp.ones(shape), 'bias': jnp.zeros(shape[1:])}
  state = tx.init(params)

  def update(grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  text = jax.jit(update).lower(params, state, params).compile().as_text()
  entry = text[text.index('ENTRY'):]
  result = re.compile(r'\s*(ROOT )?%\S+ = f32\[' + ','.join(map(str, shape))
                      + r'\]\S* (?!parameter)')
  return sum(bool(result.match(line)) for line in entry.splitlines())


def test_robust_update_computes_no_more_kernel_sized_arrays_than_adam():
  """M1's energy square is not merged with M3's where the scale is one.

  Merged, XLA wrote the squared gradient out as a buffer of its own and read
  it back (4 kernel-sized results against Adam's 3: new m, new v, new
  parameters).
  """
  adam = _kernel_sized_results(optax.adam(1e-3))
  assert _kernel_sized_results(cbp.cbp_robust(1e-3)) == adam
  assert _kernel_sized_results(cbp.cbp(1e-3)) == adam


def test_only_unscaled_leaves_are_squared_behind_a_barrier():
  """The barrier keeps an unmultiplied square apart from M3's; elsewhere it
  only costs compile time (one HLO op per leaf)."""
  params = {'kernel': jnp.ones((4, 3)), 'bias': jnp.zeros((3,))}

  def barriers(tx):
    state = tx.init(params)
    text = jax.jit(tx.update).lower(params, state, params).as_text()
    return text.count('optimization_barrier')

  assert barriers(cbp.cbp_robust(1e-3)) == 2
  assert barriers(cbp.equalize(min_scale=1.0, max_scale=1.0)) == 2
  assert barriers(cbp.cbp(1e-3)) == 0
  assert barriers(cbp.equalize(min_scale=0.5, max_scale=0.5)) == 0
