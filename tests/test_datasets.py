"""The MNIST IDX reader: real data, and files that are not what they claim."""

import gzip
import pathlib
import struct

import numpy as np
import pytest

from cbp_optax import datasets

MNIST_DIR = pathlib.Path(__file__).resolve().parents[1] / '../shared/data/mnist'
needs_mnist = pytest.mark.skipif(
    not (MNIST_DIR / 't10k-images-idx3-ubyte.gz').is_file(),
    reason=f'real MNIST test set not found at {MNIST_DIR}')


def idx_bytes(array, magic):
  header = struct.pack('>I', magic) + b''.join(
      struct.pack('>I', d) for d in array.shape)
  return header + array.astype(np.uint8).tobytes()


def write_pair(directory, images, labels, gz=False):
  for stem, payload in (
      ('t10k-images-idx3-ubyte', idx_bytes(images, 2051)),
      ('t10k-labels-idx1-ubyte', idx_bytes(labels, 2049))):
    path = directory / (stem + ('.gz' if gz else ''))
    path.write_bytes(gzip.compress(payload) if gz else payload)


@needs_mnist
def test_real_mnist_test_set_split():
  data = datasets.load_mnist(MNIST_DIR)
  assert data.train_images.shape == (8000, 28, 28)
  assert data.test_images.shape == (2000, 28, 28)
  assert data.train_images.dtype == np.float32
  assert 0.0 <= data.train_images.min() and data.train_images.max() <= 1.0
  assert set(np.unique(data.train_labels)) == set(range(10))
  assert 'test set only' in data.source
  again = datasets.load_mnist(MNIST_DIR)
  np.testing.assert_array_equal(again.test_labels, data.test_labels)


@pytest.mark.parametrize('gz', [False, True])
def test_user_directory_roundtrip(tmp_path, gz):
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (50, 28, 28))
  labels = rng.integers(0, 10, 50)
  write_pair(tmp_path, images, labels, gz=gz)
  data = datasets.load_mnist(tmp_path)
  assert len(data.train_labels) == 40 and len(data.test_labels) == 10
  restored = np.concatenate([data.train_images, data.test_images]) * 255
  assert sorted(map(int, restored.sum(axis=(1, 2)).round())) == sorted(
      map(int, images.sum(axis=(1, 2))))


def test_missing_directory_is_a_clear_error(tmp_path):
  with pytest.raises(datasets.DataError, match='No MNIST IDX files'):
    datasets.load_mnist(tmp_path)


@pytest.mark.parametrize('corrupt, match', [
    (lambda b: b[:-5], 'promises'),
    (lambda b: b[:6], 'too short|truncated'),
    (lambda b: struct.pack('>I', 2049) + b[4:], 'magic'),
])
def test_corrupted_images_are_refused(tmp_path, corrupt, match):
  write_pair(tmp_path, np.zeros((4, 28, 28)), np.zeros(4))
  path = tmp_path / 't10k-images-idx3-ubyte'
  path.write_bytes(corrupt(path.read_bytes()))
  with pytest.raises(datasets.DataError, match=match):
    datasets.load_mnist(tmp_path)


def test_out_of_range_labels_are_refused(tmp_path):
  write_pair(tmp_path, np.zeros((4, 28, 28)), np.array([0, 1, 2, 11]))
  with pytest.raises(datasets.DataError, match='outside 0-9'):
    datasets.load_mnist(tmp_path)


def test_mismatched_counts_are_refused(tmp_path):
  write_pair(tmp_path, np.zeros((4, 28, 28)), np.zeros(3))
  with pytest.raises(datasets.DataError, match='labels for'):
    datasets.load_mnist(tmp_path)


def test_random_bytes_never_crash_the_reader():
  rng = np.random.default_rng(0)
  for _ in range(200):
    blob = rng.integers(0, 256, rng.integers(0, 64)).astype(np.uint8).tobytes()
    with pytest.raises(datasets.DataError):
      datasets.parse_idx(blob, expect_magic=2051)


def test_download_is_verified_and_atomic(tmp_path, monkeypatch):
  """A tampered download is refused and nothing is written; a good one is
  written whole. The network is replaced by an in-memory server."""
  good = gzip.compress(idx_bytes(np.zeros((2, 28, 28)), 2051))
  served = {'payload': good}

  class Response:
    def __init__(self, payload):
      self.payload = payload
    def read(self):
      return self.payload
    def __enter__(self):
      return self
    def __exit__(self, *exc):
      return False

  monkeypatch.setattr(datasets.urllib.request, 'urlopen',
                      lambda url, timeout: Response(served['payload']))
  monkeypatch.setitem(datasets._SHA256, 't10k-images-idx3-ubyte.gz',
                      __import__('hashlib').sha256(good).hexdigest())
  path = datasets._download(tmp_path, 't10k-images-idx3-ubyte')
  assert path.read_bytes() == good
  path.unlink()
  served['payload'] = good[:-3] + b'bad'
  with pytest.raises(datasets.DataError, match='SHA-256'):
    datasets._download(tmp_path, 't10k-images-idx3-ubyte')
  assert list(tmp_path.iterdir()) == []


def test_truncated_gzip_is_refused(tmp_path):
  write_pair(tmp_path, np.zeros((4, 28, 28)), np.zeros(4), gz=True)
  path = tmp_path / 't10k-images-idx3-ubyte.gz'
  path.write_bytes(path.read_bytes()[:40])
  with pytest.raises(datasets.DataError, match='cannot read'):
    datasets.load_mnist(tmp_path)


def cifar_record(label, red=0):
  record = np.zeros(datasets.CIFAR10_RECORD_BYTES, np.uint8)
  record[0] = label
  record[1:1025] = red  # the red plane comes first
  return record.tobytes()


def test_cifar10_records_parse_channels_last():
  images, labels = datasets.parse_cifar10_batch(
      cifar_record(7, red=255) + cifar_record(3))
  assert labels.tolist() == [7, 3]
  assert images.shape == (2, 32, 32, 3)
  assert images[0, :, :, 0].min() == 1.0 and images[0, :, :, 1:].max() == 0.0


def test_cifar10_directory_roundtrip_and_validation(tmp_path):
  one_file = cifar_record(1) * datasets.CIFAR10_RECORDS_PER_FILE
  for name in datasets.CIFAR10_TRAIN_FILES + (datasets.CIFAR10_TEST_FILE,):
    (tmp_path / name).write_bytes(one_file)
  data = datasets.load_cifar10(tmp_path)
  assert data.train_images.shape == (50_000, 32, 32, 3)
  assert set(np.unique(data.test_labels)) == {1}
  (tmp_path / 'test_batch.bin').write_bytes(one_file[:-1])
  with pytest.raises(datasets.DataError, match='whole number|expected'):
    datasets.load_cifar10(tmp_path)
  (tmp_path / 'test_batch.bin').unlink()
  with pytest.raises(datasets.DataError, match='no CIFAR-10'):
    datasets.load_cifar10(tmp_path)


def test_random_bytes_never_crash_the_cifar10_reader():
  rng = np.random.default_rng(1)
  for _ in range(200):
    size = int(rng.choice([0, 1, 3072, 3073, 3074, 6146]))
    blob = rng.integers(0, 256, size).astype(np.uint8).tobytes()
    try:
      images, labels = datasets.parse_cifar10_batch(blob)
    except datasets.DataError:
      continue
    assert len(blob) % datasets.CIFAR10_RECORD_BYTES == 0
    assert labels.max() <= 9 and images.max() <= 1.0
