"""Conditioned Backpropagation for Flax NNX: centered layers and the fused step.

* :func:`center` wraps every supported layer of a built model in place
  (attention projections and layer stacks included), so the model computes
  ``z = W (a - mu) + b~`` (eq. 8) in every linear layer without editing its
  source.
* :class:`Centered` is that wrapper, for models written with it.
* :func:`transport` refreshes every centering mean and moves the biases so the
  function is unchanged (Algorithm 1, steps 10-11; eq. 10).
* :func:`train_step` builds one compiled CBP iteration (callable on its own
  or inside your ``nnx.jit``).
* :func:`stacked_blocks` tells M1 which parameters are layer stacks.

Example::

  model = MyModel(rngs=nnx.Rngs(0))
  cbp_optax.nnx.center(model)   # every Linear, Conv, attention projection
  optimizer = cbp_optax.nnx.Optimizer(
      model, cbp_optax.cbp(1e-3, stacked=cbp_optax.nnx.stacked_blocks(model)))
  step = cbp_optax.nnx.train_step(loss_fn)     # loss_fn(model, *batch)
  out = step(model, optimizer, images, labels)  # out.loss, out.skipped

References:
  Layerwise Conditioned Backpropagation: A Curvature-Aware Reparameterization
  of the Backward Pass with Convergence Guarantees,
  §4.2, eqs. (8)-(10), and Algorithm 1.
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

__all__ = [
    'CenterReport',
    'Centered',
    'CenteringMean',
    'Optimizer',
    'StepOutput',
    'center',
    'eval_model',
    'muon_dimension_numbers',
    'stacked_blocks',
    'train_step',
    'transport',
]
