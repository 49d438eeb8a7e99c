"""The ablation studies' optimizer configurations (``configurations``).

``relative_damping`` (damping relative to each tensor's stored second-moment
scale, a knob of the ablation studies: ``relative_precondition``, alone and
with ``zero_moment='normalized'``), the transformer ablation's combination and
``cbp_study``, the studies' spelled-out ``cbp.cbp``, against the library's
float64 NumPy reference (tests/numpy_reference.py) and its weight decay.
"""

import json
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cbp_optax as cbp
from cbp_optax_experiments import configurations
from tests import numpy_reference as ref
from tests.test_cbp_robust import assert_lemma_1_bounds
from tests.test_reference import CLIP
from tests.test_reference import LR
from tests.test_reference import REF_CLIP
from tests.test_reference import run_both
from tests.test_reference import SHAPES
from tests.test_weight_decay import decayed
from tests.test_weight_decay import TREES
from tests.test_weight_decay import _w


@pytest.mark.parametrize('damping', [1e-3, 1e-8])
@pytest.mark.parametrize('b1', [0.9, 0.0])
def test_relative_damping_matches_numpy_reference(damping, b1):
  kw = dict(b1=b1, b2=0.99, damping=damping)
  reference = ref.CBPReference(SHAPES, lr=LR, rho=0.9, relative_damping=0.3,
                               **REF_CLIP, **kw)
  worst, clip_low, clip_high = run_both(
      lambda: configurations.cbp_study(LR, decay=0.9, relative_damping=0.3,
                                       **CLIP, **kw),
      reference)
  assert clip_low and clip_high
  assert worst <= 1e-10, worst


def test_relative_damping_changes_the_update():
  # Guards the test above: with the term dropped, the reference disagrees.
  reference = ref.CBPReference(SHAPES, lr=LR, rho=0.9, relative_damping=0.3,
                               damping=1e-8, **REF_CLIP)
  worst, _, _ = run_both(
      lambda: cbp.cbp(LR, decay=0.9, damping=1e-8, **CLIP), reference)
  assert worst > 1e-3, worst


@pytest.mark.parametrize('b1', [0.9, 0.0])
def test_normalized_first_step_with_relative_damping_matches_numpy_reference(
    b1):
  # tests/test_cbp_robust.py: the option alone, through cbp.cbp.
  kw = dict(b1=b1, b2=0.99, damping=1e-3)
  reference = ref.CBPReference(SHAPES, lr=LR, rho=0.9, **REF_CLIP, **kw,
                               relative_damping=0.3,
                               normalized_first_step=True)
  worst, clip_low, clip_high = run_both(
      lambda: configurations.cbp_study(LR, decay=0.9, **CLIP, **kw,
                                       relative_damping=0.3,
                                       zero_moment='normalized'),
      reference)
  assert clip_low and clip_high
  assert worst <= 1e-10, worst


def test_normalized_first_step_with_relative_damping_keeps_lemma_1_bounds():
  # tests/test_cbp_robust.py: the same bounds without relative damping.
  damping, relative_damping = 1e-3, 0.5
  assert_lemma_1_bounds(configurations.relative_precondition(
      b1=0.0, damping=damping, relative_damping=relative_damping,
      zero_moment='normalized'), damping, relative_damping)


def test_relative_damping_is_per_slice_of_a_stacked_leaf():
  rng = np.random.default_rng(0)
  # Two layers whose gradients differ by 1e3: one r per slice, not per leaf.
  slices = [rng.standard_normal((3, 4)) * s for s in (1e-3, 1.0)]
  stacked_tree = {'layers': {'kernel': jnp.stack(slices)}}
  separate = {f'layer{i}': {'kernel': jnp.asarray(x)}
              for i, x in enumerate(slices)}
  kw = dict(b1=0.0, damping=1e-8, relative_damping=1.0)
  stacked_tx = configurations.relative_precondition(
      stacked=lambda path, leaf: True, **kw)
  separate_tx = configurations.relative_precondition(**kw)
  stacked_state = stacked_tx.init(stacked_tree)
  separate_state = separate_tx.init(separate)
  for t in range(3):
    scale = 1.0 + t
    stacked_g = jax.tree.map(lambda x: x * scale, stacked_tree)
    separate_g = jax.tree.map(lambda x: x * scale, separate)
    stacked_u, stacked_state = stacked_tx.update(stacked_g, stacked_state)
    separate_u, separate_state = separate_tx.update(separate_g, separate_state)
  for i in range(2):
    np.testing.assert_allclose(stacked_u['layers']['kernel'][i],
                               separate_u[f'layer{i}']['kernel'], rtol=1e-6)
  # Without the stack declaration the small slice is damped by the large one.
  whole_tx = configurations.relative_precondition(**kw)
  whole_state = whole_tx.init(stacked_tree)
  for t in range(3):
    whole_u, whole_state = whole_tx.update(
        jax.tree.map(lambda x, t=t: x * (1.0 + t), stacked_tree), whole_state)
  assert np.max(np.abs(whole_u['layers']['kernel'][0])) < 0.01 * np.max(
      np.abs(separate_u['layer0']['kernel']))


def test_relative_damping_keeps_lemma_1_bounds():
  # b1 = 0: the update is P_t g_t, so P_t = update / g coordinatewise.
  rng = np.random.default_rng(1)
  damping, delta = 1e-3, 0.5
  tx = configurations.relative_precondition(b1=0.0, damping=damping,
                                          relative_damping=delta)
  params = {'w': jnp.zeros(50)}
  state = tx.init(params)
  bound = 0.0
  for _ in range(30):
    g = rng.standard_normal(50) * np.exp(rng.uniform(-6, 2, 50))
    bound = max(bound, np.max(np.abs(g)))
    updates, state = tx.update({'w': jnp.asarray(g)}, state)
    p = np.asarray(updates['w']) / g
    assert np.all(p <= 1 / damping * (1 + 1e-5))
    # |g| <= G for every gradient so far, hence v_hat <= G^2 and r <= G.
    assert np.all(p >= 1 / ((1 + delta) * bound + damping) * (1 - 1e-5))


@pytest.mark.parametrize('kwargs', [
    {}, dict(weight_decay=0.1, update_clip=0.5),
    dict(damping=1e-8, zero_moment='normalized', min_scale=1.0,
         max_scale=1.0, update_clip=3.0)])
def test_zero_relative_damping_is_algorithm_1_exactly(kwargs):
  # cbp_study (the studies' spelled-out chain) with relative_damping=0.0 is
  # cbp.cbp, update for update and state for state.
  params = {'w': jnp.linspace(-1.0, 1.0, 7)}
  grads = [{'w': jnp.sin(jnp.arange(7.0) * (t + 1)) * 10.0 ** t}
           for t in range(4)]
  plain = cbp.cbp(1e-2, **kwargs)
  study = configurations.cbp_study(1e-2, relative_damping=0.0, **kwargs)
  states = [tx.init(params) for tx in (plain, study)]
  for g in grads:
    plain_u, states[0] = plain.update(g, states[0], params)
    for i, tx in ((1, study),):
      u, states[i] = tx.update(g, states[i], params)
      chex.assert_trees_all_equal(u, plain_u)
      chex.assert_trees_all_equal(states[i], states[0])


@pytest.mark.parametrize('bad, error', [(-0.1, ValueError),
                                        (True, TypeError),
                                        ('0.1', TypeError),
                                        (jnp.ones(2), ValueError),
                                        (float('nan'), ValueError)])
def test_bad_relative_damping_fails_at_construction(bad, error):
  with pytest.raises(error, match='relative_damping'):
    configurations.relative_precondition(relative_damping=bad)


def test_relative_damping_can_be_injected():
  tx = optax.inject_hyperparams(configurations.relative_precondition)(
      relative_damping=0.1)
  params = {'w': jnp.ones(3)}
  state = tx.init(params)
  for _ in range(2):
    updates, state = jax.jit(tx.update)({'w': jnp.arange(1.0, 4.0)}, state)
  assert np.all(np.isfinite(updates['w']))


def test_transformer_combination_matches_numpy_reference():
  # The transformer ablation's combination: M1 off
  # (no_blocks), relative damping on an absolute floor of 1e-8.
  reference = ref.CBPReference(SHAPES, lr=LR, damping=1e-8, equalize=False,
                               relative_damping=0.03)
  worst, _, _ = run_both(
      lambda: configurations.cbp_study(
          LR, **configurations.TRANSFORMER_COMBINATION), reference)
  assert worst <= 1e-10, worst


# cbp_study's updates when relative_damping lived in cbp.precondition
# (computed then, under the XLA flags tests/conftest.py sets, and stored):
# the move to the experiments kept them exactly.
REFERENCE = pathlib.Path(__file__).parent / 'data' / 'relative_damping.json'


@pytest.mark.parametrize('name', ['damped', 'identity_stacked', 'normalized'])
def test_relative_precondition_equals_the_librarys_former_output(name):
  kw = {'damped': dict(relative_damping=0.3),
        'identity_stacked': dict(
            relative_damping=0.5, zero_moment='identity', b1=0.0,
            damping=1e-8, stacked=cbp.blocks.stacked_predicate([('a',)])),
        'normalized': dict(relative_damping=0.3, zero_moment='normalized',
                           damping=1e-8)}[name]
  expected = json.loads(REFERENCE.read_text())[name]
  params = {'a': jnp.zeros((3, 2, 2)), 'b': jnp.zeros((3,))}
  tx = configurations.cbp_study(1e-2, **kw)
  state = tx.init(params)
  rng = np.random.default_rng(0)
  for t, want in enumerate(expected):
    g = {k: jnp.asarray(rng.normal(size=v.shape)
                        * (0 if (t == 0 and k == 'b') else 1), jnp.float32)
         for k, v in params.items()}
    updates, state = tx.update(g, state, params)
    for k in params:
      np.testing.assert_array_equal(np.asarray(updates[k]),
                                    np.asarray(want[k], np.float32))


def test_the_studies_chain_decays_what_cbp_decays():
  # configurations.cbp_study spells cbp.cbp out, its default mask included.
  for tree in TREES.values():
    params = {'tree': tree, 'layer': {'bias': _w(2, 3), 'embedding': _w(5, 2),
                                      'scale': _w(3, 2), 'kernel': _w(2, 2)}}
    assert decayed(configurations.cbp_study(0.1, weight_decay=0.5),
                   params) == decayed(cbp.cbp(0.1, weight_decay=0.5), params)
