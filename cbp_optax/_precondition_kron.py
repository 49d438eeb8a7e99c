r"""M3 in a Kronecker-factored eigenbasis: the gradient-assembly step of §8.2.

§8.2 proposes replacing M3's diagonal second moment with a correction that
interpolates between CBP and Kronecker-factored curvature methods, keeping
the preconditioner positive definite so that Proposition 1 holds unchanged.
:func:`precondition_kron` does this for every matrix-shaped leaf ``G``
(viewed as a batch of ``m x n`` matrices, reduction axes by output axes):

    L_t = beta_f L_{t-1} + (1 - beta_f) G G^T        (input side, m x m)
    R_t = beta_f R_{t-1} + (1 - beta_f) G^T G        (output side, n x n)
    Q_L, Q_R = eigenvectors of L, R, refreshed every ``every`` steps
    rot(X) = Q_L^T X Q_R,   unrot(Y) = Q_L Y Q_R^T

and applies M3's own rules (eqs. 11-12) in that basis:

    m_t = b1 m_{t-1} + (1 - b1) G,       m_hat = m_t / (1 - b1^t)          (12)
    P_t = 1 / (sqrt(v_{t-1} / (1 - b2^(t-1))) + damping),  P_1 = I          (11)
    update = unrot(P_t * rot(m_hat))
    v_t = b2 v_{t-1} + (1 - b2) rot(G)^2

The operator ``X -> unrot(P_t * rot(X))`` is ``(Q_R kron Q_L) diag(P_t)
(Q_R kron Q_L)^T``: an orthogonal change of basis around M3's diagonal, so
its eigenvalues are M3's, in ``[1/(G_max + damping), 1/damping]`` (Lemma 1),
and it is positive definite whatever the bases: Proposition 1's descent
condition and the convergence theory carry over unchanged. With identity
bases it *is* :func:`cbp_optax.precondition` (up to rounding), which is what
the first ``every`` steps run, while the factors accumulate.

The choices, and why:

* **Eigenbases, no exponent.** Shampoo preconditions with ``L^{-1/4} G
  R^{-1/4}``; the exponent sets the scale, and a wrong one (or a singular
  factor) has no bound like Lemma 1's. SOAP (Vyas et al., 2025) keeps only
  the factors' eigenvectors and runs Adam's elementwise second moment in that
  basis. This transform does the same with M3's second moment instead of
  Adam's: the lag, ``P_1 = I``, the bias corrections and the damping outside
  the square root are eq. (11)'s, so the scale is M3's and so is its bound.
* **What is lagged.** As in M3, ``P_t`` is formed from the stored
  ``v_{t-1}`` before it is refreshed with the current gradient, and the
  factors ``L``, ``R`` and the bases are updated after the direction is
  formed: the basis of step ``t`` depends on gradients up to step ``t - 1``
  only, so ``P_t`` stays independent of the current minibatch (Theorem 3).
* **The momentum in the original coordinates.** ``m`` is kept like the
  parameters and rotated each step, so a change of basis never mixes old and
  new coordinates in it. ``v``, a diagonal, is kept in the basis'
  coordinates; at a refresh it is carried into the new basis as the
  diagonal of the rotated second moment, ``(O_L o O_L) v (O_R o O_R)^T``
  with ``O = Q_new^T Q_old``. SOAP keeps ``v`` as it is, which hands a new
  coordinate the moment of whatever old coordinate had its index: one that
  was zero there gets ``P = 1/damping`` (M3's lag makes that a real jump),
  and inside a degenerate eigenspace the basis, and so the update, would
  follow float rounding.
* **Refresh interval.** An eigendecomposition costs ``O(m^3 + n^3)`` against
  the step's ``O(mn(m + n))`` rotations; refreshing every ``every = 10``
  steps (SOAP's default) amortizes it. A side longer than ``max_dim`` would
  need a factor of ``max_dim^2`` entries or more: such a leaf keeps the
  diagonal M3.
* **On the centered model.** The input factor of a dense layer is ``L ~
  E[a a^T]`` up to the output errors; on a ReLU network its top eigenvector
  is almost the mean activation, which M2 removes exactly (§4.2, Proposition
  3), so the basis spends itself on the covariance rather than on one
  rank-one direction.

Every leaf that is not a matrix (biases, norm scales, scalars, and any leaf
``dimension_numbers`` marks None) keeps the diagonal M3.

References:
  Layerwise Conditioned Backpropagation: A Curvature-Aware
  Reparameterization of the Backward Pass with Convergence Guarantees,
  §4.3-4.4 (eqs. 11-12), Lemma 1, Proposition 1, §8.2.
  Vyas et al., SOAP: Improving and Stabilizing Shampoo using Adam, ICLR 2025.
  Gupta, Koren and Singer, Shampoo: Preconditioned Stochastic Tensor
  Optimization, ICML 2018.
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
  """The two one-sided second moments of one matrix leaf and their bases.

  Attributes:
    left: ``L``, the EMA of ``G G^T``, shape ``(batch, m, m)``.
    right: ``R``, the EMA of ``G^T G``, shape ``(batch, n, n)``.
    left_basis: ``Q_L``, eigenvectors of ``L`` at the last refresh.
    right_basis: ``Q_R``, eigenvectors of ``R`` at the last refresh.
  """
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
    factors: a dict from each matrix leaf's path (its keys joined by
      ``/``, an NNX ``value`` attribute left out) to its
      ``KronFactors(left, right, left_basis, right_basis)``: ``L``, ``R``
      and their eigenvectors, each of shape ``(batch, side, side)``; the
      leaves that keep the diagonal M3 have none.
      Without any matrix, one empty array.
  """
  count: chex.Array  # shape=(), dtype=jnp.int32.
  mu: optax.Updates
  nu: optax.Updates
  factors: Any


DimensionNumbers = Union[
    Any, Callable[[Any], Any]]  # a tree of MuonDimensionNumbers / None


def default_dimension_numbers(params: Any) -> Any:
  """Rank-2 leaves as ``(in, out)`` matrices, convolution kernels (rank >= 3,
  output channels last, as Flax lays them out) as ``(window x in, out)``;
  every other leaf None (diagonal M3)."""
  def spec(leaf):
    ndim = jnp.ndim(leaf)
    if ndim < 2:
      return None
    return MuonDimensionNumbers(tuple(range(ndim - 1)), (ndim - 1,))
  return jax.tree.map(spec, params)


def _axes(spec: MuonDimensionNumbers, ndim: int) -> tuple[tuple[int, ...], ...]:
  """``(batch, reduction, output)`` axes of a leaf, normalized."""
  as_tuple = lambda a: (a,) if isinstance(a, int) else tuple(a)
  reduction = tuple(a % ndim for a in as_tuple(spec.reduction_axis))
  output = tuple(a % ndim for a in as_tuple(spec.output_axis))
  batch = tuple(a for a in range(ndim) if a not in reduction + output)
  return batch, reduction, output


def _explicit_spec(x) -> Optional[Any]:
  """The partition spec of ``x`` where its type carries one (axes of
  ``AxisType.Explicit`` meshes), else None."""
  spec = getattr(jax.typeof(x).sharding, 'spec', None)
  return spec if spec is not None and any(a is not None for a in spec) else None


class _Matrix(NamedTuple):
  """How one leaf is viewed as ``(batch, m, n)`` and back.

  A leaf sharded along explicit mesh axes is replicated for the view
  (merging a sharded axis into another is not a sharding JAX can infer)
  and given its sharding back with the result."""
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


def _specs(dimension_numbers: DimensionNumbers, params: Any) -> list:
  """One spec (or None) per leaf of ``params``."""
  found = (dimension_numbers(params) if callable(dimension_numbers)
           else dimension_numbers)
  leaves = jax.tree.leaves(params)
  specs = jax.tree.leaves(
      found, is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers))
  # test_dimension_numbers_must_cover_every_leaf: else leaves go diagonal.
  if len(specs) != len(leaves):
    raise ValueError(
        'precondition_kron: dimension_numbers must give one '
        'MuonDimensionNumbers or None per parameter leaf; got '
        f'{len(specs)} for {len(leaves)} leaves.')
  return specs


def _key(path) -> str:
  """A leaf's key in ``factors``: its path's names joined by slashes, the
  ``value`` attribute of an NNX Variable left out (``nnx.Optimizer``
  initializes on Variables and updates with arrays)."""
  return '/'.join(n for n in path_names(path) if n != 'value')


def _no_factors() -> chex.Array:
  """``factors`` where there is no matrix: one empty array, a leaf, so that
  the state's structure is a prefix of any other (``optax.tree_map_params``
  initializes on a placeholder without leaves)."""
  return jnp.zeros((0,), jnp.float32)


def _eye(batch: int, size: int, dtype) -> chex.Array:
  return jnp.broadcast_to(jnp.eye(size, dtype=dtype), (batch, size, size))


def _rotate(q_left, x, q_right):
  return jnp.einsum('bim,bin,bnk->bmk', q_left, x, q_right)


def _unrotate(q_left, y, q_right):
  return jnp.einsum('bim,bmk,bnk->bin', q_left, y, q_right)


# A factor of rank below its size (early in training, or a layer with fewer
# outputs than inputs) has a degenerate eigenspace with no canonical basis:
# eigh would pick one from float rounding, so two runs equal to rounding
# (jit and inject_hyperparams, one device and eight) would rotate into
# different bases. A ridge of TIE_BREAK times the mean eigenvalue, graded
# along the diagonal, picks the coordinate axes there and moves a basis with
# eigenvalue gaps above it by O(TIE_BREAK).
TIE_BREAK = 1e-5


def _eigenbasis(factor: chex.Array) -> chex.Array:
  """Orthonormal eigenvectors of a batch of symmetric PSD matrices."""
  size = factor.shape[-1]
  mean = jnp.trace(factor, axis1=-2, axis2=-1)[..., None, None] / size
  grade = jnp.diag(jnp.linspace(1.0, 2.0, size, dtype=factor.dtype))
  tiny = jnp.finfo(factor.dtype).tiny
  ridge = TIE_BREAK * (mean + tiny) * grade
  return jnp.linalg.eigh(factor + ridge)[1].astype(factor.dtype)


def _matrix_update(rules, beta_f, first_step, mu_correction, nu_correction,
                   refresh, g, m, v, p, f: KronFactors, view: _Matrix):
  """One matrix leaf: the direction, the new moments and the new factors
  (module docstring)."""
  g_stats = jnp.asarray(g).astype(m.dtype)
  matrix = view.to(g_stats)
  q_left, q_right = f.left_basis, f.right_basis
  # M3's rule in the rotated coordinates (rotation is linear, so the
  # rotated momentum update is the rotation of the momentum update).
  step_r, _, v_new = diag.leaf_update(
      rules, first_step, mu_correction, nu_correction,
      _rotate(q_left, matrix, q_right),
      _rotate(q_left, view.to(m), q_right), view.to(v), None)
  step = view.back(_unrotate(q_left, step_r, q_right), like=g)
  step = diag.saturating_cast(step, _checks.output_dtype(g, p))
  m_new = (rules.b1 * m + (1.0 - rules.b1) * g_stats).astype(m.dtype)
  # After the direction: the factors and bases of step t + 1, and v
  # carried into the new basis.
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
  """The second moment ``v`` (a diagonal in the old basis' coordinates) in
  the new basis: the diagonal of the rotated operator,
  ``(O_L o O_L) v (O_R o O_R)^T`` with ``O = Q_new^T Q_old`` (``o``:
  elementwise). It keeps ``v``'s total and its positivity: a coordinate of
  the new basis inherits the moment of the old coordinates it overlaps, so
  a refresh does not send a coordinate to ``P = 1/damping``."""
  o_left = jnp.square(jnp.einsum('bim,bin->bmn', new_left, old_left))
  o_right = jnp.square(jnp.einsum('bim,bin->bmn', new_right, old_right))
  return jnp.einsum('bmi,bij,bnj->bmn', o_left, v, o_right).astype(v.dtype)


# every may arrive traced (optax.inject_hyperparams); max_dim sets shapes.
KRON_ARGUMENTS = dict(factor_decay=_checks.decay(optional=True),
                      every=_checks.Count(1, traced=True),
                      max_dim=_checks.Count(1))
_SPEC = _checks.Spec('cbp.precondition_kron',
                     dict(diag.ARGUMENTS, **KRON_ARGUMENTS))


def precondition_kron(
    b1: float = 0.9,
    b2: float = 0.999,
    damping: float = 1e-3,
    *,
    factor_decay: Optional[float] = None,
    every: int = 10,
    max_dim: int = 4096,
    dimension_numbers: Optional[DimensionNumbers] = None,
    stats_dtype: Optional[Any] = None,
    zero_moment: str = 'damped',
) -> optax.GradientTransformation:
  r"""M3 run in the eigenbasis of each matrix's Kronecker factors (§8.2).

  For each matrix-shaped leaf, the direction is :math:`Q_L (P_t \odot Q_L^T
  \hat m_t Q_R) Q_R^T` with :math:`P_t = 1/(\sqrt{\hat v_{t-1}} + \zeta)` the
  lagged, damped second moment of eq. (11) kept in the rotated coordinates,
  :math:`\hat m_t` the bias-corrected momentum of eq. (12), and :math:`Q_L,
  Q_R` the eigenvectors of the EMAs of :math:`G G^T` and :math:`G^T G`,
  refreshed every ``every`` steps (the module docstring gives the reasoning
  for each choice). Every other leaf is :func:`cbp_optax.precondition`'s.
  The operator is positive definite with M3's bounds (Lemma 1), so it
  composes with :func:`cbp_optax.equalize` (M1) and the centered model (M2)
  exactly as :func:`cbp_optax.precondition` does.

  Args:
    b1: momentum decay :math:`\beta_1` in [0, 1).
    b2: second-moment decay :math:`\beta_2` in [0, 1).
    damping: :math:`\zeta > 0`.
    factor_decay: the decay of the factors' EMAs in [0, 1); None: ``b2``.
    every: refresh the bases every ``every`` steps (an int >= 1); until the
      first refresh the bases are the identity and the transform is
      :func:`cbp_optax.precondition`.
    max_dim: a matrix with a side longer than this keeps the diagonal M3 (a
      factor holds ``side^2`` entries). Under ``optax.inject_hyperparams``
      name it in ``static_args``.
    dimension_numbers: which axes of each leaf are the matrix's rows
      (reduction) and columns (output): a tree like the parameters of
      ``optax.contrib.MuonDimensionNumbers`` or None (diagonal), or a
      function of the parameters returning one (e.g.
      ``cbp_optax.nnx.muon_dimension_numbers(model)`` for attention and
      layer stacks). None: :func:`default_dimension_numbers`.
    stats_dtype: a real floating dtype for the moments and factors; float32
      for low-precision parameters by default.
    zero_moment: as in :func:`cbp_optax.precondition`.

  Returns:
    An ``optax.GradientTransformation`` whose state is
    :class:`KronPreconditionState`.

  Raises:
    TypeError, ValueError: as :func:`cbp_optax.precondition`, and for an
      ``every`` or ``max_dim`` that is not a positive int or a
      ``factor_decay`` outside [0, 1).

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
    Layerwise Conditioned Backpropagation: A Curvature-Aware
    Reparameterization of the Backward Pass with Convergence Guarantees,
    §4.3-4.4 (eqs. 11-12), Lemma 1, Proposition 1 and §8.2; Vyas et al.,
    SOAP, ICLR 2025.
  """
  _checks.check(_SPEC, b1=b1, b2=b2, damping=damping,
                factor_decay=factor_decay, every=every, max_dim=max_dim,
                stats_dtype=stats_dtype, zero_moment=zero_moment)
  rules = diag.Rules(b1, b2, damping, zero_moment)
  beta_f = b2 if factor_decay is None else factor_decay
  numbers = (default_dimension_numbers if dimension_numbers is None
             else dimension_numbers)

  def views(params):
    """Per leaf, its key in ``factors`` and its matrix view (or None)."""
    paths = [_key(path) for path, _ in
             jax.tree_util.tree_flatten_with_path(params)[0]]
    shapes = [jnp.shape(p) for p in jax.tree.leaves(params)]
    found = [(k, _matrix(shape, s, max_dim))
             for k, shape, s in zip(paths, shapes, _specs(numbers, params))]
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
        factors[key] = KronFactors(
            jnp.zeros((batch, m, m), dtype), jnp.zeros((batch, n, n), dtype),
            _eye(batch, m, dtype), _eye(batch, n, dtype))
    return KronPreconditionState(
        count=jnp.zeros([], jnp.int32),
        mu=diag.zeros_like_tree(params, stats_dtype),
        nu=diag.zeros_like_tree(params, stats_dtype),
        factors=factors or _no_factors())

  def update_fn(updates, state, params=None):
    # test_complex_gradients_are_refused: the imaginary part would be lost.
    _checks.check_real_gradients('precondition_kron', updates)
    # test_mismatched_tree_is_refused_clearly: moments of other leaves.
    diag.check_matches_state(updates, state)
    # test_params_that_do_not_match_the_gradients_are_refused.
    _checks.check_params_match('precondition_kron', updates, params)
    count_inc = optax.safe_increment(state.count)
    first_step = state.count == 0
    nu_correction = jnp.where(first_step, 1.0, 1.0 - b2 ** state.count)
    mu_correction = 1.0 - b1 ** count_inc
    refresh = jnp.remainder(count_inc, every) == 0

    g_leaves, treedef = jax.tree.flatten(updates)
    p_leaves = ([None] * len(g_leaves) if params is None
                else jax.tree.leaves(params))
    found = views(updates)
    steps, mus, nus, factors = [], [], [], {}
    for g, m, v, p, (key, view) in zip(
        g_leaves, jax.tree.leaves(state.mu), jax.tree.leaves(state.nu),
        p_leaves, found):
      if view is None:
        step, m_new, v_new = diag.leaf_update(
            rules, first_step, mu_correction, nu_correction, g, m, v, p)
      else:
        step, m_new, v_new, factors[key] = _matrix_update(
            rules, beta_f, first_step, mu_correction, nu_correction, refresh,
            g, m, v, p, state.factors[key], view)
      steps.append(step), mus.append(m_new), nus.append(v_new)
    return treedef.unflatten(steps), KronPreconditionState(
        count=count_inc, mu=treedef.unflatten(mus),
        nu=treedef.unflatten(nus), factors=factors or state.factors)

  return optax.GradientTransformation(init_fn, update_fn)
