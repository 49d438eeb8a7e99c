"""M1: layerwise gradient-norm equalization (paper §4.1, eqs. 5-7).

Each parameter block ``l`` (by default one layer: the leaves that share a parent
path) keeps an EMA ``q_l`` of its squared Frobenius gradient norm, eq. (5). The
update at step ``t`` multiplies block ``l`` by

    s_l = clip(c / sqrt(q_l), min_scale, max_scale),  c = sqrt(mean_j q_j),

eq. (6), formed from the energies stored at the end of step ``t - 1`` (``s_l = 1``
at ``t = 1``); only then are the energies refreshed with the current, raw block
gradients (Algorithm 1, steps 3-5).

The state is one flat vector of block energies and a few scalars, so its
structure and dtype never depend on the parameter tree: it survives
``optax.masked``, ``MultiSteps``, ``apply_if_finite``, ``tree_map_params`` and
sharding unchanged. The block that each entry belongs to is recovered from the
parameter tree by :func:`block_names`; the state keeps the clip bounds of
eq. (6), so :func:`equalize_stats` reads energies and scales by name from the
state and the parameters alone.

References:
  Layerwise Conditioned Backpropagation: A Curvature-Aware
  Reparameterization of the Backward Pass with Convergence Guarantees,
  §4.1, eqs. (5)-(7), and Algorithm 1, steps 3-5.
"""

from __future__ import annotations

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
  survives ``optax.masked``, ``MultiSteps``, ``apply_if_finite`` and sharding,
  and keeps one structure, shape and dtype across steps.

  Attributes:
    count: the number of updates taken, an int32 scalar.
    energy: the EMAs :math:`q_l` of eq. (5), one per block, in the order of
      :func:`cbp_optax.block_names`.
    min_scale: :math:`s_{\min}` of eq. (6), the one of the latest update (at
      init, the transform's), a scalar of the energies' dtype.
    max_scale: :math:`s_{\max}` of eq. (6), likewise.
    unblocked: :math:`\sum_k \|g_k\|_F^2` over the gradient leaves in no
      block at the latest update (0 at init, and when every leaf is in a
      block): with ``energy``, a finite value witnesses finite gradients.

  Examples:
    >>> import jax.numpy as jnp
    >>> import cbp_optax as cbp
    >>> params = {'a': {'w': jnp.ones(3)}, 'b': {'w': jnp.ones(2)}}
    >>> state = cbp.equalize().init(params)
    >>> state.energy, float(state.min_scale), float(state.max_scale)
    (Array([0., 0.], dtype=float32), 0.1..., 4.0)
  """

  count: chex.Array  # shape=(), dtype=jnp.int32.
  energy: chex.Array  # shape=(num_blocks,): the EMAs q_l of eq. (5).
  min_scale: chex.Array  # shape=(): s_min of eq. (6).
  max_scale: chex.Array  # shape=(): s_max of eq. (6).
  unblocked: chex.Array  # shape=(): squared norm of the leaves in no block.


class BlockStats(NamedTuple):
  """Energy and scale of one block, as read by :func:`equalize_stats`.

  Attributes:
    energy: :math:`q_l`, eq. (5).
    scale: the :math:`s_l` of eq. (6) that the next step applies.
  """

  energy: chex.Array  # q_l, eq. (5).
  scale: chex.Array  # s_l the next step applies, eq. (6).


def stats_dtype_for(tree: Any, stats_dtype: Optional[Any] = None) -> jnp.dtype:
  """Float32 statistics, or float64 when any leaf is float64."""
  if stats_dtype is not None:
    return jnp.dtype(stats_dtype)
  dtype = jnp.dtype(jnp.float32)
  for leaf in jax.tree.leaves(tree):
    leaf_dtype = jnp.result_type(leaf)
    if jnp.issubdtype(leaf_dtype, jnp.floating):
      dtype = jnp.promote_types(dtype, leaf_dtype)
  return dtype


def _equalizing_scales(
    energy: chex.Array, min_scale: chex.Numeric, max_scale: chex.Numeric
) -> chex.Array:
  """``clip(c / sqrt(q_l), min_scale, max_scale)`` of eq. (6), for every block."""
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
  ratio = jnp.where(
      positive,
      target / jnp.sqrt(safe_energy),
      jnp.where(target > 0, jnp.inf, 1.0).astype(energy.dtype),
  )
  low = jnp.asarray(min_scale, energy.dtype)
  high = jnp.asarray(max_scale, energy.dtype)
  # clip(x, a, a) = a for every x, also where an energy is infinite (an
  # infinite gradient: ratio inf / inf = NaN): a degenerate clip fixes the
  # scale. A
  # proper interval keeps jnp.clip's result, NaN included (Algorithm 1).
  return jnp.where(low == high, low, jnp.clip(ratio, low, high))


def block_scales(
    energy: chex.Array,
    count: chex.Array,
    min_scale: chex.Numeric,
    max_scale: chex.Numeric,
) -> chex.Array:
  """The scales ``s_l`` of eq. (6) from stored energies; ones at the first step.

  A block with zero energy (frozen, unused, or never reached) has an infinite
  ratio ``c / sqrt(q_l)`` and gets ``max_scale``; when every energy is zero
  there is no target scale and the ratio is taken as one. Either way the scale
  stays finite, so a zero gradient gives a zero update.
  """
  scales = _equalizing_scales(energy, min_scale, max_scale)
  return jnp.where(count > 0, scales, jnp.ones_like(scales))


def _group_scales(
    layout: BlockLayout,
    energy: chex.Array,
    count: chex.Array,
    min_scale: chex.Numeric,
    max_scale: chex.Numeric,
) -> tuple[Optional[chex.Array], ...]:
  """:func:`block_scales`, split into one array per group of leaves.

  The split is for compile time. XLA compiles every distinct kernel on its
  own, and identical kernels once. A slice of
  the scale vector fused into a per-leaf kernel makes that kernel distinct
  (it embeds the slice offset); so does a slice of its own. Here each group's
  scale becomes its own small buffer, so the parameter-sized kernels that
  read it are identical for same-shaped leaves, and the buffers come out of
  a few multi-output reductions (:func:`_split`) rather than one distinct
  slice kernel per block. The values are the scales, bit for bit.

  Equal concrete bounds (``cbp_robust``'s ``min_scale=max_scale=1``) clip
  every block to the same scale (``_equalizing_scales``), so all groups share
  one scalar and nothing is split; a scale that is one at every step is None
  (the leaves are left unmultiplied, which is exact).
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


# Groups per multi-output reduction of _split: each reduction is one kernel
# (distinct: it embeds its offsets); its compile time per output grows with
# its number of outputs past a few dozen.
_SPLIT_CHUNK = 32


def _split(
    vector: chex.Array,
    starts: Sequence[int],
    stacks: Sequence[Optional[int]],
) -> tuple[chex.Array, ...]:
  """``vector[start]`` (or ``vector[start:start + stack]``) for each group.

  Written as variadic ``lax.reduce`` calls over up to :data:`_SPLIT_CHUNK`
  groups of one stack size each: ``vector`` is paired with ``-0.0`` (a
  ``(n, 2)`` array), and output ``k`` adds up the rows of its slice. ``x +
  (-0.0)`` is ``x`` for every float (signed zeros, infinities and NaN
  included), so each output is its slice exactly; XLA compiles a reduction
  with many outputs as one kernel, where as many slices are as many kernels.
  """
  out: list[Optional[chex.Array]] = [None] * len(starts)
  by_stack: dict[Optional[int], list[int]] = {}
  for i, stack in enumerate(stacks):
    by_stack.setdefault(stack, []).append(i)
  minus_zero = jnp.asarray(-0.0, vector.dtype)
  pairs = jnp.stack([vector, jnp.full_like(vector, minus_zero)], axis=1)

  def add(xs, ys):
    return tuple(x + y for x, y in zip(xs, ys))

  for stack, members in by_stack.items():
    width = 1 if stack is None else stack
    for first in range(0, len(members), _SPLIT_CHUNK):
      chunk = members[first:first + _SPLIT_CHUNK]
      if stack is None:  # rows (2,) -> scalars
        operands = tuple(pairs[starts[i]] for i in chunk)
      else:  # (width, 2) -> (width,)
        operands = tuple(
            jax.lax.slice_in_dim(pairs, starts[i], starts[i] + width)
            for i in chunk)
      reduced = jax.lax.reduce(operands, (minus_zero,) * len(chunk), add,
                               (operands[0].ndim - 1,))
      for i, value in zip(chunk, reduced):
        out[i] = value
  return tuple(out)


def _scale_leaves(
    layout: BlockLayout,
    leaves: Sequence[chex.Array],
    group_scales: Sequence[Optional[chex.Array]],
    out_dtypes: Sequence[Any],
    stats_dtype: Any,
) -> list[chex.Array]:
  scaled: list[Optional[chex.Array]] = [None] * len(leaves)
  for leaf_ids, stack, scale in zip(
      layout.groups, layout.group_stacks, group_scales
  ):
    for i in leaf_ids:
      leaf = leaves[i]
      if scale is None:  # s = 1 at every step: x * 1 is x
        scaled[i] = leaf.astype(stats_dtype).astype(out_dtypes[i])
        continue
      leaf_scale = scale
      if stack is not None:
        leaf_scale = jnp.reshape(scale, (stack,) + (1,) * (leaf.ndim - 1))
      scaled[i] = (leaf.astype(scale.dtype) * leaf_scale).astype(
          out_dtypes[i])
  # Leaves in no block (key None, or empty) pass through with s = 1.
  return [
      leaf.astype(dtype) if out is None else out
      for leaf, dtype, out in zip(leaves, out_dtypes, scaled)
  ]


def _check_matches_state(layout: BlockLayout, state: EqualizeState) -> None:
  expected = state.energy.shape[0]
  if len(layout.names) != expected:
    raise ValueError(
        f'equalize: the gradient tree has {len(layout.names)} blocks but the '
        f'state was initialized for {expected}. The updates must have the '
        'structure of the parameters given to init (same leaves, same block '
        'grouping).'
    )


class RecordedBoundsError(ValueError):
  """A state whose recorded M1 bounds (eq. 6) are not the transform's."""


def _check_recorded_bounds(state: EqualizeState, min_scale: Any,
                           max_scale: Any) -> None:
  """Refuses a concrete state that recorded other bounds than the numbers
  the transform was built with: a state of another configuration (a
  ``cbp_robust`` checkpoint restored into ``cbp.cbp``), whose bounds the
  update would silently replace. Arrays (``inject_hyperparams``' values,
  which may be scheduled or set by hand) are not checked."""
  for name, recorded, own in (('min_scale', state.min_scale, min_scale),
                              ('max_scale', state.max_scale, max_scale)):
    if (not isinstance(own, (numbers.Real, np.generic))
        or isinstance(recorded, jax.core.Tracer)):
      continue
    value = float(own)
    # NumPy: inside a trace a jnp operation would stage the concrete value.
    recorded = np.asarray(recorded)
    if float(recorded) != float(np.asarray(value, recorded.dtype)):
      raise RecordedBoundsError(
          f'equalize: the optimizer state records {name}='
          f'{float(recorded):g} but this transform has {name}={value:g}: '
          'the state was made by another configuration (a checkpoint of '
          'cbp.cbp_robust restored into cbp.cbp, or the reverse). Restore '
          'it into the optimizer that saved it; to change the bounds on '
          'purpose, set them in the state (state._replace(min_scale=..., '
          'max_scale=...)).')


def check_recorded_bounds(tx: optax.GradientTransformation, opt_state: Any,
                          params: Any) -> None:
  """Before a fused step compiles: ``tx.update`` traced abstractly with each
  concrete :class:`EqualizeState`'s bounds kept concrete, so that an M1
  inside any chain refuses bounds it did not record.

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

    state = jax.tree.map(concrete, state, is_leaf=is_state)
    return tx.update(params, state, params)

  try:
    jax.eval_shape(run, opt_state, params)
  except RecordedBoundsError:
    raise
  except Exception:  # pylint: disable=broad-except
    return  # anything else, the step itself reports


# M1's hyperparameters (eqs. 5-6) and function arguments.
ARGUMENTS = dict(decay=_checks.decay(), min_scale=_checks.positive(),
                 max_scale=_checks.positive(), block_fn=_checks.Function(),
                 stacked=_checks.Function())
SCALES_ORDERED = _checks.ordered('min_scale', 'max_scale')
_SPEC = _checks.Spec('cbp.equalize', dict(
    ARGUMENTS, stats_dtype=_checks.STATS_DTYPE),
    relations=(SCALES_ORDERED,))


def equalize(
    decay: float = 0.99,
    min_scale: float = 0.1,
    max_scale: float = 4.0,
    *,
    block_fn: Optional[BlockFn] = None,
    stacked: Optional[StackedFn] = None,
    stats_dtype: Optional[Any] = None,
) -> optax.GradientTransformation:
  r"""Layerwise gradient-norm equalization, M1 of Conditioned Backpropagation.

  Multiplies each parameter block :math:`l` by
  :math:`s_l = \mathrm{clip}(c / \sqrt{q_l}, s_{\min}, s_{\max})` with
  :math:`c = (\frac{1}{L}\sum_j q_j)^{1/2}` (eq. 6), where :math:`q_l` is an EMA
  of :math:`\|g^{(l)}\|_F^2` (eq. 5). The scales of step :math:`t` use the
  energies stored at the end of step :math:`t-1` (:math:`s_l = 1` at
  :math:`t = 1`); the energies are refreshed with the raw block gradients only
  afterwards (Algorithm 1, steps 3-5), so the scaling is a function of the past.

  Args:
    decay: EMA decay :math:`\rho` of the block energies, in [0, 1).
    min_scale: lower clip :math:`s_{\min} > 0`.
    max_scale: upper clip :math:`s_{\max} \ge s_{\min}`.
    block_fn: ``block_fn(path, leaf) -> hashable`` groups leaves into blocks
      (leaves with equal keys share a block; a leaf whose key is ``None``,
      or of size zero, is in no block and passes through unscaled). The
      default, :func:`cbp_optax.layer_blocks`, groups the leaves that share a parent
      path, i.e. one block per layer (``Dense_0``'s kernel and bias form block
      ``Dense_0``); NNX ``.value`` path suffixes are ignored. Presets:
      :func:`cbp_optax.leaf_blocks` (one block per tensor),
      :func:`cbp_optax.kernel_blocks` (weight matrices only) and
      :func:`cbp_optax.no_blocks` (M1 off); the last two are not
      Algorithm 1's grouping.
    stacked: ``stacked(path, leaf) -> bool`` declares leaves that carry a
      leading layer axis (``nn.scan`` / ``nnx.vmap`` layer stacks); each slice
      along that axis becomes its own block, as one block per layer intends.
    stats_dtype: a real floating dtype for the energies; defaults to
      float32, or float64 when a parameter is float64.

  Returns:
    An ``optax.GradientTransformation`` whose state is :class:`EqualizeState`.
    Updates keep the gradients' dtype (a non-float gradient gets its
    parameter's dtype).

  Raises:
    TypeError: a hyperparameter that is not a real number (a bool, a string,
      a schedule: schedule ``decay``, ``min_scale`` or ``max_scale`` with
      ``optax.inject_hyperparams``), or a non-float ``stats_dtype``; at
      update, complex gradients.
    ValueError: a non-scalar hyperparameter or a concrete value out of range;
      at update, gradients with another number of blocks than the state, or
      whose leaves or shapes differ from the ``params`` given to ``update``
      (without them only the number of blocks is checked: pass them, as
      :func:`cbp_optax.cbp` does).

  Examples:
    Two layers whose gradient energies differ by almost four orders of
    magnitude. Step 1 applies :math:`s_l = 1`; step 2 boosts the weak block
    up to ``max_scale`` and damps the strong one (``decay=0`` makes
    :math:`q_l` the last energy, for a short example):

    >>> import jax.numpy as jnp
    >>> import cbp_optax as cbp
    >>> params = {'a': {'w': jnp.ones(3)}, 'b': {'w': jnp.ones(2)}}
    >>> grads = {'a': {'w': jnp.full(3, 0.1)}, 'b': {'w': jnp.full(2, 10.0)}}
    >>> cbp.block_names(params)
    ('a', 'b')
    >>> tx = cbp.equalize(decay=0.0)
    >>> state = tx.init(params)
    >>> state.energy
    Array([0., 0.], dtype=float32)
    >>> updates, state = tx.update(grads, state)
    >>> print(updates['a']['w'], updates['b']['w'])
    [0.1 0.1 0.1] [10. 10.]
    >>> updates, state = tx.update(grads, state)
    >>> print(updates['a']['w'].round(3), updates['b']['w'].round(3))
    [0.4 0.4 0.4] [7.072... 7.072...]

  References:
    Layerwise Conditioned Backpropagation: A Curvature-Aware
    Reparameterization of the Backward Pass with Convergence Guarantees,
    §4.1 (eqs. 5-7) and Algorithm 1, steps 3-5.
  """
  _checks.check(_SPEC, decay=decay, min_scale=min_scale, max_scale=max_scale,
                block_fn=block_fn, stacked=stacked, stats_dtype=stats_dtype)

  def init_fn(params):
    _checks.check_float_leaves('equalize', params)
    layout = block_layout(params, block_fn=block_fn, stacked=stacked)
    dtype = stats_dtype_for(params, stats_dtype)
    return EqualizeState(
        count=jnp.zeros([], jnp.int32),
        energy=jnp.zeros((len(layout.names),), dtype),
        min_scale=jnp.asarray(min_scale, dtype),
        max_scale=jnp.asarray(max_scale, dtype),
        unblocked=jnp.zeros([], dtype),
    )

  def update_fn(updates, state, params=None):
    # test_complex_gradients_are_refused: the imaginary part would be lost.
    _checks.check_real_gradients('equalize', updates)
    layout = block_layout(updates, block_fn=block_fn, stacked=stacked)
    # test_mismatched_tree_is_refused_clearly: energies of other blocks.
    _check_matches_state(layout, state)
    # test_an_eager_update_refuses_another_configurations_state: the bounds.
    _check_recorded_bounds(state, min_scale, max_scale)
    # test_equalize_refuses_other_leaves_with_the_same_block_count (the state
    # is a flat vector: only the parameters show the leaves).
    _checks.check_params_match('equalize', updates, params)
    leaves, treedef = jax.tree.flatten(updates)
    param_leaves = [None] * len(leaves)
    if params is not None:
      param_leaves = jax.tree.leaves(params)
    leaves = [jnp.asarray(leaf) for leaf in leaves]
    out_dtypes = [
        _checks.output_dtype(g, p) for g, p in zip(leaves, param_leaves)
    ]
    scales = _group_scales(
        layout, state.energy, state.count, min_scale, max_scale
    )
    energy, unblocked = new_energies(
        layout, leaves, state.energy, decay,
        unscaled=[scale is None for scale in scales])
    scaled = _scale_leaves(layout, leaves, scales, out_dtypes,
                           state.energy.dtype)
    dtype = state.energy.dtype
    new_state = EqualizeState(
        count=optax.safe_increment(state.count),
        energy=energy.astype(dtype),
        min_scale=jnp.asarray(min_scale, dtype),
        max_scale=jnp.asarray(max_scale, dtype),
        unblocked=unblocked,
    )
    return jax.tree.unflatten(treedef, scaled), new_state

  return optax.GradientTransformation(init_fn, update_fn)
