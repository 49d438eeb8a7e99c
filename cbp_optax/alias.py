"""``cbp()``: the optimizer side of Conditioned Backpropagation as one optax chain."""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import optax

from cbp_optax import equalize as equalize_lib
from cbp_optax import precondition as precondition_lib


def cbp(
    learning_rate: optax.ScalarOrSchedule,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    damping: float = 1e-3,
    decay: float = 0.99,
    min_scale: float = 0.1,
    max_scale: float = 4.0,
    weight_decay: float = 0.0,
    mask: Optional[Union[Any, Callable[[optax.Params], Any]]] = None,
    block_fn: Optional[equalize_lib.BlockFn] = None,
    stacked: Optional[equalize_lib.StackedFn] = None,
    stats_dtype: Optional[Any] = None,
) -> optax.GradientTransformation:
  r"""Conditioned Backpropagation: M1 equalization, then M3 preconditioning.

  The chain :func:`equalize` -> :func:`precondition` -> optional decoupled
  weight decay -> ``optax.scale_by_learning_rate``, i.e. the update
  :math:`-\eta P_t \hat m_t` of eq. (12) with :math:`m` built from
  :math:`S_t g_t`. Centering (M2) is a reparameterization of the model, not an
  optimizer step: wrap the layers with ``cbp_optax.nnx.Centered`` or
  ``cbp_optax.linen.Centered`` and train with the fused step of those modules.

  Args:
    learning_rate: :math:`\eta`, a float or an optax schedule.
    b1: momentum decay :math:`\beta_1` (0 gives the analysed momentum-free
      method).
    b2: second-moment decay :math:`\beta_2`.
    damping: preconditioner damping :math:`\zeta`.
    decay: block-energy EMA decay :math:`\rho` of M1 (eq. 5).
    min_scale: :math:`s_{\min}` of eq. (6).
    max_scale: :math:`s_{\max}` of eq. (6).
    weight_decay: decoupled (AdamW-style) weight decay, added to the update
      before the learning rate is applied; 0 leaves it out of the chain.
    mask: which parameters the weight decay applies to, as in
      ``optax.add_decayed_weights``.
    block_fn: grouping of leaves into M1 blocks, see :func:`equalize`.
    stacked: layer-stacked leaves, see :func:`equalize`.
    stats_dtype: dtype of all optimizer statistics (default float32, float64
      for float64 parameters).

  Returns:
    An ``optax.GradientTransformation``.

  Examples:
    >>> import cbp_optax as cbp
    >>> import jax.numpy as jnp
    >>> params = {'dense': {'kernel': jnp.ones((2, 2)), 'bias': jnp.zeros(2)}}
    >>> tx = cbp.cbp(1e-3)
    >>> state = tx.init(params)
    >>> updates, state = tx.update(params, state, params)

  References:
    Conditioned Backpropagation, §4.4 and Algorithm 1.
  """
  transforms = [
      equalize_lib.equalize(
          decay,
          min_scale,
          max_scale,
          block_fn=block_fn,
          stacked=stacked,
          stats_dtype=stats_dtype,
      ),
      precondition_lib.precondition(
          b1, b2, damping, stats_dtype=stats_dtype
      ),
  ]
  if not (isinstance(weight_decay, (int, float)) and weight_decay == 0):
    transforms.append(optax.add_decayed_weights(weight_decay, mask))
  transforms.append(optax.scale_by_learning_rate(learning_rate))
  return optax.chain(*transforms)
