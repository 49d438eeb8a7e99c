"""Test-session settings of the experiments' tests: the library's.

The library's ``tests/conftest.py`` compiles at XLA's LLVM optimization level
0 (its docstring says why) through ``XLA_FLAGS``, before JAX creates its CPU
backend; importing it here applies the same setting when only these tests
run. This directory has no ``__init__.py``: a package here would be a second
``tests`` package beside the library's. The repository root is on the path
(``pythonpath`` in pyproject.toml), so ``tests`` is the library's test package
and its helpers (``tests.mnist``, ``tests.numpy_reference``) import from here.
"""

from tests import conftest  # noqa: F401  (sets XLA_FLAGS)
