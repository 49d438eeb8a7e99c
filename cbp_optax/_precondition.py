"""M3: damped, lagged diagonal second-moment preconditioning (§4.3-4.4, eqs. 11-12).

With ``g~`` the (equalized) gradient of step ``t``:

    m_t = b1 m_{t-1} + (1 - b1) g~,          m_hat = m_t / (1 - b1^t)      (12)
    P_t = 1 / (sqrt(v_{t-1} / (1 - b2^(t-1))) + damping),  P_1 = I          (11)
    update = P_t m_hat
    v_t = b2 v_{t-1} + (1 - b2) g~^2

The preconditioner of step ``t`` is formed from the *stored* second moment
before it is refreshed with the current gradient (Algorithm 1, steps 6-9): this
one-step lag makes ``P_t`` independent of the current minibatch, which the
stochastic analysis (Theorem 3) requires.

References:
  Layerwise Conditioned Backpropagation: A Curvature-Aware
  Reparameterization of the Backward Pass with Convergence Guarantees,
  §4.3-4.4, eqs. (11)-(12), Lemma 1 and Algorithm 1, steps 6-9.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp
import optax

from cbp_optax import _checks
from cbp_optax.centering import centered_after_init


class PreconditionState(NamedTuple):
  """State of :func:`precondition`.

  Attributes:
    count: the number of updates taken, an int32 scalar.
    mu: the first moment :math:`m` of eq. (12), like the parameters, in the
      statistics dtype.
    nu: the second moment :math:`v` of eq. (11), like the parameters, in the
      statistics dtype.

  Examples:
    >>> import jax.numpy as jnp
    >>> import cbp_optax as cbp
    >>> state = cbp.precondition().init({'w': jnp.ones(2, jnp.bfloat16)})
    >>> int(state.count), state.mu['w'].dtype, state.nu['w'].shape
    (0, dtype('float32'), (2,))
  """

  count: chex.Array  # shape=(), dtype=jnp.int32.
  mu: optax.Updates  # First moment m, in stats dtype.
  nu: optax.Updates  # Second moment v, in stats dtype.


def moment_dtype(leaf: Any, stats_dtype: Optional[Any]) -> jnp.dtype:
  if stats_dtype is not None:
    return jnp.dtype(stats_dtype)
  # Low-precision parameters keep float32 statistics; float64 stays float64.
  return jnp.promote_types(jnp.result_type(leaf), jnp.float32)


def is_narrow(dtype: Any) -> bool:
  """Whether ``dtype`` is a float of smaller range than float32 (float16)."""
  dtype = jnp.dtype(dtype)
  return bool(jnp.issubdtype(dtype, jnp.floating)) and (
      jnp.finfo(dtype).maxexp < jnp.finfo(jnp.float32).maxexp
  )


def saturating_cast(x: chex.Array, dtype: Any) -> chex.Array:
  """``x.astype(dtype)``, but finite values beyond ``dtype``'s range saturate.

  ``P_t m_hat`` can exceed float16's range; NaN and infinities stay as they
  are (``optax.apply_if_finite`` and the fused steps see them).
  """
  dtype = jnp.dtype(dtype)
  if not is_narrow(dtype) or jnp.finfo(x.dtype).max <= jnp.finfo(dtype).max:
    return x.astype(dtype)
  limit = jnp.asarray(jnp.finfo(dtype).max, x.dtype)
  return jnp.where(jnp.isfinite(x), jnp.clip(x, -limit, limit), x).astype(
      dtype
  )


def zeros_like_tree(tree: Any, stats_dtype: Optional[Any]) -> Any:
  # zeros_like keeps the parameters' sharding: one state type at init and
  # after every update.
  return jax.tree.map(
      lambda leaf: jnp.zeros_like(leaf, dtype=moment_dtype(leaf, stats_dtype)),
      tree,
  )


def check_matches_state(updates: Any, state: PreconditionState) -> None:
  updates_def = jax.tree.structure(updates)
  state_def = jax.tree.structure(state.mu)
  if updates_def != state_def:
    hint = centered_after_init(updates, state.mu)
    if hint:
      raise ValueError(f'precondition: {hint}')
    raise ValueError(
        'precondition: the gradient tree does not match the state the '
        f'transform was initialized with.\n  gradients: {updates_def}\n  '
        f'state:     {state_def}'
    )
  for (path, g), m in zip(jax.tree_util.tree_flatten_with_path(updates)[0],
                          jax.tree.leaves(state.mu)):
    if jnp.shape(g) != jnp.shape(m):
      raise ValueError(
          f'precondition: gradient {jax.tree_util.keystr(path)} has shape '
          f'{jnp.shape(g)} but its state has shape {jnp.shape(m)}.'
      )


# What P is for a coordinate whose stored second moment is zero (every
# coordinate at step 1; later, one whose gradients were all exactly zero).
ZERO_MOMENT_RULES = ('damped', 'identity', 'normalized')


# M3's hyperparameters (eqs. 11-12).
ARGUMENTS = dict(b1=_checks.decay(), b2=_checks.decay(),
                 damping=_checks.positive(),
                 zero_moment=_checks.Choice(ZERO_MOMENT_RULES),
                 stats_dtype=_checks.STATS_DTYPE)
_SPEC = _checks.Spec('cbp.precondition', ARGUMENTS)


class Rules(NamedTuple):
  """The hyperparameters of one :func:`precondition` (tracers allowed)."""
  b1: Any
  b2: Any
  damping: Any
  zero_moment: str  # one of ZERO_MOMENT_RULES


def _same_kind(a: chex.Array, b: chex.Array) -> bool:
  """Arrays of one shape and one (strong) dtype: no promotion between them."""
  return (jnp.shape(a) == jnp.shape(b) and jnp.result_type(a) == jnp.result_type(b)
          and not getattr(a, 'weak_type', False)
          and not getattr(b, 'weak_type', False))


def _where(pred: chex.Array, a: chex.Array, b: chex.Array) -> chex.Array:
  """``jnp.where(pred, a, b)``; the same ``select_n`` without ``jnp.where``'s
  nested jit (trace and lowering time, per leaf) where no promotion is due."""
  if _same_kind(a, b) and (jnp.ndim(pred) == 0
                           or jnp.shape(pred) == jnp.shape(a)):
    return jax.lax.select_n(pred, b, a)
  return jnp.where(pred, a, b)


def leaf_update(rules: Rules, first_step, mu_correction, nu_correction,
                 g, m, v, p):
  """One leaf's direction and new moments (eqs. 11-12; steps 6-9)."""
  b1, b2, damping = rules.b1, rules.b2, rules.damping
  out_dtype = _checks.output_dtype(g, p)
  g_stats = jnp.asarray(g).astype(m.dtype)
  m_new = b1 * m + (1.0 - b1) * g_stats
  m_hat = m_new / mu_correction.astype(m.dtype)
  v_hat = v / nu_correction.astype(v.dtype)
  g_square = jnp.square(g_stats)
  normalized = rules.zero_moment == 'normalized'
  if normalized:
    # No history yet: the current gradient's own moment (Adam's step 1).
    v_hat = _where(v == 0, g_square, v_hat)
  denom = jnp.sqrt(v_hat) + damping
  if normalized:
    step = m_hat / denom
  else:
    step = _where(first_step, m_hat, m_hat / denom)
  if rules.zero_moment == 'identity':
    step = _where(v == 0, m_hat, step)
  v_new = b2 * v + (1.0 - b2) * g_square
  # A finite gradient whose square overflows (eq. 11's g^2 beyond the
  # dtype's range): (sqrt(1 - b2) g)^2 instead, at most the largest finite
  # value, so the stored moment stays finite.
  largest = jnp.finfo(v.dtype).max
  overflowed = (jnp.isinf(v_new) & (jnp.abs(g_stats) <= largest)
                & (v <= largest))
  v_new = _where(overflowed, jnp.minimum(
      b2 * v + jnp.square(jnp.sqrt(1.0 - b2) * g_stats), largest), v_new)
  return (saturating_cast(step, out_dtype), m_new.astype(m.dtype),
          v_new.astype(v.dtype))


def precondition(
    b1: float = 0.9,
    b2: float = 0.999,
    damping: float = 1e-3,
    *,
    stats_dtype: Optional[Any] = None,
    zero_moment: str = 'damped',
) -> optax.GradientTransformation:
  r"""Damped, lagged diagonal preconditioner with momentum, M3 of CBP.

  Returns :math:`\hat m_t / (\sqrt{\hat v_{t-1}} + \zeta)` with bias-corrected
  momentum :math:`\hat m_t = m_t / (1 - \beta_1^t)` (eq. 12) and the *stored*
  second moment :math:`\hat v_{t-1} = v_{t-1} / (1 - \beta_2^{t-1})` (eq. 11);
  the first step uses :math:`P_1 = I`, i.e. returns :math:`\hat m_1`. The
  second moment is refreshed with the current gradient only after the update
  is formed (Algorithm 1, steps 6-9).

  Differs from Adam in the lag (Adam divides by :math:`\hat v_t`), in
  :math:`P_1 = I`, and in the damping :math:`\zeta` outside the square root,
  which bounds the operator (Lemma 1): :math:`1/(G + \zeta) \le P_t \le
  1/\zeta`.

  Choosing the learning rate: because of the lag, a coordinate whose stored
  second moment is still zero (its gradients were exactly zero so far) is
  multiplied by :math:`1/\zeta` the first time its gradient is non-zero; the
  paper's Table 8 divergence at :math:`\zeta = 10^{-4}` is this mechanism.
  Where gradients can be exactly zero at the start, use a learning rate well
  below Adam's, a larger ``damping``, a warm-up, or
  ``zero_moment='identity'``.

  Dtypes: the moments are float32 for low-precision parameters
  (``stats_dtype`` overrides); the update has the gradient's dtype and
  saturates at float16's largest finite value rather than overflowing.

  Args:
    b1: momentum decay :math:`\beta_1` in [0, 1); 0 gives the momentum-free
      method analysed in §5.4.
    b2: second-moment decay :math:`\beta_2` in [0, 1).
    damping: :math:`\zeta > 0`.
    stats_dtype: a real floating dtype for both moments; defaults to float32
      for low-precision parameters and to the parameter dtype otherwise.
    zero_moment: :math:`P` where the stored second moment is exactly zero.
      ``'damped'`` (the default) is Algorithm 1: :math:`P_1 = I` at step 1,
      :math:`1/\zeta` after it. ``'identity'`` (opt-in): :math:`P = 1`.
      ``'normalized'`` (opt-in, :func:`cbp_optax.cbp_robust`'s): :math:`P`
      from the current gradient's own moment :math:`\tilde g_t^2` (Adam's
      first step); Lemma 1's bounds hold, the lag of Theorem 3 is given up
      at that one step of each coordinate. A string, so
      ``optax.inject_hyperparams`` keeps it static.

  Returns:
    An ``optax.GradientTransformation`` whose state is
    :class:`PreconditionState`.

  Raises:
    TypeError: a hyperparameter that is not a real number (or a schedule),
      a ``zero_moment`` that is not a string, or a non-float ``stats_dtype``.
    ValueError: a non-scalar or out-of-range hyperparameter, an unknown
      ``zero_moment``; at update, gradients or ``params`` that do not match
      the state.

  Examples:
    Momentum-free (``b1=0``) so the update is :math:`P_t g_t`. Step 1 returns
    the gradient (:math:`P_1 = I`). At step 2 the first coordinate is divided
    by its stored :math:`\sqrt{\hat v_1} + \zeta = 2.001`; the second, whose
    gradient was zero at step 1, is multiplied by :math:`1/\zeta = 1000`:

    >>> import jax.numpy as jnp
    >>> import cbp_optax as cbp
    >>> tx = cbp.precondition(b1=0.0, damping=1e-3)
    >>> state = tx.init({'w': jnp.zeros(2)})
    >>> updates, state = tx.update({'w': jnp.array([2.0, 0.0])}, state)
    >>> print(updates['w'])
    [2. 0.]
    >>> updates, state = tx.update({'w': jnp.array([2.0, 3.0])}, state)
    >>> print(*(f'{u:.4g}' for u in updates['w'].tolist()))
    0.9995 3000

    The opt-in guard gives that coordinate :math:`P = 1` instead:

    >>> tx = cbp.precondition(b1=0.0, zero_moment='identity')
    >>> state = tx.init({'w': jnp.zeros(2)})
    >>> _, state = tx.update({'w': jnp.array([2.0, 0.0])}, state)
    >>> updates, state = tx.update({'w': jnp.array([2.0, 3.0])}, state)
    >>> print(*(f'{u:.4g}' for u in updates['w'].tolist()))
    0.9995 3
    >>> int(state.count), state.nu['w'].dtype
    (2, dtype('float32'))

  References:
    Layerwise Conditioned Backpropagation: A Curvature-Aware
    Reparameterization of the Backward Pass with Convergence Guarantees,
    §4.3-4.4 (eqs. 11-12), Lemma 1 and Algorithm 1, steps 6-9.
  """
  _checks.check(_SPEC, b1=b1, b2=b2, damping=damping, zero_moment=zero_moment,
                stats_dtype=stats_dtype)
  rules = Rules(b1, b2, damping, zero_moment)

  def init_fn(params):
    _checks.check_float_leaves('precondition', params)
    return PreconditionState(
        count=jnp.zeros([], jnp.int32),
        mu=zeros_like_tree(params, stats_dtype),
        nu=zeros_like_tree(params, stats_dtype),
    )

  def update_fn(updates, state, params=None):
    # test_complex_gradients_are_refused: the imaginary part would be lost.
    _checks.check_real_gradients('precondition', updates)
    # test_mismatched_tree_is_refused_clearly: moments of other leaves.
    check_matches_state(updates, state)
    count = state.count
    count_inc = optax.safe_increment(count)
    first_step = count == 0
    # 1 - b2^(t-1) is zero at the first step, where P_1 = I is used instead.
    nu_correction = jnp.where(first_step, 1.0, 1.0 - b2 ** count)
    mu_correction = 1.0 - b1 ** count_inc

    g_leaves, treedef = jax.tree.flatten(updates)
    # test_params_that_do_not_match_the_gradients_are_refused.
    _checks.check_params_match('precondition', updates, params)
    p_leaves = ([None] * len(g_leaves) if params is None
                else jax.tree.leaves(params))
    results = [
        leaf_update(rules, first_step, mu_correction, nu_correction,
                     g, m, v, p)
        for g, m, v, p in zip(g_leaves, jax.tree.leaves(state.mu),
                              jax.tree.leaves(state.nu), p_leaves)
    ]
    steps, mu, nu = (treedef.unflatten([r[i] for r in results])
                     for i in range(3))
    return steps, PreconditionState(count=count_inc, mu=mu, nu=nu)

  return optax.GradientTransformation(init_fn, update_fn)
