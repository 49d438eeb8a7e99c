"""Test-session settings shared by every test file.

The default tier is compile-bound: most tests jit small functions once and run
them for a few steps, so XLA's CPU backend spends more time optimizing machine
code than the code spends running. LLVM optimization level 0 cuts the tier's
CPU time by about a quarter and changes no arithmetic a test checks (bit-exact
comparisons are between two computations compiled the same way, and the float64
reference comparisons hold at 1e-15 either way). It is set before JAX creates
its CPU backend, and through the environment, so the processes tests start
(examples, launched workers) inherit it. A value already in ``XLA_FLAGS`` wins:
``XLA_FLAGS=--xla_backend_optimization_level=2 pytest`` tests the optimized
code.
"""

import os

_OPT_LEVEL_FLAG = '--xla_backend_optimization_level'


def _with_fast_compiles(flags: str) -> str:
  if _OPT_LEVEL_FLAG in flags:
    return flags
  return f'{flags} {_OPT_LEVEL_FLAG}=0'.strip()


os.environ['XLA_FLAGS'] = _with_fast_compiles(os.environ.get('XLA_FLAGS', ''))
