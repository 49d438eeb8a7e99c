"""M1's block energies (eq. 5) from the gradients, without overflow."""

from __future__ import annotations

import functools
from typing import Any, Sequence

import chex
import jax
import jax.numpy as jnp

from cbp_optax.blocks import BlockLayout


def block_energies(layout: BlockLayout, leaves: Sequence[chex.Array],
                   dtype: Any, unscaled: Sequence[bool]) -> chex.Array:
  """``||g_l||_F^2`` of every block, shape (L,); ``unscaled[k]``: group
  ``k``'s leaves leave M1 unmultiplied."""
  per_group = []
  for leaf_ids, stack, barrier in zip(layout.groups, layout.group_stacks,
                                      unscaled):
    total = 0.0
    for i in leaf_ids:
      leaf = jnp.asarray(leaves[i])
      if barrier:
        # Keeps XLA from merging this square with M3's (eq. 11) of the same
        # gradient, which writes a parameter-sized buffer out and back.
        leaf = jax.lax.optimization_barrier(leaf)
      leaf = leaf.astype(dtype)
      axes = tuple(range(1, leaf.ndim)) if stack is not None else None
      total = total + jnp.sum(jnp.square(leaf), axis=axes)
    per_group.append(jnp.reshape(total, (-1,)))
  return jnp.concatenate(per_group) if per_group else jnp.zeros((0,), dtype)


def _rescued_energies(layout: BlockLayout, leaves: Sequence[chex.Array],
                      dtype: Any, weight: chex.Numeric
                      ) -> tuple[chex.Array, chex.Array]:
  """``weight * ||g_l||_F^2`` of every block, and ``||g_k||_F^2`` of the leaves
  in no block, as ``(sqrt(weight) m)^2 * sum((g / m)^2)`` with ``m = max |g|``,
  saturating at the dtype's largest value: finite for finite gradients."""
  largest = jnp.finfo(dtype).max
  root = jnp.sqrt(jnp.asarray(weight, dtype))

  def energy(members, stack, root):
    xs = [jnp.asarray(leaves[i]).astype(dtype) for i in members]
    axes = lambda x: tuple(range(1, x.ndim)) if stack is not None else None
    shape = lambda x: (-1,) + (1,) * (x.ndim - 1) if stack is not None else ()
    peak = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(x), axis=axes(x))
                                          for x in xs], xs[0].dtype.type(0))
    safe = jnp.where(peak > 0, peak, jnp.ones_like(peak))
    total = sum(jnp.sum(jnp.square(x / jnp.reshape(safe, shape(x))),
                        axis=axes(x)) for x in xs)
    return jnp.minimum(jnp.square(root * peak) * total, largest)

  blocks = [jnp.reshape(energy(ids, stack, root), (-1,))
            for ids, stack in zip(layout.groups, layout.group_stacks)]
  in_blocks = {i for group in layout.groups for i in group}
  rest = [i for i, leaf in enumerate(leaves)
          if i not in in_blocks and jnp.size(leaf)]
  unblocked = (energy(rest, None, jnp.ones((), dtype)) if rest
               else jnp.zeros([], dtype))
  return (jnp.concatenate(blocks) if blocks else jnp.zeros((0,), dtype),
          unblocked)


def new_energies(layout: BlockLayout, leaves: Sequence[chex.Array],
                 energy: chex.Array, decay: chex.Numeric,
                 unscaled: Sequence[bool]) -> tuple[chex.Array, chex.Array]:
  """The refreshed EMAs of eq. (5), ``decay * q_l + (1 - decay)
  ||g_l||_F^2``, and the unblocked energy; where that overflows for a finite
  gradient, :func:`_rescued_energies` (a non-finite energy would make every
  later scale of eq. (6) NaN)."""
  dtype = energy.dtype
  energies = block_energies(layout, leaves, dtype, unscaled=unscaled)
  plain = decay * energy + (1 - decay) * energies
  # sum ||g_k||_F^2 over the leaves in no block (a zero when none is).
  in_blocks = {i for group in layout.groups for i in group}
  unblocked = sum((jnp.sum(jnp.square(leaf.astype(dtype)))
                   for i, leaf in enumerate(leaves) if i not in in_blocks),
                  jnp.zeros([], dtype))

  def rescue(operands):
    plain, unblocked, leaves = operands
    weighted, rest = _rescued_energies(layout, leaves, dtype, 1 - decay)
    largest = jnp.finfo(dtype).max
    rescued = jnp.minimum(decay * energy + weighted, largest)
    # Finite gradients and stored energy only (NaN compares false).
    overflowed = jnp.isinf(plain) & (energy <= largest) & (weighted <= largest)
    rest_overflowed = jnp.isinf(unblocked) & (rest <= largest)
    return (jnp.where(overflowed, rescued, plain).astype(dtype),
            jnp.where(rest_overflowed, rest, unblocked).astype(dtype))

  overflow = jnp.any(jnp.isinf(plain)) | jnp.isinf(unblocked)
  return jax.lax.cond(overflow, rescue, lambda operands: operands[:2],
                      (plain.astype(dtype), unblocked, list(leaves)))
