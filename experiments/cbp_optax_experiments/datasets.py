"""MNIST (IDX) and CIFAR-10 (binary) readers for the examples and experiments.

Not part of the optimizer: nothing in the transforms or the Flax modules
imports it. Files are read from a directory the user names (gzipped or not),
``$CBP_OPTAX_MNIST`` or the user cache directory; where the network allows,
the full dataset is downloaded into it, verified against known SHA-256
digests and written atomically. A small real subset ships with the package
(``data/mnist_subset.npz``) as the last resort of ``find_mnist(...,
bundled=True)``. Every file is validated (magic
number, dimensions, size, label range) before use; nothing is unpickled.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.resources
import math
import os
import pathlib
import struct
import tempfile
import urllib.request
import zlib
from typing import NamedTuple, Optional, Sequence, Union

import numpy as np

PathLike = Union[str, os.PathLike]

_IMAGES_MAGIC, _LABELS_MAGIC = 2051, 2049
_FILES = {
    'train_images': 'train-images-idx3-ubyte',
    'train_labels': 'train-labels-idx1-ubyte',
    'test_images': 't10k-images-idx3-ubyte',
    'test_labels': 't10k-labels-idx1-ubyte',
}
# SHA-256 of the original gzipped files as published on the mirrors below;
# a download is used only if its digest matches.
_SHA256 = {
    'train-images-idx3-ubyte.gz':
        '440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609',
    'train-labels-idx1-ubyte.gz':
        '3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c',
    't10k-images-idx3-ubyte.gz':
        '8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6',
    't10k-labels-idx1-ubyte.gz':
        'f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6',
}
_MIRRORS = (
    'https://storage.googleapis.com/cvdf-datasets/mnist/',
    'https://ossci-datasets.s3.amazonaws.com/mnist/',
)
TEST_ONLY_TRAIN_SIZE = 8000
_HOW_TO_PASS_DATA = (
    'Put the four files (train-images-idx3-ubyte.gz, '
    'train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz, '
    't10k-labels-idx1-ubyte.gz), or only the two t10k files, in a directory '
    'and pass it with --data-dir DIR (data_dir= in Python) or set '
    '$CBP_OPTAX_MNIST=DIR; or, with network access, allow the download '
    '(download=True; the command-line tools and examples download by '
    'default).'
)


class Mnist(NamedTuple):
  """Images as float32 in [0, 1], shape (N, 28, 28); labels int32 in [0, 9]."""

  train_images: np.ndarray
  train_labels: np.ndarray
  test_images: np.ndarray
  test_labels: np.ndarray
  source: str  # What the split is, for printing beside results.


class DataError(ValueError):
  """A data file is missing, truncated or not what it claims to be."""


def _read_bytes(path: pathlib.Path) -> bytes:
  try:
    if path.suffix == '.gz':
      with gzip.open(path, 'rb') as f:
        return f.read()
    return path.read_bytes()
  except (OSError, EOFError, gzip.BadGzipFile) as e:
    raise DataError(f'{path}: cannot read ({e}).') from e


# Far above the largest MNIST file (47 MB of training images): a header that
# promises more is refused before anything is inflated.
MAX_IDX_BYTES = 1 << 30


def _idx_header(data: bytes, expect_magic: int, name: str):
  """(header length, shape, promised data bytes) of an IDX header prefix."""
  if len(data) < 8:
    raise DataError(f'{name}: {len(data)} bytes is too short for an IDX header.')
  magic = struct.unpack('>I', data[:4])[0]
  if magic != expect_magic:
    raise DataError(
        f'{name}: magic number {magic}, expected {expect_magic} '
        f'({"images" if expect_magic == _IMAGES_MAGIC else "labels"}).'
    )
  ndim = magic & 0xFF
  header = 4 + 4 * ndim
  if len(data) < header:
    raise DataError(f'{name}: truncated header.')
  shape = struct.unpack(f'>{ndim}I', data[4:header])
  expected = math.prod(shape)  # Python ints: no overflow
  if expected > MAX_IDX_BYTES:
    raise DataError(
        f'{name}: header promises {expected:,} bytes for shape {shape}, more '
        f'than the {MAX_IDX_BYTES:,}-byte limit for an IDX file; refused '
        'unread.'
    )
  return header, shape, expected


def parse_idx(data: bytes, *, expect_magic: int, name: str = 'IDX data'):
  """Parses an IDX unsigned-byte file, validating its header and size."""
  header, shape, expected = _idx_header(data, expect_magic, name)
  if len(data) - header != expected:
    raise DataError(
        f'{name}: header promises {expected} bytes of data for shape {shape}, '
        f'file has {len(data) - header}.'
    )
  return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape)


def _read_idx(path: pathlib.Path, expect_magic: int) -> np.ndarray:
  """Reads and parses an IDX file, inflating a gzip only as far as its header
  promises (plus one byte to detect trailing data): a small archive that
  inflates to gigabytes is refused after reading what the header allows."""
  name = str(path)
  try:
    opener = gzip.open if path.suffix == '.gz' else open
    with opener(path, 'rb') as f:
      prefix = f.read(8)
      if len(prefix) >= 4:
        ndim = struct.unpack('>I', prefix[:4])[0] & 0xFF
        prefix += f.read(max(0, 4 + 4 * ndim - len(prefix)))
      header, _, expected = _idx_header(prefix, expect_magic, name)
      data = prefix + f.read(expected - (len(prefix) - header) + 1)
  except (OSError, EOFError, gzip.BadGzipFile, zlib.error) as e:
    raise DataError(f'{path}: cannot read ({e}).') from e
  if len(data) - header > expected:
    raise DataError(
        f'{name}: header promises {expected} bytes of data, the file has '
        'more.'
    )
  return parse_idx(data, expect_magic=expect_magic, name=name)


def _find(directory: pathlib.Path, stem: str) -> Optional[pathlib.Path]:
  for candidate in (directory / stem, directory / f'{stem}.gz'):
    if candidate.is_file():
      return candidate
  return None


def _load_pair(images_path, labels_path):
  images = _read_idx(images_path, _IMAGES_MAGIC)
  labels = _read_idx(labels_path, _LABELS_MAGIC)
  if images.ndim != 3 or images.shape[1:] != (28, 28):
    raise DataError(f'{images_path}: images of shape {images.shape[1:]}, '
                    'expected 28x28.')
  if labels.shape != (images.shape[0],):
    raise DataError(f'{labels_path}: {labels.shape} labels for '
                    f'{images.shape[0]} images.')
  if labels.size and labels.max() > 9:
    raise DataError(f'{labels_path}: label {labels.max()} outside 0-9.')
  return images.astype(np.float32) / 255.0, labels.astype(np.int32)


def _download(directory: pathlib.Path, stem: str) -> pathlib.Path:
  filename = f'{stem}.gz'
  errors = []
  for mirror in _MIRRORS:
    try:
      with urllib.request.urlopen(mirror + filename, timeout=30) as response:
        payload = response.read()
    except OSError as e:
      errors.append(f'{mirror}: {e}')
      continue
    digest = hashlib.sha256(payload).hexdigest()
    if digest != _SHA256[filename]:
      errors.append(f'{mirror}: SHA-256 {digest} != {_SHA256[filename]}')
      continue
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / filename
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f'.{filename}.')
    with os.fdopen(fd, 'wb') as f:
      f.write(payload)
    os.replace(tmp, target)  # atomic: a reader never sees half a file
    return target
  raise DataError(f'Could not download {filename}: ' + '; '.join(errors))


def load_mnist(
    data_dir: PathLike, *, download: bool = False, seed: int = 0
) -> Mnist:
  """Loads MNIST from ``data_dir``.

  With all four standard files present this is the usual 60,000 / 10,000
  split. With only the test files (``t10k-*``, as in an offline copy) the
  10,000 images are split 8,000 / 2,000 by a fixed permutation (``seed``), and
  :attr:`Mnist.source` says so.

  Args:
    data_dir: directory with the IDX files, gzipped or not.
    download: fetch missing files of the full dataset into ``data_dir`` when
      the network allows (SHA-256-verified, atomic writes); if that fails and the
      test files are there, the test-only split is used and ``source`` says
      why.
    seed: permutation seed of the test-only split.

  Raises:
    DataError: files missing (and not downloadable) or invalid.
  """
  directory = pathlib.Path(data_dir).expanduser()
  paths = {key: _find(directory, stem) for key, stem in _FILES.items()}
  note = ''
  if download and not all(paths.values()):
    try:
      for key, stem in _FILES.items():
        if paths[key] is None:
          paths[key] = _download(directory, stem)
    except (DataError, OSError) as e:
      if not (paths['test_images'] and paths['test_labels']):
        raise DataError(
            f'No MNIST IDX files in {directory}, and downloading them failed '
            f'({e}). {_HOW_TO_PASS_DATA}'
        ) from e
      # Offline: fall back to the test files, and say so in `source`.
      note = '; the full set could not be downloaded'
  if paths['train_images'] and paths['train_labels'] and paths['test_images'] \
      and paths['test_labels']:
    train = _load_pair(paths['train_images'], paths['train_labels'])
    test = _load_pair(paths['test_images'], paths['test_labels'])
    return Mnist(*train, *test,
                 source=f'MNIST, full 60,000/10,000 split ({directory})')
  if paths['test_images'] and paths['test_labels']:
    images, labels = _load_pair(paths['test_images'], paths['test_labels'])
    order = np.random.default_rng(seed).permutation(len(labels))
    cut = TEST_ONLY_TRAIN_SIZE * len(labels) // 10000
    if cut == 0 or cut == len(labels):
      raise DataError(
          f'{paths["test_images"]}: {len(labels)} image(s) cannot be split '
          f'{TEST_ONLY_TRAIN_SIZE}:{10000 - TEST_ONLY_TRAIN_SIZE} into a '
          'non-empty training and test set; the test-only split needs at '
          'least 2 images (MNIST\'s test set has 10,000).'
      )
    train, test = order[:cut], order[cut:]
    return Mnist(
        images[train], labels[train], images[test], labels[test],
        source=(f'MNIST test set only ({len(labels):,} real images), fixed '
                f'{len(train):,}/{len(test):,} split, seed {seed} '
                f'({directory}){note}'),
    )
  raise DataError(
      f'No MNIST IDX files in {directory} (looked for '
      f'{", ".join(_FILES.values())}, optionally .gz); pass a directory that '
      'has them, or allow downloading. ' + _HOW_TO_PASS_DATA
  )


def default_mnist_dirs() -> Sequence[pathlib.Path]:
  """Where MNIST is looked for when no directory is given, in order.

  Returns:
    ``$CBP_OPTAX_MNIST`` when set, then the user cache directory
    (``$XDG_CACHE_HOME/cbp_optax/mnist``, by default
    ``~/.cache/cbp_optax/mnist``), which is also where a download goes.
  """
  dirs = []
  if os.environ.get('CBP_OPTAX_MNIST'):
    dirs.append(pathlib.Path(os.environ['CBP_OPTAX_MNIST']).expanduser())
  cache = os.environ.get('XDG_CACHE_HOME') or pathlib.Path.home() / '.cache'
  dirs.append(pathlib.Path(cache) / 'cbp_optax' / 'mnist')
  return dirs


BUNDLED_MNIST = 'data/mnist_subset.npz'  # inside the package, see data/README.md


def load_bundled_mnist() -> Mnist:
  """The small real-MNIST subset shipped inside the package.

  2,000 training and 500 test images drawn from the MNIST test set (see
  ``cbp_optax_experiments/data/README.md`` for how, and for the CC BY-SA 3.0 licence of
  MNIST by Yann LeCun, Corinna Cortes and Christopher J.C. Burges). Enough to
  try the command-line tools offline; not a benchmark.

  Returns:
    The subset as :class:`Mnist`; ``source`` names it.

  Raises:
    DataError: the file is missing from the installation or invalid.
  """
  resource = importlib.resources.files(__package__).joinpath(BUNDLED_MNIST)
  try:
    with resource.open('rb') as f, np.load(f, allow_pickle=False) as npz:
      arrays = {key: npz[key] for key in (
          'train_images', 'train_labels', 'test_images', 'test_labels')}
  except (OSError, KeyError, ValueError) as e:
    raise DataError(f'bundled MNIST subset {resource}: cannot read ({e}).'
                    ) from e
  for split in ('train', 'test'):
    images, labels = arrays[f'{split}_images'], arrays[f'{split}_labels']
    if (images.dtype != np.uint8 or images.ndim != 3
        or images.shape[1:] != (28, 28) or labels.shape != images.shape[:1]
        or labels.max() > 9):
      raise DataError(f'bundled MNIST subset {resource}: {split} split is not '
                      '28x28 uint8 images with labels 0-9.')
  return Mnist(
      arrays['train_images'].astype(np.float32) / 255.0,
      arrays['train_labels'].astype(np.int32),
      arrays['test_images'].astype(np.float32) / 255.0,
      arrays['test_labels'].astype(np.int32),
      source=(f'MNIST subset bundled with cbp_optax ('
              f'{len(arrays["train_labels"]):,}/{len(arrays["test_labels"]):,}'
              ' real images from the MNIST test set; not a benchmark)'),
  )


def find_mnist(data_dir: Optional[PathLike] = None, *,
               download: bool = True, bundled: bool = False) -> Mnist:
  """Finds MNIST: in ``data_dir``, else in the default directories.

  Without ``data_dir``, the first of :func:`default_mnist_dirs` that holds
  the test files is used; otherwise the full set is downloaded into the last
  one (the user cache) when ``download`` allows.

  Args:
    data_dir: directory with the IDX files; when given, only it is used.
    download: allow downloading into ``data_dir`` or the user cache.
    bundled: when nothing is found (and downloading is not allowed or
      fails), fall back to the subset shipped with the package
      (:func:`load_bundled_mnist`) instead of raising; ``source`` then says
      that and why. Not used when ``data_dir`` is given.

  Returns:
    The dataset; its ``source`` says which files it came from.

  Raises:
    DataError: no data found, or the files are invalid.
  """
  if data_dir is not None:
    return load_mnist(data_dir, download=download)
  candidates = default_mnist_dirs()
  for directory in candidates:
    if _find(directory, _FILES['test_images']):
      return load_mnist(directory)
  try:
    return load_mnist(candidates[-1], download=download)
  except DataError as e:
    searched = ', '.join(dict.fromkeys(str(d.resolve()) for d in candidates))
    if bundled:
      data = load_bundled_mnist()
      why = ('the full set could not be downloaded' if download else
             'downloading was not allowed')
      return data._replace(source=(
          f'{data.source}; no MNIST files in {searched} and {why}: set '
          '$CBP_OPTAX_MNIST or pass --data-dir for real runs'))
    raise DataError(
        f'MNIST not found: none of the default directories holds the IDX '
        f'files (searched {searched}'
        f'{"" if download else "; downloading was not allowed"}). {e}'
    ) from e


# --- CIFAR-10, binary distribution -------------------------------------------
# ``cifar-10-batches-bin`` holds data_batch_1.bin .. data_batch_5.bin and
# test_batch.bin; each record is one label byte (0..9) and 3072 pixel bytes,
# the 32x32 red, green and blue planes in row-major order. Only these raw bytes
# are parsed (never the Python-pickle distribution).

CIFAR10_RECORD_BYTES = 1 + 3 * 32 * 32
CIFAR10_RECORDS_PER_FILE = 10_000
CIFAR10_TRAIN_FILES = tuple(f'data_batch_{i}.bin' for i in range(1, 6))
CIFAR10_TEST_FILE = 'test_batch.bin'


class Cifar10(NamedTuple):
  """Images float32 in [0, 1], shape (N, 32, 32, 3); labels int32."""
  train_images: np.ndarray
  train_labels: np.ndarray
  test_images: np.ndarray
  test_labels: np.ndarray
  source: str


def parse_cifar10_batch(
    data: bytes, name: str = 'CIFAR-10 batch'
) -> tuple[np.ndarray, np.ndarray]:
  """Records -> (images (N, 32, 32, 3) float32 in [0, 1], labels int32)."""
  if len(data) == 0 or len(data) % CIFAR10_RECORD_BYTES:
    raise DataError(
        f'{name}: {len(data)} bytes is not a whole number of '
        f'{CIFAR10_RECORD_BYTES}-byte records')
  records = np.frombuffer(data, np.uint8).reshape(-1, CIFAR10_RECORD_BYTES)
  labels = records[:, 0].astype(np.int32)
  if labels.max() > 9:
    raise DataError(f'{name}: label {int(labels.max())} outside 0..9')
  planes = records[:, 1:].reshape(-1, 3, 32, 32)
  images = planes.transpose(0, 2, 3, 1).astype(np.float32) / 255.0
  return images, labels


def find_cifar10(data_dir: PathLike) -> Optional[pathlib.Path]:
  """``data_dir`` or its ``cifar-10-batches-bin`` child, if it holds the files."""
  root = pathlib.Path(data_dir).expanduser()
  for candidate in (root, root / 'cifar-10-batches-bin',
                    root / 'cifar10' / 'cifar-10-batches-bin'):
    files = CIFAR10_TRAIN_FILES + (CIFAR10_TEST_FILE,)
    if all((candidate / f).is_file() for f in files):
      return candidate
  return None


def load_cifar10(data_dir: PathLike) -> Cifar10:
  """Loads the 50,000 / 10,000 split; raises :class:`DataError` otherwise."""
  directory = find_cifar10(data_dir)
  if directory is None:
    raise DataError(f'no CIFAR-10 binary files under {data_dir}')

  def read(name: str):
    data = _read_bytes(directory / name)
    if len(data) != CIFAR10_RECORDS_PER_FILE * CIFAR10_RECORD_BYTES:
      raise DataError(
          f'{name}: expected {CIFAR10_RECORDS_PER_FILE} records, got '
          f'{len(data) / CIFAR10_RECORD_BYTES:g}')
    return parse_cifar10_batch(data, name)

  train = [read(name) for name in CIFAR10_TRAIN_FILES]
  test_images, test_labels = read(CIFAR10_TEST_FILE)
  return Cifar10(np.concatenate([t[0] for t in train]),
                 np.concatenate([t[1] for t in train]), test_images,
                 test_labels, source=f'CIFAR-10, 50,000/10,000 ({directory})')


# --- Tabular data bundled inside scikit-learn ---------------------------------
# Only the loaders whose files ship inside the scikit-learn package are used
# (no download): the experiments extra installs it.

BUNDLED_TABULAR = ('breast_cancer', 'digits')


class Tabular(NamedTuple):
  """Raw features (float32, unscaled) and integer labels."""
  features: np.ndarray
  labels: np.ndarray
  source: str


def load_bundled_tabular(name: str) -> Tabular:
  """A classification data set shipped inside scikit-learn, features raw.

  Args:
    name: ``'breast_cancer'`` (569 tumours, 30 measurements on scales from
      0.001 to 4,000; 2 classes) or ``'digits'`` (1,797 8x8 images, pixel
      counts 0-16; 10 classes).

  Raises:
    DataError: an unknown name, or scikit-learn is not installed.
  """
  if name not in BUNDLED_TABULAR:
    raise DataError(f'unknown bundled tabular data set {name!r}; choose '
                    f'from {", ".join(BUNDLED_TABULAR)}')
  try:
    from sklearn import datasets as sklearn_datasets  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise DataError(
        f'the {name} data set ships inside scikit-learn, which is not '
        'installed: pip install ./experiments (or scikit-learn)'
    ) from e
  found = getattr(sklearn_datasets, f'load_{name}')()
  return Tabular(np.asarray(found.data, np.float32),
                 np.asarray(found.target, np.int32),
                 f'scikit-learn load_{name} (bundled with the package; '
                 f'{len(found.target):,} examples, raw features)')
