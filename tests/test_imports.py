"""The slim core: ``import cbp_optax`` needs jax and optax, never Flax.

Flax is the ``flax`` extra; the adapters ``cbp_optax.nnx`` and
``cbp_optax.linen`` are imported on first use, and without Flax they say
which extra to install.
"""

import json
import pathlib
import subprocess
import sys

import pytest

tomllib = pytest.importorskip('tomllib')

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The framework-free core: the optimizer transforms and M2's maths.
CORE = ('cbp_optax', 'cbp_optax.centering', 'cbp_optax._opt_state',
        'cbp_optax._step', 'cbp_optax._untransported', 'cbp_optax.blocks')


def run_python(code: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, '-c', code], cwd=ROOT,
                        capture_output=True, text=True, timeout=300,
                        check=False)


def loaded_modules(code: str) -> list[str]:
  result = run_python(code + '\nimport json, sys\n'
                      'print(json.dumps(sorted(sys.modules)))')
  assert result.returncode == 0, result.stderr
  return json.loads(result.stdout.strip().splitlines()[-1])


def test_importing_the_core_imports_no_flax_or_orbax():
  loaded = loaded_modules(f'import {", ".join(CORE)}')
  assert 'cbp_optax.centering' in loaded
  leaked = [m for m in loaded if m.startswith(('flax', 'orbax'))]
  assert not leaked, f'importing the core loaded {leaked[:5]}'
  adapters = [m for m in loaded if m.startswith(('cbp_optax.nnx',
                                                 'cbp_optax.linen'))]
  assert not adapters, adapters


def test_the_adapters_load_on_first_attribute_access():
  loaded = loaded_modules(
      'import cbp_optax\n'
      'assert callable(cbp_optax.nnx.center)\n'
      'assert callable(cbp_optax.linen.center)\n'
      "assert 'nnx' in dir(cbp_optax)")
  assert 'cbp_optax.nnx' in loaded and 'cbp_optax.linen' in loaded
  assert 'flax' in loaded


def test_an_adapter_without_flax_names_the_extra():
  for api in ('nnx', 'linen'):
    result = run_python(
        "import sys\nsys.modules['flax'] = None\n"  # as if not installed
        'import cbp_optax\n'
        'try:\n'
        f'  cbp_optax.{api}\n'
        'except ImportError as e:\n'
        '  print(e)\n'
        'else:\n'
        "  raise SystemExit('no ImportError')")
    assert result.returncode == 0, result.stderr + result.stdout
    assert 'pip install "cbp-optax[flax]"' in result.stdout, result.stdout


def test_flax_and_orbax_are_extras_not_core_dependencies():
  project = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']
  core = ' '.join(project['dependencies'])
  assert 'flax' not in core and 'orbax' not in core, core
  extras = project['optional-dependencies']
  assert extras['flax'] == ['flax>=0.11']
  for extra in ('test',):
    assert 'flax>=0.11' in extras[extra]
    assert 'orbax-checkpoint>=0.6' in extras[extra]
