"""Configurations of the library that only the studies use.

They are spelled out here, not in ``cbp_optax``, so the library's public
surface holds what a user trains with; the studies (the transformer
ablation) and their tests measure them.
"""

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

import cbp_optax as cbp

# The transformer ablation's combination: cbp with these arguments changed
# (arguments of cbp_study, which has the study-only relative_damping). The
# ablation measures each entry alone and together.
TRANSFORMER_COMBINATION = dict(
    damping=1e-8,
    relative_damping=0.03,
    zero_moment='identity',
    block_fn=cbp.no_blocks,
)


def cbp_study(
    learning_rate: optax.ScalarOrSchedule,
    *,
    relative_damping: float = 0.0,
    b1: float = 0.9,
    b2: float = 0.999,
    damping: float = 1e-3,
    decay: float = 0.99,
    min_scale: float = 0.1,
    max_scale: float = 4.0,
    weight_decay: Optional[optax.ScalarOrSchedule] = None,
    mask: Any = None,
    block_fn: Optional[cbp.blocks.BlockFn] = None,
    stacked: Optional[cbp.blocks.StackedFn] = None,
    stats_dtype: Optional[Any] = None,
    zero_moment: str = 'damped',
    update_clip: Optional[float] = None,
) -> optax.GradientTransformation:
  """``cbp.cbp`` spelled out as its optax chain, with ``relative_damping``.

  ``relative_damping`` (see :func:`relative_precondition`) serves the
  ablation studies only. With ``relative_damping=0`` this is ``cbp.cbp``
  with the same arguments, update for update and state for state, on trees
  without float16 leaves.
  """
  transforms = [
      cbp.equalize(decay, min_scale, max_scale, block_fn=block_fn,
                   stacked=stacked, stats_dtype=stats_dtype),
      relative_precondition(b1, b2, damping, stats_dtype=stats_dtype,
                            zero_moment=zero_moment,
                            relative_damping=relative_damping,
                            stacked=stacked),
  ]
  if update_clip is not None:
    transforms.append(optax.clip(update_clip))
  if weight_decay is not None:
    transforms.append(optax.add_decayed_weights(
        weight_decay, _matrices if mask is None else mask))
  transforms.append(optax.scale_by_learning_rate(learning_rate))
  return optax.chain(*transforms)


def _matrices(params: Any) -> Any:
  """``cbp.cbp``'s documented default decay mask: every leaf of rank >= 2 but
  those named bias, scale or embedding."""
  def is_matrix(path, leaf):
    names = [str(getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k))))
             for k in path]
    names = [n for n in names if n != 'value']
    return jnp.ndim(leaf) >= 2 and not (
        names and names[-1] in ('bias', 'scale', 'embedding'))
  return jax.tree_util.tree_map_with_path(is_matrix, params)


def _check_relative_damping(value: Any) -> None:
  if isinstance(value, (bool, str)) or not isinstance(
      value, (int, float, np.number, np.ndarray, jax.Array)):
    raise TypeError('relative_damping must be a real number >= 0, got the '
                    f'{type(value).__name__} {value!r}.')
  if np.ndim(value) != 0:
    raise ValueError('relative_damping must be a scalar, got shape '
                     f'{np.shape(value)}.')
  if not isinstance(value, jax.core.Tracer) and not float(value) >= 0:
    raise ValueError(f'relative_damping must be >= 0, got {value!r}.')


def relative_precondition(
    b1: float = 0.9,
    b2: float = 0.999,
    damping: float = 1e-3,
    *,
    relative_damping: Any = 0.0,
    stacked: Optional[cbp.blocks.StackedFn] = None,
    stats_dtype: Optional[Any] = None,
    zero_moment: str = 'damped',
) -> optax.GradientTransformation:
  r"""``cbp.precondition`` with a damping relative to each tensor's moment.

  Eq. (11) with the damping :math:`\zeta + \delta r`, :math:`r` the root
  mean square of the tensor's stored :math:`\hat v` (of each slice of a
  ``stacked(path, leaf)`` leaf); an ablation knob, not Algorithm 1. Lemma
  1's bounds become :math:`1/((1 + \delta) G + \zeta) \le P_t \le
  1/\zeta`. The state is ``cbp.precondition``'s, updated by it; a concrete
  ``relative_damping=0`` is ``cbp.precondition`` itself.
  """
  _check_relative_damping(relative_damping)
  if stacked is not None and not callable(stacked):
    raise TypeError(f'stacked must be a function or None, got {stacked!r}.')
  inner = cbp.precondition(b1, b2, damping, stats_dtype=stats_dtype,
                           zero_moment=zero_moment)
  if not isinstance(relative_damping, jax.core.Tracer) and float(
      relative_damping) == 0.0:
    return inner

  def leaf_step(path, g, m_new, v, p, first_step, mu_correction,
                nu_correction):
    g_stats = jnp.asarray(g).astype(m_new.dtype)
    m_hat = m_new / mu_correction.astype(m_new.dtype)
    v_hat = v / nu_correction.astype(v.dtype)
    if zero_moment == 'normalized':
      v_hat = jnp.where(v == 0, jnp.square(g_stats), v_hat)
    axes = None
    if stacked is not None and v_hat.ndim and stacked(
        cbp.blocks.strip_variable_suffix(path), g):
      axes = tuple(range(1, v_hat.ndim))
    rms = jnp.sqrt(jnp.mean(v_hat, axis=axes, keepdims=v_hat.ndim > 0))
    denom = jnp.sqrt(v_hat) + damping
    denom = denom + relative_damping * rms
    if zero_moment == 'normalized':
      step = m_hat / denom
    else:
      step = jnp.where(first_step, m_hat, m_hat / denom)
    if zero_moment == 'identity':
      step = jnp.where(v == 0, m_hat, step)
    dtype = jnp.result_type(g)
    if not jnp.issubdtype(dtype, jnp.floating):
      dtype = jnp.result_type(p) if p is not None else jnp.float32
    return step.astype(dtype)

  def update_fn(updates, state, params=None):
    _, new_state = inner.update(updates, state, params)  # checks, moments
    count = state.count
    first_step = count == 0
    nu_correction = jnp.where(first_step, 1.0, 1.0 - b2 ** count)
    mu_correction = 1.0 - b1 ** optax.safe_increment(count)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(updates)
    p_leaves = (jax.tree.leaves(params) if params is not None
                else [None] * len(leaves))
    steps = [leaf_step(path, g, m, v, p, first_step, mu_correction,
                       nu_correction)
             for (path, g), m, v, p in zip(
                 leaves, jax.tree.leaves(new_state.mu),
                 jax.tree.leaves(state.nu), p_leaves)]
    return treedef.unflatten(steps), new_state

  return optax.GradientTransformation(inner.init, update_fn)
