"""cbp_optax against the independent float64 NumPy implementation of Algorithm 1."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cbp_optax as cbp
from tests import numpy_reference as ref

SHAPES = [[(4, 3), (3,)], [(3, 5), (5,)], [(5, 2), (2,)], [(7,)]]
# Orders of magnitude apart, so both clip bounds of eq. (6) bind.
BLOCK_SCALES = [1e-3, 1.0, 30.0, 1e3]
STEPS = 40
LR = 1e-2
# With L blocks the largest one always has c / sqrt(q_l) >= 1 / sqrt(L) = 0.5,
# so the lower bound binds only above that.
CLIP = dict(min_scale=0.6, max_scale=4.0)
REF_CLIP = dict(s_min=0.6, s_max=4.0)


def to_tree(blocks):
  return {
      f'layer{l}': {f'p{i}': jnp.asarray(x) for i, x in enumerate(block)}
      for l, block in enumerate(blocks)
  }


def from_tree(tree):
  return [[np.asarray(tree[f'layer{l}'][f'p{i}']) for i in range(len(b))]
          for l, b in enumerate(SHAPES)]


def max_relative_error(actual, expected):
  errors = [
      np.max(np.abs(a - e) / np.maximum(np.abs(e), 1e-300))
      for ab, eb in zip(actual, expected) for a, e in zip(ab, eb)
  ]
  return max(errors)


def run_both(make_tx, reference, steps=STEPS, seed=0):
  rng = np.random.default_rng(seed)
  grads_seq = ref.gradient_sequence(rng, SHAPES, steps, BLOCK_SCALES)
  params_np = [[rng.standard_normal(s) for s in b] for b in SHAPES]
  with jax.enable_x64(True):
    tx = make_tx()
    params = to_tree(params_np)
    state = tx.init(params)
    update = jax.jit(tx.update)
    worst = 0.0
    clip_low = clip_high = False
    for grads_np in grads_seq:
      updates, state = update(to_tree(grads_np), state, params)
      params = optax.apply_updates(params, updates)
      params_np = reference.step(params_np, grads_np)
      clip_low |= bool(np.any(reference.last_scales == reference.s_min))
      clip_high |= bool(np.any(reference.last_scales == reference.s_max))
      worst = max(worst, max_relative_error(from_tree(params), params_np))
    assert jax.tree.leaves(params)[0].dtype == jnp.float64
  return worst, clip_low, clip_high


@pytest.mark.parametrize('b1', [0.9, 0.0])
def test_cbp_matches_numpy_reference(b1):
  kw = dict(b1=b1, b2=0.99, damping=1e-3)
  reference = ref.CBPReference(SHAPES, lr=LR, rho=0.9, **REF_CLIP, **kw)
  worst, clip_low, clip_high = run_both(
      lambda: cbp.cbp(LR, decay=0.9, **CLIP, **kw), reference
  )
  assert clip_low and clip_high, 'test data must make both clip bounds bind'
  assert worst <= 1e-10, worst


def test_chained_spelling_matches_numpy_reference():
  reference = ref.CBPReference(
      SHAPES, lr=LR, rho=0.95, b2=0.995, **REF_CLIP
  )
  worst, clip_low, clip_high = run_both(
      lambda: optax.chain(
          cbp.equalize(decay=0.95, **CLIP),
          cbp.precondition(b2=0.995),
          optax.scale_by_learning_rate(LR),
      ),
      reference,
  )
  assert clip_low and clip_high
  assert worst <= 1e-10, worst


def test_equalize_alone_matches_numpy_reference():
  reference = ref.CBPReference(
      SHAPES, lr=LR, b1=0.0, rho=0.9, precondition=False, **REF_CLIP
  )
  worst, clip_low, clip_high = run_both(
      lambda: optax.chain(
          cbp.equalize(decay=0.9, **CLIP), optax.scale_by_learning_rate(LR)
      ),
      reference,
  )
  assert clip_low and clip_high
  assert worst <= 1e-10, worst


def test_precondition_alone_matches_numpy_reference():
  reference = ref.CBPReference(SHAPES, lr=LR, b2=0.99, equalize=False)
  worst, _, _ = run_both(
      lambda: optax.chain(
          cbp.precondition(b2=0.99), optax.scale_by_learning_rate(LR)
      ),
      reference,
  )
  assert worst <= 1e-10, worst


def test_cbp_is_the_chain():
  rng = np.random.default_rng(3)
  seq = ref.gradient_sequence(rng, SHAPES, 12, BLOCK_SCALES)
  params = to_tree([[rng.standard_normal(s) for s in b] for b in SHAPES])
  alias = cbp.cbp(0.1, damping=1e-2, min_scale=0.5, max_scale=2.0)
  chained = optax.chain(
      cbp.equalize(min_scale=0.5, max_scale=2.0),
      cbp.precondition(damping=1e-2),
      optax.scale_by_learning_rate(0.1),
  )
  sa, sc = alias.init(params), chained.init(params)
  for grads in seq:
    ua, sa = alias.update(to_tree(grads), sa, params)
    uc, sc = chained.update(to_tree(grads), sc, params)
    for a, c in zip(jax.tree.leaves(ua), jax.tree.leaves(uc)):
      np.testing.assert_array_equal(a, c)


def spiky_sequence(rng, steps):
  """Gradients with sparse coordinates (exact zeros for a while, then
  nonzero) and 1e4x spikes: where recovering v_{t-1} from v_t would lose
  accuracy if it were going to."""
  seq = ref.gradient_sequence(rng, SHAPES, steps, BLOCK_SCALES)
  for t, grads in enumerate(seq):
    for block in grads:
      for g in block:
        g[..., :1] = 0.0 if t < steps // 2 else g[..., :1]  # dead, revived
        if t % 17 == 5:
          g.flat[-1] *= 1e4  # a spike
  return seq


@pytest.mark.parametrize('b2', [0.999, 0.9, 0.0])
def test_lagged_preconditioner_exact_through_spikes_and_sparse_gradients(b2):
  rng = np.random.default_rng(7)
  steps = 200
  grads_seq = spiky_sequence(rng, steps)
  params_np = [[rng.standard_normal(s) for s in b] for b in SHAPES]
  reference = ref.CBPReference(SHAPES, lr=LR, b2=b2, rho=0.9, **REF_CLIP)
  with jax.enable_x64(True):
    tx = cbp.cbp(LR, b2=b2, decay=0.9, **CLIP)
    params = to_tree(params_np)
    state = tx.init(params)
    update = jax.jit(tx.update, donate_argnums=(1,))
    worst = 0.0
    for grads_np in grads_seq:
      updates, state = update(to_tree(grads_np), state, params)
      params = optax.apply_updates(params, updates)
      params_np = reference.step(params_np, grads_np)
      worst = max(worst, max_relative_error(from_tree(params), params_np))
  assert worst <= 1e-10, worst
