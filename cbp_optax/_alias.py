"""The optimizer side of Conditioned Backpropagation as one optax chain."""

# No `from __future__ import annotations`: optax's contract tests read
# `learning_rate`'s annotation (optax.ScalarOrSchedule) with inspect.

import functools
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import optax

from cbp_optax import _checks
from cbp_optax import _equalize as equalize_lib
from cbp_optax import _precondition as precondition_lib
from cbp_optax import _precondition_kron as precondition_kron_lib
from cbp_optax import _weight_decay as weight_decay_lib


def _narrow_in_float32(inner: optax.GradientTransformation
                       ) -> optax.GradientTransformationExtraArgs:
  """Runs ``inner`` on float32 copies of float16 gradients, casting the
  update back (saturating); other trees go through untouched."""
  inner = optax.with_extra_args_support(inner)

  def update_fn(updates, state, params=None, **extra_args):
    leaves, treedef = jax.tree.flatten(updates)
    narrow = [precondition_lib.is_narrow(jnp.result_type(g)) for g in leaves]
    if not any(narrow):
      return inner.update(updates, state, params, **extra_args)
    wide = treedef.unflatten([jnp.asarray(g, jnp.float32) if n else g
                              for g, n in zip(leaves, narrow)])
    new_updates, new_state = inner.update(wide, state, params, **extra_args)
    new_leaves, new_def = jax.tree.flatten(new_updates)
    return new_def.unflatten([
        precondition_lib.saturating_cast(u, jnp.result_type(g)) if n else u
        for u, g, n in zip(new_leaves, leaves, narrow)]), new_state

  return optax.GradientTransformationExtraArgs(inner.init, update_fn)


def _spec(name: str, **more: Any) -> _checks.Spec:
  """The checks of a CBP chain's arguments."""
  return _checks.Spec(name, dict(
      learning_rate=_checks.nonnegative(schedule=True),
      weight_decay=_checks.nonnegative(schedule=True, optional=True),
      **equalize_lib.ARGUMENTS, mask=weight_decay_lib.Mask(),
      **precondition_lib.ARGUMENTS,
      update_clip=_checks.positive(optional=True), **more),
      leading=('learning_rate',),
      relations=(equalize_lib.SCALES_ORDERED,
                 weight_decay_lib.MASK_NEEDS_DECAY))


_CBP = _spec('cbp.cbp')
_CBP_KRON = _spec('cbp.cbp_kron', **precondition_kron_lib.KRON_ARGUMENTS)


def _finish(m3, *, decay, min_scale, max_scale, block_fn, stacked,
            stats_dtype, update_clip, weight_decay, mask, learning_rate
            ) -> optax.GradientTransformationExtraArgs:
  """M1, ``m3``, the optional clip and decay, and the rate, as one chain."""
  transforms = [equalize_lib.equalize(
      decay, min_scale, max_scale, block_fn=block_fn, stacked=stacked,
      stats_dtype=stats_dtype), m3]
  if update_clip is not None:
    transforms.append(optax.clip(update_clip))
  transforms += weight_decay_lib.decayed_weights(weight_decay, mask)
  transforms.append(optax.scale_by_learning_rate(learning_rate))
  return _narrow_in_float32(optax.chain(*transforms))


def cbp(
    learning_rate: optax.ScalarOrSchedule, *, b1: float = 0.9,
    b2: float = 0.999, damping: float = 1e-3, decay: float = 0.99,
    min_scale: float = 0.1, max_scale: float = 4.0,
    weight_decay: Optional[optax.ScalarOrSchedule] = None,
    mask: Optional[Union[Any, Callable[[optax.Params], Any]]] = None,
    block_fn: Optional[equalize_lib.BlockFn] = None,
    stacked: Optional[equalize_lib.StackedFn] = None,
    stats_dtype: Optional[Any] = None, zero_moment: str = 'damped',
    update_clip: Optional[float] = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Conditioned Backpropagation: M1 equalization, then M3 preconditioning.

  The chain :func:`equalize` -> :func:`precondition` -> optional ``optax.clip``
  -> optional decoupled weight decay -> ``optax.scale_by_learning_rate``: the
  update :math:`-\eta P_t \hat m_t` of eq. (12) with :math:`m` built from
  :math:`S_t g_t`. Centering (M2) is a reparameterization of the model
  (``cbp_optax.nnx.center``, ``cbp_optax.linen.center``), not an optimizer step.

  Start around :math:`\eta = 10^{-3}`: a coordinate whose gradient was zero so
  far is scaled by up to :math:`1/\zeta` the first time it is not (on Rosenbrock
  from the origin, :math:`\eta = 0.1` sends the second coordinate to about 421;
  see :func:`precondition` for the remedies). Schedule hyperparameters other
  than ``learning_rate`` and ``weight_decay`` with ``optax.inject_hyperparams``,
  naming ``block_fn``, ``stacked`` and ``mask`` in its ``static_args``.

  Args:
    learning_rate: :math:`\eta \ge 0`, a float or an optax schedule.
    b1: momentum decay :math:`\beta_1` in [0, 1) (0: momentum-free, §5.4).
    b2: second-moment decay :math:`\beta_2` in [0, 1).
    damping: preconditioner damping :math:`\zeta > 0`.
    decay: block-energy EMA decay :math:`\rho` of M1 (eq. 5), in [0, 1).
    min_scale: :math:`s_{\min} > 0` of eq. (6).
    max_scale: :math:`s_{\max} \ge s_{\min}` of eq. (6).
    weight_decay: decoupled weight decay :math:`\ge 0` (a number or a
      schedule), before the learning rate; None leaves it out of the chain.
    mask: the leaves ``weight_decay`` applies to, as in
      ``optax.add_decayed_weights`` (only with it). None: every leaf of rank
      >= 2 but those named ``bias``, ``scale`` or ``embedding``.
    block_fn: grouping of leaves into M1 blocks, see :func:`equalize`.
    stacked: layer-stacked leaves, see :func:`equalize`.
    stats_dtype: a real floating dtype for all optimizer statistics (default
      float32, float64 for float64 parameters).
    zero_moment: ``'damped'`` (Algorithm 1), ``'identity'`` or
      ``'normalized'``; see :func:`precondition`.
    update_clip: opt-in :math:`c > 0` (not Algorithm 1): ``optax.clip(c)``
      after :func:`precondition`; Lemma 1's lower bound becomes
      :math:`\min(1/(G + \zeta), c / G)`.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is the chain's:
    ``(EqualizeState, PreconditionState, [clip state,] [weight decay
    state,] learning-rate state)``. Updates have the gradients' dtype
    (float16 gradients run through the chain as float32).

  Raises:
    TypeError: a hyperparameter of the wrong type, a non-float
      ``stats_dtype``, or a function argument that is not a function.
    ValueError: a non-scalar or out-of-range hyperparameter, an unknown
      ``zero_moment``, or a ``mask`` without ``weight_decay``.

  Examples:
    Step 1 applies :math:`s_l = 1` and :math:`P_1 = I`, so the update is
    :math:`-\eta g`; step 2 divides by :math:`|g| + \zeta`:

    >>> import jax.numpy as jnp
    >>> import cbp_optax as cbp
    >>> params = {'dense': {'kernel': jnp.ones((2, 2)), 'bias': jnp.zeros(2)}}
    >>> grads = {'dense': {'kernel': jnp.full((2, 2), 0.5),
    ...                    'bias': jnp.ones(2)}}
    >>> tx = cbp.cbp(learning_rate=0.1)
    >>> state = tx.init(params)
    >>> [type(s).__name__ for s in state]
    ['EqualizeState', 'PreconditionState', 'EmptyState']
    >>> updates, state = tx.update(grads, state, params)
    >>> print(updates['dense']['kernel'].round(4))
    [[-0.05 -0.05]
     [-0.05 -0.05]]
    >>> updates, state = tx.update(grads, state, params)
    >>> print(updates['dense']['kernel'].round(4))
    [[-0.0998 -0.0998]
     [-0.0998 -0.0998]]

  References:
    Layerwise Conditioned Backpropagation, §4.4 (eq. 12) and Algorithm 1.
  """
  _checks.check(_CBP, learning_rate=learning_rate, b1=b1, b2=b2,
      damping=damping, decay=decay, min_scale=min_scale, max_scale=max_scale,
      weight_decay=weight_decay, mask=mask, block_fn=block_fn, stacked=stacked,
      stats_dtype=stats_dtype, zero_moment=zero_moment, update_clip=update_clip)
  m3 = precondition_lib.precondition(
      b1, b2, damping, stats_dtype=stats_dtype, zero_moment=zero_moment)
  return _finish(m3, decay=decay, min_scale=min_scale, max_scale=max_scale,
                 block_fn=block_fn, stacked=stacked, stats_dtype=stats_dtype,
                 update_clip=update_clip, weight_decay=weight_decay, mask=mask,
                 learning_rate=learning_rate)


cbp_robust = functools.partial(
    cbp, damping=1e-8, min_scale=1.0, max_scale=1.0, zero_moment='normalized',
    update_clip=3.0)
cbp_robust.__doc__ = r"""CBP made robust: :func:`cbp` with four departures from Algorithm 1.

  ``functools.partial(cbp, damping=1e-8, min_scale=1.0, max_scale=1.0,
  zero_moment='normalized', update_clip=3.0)``; each can be passed back.
  The step is Adam-sized: start from a tuned AdamW learning rate.

  * ``damping=1e-8``: eq. (11)'s :math:`\zeta` is Adam's :math:`\epsilon`.
  * ``zero_moment='normalized'``: step 1 moves each coordinate by about
    :math:`\eta`.
  * ``update_clip=3.0``: the lagged :math:`\hat v_{t-1}` does not bound a
    growing gradient.
  * ``min_scale=max_scale=1.0``: :math:`S_t = I` (block energies still kept).

  Lemma 1's bounds hold, the lower one :math:`\min(1/(G + \zeta), 3/G)`.

  Examples:
    Step 1 moves each coordinate by about the learning rate:

    >>> import jax.numpy as jnp
    >>> import cbp_optax as cbp
    >>> params = {'a': jnp.zeros(2), 'b': jnp.zeros(2)}
    >>> tx = cbp.cbp_robust(1e-2)
    >>> state = tx.init(params)
    >>> grads = {'a': jnp.array([3e4, -1e4]), 'b': jnp.array([1e-4, 2e-4])}
    >>> updates, state = tx.update(grads, state, params)
    >>> print(updates['a'].round(4), updates['b'].round(4))
    [-0.01  0.01] [-0.01 -0.01]

  References:
    Layerwise Conditioned Backpropagation, eq. (11), Lemma 1, Theorem 3 and
    Algorithm 1.
  """

# doctest does not look inside a functools.partial: run its examples.
__test__ = {'cbp_robust': cbp_robust.__doc__}


def cbp_kron(
    learning_rate: optax.ScalarOrSchedule, *, b1: float = 0.9,
    b2: float = 0.999, damping: float = 1e-8, decay: float = 0.99,
    min_scale: float = 1.0, max_scale: float = 1.0, every: int = 10,
    max_dim: int = 4096, dimension_numbers: Optional[Any] = None,
    weight_decay: Optional[optax.ScalarOrSchedule] = None,
    mask: Optional[Union[Any, Callable[[optax.Params], Any]]] = None,
    block_fn: Optional[equalize_lib.BlockFn] = None,
    stacked: Optional[equalize_lib.StackedFn] = None,
    stats_dtype: Optional[Any] = None, zero_moment: str = 'normalized',
    update_clip: Optional[float] = 3.0,
) -> optax.GradientTransformationExtraArgs:
  r""":func:`cbp_robust` with the Kronecker-factored M3 (§8.2).

  The chain :func:`equalize` -> :func:`precondition_kron` -> optional
  ``optax.clip`` -> optional decoupled weight decay ->
  ``optax.scale_by_learning_rate``, with :func:`cbp_robust`'s defaults.
  Every argument is :func:`cbp`'s, but ``every``, ``max_dim`` and
  ``dimension_numbers``, which are :func:`precondition_kron`'s.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import cbp_optax as cbp
    >>> params = {'kernel': jnp.ones((3, 2)), 'bias': jnp.zeros(2)}
    >>> tx = cbp.cbp_kron(1e-2, every=1)
    >>> state = tx.init(params)
    >>> updates, state = tx.update(params, state, params)
    >>> print(updates['kernel'].round(3)[0])
    [-0.01 -0.01]

  References:
    Layerwise Conditioned Backpropagation, Algorithm 1, Lemma 1 and §8.2.
  """
  _checks.check(_CBP_KRON, learning_rate=learning_rate, b1=b1, b2=b2,
      damping=damping, decay=decay, min_scale=min_scale, max_scale=max_scale,
      every=every, max_dim=max_dim, dimension_numbers=dimension_numbers,
      weight_decay=weight_decay, mask=mask, block_fn=block_fn, stacked=stacked,
      stats_dtype=stats_dtype, zero_moment=zero_moment, update_clip=update_clip)
  m3 = precondition_kron_lib.precondition_kron(
      b1, b2, damping, every=every, max_dim=max_dim,
      dimension_numbers=dimension_numbers, stats_dtype=stats_dtype,
      zero_moment=zero_moment)
  return _finish(m3, decay=decay, min_scale=min_scale, max_scale=max_scale,
                 block_fn=block_fn, stacked=stacked, stats_dtype=stats_dtype,
                 update_clip=update_clip, weight_decay=weight_decay, mask=mask,
                 learning_rate=learning_rate)
