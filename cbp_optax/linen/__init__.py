"""Conditioned Backpropagation for Flax Linen: centered layers and the fused step.

:func:`center` runs an unmodified module with every supported layer centered
(:class:`Centered` wraps one), ``z = W (a - mu) + b~`` (eq. 8), its means in
the ``'centering'`` collection; :func:`transport` is the pure mean refresh and
bias transport (Algorithm 1, steps 10-11; eq. 10); :func:`train_step` is one
compiled CBP iteration; :func:`stacked_blocks` tells M1 the layer stacks.

Example::

  model = cbp_optax.linen.center(MyModel())
  variables = model.init(key, x)                # params + 'centering'
  state = cbp_optax.linen.TrainState.create(
      apply_fn=model.apply, params=variables['params'],
      centering=variables['centering'], tx=cbp_optax.cbp(1e-3))
  state, out = cbp_optax.linen.train_step(loss_fn)(state, images, labels)

References:
  Layerwise Conditioned Backpropagation, §4.2, eqs. (8)-(10), Algorithm 1.
"""

try:
  import flax  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised without Flax only
  raise ImportError(
      'cbp_optax.linen needs Flax: pip install "cbp-optax[flax]"') from e

from cbp_optax._step import StepOutput
from cbp_optax.linen._wrapper import Centered
from cbp_optax.linen._wrapper import CenteringMean
from cbp_optax.linen._wrapper import COLLECTION  # noqa: F401  (not in __all__)
from cbp_optax.linen._center import center
from cbp_optax.linen._center import CenteredModel
from cbp_optax.linen._center import stacked_blocks
from cbp_optax.linen._transport import eval_params
from cbp_optax.linen._transport import muon_dimension_numbers
from cbp_optax.linen._transport import transport
from cbp_optax.linen._train_step import train_step
from cbp_optax.linen._train_step import TrainState

__all__ = ['Centered', 'CenteredModel', 'CenteringMean', 'StepOutput',
           'TrainState', 'center', 'eval_params', 'muon_dimension_numbers',
           'stacked_blocks', 'train_step', 'transport']
