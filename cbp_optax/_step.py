"""Pieces shared by the fused train steps of ``cbp_optax.nnx`` and ``.linen``."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import functools

import jax
import jax.extend.core
import jax.numpy as jnp

from cbp_optax import _equalize


class StepOutput(NamedTuple):
  """What a fused CBP train step reports.

  Attributes:
    loss: the loss of the batch, computed before the update.
    aux: whatever else the loss function returned (metrics), or None.
    skipped: True when the loss, a gradient or a recorded batch mean was not
      finite (under ``cbp.cbp`` and ``cbp.cbp_robust``: when a block energy
      that M1 would store was not, which a non-finite gradient entry makes
      so, and also an overflowing block norm or a state already holding a
      non-finite energy); the step then left parameters, optimizer state and
      centering means exactly as they were (but for the skip count).

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

  ``opt_state`` is the optimizer state before the step (its structure is the
  one the step produces); ``opt_state_of(applied)`` finds the new optimizer
  state in what ``apply_step`` produced.

  For a transform whose first step is M1 on the raw gradients (``cbp.cbp``,
  ``cbp.cbp_robust``, ``cbp.equalize`` or an optax chain that begins with
  it), the answer is read from the state M1 just stored: the block energies
  :math:`q_l = \rho q_l + (1 - \rho) \|g_l\|_F^2` (eq. 5) and the squared
  norm of the leaves in no block. One non-finite gradient entry makes one of
  them non-finite, so the pass over every gradient entry is not needed. The
  check is on the state the step would store, so it also refuses:

  * a block energy that overflows its float32 (or wider) statistics, from
    entries beyond about 1.8e19: stored, it would make every later scale
    NaN (eq. 6);
  * a state whose energies were not finite to begin with (written by an
    unchecked loop or restored from a broken checkpoint): every step is
    skipped, and counted, until a good state is restored.

  For any other state this returns None, and the fused step checks every
  entry.
  """
  if _raw_equalize_state(opt_state) is None:
    return None

  def check(grads, applied):
    del grads  # witnessed by the state M1 stored
    state = _raw_equalize_state(opt_state_of(applied))
    stored = jnp.concatenate([state.energy, state.unblocked[None]])
    return jnp.all(jnp.isfinite(stored))

  return check


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
  means, batch statistics), checks that the loss, ``changed`` and the
  gradients are finite (the gradients entry by entry, or through
  ``grads_finite(grads, applied)`` when given, which may read the state
  ``apply_step`` produced: see :func:`gradients_finite`), and keeps
  ``apply_step(*operands, grads, changed)`` (update, then transport) or
  ``skip_step(...)`` through ``select`` (:func:`select` or its NNX twin):
  both are computed and every state leaf is selected elementwise, which XLA
  fuses into the elementwise update that produces it. ``changed`` leaves
  out the centered layers' counts of pooled positions: the step's transport
  sets them to zero, and a count read here would keep the
  untransported-model check alive in the step (see
  :mod:`cbp_optax._untransported`). A ``lax.cond`` instead
  makes XLA copy the state it passes through: inside an outer, undonated
  ``jit`` (a user's ``nnx.jit`` step) every parameter-sized buffer was copied
  each step (1.41x AdamW's step against 1.17x with the select, NNX MLP of
  width 1024), and small ones even when donated.

  Returns:
    ``(select's result, StepOutput)``.
  """
  (loss, (aux, changed)), grads = jax.value_and_grad(
      loss_of, has_aux=True)(params)
  if grads_finite is None:
    # Decided before the update, as always: the same program, bit for bit
    # (deciding after it moved a float32 rounding of AdamW's fused update).
    ok = all_finite(loss, grads, changed)
    result = select(ok, apply_step, skip_step, *operands, grads, changed)
    return result, StepOutput(loss=loss, aux=aux, skipped=jnp.logical_not(ok))
  inputs_ok = all_finite(loss, changed)
  decided = []

  def ok_of(applied):
    decided.append(jnp.logical_and(inputs_ok, grads_finite(grads, applied)))
    return decided[-1]

  result = select(ok_of, apply_step, skip_step, *operands, grads, changed)
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

  Both functions run and their results are selected leaf by leaf (see
  :func:`conditioned_update` for why); they must return the same structure.
  ``ok`` is a boolean scalar, or a function of ``apply_step``'s result
  that returns one.
  """
  applied = apply_step(*operands)
  skipped = skip_step(*operands)
  return select_leaves(decide(ok, applied), applied, skipped)


def unaliased(tree: Any) -> Any:
  """``tree`` with every array that occurs in it twice copied, but the first.

  Donation refuses one buffer twice, and optimizers that keep a copy of the
  parameters often keep the very arrays at ``init`` (SAM's cache, the initial
  point of DoG, Prodigy, MADGRAD, Mechanic, COCOB): the first fused step
  would fail. Without repeats (every step after the first) ``tree`` is
  returned as it is.
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

  A leaf of ``tree`` that is a tracer says so; so does the current trace
  (``jax.extend.core.find_top_trace``), which also covers an outer ``jit``
  whose arguments are all closed over: outside every transform it is JAX's
  eager ``EvalTrace``.
  """
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree)):
    return True
  return type(jax.extend.core.find_top_trace(())).__name__ != 'EvalTrace'


def jit_step(
    fun: Callable[..., Any], *, donate_argnums: tuple[int, ...] = (),
    static_argnums: tuple[int, ...] = (),
) -> Callable[..., Any]:
  """``fun`` under ``jax.jit``, called directly or inside the user's own jit.

  Called directly, ``fun`` runs as one executable with ``donate_argnums``
  donated and, on CPU, :func:`compiler_options`; ``jax.jit``'s cache
  compiles it once per argument signature. Called while an outer ``jit``
  traces (a user's own ``nnx.jit`` / ``jax.jit`` train step), the same
  function is traced into the outer program instead: XLA accepts compiler
  options and donation only on the outermost executable, and the outer
  program's own settings apply. Region analysis changes buffer assignment
  only, so both give the same numbers, bit for bit.

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

  On CPU, XLA's copy insertion by default orders instructions by data
  dependence only, and copies every donated buffer that is read after an
  in-place write could have clobbered it: the lagged second moment of M3
  (``P_t`` reads ``v_{t-1}`` while ``v_t`` goes into the same buffer) and the
  branches of the skip conditional. Region analysis proves the read comes
  first and drops the copies. It changes buffer assignment only: results are
  bitwise identical (tested).

  The fused steps apply them when called directly. Pass them to your own
  top-level ``jax.jit`` too, where the state is donated
  (``jax.jit(step, donate_argnums=0, compiler_options=...)``).

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
