"""Diagnostics of gradient flow and curvature for any parameter tree.

Functions a user can call on their own model to ask whether its gradient flow
is broken and what CBP changes:

* :func:`gradient_profile` / :func:`update_profile` - the Frobenius norm of
  every M1 block (same blocks, order and names as :func:`cbp_optax.equalize`)
  and their disparity ``max_l / min_l``, the quantity M1 equalizes (eqs. 5-7).
* :func:`hessian_trace` - Hutchinson's estimate of ``tr(H)`` with Rademacher
  probes and its standard error, total and per block.
* :func:`top_eigenvalue` - power iteration on Hessian-vector products, for the
  whole Hessian or for each diagonal block ``H_ll`` (the block constants of
  Theorem 4, eq. 28).
* :func:`parameter_movement` - distance from initialization, per block and in
  total, relative to the initial norm (lazy vs rich training).
* :func:`mean_alignment` - the cosine between a layer's input mean and the top
  eigenvector of its input curvature factor ``E[a a^T]`` (Proposition 3,
  eqs. 20-21; Table 5).

Hessian-vector products are forward-over-reverse (``jax.jvp`` of
``jax.grad``). Every function is traceable (``jax.jit`` works on all of them;
block names are static pytree metadata of the results) and computes in the
floating dtype of its inputs: float32, or float64 under
``jax.enable_x64(True)``.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp

from cbp_optax.blocks import block_layout
from cbp_optax.blocks import BlockFn
from cbp_optax.blocks import BlockLayout
from cbp_optax.blocks import StackedFn
from cbp_optax_experiments.diagnostics import _checks
from cbp_optax_experiments.diagnostics import _hessian
from cbp_optax_experiments.diagnostics import _per_block
from cbp_optax_experiments.diagnostics._checks import stats_dtype_for
from cbp_optax_experiments.diagnostics._hessian import LossFn

__all__ = (
    'GradientProfile',
    'HessianTrace',
    'MeanAlignment',
    'ParameterMovement',
    'TopEigenvalue',
    'UpdateProfile',
    'gradient_profile',
    'hessian_trace',
    'mean_alignment',
    'parameter_movement',
    'top_eigenvalue',
    'update_profile',
)


def _static_names(cls):
  """Registers a NamedTuple whose ``names`` field is static pytree metadata.

  The block names are Python strings: as aux data they survive ``jax.jit``
  and ``jax.vmap`` while the arrays stay leaves.
  """
  fields = tuple(f for f in cls._fields if f != 'names')

  def flatten_with_keys(result):
    children = tuple((jax.tree_util.GetAttrKey(f), getattr(result, f))
                     for f in fields)
    return children, result.names

  def unflatten(names, children):
    return cls(names=names, **dict(zip(fields, children)))

  jax.tree_util.register_pytree_with_keys(
      cls, flatten_with_keys, unflatten,
      flatten_func=lambda r: (tuple(getattr(r, f) for f in fields), r.names))
  return cls


@_static_names
class GradientProfile(NamedTuple):
  """Per-block gradient norms, see :func:`gradient_profile`.

  Attributes:
    names: block names, as :func:`cbp_optax.block_names` gives them.
    norms: ``||g_l||_F`` of every block, shape ``(L,)``.
    disparity: ``max_l ||g_l|| / min_l ||g_l||``; ``inf`` when a block is zero,
      ``nan`` when all are.
  """

  names: tuple[str, ...]
  norms: chex.Array
  disparity: chex.Array


@_static_names
class UpdateProfile(NamedTuple):
  """Per-block update norms, see :func:`update_profile`.

  Attributes:
    names: block names, as :func:`cbp_optax.block_names` gives them.
    norms: ``||u_l||_F`` of every block, shape ``(L,)``.
    disparity: ``max_l ||u_l|| / min_l ||u_l||``.
    relative: ``||u_l|| / ||theta_l||`` (the relative step of every block;
      ``inf`` for a step away from an all-zero block, 0 for no step), or None
      when no parameters were given.
  """

  names: tuple[str, ...]
  norms: chex.Array
  disparity: chex.Array
  relative: Optional[chex.Array] = None


@_static_names
class HessianTrace(NamedTuple):
  """Hutchinson estimate of the Hessian trace, see :func:`hessian_trace`.

  Attributes:
    names: block names.
    estimate: the mean of ``v^T H v`` over the probes: the trace over every
      parameter, in a block or not.
    stderr: its standard error, ``sd(v^T H v) / sqrt(num_samples)``.
    block_estimates: unbiased estimates of ``tr(H_ll)`` per block, shape
      ``(L,)``; with ``outside_estimate`` they sum to ``estimate``.
    block_stderr: their standard errors, shape ``(L,)``.
    outside_estimate: the estimate of the trace over the parameters in no
      block (``block_fn`` returned None for them: ``cbp.no_blocks``,
      ``cbp.kernel_blocks``' biases); 0 when every parameter is in one.
    outside_stderr: its standard error.
  """

  names: tuple[str, ...]
  estimate: chex.Array
  stderr: chex.Array
  block_estimates: chex.Array
  block_stderr: chex.Array
  outside_estimate: Optional[chex.Array] = None
  outside_stderr: Optional[chex.Array] = None


@_static_names
class TopEigenvalue(NamedTuple):
  """Result of power iteration, see :func:`top_eigenvalue`.

  Attributes:
    names: ``()`` for the whole Hessian, the block names with ``per_block``.
    eigenvalue: the Rayleigh quotient ``v^T H v`` at the final unit vector;
      shape ``()``, or ``(L,)`` per block.
    residual: ``||H v - eigenvalue v||``. ``H`` being symmetric, it has an
      eigenvalue within ``residual`` of ``eigenvalue`` (the error bound).
    vector: the unit vector ``v``, a tree like ``params`` (with a leading
      block axis per block, zero outside its block).
  """

  names: tuple[str, ...]
  eigenvalue: chex.Array
  residual: chex.Array
  vector: Any


@_static_names
class ParameterMovement(NamedTuple):
  """Distance from initialization, see :func:`parameter_movement`.

  Attributes:
    names: block names.
    distances: ``||theta_l - theta0_l||_F`` per block, shape ``(L,)``.
    relative: ``distances / ||theta0_l||_F`` (``inf`` for a block that moved
      from zero, 0 for one that stayed there).
    total: ``||theta - theta0|| / ||theta0||`` over the whole tree, every
      parameter, in a block or not.
    outside_distance: ``||theta - theta0||`` over the parameters in no block
      (``block_fn`` returned None for them); 0 when every parameter is in one.
  """

  names: tuple[str, ...]
  distances: chex.Array
  relative: chex.Array
  total: chex.Array
  outside_distance: Optional[chex.Array] = None


class MeanAlignment(NamedTuple):
  """Mean term of a layer's input curvature factor, see :func:`mean_alignment`.

  Attributes:
    cosine: ``|cos(mu, v_1)|``, ``mu = E[a]``, ``v_1`` the top eigenvector of
      ``A = E[a a^T]``.
    mean_norm: ``||mu||``.
    eigenvalues: eigenvalues of ``A``, ascending, shape ``(d,)``.
    centered_eigenvalues: eigenvalues of ``Cov(a) = A - mu mu^T``, ascending.
  """

  cosine: chex.Array
  mean_norm: chex.Array
  eigenvalues: chex.Array
  centered_eigenvalues: chex.Array

  @property
  def top_eigenvalue(self) -> chex.Array:
    """``lambda_max(E[a a^T])``."""
    return self.eigenvalues[-1]

  @property
  def centered_top_eigenvalue(self) -> chex.Array:
    """``lambda_max(Cov(a))``; M2 removes the difference (eq. 20)."""
    return self.centered_eigenvalues[-1]


# --- block norms -------------------------------------------------------------


def _layout(tree, block_fn, stacked) -> BlockLayout:
  return block_layout(tree, block_fn=block_fn, stacked=stacked)


def gradient_profile(
    grads: Any,
    *,
    block_fn: Optional[BlockFn] = None,
    stacked: Optional[StackedFn] = None,
) -> GradientProfile:
  """Frobenius norm of every M1 block of a gradient, and their disparity.

  The blocks, their order and names are those of :func:`cbp_optax.equalize`
  with the same ``block_fn`` / ``stacked`` (one block per layer by default,
  one per slice of a declared layer stack), so ``norms[i] ** 2`` is the
  ``||g^(l)||_F^2`` that eq. (5) averages. The disparity ``max / min`` is the
  depth-dependent scale gap that M1 removes (eqs. 6-7, Proposition 2).

  Args:
    grads: a gradient (or any) tree of float arrays.
    block_fn: the grouping of :func:`cbp_optax.equalize`.
    stacked: the layer-stack declaration of :func:`cbp_optax.equalize`.

  Returns:
    A :class:`GradientProfile`; norms in float32, or float64 when a leaf is.

  Examples:
    >>> import jax.numpy as jnp
    >>> from cbp_optax_experiments import diagnostics
    >>> grads = {'dense_0': {'kernel': jnp.full((2, 2), 0.5),
    ...                      'bias': jnp.zeros(2)},
    ...          'dense_1': {'kernel': jnp.full((2, 1), 3.0)}}
    >>> profile = diagnostics.gradient_profile(grads)
    >>> profile.names
    ('dense_0', 'dense_1')
    >>> [round(float(n), 4) for n in profile.norms]
    [1.0, 4.2426]
    >>> round(float(profile.disparity), 4)
    4.2426
  """
  layout = _layout(grads, block_fn, stacked)
  norms = _per_block.norms(layout, grads, stats_dtype_for(grads))
  return GradientProfile(layout.names, norms, _per_block.disparity(norms))


def update_profile(
    updates: Any,
    params: Optional[Any] = None,
    *,
    block_fn: Optional[BlockFn] = None,
    stacked: Optional[StackedFn] = None,
) -> UpdateProfile:
  """Per-block norms of the updates an optimizer applies.

  Comparing it with :func:`gradient_profile` of the raw gradient shows what an
  optimizer does to the layer scales: SGD keeps the gradient's profile, M1
  flattens it towards ``c = sqrt(mean_j q_j)`` within its clip (eq. 6), Adam
  and M3 rescale every coordinate (eq. 11).

  Args:
    updates: the output of ``tx.update`` (or any tree).
    params: the parameters the updates apply to; when given, ``relative`` is
      each block's step relative to its norm, ``||u_l|| / ||theta_l||``.
    block_fn: the grouping of :func:`cbp_optax.equalize`.
    stacked: the layer-stack declaration of :func:`cbp_optax.equalize`.

  Returns:
    An :class:`UpdateProfile`.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> from cbp_optax_experiments import diagnostics
    >>> params = {'a': {'w': jnp.ones(4)}, 'b': {'w': jnp.ones(4)}}
    >>> grads = {'a': {'w': jnp.full(4, 1e-3)}, 'b': {'w': jnp.ones(4)}}
    >>> tx = optax.adam(0.1)
    >>> updates, _ = tx.update(grads, tx.init(params), params)
    >>> profile = diagnostics.update_profile(updates, params)
    >>> round(float(profile.disparity), 3)  # Adam: both steps are lr-sized
    1.0
    >>> [round(float(r), 3) for r in profile.relative]
    [0.1, 0.1]
  """
  layout = _layout(updates, block_fn, stacked)
  dtype = stats_dtype_for(updates)
  norms = _per_block.norms(layout, updates, dtype)
  relative = None
  if params is not None:
    param_layout = _layout(params, block_fn, stacked)
    if param_layout.names != layout.names:
      raise ValueError(
          'update_profile: updates and params have different blocks '
          f'({layout.names} vs {param_layout.names}).')
    relative = _per_block.safe_ratio(
        norms, _per_block.norms(param_layout, params, dtype))
  return UpdateProfile(layout.names, norms, _per_block.disparity(norms),
                       relative)


# --- curvature ---------------------------------------------------------------


def hessian_trace(
    loss_fn: LossFn,
    params: Any,
    key: chex.PRNGKey,
    *,
    num_samples: int = 100,
    batch_size: Optional[int] = None,
    block_fn: Optional[BlockFn] = None,
    stacked: Optional[StackedFn] = None,
) -> HessianTrace:
  r"""Hutchinson estimate of ``tr(H)``, ``H`` the Hessian of ``loss_fn``.

  With Rademacher probes :math:`v` (entries :math:`\pm 1`),
  :math:`\mathbb{E}[v^\top H v] = \mathrm{tr}(H)` and
  :math:`\mathrm{Var}[v^\top H v] = 2\sum_{i \ne j} H_{ij}^2`: a diagonal
  Hessian is estimated exactly. ``stderr`` is the sample standard deviation
  over ``sqrt(num_samples)``; the per-block estimates restrict the same
  products to each block, ``v_l^T (H v)_l``, whose mean is ``tr(H_ll)``.

  Args:
    loss_fn: ``loss_fn(params) -> scalar``, twice differentiable (close over
      the batch).
    params: the point at which the Hessian is taken.
    key: PRNG key of the probes.
    num_samples: number of probes (at least 2 for a finite ``stderr``).
    batch_size: probes evaluated together (``jax.lax.map``); None: one at a
      time, the least memory.
    block_fn: the grouping of :func:`cbp_optax.equalize` for the block traces.
    stacked: its layer-stack declaration.

  Returns:
    A :class:`HessianTrace`.

  Examples:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from cbp_optax_experiments import diagnostics
    >>> loss = lambda p: 0.5 * jnp.sum(jnp.array([1.0, 2.0, 3.0]) * p['w']**2)
    >>> out = diagnostics.hessian_trace(loss, {'w': jnp.ones(3)},
    ...                                 jax.random.key(0), num_samples=8)
    >>> float(out.estimate), float(out.stderr)  # diagonal H: exact
    (6.0, 0.0)
  """
  _checks.check_count('num_samples', num_samples, minimum=1,
                      maximum=_hessian.MAX_COUNT)
  if batch_size is not None:
    _checks.check_count('batch_size', batch_size, minimum=1,
                        maximum=_hessian.MAX_COUNT)
  _hessian.check_key(key)
  _hessian.float_leaves(params)
  layout = _layout(params, block_fn, stacked)
  whole, outside = _per_block.whole_and_outside(layout, params)
  dtype = stats_dtype_for(params)

  def sample(probe_key):
    probe = _hessian.rademacher_like(probe_key, params)
    hv = _hessian.hvp(loss_fn, params, probe)
    products = jax.tree.leaves(
        jax.tree.map(lambda v, h: (v * h).astype(dtype), probe, hv))
    return (_per_block.sums(layout, products, dtype),
            _per_block.scalar(_per_block.sums(whole, products, dtype), dtype),
            _per_block.scalar(_per_block.sums(outside, products, dtype),
                              dtype))

  keys = jax.random.split(key, num_samples)
  per_block, totals, outsides = jax.lax.map(sample, keys,
                                            batch_size=batch_size)
  estimate, stderr = _hessian.mean_and_stderr(totals)
  block_estimates, block_stderr = _hessian.mean_and_stderr(per_block)
  outside_estimate, outside_stderr = _hessian.mean_and_stderr(outsides)
  return HessianTrace(layout.names, estimate, stderr, block_estimates,
                      block_stderr, outside_estimate, outside_stderr)


def top_eigenvalue(
    loss_fn: LossFn,
    params: Any,
    key: chex.PRNGKey,
    *,
    num_iters: int = 50,
    per_block: bool = False,
    block_fn: Optional[BlockFn] = None,
    stacked: Optional[StackedFn] = None,
) -> TopEigenvalue:
  r"""Largest-magnitude Hessian eigenvalue by power iteration.

  Iterates :math:`v \leftarrow Hv / \|Hv\|` from a Gaussian start with
  forward-over-reverse Hessian-vector products and returns the Rayleigh
  quotient :math:`v^\top H v`. Convergence is geometric in
  :math:`|\lambda_2 / \lambda_1|`; ``residual`` :math:`\|Hv - \lambda v\|`
  bounds the distance from the returned value to an eigenvalue of :math:`H`
  (:math:`H` is symmetric), so a small residual certifies it. Near the
  minimum of a loss the top eigenvalue is the sharpness; elsewhere a large
  negative eigenvalue can win on magnitude, and its sign shows it.

  With ``per_block`` the iteration runs separately on every diagonal block
  :math:`H_{ll}` of the M1 blocks (the block constants :math:`\ell_l` of
  eq. 28 that Theorem 4's rate depends on), one block after the other.

  Args:
    loss_fn: ``loss_fn(params) -> scalar``.
    params: the point at which the Hessian is taken.
    key: PRNG key of the starting vector.
    num_iters: Hessian-vector products before the final Rayleigh quotient.
    per_block: one eigenvalue per block instead of one for the whole ``H``.
    block_fn: the grouping of :func:`cbp_optax.equalize`.
    stacked: its layer-stack declaration.

  Returns:
    A :class:`TopEigenvalue`.

  Examples:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from cbp_optax_experiments import diagnostics
    >>> h = jnp.array([1.0, 4.0])
    >>> loss = lambda p: 0.5 * (h[0] * p['a']['w']**2 + h[1] * p['b']['w']**2)
    >>> params = {'a': {'w': 1.0}, 'b': {'w': 1.0}}
    >>> out = diagnostics.top_eigenvalue(loss, params, jax.random.key(0))
    >>> round(float(out.eigenvalue), 4)
    4.0
    >>> blocks = diagnostics.top_eigenvalue(loss, params, jax.random.key(0),
    ...                                     per_block=True)
    >>> blocks.names, [round(float(e), 4) for e in blocks.eigenvalue]
    (('a', 'b'), [1.0, 4.0])
  """
  _checks.check_count('num_iters', num_iters, minimum=0,
                      maximum=_hessian.MAX_COUNT)
  _checks.check_bool('per_block', per_block)
  _hessian.check_key(key)
  _hessian.float_leaves(params)
  dtype = stats_dtype_for(params)
  if not per_block:
    value, residual, vector = _hessian.power_iteration(
        loss_fn, params, key, num_iters, None, dtype)
    return TopEigenvalue((), value, residual, vector)
  layout = _layout(params, block_fn, stacked)
  ids = _per_block.leaf_block_ids(layout, params)
  treedef = jax.tree.structure(params)

  def one_block(block):
    # A leaf in no block (block_fn returned None) is outside every H_ll.
    mask = jax.tree.unflatten(treedef, [
        jnp.zeros((), jnp.bool_) if i is None else i == block for i in ids])
    return _hessian.power_iteration(
        loss_fn, params, jax.random.fold_in(key, block), num_iters, mask,
        dtype)

  values, residuals, vectors = jax.lax.map(
      one_block, jnp.arange(len(layout.names), dtype=jnp.int32))
  return TopEigenvalue(layout.names, values, residuals, vectors)


# --- movement and alignment --------------------------------------------------


def parameter_movement(
    params: Any,
    params_init: Any,
    *,
    block_fn: Optional[BlockFn] = None,
    stacked: Optional[StackedFn] = None,
) -> ParameterMovement:
  """How far every block has moved from its initialization.

  A small relative movement with a falling loss is the lazy (kernel) regime of
  large initialization scales; a movement of order one is feature learning.

  Args:
    params: the current parameters.
    params_init: the parameters at initialization (same structure).
    block_fn: the grouping of :func:`cbp_optax.equalize`.
    stacked: its layer-stack declaration.

  Returns:
    A :class:`ParameterMovement`.

  Examples:
    >>> import jax.numpy as jnp
    >>> from cbp_optax_experiments import diagnostics
    >>> init = {'a': {'w': jnp.array([3.0, 4.0])}, 'b': {'w': jnp.ones(4)}}
    >>> now = {'a': {'w': jnp.array([3.0, 4.5])}, 'b': {'w': jnp.ones(4)}}
    >>> out = diagnostics.parameter_movement(now, init)
    >>> [round(float(d), 4) for d in out.distances]
    [0.5, 0.0]
    >>> [round(float(r), 4) for r in out.relative]
    [0.1, 0.0]
    >>> round(float(out.total), 4)  # 0.5 / sqrt(25 + 4)
    0.0928
  """
  if jax.tree.structure(params) != jax.tree.structure(params_init):
    raise ValueError('parameter_movement: params and params_init have '
                     'different tree structures.')
  layout = _layout(params, block_fn, stacked)
  dtype = stats_dtype_for((params, params_init))
  delta = jax.tree.map(
      lambda a, b: jnp.asarray(a, dtype) - jnp.asarray(b, dtype),
      params, params_init)
  distances = _per_block.norms(layout, delta, dtype)
  initial = _per_block.norms(layout, params_init, dtype)
  relative = _per_block.safe_ratio(distances, initial)
  whole, outside = _per_block.whole_and_outside(layout, params)
  total = _per_block.safe_ratio(
      _per_block.scalar(_per_block.norms(whole, delta, dtype), dtype),
      _per_block.scalar(_per_block.norms(whole, params_init, dtype), dtype))
  outside_distance = _per_block.scalar(
      _per_block.norms(outside, delta, dtype), dtype)
  return ParameterMovement(layout.names, distances, relative, total,
                           outside_distance)


def mean_alignment(inputs: chex.Array) -> MeanAlignment:
  r"""Alignment of a layer's input mean with its top curvature direction.

  For a dense weight block :math:`W^{(l)}` the Gauss-Newton curvature is
  approximately :math:`A \otimes B` with input factor
  :math:`A = \mathbb{E}[a a^\top] = \Sigma + \mu\mu^\top` (§5.3), so the top
  eigenvector :math:`v_1` of :math:`A` is the input side of the block's top
  curvature direction. This returns :math:`|\cos\angle(\mu, v_1)|` and the
  spectra of :math:`A` and of the centered factor :math:`\Sigma` that M2
  leaves: when the cosine is near one (the aligned regime of Proposition
  3(ii), eq. 21), centering lowers :math:`\lambda_{\max}` by about
  :math:`\|\mu\|^2` (eq. 20). This is the measurement of Table 5.

  Args:
    inputs: the layer's inputs ``a``, shape ``(..., d)``; every leading axis
      counts as samples (for a convolution pass the extracted patches).
      Computed in the inputs' floating dtype (float32 for integers and half
      precision); the factors are usually
      rank-deficient, so use float64 for the small eigenvalues.

  Returns:
    A :class:`MeanAlignment`; ``top_eigenvalue`` and
    ``centered_top_eigenvalue`` are properties.

  Examples:
    >>> import jax.numpy as jnp
    >>> from cbp_optax_experiments import diagnostics
    >>> a = jnp.array([[4.0, 1.0], [2.0, -1.0], [4.0, -1.0], [2.0, 1.0]])
    >>> out = diagnostics.mean_alignment(a)  # mean (3, 0), Cov = I
    >>> round(float(out.cosine), 4), round(float(out.mean_norm), 4)
    (1.0, 3.0)
    >>> round(float(out.top_eigenvalue), 4)
    10.0
    >>> round(float(out.centered_top_eigenvalue), 4)
    1.0
  """
  inputs = jnp.asarray(inputs)
  if inputs.ndim < 2 or 0 in inputs.shape:
    # Without a sample every statistic is NaN; without a feature there is
    # no eigenvector (a ZeroDivisionError from inside the reshape).
    raise ValueError('mean_alignment: inputs need shape (..., d) with at '
                     'least one sample axis, one sample and one feature, got '
                     f'shape {inputs.shape}.')
  if (not jnp.issubdtype(inputs.dtype, jnp.floating)
      or jnp.finfo(inputs.dtype).bits < 32):
    # Integers, and half precision, whose second moments overflow (float16
    # holds 65504) and which eigh does not take.
    inputs = inputs.astype(jnp.float32)
  a = jnp.reshape(inputs, (-1, inputs.shape[-1]))
  n = a.shape[0]
  mu = jnp.mean(a, axis=0)
  second_moment = a.T @ a / n
  covariance = second_moment - jnp.outer(mu, mu)
  values, vectors = jnp.linalg.eigh(second_moment)
  centered_values = jnp.linalg.eigvalsh(covariance)
  mean_norm = jnp.linalg.norm(mu)
  tiny = jnp.finfo(a.dtype).tiny
  cosine = jnp.abs(vectors[:, -1] @ mu) / jnp.maximum(mean_norm, tiny)
  return MeanAlignment(cosine, mean_norm, values, centered_values)
