r"""M3 in a Kronecker-factored eigenbasis (§8.2).

For every matrix-shaped leaf ``G`` (a batch of ``m x n`` matrices):

    L_t = beta_f L_{t-1} + (1 - beta_f) G G^T,   R_t likewise with G^T G
    Q_L, Q_R = eigenvectors of L, R, refreshed every ``every`` steps
    rot(X) = Q_L^T X Q_R,   unrot(Y) = Q_L Y Q_R^T
    update = unrot(P_t * rot(m_hat)),   v_t = b2 v_{t-1} + (1 - b2) rot(G)^2

with M3's ``m_hat`` (eq. 12) and lagged, damped ``P_t`` (eq. 11). The
operator is an orthogonal change of basis around M3's diagonal, so its
eigenvalues are M3's (Lemma 1) and Proposition 1 holds unchanged; with
identity bases (the first ``every`` steps) it is M3. As in SOAP (Vyas et
al., 2025), only the factors' eigenvectors are used; unlike SOAP, ``v`` is
carried into a new basis (:func:`_carry`), and the factors and bases are
updated after the direction, so the basis of step ``t`` sees gradients up
to ``t - 1`` only (Theorem 3). Every other leaf keeps the diagonal M3.

References:
  Vyas et al., SOAP: Improving and Stabilizing Shampoo using Adam, ICLR 2025.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional, Union

import chex
import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers

from cbp_optax import _checks
from cbp_optax import _precondition as diag
from cbp_optax._paths import path_names


class KronFactors(NamedTuple):
  """``L`` (EMA of ``G G^T``, ``(batch, m, m)``), ``R`` (of ``G^T G``,
  ``(batch, n, n)``) and their eigenvectors at the last refresh."""
  left: chex.Array
  right: chex.Array
  left_basis: chex.Array
  right_basis: chex.Array


class KronPreconditionState(NamedTuple):
  """State of :func:`precondition_kron`.

  Attributes:
    count: the number of updates taken, an int32 scalar.
    mu: the first moment :math:`m` of eq. (12), like the parameters.
    nu: the second moment :math:`v` of eq. (11), like the parameters; for a
      matrix leaf, in the coordinates of its eigenbasis.
    factors: a dict from each matrix leaf's path (keys joined by ``/``) to
      its ``KronFactors(left, right, left_basis, right_basis)``; without any
      matrix, one empty array.
  """
  count: chex.Array
  mu: optax.Updates
  nu: optax.Updates
  factors: Any


# A tree of MuonDimensionNumbers / None, or a function returning one.
DimensionNumbers = Union[Any, Callable[[Any], Any]]


def default_dimension_numbers(params: Any) -> Any:
  """Leaves of rank >= 2 as ``(all but the last axis, last axis)`` matrices
  (dense and Flax convolution kernels); every other leaf None."""
  return jax.tree.map(lambda leaf: None if (n := jnp.ndim(leaf)) < 2 else
                      MuonDimensionNumbers(tuple(range(n - 1)), (n - 1,)),
                      params)


def _axes(spec: MuonDimensionNumbers, ndim: int) -> tuple[tuple[int, ...], ...]:
  """``(batch, reduction, output)`` axes of a leaf, normalized."""
  as_tuple = lambda a: (a,) if isinstance(a, int) else tuple(a)
  reduction = tuple(a % ndim for a in as_tuple(spec.reduction_axis))
  output = tuple(a % ndim for a in as_tuple(spec.output_axis))
  batch = tuple(a for a in range(ndim) if a not in reduction + output)
  return batch, reduction, output


def _explicit_spec(x) -> Optional[Any]:
  """The partition spec of ``x`` on an explicit mesh axis, else None."""
  spec = getattr(jax.typeof(x).sharding, 'spec', None)
  return spec if spec is not None and any(a is not None for a in spec) else None


class _Matrix(NamedTuple):
  """How one leaf is viewed as ``(batch, m, n)`` and back (replicated for
  the view where it is sharded along explicit mesh axes)."""
  perm: tuple[int, ...]
  shape: tuple[int, int, int]
  permuted_shape: tuple[int, ...]

  def to(self, x):
    if _explicit_spec(x) is not None:
      x = jax.sharding.reshard(x, jax.sharding.PartitionSpec())
    return jnp.transpose(x, self.perm).reshape(self.shape)

  def back(self, x, like=None):
    inverse = tuple(sorted(range(len(self.perm)), key=self.perm.__getitem__))
    out = jnp.transpose(x.reshape(self.permuted_shape), inverse)
    spec = None if like is None else _explicit_spec(like)
    return out if spec is None else jax.sharding.reshard(out, spec)


def _matrix(shape: tuple[int, ...], spec: Optional[MuonDimensionNumbers],
            max_dim: int) -> Optional[_Matrix]:
  """The leaf's matrix view, or None for a leaf that keeps the diagonal M3
  (no spec, or a side longer than ``max_dim``)."""
  if spec is None:
    return None
  batch, reduction, output = _axes(spec, len(shape))
  size = lambda axes: math.prod(shape[a] for a in axes)
  m, n = size(reduction), size(output)
  if m > max_dim or n > max_dim or m * n == 0:
    return None
  perm = batch + reduction + output
  return _Matrix(perm, (size(batch), m, n), tuple(shape[a] for a in perm))


def _rotate(q_left, x, q_right):
  return jnp.einsum('bim,bin,bnk->bmk', q_left, x, q_right)


def _unrotate(q_left, y, q_right):
  return jnp.einsum('bim,bmk,bnk->bin', q_left, y, q_right)


# A rank-deficient factor's degenerate eigenspace has no canonical basis, and
# eigh would pick one from float rounding. A ridge of TIE_BREAK times the mean
# eigenvalue, graded along the diagonal, picks the coordinate axes there and
# moves a basis with larger eigenvalue gaps by O(TIE_BREAK).
TIE_BREAK = 1e-5


def _eigenbasis(factor: chex.Array) -> chex.Array:
  """Orthonormal eigenvectors of a batch of symmetric PSD matrices."""
  size = factor.shape[-1]
  mean = jnp.trace(factor, axis1=-2, axis2=-1)[..., None, None] / size
  grade = jnp.diag(jnp.linspace(1.0, 2.0, size, dtype=factor.dtype))
  tiny = jnp.finfo(factor.dtype).tiny
  ridge = TIE_BREAK * (mean + tiny) * grade
  return jnp.linalg.eigh(factor + ridge)[1].astype(factor.dtype)


def _matrix_update(rules, beta_f, terms, refresh, g, m, v, p, f: KronFactors,
                   view: _Matrix):
  """One matrix leaf: the direction, the new moments and the new factors."""
  g_stats = jnp.asarray(g).astype(m.dtype)
  matrix = view.to(g_stats)
  q_left, q_right = f.left_basis, f.right_basis
  # M3's rule in the rotated coordinates.
  step_r, _, v_new = diag.leaf_update(
      rules, terms, _rotate(q_left, matrix, q_right),
      _rotate(q_left, view.to(m), q_right), view.to(v), None)
  step = diag.saturating_cast(view.back(_unrotate(q_left, step_r, q_right),
                                        like=g), _checks.output_dtype(g, p))
  m_new = (rules.b1 * m + (1.0 - rules.b1) * g_stats).astype(m.dtype)
  # After the direction: the factors and bases of step t + 1.
  left = beta_f * f.left + (1.0 - beta_f) * jnp.einsum(
      'bik,bjk->bij', matrix, matrix)
  right = beta_f * f.right + (1.0 - beta_f) * jnp.einsum(
      'bki,bkj->bij', matrix, matrix)
  left, right = left.astype(f.left.dtype), right.astype(f.right.dtype)

  def refreshed(l, r, v_r, old_left=q_left, old_right=q_right):
    new_left, new_right = _eigenbasis(l), _eigenbasis(r)
    return new_left, new_right, _carry(v_r, old_left, old_right,
                                       new_left, new_right)

  q_left, q_right, v_new = jax.lax.cond(
      refresh, refreshed, lambda l, r, v_r: (q_left, q_right, v_r),
      left, right, v_new.astype(v.dtype))
  return (step, m_new, view.back(v_new, like=v),
          KronFactors(left, right, q_left, q_right))


def _carry(v, old_left, old_right, new_left, new_right):
  """``v`` carried into the new basis: the diagonal of the rotated operator,
  ``(O_L o O_L) v (O_R o O_R)^T`` with ``O = Q_new^T Q_old`` (``o``:
  elementwise). It keeps ``v``'s total and positivity, so a refresh sends
  no coordinate to ``P = 1/damping``."""
  o_left = jnp.square(jnp.einsum('bim,bin->bmn', new_left, old_left))
  o_right = jnp.square(jnp.einsum('bim,bin->bmn', new_right, old_right))
  return jnp.einsum('bmi,bij,bnj->bmn', o_left, v, o_right).astype(v.dtype)


KRON_ARGUMENTS = dict(factor_decay=_checks.decay(optional=True),
                      every=_checks.Count(1, traced=True),
                      max_dim=_checks.Count(1))
_SPEC = _checks.Spec('cbp.precondition_kron',
                     dict(diag.ARGUMENTS, **KRON_ARGUMENTS))


def precondition_kron(
    b1: float = 0.9, b2: float = 0.999, damping: float = 1e-3, *,
    factor_decay: Optional[float] = None, every: int = 10, max_dim: int = 4096,
    dimension_numbers: Optional[DimensionNumbers] = None,
    stats_dtype: Optional[Any] = None, zero_moment: str = 'damped',
) -> optax.GradientTransformation:
  r"""M3 run in the eigenbasis of each matrix's Kronecker factors (§8.2).

  A matrix leaf's direction is :math:`Q_L (P_t \odot Q_L^T \hat m_t Q_R)
  Q_R^T` (eqs. 11-12 in the rotated coordinates; :math:`Q_L, Q_R` the
  eigenvectors of the EMAs of :math:`G G^T` and :math:`G^T G`), with M3's
  bounds (Lemma 1); every other leaf's is :func:`cbp_optax.precondition`'s.

  Args:
    b1: momentum decay :math:`\beta_1` in [0, 1).
    b2: second-moment decay :math:`\beta_2` in [0, 1).
    damping: :math:`\zeta > 0`.
    factor_decay: the decay of the factors' EMAs in [0, 1); None: ``b2``.
    every: refresh the bases every ``every`` steps (an int >= 1); until the
      first refresh they are the identity.
    max_dim: a matrix with a longer side keeps the diagonal M3 (name it in
      ``static_args`` under ``optax.inject_hyperparams``).
    dimension_numbers: a tree like the parameters of
      ``optax.contrib.MuonDimensionNumbers`` (a leaf's reduction and output
      axes) or None (diagonal), or a function of the parameters returning
      one (``cbp_optax.nnx.muon_dimension_numbers(model)``). None:
      :func:`default_dimension_numbers`.
    stats_dtype: a real floating dtype for the moments and factors.
    zero_moment: as in :func:`cbp_optax.precondition`.

  Returns:
    An ``optax.GradientTransformation`` whose state is
    :class:`KronPreconditionState`.

  Raises:
    TypeError, ValueError: as :func:`cbp_optax.precondition`, and for an
      ``every`` or ``max_dim`` that is not a positive int, a ``factor_decay``
      outside [0, 1), or ``dimension_numbers`` not covering the leaves.

  Examples:
    >>> import jax.numpy as jnp
    >>> import cbp_optax as cbp
    >>> tx = cbp.precondition_kron(b1=0.0, every=1)
    >>> params = {'w': jnp.zeros((3, 2)), 'b': jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> state.factors['w'].left.shape, list(state.factors)
    ((1, 3, 3), ['w'])
    >>> grads = {'w': jnp.ones((3, 2)), 'b': jnp.ones(2)}
    >>> updates, state = tx.update(grads, state)   # P_1 = I
    >>> print(updates['w'][0])
    [1. 1.]

  References:
    Layerwise Conditioned Backpropagation,
    §4.3-4.4 (eqs. 11-12), Lemma 1, Proposition 1 and §8.2.
  """
  _checks.check(_SPEC, b1=b1, b2=b2, damping=damping, factor_decay=factor_decay,
      every=every, max_dim=max_dim, dimension_numbers=dimension_numbers,
      stats_dtype=stats_dtype, zero_moment=zero_moment)
  rules = diag.Rules(b1, b2, damping, zero_moment)
  beta_f = b2 if factor_decay is None else factor_decay
  numbers = (default_dimension_numbers if dimension_numbers is None
             else dimension_numbers)

  def views(params):
    """Per leaf, its key in ``factors`` and its matrix view (or None)."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    specs = jax.tree.leaves(
        numbers(params) if callable(numbers) else numbers,
        is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers))
    # test_dimension_numbers_must_cover_every_leaf: else leaves go diagonal.
    if len(specs) != len(leaves):
      raise ValueError(
          'precondition_kron: dimension_numbers must give one '
          f'MuonDimensionNumbers or None per leaf; got {len(specs)} for '
          f'{len(leaves)} leaves.')
    # Keys: joined paths without NNX's ``value`` (the same at init and update).
    found = [('/'.join(n for n in path_names(path) if n != 'value'),
              _matrix(jnp.shape(leaf), s, max_dim))
             for (path, leaf), s in zip(leaves, specs)]
    keys = [k for k, view in found if view is not None]
    # test_matrices_whose_joined_paths_collide_are_refused: one factor.
    if len(set(keys)) != len(keys):
      raise ValueError('precondition_kron: two matrix leaves have the same '
                       f'path once joined ({sorted(keys)}); rename one.')
    return found

  def init_fn(params):
    _checks.check_float_leaves('precondition_kron', params)
    factors = {}
    for leaf, (key, view) in zip(jax.tree.leaves(params), views(params)):
      if view is not None:
        dtype = diag.moment_dtype(leaf, stats_dtype)
        batch, m, n = view.shape
        zeros, eye = (jnp.zeros((batch, k, k), dtype) for k in (m, n)), (
            jnp.broadcast_to(jnp.eye(k, dtype=dtype), (batch, k, k))
            for k in (m, n))
        factors[key] = KronFactors(*zeros, *eye)
    return KronPreconditionState(
        count=jnp.zeros([], jnp.int32),
        mu=diag.zeros_like_tree(params, stats_dtype),
        nu=diag.zeros_like_tree(params, stats_dtype),
        # Without a matrix, a leaf: a prefix of any structure (for
        # optax.tree_map_params, which initializes on a leafless placeholder).
        factors=factors or jnp.zeros((0,), jnp.float32))

  def update_fn(updates, state, params=None):
    count_inc, terms, p_leaves = diag.begin_update(
        'precondition_kron', rules, updates, state, params)
    refresh = jnp.remainder(count_inc, every) == 0
    g_leaves, treedef = jax.tree.flatten(updates)
    steps, mus, nus, factors = [], [], [], {}
    for g, m, v, p, (key, view) in zip(
        g_leaves, jax.tree.leaves(state.mu), jax.tree.leaves(state.nu),
        p_leaves, views(updates)):
      if view is None:
        step, m_new, v_new = diag.leaf_update(rules, terms, g, m, v, p)
      else:
        step, m_new, v_new, factors[key] = _matrix_update(
            rules, beta_f, terms, refresh, g, m, v, p, state.factors[key], view)
      steps.append(step), mus.append(m_new), nus.append(v_new)
    return treedef.unflatten(steps), KronPreconditionState(
        count=count_inc, mu=treedef.unflatten(mus),
        nu=treedef.unflatten(nus), factors=factors or state.factors)

  return optax.GradientTransformation(init_fn, update_fn)
