"""The recommended recipe: schedule-free CBP M3 on a centered model.

References:
  Layerwise Conditioned Backpropagation: A Curvature-Aware
  Reparameterization of the Backward Pass with Convergence Guarantees,
  §4.2, eqs. (8)-(10) (the centering) and §4.4, eqs. (11)-(12) (the
  preconditioner).
"""

from typing import Any, Callable, Optional, Union

import jax.numpy as jnp
import optax

from cbp_optax import _checks
from cbp_optax import _precondition as precondition_lib
from cbp_optax import _weight_decay as weight_decay_lib

# cbp_robust's M3 rules: Adam's epsilon as the damping, the current gradient
# where the lagged second moment is still zero, and each coordinate of the
# preconditioned gradient clipped to [-3, 3].
_B2 = 0.999
_DAMPING = 1e-8
_ZERO_MOMENT = 'normalized'
_CLIP = 3.0


_SPEC = _checks.Spec('cbp.recommended', dict(
    learning_rate=_checks.nonnegative(schedule=True),
    warmup_steps=_checks.Count(0, optional=True),
    b1=_checks.Interval(0.0, 1.0, closed='neither'),
    weight_decay=_checks.nonnegative(optional=True),
    mask=weight_decay_lib.Mask(), state_dtype=_checks.FloatDtype()),
    leading=('learning_rate',),
    relations=(weight_decay_lib.MASK_NEEDS_DECAY, _checks.Relation(
        lambda v: not (callable(v['learning_rate']) and v['warmup_steps']),
        'warmup_steps={warmup_steps} with a learning-rate schedule; put the '
        'warm-up in the schedule, or pass the peak rate as a number.')))


def recommended(
    learning_rate: optax.ScalarOrSchedule,
    *,
    warmup_steps: Optional[int] = None,
    b1: float = 0.9,
    weight_decay: Optional[float] = 0.01,
    mask: Optional[Union[Any, Callable[[optax.Params], Any]]] = None,
    state_dtype: Any = None,
) -> optax.GradientTransformation:
  r"""The recommended recipe's optimizer: schedule-free CBP M3.

  The model side is M2 (eqs. 8-10): ``cbp_optax.nnx.center(model)`` or
  ``cbp_optax.linen.center(module)`` with the fused steps' transport (a
  model with BatchNorm is left plain). The optimizer is
  ``optax.contrib.schedule_free`` (weight averaging in place of a decay
  schedule, ``weight_lr_power=2``) around :func:`precondition` with
  :func:`cbp_robust`'s rules and no momentum of its own:

  * the direction :math:`P_t g_t`, :math:`P_t = (\sqrt{\hat v_{t-1}} +
    \zeta)^{-1}` (eqs. 11-12) with the lagged second moment, ``b2=0.999``,
    :math:`\zeta = 10^{-8}`, and the current :math:`g_t^2` where the stored
    moment is still zero (``zero_moment='normalized'``);
  * each coordinate clipped to :math:`[-3, 3]` (``optax.clip(3.0)``);
  * decoupled weight decay on the matrices, times the rate;
  * the rate: a linear warm-up over ``warmup_steps`` to ``learning_rate``,
    then constant. Schedule-free needs no decay.

  Evaluate at the schedule-free evaluation point:
  ``cbp_optax.nnx.eval_model(model, optimizer)``,
  ``cbp_optax.linen.eval_params(params, opt_state)`` or
  ``optax.contrib.schedule_free_eval_params``. A tuned AdamW learning rate is
  the place to start.

  How it compares with AdamW, NAdamW, schedule-free AdamW and Muon, plain
  and centered, with intervals and paired tests: the docs page "Workloads"
  (``docs/reproduction/workloads.md``).

  Args:
    learning_rate: the peak rate :math:`\eta \ge 0`, a float or an optax
      schedule (then it is used as given, with no ``warmup_steps``).
    warmup_steps: linear warm-up steps from 0 to ``learning_rate``, an int
      :math:`\ge 0` (a few percent of training is usual); None or 0: none.
      Under ``optax.inject_hyperparams`` name it in ``static_args`` (there a
      scheduled ``learning_rate`` arrives as a number, so a warm-up on top
      of a schedule cannot be refused: put it in the schedule instead). As
      in ``optax.contrib.schedule_free_adamw``, the first step's rate is 0.
    b1: schedule-free's interpolation :math:`\beta_1` in (0, 1); to
      schedule it, ``optax.inject_hyperparams(cbp.recommended)(...,
      b1=schedule)`` (the state keeps the one of the latest update, which
      the evaluation point uses).
    weight_decay: decoupled weight decay :math:`\ge 0`; None: none (as in
      :func:`cbp`).
    mask: which leaves ``weight_decay`` applies to (a tree of bools or a
      function of the parameters), as ``optax.add_decayed_weights``; only
      with ``weight_decay``. None: every leaf of rank >= 2 but those named
      ``bias``, ``scale`` or ``embedding`` (the matrices of any pytree; not
      vectors, stacked biases and norm scales, or embedding tables).
    state_dtype: the dtype of schedule-free's parameter copy; None: the
      parameters'. Pass ``jnp.float32`` for a 16-bit model (and name it in
      ``static_args`` under ``optax.inject_hyperparams``).

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Raises:
    TypeError: a learning rate that is neither a number nor a schedule, a
      ``state_dtype`` that is not a real floating dtype, or another argument
      of the wrong type.
    ValueError: a negative learning rate, weight decay or warm-up, a ``b1``
      outside (0, 1), warm-up steps with a schedule, or a ``mask`` without
      ``weight_decay``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import cbp_optax as cbp
    >>> model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.relu,
    ...                        nnx.Linear(8, 2, rngs=nnx.Rngs(1)))
    >>> cbp.nnx.center(model).centered
    ['layers/0', 'layers/2']
    >>> optimizer = cbp.nnx.Optimizer(
    ...     model, cbp.recommended(1e-3, warmup_steps=100))
    >>> step = cbp.nnx.train_step(lambda m, x: jnp.mean(m(x) ** 2))
    >>> bool(step(model, optimizer, jnp.ones((3, 4))).skipped)
    False
    >>> evaluated = cbp.nnx.eval_model(model, optimizer)

  References:
    Layerwise Conditioned Backpropagation: A Curvature-Aware
    Reparameterization of the Backward Pass with Convergence Guarantees,
    §4.2, eqs. (8)-(10), and §4.4, eqs. (11)-(12).
  """
  _checks.check(_SPEC, learning_rate=learning_rate, warmup_steps=warmup_steps,
                b1=b1, weight_decay=weight_decay, mask=mask,
                state_dtype=state_dtype)
  rate = learning_rate
  if warmup_steps and not callable(learning_rate):
    rate = optax.warmup_constant_schedule(0.0, learning_rate, warmup_steps)
  base = optax.chain(
      precondition_lib.precondition(b1=0.0, b2=_B2, damping=_DAMPING,
                                    zero_moment=_ZERO_MOMENT),
      optax.clip(_CLIP),
      *weight_decay_lib.decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(rate),
  )
  free = optax.contrib.schedule_free(base, learning_rate=rate, b1=b1,
                                     state_dtype=state_dtype)

  def update_fn(updates, state, params=None, **extra_args):
    updates, state = free.update(updates, state, params, **extra_args)
    # The state's b1 is the one this update used, so that the evaluation
    # point (y - (1 - b1) z) / b1 is the x of this update also when
    # optax.inject_hyperparams schedules b1 (schedule_free keeps init's).
    return updates, state._replace(b1=jnp.asarray(b1, state.b1.dtype))

  return optax.GradientTransformationExtraArgs(free.init, update_fn)
