"""The fused Linen step: Algorithm 1 as one compiled iteration."""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import flax
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

from cbp_optax import _checks
from cbp_optax import _opt_state
from cbp_optax import _step
from cbp_optax._equalize import check_recorded_bounds
from cbp_optax._step import StepOutput
from cbp_optax.linen._transport import check_opt_state
from cbp_optax.linen._transport import like
from cbp_optax.linen._transport import transport_collections
from cbp_optax.linen._wrapper import COLLECTION
from cbp_optax.linen._wrapper import COUNT


class TrainState(train_state.TrainState):
  """``flax.training.train_state.TrainState`` with the model's other state.

  ``centering`` is ``variables['centering']``, ``model_state`` the other updated
  collections (``batch_stats``); ``skipped_steps`` counts non-finite batches.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import cbp_optax as cbp
    >>> state = cbp.linen.TrainState.create(
    ...     apply_fn=None, params={}, tx=optax.sgd(0.1))
    >>> int(state.step), int(state.skipped_steps), state.model_state
    (0, 0, {})
  """

  centering: Any = flax.struct.field(default_factory=dict)
  model_state: Any = flax.struct.field(default_factory=dict)
  skipped_steps: jax.Array = flax.struct.field(
      default_factory=lambda: jnp.zeros((), jnp.int32))


def _old_counts(new: Any, old: Any) -> Any:
  """``new`` centering entries with ``old``'s counts (the transport's zeros)."""
  if not isinstance(new, Mapping):
    return new
  return {k: old[k] if k == COUNT and k in old else _old_counts(v, old.get(k))
          for k, v in new.items()} if isinstance(old, Mapping) else new


def _transport_unless_skipped(state: TrainState, skipped: jax.Array,
                              mean_decay: Any) -> TrainState:
  """The transport (eq. 10) of an unskipped step, after the skip select."""
  if not state.centering:
    return state

  def transport_step(state):
    params, centering, opt_state = transport_collections(
        state.params, state.centering, mean_decay, state.opt_state,
        recorded_only=False)
    return state.replace(params=params, centering=centering,
                         opt_state=opt_state)

  return _step.select(jnp.logical_not(skipped), transport_step,
                      lambda state: state, state)


def train_step(loss_fn: Callable[..., Any], *, mean_decay: Any = 0.99,
               donate: bool = True
               ) -> Callable[..., tuple[TrainState, StepOutput]]:
  """One jit-compiled CBP iteration for a Linen model (Algorithm 1, 1-11).

  ``step(state, *batch)`` runs forward, backward, ``state.tx`` (any optax
  transform) and :func:`transport` of the parameters and the optimizer's
  copies in one donated ``jax.jit`` (bit for bit the same inside yours). A
  non-finite loss, gradient or statistic skips the step: only
  ``skipped_steps`` grows, and ``StepOutput.skipped`` is True.

  Args:
    loss_fn: ``loss_fn(apply, *batch)`` returning a scalar loss or ``(loss,
      aux)``; ``apply(*args, **kwargs)`` (call it once) runs ``state.apply_fn``
      on the state's variables, e.g. with ``rngs={'dropout': key}``.
    mean_decay: the EMA decay ``rho`` of the centering means, in ``[0, 1)``.
    donate: donate the input state's buffers to the step.

  Returns:
    ``step(state, *batch) -> (state, StepOutput)``.

  Raises:
    ValueError: a ``mean_decay`` outside ``[0, 1)`` (at construction).
    TypeError: a first argument that is not a :class:`TrainState`, or an
      unclassifiable optimizer state (before tracing).

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import flax.linen as nn
    >>> import cbp_optax as cbp
    >>> model = cbp.linen.center(nn.Dense(1))
    >>> x, y = jnp.ones((8, 3)), jnp.zeros((8, 1))
    >>> variables = model.init(jax.random.key(0), x)
    >>> state = cbp.linen.TrainState.create(
    ...     apply_fn=model.apply, params=variables['params'],
    ...     centering=variables['centering'], tx=cbp.cbp(1e-3))
    >>> step = cbp.linen.train_step(
    ...     lambda apply, x, y: jnp.mean((apply(x) - y) ** 2), mean_decay=0.99)
    >>> state, out = step(state, x, y)
    >>> bool(out.skipped), int(state.step)
    (False, 1)
    >>> state.centering['mean'].value  # 0.99 * 0 + 0.01 * mean(x)
    Array([0.01, 0.01, 0.01], dtype=float32)
    >>> state, out = step(state, x, jnp.full((8, 1), jnp.nan))
    >>> bool(out.skipped), int(state.step), int(state.skipped_steps)
    (True, 1, 1)

  References:
    Layerwise Conditioned Backpropagation, Algorithm 1.
  """
  _checks.check_mean_decay(mean_decay)
  _checks.check_function('loss_fn', loss_fn)
  _checks.check_bool('donate', donate)

  def step(state: TrainState, *batch):
    def loss_of(params):
      mutated = []

      def apply(*args, **kwargs):
        if mutated:
          raise ValueError('train_step: loss_fn called apply twice; one step '
                           'records from one forward pass (concatenate the '
                           'inputs).')
        variables = {'params': params, COLLECTION: state.centering,
                     **state.model_state}
        mutable = [COLLECTION, *state.model_state]
        out, changed = state.apply_fn(variables, *args, mutable=mutable,
                                      **kwargs)
        extra = sorted(set(changed) - set(mutable)) or (
            [COLLECTION] if changed.get(COLLECTION) and not state.centering
            else [])
        if extra:
          raise ValueError(
              f'train_step: the model creates collections {extra} that the '
              'TrainState lacks: pass them to TrainState.create (model_state='
              ', or centering=variables["centering"]).')
        mutated.append(changed)
        return out

      loss, aux = _step.split_loss(loss_fn(apply, *batch))
      _step.check_scalar_loss(loss)
      changed = mutated[0] if mutated else {}
      centering = like(state.centering, _old_counts(
          flax.core.unfreeze(changed.get(COLLECTION, state.centering)),
          flax.core.unfreeze(state.centering)))
      model_state = like(state.model_state, {
          k: changed.get(k, v) for k, v in state.model_state.items()})
      return loss, (aux, (centering, model_state))

    def apply_step(state, grads, changed):
      (centering, model_state), loss = changed
      update = functools.partial(state.tx.update, grads, state.opt_state,
                                 state.params)
      updates, opt_state = _step.update_with_loss(update, state.tx, loss)
      params = optax.apply_updates(state.params, updates)
      return state.replace(step=state.step + 1, params=params,
                           opt_state=opt_state, centering=centering,
                           model_state=model_state)

    def skip_step(state, grads, changed):
      del grads, changed
      return state.replace(skipped_steps=state.skipped_steps + 1)

    state, out = _step.conditioned_update(
        loss_of, state.params, apply_step, skip_step, _step.select, state,
        grads_finite=_step.gradients_finite(
            state.opt_state, lambda applied: applied.opt_state))
    return _transport_unless_skipped(state, out.skipped, mean_decay), out

  jitted = _step.jit_step(step, donate_argnums=(0,) if donate else ())
  classified = _opt_state.CheckCache()

  def train(*args):
    if not args or not isinstance(args[0], TrainState):
      got = f'a {type(args[0]).__name__}' if args else 'no argument'
      raise TypeError('train_step: step(state, *batch) takes a '
                      f'cbp_optax.linen.TrainState first, got {got}.')
    state = args[0]

    def classify():
      _opt_state.check_fusable(state.opt_state, 'train_step')
      check_recorded_bounds(state.tx, state.opt_state, state.params)
      if state.centering:
        check_opt_state(state.params, state.centering, state.opt_state)

    # Once per tx (again while tracing, for any other state).
    classified.check(state.tx, (state.apply_fn, bool(state.centering)),
                     classify)
    if donate:
      args = (_step.unaliased(state),) + args[1:]
    return jitted(*args)

  train.lower = jitted.lower
  return train
