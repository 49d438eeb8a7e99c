"""CIFAR-10 in its standard binary format, read and validated without pickle.

The binary distribution (``cifar-10-batches-bin``) holds ``data_batch_1.bin``
.. ``data_batch_5.bin`` and ``test_batch.bin``; each record is one label byte
(0..9) followed by 3072 pixel bytes, the 32x32 red, green and blue planes in
row-major order. Only these raw bytes are parsed (never the Python-pickle
distribution), and every file is checked for size and label range.
"""

from __future__ import annotations

import pathlib
from typing import NamedTuple, Optional, Union

import numpy as np

RECORD_BYTES = 1 + 3 * 32 * 32
RECORDS_PER_FILE = 10_000
TRAIN_FILES = tuple(f'data_batch_{i}.bin' for i in range(1, 6))
TEST_FILE = 'test_batch.bin'


class Cifar10(NamedTuple):
  """Images float32 in [0, 1], shape (N, 32, 32, 3); labels int32."""
  train_images: np.ndarray
  train_labels: np.ndarray
  test_images: np.ndarray
  test_labels: np.ndarray
  source: str


class Cifar10Error(ValueError):
  """Missing or malformed CIFAR-10 binary files."""


def parse_batch(data: bytes, name: str = 'CIFAR-10 batch'
                ) -> tuple[np.ndarray, np.ndarray]:
  """Records -> (images (N, 32, 32, 3) float32 in [0, 1], labels int32)."""
  if len(data) == 0 or len(data) % RECORD_BYTES:
    raise Cifar10Error(
        f'{name}: {len(data)} bytes is not a whole number of '
        f'{RECORD_BYTES}-byte records')
  records = np.frombuffer(data, np.uint8).reshape(-1, RECORD_BYTES)
  labels = records[:, 0].astype(np.int32)
  if labels.max() > 9:
    raise Cifar10Error(f'{name}: label {int(labels.max())} outside 0..9')
  planes = records[:, 1:].reshape(-1, 3, 32, 32)
  images = planes.transpose(0, 2, 3, 1).astype(np.float32) / 255.0
  return images, labels


def find_directory(data_dir: Union[str, pathlib.Path]) -> Optional[pathlib.Path]:
  """``data_dir`` or its ``cifar-10-batches-bin`` child, if it holds the files."""
  root = pathlib.Path(data_dir).expanduser()
  for candidate in (root, root / 'cifar-10-batches-bin',
                    root / 'cifar10' / 'cifar-10-batches-bin'):
    if all((candidate / f).is_file() for f in TRAIN_FILES + (TEST_FILE,)):
      return candidate
  return None


def load_cifar10(data_dir: Union[str, pathlib.Path]) -> Cifar10:
  """Loads the 50,000 / 10,000 split; raises :class:`Cifar10Error` otherwise."""
  directory = find_directory(data_dir)
  if directory is None:
    raise Cifar10Error(f'no CIFAR-10 binary files under {data_dir}')

  def read(name: str):
    data = (directory / name).read_bytes()
    if len(data) != RECORDS_PER_FILE * RECORD_BYTES:
      raise Cifar10Error(f'{name}: expected {RECORDS_PER_FILE} records, got '
                         f'{len(data) / RECORD_BYTES:g}')
    return parse_batch(data, name)

  train = [read(name) for name in TRAIN_FILES]
  test_images, test_labels = read(TEST_FILE)
  return Cifar10(np.concatenate([t[0] for t in train]),
                 np.concatenate([t[1] for t in train]), test_images,
                 test_labels, source=f'CIFAR-10, 50,000/10,000 ({directory})')
