"""Pieces shared by the fused train steps of ``cbp_optax.nnx`` and ``.linen``."""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.extend.core
import jax.numpy as jnp
import optax

from cbp_optax import _equalize


class StepOutput(NamedTuple):
  """What a fused CBP train step reports.

  Attributes:
    loss: the loss of the batch, computed before the update.
    aux: whatever else the loss function returned (metrics), or None.
    skipped: True when the loss, a gradient or a recorded batch mean was not
      finite; the step then left parameters, optimizer state and centering
      means as they were (but for the skip count).

  Examples:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import cbp_optax as cbp
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> optimizer = nnx.Optimizer(model, cbp.cbp(1e-3), wrt=nnx.Param)
    >>> def loss_fn(model, x):
    ...   y = model(x)
    ...   return jnp.mean(y ** 2), {'mean_output': jnp.mean(y)}
    >>> out = cbp.nnx.train_step(loss_fn)(model, optimizer, jnp.ones((4, 2)))
    >>> sorted(out.aux), out.skipped.dtype
    (['mean_output'], dtype('bool'))
  """

  loss: jax.Array
  aux: Any
  skipped: jax.Array


def split_loss(output: Any) -> tuple[jax.Array, Any]:
  """A loss function may return ``loss`` or ``(loss, aux)``."""
  if isinstance(output, tuple):
    if len(output) != 2:
      raise ValueError('The loss function must return a scalar loss or a '
                       f'(loss, aux) pair, got a tuple of {len(output)}.')
    return output
  return output, None


def check_scalar_loss(loss: jax.Array) -> None:
  if jnp.shape(loss) != ():
    raise ValueError('The loss function must return a scalar, got shape '
                     f'{jnp.shape(loss)}.')


def all_finite(*trees: Any) -> jax.Array:
  """True when every floating-point entry of ``trees`` is finite."""
  flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(trees)
           if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  return jnp.all(jnp.stack(flags)) if flags else jnp.array(True)


def _raw_equalize_state(opt_state: Any) -> Optional[_equalize.EqualizeState]:
  """The :class:`EqualizeState` of a transform whose first step is M1 on the
  raw gradients: ``opt_state`` itself, or the first entry of an optax chain's
  state (recursively); else None."""
  while (isinstance(opt_state, tuple) and opt_state
         and not hasattr(opt_state, '_fields')):  # a chain's state
    opt_state = opt_state[0]
  return opt_state if isinstance(opt_state, _equalize.EqualizeState) else None


def gradients_finite(opt_state: Any, opt_state_of: Callable[[Any], Any]
                     ) -> Optional[Callable[[Any, Any], jax.Array]]:
  r"""``conditioned_update``'s ``grads_finite(grads, applied)`` for a state.

  For a transform whose first step is M1 on the raw gradients, the answer
  is read from the energies :math:`q_l` (eq. 5) M1 just stored, found by
  ``opt_state_of(applied)``: a non-finite gradient makes one non-finite.
  For any other state, None (the fused step checks every entry).
  """
  if _raw_equalize_state(opt_state) is None:
    return None

  def check(grads, applied):
    del grads  # witnessed by the state M1 stored
    state = _raw_equalize_state(opt_state_of(applied))
    stored = jnp.concatenate([state.energy, state.unblocked[None]])
    return jnp.all(jnp.isfinite(stored))

  return check


def update_with_loss(update: Callable[..., Any],
                     tx: optax.GradientTransformation, loss: jax.Array) -> Any:
  """``update()``, or ``update(value=loss)`` where that raises a TypeError
  for a transform taking extra arguments (polyak_sgd, momo and
  reduce_on_plateau require the loss; ``optax.contrib.sam`` refuses it)."""
  try:
    return update()
  except TypeError:
    if not isinstance(tx, optax.GradientTransformationExtraArgs):
      raise
  return update(value=loss)


def conditioned_update(
    loss_of: Callable[[Any], tuple[jax.Array, tuple[Any, Any]]], params: Any,
    apply_step: Callable[..., Any], skip_step: Callable[..., Any],
    select: Callable[..., Any], *operands: Any,
    grads_finite: Optional[Callable[[Any, Any], jax.Array]] = None,
) -> tuple[Any, StepOutput]:
  """The skeleton both fused steps share (Algorithm 1, steps 1-11).

  Differentiates ``loss_of(params) -> (loss, (aux, changed))`` (``changed``:
  the non-parameter state the forward pass wrote), checks that the loss,
  ``changed`` and the gradients are finite (entry by entry, or by
  ``grads_finite``), and keeps ``apply_step(*operands, grads, (changed,
  loss))`` or ``skip_step(...)`` through ``select`` (leaf by leaf, which XLA
  fuses, where a ``lax.cond`` would copy every state buffer).

  Returns:
    ``(select's result, StepOutput)``.
  """
  (loss, (aux, changed)), grads = jax.value_and_grad(
      loss_of, has_aux=True)(params)
  if grads_finite is None:
    # Decided before the update: the same program as a plain step.
    decided = [all_finite(loss, grads, changed)]
    ok_of = decided[0]
  else:
    inputs_ok, decided = all_finite(loss, changed), []

    def ok_of(applied):
      decided.append(jnp.logical_and(inputs_ok, grads_finite(grads, applied)))
      return decided[-1]

  result = select(ok_of, apply_step, skip_step, *operands, grads,
                  (changed, loss))
  ok, = decided
  return result, StepOutput(loss=loss, aux=aux, skipped=jnp.logical_not(ok))


def decide(ok: Any, applied: Any) -> jax.Array:
  """``ok``, or ``ok(applied)`` when the decision reads the applied state."""
  return ok(applied) if callable(ok) else ok


def select_leaves(ok: jax.Array, applied: Any, skipped: Any) -> Any:
  """``applied`` where ``ok`` else ``skipped``, leaf by leaf."""
  return jax.tree.map(
      lambda a, b: a if a is b else jax.lax.select(ok, a, b), applied, skipped)


def select(ok: Any, apply_step: Callable[..., Any],
           skip_step: Callable[..., Any], *operands: Any) -> Any:
  """``lax.cond(ok, apply_step, skip_step, *operands)``'s value, selected
  leaf by leaf; ``ok`` may be a function of ``apply_step``'s result."""
  applied = apply_step(*operands)
  return select_leaves(decide(ok, applied), applied, skip_step(*operands))


def unaliased(tree: Any) -> Any:
  """``tree`` with every repeated array copied but the first (donation
  refuses one buffer twice; SAM, DoG, Prodigy hold the parameters at init)."""
  leaves = jax.tree.leaves(tree)
  if len({id(x) for x in leaves}) == len(leaves):
    return tree
  seen = set()

  def fresh(x):
    if isinstance(x, jax.Array):
      if id(x) in seen:
        return jnp.copy(x)
      seen.add(id(x))
    return x

  return jax.tree.map(fresh, tree)


def staged(tree: Any) -> bool:
  """True when called while an outer ``jit`` (or another transform) traces:
  a tracer leaf, or JAX's opaque trace state differs from the eager one."""
  return (any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree))
          or _trace_state() != _EAGER_STATE)


def _trace_state() -> Any:
  return jax.extend.core.get_opaque_trace_state(convention='cbp_optax')


_EAGER_STATE = _trace_state()


def jit_step(fun: Callable[..., Any], *, donate_argnums: tuple[int, ...] = (),
             static_argnums: tuple[int, ...] = ()) -> Callable[..., Any]:
  """``fun`` under ``jax.jit``: donated with :func:`compiler_options` when
  called directly, traced into the outer program inside a ``jit`` (same
  numbers). ``call.lower`` lowers the direct executable."""
  direct = jax.jit(fun, donate_argnums=donate_argnums,
                   static_argnums=static_argnums,
                   compiler_options=compiler_options())
  nested = jax.jit(fun, static_argnums=static_argnums)

  @functools.wraps(fun)
  def call(*args):
    return (nested if staged(args) else direct)(*args)

  call.lower = direct.lower
  return call


def compiler_options() -> Optional[dict[str, Any]]:
  """Per-executable XLA options for the fused steps, or None.

  On CPU, region analysis lets copy insertion see that M3 reads ``v_{t-1}``
  before ``v_t`` overwrites its donated buffer (results bitwise identical).
  """
  return ({'xla_cpu_copy_insertion_use_region_analysis': True}
          if jax.default_backend() == 'cpu' else None)
