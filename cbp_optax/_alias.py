"""``cbp()``: the optimizer side of Conditioned Backpropagation as one optax chain.

References:
  Layerwise Conditioned Backpropagation: A Curvature-Aware
  Reparameterization of the Backward Pass with Convergence Guarantees,
  §4.4, eq. (12), and Algorithm 1.
"""

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


def _narrow_in_float32(
    inner: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
  """Runs ``inner`` on float32 copies of float16 gradients.

  The update comes back in each gradient's dtype (optax's dtype contract, so
  ``lax.cond``, ``apply_if_finite`` and ``MultiSteps`` work), cast only after
  the learning rate, where it is small; a value still beyond float16's range
  saturates (``saturating_cast`` in ``_precondition``). Trees without
  float16 leaves go through ``inner`` untouched: the same computation, bit
  for bit, as the bare chain. The state is ``inner``'s.
  """
  inner = optax.with_extra_args_support(inner)

  def update_fn(updates, state, params=None, **extra_args):
    dtypes = [jnp.result_type(g) for g in jax.tree.leaves(updates)]
    if not any(precondition_lib.is_narrow(d) for d in dtypes):
      return inner.update(updates, state, params, **extra_args)
    wide = jax.tree.map(
        lambda g: jnp.asarray(g, jnp.float32)
        if precondition_lib.is_narrow(jnp.result_type(g)) else g,
        updates,
    )
    new_updates, new_state = inner.update(wide, state, params, **extra_args)
    leaves, treedef = jax.tree.flatten(new_updates)
    return treedef.unflatten([
        precondition_lib.saturating_cast(u, d) if precondition_lib.is_narrow(d)
        else u for u, d in zip(leaves, dtypes)
    ]), new_state

  return optax.GradientTransformationExtraArgs(inner.init, update_fn)


# Hyperparameters that take a number and no schedule (schedule them with
# optax.inject_hyperparams).
_NUMBERS = ('b1', 'b2', 'damping', 'decay', 'min_scale', 'max_scale',
            'update_clip')


def _check_arguments(factory: str, arguments: dict[str, Any]) -> None:
  """Refuses what ``optax.inject_hyperparams`` can make of an argument.

  It takes every callable for a schedule: a schedule of a number-only
  hyperparameter is refused naming ``inject_hyperparams(factory)``, and a
  function argument not in its ``static_args`` (``block_fn``, ``stacked``,
  ``mask``; the dtype ``jnp.float32`` is callable too) arrives here as its
  value at the step count and is refused naming ``static_args``. Range
  checks are left to the transforms of the chain.

  Args:
    factory: the factory named in the messages, ``'cbp.cbp'`` (also for
      :func:`cbp_robust`, a ``functools.partial`` of it).
    arguments: the factory's arguments by name.

  Raises:
    TypeError: a schedule where none is supported, or a function argument
      that arrived as a value.
    ValueError: a ``mask`` without ``weight_decay``.
  """
  _checks.check_nonnegative('learning_rate', arguments['learning_rate'],
                            schedule_ok=True, factory=factory)
  weight_decay = arguments['weight_decay']
  if weight_decay is not None:
    _checks.check_nonnegative('weight_decay', weight_decay, schedule_ok=True,
                              factory=factory)
  for name in _NUMBERS:
    if callable(arguments[name]):
      _checks.check_scalar(name, arguments[name], factory=factory)
  mask = arguments['mask']
  mask_error = _checks.mask_error(factory, mask)
  arrived_as_value = {
      'block_fn': _checks.is_injected_value(arguments['block_fn']),
      'stacked': _checks.is_injected_value(arguments['stacked']),
      'mask': mask_error is not None,
      'stats_dtype': _checks.is_array(arguments['stats_dtype']),
  }
  injected = {k: arguments[k] for k, hit in arrived_as_value.items() if hit}
  if len(injected) > 1:
    # One call of inject_hyperparams made all of them: one remedy for all.
    got = ', '.join(f'{k}={v!r}' for k, v in injected.items())
    raise TypeError(
        f'{factory} got {got}, where functions (and a dtype) were '
        'expected. ' + _checks.static_args_remedy(factory, injected)
    )
  _checks.check_callable('block_fn', arguments['block_fn'], factory=factory)
  _checks.check_callable('stacked', arguments['stacked'], factory=factory)
  if mask_error is not None:
    raise TypeError(mask_error)
  _checks.check_stats_dtype(arguments['stats_dtype'], factory=factory)
  if mask is not None and weight_decay is None:
    raise ValueError(
        f'{factory}: mask selects the parameters that weight_decay applies '
        'to, but weight_decay is None (no decay). Pass weight_decay=..., or '
        'leave mask out.'
    )


def cbp(
    learning_rate: optax.ScalarOrSchedule,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    damping: float = 1e-3,
    decay: float = 0.99,
    min_scale: float = 0.1,
    max_scale: float = 4.0,
    weight_decay: Optional[optax.ScalarOrSchedule] = None,
    mask: Optional[Union[Any, Callable[[optax.Params], Any]]] = None,
    block_fn: Optional[equalize_lib.BlockFn] = None,
    stacked: Optional[equalize_lib.StackedFn] = None,
    stats_dtype: Optional[Any] = None,
    zero_moment: str = 'damped',
    update_clip: Optional[float] = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Conditioned Backpropagation: M1 equalization, then M3 preconditioning.

  The chain :func:`equalize` -> :func:`precondition` -> optional
  ``optax.clip`` -> optional decoupled weight decay ->
  ``optax.scale_by_learning_rate``, i.e. the update
  :math:`-\eta P_t \hat m_t` of eq. (12) with :math:`m` built from
  :math:`S_t g_t`. Centering (M2) is a reparameterization of the model, not an
  optimizer step: wrap the layers with ``cbp_optax.nnx.Centered`` or
  ``cbp_optax.linen.Centered`` and train with the fused step of those modules.

  Choosing the learning rate: the preconditioner of step :math:`t` uses the
  second moment stored before step :math:`t` (the lag of Algorithm 1), so a
  coordinate whose gradient was exactly zero until now is scaled by up to
  :math:`1/\zeta` = 1000 (default damping) the first time it is non-zero:
  Adam's learning rate can be far too large (on Rosenbrock from the origin,
  :math:`\eta = 0.1` sends the second coordinate to about 421). Start around
  :math:`10^{-3}` to :math:`3 \cdot 10^{-3}`, or use a larger ``damping``, a
  learning-rate warm-up, or the opt-in ``zero_moment='identity'`` where
  gradients can be exactly zero at the start; see :func:`precondition`.

  Hyperparameters: every argument but ``learning_rate`` and ``weight_decay``
  must be a number; to schedule ``b1``, ``b2``, ``damping``, ``decay``,
  ``min_scale`` or ``max_scale`` use
  ``optax.inject_hyperparams(cbp.cbp)(learning_rate=..., b1=schedule)``.
  Concrete values are validated here; values traced by
  ``inject_hyperparams`` only by shape. ``inject_hyperparams`` takes every
  callable argument for a schedule and passes the factory its value at the
  step count: name ``block_fn``, ``stacked`` and ``mask`` (and a dtype such
  as ``jnp.float32``, also callable; or pass ``stats_dtype='float32'``) in
  its ``static_args`` when you pass them,
  ``optax.inject_hyperparams(cbp.cbp, static_args=('block_fn', 'mask'))``.
  Such an argument that arrives as a value is refused with that call, never
  used as it came (a mask function called with the step count returns one
  bool, which would decay every parameter or none).

  Dtypes: updates have the gradients' dtype. float16 gradients run through
  the chain as float32 (float16 cannot hold the preconditioned direction,
  up to ``max_scale / damping`` times the gradient) and only the final,
  learning-rate-scaled update is cast back to float16, saturating at its
  largest finite value.

  Args:
    learning_rate: :math:`\eta \ge 0`, a float or an optax schedule.
    b1: momentum decay :math:`\beta_1` in [0, 1) (0 gives the analysed
      momentum-free method).
    b2: second-moment decay :math:`\beta_2` in [0, 1).
    damping: preconditioner damping :math:`\zeta > 0`.
    decay: block-energy EMA decay :math:`\rho` of M1 (eq. 5), in [0, 1).
    min_scale: :math:`s_{\min} > 0` of eq. (6).
    max_scale: :math:`s_{\max} \ge s_{\min}` of eq. (6).
    weight_decay: decoupled (AdamW-style) weight decay :math:`\ge 0` (a
      number or a schedule), added to the update before the learning rate is
      applied. ``None`` (the default) leaves it out of the chain; any number,
      0 included, puts ``optax.add_decayed_weights`` in the chain, so the
      state has one structure whatever the value (as
      ``optax.inject_hyperparams`` requires).
    mask: which parameters the weight decay applies to, as in
      ``optax.add_decayed_weights``: a tree of booleans like the parameters,
      or a function of the parameters returning one; only with
      ``weight_decay``. A single bool is refused (to decay every parameter
      leave ``mask`` out; to decay none, ``weight_decay``).
    block_fn: grouping of leaves into M1 blocks, see :func:`equalize`.
    stacked: layer-stacked leaves, see :func:`equalize`.
    stats_dtype: a real floating dtype for all optimizer statistics (default
      float32, float64 for float64 parameters).
    zero_moment: what :math:`P` is where the stored second moment is
      exactly zero: ``'damped'`` (the default, Algorithm 1: :math:`P_1 = I`
      at step 1, :math:`1/\zeta` after it), ``'identity'`` (opt-in:
      :math:`P = 1`) or ``'normalized'`` (opt-in, :func:`cbp_robust`'s:
      :math:`P` from the current gradient's own moment, Adam's first step);
      see :func:`precondition`.
    update_clip: opt-in :math:`c > 0` (``None``, the default, leaves it
      out; not part of Algorithm 1): ``optax.clip(c)`` after
      :func:`precondition`, so each coordinate of :math:`P_t \hat m_t` lies
      in :math:`[-c, c]` and moves by at most :math:`c \eta`. It is
      :math:`P'_t \hat m_t` with :math:`P'_t = \min(P_t, c / |\hat m_t|)`:
      Lemma 1's upper bound holds and the lower one becomes
      :math:`\min(1/(G + \zeta), c / G)`; where it binds, the lag of
      Theorem 3 is given up on that coordinate at that step.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is the chain's:
    ``(EqualizeState, PreconditionState, [clip state,] [weight decay
    state,] learning-rate state)``.

  Raises:
    TypeError: a hyperparameter of the wrong type (bool, string, schedule
      where none is supported), a non-float ``stats_dtype``, a
      ``block_fn``, ``stacked`` or ``mask`` that is not a function (nor a
      tree, for ``mask``): the message names ``static_args`` when it looks
      like the value ``inject_hyperparams`` made of a function.
    ValueError: a non-scalar hyperparameter, a concrete value that is not
      finite or out of range, an unknown ``zero_moment``, or a ``mask``
      without ``weight_decay``.

  Examples:
    The first step applies :math:`s_l = 1` and :math:`P_1 = I`, so the update
    is :math:`-\eta g`; from the second step on, :math:`P_t` divides by the
    stored second moment (here :math:`|g| + \zeta`):

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
    >>> updates['dense']['kernel'].dtype
    dtype('float32')

    float16 gradients give float16 updates (computed in float32):

    >>> half = {'w': jnp.ones(3, jnp.float16)}
    >>> tx = cbp.cbp(1e-3)
    >>> updates, _ = tx.update(half, tx.init(half), half)
    >>> updates['w'].dtype
    dtype('float16')

  References:
    Layerwise Conditioned Backpropagation: A Curvature-Aware
    Reparameterization of the Backward Pass with Convergence Guarantees,
    §4.4 (eq. 12) and Algorithm 1.
  """
  factory = 'cbp.cbp'
  _check_arguments(factory, locals())
  precondition_lib.check_zero_moment(zero_moment, factory=factory)
  if update_clip is not None:
    _checks.check_positive('update_clip', update_clip, factory=factory)
  transforms = [
      equalize_lib.equalize(decay, min_scale, max_scale, block_fn=block_fn,
                            stacked=stacked, stats_dtype=stats_dtype),
      precondition_lib.precondition(b1, b2, damping, stats_dtype=stats_dtype,
                                    zero_moment=zero_moment),
  ]
  if update_clip is not None:
    transforms.append(optax.clip(update_clip))
  if weight_decay is not None:
    transforms.append(optax.add_decayed_weights(weight_decay, mask))
  transforms.append(optax.scale_by_learning_rate(learning_rate))
  return _narrow_in_float32(optax.chain(*transforms))


cbp_robust = functools.partial(
    cbp, damping=1e-8, min_scale=1.0, max_scale=1.0, zero_moment='normalized',
    update_clip=3.0)
cbp_robust.__doc__ = r"""CBP made robust: :func:`cbp` with four departures from Algorithm 1.

  ``functools.partial(cbp, damping=1e-8, min_scale=1.0, max_scale=1.0,
  zero_moment='normalized', update_clip=3.0)``: every argument is
  :func:`cbp`'s, and each of these four can be passed back
  (``cbp_robust(lr, damping=1e-3, zero_moment='damped', update_clip=None,
  min_scale=0.1, max_scale=4.0)`` is :func:`cbp`, Algorithm 1). Use
  :func:`cbp` to reproduce the paper. The step is Adam-sized, so start from a
  tuned AdamW learning rate. Spelled out, it is the chain

  .. code-block:: python

    optax.chain(
        cbp.equalize(min_scale=1.0, max_scale=1.0),
        cbp.precondition(damping=1e-8, zero_moment='normalized'),
        optax.clip(3.0),
        optax.scale_by_learning_rate(learning_rate),
    )

  * ``damping=1e-8``: eq. (11)'s :math:`\zeta` is Adam's :math:`\epsilon`,
    not :math:`10^{-3}` (which makes every coordinate with
    :math:`\sqrt{\hat v} \ll \zeta` take an SGD-sized step). The lag is kept.
  * ``zero_moment='normalized'``: where the stored second moment is zero
    (every coordinate at step 1), :math:`P` uses the current
    :math:`\tilde g_t^2` instead of :math:`P_1 = I`, so step 1 moves each
    coordinate by about :math:`\eta`, as Adam's does.
  * ``update_clip=3.0``: ``optax.clip(3.0)`` after :func:`precondition`
    (about Adam's largest step), since the lagged :math:`\hat v_{t-1}` does
    not bound a gradient that grows.
  * ``min_scale=max_scale=1.0``: M1's scales are one (:math:`S_t = I`); the
    block energies are still kept for :func:`cbp_optax.equalize_stats`.

  Lemma 1's bounds hold with each (the clip changes the lower one to
  :math:`\min(1/(G + \zeta), 3/G)`). Why each was chosen, with the
  measurements, is in the docs page "Why cbp_robust departs from Algorithm 1".

  Its state is ``(EqualizeState, PreconditionState, EmptyState (the clip),
  [weight decay state,] EmptyState (the learning rate))``.

  Examples:
    Step 1 moves each coordinate by about the learning rate, whatever the
    gradient's scale (Algorithm 1 moves them by ``1e-2 * g``: 300 and
    1e-6 here):

    >>> import jax.numpy as jnp
    >>> import cbp_optax as cbp
    >>> params = {'a': jnp.zeros(2), 'b': jnp.zeros(2)}
    >>> tx = cbp.cbp_robust(1e-2)
    >>> state = tx.init(params)
    >>> grads = {'a': jnp.array([3e4, -1e4]), 'b': jnp.array([1e-4, 2e-4])}
    >>> updates, state = tx.update(grads, state, params)
    >>> print(updates['a'].round(4), updates['b'].round(4))
    [-0.01  0.01] [-0.01 -0.01]

    From step 2 the preconditioner is the lagged one. A coordinate whose
    gradient grew 1000-fold would move by 1.9 under Algorithm 1 (the lagged
    :math:`\hat v_1` is 1000 times too small); the clip moves it by three
    times the learning rate:

    >>> grads = {'a': jnp.array([3e4, -1e4]), 'b': jnp.array([1e-1, 2e-4])}
    >>> updates, state = tx.update(grads, state, params)
    >>> print(updates['a'].round(4), updates['b'].round(4))
    [-0.01  0.01] [-0.03 -0.01]

    A partial keeps working under ``optax.inject_hyperparams``:

    >>> import optax
    >>> tx = optax.inject_hyperparams(cbp.cbp_robust)(1e-2)
    >>> state = tx.init(params)
    >>> float(state.hyperparams['min_scale']), float(state.hyperparams['max_scale'])
    (1.0, 1.0)

  References:
    Layerwise Conditioned Backpropagation: A Curvature-Aware
    Reparameterization of the Backward Pass with Convergence Guarantees,
    eq. (11), Lemma 1, Theorem 3 and Algorithm 1 (what this configuration
    departs from).
  """

# doctest does not look inside a functools.partial: run its examples.
__test__ = {'cbp_robust': cbp_robust.__doc__}
