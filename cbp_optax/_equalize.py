"""M1: layerwise gradient-norm equalization (§4.1, eqs. 5-7; Algorithm 1)."""

from __future__ import annotations

import functools
import numbers
from typing import Any, NamedTuple, Optional, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from cbp_optax import _checks
from cbp_optax._energies import new_energies
from cbp_optax.blocks import block_layout
from cbp_optax.blocks import BlockFn
from cbp_optax.blocks import BlockLayout
from cbp_optax.blocks import StackedFn


class EqualizeState(NamedTuple):
  r"""State of :func:`equalize`.

  One flat vector and four scalars whatever the parameter tree, so it
  survives ``optax.masked``, ``MultiSteps``, ``apply_if_finite`` and sharding.

  Attributes:
    count: the number of updates taken, an int32 scalar.
    energy: the EMAs :math:`q_l` of eq. (5), one per block, in the order of
      :func:`cbp_optax.block_names`; zeros at init.
    min_scale: :math:`s_{\min}` of eq. (6) of the latest update (at init,
      the transform's).
    max_scale: :math:`s_{\max}` of eq. (6), likewise.
    unblocked: :math:`\sum_k \|g_k\|_F^2` over the leaves in no block at
      the latest update; with ``energy``, finite for finite gradients.
  """

  count: chex.Array
  energy: chex.Array
  min_scale: chex.Array
  max_scale: chex.Array
  unblocked: chex.Array


class BlockStats(NamedTuple):
  """Energy and scale of one block, as read by :func:`equalize_stats`.

  Attributes:
    energy: :math:`q_l`, eq. (5).
    scale: the :math:`s_l` of eq. (6) that the next step applies.
  """

  energy: chex.Array
  scale: chex.Array


def stats_dtype_for(tree: Any, stats_dtype: Optional[Any] = None) -> jnp.dtype:
  """Float32 statistics, or float64 when any leaf is float64."""
  if stats_dtype is not None:
    return jnp.dtype(stats_dtype)
  return functools.reduce(jnp.promote_types, [
      d for d in map(jnp.result_type, jax.tree.leaves(tree))
      if jnp.issubdtype(d, jnp.floating)], jnp.dtype(jnp.float32))


def block_scales(energy: chex.Array, count: chex.Array, min_scale: chex.Numeric,
                 max_scale: chex.Numeric) -> chex.Array:
  """The scales ``s_l = clip(c / sqrt(q_l), s_min, s_max)`` of eq. (6) from
  stored energies; ones at the first step. A zero energy (a frozen or unused
  block) gets ``max_scale``; when every energy is zero the ratio is one. The
  scale is finite, so a zero gradient gives a zero update."""
  if energy.shape[0] == 0:
    return energy
  target = jnp.sqrt(jnp.mean(energy))
  # Finite energies near the dtype's largest value: their sum overflows, not
  # their mean, which is formed relative to the largest energy instead.
  peak = jnp.max(energy)
  relative = jnp.sqrt(peak) * jnp.sqrt(
      jnp.mean(energy / jnp.where(peak > 0, peak, jnp.ones_like(peak))))
  target = jnp.where(jnp.isinf(target) & (peak <= jnp.finfo(peak.dtype).max),
                     relative, target)
  positive = energy > 0
  safe_energy = jnp.where(positive, energy, jnp.ones_like(energy))
  ratio = jnp.where(positive, target / jnp.sqrt(safe_energy),
                    jnp.where(target > 0, jnp.inf, 1.0).astype(energy.dtype))
  low, high = (jnp.asarray(b, energy.dtype) for b in (min_scale, max_scale))
  # clip(x, a, a) = a also where the ratio is inf / inf = NaN (an infinite
  # energy); a proper interval keeps jnp.clip's NaN (Algorithm 1).
  scales = jnp.where(low == high, low, jnp.clip(ratio, low, high))
  return jnp.where(count > 0, scales, jnp.ones_like(scales))


def _group_scales(layout: BlockLayout, energy: chex.Array, count: chex.Array,
                  min_scale: chex.Numeric, max_scale: chex.Numeric
                  ) -> tuple[Optional[chex.Array], ...]:
  """:func:`block_scales`, bit for bit, as one array per group of leaves.

  For compile time: a buffer per group, from a few multi-output reductions
  (:func:`_split`), keeps same-shaped leaves' kernels identical, where a fused
  slice of the scale vector would make each distinct. Equal concrete bounds
  give one shared scale, None where it is one (leaves left unmultiplied).
  """
  if not layout.groups:
    return ()
  low = _checks.concrete_float(min_scale)
  if low is not None and low == _checks.concrete_float(max_scale):
    if low == 1.0:
      return (None,) * len(layout.groups)
    shared = jnp.where(count > 0, jnp.asarray(min_scale, energy.dtype),
                       jnp.ones((), energy.dtype))
    return tuple(shared if stack is None else jnp.broadcast_to(shared, (stack,))
                 for stack in layout.group_stacks)
  scales = block_scales(energy, count, min_scale, max_scale)
  return _split(scales, layout.group_starts, layout.group_stacks)


# Groups per _split reduction (compile time per output grows past dozens).
_SPLIT_CHUNK = 32


def _split(vector: chex.Array, starts: Sequence[int],
           stacks: Sequence[Optional[int]]) -> tuple[chex.Array, ...]:
  """``vector[start]`` (or ``vector[start:start + stack]``) for each group,
  as variadic ``lax.reduce`` calls over ``(vector, -0.0)`` pairs: ``x + (-0.0)``
  is ``x`` exactly, and a many-output reduction compiles as one kernel."""
  out: list[Optional[chex.Array]] = [None] * len(starts)
  by_stack: dict[Optional[int], list[int]] = {}
  for i, stack in enumerate(stacks):
    by_stack.setdefault(stack, []).append(i)
  minus_zero = jnp.asarray(-0.0, vector.dtype)
  pairs = jnp.stack([vector, jnp.full_like(vector, minus_zero)], axis=1)
  add = lambda xs, ys: tuple(x + y for x, y in zip(xs, ys))
  for stack, members in by_stack.items():
    for first in range(0, len(members), _SPLIT_CHUNK):
      chunk = members[first:first + _SPLIT_CHUNK]
      if stack is None:  # rows (2,) -> scalars
        operands = tuple(pairs[starts[i]] for i in chunk)
      else:  # (stack, 2) -> (stack,)
        operands = tuple(jax.lax.slice_in_dim(pairs, starts[i],
                                              starts[i] + stack) for i in chunk)
      reduced = jax.lax.reduce(operands, (minus_zero,) * len(chunk), add,
                               (operands[0].ndim - 1,))
      for i, value in zip(chunk, reduced):
        out[i] = value
  return tuple(out)


def _scale_leaves(layout: BlockLayout, leaves: Sequence[chex.Array],
                  group_scales: Sequence[Optional[chex.Array]],
                  out_dtypes: Sequence[Any], stats_dtype: Any
                  ) -> list[chex.Array]:
  scaled: list[Optional[chex.Array]] = [None] * len(leaves)
  for leaf_ids, stack, scale in zip(layout.groups, layout.group_stacks,
                                    group_scales):
    for i in leaf_ids:
      leaf = leaves[i]
      if scale is None:  # s = 1 at every step: x * 1 is x
        scaled[i] = leaf.astype(stats_dtype).astype(out_dtypes[i])
        continue
      leaf_scale = (scale if stack is None else
                    jnp.reshape(scale, (stack,) + (1,) * (leaf.ndim - 1)))
      scaled[i] = (leaf.astype(scale.dtype) * leaf_scale).astype(out_dtypes[i])
  # Leaves in no block (key None, or empty) pass through with s = 1.
  return [leaf.astype(dtype) if out is None else out
          for leaf, dtype, out in zip(leaves, out_dtypes, scaled)]


class RecordedBoundsError(ValueError):
  """A state whose recorded M1 bounds (eq. 6) are not the transform's."""


def _check_recorded_bounds(state: EqualizeState, min_scale: Any,
                           max_scale: Any) -> None:
  """Refuses a concrete state of another configuration (recorded bounds not
  the transform's numbers); array bounds (``inject_hyperparams``) pass."""
  for name, recorded, own in (('min_scale', state.min_scale, min_scale),
                              ('max_scale', state.max_scale, max_scale)):
    if (not isinstance(own, (numbers.Real, np.generic))
        or isinstance(recorded, jax.core.Tracer)):
      continue
    # NumPy: inside a trace a jnp operation would stage the concrete value.
    recorded, value = np.asarray(recorded), float(own)
    if float(recorded) != float(np.asarray(value, recorded.dtype)):
      raise RecordedBoundsError(
          f'equalize: the optimizer state records {name}='
          f'{float(recorded):g} but this transform has {name}={value:g}; '
          'restore a state into the configuration that saved it, or set the '
          'bounds with state._replace(min_scale=..., max_scale=...).')


def check_recorded_bounds(tx: optax.GradientTransformation, opt_state: Any,
                          params: Any) -> None:
  """Traces ``tx.update`` abstractly with each concrete
  :class:`EqualizeState`'s bounds kept concrete, so that an M1 anywhere in
  the chain refuses bounds it did not record (before a fused step compiles).

  Raises:
    RecordedBoundsError: a recorded bound differs from the transform's.
  """
  is_state = lambda x: isinstance(x, EqualizeState)
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_state)
           if is_state(x) and not isinstance(x.min_scale, jax.core.Tracer)]
  if not found:
    return

  def run(state, params):
    recorded = iter(found)

    def concrete(node):
      if not is_state(node):
        return node
      bounds = next(recorded)
      return node._replace(min_scale=bounds.min_scale,
                           max_scale=bounds.max_scale)

    return tx.update(params, jax.tree.map(concrete, state, is_leaf=is_state),
                     params)

  try:
    jax.eval_shape(run, opt_state, params)
  except RecordedBoundsError:
    raise
  except Exception:  # pylint: disable=broad-except
    return  # anything else, the step itself reports


ARGUMENTS = dict(decay=_checks.decay(), min_scale=_checks.positive(),
                 max_scale=_checks.positive(), block_fn=_checks.Function(),
                 stacked=_checks.Function())
SCALES_ORDERED = _checks.ordered('min_scale', 'max_scale')
_SPEC = _checks.Spec('cbp.equalize', dict(
    ARGUMENTS, stats_dtype=_checks.STATS_DTYPE), relations=(SCALES_ORDERED,))


def equalize(
    decay: float = 0.99, min_scale: float = 0.1, max_scale: float = 4.0, *,
    block_fn: Optional[BlockFn] = None, stacked: Optional[StackedFn] = None,
    stats_dtype: Optional[Any] = None,
) -> optax.GradientTransformation:
  r"""Layerwise gradient-norm equalization, M1 of Conditioned Backpropagation.

  Multiplies each parameter block :math:`l` by :math:`s_l = \mathrm{clip}(c /
  \sqrt{q_l}, s_{\min}, s_{\max})` with :math:`c = (\frac{1}{L}\sum_j
  q_j)^{1/2}` (eq. 6), where :math:`q_l` is an EMA of :math:`\|g^{(l)}\|_F^2`
  (eq. 5). The scales of step :math:`t` use the energies stored at step
  :math:`t-1` (:math:`s_l = 1` at :math:`t = 1`), which the raw gradients
  refresh afterwards (Algorithm 1, steps 3-5).

  Args:
    decay: EMA decay :math:`\rho` of the block energies, in [0, 1).
    min_scale: lower clip :math:`s_{\min} > 0`.
    max_scale: upper clip :math:`s_{\max} \ge s_{\min}`.
    block_fn: ``block_fn(path, leaf) -> hashable`` groups leaves into blocks
      (see :func:`cbp_optax.blocks.block_layout`). Default:
      :func:`cbp_optax.layer_blocks`, one block per layer; presets
      :func:`cbp_optax.leaf_blocks`, :func:`cbp_optax.kernel_blocks` and
      :func:`cbp_optax.no_blocks` (M1 off).
    stacked: ``stacked(path, leaf) -> bool`` declares leaves with a leading
      layer axis (layer stacks); each slice is a block of its own.
    stats_dtype: a real floating dtype for the energies; default float32, or
      float64 when a parameter is float64.

  Returns:
    An ``optax.GradientTransformation`` whose state is :class:`EqualizeState`.
    Updates keep the gradients' dtype.

  Raises:
    TypeError: a hyperparameter that is not a real number, or a non-float
      ``stats_dtype``; at update, complex gradients.
    ValueError: a non-scalar or out-of-range hyperparameter; at update,
      gradients with another number of blocks than the state, or that do
      not match the ``params`` given to ``update``.

  Examples:
    Step 1 applies :math:`s_l = 1`; step 2 (``decay=0``: :math:`q_l` is the last
    energy) boosts the weak block to ``max_scale``, damps the strong one:

    >>> import jax.numpy as jnp
    >>> import cbp_optax as cbp
    >>> params = {'a': {'w': jnp.ones(3)}, 'b': {'w': jnp.ones(2)}}
    >>> grads = {'a': {'w': jnp.full(3, 0.1)}, 'b': {'w': jnp.full(2, 10.0)}}
    >>> cbp.block_names(params)
    ('a', 'b')
    >>> tx = cbp.equalize(decay=0.0)
    >>> state = tx.init(params)
    >>> updates, state = tx.update(grads, state)
    >>> print(updates['a']['w'], updates['b']['w'])
    [0.1 0.1 0.1] [10. 10.]
    >>> updates, state = tx.update(grads, state)
    >>> print(updates['a']['w'].round(3), updates['b']['w'].round(3))
    [0.4 0.4 0.4] [7.072... 7.072...]

  References:
    Layerwise Conditioned Backpropagation, §4.1 (eqs. 5-7), Algorithm 1,
    steps 3-5.
  """
  _checks.check(_SPEC, decay=decay, min_scale=min_scale, max_scale=max_scale,
      block_fn=block_fn, stacked=stacked, stats_dtype=stats_dtype)

  def make(count, energy, unblocked, dtype):
    return EqualizeState(count, energy.astype(dtype),
                         jnp.asarray(min_scale, dtype),
                         jnp.asarray(max_scale, dtype), unblocked)

  def init_fn(params):
    _checks.check_float_leaves('equalize', params)
    layout = block_layout(params, block_fn=block_fn, stacked=stacked)
    dtype = stats_dtype_for(params, stats_dtype)
    return make(jnp.zeros([], jnp.int32),
                jnp.zeros((len(layout.names),), dtype), jnp.zeros([], dtype),
                dtype)

  def update_fn(updates, state, params=None):
    # test_complex_gradients_are_refused: the imaginary part would be lost.
    _checks.check_real_gradients('equalize', updates)
    layout = block_layout(updates, block_fn=block_fn, stacked=stacked)
    # test_mismatched_tree_is_refused_clearly: energies of other blocks.
    if len(layout.names) != state.energy.shape[0]:
      raise ValueError(
          f'equalize: the gradients have {len(layout.names)} blocks but the '
          f'state was initialized for {state.energy.shape[0]}.')
    # test_an_eager_update_refuses_another_configurations_state: the bounds.
    _check_recorded_bounds(state, min_scale, max_scale)
    # test_equalize_refuses_other_leaves_with_the_same_block_count.
    _checks.check_params_match('equalize', updates, params)
    leaves, treedef = jax.tree.flatten(updates)
    leaves = [jnp.asarray(leaf) for leaf in leaves]
    out_dtypes = [_checks.output_dtype(g, p) for g, p in zip(leaves, (
        [None] * len(leaves) if params is None else jax.tree.leaves(params)))]
    dtype = state.energy.dtype
    scales = _group_scales(layout, state.energy, state.count, min_scale,
                           max_scale)
    energy, unblocked = new_energies(layout, leaves, state.energy, decay,
                                     unscaled=[s is None for s in scales])
    scaled = _scale_leaves(layout, leaves, scales, out_dtypes, dtype)
    return jax.tree.unflatten(treedef, scaled), make(
        optax.safe_increment(state.count), energy, unblocked, dtype)

  return optax.GradientTransformation(init_fn, update_fn)
