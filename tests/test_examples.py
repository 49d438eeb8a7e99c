"""The runnable entry points: the examples and the ``cbp-optax compare`` job."""

import pathlib
import re
import subprocess
import sys

import pytest

from tests.test_datasets import MNIST_DIR, needs_mnist

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(*args):
  result = subprocess.run(
      [sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
      timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout


@needs_mnist
@pytest.mark.parametrize('script', ['mnist_nnx.py', 'mnist_linen.py'])
def test_example_trains_on_real_mnist(script):
  out = run(f'examples/{script}', '--epochs', '1', '--data-dir',
            str(MNIST_DIR))
  assert 'test set only' in out
  accuracy = float(re.findall(r'test accuracy ([0-9.]+)', out)[-1])
  assert accuracy > 0.8, out


@needs_mnist
def test_compare_job_prints_a_table():
  out = run('-m', 'cbp_optax.cli', 'compare', '--steps', '20', '--width',
            '32', '--data-dir', str(MNIST_DIR))
  lines = [l for l in out.splitlines() if l.startswith('| ')]
  assert [l.split('|')[1].strip() for l in lines[1:]] == [
      'Adam', 'Adam + Center', 'CBP (M1+M2+M3)']


@needs_mnist
@pytest.mark.parametrize('script', ['center_nnx.py', 'center_linen.py'])
def test_one_call_centering_example_trains_the_unmodified_cnn(script):
  out = run(f'examples/{script}', '--steps', '60', '--data-dir',
            str(MNIST_DIR))
  assert re.search(r'centered: .*Conv|centered: conv1', out), out
  accuracy = float(re.findall(r'test accuracy ([0-9.]+)', out)[-1])
  assert accuracy > 0.7, out
