"""Configurations of the library that only the studies use.

They are spelled out here, not in ``cbp_optax``, so the library's public
surface holds what a user trains with; the studies (the transformer
ablation, the workload suite's ``former_cbp_transformer`` arm) and their
tests measure them.
"""

import cbp_optax as cbp

# What cbp.cbp_transformer was until it became a name of cbp_robust: cbp with
# these arguments changed. The transformer ablation measures each entry alone
# and together; cbp_robust beat the combination there.
TRANSFORMER_COMBINATION = dict(
    damping=1e-8,
    relative_damping=0.03,
    zero_moment_identity=True,
    block_fn=cbp.no_blocks,
)
