"""Configurations of the library that only the studies use.

They are spelled out here, not in ``cbp_optax``, so the library's public
surface holds what a user trains with; the studies (the transformer
ablation) and their tests measure them.
"""

from typing import Any, Optional

import optax

import cbp_optax as cbp

# The transformer ablation's combination: cbp with these arguments changed
# (arguments of cbp_study, which has the study-only relative_damping). The
# ablation measures each entry alone and together.
TRANSFORMER_COMBINATION = dict(
    damping=1e-8,
    relative_damping=0.03,
    zero_moment='identity',
    block_fn=cbp.no_blocks,
)


def cbp_study(
    learning_rate: optax.ScalarOrSchedule,
    *,
    relative_damping: float = 0.0,
    b1: float = 0.9,
    b2: float = 0.999,
    damping: float = 1e-3,
    decay: float = 0.99,
    min_scale: float = 0.1,
    max_scale: float = 4.0,
    weight_decay: Optional[optax.ScalarOrSchedule] = None,
    mask: Any = None,
    block_fn: Optional[cbp.blocks.BlockFn] = None,
    stacked: Optional[cbp.blocks.StackedFn] = None,
    stats_dtype: Optional[Any] = None,
    zero_moment: str = 'damped',
    update_clip: Optional[float] = None,
) -> optax.GradientTransformation:
  """``cbp.cbp`` spelled out as its optax chain, with ``relative_damping``.

  ``relative_damping`` (a damping relative to each tensor's stored second
  moment, eq. 11's ``zeta + delta * rms(v_hat)``) serves the ablation
  studies only; ``cbp.cbp`` has no such argument, ``cbp.precondition``
  keeps it. With ``relative_damping=0`` this is ``cbp.cbp`` with the same
  arguments, update for update and state for state, on trees without float16
  leaves.
  """
  transforms = [
      cbp.equalize(decay, min_scale, max_scale, block_fn=block_fn,
                   stacked=stacked, stats_dtype=stats_dtype),
      cbp.precondition(b1, b2, damping, stats_dtype=stats_dtype,
                       zero_moment=zero_moment,
                       relative_damping=relative_damping, stacked=stacked),
  ]
  if update_clip is not None:
    transforms.append(optax.clip(update_clip))
  if weight_decay is not None:
    transforms.append(optax.add_decayed_weights(weight_decay, mask))
  transforms.append(optax.scale_by_learning_rate(learning_rate))
  return optax.chain(*transforms)
