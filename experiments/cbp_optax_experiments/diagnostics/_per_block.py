"""Per-block reductions of a tree over M1's block layout (for the diagnostics).

A :class:`~cbp_optax.blocks.BlockLayout` (the blocks of
:func:`cbp_optax.equalize`, in its order) reduces a tree to one value per
block, shape ``(L,)``: :func:`norms`, :func:`sums`; :func:`whole_and_outside`
gives the one-block layouts whose reductions are the totals over every
parameter and over those in no block. Shared by the profile and the curvature
functions of :mod:`cbp_optax_experiments.diagnostics`.
"""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp

from cbp_optax.blocks import BlockLayout


def one_block(leaf_ids: Any) -> BlockLayout:
  """A layout with the leaves ``leaf_ids`` as one block (none: no block)."""
  leaf_ids = tuple(leaf_ids)
  if not leaf_ids:
    return BlockLayout((), (), (), ())
  return BlockLayout(('all',), (leaf_ids,), (0,), (None,))


def whole_and_outside(layout: BlockLayout, tree: Any):
  """One-block layouts of every leaf, and of the leaves in no block of
  ``layout``: totals cover every parameter, whatever ``block_fn`` says."""
  count = len(jax.tree.leaves(tree))
  inside = {i for group in layout.groups for i in group}
  return (one_block(range(count)),
          one_block(i for i in range(count) if i not in inside))


def scalar(blocks: chex.Array, dtype) -> chex.Array:
  """The one entry of a one-block result (0 for a layout without blocks)."""
  return jnp.sum(blocks).astype(dtype)


def norms(layout: BlockLayout, tree: Any, dtype) -> chex.Array:
  """``||x_l||_F`` of every block, shape (L,), without underflow.

  ``block_energies`` squares the entries, so in float32 a block whose entries
  are all below ~1e-19 (a vanishing gradient, exactly what these diagnostics
  look for) would read as zero. Each block is divided by its largest entry
  before squaring and the norm scaled back: ``m * ||x / m||``.
  """
  leaves = jax.tree.leaves(tree)
  per_group = []
  for leaf_ids, stack in zip(layout.groups, layout.group_stacks):
    arrays = [jnp.asarray(leaves[i]).astype(dtype) for i in leaf_ids]
    axes = lambda a: tuple(range(1, a.ndim)) if stack is not None else None
    expand = lambda v, a: v if stack is None else jnp.reshape(
        v, (stack,) + (1,) * (a.ndim - 1))
    peak = jnp.zeros((stack,) if stack is not None else (), dtype)
    for a in arrays:
      peak = jnp.maximum(peak, jnp.max(jnp.abs(a), axis=axes(a), initial=0))
    safe = jnp.where((peak > 0) & jnp.isfinite(peak), peak, 1.0)
    total = jnp.zeros_like(peak)
    for a in arrays:
      total = total + jnp.sum(jnp.square(a / expand(safe, a)), axis=axes(a))
    norm = jnp.where(jnp.isinf(peak), peak, safe * jnp.sqrt(total))
    per_group.append(jnp.reshape(jnp.where(peak == 0, 0.0, norm), (-1,)))
  if not per_group:
    return jnp.zeros((0,), dtype)
  return jnp.concatenate(per_group)


def disparity(block_norms: chex.Array) -> chex.Array:
  """``max / min`` of the block norms (NaN without blocks)."""
  if block_norms.shape[0] == 0:
    return jnp.asarray(jnp.nan, block_norms.dtype)
  return jnp.max(block_norms) / jnp.min(block_norms)


def sums(layout: BlockLayout, leaves, dtype) -> chex.Array:
  """Sum of every block's entries, shape (L,), in the order of ``layout``."""
  per_group = []
  for leaf_ids, stack in zip(layout.groups, layout.group_stacks):
    total = jnp.zeros((stack,) if stack is not None else (), dtype)
    for i in leaf_ids:
      leaf = jnp.asarray(leaves[i], dtype)
      axes = tuple(range(1, leaf.ndim)) if stack is not None else None
      total = total + jnp.sum(leaf, axis=axes)
    per_group.append(jnp.reshape(total, (-1,)))
  if not per_group:
    return jnp.zeros((0,), dtype)
  return jnp.concatenate(per_group)


def leaf_block_ids(layout: BlockLayout, params: Any) -> list[chex.Array]:
  """For each leaf, the index of its block, broadcastable against the leaf."""
  leaves = jax.tree.leaves(params)
  ids: list[Any] = [None] * len(leaves)
  for leaf_ids, start, stack in zip(layout.groups, layout.group_starts,
                                    layout.group_stacks):
    for i in leaf_ids:
      if stack is None:
        ids[i] = jnp.asarray(start, jnp.int32)
      else:
        shape = (stack,) + (1,) * (jnp.ndim(leaves[i]) - 1)
        ids[i] = jnp.reshape(start + jnp.arange(stack, dtype=jnp.int32), shape)
  return ids



def safe_ratio(numerator: chex.Array, denominator: chex.Array) -> chex.Array:
  """``n / d``, with ``0 / 0 = 0``, ``n / 0 = inf`` and NaN in, NaN out."""
  positive = denominator > 0
  ratio = numerator / jnp.where(positive, denominator, 1.0)
  ratio = jnp.where(positive, ratio,
                    jnp.where(numerator > 0, jnp.inf, 0.0).astype(ratio.dtype))
  return jnp.where(jnp.isnan(numerator) | jnp.isnan(denominator),
                   jnp.nan, ratio).astype(ratio.dtype)
