"""cbp_optax_experiments.diagnostics against closed forms.

Norms on hand-built trees, Hutchinson and power iteration on quadratics with a
known Hessian, movement and alignment on hand-computable inputs, in float32 and
float64, eagerly and under jit. A few seconds on 2 cores.
"""

import doctest
import math
import re

import chex
import jax
from jax import flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

import cbp_optax as cbp
from cbp_optax_experiments import diagnostics


def hand_tree(dtype=jnp.float32):
  # ||dense_0|| = sqrt(4 * 0.25 + 0) = 1, ||dense_1|| = sqrt(2 * 9) = 3 sqrt 2.
  return {'dense_0': {'kernel': jnp.full((2, 2), 0.5, dtype),
                      'bias': jnp.zeros(2, dtype)},
          'dense_1': {'kernel': jnp.full((2, 1), 3.0, dtype)},
          'scale': jnp.asarray(-2.0, dtype)}


def quadratic(matrix):
  """0.5 x^T H x + b^T x over a two-block tree; its Hessian is ``matrix``."""
  b = jnp.arange(matrix.shape[0], dtype=matrix.dtype)

  def loss(params):
    x = jnp.concatenate([params['a']['w'], params['b']['w']])
    return 0.5 * x @ matrix @ x + b @ x

  n_a = matrix.shape[0] // 2
  params = {'a': {'w': jnp.ones(n_a, matrix.dtype)},
            'b': {'w': jnp.ones(matrix.shape[0] - n_a, matrix.dtype)}}
  return loss, params


def random_spd(seed, n, dtype):
  rng = np.random.default_rng(seed)
  q, _ = np.linalg.qr(rng.standard_normal((n, n)))
  spectrum = np.linspace(1.0, 10.0, n)  # top gap 10 / (10 - 9/(n-1))
  return jnp.asarray(q @ np.diag(spectrum) @ q.T, dtype), spectrum


# --- profiles -------------------------------------------------------------------


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.float64])
def test_gradient_profile_exact_norms_names_and_dtype(dtype):
  with jax.enable_x64(dtype == jnp.float64):
    grads = hand_tree(dtype)
    profile = diagnostics.gradient_profile(grads)
    assert profile.names == cbp.block_names(grads)
    assert profile.names == ('dense_0', 'dense_1', 'scale')
    chex.assert_type(profile.norms, dtype)
    chex.assert_shape(profile.norms, (3,))
    chex.assert_trees_all_close(profile.norms,
                                jnp.asarray([1.0, 3 * 2**0.5, 2.0], dtype),
                                rtol=1e-6)
    chex.assert_trees_all_close(profile.disparity,
                                jnp.asarray(3 * 2**0.5, dtype), rtol=1e-6)


def test_gradient_profile_norms_match_equalize_energies():
  # With decay 0 the M1 state after one step is ||g_l||^2 in state order.
  rng = np.random.default_rng(0)
  grads = {f'layer_{i}': {'kernel': jnp.asarray(rng.standard_normal((3, 3)),
                                                jnp.float32) * 10.0**-i,
                          'bias': jnp.asarray(rng.standard_normal(3),
                                              jnp.float32)}
           for i in range(12)}
  tx = cbp.equalize(decay=0.0)
  _, state = tx.update(grads, tx.init(grads))
  profile = diagnostics.gradient_profile(grads)
  assert profile.names == cbp.block_names(grads)
  assert profile.names[:3] == ('layer_0', 'layer_1', 'layer_10')  # tree order
  chex.assert_trees_all_close(profile.norms**2, state.energy, rtol=1e-5)


def test_profile_of_stacked_layers_and_custom_blocks():
  stacked = lambda path, leaf: path[0].key == 'layers'
  grads = {'layers': {'kernel': jnp.stack([jnp.full((2, 2), 10.0**i)
                                           for i in range(3)]),
                      'bias': jnp.zeros((3, 2))},
           'head': {'kernel': jnp.ones((2, 1))}}
  profile = diagnostics.gradient_profile(grads, stacked=stacked)
  assert profile.names == cbp.block_names(grads, stacked=stacked)
  assert profile.names == ('head', 'layers[0]', 'layers[1]', 'layers[2]')
  chex.assert_trees_all_close(profile.norms,
                              jnp.asarray([2**0.5, 2.0, 20.0, 200.0]))
  chex.assert_trees_all_close(profile.disparity, 200.0 / 2**0.5)
  per_leaf = lambda path, leaf: path
  by_leaf = diagnostics.gradient_profile(grads, block_fn=per_leaf)
  assert by_leaf.names == cbp.block_names(grads, block_fn=per_leaf)
  assert len(by_leaf.names) == 3


def test_profile_under_jit_keeps_the_names():
  grads = hand_tree()
  profile = jax.jit(diagnostics.gradient_profile)(grads)
  assert isinstance(profile, diagnostics.GradientProfile)
  assert profile.names == cbp.block_names(grads)
  chex.assert_trees_all_close(profile,
                              diagnostics.gradient_profile(grads))


def test_disparity_of_zero_blocks():
  zero = diagnostics.gradient_profile({'a': {'w': jnp.zeros(2)},
                                       'b': {'w': jnp.ones(2)}})
  assert float(zero.disparity) == np.inf
  assert np.isnan(diagnostics.gradient_profile({}).disparity)


def test_update_profile_of_sgd_and_m1():
  params = {'low': {'w': jnp.ones(4)}, 'high': {'w': jnp.ones(4)}}
  grads = {'low': {'w': jnp.full(4, 0.01)}, 'high': {'w': jnp.ones(4)}}
  raw = diagnostics.gradient_profile(grads)
  assert raw.names == ('high', 'low')
  chex.assert_trees_all_close(raw.disparity, 100.0, rtol=1e-5)
  # SGD keeps the raw profile, scaled by the learning rate.
  sgd = diagnostics.update_profile(jax.tree.map(lambda g: -0.1 * g, grads),
                                   params)
  chex.assert_trees_all_close(sgd.norms, 0.1 * raw.norms, rtol=1e-6)
  chex.assert_trees_all_close(sgd.relative, jnp.asarray([0.1, 0.001]),
                              rtol=1e-5)
  # M1, second step: s = clip(c / ||g_l||, 0.1, 4), c^2 = mean q = 2.0002.
  tx = cbp.equalize(decay=0.0)
  _, state = tx.update(grads, tx.init(params))
  equalized, _ = tx.update(grads, state)
  m1 = diagnostics.update_profile(equalized)
  assert m1.relative is None
  c = np.sqrt((4.0 + 4e-4) / 2)
  expected = [np.clip(c / 2.0, 0.1, 4) * 2.0, np.clip(c / 0.02, 0.1, 4) * 0.02]
  chex.assert_trees_all_close(m1.norms, jnp.asarray(expected), rtol=1e-5)
  # The clip s <= 4 leaves 0.08 vs 1.41: disparity 100 -> 17.7.
  chex.assert_trees_all_close(m1.disparity, expected[0] / expected[1],
                              rtol=1e-5)
  with pytest.raises(ValueError, match='different blocks'):
    diagnostics.update_profile(grads, {'x': {'w': jnp.ones(4)}})


# --- Hessian trace --------------------------------------------------------------


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.float64])
def test_hutchinson_is_exact_on_a_diagonal_hessian(dtype):
  with jax.enable_x64(dtype == jnp.float64):
    diag = jnp.asarray([1.0, 2.0, 3.0, -0.5, 7.0], dtype)
    loss, params = quadratic(jnp.diag(diag))
    out = diagnostics.hessian_trace(loss, params, jax.random.key(0),
                                    num_samples=4)
    chex.assert_type(out.estimate, dtype)
    chex.assert_trees_all_close(out.estimate, jnp.sum(diag), rtol=1e-6)
    assert float(out.stderr) == 0.0
    assert out.names == ('a', 'b')
    chex.assert_trees_all_close(
        out.block_estimates,
        jnp.asarray([diag[:2].sum(), diag[2:].sum()], dtype), rtol=1e-6)


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.float64])
def test_hutchinson_within_its_standard_error_on_a_dense_hessian(dtype):
  with jax.enable_x64(dtype == jnp.float64):
    matrix, spectrum = random_spd(1, 8, dtype)
    loss, params = quadratic(matrix)
    n = 400
    out = jax.jit(lambda p, k: diagnostics.hessian_trace(
        loss, p, k, num_samples=n, batch_size=50))(params, jax.random.key(3))
    h = np.asarray(matrix, np.float64)
    # Var[v^T H v] = 2 sum_{i != j} H_ij^2 for Rademacher v.
    sd = np.sqrt(2 * (np.sum(h**2) - np.sum(np.diag(h)**2)))
    assert abs(float(out.estimate) - spectrum.sum()) < 4 * float(out.stderr)
    assert float(out.stderr) == pytest.approx(sd / np.sqrt(n), rel=0.2)
    chex.assert_trees_all_close(out.block_estimates.sum(), out.estimate,
                                rtol=1e-5)
    # Each block's estimate targets the trace of its diagonal block.
    for estimate, stderr, block in zip(out.block_estimates, out.block_stderr,
                                       (slice(0, 4), slice(4, 8))):
      exact = np.trace(h[block, block])
      assert abs(float(estimate) - exact) < 4 * float(stderr) + 1e-6


def test_hutchinson_trace_of_a_network_matches_the_dense_hessian():
  # Small tanh net: trace of the full Hessian from jax.hessian, 64 parameters.
  key = jax.random.key(0)
  x = jax.random.normal(key, (16, 3))
  y = jnp.sin(x).sum(-1)
  params = {'l0': {'w': 0.5 * jax.random.normal(jax.random.key(1), (3, 8)),
                   'b': jnp.zeros(8)},
            'l1': {'w': 0.5 * jax.random.normal(jax.random.key(2), (8, 3)),
                   'b': jnp.zeros(3)}}

  def loss(p):
    h = jnp.tanh(x @ p['l0']['w'] + p['l0']['b'])
    return jnp.mean((jnp.sum(h @ p['l1']['w'] + p['l1']['b'], -1) - y)**2)

  flat, unravel = flatten_util.ravel_pytree(params)
  exact = jnp.trace(jax.jit(jax.hessian(lambda f: loss(unravel(f))))(flat))
  out = jax.jit(lambda p: diagnostics.hessian_trace(
      loss, p, jax.random.key(5), num_samples=300))(params)
  assert abs(float(out.estimate - exact)) < 4 * float(out.stderr)
  assert float(out.stderr) < 0.2 * abs(float(exact))


def test_hessian_trace_rejects_bad_arguments():
  loss, params = quadratic(jnp.eye(2))
  with pytest.raises(ValueError, match='num_samples'):
    diagnostics.hessian_trace(loss, params, jax.random.key(0), num_samples=0)
  with pytest.raises(TypeError, match='floating-point'):
    diagnostics.hessian_trace(lambda p: 0.0, {'i': jnp.ones(2, jnp.int32)},
                              jax.random.key(0), num_samples=2)


# --- top eigenvalue -------------------------------------------------------------


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.float64])
def test_power_iteration_finds_the_top_eigenvalue(dtype):
  with jax.enable_x64(dtype == jnp.float64):
    matrix, spectrum = random_spd(2, 10, dtype)
    loss, params = quadratic(matrix)
    out = jax.jit(lambda p: diagnostics.top_eigenvalue(
        loss, p, jax.random.key(0), num_iters=200))(params)
    chex.assert_type(out.eigenvalue, dtype)
    assert out.names == ()
    # The residual bounds the distance to an eigenvalue; here it is the top.
    tol = 1e-3 if dtype == jnp.float32 else 1e-8
    assert float(out.residual) < tol
    assert abs(float(out.eigenvalue) - spectrum[-1]) <= float(
        out.residual) + 10 * tol
    # The vector is the top eigenvector, up to sign.
    v = np.concatenate([out.vector['a']['w'], out.vector['b']['w']])
    top = np.linalg.eigh(np.asarray(matrix, np.float64))[1][:, -1]
    assert abs(abs(v @ top) - 1.0) < 10 * tol


def test_power_iteration_per_block_gives_the_diagonal_blocks_spectra():
  # Block-diagonal plus coupling: per-block values are those of H_aa and H_bb.
  rng = np.random.default_rng(4)
  h_aa = np.diag([1.0, 2.0, 3.0])
  h_bb = np.diag([0.5, 20.0])
  coupling = 0.3 * rng.standard_normal((3, 2))
  matrix = jnp.asarray(np.block([[h_aa, coupling], [coupling.T, h_bb]]),
                       jnp.float32)

  def loss(p):
    x = jnp.concatenate([p['a']['w'], p['b']['w']])
    return 0.5 * x @ matrix @ x

  params = {'a': {'w': jnp.zeros(3)}, 'b': {'w': jnp.zeros(2)}}
  out = diagnostics.top_eigenvalue(loss, params, jax.random.key(1),
                                   num_iters=100, per_block=True)
  assert out.names == cbp.block_names(params) == ('a', 'b')
  chex.assert_trees_all_close(out.eigenvalue, jnp.asarray([3.0, 20.0]),
                              rtol=1e-4)
  # Each vector lives in its own block only.
  chex.assert_trees_all_close(out.vector['b']['w'][0], jnp.zeros(2))
  chex.assert_trees_all_close(out.vector['a']['w'][1], jnp.zeros(3))


def test_power_iteration_per_slice_of_a_layer_stack():
  stacked = lambda path, leaf: path[0].key == 'layers'
  gains = jnp.asarray([1.0, 5.0, 2.0])
  params = {'layers': {'w': jnp.ones((3, 4))}}
  loss = lambda p: 0.5 * jnp.sum(gains[:, None] * p['layers']['w']**2)
  out = diagnostics.top_eigenvalue(loss, params, jax.random.key(0),
                                   num_iters=5, per_block=True,
                                   stacked=stacked)
  assert out.names == ('layers[0]', 'layers[1]', 'layers[2]')
  chex.assert_trees_all_close(out.eigenvalue, gains, rtol=1e-5)


# --- movement and alignment ---------------------------------------------------


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.float64])
def test_parameter_movement_exact(dtype):
  with jax.enable_x64(dtype == jnp.float64):
    init = {'a': {'kernel': jnp.asarray([[3.0, 4.0]], dtype),
                  'bias': jnp.zeros(1, dtype)},
            'b': {'bias': jnp.zeros(2, dtype)},
            'c': {'w': jnp.ones(4, dtype)}}
    now = {'a': {'kernel': jnp.asarray([[3.0, 4.0]], dtype),
                 'bias': jnp.asarray([1.0], dtype)},
           'b': {'bias': jnp.asarray([0.0, 2.0], dtype)},
           'c': {'w': jnp.ones(4, dtype)}}
    out = jax.jit(diagnostics.parameter_movement)(now, init)
    assert out.names == cbp.block_names(init)
    chex.assert_type(out.relative, dtype)
    chex.assert_trees_all_close(out.distances,
                                jnp.asarray([1.0, 2.0, 0.0], dtype))
    # b moved away from zero: infinite relative movement; c did not move.
    chex.assert_trees_all_close(out.relative,
                                jnp.asarray([0.2, np.inf, 0.0], dtype))
    chex.assert_trees_all_close(out.total,
                                jnp.asarray(np.sqrt(5.0) / np.sqrt(29.0),
                                            dtype), rtol=1e-6)
  with pytest.raises(ValueError, match='tree structures'):
    diagnostics.parameter_movement({'a': jnp.ones(1)}, {'b': jnp.ones(1)})


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.float64])
def test_mean_alignment_closed_form(dtype):
  with jax.enable_x64(dtype == jnp.float64):
    # +-1 around mean (3, 0): A = [[10, 0], [0, 1]], Cov = I.
    a = jnp.asarray([[4.0, 1.0], [2.0, -1.0], [4.0, -1.0], [2.0, 1.0]], dtype)
    out = jax.jit(diagnostics.mean_alignment)(a)
    chex.assert_type(out.cosine, dtype)
    chex.assert_trees_all_close(out.cosine, jnp.asarray(1.0, dtype))
    chex.assert_trees_all_close(out.mean_norm, jnp.asarray(3.0, dtype))
    chex.assert_trees_all_close(out.eigenvalues,
                                jnp.asarray([1.0, 10.0], dtype), rtol=1e-6)
    chex.assert_trees_all_close(out.centered_eigenvalues,
                                jnp.asarray([1.0, 1.0], dtype), rtol=1e-6)
    assert float(out.top_eigenvalue) == pytest.approx(10.0)
    assert float(out.centered_top_eigenvalue) == pytest.approx(1.0)


def test_mean_alignment_of_a_mean_orthogonal_to_the_top_direction():
  # Variance 16 along y, mean (1, 0): A = diag(1, 16), v1 = e_y, cos = 0.
  a = jnp.asarray([[1.0, 4.0], [1.0, -4.0]])
  out = diagnostics.mean_alignment(a)
  chex.assert_trees_all_close(out.cosine, 0.0, atol=1e-6)
  chex.assert_trees_all_close(out.top_eigenvalue, 16.0)
  # Eq. (20): lambda_max(A) >= lambda_1(Sigma) + (v1^T mu)^2, equality here.
  chex.assert_trees_all_close(out.centered_top_eigenvalue, 16.0)


def test_mean_alignment_treats_leading_axes_as_samples():
  rng = np.random.default_rng(0)
  a = jnp.asarray(np.abs(rng.standard_normal((4, 5, 6))), jnp.float32)
  chex.assert_trees_all_close(diagnostics.mean_alignment(a),
                              diagnostics.mean_alignment(a.reshape(20, 6)),
                              rtol=1e-5)
  with pytest.raises(ValueError, match='sample axis'):
    diagnostics.mean_alignment(jnp.ones(3))


def test_relu_mean_is_aligned_and_centering_lowers_lambda_max():
  # Rectified activations: the nonnegative mean dominates E[aa^T] (Table 5).
  rng = np.random.default_rng(1)
  a = jnp.asarray(np.maximum(rng.standard_normal((2000, 16)) + 0.5, 0.0),
                  jnp.float32)
  out = diagnostics.mean_alignment(a)
  assert float(out.cosine) > 0.95
  assert float(out.centered_top_eigenvalue) < 0.5 * float(out.top_eigenvalue)
  # Eq. (20) with v1 the top eigenvector of Sigma is a lower bound on A's.
  assert float(out.top_eigenvalue) >= float(out.centered_top_eigenvalue)


def test_docstring_examples():
  failures, tried = doctest.testmod(diagnostics, optionflags=doctest.ELLIPSIS)
  assert tried > 10
  assert failures == 0


def test_the_docs_example_runs(capsys):
  import pathlib  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top
  page = pathlib.Path(__file__).resolve().parents[2] / 'docs/diagnostics.md'
  blocks = re.findall(r'```python\n(.*?)```', page.read_text(), re.S)
  assert len(blocks) == 1
  exec(compile(blocks[0], str(page), 'exec'), {})  # pylint: disable=exec-used
  out = capsys.readouterr().out
  raw = float(re.search(r'raw disparity ([0-9.e+-]+)', out).group(1))
  applied = float(re.search(r'applied disparity ([0-9.e+-]+)', out).group(1))
  assert applied < raw  # M1 flattens the profile of the 1/d_in net


def test_update_profile_relative_to_zero_blocks():
  params = {'a': {'w': jnp.zeros(2)}, 'b': {'w': jnp.zeros(2)}}
  updates = {'a': {'w': jnp.ones(2)}, 'b': {'w': jnp.zeros(2)}}
  out = diagnostics.update_profile(updates, params)
  chex.assert_trees_all_close(out.relative, jnp.asarray([np.inf, 0.0]))


def test_profile_of_a_vanishing_gradient_does_not_underflow():
  # 1e-25 ** 2 underflows float32; the profile still reads the exact norm.
  grads = {'bottom': {'w': jnp.full((4, 4), 1e-25, jnp.float32)},
           'top': {'w': jnp.full((4,), 1.0, jnp.float32)}}
  profile = diagnostics.gradient_profile(grads)
  chex.assert_trees_all_close(profile.norms, jnp.asarray([4e-25, 2.0]),
                              rtol=1e-6)
  chex.assert_trees_all_close(profile.disparity, 5e24, rtol=1e-6)
  stacked = diagnostics.gradient_profile(
      {'s': {'w': jnp.asarray([[3e-30, 4e-30], [0.0, 0.0]])}},
      stacked=lambda path, leaf: True)
  chex.assert_trees_all_close(stacked.norms, jnp.asarray([5e-30, 0.0]),
                              rtol=1e-6)


def test_profile_propagates_nan_and_inf():
  out = diagnostics.gradient_profile({'a': {'w': jnp.asarray([1.0, jnp.nan])},
                                      'b': {'w': jnp.asarray([jnp.inf])},
                                      'c': {'w': jnp.zeros(2)}})
  assert np.isnan(out.norms[0]) and out.norms[1] == np.inf
  assert out.norms[2] == 0.0


# --- argument checks (item 14 of the factories' audit) ------------------------


def test_a_block_fn_of_the_wrong_type_is_a_type_error():
  # check_callable raised ValueError and check_function TypeError.
  with pytest.raises(TypeError, match=(
      'block_fn must be a function or None, got the float 1.0')):
    diagnostics.gradient_profile({}, block_fn=1.0)


def curvature_tree():
  """A diagonal Hessian: every block's top eigenvalue is its largest entry."""
  return {'a': {'kernel': jnp.array([[1.0, 9.0], [2.0, 3.0]]),
                'bias': jnp.array([20.0, 1.0])},
          'b': {'kernel': jnp.array([0.5, 6.0, 1.0])},
          'norm': {'scale': jnp.array([30.0])},
          'stack': {'kernel': jnp.array([[2.0, 12.0], [40.0, 1.0]])}}


def diagonal_loss(curvature):
  def loss(params):
    return 0.5 * sum(jnp.sum(h * p**2) for h, p in zip(
        jax.tree.leaves(curvature), jax.tree.leaves(params)))
  return loss


# The presets that put every leaf in a block worked before: slow tier.
@pytest.mark.parametrize('block_fn, stacked, expected', [
    pytest.param(None, False, {'a': 20.0, 'b': 6.0, 'norm': 30.0,
                               'stack': 40.0}, marks=pytest.mark.slow),
    pytest.param(cbp.layer_blocks, True, {
        'a': 20.0, 'b': 6.0, 'norm': 30.0, 'stack[0]': 12.0,
        'stack[1]': 40.0}, marks=pytest.mark.slow),
    pytest.param(cbp.leaf_blocks, False, {
        'a/bias': 20.0, 'a/kernel': 9.0, 'b/kernel': 6.0, 'norm/scale': 30.0,
        'stack/kernel': 40.0}, marks=pytest.mark.slow),
    (cbp.kernel_blocks, False, {'a': 9.0, 'b': 6.0, 'stack': 40.0}),
    (cbp.kernel_blocks, True, {'a': 9.0, 'b': 6.0, 'stack[0]': 12.0,
                               'stack[1]': 40.0}),
    (cbp.no_blocks, False, {}),
])
def test_top_eigenvalue_per_block_with_every_built_in_block_fn(
    block_fn, stacked, expected):
  # Item 14: "'bool' object has no attribute 'astype'" for any leaf in no
  # block (kernel_blocks' biases, no_blocks).
  curvature = curvature_tree()
  params = jax.tree.map(jnp.ones_like, curvature)
  stacked_fn = cbp.blocks.stacked_predicate([('stack',)]) if stacked else None
  out = diagnostics.top_eigenvalue(
      diagonal_loss(curvature), params, jax.random.key(0), num_iters=40,
      per_block=True, block_fn=block_fn, stacked=stacked_fn)
  assert out.names == tuple(expected)
  np.testing.assert_allclose(out.eigenvalue, list(expected.values()),
                             rtol=1e-4)
  # Each block's vector lies in its block: zero on every other leaf.
  layout = cbp.blocks.block_layout(params, block_fn=block_fn,
                                   stacked=stacked_fn)
  leaves = jax.tree.leaves(out.vector)
  for block, (group, stack) in enumerate(zip(layout.groups,
                                             layout.group_stacks)):
    if stack is not None:
      continue
    for i, leaf in enumerate(leaves):
      if i not in group:
        assert not np.any(leaf[block]), (out.names[block], i)


@pytest.mark.parametrize('name, value', [
    ('num_samples', 10**12), ('num_samples', 2**31), ('batch_size', 10**12),
    ('num_iters', 10**12)])
def test_diagnostics_counts_beyond_int32_are_refused(name, value):
  # Item 14: "OverflowError ... argument path is y" from inside JAX.
  curvature = curvature_tree()
  params = jax.tree.map(jnp.ones_like, curvature)
  loss = diagonal_loss(curvature)
  call = (diagnostics.top_eigenvalue if name == 'num_iters'
          else diagnostics.hessian_trace)
  kwargs = {name: value} if name != 'batch_size' else {
      'num_samples': 2, 'batch_size': value}
  with pytest.raises(ValueError, match=(
      rf'{name} must be an integer in \[[01], 2147483647\], got {value}')):
    call(loss, params, jax.random.key(0), **kwargs)


@pytest.mark.parametrize('key', [0, np.zeros(3, np.uint32),
                                 jax.random.split(jax.random.key(0), 2)])
def test_diagnostics_refuse_what_is_not_one_prng_key(key):
  curvature = curvature_tree()
  params = jax.tree.map(jnp.ones_like, curvature)
  for call in (diagnostics.hessian_trace, diagnostics.top_eigenvalue):
    with pytest.raises(TypeError, match='key must be one PRNG key'):
      call(diagonal_loss(curvature), params, key)


def test_diagnostics_accept_a_raw_key():
  # Traced keys are covered by the jit tests above.
  curvature = curvature_tree()
  params = jax.tree.map(jnp.ones_like, curvature)
  out = diagnostics.hessian_trace(diagonal_loss(curvature), params,
                                  jax.random.PRNGKey(0), num_samples=2)
  total = sum(float(jnp.sum(h)) for h in jax.tree.leaves(curvature))
  assert float(out.estimate) == total


@pytest.mark.parametrize('shape', [(0, 3), (2, 0, 3), (3, 0)])
def test_mean_alignment_without_samples_or_features_is_refused(shape):
  # (0, 3) gave NaN for every statistic, (3, 0) "integer modulo by zero".
  with pytest.raises(ValueError, match='one sample and one feature, got '
                     f'shape {re.escape(str(shape))}'):
    diagnostics.mean_alignment(jnp.ones(shape))


# --- issue 24, item 7: totals cover parameters outside blocks -----------------


def diagonal_quadratic():
  curvature = {'l': {'bias': jnp.array([4.0, 6.0]),
                     'kernel': jnp.array([1.0, 2.0, 3.0, 4.0, 5.0])}}

  def loss(params):
    return 0.5 * sum(jnp.sum(h * p**2) for h, p in zip(
        jax.tree.leaves(curvature), jax.tree.leaves(params)))

  return loss, jax.tree.map(jnp.ones_like, curvature)


@pytest.mark.parametrize('block_fn, blocks, outside', [
    (None, [25.0], 0.0),
    (cbp.no_blocks, [], 25.0),
    (cbp.kernel_blocks, [15.0], 10.0),
])
def test_diagnostics_totals_cover_parameters_outside_blocks(
    block_fn, blocks, outside):
  # Item 7: with a true trace of 25, no_blocks gave 0.0 and kernel_blocks
  # 15.0; parameter_movement(..., no_blocks).total was 0.0.
  loss, params = diagonal_quadratic()
  out = diagnostics.hessian_trace(loss, params, jax.random.key(0),
                                      num_samples=2, block_fn=block_fn)
  assert float(out.estimate) == 25.0
  np.testing.assert_array_equal(out.block_estimates, blocks)
  assert float(out.outside_estimate) == outside
  init = jax.tree.map(lambda x: 2.0 * x, params)
  movement = diagnostics.parameter_movement(params, init,
                                                block_fn=block_fn)
  assert float(movement.total) == pytest.approx(0.5)
  assert float(movement.outside_distance) == pytest.approx(
      {0.0: 0.0, 25.0: math.sqrt(7.0), 10.0: math.sqrt(2.0)}[outside])


def test_parameter_movement_of_nan_parameters_is_nan():
  params = {'a': {'w': jnp.array([1.0, jnp.nan])}}
  init = {'a': {'w': jnp.array([jnp.nan, 1.0])}}
  movement = diagnostics.parameter_movement(params, init)
  assert np.isnan(movement.relative).all() and np.isnan(movement.total)


@pytest.mark.parametrize('name, value, error', [
    ('num_samples', 2.0, TypeError), ('num_samples', '4', TypeError),
    ('num_samples', 0, ValueError), ('num_samples', True, TypeError),
    ('batch_size', 0, ValueError), ('batch_size', 1.5, TypeError),
])
def test_hessian_trace_refuses_bad_counts(name, value, error):
  loss, params = diagonal_quadratic()
  kwargs = {'num_samples': 2, name: value}
  with pytest.raises(error, match=f'{name} must be an integer'):
    diagnostics.hessian_trace(loss, params, jax.random.key(0), **kwargs)


@pytest.mark.parametrize('value, error', [
    (2.5, TypeError), (-1, ValueError), ('3', TypeError)])
def test_top_eigenvalue_refuses_bad_iteration_counts(value, error):
  loss, params = diagonal_quadratic()
  with pytest.raises(error, match='num_iters must be an integer'):
    diagnostics.top_eigenvalue(loss, params, jax.random.key(0),
                                   num_iters=value)


# --- issue 24, audit: arguments are refused naming them -------------------------


def test_top_eigenvalue_refuses_a_per_block_that_is_not_a_bool():
  params = {'a': {'w': jnp.ones((4, 2))}}
  loss = lambda p: jnp.sum(p['a']['w'] ** 2)
  with pytest.raises(TypeError,
                     match="per_block must be True or False, got 'yes'"):
    diagnostics.top_eigenvalue(loss, params, jax.random.key(0),
                               per_block='yes')


def test_mean_alignment_of_half_precision_is_computed_in_float32():
  # float16 second moments overflow (65504) and eigh has no half precision:
  # "NotImplementedError: Unsupported dtype float16".
  a = jnp.array([[300.0, 1.0], [1.0, 400.0]], jnp.float16)
  out = diagnostics.mean_alignment(a)
  assert out.eigenvalues.dtype == jnp.float32
  chex.assert_trees_all_close(
      out, diagnostics.mean_alignment(a.astype(jnp.float32)))
