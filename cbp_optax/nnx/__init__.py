"""Conditioned Backpropagation for Flax NNX: centered layers and the fused step.

:func:`center` wraps every supported layer of a built model in place
(:class:`Centered`), so each computes ``z = W (a - mu) + b~`` (eq. 8);
:func:`transport` refreshes the means and moves the biases so the function is
unchanged (Algorithm 1, steps 10-11; eq. 10); :func:`train_step` is one
compiled CBP iteration; :func:`stacked_blocks` tells M1 the layer stacks.

Example::

  cbp_optax.nnx.center(model)
  optimizer = cbp_optax.nnx.Optimizer(model, cbp_optax.cbp(1e-3))
  step = cbp_optax.nnx.train_step(loss_fn)     # loss_fn(model, *batch)
  out = step(model, optimizer, images, labels)  # out.loss, out.skipped

References:
  Layerwise Conditioned Backpropagation, §4.2, eqs. (8)-(10), Algorithm 1.
"""

try:
  import flax  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised without Flax only
  raise ImportError(
      'cbp_optax.nnx needs Flax: pip install "cbp-optax[flax]"') from e

from cbp_optax._step import StepOutput
from cbp_optax.nnx._wrapper import Centered
from cbp_optax.nnx._wrapper import CenteringMean
from cbp_optax.nnx._center import center
from cbp_optax.nnx._center import centered_layers  # noqa: F401  (not in __all__)
from cbp_optax.nnx._center import CenterReport
from cbp_optax.nnx._center import stacked_blocks
from cbp_optax.nnx._transport import eval_model
from cbp_optax.nnx._transport import muon_dimension_numbers
from cbp_optax.nnx._transport import transport
from cbp_optax.nnx._train_step import Optimizer
from cbp_optax.nnx._train_step import train_step

__all__ = ['CenterReport', 'Centered', 'CenteringMean', 'Optimizer',
           'StepOutput', 'center', 'eval_model', 'muon_dimension_numbers',
           'stacked_blocks', 'train_step', 'transport']
