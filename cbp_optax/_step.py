"""Pieces shared by the fused train steps of ``cbp_optax.nnx`` and ``.linen``."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import functools

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
      finite (under ``cbp.cbp``: a block energy M1 would store was not); the
      step then left parameters, optimizer state and centering means as they
      were (but for the skip count).

  Examples:
    A loss function returning ``(loss, aux)`` gets its ``aux`` back:

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import cbp_optax as cbp
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> optimizer = nnx.Optimizer(model, cbp.cbp(1e-3), wrt=nnx.Param)
    >>> def loss_fn(model, x):
    ...   y = model(x)
    ...   return jnp.mean(y ** 2), {'mean_output': jnp.mean(y)}
    >>> out = cbp.nnx.train_step(loss_fn)(model, optimizer, jnp.ones((4, 2)))
    >>> out._fields
    ('loss', 'aux', 'skipped')
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
      raise ValueError(
          'The loss function must return a scalar loss or a (loss, aux) pair, '
          f'got a tuple of {len(output)}.'
      )
    return output
  return output, None


def check_scalar_loss(loss: jax.Array) -> None:
  if jnp.shape(loss) != ():
    raise ValueError(
        f'The loss function must return a scalar, got shape {jnp.shape(loss)}.'
    )


def all_finite(*trees: Any) -> jax.Array:
  """True when every floating-point entry of ``trees`` is finite."""
  flags = [
      jnp.all(jnp.isfinite(x))
      for x in jax.tree.leaves(trees)
      if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
  ]
  return jnp.all(jnp.stack(flags)) if flags else jnp.array(True)


def _raw_equalize_state(opt_state: Any) -> Optional[_equalize.EqualizeState]:
  """The :class:`EqualizeState` of a transform whose first step is M1 on the
  raw gradients: ``opt_state`` itself, or the first entry of an optax chain's
  state (recursively); else None."""
  while isinstance(opt_state, tuple) and not isinstance(
      opt_state, _equalize.EqualizeState) and not hasattr(opt_state, '_fields'):
    if not opt_state:
      return None
    opt_state = opt_state[0]
  if isinstance(opt_state, _equalize.EqualizeState):
    return opt_state
  return None


def gradients_finite(
    opt_state: Any, opt_state_of: Callable[[Any], Any]
) -> Optional[Callable[[Any, Any], jax.Array]]:
  r"""``conditioned_update``'s ``grads_finite(grads, applied)`` for a state.

  ``opt_state`` is the state before the step; ``opt_state_of(applied)``
  finds the new one in what ``apply_step`` produced. For a transform whose
  first step is M1 on the raw gradients (``cbp.cbp``, ``cbp.equalize``, a
  chain beginning with it), the answer is read from the block energies
  :math:`q_l` M1 just stored (eq. 5): a non-finite gradient entry makes one
  non-finite, as does a state that was not finite to begin with (a finite
  block norm beyond the dtype's range is stored saturated, finite). For any other state this returns None, and the
  fused step checks every entry.
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
  for a transform taking extra arguments (optax's protocol): polyak_sgd,
  momo and reduce_on_plateau require the loss. Every other runs as the
  user's, without ``value=`` (``optax.contrib.sam`` refuses one, even in a
  chain)."""
  try:
    return update()
  except TypeError:
    if not isinstance(tx, optax.GradientTransformationExtraArgs):
      raise
  return update(value=loss)


def conditioned_update(
    loss_of: Callable[[Any], tuple[jax.Array, tuple[Any, Any]]],
    params: Any,
    apply_step: Callable[..., Any],
    skip_step: Callable[..., Any],
    select: Callable[..., Any],
    *operands: Any,
    grads_finite: Optional[Callable[[Any, Any], jax.Array]] = None,
) -> tuple[Any, StepOutput]:
  """The skeleton both fused steps share (Algorithm 1, steps 1-11).

  Differentiates ``loss_of(params) -> (loss, (aux, changed))``, where
  ``changed`` is the non-parameter state the forward pass wrote (recorded
  means without their counts, batch statistics), checks that the loss,
  ``changed`` and the gradients are finite (entry by entry, or through
  ``grads_finite(grads, applied)``: :func:`gradients_finite`), and keeps
  ``apply_step(*operands, grads, (changed, loss))`` (update, then
  transport; the loss for an optimizer that takes it as ``value=``) or
  ``skip_step(...)`` through ``select``: both are computed and selected
  leaf by leaf, which XLA fuses into the update, where a ``lax.cond`` would
  copy every state buffer it passes through inside an undonated outer jit.

  Returns:
    ``(select's result, StepOutput)``.
  """
  (loss, (aux, changed)), grads = jax.value_and_grad(
      loss_of, has_aux=True)(params)
  if grads_finite is None:
    # Decided before the update: the same program as a plain step.
    ok = all_finite(loss, grads, changed)
    result = select(ok, apply_step, skip_step, *operands, grads,
                    (changed, loss))
    return result, StepOutput(loss=loss, aux=aux, skipped=jnp.logical_not(ok))
  inputs_ok = all_finite(loss, changed)
  decided = []

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
  """``applied`` where ``ok`` else ``skipped``, leaf by leaf (same structure).

  A leaf that is the same array on both sides is kept as it is.
  """
  return jax.tree.map(
      lambda a, b: a if a is b else jax.lax.select(ok, a, b), applied, skipped)


def select(ok: Any, apply_step: Callable[..., Any],
           skip_step: Callable[..., Any], *operands: Any) -> Any:
  """``lax.cond(ok, apply_step, skip_step, *operands)``'s value, as a select.

  Both run and their results are selected leaf by leaf; ``ok`` is a
  boolean scalar or a function of ``apply_step``'s result returning one.
  """
  applied = apply_step(*operands)
  skipped = skip_step(*operands)
  return select_leaves(decide(ok, applied), applied, skipped)


def unaliased(tree: Any) -> Any:
  """``tree`` with every array that occurs in it twice copied, but the first.

  Donation refuses one buffer twice, and optimizers that keep a copy of the
  parameters (SAM, DoG, Prodigy, ...) often hold the very arrays at init.
  """
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
  """True when called while an outer ``jit`` (or another transform) traces.

  A tracer leaf says so; so does the current trace, which also covers an
  outer ``jit`` whose arguments are all closed over: JAX's opaque trace state
  (the one Flax NNX keys its variables on) differs from the eager one.
  """
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree)):
    return True
  return _trace_state() != _EAGER_STATE


def _trace_state() -> Any:
  return jax.extend.core.get_opaque_trace_state(convention='cbp_optax')


_EAGER_STATE = _trace_state()


def jit_step(
    fun: Callable[..., Any], *, donate_argnums: tuple[int, ...] = (),
    static_argnums: tuple[int, ...] = (),
) -> Callable[..., Any]:
  """``fun`` under ``jax.jit``, called directly or inside the user's own jit.

  Called directly, ``fun`` runs donated with :func:`compiler_options`;
  inside an outer ``jit`` it is traced into the outer program, whose own
  settings apply (XLA takes options and donation only at the top). Both give
  the same numbers, bit for bit.

  Returns:
    ``call(*args)``, with ``call.lower`` lowering the direct executable.
  """
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
  """Per-executable XLA options for the fused steps.

  On CPU, region analysis lets XLA's copy insertion see that M3 reads
  ``v_{t-1}`` before ``v_t`` overwrites its donated buffer, and drop the
  copies; buffer assignment only, results bitwise identical. Pass them to
  your own top-level ``jax.jit`` too where the state is donated.

  Returns:
    ``{'xla_cpu_copy_insertion_use_region_analysis': True}`` on CPU, else
    None.

  Examples:
    >>> import jax
    >>> from cbp_optax import _step
    >>> options = _step.compiler_options()
    >>> options == ({'xla_cpu_copy_insertion_use_region_analysis': True}
    ...             if jax.default_backend() == 'cpu' else None)
    True
  """
  if jax.default_backend() == 'cpu':
    return {'xla_cpu_copy_insertion_use_region_analysis': True}
  return None
