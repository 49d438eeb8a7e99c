"""M3: damped, lagged diagonal preconditioning (§4.3-4.4, eqs. 11-12)."""

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
    nu: the second moment :math:`v` of eq. (11), likewise.
  """

  count: chex.Array
  mu: optax.Updates
  nu: optax.Updates


def moment_dtype(leaf: Any, stats_dtype: Optional[Any]) -> jnp.dtype:
  """``stats_dtype``, else float32 or the leaf's dtype if wider."""
  if stats_dtype is not None:
    return jnp.dtype(stats_dtype)
  return jnp.promote_types(jnp.result_type(leaf), jnp.float32)


def is_narrow(dtype: Any) -> bool:
  """Whether ``dtype`` is a float of smaller range than float32 (float16)."""
  dtype = jnp.dtype(dtype)
  return bool(jnp.issubdtype(dtype, jnp.floating)) and (
      jnp.finfo(dtype).maxexp < jnp.finfo(jnp.float32).maxexp)


def saturating_cast(x: chex.Array, dtype: Any) -> chex.Array:
  """``x.astype(dtype)``, but finite values beyond ``dtype``'s range
  saturate; NaN and infinities stay (``apply_if_finite`` sees them)."""
  dtype = jnp.dtype(dtype)
  if not is_narrow(dtype) or jnp.finfo(x.dtype).max <= jnp.finfo(dtype).max:
    return x.astype(dtype)
  limit = jnp.asarray(jnp.finfo(dtype).max, x.dtype)
  return jnp.where(jnp.isfinite(x), jnp.clip(x, -limit, limit),
                   x).astype(dtype)


def zeros_like_tree(tree: Any, stats_dtype: Optional[Any]) -> Any:
  # zeros_like keeps the parameters' sharding.
  return jax.tree.map(lambda leaf: jnp.zeros_like(
      leaf, dtype=moment_dtype(leaf, stats_dtype)), tree)


# What P is where the stored second moment is zero.
ZERO_MOMENT_RULES = ('damped', 'identity', 'normalized')
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


def _where(pred: chex.Array, a: chex.Array, b: chex.Array) -> chex.Array:
  """``jnp.where(pred, a, b)``, as ``select_n`` without its nested jit (trace
  time, per leaf) where no promotion or broadcast is due."""
  if (jnp.shape(a) == jnp.shape(b) and jnp.result_type(a) == jnp.result_type(b)
      and not getattr(a, 'weak_type', False)
      and not getattr(b, 'weak_type', False)
      and jnp.shape(pred) in ((), jnp.shape(a))):
    return jax.lax.select_n(pred, b, a)
  return jnp.where(pred, a, b)


def begin_update(name: str, rules: Rules, updates: Any, state: Any,
                 params: Any) -> tuple[chex.Array, tuple[Any, ...], list]:
  """Checks an update's trees; returns the new count, the step's ``terms``
  ``(t == 1, 1 - b1^t, 1 - b2^(t-1))`` (the last 1 at the first step, where
  P_1 = I) and the parameter leaves (None without ``params``)."""
  # test_complex_gradients_are_refused: the imaginary part would be lost.
  _checks.check_real_gradients(name, updates)
  # test_mismatched_tree_is_refused_clearly: moments of other leaves.
  updates_def, state_def = map(jax.tree.structure, (updates, state.mu))
  if updates_def != state_def:
    raise ValueError('precondition: ' + (
        centered_after_init(updates, state.mu) or 'the gradient tree does '
        'not match the state the transform was initialized with.\n  '
        f'gradients: {updates_def}\n  state:     {state_def}'))
  for (path, g), m in zip(jax.tree_util.tree_flatten_with_path(updates)[0],
                          jax.tree.leaves(state.mu)):
    if jnp.shape(g) != jnp.shape(m):
      raise ValueError(
          f'precondition: gradient {jax.tree_util.keystr(path)} has shape '
          f'{jnp.shape(g)} but its state has shape {jnp.shape(m)}.')
  # test_params_that_do_not_match_the_gradients_are_refused.
  _checks.check_params_match(name, updates, params)
  count_inc = optax.safe_increment(state.count)
  first_step = state.count == 0
  terms = (first_step, 1.0 - rules.b1 ** count_inc,
           jnp.where(first_step, 1.0, 1.0 - rules.b2 ** state.count))
  p_leaves = ([None] * len(jax.tree.leaves(updates)) if params is None
              else jax.tree.leaves(params))
  return count_inc, terms, p_leaves


def leaf_update(rules: Rules, terms: tuple[Any, ...], g, m, v, p):
  """One leaf's direction and moments (eqs. 11-12; Algorithm 1, steps 6-9)."""
  b1, b2, damping = rules.b1, rules.b2, rules.damping
  first_step, mu_correction, nu_correction = terms
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
  step = m_hat / denom if normalized else _where(first_step, m_hat,
                                                  m_hat / denom)
  if rules.zero_moment == 'identity':
    step = _where(v == 0, m_hat, step)
  v_new = b2 * v + (1.0 - b2) * g_square
  # A finite gradient whose square overflows: (sqrt(1 - b2) g)^2 instead,
  # saturating, so the stored moment stays finite.
  largest = jnp.finfo(v.dtype).max
  overflowed = (jnp.isinf(v_new) & (jnp.abs(g_stats) <= largest)
                & (v <= largest))
  v_new = _where(overflowed, jnp.minimum(
      b2 * v + jnp.square(jnp.sqrt(1.0 - b2) * g_stats), largest), v_new)
  return (saturating_cast(step, out_dtype), m_new.astype(m.dtype),
          v_new.astype(v.dtype))


def precondition(b1: float = 0.9, b2: float = 0.999, damping: float = 1e-3, *,
                 stats_dtype: Optional[Any] = None,
                 zero_moment: str = 'damped') -> optax.GradientTransformation:
  r"""Damped, lagged diagonal preconditioner with momentum, M3 of CBP.

  Returns :math:`P_t \hat m_t` with :math:`\hat m_t = m_t / (1 - \beta_1^t)`
  (eq. 12) and :math:`P_t = 1 / (\sqrt{\hat v_{t-1}} + \zeta)` from the *stored*
  second moment :math:`\hat v_{t-1} = v_{t-1} / (1 - \beta_2^{t-1})` (eq. 11),
  :math:`P_1 = I`; :math:`v` is refreshed with the current gradient afterwards
  (Algorithm 1, steps 6-9). The lag keeps :math:`P_t` independent of the current
  minibatch (Theorem 3); the damping outside the root bounds it: :math:`1/(G +
  \zeta) \le P_t \le 1/\zeta` (Lemma 1).

  Because of the lag, a coordinate whose gradients were exactly zero so far
  is multiplied by :math:`1/\zeta` the first time its gradient is non-zero:
  there, use a learning rate well below Adam's, a larger ``damping``, a
  warm-up, or ``zero_moment='identity'``.

  Args:
    b1: momentum decay :math:`\beta_1` in [0, 1) (0: momentum-free, §5.4).
    b2: second-moment decay :math:`\beta_2` in [0, 1).
    damping: :math:`\zeta > 0`.
    stats_dtype: a real floating dtype for both moments; default float32
      for low-precision parameters, else the parameters' dtype.
    zero_moment: :math:`P` where the stored second moment is zero:
      ``'damped'`` (Algorithm 1: :math:`P_1 = I`, :math:`1/\zeta` after
      step 1), ``'identity'`` (:math:`P = 1`) or ``'normalized'`` (from the
      current :math:`\tilde g_t^2`, Adam's first step; Lemma 1 holds, the
      lag is given up at that one step).

  Returns:
    An ``optax.GradientTransformation`` whose state is
    :class:`PreconditionState`. Updates have the gradients' dtype,
    saturating at float16's largest value.

  Raises:
    TypeError: a hyperparameter of the wrong type, or a non-float
      ``stats_dtype``; at update, complex gradients.
    ValueError: a non-scalar or out-of-range hyperparameter, an unknown
      ``zero_moment``; at update, gradients or ``params`` unlike the state.

  Examples:
    Momentum-free, so the update is :math:`P_t g_t`: step 1 returns the
    gradient; at step 2 the first coordinate is divided by
    :math:`\sqrt{\hat v_1} + \zeta = 2.001`, the second (zero at step 1)
    multiplied by :math:`1/\zeta`:

    >>> import jax.numpy as jnp
    >>> import cbp_optax as cbp
    >>> params = {'w': jnp.zeros(2)}
    >>> tx = cbp.precondition(b1=0.0, damping=1e-3)
    >>> state = tx.init(params)
    >>> updates, state = tx.update({'w': jnp.array([2.0, 0.0])}, state)
    >>> print(updates['w'])
    [2. 0.]
    >>> updates, state = tx.update({'w': jnp.array([2.0, 3.0])}, state)
    >>> print(*(f'{u:.4g}' for u in updates['w'].tolist()))
    0.9995 3000

  References:
    Layerwise Conditioned Backpropagation,
    §4.3-4.4 (eqs. 11-12), Lemma 1 and Algorithm 1, steps 6-9.
  """
  _checks.check(_SPEC, b1=b1, b2=b2, damping=damping, stats_dtype=stats_dtype,
      zero_moment=zero_moment)
  rules = Rules(b1, b2, damping, zero_moment)

  def init_fn(params):
    _checks.check_float_leaves('precondition', params)
    return PreconditionState(jnp.zeros([], jnp.int32),
                             zeros_like_tree(params, stats_dtype),
                             zeros_like_tree(params, stats_dtype))

  def update_fn(updates, state, params=None):
    count_inc, terms, p_leaves = begin_update('precondition', rules, updates,
                                              state, params)
    g_leaves, treedef = jax.tree.flatten(updates)
    results = [leaf_update(rules, terms, g, m, v, p) for g, m, v, p in zip(
        g_leaves, jax.tree.leaves(state.mu), jax.tree.leaves(state.nu),
        p_leaves)]
    steps, mu, nu = (treedef.unflatten([r[i] for r in results])
                     for i in range(3))
    return steps, PreconditionState(count=count_inc, mu=mu, nu=nu)

  return optax.GradientTransformation(init_fn, update_fn)
