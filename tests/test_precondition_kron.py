"""precondition_kron (M3 in a Kronecker-factored eigenbasis, §8.2) against a
dense float64 NumPy implementation, its reduction to precondition(), and the
positive-definiteness that Proposition 1 needs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cbp_optax as cbp


def _basis(factor):
  """Eigenvectors, ties broken by the documented graded ridge."""
  size = factor.shape[0]
  ridge = cbp._precondition_kron.TIE_BREAK * (
      np.trace(factor) / size + np.finfo(np.float64).tiny) * np.diag(
          np.linspace(1.0, 2.0, size))
  return np.linalg.eigh(factor + ridge)[1]


class KronReference:
  """The transform written densely in float64 NumPy, from its definition:
  per matrix leaf, rotate the bias-corrected momentum into the eigenbases of
  the factors' EMAs, apply M3's lagged damped rule (P_1 = I), rotate back;
  update v with the rotated gradient, then the factors, then (every k steps)
  the bases. Vectors: diagonal M3."""

  def __init__(self, shapes, b1, b2, damping, factor_decay, every):
    self.b1, self.b2, self.damping = b1, b2, damping
    self.beta_f, self.every, self.t = factor_decay, every, 0
    self.m = {k: np.zeros(s) for k, s in shapes.items()}
    self.v = {k: np.zeros(s) for k, s in shapes.items()}
    self.left = {k: np.zeros((s[0], s[0])) for k, s in shapes.items()
                 if len(s) == 2}
    self.right = {k: np.zeros((s[1], s[1])) for k, s in shapes.items()
                  if len(s) == 2}
    self.ql = {k: np.eye(s[0]) for k, s in shapes.items() if len(s) == 2}
    self.qr = {k: np.eye(s[1]) for k, s in shapes.items() if len(s) == 2}

  def step(self, grads):
    self.t += 1
    t, out = self.t, {}
    for k, g in grads.items():
      self.m[k] = self.b1 * self.m[k] + (1 - self.b1) * g
      m_hat = self.m[k] / (1 - self.b1 ** t)
      matrix = k in self.ql
      if matrix:
        m_hat = self.ql[k].T @ m_hat @ self.qr[k]
        g_rot = self.ql[k].T @ g @ self.qr[k]
      else:
        g_rot = g
      if t == 1:
        d = m_hat                                        # P_1 = I
      else:
        v_hat = self.v[k] / (1 - self.b2 ** (t - 1))     # lagged
        d = m_hat / (np.sqrt(v_hat) + self.damping)
      self.v[k] = self.b2 * self.v[k] + (1 - self.b2) * g_rot ** 2
      if matrix:
        d = self.ql[k] @ d @ self.qr[k].T
        self.left[k] = (self.beta_f * self.left[k]
                        + (1 - self.beta_f) * g @ g.T)
        self.right[k] = (self.beta_f * self.right[k]
                         + (1 - self.beta_f) * g.T @ g)
        if t % self.every == 0:
          ql, qr = _basis(self.left[k]), _basis(self.right[k])
          # v into the new basis: the diagonal of the rotated operator,
          # entry by entry.
          rotation = np.kron(ql.T @ self.ql[k], qr.T @ self.qr[k])
          carried = rotation @ np.diag(self.v[k].ravel()) @ rotation.T
          self.v[k] = np.diag(carried).reshape(self.v[k].shape)
          self.ql[k], self.qr[k] = ql, qr
      out[k] = d
    return out


SHAPES = {'w': (5, 3), 'u': (3, 4), 'b': (3,)}


def _grads(rng, steps):
  return [{k: rng.normal(size=s) * (1.0 + np.arange(s[-1]))
           for k, s in SHAPES.items()} for _ in range(steps)]


# Refreshes from step 2 on: the factors then have full rank, so their
# eigenvectors are unique up to sign (which cancels); a rank-deficient
# factor's null space has no canonical basis to compare.
@pytest.mark.parametrize('every', [2, 3])
def test_matches_the_dense_float64_reference(every):
  rng = np.random.default_rng(0)
  kwargs = dict(b1=0.9, b2=0.99, damping=1e-3, factor_decay=0.95,
                every=every)
  reference = KronReference(SHAPES, **kwargs)
  with jax.enable_x64(True):
    tx = cbp.precondition_kron(**kwargs)
    params = {k: jnp.zeros(s, jnp.float64) for k, s in SHAPES.items()}
    state = tx.init(params)
    update = jax.jit(tx.update)
    for grads in _grads(rng, 12):
      got, state = update({k: jnp.asarray(g) for k, g in grads.items()},
                          state)
      want = reference.step(grads)
      for k in SHAPES:
        np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=1e-9,
                                   atol=1e-12, err_msg=k)
    assert int(state.count) == 12


def test_before_the_first_refresh_it_is_precondition():
  rng = np.random.default_rng(1)
  with jax.enable_x64(True):
    kron = cbp.precondition_kron(b1=0.9, b2=0.999, damping=1e-3, every=100)
    plain = cbp.precondition(b1=0.9, b2=0.999, damping=1e-3)
    params = {k: jnp.zeros(s, jnp.float64) for k, s in SHAPES.items()}
    sk, sp = kron.init(params), plain.init(params)
    for grads in _grads(rng, 6):
      grads = {k: jnp.asarray(g) for k, g in grads.items()}
      uk, sk = kron.update(grads, sk)
      up, sp = plain.update(grads, sp)
      for k in SHAPES:
        np.testing.assert_allclose(uk[k], up[k], rtol=1e-13, atol=1e-15)


def test_the_operator_is_positive_definite_with_m3_s_bounds():
  # After a refresh, the map from momentum to update is Q diag(P) Q^T:
  # symmetric, with eigenvalues in [1/(sqrt(v_max) + damping), 1/damping].
  rng = np.random.default_rng(2)
  damping = 1e-2
  with jax.enable_x64(True):
    tx = cbp.precondition_kron(b1=0.0, b2=0.9, damping=damping, every=1)
    params = {'w': jnp.zeros((4, 3), jnp.float64)}
    state = tx.init(params)
    for _ in range(3):
      _, state = tx.update({'w': jnp.asarray(rng.normal(size=(4, 3)))},
                           state)
    # With b1 = 0 the update is linear in the gradient: probe it.
    basis = np.eye(12).reshape(12, 4, 3)
    columns = []
    for e in basis:
      u, _ = tx.update({'w': jnp.asarray(e)}, state)
      columns.append(np.asarray(u['w']).ravel())
    operator = np.stack(columns, axis=1)
    np.testing.assert_allclose(operator, operator.T, atol=1e-10)
    eig = np.linalg.eigvalsh(operator)
    v_max = float(jnp.max(state.nu['w'])) / (1 - 0.9 ** 3)
    assert eig.min() >= 1 / (np.sqrt(v_max) + damping) - 1e-9
    assert eig.max() <= 1 / damping + 1e-9


def test_default_views_dimension_numbers_and_max_dim():
  params = {'dense': jnp.zeros((4, 3)), 'conv': jnp.zeros((3, 3, 2, 5)),
            'bias': jnp.zeros(3), 'scalar': jnp.zeros(())}
  state = cbp.precondition_kron().init(params)
  assert state.factors['dense'].left.shape == (1, 4, 4)
  assert state.factors['conv'].left.shape == (1, 18, 18)   # 3 x 3 x 2 in
  assert state.factors['conv'].right.shape == (1, 5, 5)
  assert set(state.factors) == {'dense', 'conv'}
  # A stack of 2 layers: the leading axis is a batch axis.
  numbers = {'stack': optax.contrib.MuonDimensionNumbers(1, 2)}
  state = cbp.precondition_kron(dimension_numbers=numbers).init(
      {'stack': jnp.zeros((2, 4, 3))})
  assert state.factors['stack'].left.shape == (2, 4, 4)
  # Longer than max_dim: the diagonal M3.
  state = cbp.precondition_kron(max_dim=3).init(params)
  # (No matrix left: factors is one empty array.)
  assert state.factors.shape == (0,)
  state = cbp.precondition_kron(max_dim=4).init(params)
  assert set(state.factors) == {'dense'}


def test_stacked_layers_are_preconditioned_one_by_one():
  rng = np.random.default_rng(3)
  numbers = {'stack': optax.contrib.MuonDimensionNumbers(1, 2)}
  with jax.enable_x64(True):
    stacked = cbp.precondition_kron(every=1, dimension_numbers=numbers)
    single = cbp.precondition_kron(every=1)
    s = stacked.init({'stack': jnp.zeros((2, 4, 3), jnp.float64)})
    singles = [single.init({'w': jnp.zeros((4, 3), jnp.float64)})
               for _ in range(2)]
    for _ in range(4):
      g = jnp.asarray(rng.normal(size=(2, 4, 3)))
      u, s = stacked.update({'stack': g}, s)
      for i in range(2):
        ui, singles[i] = single.update({'w': g[i]}, singles[i])
        np.testing.assert_allclose(u['stack'][i], ui['w'], rtol=1e-10,
                                   atol=1e-13)


@pytest.mark.parametrize('kwargs, error', [
    (dict(every=0), ValueError), (dict(every=2.5), TypeError),
    (dict(max_dim=True), TypeError), (dict(factor_decay=1.0), ValueError),
    (dict(damping=0.0), ValueError), (dict(zero_moment='x'), ValueError)])
def test_bad_arguments_are_refused_at_construction(kwargs, error):
  with pytest.raises(error):
    cbp.precondition_kron(**kwargs)


def test_dimension_numbers_must_cover_every_leaf():
  tx = cbp.precondition_kron(dimension_numbers={'a': None})
  with pytest.raises(ValueError, match='one MuonDimensionNumbers or None'):
    tx.init({'a': jnp.zeros((2, 2)), 'b': jnp.zeros(2)})


def test_matrices_whose_joined_paths_collide_are_refused():
  # 'a/b' and ['a']['b'] join to one key of the factors: both matrices would
  # silently share (and overwrite) one pair of Kronecker factors.
  tx = cbp.precondition_kron()
  with pytest.raises(ValueError, match='same path once joined'):
    tx.init({'a/b': jnp.zeros((3, 2)), 'a': {'b': jnp.zeros((3, 2))}})


def test_vmapped_over_seeds_equals_one_run_per_seed():
  # The suite trains seeds as one vmapped program: each seed's update is
  # the one it gets alone (bases included, the refresh under vmap).
  tx = cbp.precondition_kron(every=2)
  params = {'w': jnp.zeros((4, 3)), 'b': jnp.zeros(3)}
  grads = jax.random.normal(jax.random.key(0), (3, 5, 4, 3))

  def run(g_seq):
    state = tx.init(params)
    out = []
    for g in g_seq:
      u, state = tx.update({'w': g, 'b': g[0]}, state)
      out.append(u['w'])
    return jnp.stack(out)

  batched = jax.jit(jax.vmap(run))(grads)
  for seed in range(3):
    np.testing.assert_allclose(batched[seed], jax.jit(run)(grads[seed]),
                               rtol=2e-5, atol=2e-6)
