"""The recommended recipe: M2 centering with Muon on the centered model.

References:
  Layerwise Conditioned Backpropagation: A Curvature-Aware
  Reparameterization of the Backward Pass with Convergence Guarantees,
  §4.2, eqs. (8)-(10) (the centering this recipe keeps).
"""

from typing import Any, Callable, Optional, Union

import optax

from cbp_optax import _checks

# Muon's update scaled so that its RMS matches AdamW's: AdamW's tuned
# learning rate then means the same for it.
CONSISTENT_RMS = 0.2


def recommended(
    learning_rate: optax.ScalarOrSchedule,
    *,
    weight_decay: float = 0.01,
    mask: Optional[Union[Any, Callable[[optax.Params], Any]]] = None,
    dimension_numbers: Any = None,
) -> optax.GradientTransformation:
  r"""The recommended recipe's optimizer: Muon, for a centered model.

  The model side is M2 (eqs. 8-10): ``cbp_optax.nnx.center(model)`` or
  ``cbp_optax.linen.center(module)`` with the fused steps' transport (a model
  with BatchNorm is left plain). This builds ``optax.contrib.muon`` with its
  update RMS matched to AdamW's, so a tuned AdamW learning rate is the place
  to start, and decoupled weight decay on the kernels. Algorithm 1 itself is
  :func:`cbp_optax.cbp`; the evidence is in the docs page "Workloads".

  Args:
    learning_rate: a float or an optax schedule (a linear warm-up followed
      by a cosine decay is the usual choice).
    weight_decay: decoupled decay of the Muon leaves.
    mask: which leaves ``weight_decay`` applies to (a tree of bools or a
      function of the parameters), as ``optax.contrib.muon``'s
      ``weight_decay_mask``; None: every Muon leaf.
    dimension_numbers: Muon's weight dimension numbers; for a centered model
      ``cbp_optax.nnx.muon_dimension_numbers(model)`` (or the Linen one).
      None: optax's default (every 2-D leaf is a matrix).

  Returns:
    An ``optax.GradientTransformation``.

  Raises:
    TypeError: a learning rate that is neither a number nor a schedule, or
      a weight decay that is not a number.
    ValueError: a negative learning rate or weight decay.

  Examples:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import cbp_optax as cbp
    >>> model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.relu,
    ...                        nnx.Linear(8, 2, rngs=nnx.Rngs(1)))
    >>> cbp.nnx.center(model).centered
    ['layers/0', 'layers/2']
    >>> tx = cbp.recommended(
    ...     1e-3, dimension_numbers=cbp.nnx.muon_dimension_numbers(model))
    >>> optimizer = cbp.nnx.Optimizer(model, tx)
    >>> step = cbp.nnx.train_step(lambda m, x: jnp.mean(m(x) ** 2))
    >>> bool(step(model, optimizer, jnp.ones((3, 4))).skipped)
    False

  References:
    Layerwise Conditioned Backpropagation: A Curvature-Aware
    Reparameterization of the Backward Pass with Convergence Guarantees,
    §4.2, eqs. (8)-(10).
  """
  factory = 'cbp.recommended'
  _checks.check_nonnegative('learning_rate', learning_rate, schedule_ok=True,
                            factory=factory)
  _checks.check_nonnegative('weight_decay', weight_decay, factory=factory)
  return optax.contrib.muon(
      learning_rate,
      weight_decay=weight_decay,
      weight_decay_mask=mask,
      adam_weight_decay=0.0,
      muon_weight_dimension_numbers=dimension_numbers,
      consistent_rms=CONSISTENT_RMS,
  )
