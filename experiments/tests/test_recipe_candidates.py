"""The recipe's arms in the workload suite: the recipe itself
(``arms.RECOMMENDED``, ``cbp.recommended``) and the candidates beyond the
peers, schedule-free CBP M3 (``arms.CANDIDATES``)."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cbp_optax as cbp
from cbp_optax_experiments.workloads import arms as arms_lib
from cbp_optax_experiments.workloads import definitions
from cbp_optax_experiments.workloads import protocol

NAMES = [arm.name for arm in arms_lib.CANDIDATES]


def _params():
  keys = jax.random.split(jax.random.key(0), 2)
  return {'a': {'kernel': jax.random.normal(keys[0], (4, 3)),
                'bias': jnp.zeros(3)},
          'b': {'kernel': jax.random.normal(keys[1], (3, 2)),
                'bias': jnp.zeros(2)}}


def _grads(params, i):
  # Block 'a' has 100 times block 'b''s gradient scale.
  return {'a': jax.tree.map(lambda x: 100.0 * jnp.cos(x + i), params['a']),
          'b': jax.tree.map(lambda x: jnp.sin(x - i), params['b'])}


def _run(tx, params, steps=3):
  state = tx.init(params)
  start, out = params, []
  for i in range(steps):
    # Gradients that do not depend on the trajectory: two transforms see
    # the same ones.
    updates, state = tx.update(_grads(start, i), state, params)
    params = optax.apply_updates(params, updates)
    out.append(updates)
  return out, state


def test_the_recipe_arm_is_cbp_recommended_with_the_suites_warmup():
  arm = arms_lib.builtin_arms()[arms_lib.RECOMMENDED]
  ctx = arms_lib.Context(steps=40)
  chex.assert_trees_all_equal(
      _run(arm.make(1e-2, ctx), _params(), steps=6),
      _run(cbp.recommended(1e-2, warmup_steps=ctx.warmup), _params(),
           steps=6))


def test_the_muon_candidate_is_muon_centered_but_for_batch_norm_models():
  builtin = arms_lib.builtin_arms()
  candidate = builtin['muon_centered_batchnorm_plain']
  muon = builtin['muon_centered']
  assert candidate.centered and not candidate.center_batch_norm_models
  assert muon.center_batch_norm_models
  assert candidate.make is muon.make


def test_candidates_follow_the_recipes_model_rule():
  builtin = arms_lib.builtin_arms()
  cnn = definitions.workload('tutorial-cnn', quick=True)
  mlp = definitions.workload('mnist-mlp', quick=True)
  for name in NAMES:
    arm = builtin[name]
    assert arm.centers(mlp) and not arm.centers(cnn), name
  assert builtin['schedule_free_cbp_robust'].eval_params is (
      optax.contrib.schedule_free_eval_params)


def test_schedule_free_cbp_robust_is_its_spelled_out_chain():
  ctx = arms_lib.Context(steps=20)
  rate = optax.warmup_constant_schedule(0.0, 1e-2, ctx.warmup)
  want = optax.contrib.schedule_free(optax.chain(
      cbp.precondition(b1=0.0, b2=0.999, damping=1e-8,
                       zero_moment='normalized'),
      optax.clip(3.0),
      optax.add_decayed_weights(arms_lib.WEIGHT_DECAY, arms_lib.decay_mask),
      optax.scale_by_learning_rate(rate)), learning_rate=rate, b1=0.9)
  arm = arms_lib.builtin_arms()['schedule_free_cbp_robust']
  got = _run(arm.make(1e-2, ctx), _params(), steps=5)[0]
  chex.assert_trees_all_equal(got, _run(want, _params(), steps=5)[0])


@pytest.mark.parametrize('name', NAMES)
def test_candidate_builds_and_trains_a_centered_workload(name):
  # spiral at --quick size: the centered model, the transport after every
  # update (schedule-free's z included), and a falling loss.
  arm = arms_lib.builtin_arms()[name]
  workload = definitions.workload('spiral', quick=True)
  assert arm.centers(workload)
  runner = protocol.make_runner(workload.build(True), arm, workload)
  losses, metrics, initial = runner.run(0, 3e-3)
  assert np.all(np.isfinite(losses)) and math.isfinite(initial)
  assert np.mean(losses[-5:]) < 0.9 * np.mean(losses[:5]), losses
  assert np.all(np.isfinite(metrics))
