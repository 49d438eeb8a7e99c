"""Reproduction suite of the paper's studies (§5.6, §6), on the public API.

``cbp-optax reproduce <study|all> [--seeds N] [--quick] [--out DIR]
[--data-dir DIR]``; see :mod:`cbp_optax_experiments.reproduce.cli`. Each study module
(``gradient_norms``, ``conditioning``, ``head_to_head``, ``factorial``,
``quadratic``, ``disparity``, ``depth_training``, ``overhead``, ``mnist``,
``resnet``) has ``NAME``, ``TITLE`` and ``run(StudyContext) -> StudyResult``
and writes ``results.md``, ``results.json`` and PNGs to its folder.
"""
