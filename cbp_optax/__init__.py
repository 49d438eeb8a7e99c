"""cbp_optax: Conditioned Backpropagation for JAX, Optax and Flax.

Optimizer side (optax transforms): :func:`equalize` (M1, eqs. 5-7),
:func:`precondition` (M3, eqs. 11-12), :func:`precondition_kron` (M3 in
Kronecker-factored eigenbases, §8.2), :func:`cbp`, :func:`cbp_robust` and
:func:`cbp_kron` (chained with a learning rate, Algorithm 1) and
:func:`recommended`. Model side (M2 centering, the fused train step):
``cbp_optax.nnx`` and ``cbp_optax.linen``, imported on first use (Flax).
"""

import importlib

from cbp_optax import blocks
from cbp_optax import centering
from cbp_optax._alias import cbp
from cbp_optax._alias import cbp_kron
from cbp_optax._alias import cbp_robust
from cbp_optax._recipe import recommended
from cbp_optax.blocks import block_names
from cbp_optax.blocks import kernel_blocks
from cbp_optax.blocks import layer_blocks
from cbp_optax.blocks import leaf_blocks
from cbp_optax.blocks import no_blocks
from cbp_optax._equalize import BlockStats
from cbp_optax._equalize import equalize
from cbp_optax._equalize_stats import equalize_stats
from cbp_optax._equalize import EqualizeState
from cbp_optax._precondition import precondition
from cbp_optax._precondition import PreconditionState
from cbp_optax._precondition_kron import KronPreconditionState
from cbp_optax._precondition_kron import precondition_kron

# The package's own states hold gradient statistics only.
centering.register_parameter_state(EqualizeState)
centering.register_parameter_state(PreconditionState)
centering.register_parameter_state(KronPreconditionState)

__version__ = '0.1.0'

__all__ = ('BlockStats', 'EqualizeState', 'KronPreconditionState',
           'PreconditionState', 'block_names', 'blocks', 'cbp', 'cbp_kron',
           'cbp_robust', 'centering', 'equalize', 'equalize_stats',
           'kernel_blocks', 'layer_blocks', 'leaf_blocks', 'linen', 'nnx',
           'no_blocks', 'precondition', 'precondition_kron', 'recommended')

# Imported on first use: the Flax adapters (Flax is an optional extra).
_LAZY_MODULES = frozenset({'linen', 'nnx'})


def __getattr__(name: str):
  if name in _LAZY_MODULES:
    return importlib.import_module(f'cbp_optax.{name}')
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def __dir__() -> list[str]:
  return sorted(set(globals()) | _LAZY_MODULES)
