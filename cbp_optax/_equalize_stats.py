"""Reading M1's state: each block's energy (eq. 5) and next scale (eq. 6)."""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax

from cbp_optax._equalize import block_scales
from cbp_optax._equalize import BlockStats
from cbp_optax._equalize import EqualizeState
from cbp_optax.blocks import block_layout
from cbp_optax.blocks import BlockFn
from cbp_optax.blocks import StackedFn


def _nodes(tree: Any, kind: Any) -> list[Any]:
  """The outermost nodes of ``tree`` that are instances of ``kind``."""
  return [leaf for leaf in jax.tree.leaves(
      tree, is_leaf=lambda x: isinstance(x, kind)) if isinstance(leaf, kind)]


def find_equalize_state(opt_state: Any) -> EqualizeState:
  """The single :class:`EqualizeState` nested anywhere inside ``opt_state``.

  Raises:
    ValueError: ``opt_state`` holds none, or several.
  """
  found = _nodes(opt_state, EqualizeState)
  if len(found) != 1:
    raise ValueError(
        'Expected exactly one EqualizeState inside the optimizer state, found '
        + (f'{len(found)}; pass the sub-state you mean (optax.multi_transform:'
           " opt_state.inner_states['label'])." if found else
           f'none in the {type(opt_state).__name__} given: pass the state of '
           'cbp.cbp, cbp.cbp_robust or cbp.equalize (or of a wrapper).'))
  return found[0]


_INJECTED = (optax.InjectStatefulHyperparamsState, optax.InjectHyperparamsState)


def _injected_bounds(opt_state: Any, state: EqualizeState) -> dict[str, Any]:
  """The unscheduled clip bounds of the innermost ``inject_hyperparams``
  state around ``state`` (the next step's, also when set by hand)."""
  for node in _nodes(opt_state, _INJECTED):
    if inner := _injected_bounds(node.inner_state, state):
      return inner
    if any(s is state for s in _nodes(node.inner_state, EqualizeState)):
      scheduled = set(getattr(node, 'hyperparams_states', None) or ())
      # `x[...]` reads NNX Variables and arrays alike; a number set by
      # hand (hyperparams['max_scale'] = 2.0) has no __getitem__.
      return {name: jnp.asarray(value[...] if hasattr(value, '__getitem__')
                                else value)
              for name, value in node.hyperparams.items()
              if name in ('min_scale', 'max_scale') and name not in scheduled}
  return {}


def equalize_stats(
    opt_state: Any, params: Any, *, block_fn: Optional[BlockFn] = None,
    stacked: Optional[StackedFn] = None) -> dict[str, BlockStats]:
  """Each block's energy ``q_l`` (eq. 5) and next step's scale ``s_l`` (eq. 6).

  The scales are eq. (6)'s from the stored energies and the clip bounds the
  state records (the latest update's); under ``optax.inject_hyperparams`` an
  unscheduled bound is read from its hyperparameters. The block names come
  from ``params`` and the grouping, which must be the optimizer's.

  Args:
    opt_state: the state of :func:`equalize`, or any optimizer state holding
      one (a chain, ``inject_hyperparams``, ``MultiSteps``...).
    params: the parameters (or the subtree) the transform was initialized on.
    block_fn: the grouping the transform uses.
    stacked: the layer-stack declaration the transform uses.

  Returns:
    ``{block name: BlockStats(energy, scale)}`` in state order.

  Raises:
    ValueError: ``opt_state`` holds no single :class:`EqualizeState`, or
      ``params`` have another number of blocks than the state.

  Examples:
    >>> import jax.numpy as jnp
    >>> import cbp_optax as cbp
    >>> params = {'a': {'w': jnp.ones(3)}, 'b': {'w': jnp.ones(2)}}
    >>> grads = {'a': {'w': jnp.full(3, 0.1)}, 'b': {'w': jnp.full(2, 10.0)}}
    >>> tx = cbp.cbp(1e-3, decay=0.0)
    >>> state = tx.init(params)
    >>> _, state = tx.update(grads, state, params)
    >>> for name, block in cbp.equalize_stats(state, params).items():
    ...   print(name, round(float(block.energy), 3), round(float(block.scale), 3))
    a 0.03 4.0
    b 200.0 0.707

  References:
    Layerwise Conditioned Backpropagation, eqs. (5) and (6).
  """
  state = find_equalize_state(opt_state)
  # `x[...]` reads NNX optimizer-state Variables and plain arrays alike.
  energy, count, min_scale, max_scale = (
      jnp.asarray(x[...]) for x in
      (state.energy, state.count, state.min_scale, state.max_scale))
  injected = _injected_bounds(opt_state, state)
  layout = block_layout(params, block_fn=block_fn, stacked=stacked)
  if len(layout.names) != energy.shape[0]:
    raise ValueError(
        f'equalize_stats: params have {len(layout.names)} blocks (with '
        f'block_fn={block_fn!r}, stacked={stacked!r}) but the optimizer state '
        f'holds the energies of {energy.shape[0]}. Pass the block_fn= and '
        'stacked= the optimizer was built with.')
  scales = block_scales(energy, count, injected.get('min_scale', min_scale),
                        injected.get('max_scale', max_scale))
  return {name: BlockStats(energy=energy[i], scale=scales[i])
          for i, name in enumerate(layout.names)}
