"""Reading M1's state: the block energies and the scales the next step applies.

:func:`equalize_stats` reports, per block, the energy :math:`q_l` of eq. (6)
and the scale :math:`s_l` of eq. (7) that :func:`cbp_optax.equalize` will
apply at its next update, from an optimizer state anywhere it is nested.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from cbp_optax import _checks
from cbp_optax._equalize import _check_scales
from cbp_optax._equalize import block_scales
from cbp_optax._equalize import BlockStats
from cbp_optax._equalize import EqualizeState
from cbp_optax.blocks import block_layout
from cbp_optax.blocks import BlockFn
from cbp_optax.blocks import StackedFn


def _nodes(tree: Any, kind: Any) -> list[Any]:
  """The outermost nodes of ``tree`` that are instances of ``kind``."""
  return [
      leaf for leaf in jax.tree.leaves(
          tree, is_leaf=lambda x: isinstance(x, kind))
      if isinstance(leaf, kind)
  ]


def find_equalize_state(opt_state: Any) -> EqualizeState:
  """The single :class:`EqualizeState` nested anywhere inside ``opt_state``.

  Raises:
    ValueError: ``opt_state`` holds none (not the state of a CBP optimizer)
      or several (say which, by passing that sub-state).
  """
  found = _nodes(opt_state, EqualizeState)
  if len(found) == 1:
    return found[0]
  if not found:
    raise ValueError(
        'Expected exactly one EqualizeState inside the optimizer state, '
        f'found none in the {type(opt_state).__name__} given: pass the state '
        'of cbp.cbp, cbp.cbp_robust or cbp.equalize (or of any optax wrapper '
        'of one), before the parameters.'
    )
  raise ValueError(
      f'Expected exactly one EqualizeState inside the optimizer state, found '
      f'{len(found)}; pass the sub-state of the equalize transform you mean '
      "(optax.multi_transform: opt_state.inner_states['label'])."
  )


_INJECTED = (optax.InjectStatefulHyperparamsState, optax.InjectHyperparamsState)


def _injected_bounds(opt_state: Any, state: EqualizeState) -> Optional[Any]:
  """The innermost ``optax.inject_hyperparams`` state around ``state`` that
  records both clip bounds (the factory was cbp, cbp_robust or equalize), or
  None."""
  for node in _nodes(opt_state, _INJECTED):
    inner = _injected_bounds(node.inner_state, state)
    if inner is not None:
      return inner
    if ({'min_scale', 'max_scale'} <= set(node.hyperparams)
        and any(s is state for s in _nodes(node.inner_state, EqualizeState))):
      return node
  return None


def _clip_bounds(
    opt_state: Any, state: EqualizeState, given: dict[str, Any]
) -> tuple[Any, Any]:
  """``(min_scale, max_scale)``: the ones given, else the ones the state of
  ``optax.inject_hyperparams`` records; never a default."""
  injected = _injected_bounds(opt_state, state)
  scheduled = set(getattr(injected, 'hyperparams_states', None) or ())
  bounds = []
  for name, value in given.items():
    recorded = None
    if injected is not None and name not in scheduled:
      recorded = injected.hyperparams[name]
      # `x[...]` reads NNX optimizer-state Variables and arrays alike; a
      # number set by hand (state.hyperparams['max_scale'] = 2.0) has none.
      recorded = jnp.asarray(
          recorded[...] if hasattr(recorded, '__getitem__') else recorded)
    if value is None and recorded is None:
      why = (f'{name} is scheduled, and the state holds the value of the '
             'step taken, not of the next one; pass '
             f'{name}=schedule(step)' if name in scheduled else
             'the state of cbp.cbp, cbp.cbp_robust and cbp.equalize does not '
             'record them (optax.inject_hyperparams does); pass the ones '
             'the optimizer was built with: min_scale=0.1, max_scale=4.0 are '
             "cbp.cbp's and cbp.equalize's defaults, min_scale=1.0, "
             "max_scale=1.0 cbp.cbp_robust's")
      raise ValueError(
          f'equalize_stats needs the clip bounds of eq. (6) to know the '
          f'scales: {why}.'
      )
    if value is not None and recorded is not None:
      # Compared in the recorded dtype: 0.1 is stored as float32's 0.1.
      stored = _checks.concrete_float(recorded)
      passed = _checks.concrete_float(value)
      if passed is not None:
        passed = float(np.asarray(passed, recorded.dtype))
      if None not in (stored, passed) and stored != passed:
        raise ValueError(
            f'equalize_stats: {name}={value!r} was passed, but the optimizer '
            f'state (optax.inject_hyperparams) records {name}={stored!r}, '
            'the value its next step applies; leave it out to use that one.'
        )
    bounds.append(recorded if value is None else value)
  return bounds[0], bounds[1]


def equalize_stats(
    opt_state: Any,
    params: Any,
    *,
    min_scale: Optional[float] = None,
    max_scale: Optional[float] = None,
    block_fn: Optional[BlockFn] = None,
    stacked: Optional[StackedFn] = None,
) -> dict[str, BlockStats]:
  """Each block's energy ``q_l`` and the scale ``s_l`` the next step applies.

  The scales depend on the clip bounds of eq. (6), which the state of
  :func:`equalize` does not hold and which differ between the factories
  (:func:`cbp_optax.cbp`: [0.1, 4]; :func:`cbp_optax.cbp_robust`: [1, 1], M1
  held at one): pass the bounds the optimizer was built with, or build it
  with ``optax.inject_hyperparams``, whose state records them. No bounds are
  assumed. Likewise ``block_fn`` and ``stacked`` must be the optimizer's
  (only a different number of blocks can be detected).

  Args:
    opt_state: the state of :func:`equalize`, or any optimizer state (a chain,
      ``cbp.cbp``, ``inject_hyperparams``, ``MultiSteps``...) holding one.
    params: the parameters (or the subtree) the transform was initialized on.
    min_scale: the lower clip bound the transform uses; None: the one its
      ``inject_hyperparams`` state records.
    max_scale: the upper clip bound, likewise.
    block_fn: the grouping the transform uses.
    stacked: the layer-stack declaration the transform uses.

  Returns:
    ``{block name: BlockStats(energy, scale)}`` in state order.

  Raises:
    TypeError: a bound that is not a number (a schedule included).
    ValueError: no bound given and none recorded (or a scheduled one) while
      there are blocks, a bound that differs from the recorded one, or
      ``params`` (with this ``block_fn`` and ``stacked``) with another number
      of blocks than the state.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import cbp_optax as cbp
    >>> params = {'a': {'w': jnp.ones(3)}, 'b': {'w': jnp.ones(2)}}
    >>> grads = {'a': {'w': jnp.full(3, 0.1)}, 'b': {'w': jnp.full(2, 10.0)}}
    >>> tx = cbp.cbp(1e-3, decay=0.0)
    >>> state = tx.init(params)
    >>> _, state = tx.update(grads, state, params)
    >>> stats = cbp.equalize_stats(state, params, min_scale=0.1, max_scale=4.0)
    >>> for name, block in stats.items():
    ...   print(name, round(float(block.energy), 3), round(float(block.scale), 3))
    a 0.03 4.0
    b 200.0 0.707

    ``cbp_robust`` holds M1 at one; under ``inject_hyperparams`` the state
    says so:

    >>> tx = optax.inject_hyperparams(cbp.cbp_robust)(1e-3, decay=0.0)
    >>> state = tx.init(params)
    >>> _, state = tx.update(grads, state, params)
    >>> [float(block.scale) for block in cbp.equalize_stats(state, params).values()]
    [1.0, 1.0]

  References:
    Layerwise Conditioned Backpropagation: A Curvature-Aware
    Reparameterization of the Backward Pass with Convergence Guarantees,
    eqs. (5) and (6).
  """
  for name, value in (('min_scale', min_scale), ('max_scale', max_scale)):
    if callable(value):
      raise TypeError(
          f'{name} must be a number, the bound the next step applies, got '
          f'the callable {value!r}; for a schedule pass schedule(step).')
    if value is not None:
      _checks.check_positive(name, value)
  state = find_equalize_state(opt_state)
  # `x[...]` reads NNX optimizer-state Variables and plain arrays alike.
  energy, count = jnp.asarray(state.energy[...]), jnp.asarray(state.count[...])
  layout = block_layout(params, block_fn=block_fn, stacked=stacked)
  if len(layout.names) != energy.shape[0]:
    raise ValueError(
        f'equalize_stats: params have {len(layout.names)} blocks (with '
        f'block_fn={block_fn!r}, stacked={stacked!r}) but the optimizer state '
        f'holds the energies of {energy.shape[0]}. Pass the block_fn= and '
        'stacked= the optimizer was built with, and the parameters (or, '
        'under optax.masked, the subtree) it was initialized on.'
    )
  if not layout.names:
    return {}  # no block (block_fn=cbp.no_blocks): no scale to know
  min_scale, max_scale = _clip_bounds(
      opt_state, state, {'min_scale': min_scale, 'max_scale': max_scale})
  _check_scales(min_scale, max_scale)
  scales = block_scales(energy, count, min_scale, max_scale)
  return {
      name: BlockStats(energy=energy[i], scale=scales[i])
      for i, name in enumerate(layout.names)
  }
