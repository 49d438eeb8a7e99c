"""The recommended recipe: schedule-free CBP M3 (eqs. 11-12) on a model
centered with M2 (eqs. 8-10)."""

from typing import Any, Callable, Optional, Union

import jax.numpy as jnp
import optax

from cbp_optax import _checks
from cbp_optax import _precondition as precondition_lib
from cbp_optax import _weight_decay as weight_decay_lib

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
    learning_rate: optax.ScalarOrSchedule, *,
    warmup_steps: Optional[int] = None, b1: float = 0.9,
    weight_decay: Optional[float] = 0.01, mask: Optional[Union[Any,
    Callable[[optax.Params], Any]]] = None, state_dtype: Any = None,
) -> optax.GradientTransformation:
  r"""The recommended recipe's optimizer: schedule-free CBP M3.

  For a model centered with M2 (§4.2, eqs. 8-10: ``cbp_optax.nnx.center`` or
  ``cbp_optax.linen.center``): ``optax.contrib.schedule_free`` around
  :func:`precondition` with :func:`cbp_robust`'s rules and no momentum, the
  direction :math:`P_t g_t` (§4.4, eqs. 11-12; ``b2=0.999``, :math:`\zeta =
  10^{-8}`, ``zero_moment='normalized'``), clipped to :math:`[-3, 3]`, with
  decoupled weight decay and a linear warm-up to a constant rate. Evaluate
  at the schedule-free point (``cbp_optax.nnx.eval_model``,
  ``cbp_optax.linen.eval_params``); start from a tuned AdamW learning rate.
  How it and its peers score on the suite's workloads:
  ``docs/reproduction/workloads.md``.

  Args:
    learning_rate: the peak rate :math:`\eta \ge 0`, a float or an optax
      schedule (used as given).
    warmup_steps: linear warm-up steps from 0 to ``learning_rate`` (an int
      :math:`\ge 0`; None or 0: none), not with a schedule. Under
      ``optax.inject_hyperparams`` name it in ``static_args``.
    b1: schedule-free's interpolation :math:`\beta_1` in (0, 1).
    weight_decay: decoupled weight decay :math:`\ge 0`; None: none.
    mask: which leaves ``weight_decay`` applies to, as in :func:`cbp`.
    state_dtype: the dtype of schedule-free's parameter copy; None: the
      parameters'. Pass ``jnp.float32`` for a 16-bit model.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Raises:
    TypeError: an argument of the wrong type, or a ``state_dtype`` that is
      not a real floating dtype.
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
    Layerwise Conditioned Backpropagation, §4.2 (eqs. 8-10), §4.4 (eqs. 11-12).
  """
  _checks.check(_SPEC, learning_rate=learning_rate, warmup_steps=warmup_steps,
      b1=b1, weight_decay=weight_decay, mask=mask, state_dtype=state_dtype)
  rate = learning_rate
  if warmup_steps and not callable(learning_rate):
    rate = optax.warmup_constant_schedule(0.0, learning_rate, warmup_steps)
  base = optax.chain(  # cbp_robust's M3 rules
      precondition_lib.precondition(b1=0.0, b2=0.999, damping=1e-8,
                                    zero_moment='normalized'),
      optax.clip(3.0), *weight_decay_lib.decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(rate))
  free = optax.contrib.schedule_free(base, learning_rate=rate, b1=b1,
                                     state_dtype=state_dtype)

  def update_fn(updates, state, params=None, **extra_args):
    updates, state = free.update(updates, state, params, **extra_args)
    # The b1 this update used, for the evaluation point (y - (1 - b1) z) /
    # b1 when inject_hyperparams schedules it (schedule_free keeps init's).
    return updates, state._replace(b1=jnp.asarray(b1, state.b1.dtype))

  return optax.GradientTransformationExtraArgs(free.init, update_fn)
