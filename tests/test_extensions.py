"""The opt-in extensions of Algorithm 1 against the float64 NumPy reference.

``block_fn`` presets that leave leaves out of M1. The defaults stay Algorithm
1: tests/test_reference.py checks those, unchanged. The ablation studies'
knobs (``relative_damping``, the transformer ablation's combination) are the
experiments' ``configurations``: experiments/tests/test_configurations.py.
"""

import chex
import jax.numpy as jnp
import numpy as np

import cbp_optax as cbp
from tests import numpy_reference as ref
from tests.test_reference import CLIP
from tests.test_reference import LR
from tests.test_reference import REF_CLIP
from tests.test_reference import run_both
from tests.test_reference import SHAPES


def _without_last_block(path, leaf):
  del leaf
  return None if path[0].key == 'layer3' else path[:-1]


def test_block_left_out_of_m1_matches_numpy_reference():
  reference = ref.CBPReference(SHAPES, lr=LR, rho=0.9,
                               equalized=[True, True, True, False], **REF_CLIP)
  worst, clip_low, clip_high = run_both(
      lambda: cbp.cbp(LR, decay=0.9, block_fn=_without_last_block, **CLIP),
      reference)
  assert clip_low and clip_high
  assert worst <= 1e-10, worst


def test_left_out_leaf_passes_through_equalize_unscaled():
  params = {'a': {'kernel': jnp.ones((2, 3)), 'bias': jnp.ones(3)},
            'b': {'kernel': jnp.ones((3, 1)), 'bias': jnp.ones(1)},
            'norm': {'scale': jnp.ones(3)}}
  grads = {'a': {'kernel': jnp.full((2, 3), 1e-3), 'bias': jnp.full(3, 5.0)},
           'b': {'kernel': jnp.full((3, 1), 10.0), 'bias': jnp.full(1, 7.0)},
           'norm': {'scale': jnp.full(3, 1e4)}}
  tx = cbp.equalize(decay=0.0, block_fn=cbp.kernel_blocks)
  state = tx.init(params)
  assert state.energy.shape == (2,)
  for _ in range(3):
    updates, state = tx.update(grads, state)
  for name in ('a', 'b'):
    chex.assert_trees_all_equal(updates[name]['bias'], grads[name]['bias'])
  chex.assert_trees_all_equal(updates['norm'], grads['norm'])
  # The kernels alone set the target: a's tiny kernel is boosted to the cap.
  np.testing.assert_allclose(updates['a']['kernel'], 4.0 * 1e-3, rtol=1e-6)
  stats = cbp.equalize_stats(state, params, block_fn=cbp.kernel_blocks)
  assert list(stats) == ['a', 'b']


def test_block_presets_name_their_blocks():
  params = {'attn': {'query': {'kernel': jnp.ones((4, 2, 2)),
                               'bias': jnp.ones((2, 2))}},
            'embed': {'embedding': jnp.ones((8, 4))},
            'norm': {'scale': jnp.ones(4), 'bias': jnp.ones(4)}}
  assert cbp.block_names(params) == cbp.block_names(
      params, block_fn=cbp.layer_blocks) == ('attn/query', 'embed', 'norm')
  assert cbp.block_names(params, block_fn=cbp.leaf_blocks) == (
      'attn/query/bias', 'attn/query/kernel', 'embed/embedding', 'norm/bias',
      'norm/scale')
  assert cbp.block_names(params, block_fn=cbp.kernel_blocks) == (
      'attn/query',)


def test_every_leaf_left_out_gives_the_identity():
  params = {'w': jnp.arange(3.0)}
  tx = cbp.equalize(block_fn=lambda path, leaf: None)
  state = tx.init(params)
  assert state.energy.shape == (0,)
  updates, _ = tx.update(params, state)
  chex.assert_trees_all_equal(updates, params)
