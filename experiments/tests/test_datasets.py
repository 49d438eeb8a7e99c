"""The MNIST IDX reader: real data, and files that are not what they claim.

Real MNIST is found only through ``$CBP_OPTAX_MNIST`` (a directory with the
IDX test files, ``t10k-*-idx?-ubyte.gz``); tests that need it skip when it is
not set or the directory lacks them.
"""

import gzip
import hashlib
import pathlib
import struct

import numpy as np
import pytest

from cbp_optax_experiments import datasets
from tests.mnist import MNIST_DIR
from tests.mnist import needs_mnist


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
                      hashlib.sha256(good).hexdigest())
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


# --- where MNIST is looked for, and the bundled subset ------------------------


def _offline(monkeypatch):
  def urlopen(url, timeout):
    raise OSError(f'no network for {url}')
  monkeypatch.setattr(datasets.urllib.request, 'urlopen', urlopen)


def test_default_dirs_come_from_the_environment_only(tmp_path, monkeypatch):
  monkeypatch.setenv('CBP_OPTAX_MNIST', str(tmp_path / 'mine'))
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'cache'))
  assert datasets.default_mnist_dirs() == [
      tmp_path / 'mine', tmp_path / 'cache' / 'cbp_optax' / 'mnist']
  monkeypatch.delenv('CBP_OPTAX_MNIST')
  monkeypatch.delenv('XDG_CACHE_HOME')
  assert datasets.default_mnist_dirs() == [
      pathlib.Path.home() / '.cache' / 'cbp_optax' / 'mnist']


def test_env_var_directory_is_used(tmp_path, monkeypatch):
  rng = np.random.default_rng(0)
  write_pair(tmp_path, rng.integers(0, 256, (20, 28, 28)),
             rng.integers(0, 10, 20))
  monkeypatch.setenv('CBP_OPTAX_MNIST', str(tmp_path))
  _offline(monkeypatch)
  data = datasets.find_mnist(None, download=True, bundled=True)
  assert str(tmp_path) in data.source and 'bundled' not in data.source
  assert len(data.train_labels) + len(data.test_labels) == 20


def test_bundled_subset_is_real_mnist_and_small():
  path = pathlib.Path(datasets.__file__).parent / datasets.BUNDLED_MNIST
  assert path.stat().st_size < 1_000_000
  data = datasets.load_bundled_mnist()
  assert data.train_images.shape == (2000, 28, 28)
  assert data.test_images.shape == (500, 28, 28)
  assert data.train_images.dtype == np.float32
  assert 0.0 <= data.train_images.min() and data.train_images.max() == 1.0
  assert set(np.unique(data.train_labels)) == set(range(10))
  assert set(np.unique(data.test_labels)) == set(range(10))
  # Drawn without replacement from one set: train and test are disjoint.
  with np.load(path) as npz:
    assert not set(npz['train_index']) & set(npz['test_index'])
  # Real digits, not noise: every image has ink on a mostly blank page.
  ink = (data.train_images > 0.5).mean(axis=(1, 2))
  assert 0.03 < ink.min() and ink.max() < 0.5
  assert 'bundled' in data.source
  licence = path.with_name('README.md').read_text()
  assert 'CC BY-SA 3.0' in licence and 'LeCun' in licence


@pytest.mark.parametrize('download', [True, False])
def test_find_mnist_falls_back_to_the_bundled_subset_offline(
    tmp_path, monkeypatch, download):
  """No env var, an empty cache, no network: the bundled subset, and
  ``source`` says so and why; without ``bundled`` it is an error."""
  monkeypatch.delenv('CBP_OPTAX_MNIST', raising=False)
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path))
  _offline(monkeypatch)
  data = datasets.find_mnist(None, download=download, bundled=True)
  assert len(data.train_labels) == 2000 and len(data.test_labels) == 500
  assert 'bundled' in data.source and 'CBP_OPTAX_MNIST' in data.source
  assert str(tmp_path / 'cbp_optax' / 'mnist') in data.source
  assert ('could not be downloaded' if download
          else 'downloading was not allowed') in data.source
  with pytest.raises(datasets.DataError, match='MNIST not found'):
    datasets.find_mnist(None, download=download)


def test_a_named_directory_never_falls_back(tmp_path, monkeypatch):
  _offline(monkeypatch)
  with pytest.raises(datasets.DataError, match='No MNIST IDX files'):
    datasets.find_mnist(tmp_path, download=True, bundled=True)


# --- bad files and offline errors (issue's items 17 and 18) -----------------------


def idx(shape, magic=2051, payload=b''):
  return struct.pack('>I', magic) + b''.join(
      struct.pack('>I', d) for d in shape) + payload


def test_overflowing_header_is_a_data_error():
  with pytest.raises(datasets.DataError, match='header promises'):
    datasets.parse_idx(idx((2**31, 2**31, 2**31)), expect_magic=2051)


def test_gzip_bomb_is_inflated_only_as_far_as_the_header_promises(
    tmp_path, monkeypatch):
  header_and_images = idx((4, 28, 28), payload=bytes(4 * 28 * 28))
  bomb = gzip.compress(header_and_images + bytes(32 << 20), compresslevel=1)
  (tmp_path / 't10k-images-idx3-ubyte.gz').write_bytes(bomb)
  (tmp_path / 't10k-labels-idx1-ubyte').write_bytes(
      idx((4,), magic=2049, payload=bytes(4)))
  inflated = []
  real_open = gzip.open

  class Counting:

    def __init__(self, f):
      self.f = f

    def read(self, *size):
      data = self.f.read(*size)
      inflated.append(len(data))
      return data

    def __enter__(self):
      return self

    def __exit__(self, *exc):
      self.f.close()

  monkeypatch.setattr(datasets.gzip, 'open',
                      lambda *a, **k: Counting(real_open(*a, **k)))
  with pytest.raises(datasets.DataError, match='t10k-images.*promises'):
    datasets.load_mnist(tmp_path)
  assert sum(inflated) <= len(header_and_images) + 1


def test_header_beyond_the_size_limit_is_refused_unread():
  with pytest.raises(datasets.DataError, match='limit'):
    datasets.parse_idx(idx((60000, 28, 28, 28, 28), magic=2053),
                       expect_magic=2053)


def test_too_few_test_images_for_a_split_is_refused(tmp_path):
  (tmp_path / 't10k-images-idx3-ubyte').write_bytes(
      idx((1, 28, 28), payload=bytes(28 * 28)))
  (tmp_path / 't10k-labels-idx1-ubyte').write_bytes(
      idx((1,), magic=2049, payload=bytes(1)))
  with pytest.raises(datasets.DataError, match='1 image.*at least 2'):
    datasets.load_mnist(tmp_path)


def test_offline_without_data_says_where_it_looked_and_what_to_do(
    tmp_path, monkeypatch):
  dirs = [tmp_path / 'first', tmp_path / 'cache']
  monkeypatch.setattr(datasets, 'default_mnist_dirs', lambda: dirs)

  def offline(url, timeout):
    raise OSError(f'no network for {url}')

  monkeypatch.setattr(datasets.urllib.request, 'urlopen', offline)
  for download in (True, False):
    with pytest.raises(datasets.DataError) as info:
      datasets.find_mnist(None, download=download)
    message = str(info.value)
    assert str(dirs[0].resolve()) in message and str(dirs[1].resolve()) in message
    assert '--data-dir' in message and '$CBP_OPTAX_MNIST' in message
  with pytest.raises(datasets.DataError, match='downloading them failed.*'
                     '--data-dir'):
    datasets.load_mnist(tmp_path / 'given', download=True)
