"""The paper's guarantees as properties: Lemma 1, Proposition 2 and Lemma 2."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import given, settings, strategies as st

import cbp_optax as cbp


@st.composite
def block_problems(draw):
  """A random pytree of 1-4 blocks and a gradient sequence whose blocks differ
  in scale by up to six orders of magnitude."""
  num_blocks = draw(st.integers(1, 4))
  shapes = [
      [tuple(draw(st.lists(st.integers(1, 4), min_size=0, max_size=2)))
       for _ in range(draw(st.integers(1, 2)))]
      for _ in range(num_blocks)
  ]
  exponents = draw(st.lists(st.floats(-3, 3), min_size=num_blocks,
                            max_size=num_blocks))
  steps = draw(st.integers(2, 7))
  seed = draw(st.integers(0, 2**31 - 1))
  rng = np.random.default_rng(seed)
  grads = [
      {f'b{l}': {f'w{i}': 10.0**e * rng.standard_normal(shape)
                 for i, shape in enumerate(block)}
       for l, (block, e) in enumerate(zip(shapes, exponents))}
      for _ in range(steps)
  ]
  min_scale = draw(st.floats(0.05, 1.0))
  max_scale = draw(st.floats(1.0, 8.0))
  damping = draw(st.floats(1e-4, 1e-1))
  return grads, min_scale, max_scale, damping


@settings(max_examples=15, deadline=None)
@given(block_problems())
def test_lemma1_operator_bounds(problem):
  """With b1 = 0 every coordinate of M_t = P_t S_t lies in
  [s_min / (G + zeta), s_max / zeta] for t >= 2, and M_1 = I."""
  grads, min_scale, max_scale, damping = problem
  with jax.enable_x64(True):
    to_jnp = lambda tree: jax.tree.map(jnp.asarray, tree)
    eq = cbp.equalize(min_scale=min_scale, max_scale=max_scale)
    tx = optax.chain(
        cbp.equalize(min_scale=min_scale, max_scale=max_scale),
        cbp.precondition(b1=0.0, damping=damping),
    )
    eq_state, state = eq.init(to_jnp(grads[0])), tx.init(to_jnp(grads[0]))
    structure = jax.tree.map(lambda x: (x.shape, x.dtype), state)
    # One compilation per example instead of op-by-op dispatch every step.
    eq_update, tx_update = jax.jit(eq.update), jax.jit(tx.update)
    big_g = 0.0  # G of Lemma 1: sup-norm of every equalized gradient so far.
    for t, g in enumerate(grads, start=1):
      g = to_jnp(g)
      equalized, eq_state = eq_update(g, eq_state)
      direction, state = tx_update(g, state)
      chex.assert_tree_all_finite((direction, state))
      assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == structure
      operator = np.concatenate([
          np.ravel(d / x) for d, x in zip(jax.tree.leaves(direction),
                                          jax.tree.leaves(g))
      ])
      if t == 1:
        np.testing.assert_allclose(operator, 1.0, rtol=1e-12)
      else:
        low = min_scale / (big_g + damping)
        high = max_scale / damping
        assert np.all(operator >= low * (1 - 1e-12)), (operator.min(), low)
        assert np.all(operator <= high * (1 + 1e-12)), (operator.max(), high)
      big_g = max(big_g, max(float(jnp.max(jnp.abs(x)))
                             for x in jax.tree.leaves(equalized)))


def equalized_disparity(norms, min_scale, max_scale):
  """Block-norm disparity max/min after one M1 scaling with q_l = ||g_l||^2."""
  grads = {f'b{l}': {'w': jnp.full((4,), n / 2.0)} for l, n in enumerate(norms)}
  tx = cbp.equalize(decay=0.0, min_scale=min_scale, max_scale=max_scale)
  state = tx.init(grads)
  _, state = tx.update(grads, state)  # q_l = ||g_l||^2 exactly (rho = 0)
  equalized, _ = tx.update(grads, state)
  out = np.array([float(optax.tree.norm(equalized[f'b{l}']))
                  for l in range(len(norms))])
  return out.max() / out.min()


def test_proposition2_spread_within_range_is_equalized():
  norms = [1.0, 1.7, 0.6, 2.5]  # c / ||g_l|| all within [0.1, 4]
  assert equalized_disparity(norms, 0.1, 4.0) < 1 + 1e-5


def test_lemma2_disparity_reduced_by_exactly_the_clip_range():
  # Both extreme blocks clip (the largest at s_min, the smallest at s_max).
  norms = np.array([1e-3, 1.0, 3.0, 1e3])
  min_scale, max_scale = 0.6, 4.0
  spread = norms.max() / norms.min()
  disparity = equalized_disparity(norms, min_scale, max_scale)
  np.testing.assert_allclose(disparity, spread / (max_scale / min_scale),
                             rtol=1e-5)


@settings(max_examples=15, deadline=None)
@given(st.lists(st.floats(-4, 4), min_size=2, max_size=6),
       st.floats(0.05, 1.0), st.floats(1.0, 8.0))
def test_lemma2_clip_cannot_over_correct(exponents, min_scale, max_scale):
  """Phi >= kappa_* / R for any block norms; Phi <= kappa_* (never worse)."""
  norms = 10.0 ** np.array(exponents)
  spread = norms.max() / norms.min()
  disparity = equalized_disparity(norms, min_scale, max_scale)
  assert disparity >= spread / (max_scale / min_scale) * (1 - 1e-4)
  assert disparity <= max(spread, 1.0) * (1 + 1e-4)
