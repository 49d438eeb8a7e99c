"""The workloads beyond the original seven: the families the suite lacked.

Each is small (one arm's grid and seeds in well under a minute on two CPU
cores), offline and fixed: autoencoder, recurrent network, vision
transformer, tabular data with raw features (data sets shipped inside
scikit-learn), coordinate networks, a graph network on a generated graph,
and variants of the MLP and CNN families (LayerNorm, a larger batch, a CNN
without normalization). Which split each is in, and why, is ``splits``.

Every random choice of a data set (the image of a coordinate network, the
graph, the train/validation split) is a fixed NumPy seed, so a workload is
the same on every machine; MNIST is the suite's (``tasks.mnist_data``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import cbp_optax as cbp
from cbp_optax_experiments import datasets
from cbp_optax_experiments.reproduce import flow
from cbp_optax_experiments.reproduce import training
from cbp_optax_experiments.workloads import tasks

ADAM_GRID = (3e-4, 1e-3, 3e-3, 1e-2)


def _classifier(model: Any, plain: Optional[nn.Module], train_x, train_y,
                val_x, val_y, batch_size: int,
                metric: str = tasks.ACCURACY) -> tasks.Task:
  """A Linen classifier: minibatches with replacement, validation accuracy
  (or mean cross-entropy)."""
  train_x, train_y = jnp.asarray(train_x), jnp.asarray(train_y)
  val_x, val_y = jnp.asarray(val_x), jnp.asarray(val_y)

  def batch(key):
    return jax.random.randint(key, (batch_size,), 0, train_x.shape[0])

  def metric_of(forward):
    logits = forward(val_x)
    if metric == tasks.CROSS_ENTROPY:
      return training.cross_entropy(logits, val_y)
    return training.accuracy(logits, val_y)

  return tasks.linen_model_task(
      model, plain, train_x[:2], batch,
      lambda forward, index: training.cross_entropy(forward(train_x[index]),
                                                    train_y[index]),
      metric_of)


def _centered(module: nn.Module, centered: bool):
  """(model, plain): ``cbp.linen.center(module)`` and the module itself when
  ``centered`` (the centered model takes the plain one's weights)."""
  return (cbp.linen.center(module), module) if centered else (module, None)


# ---------------------------------------------------------------------------
# MLP family: LayerNorm, a larger batch


def _mlp_layernorm(quick: bool) -> tasks.Workload:
  width, depth, batch = (32, 2, 64) if quick else (128, 4, 128)
  steps, every = (20, 10) if quick else (300, 15)
  data = tasks.mnist_data(quick)

  def build(centered):
    model = flow.NormMLP(hidden=(width,) * depth, classes=10, norm='layer',
                         centered=centered)
    return tasks.linen_task(model, data, batch)
  return tasks.Workload(
      'mnist-mlp-layernorm', f'ReLU MLP 784 -> {width} x {depth} -> 10 with '
      f'LayerNorm before every activation (He init), MNIST, batch {batch}, '
      f'{steps} steps', tasks.ACCURACY, True, steps, every, ADAM_GRID, None,
      build, family='mlp', validation_size=len(data.val_y))


def _mlp_big_batch(quick: bool) -> tasks.Workload:
  width, depth, batch = (32, 2, 256) if quick else (128, 4, 1024)
  steps, every = (20, 10) if quick else (150, 10)
  data = tasks.mnist_data(quick)

  def build(centered):
    model = training.MLP(hidden=(width,) * depth, classes=10,
                         centered=centered)
    return tasks.linen_task(model, data, batch)
  return tasks.Workload(
      'mnist-mlp-batch1024', f'§6.6 MLP 784 -> {width} x {depth} -> 10 (ReLU, '
      f'He), MNIST, large batch {batch}, {steps} steps', tasks.ACCURACY, True,
      steps, every, (1e-3, 3e-3, 1e-2, 3e-2), None, build, family='mlp',
      validation_size=len(data.val_y))


# ---------------------------------------------------------------------------
# Convolutional family: no normalization


class PlainCNN(nn.Module):
  """conv 3x3 -> ReLU -> avg-pool, twice, then Linear -> ReLU -> Linear; no
  normalization, He initialization."""
  widths: Sequence[int] = (16, 32, 128)
  classes: int = 10

  @nn.compact
  def __call__(self, x, *, train: bool = False):
    del train
    he = nn.initializers.variance_scaling(2.0, 'fan_in', 'normal')
    x = x.reshape(x.shape[0], 28, 28, 1)
    for width in self.widths[:2]:
      x = nn.relu(nn.Conv(width, (3, 3), kernel_init=he)(x))
      x = nn.avg_pool(x, (2, 2), (2, 2))
    x = x.reshape(x.shape[0], -1)
    x = nn.relu(nn.Dense(self.widths[2], kernel_init=he)(x))
    return nn.Dense(self.classes, kernel_init=he)(x)


def _cnn_plain(quick: bool) -> tasks.Workload:
  widths = (4, 8, 16) if quick else (16, 32, 128)
  steps, every, batch = (20, 10, 32) if quick else (200, 20, 32)
  data = tasks.mnist_data(quick)

  def build(centered):
    model, plain = _centered(PlainCNN(widths), centered)
    return _classifier(model, plain, data.train_x, data.train_y, data.val_x,
                       data.val_y, batch)
  return tasks.Workload(
      'cnn-plain', f'CNN without normalization (conv {widths[0]}/{widths[1]} '
      f'3x3 + ReLU + avg-pool, Linear {widths[2]}, He init), MNIST, batch '
      f'{batch}, {steps} steps', tasks.ACCURACY, True, steps, every,
      ADAM_GRID, None, build, family='convolutional',
      validation_size=len(data.val_y), scan_steps=False)


# ---------------------------------------------------------------------------
# Autoencoder


class LogisticAutoencoder(nn.Module):
  """Deep autoencoder with logistic units (Hinton & Salakhutdinov 2006's
  shape at reduced width): sigmoid hidden layers, a linear code layer, and
  logits of the 784 pixels."""
  widths: Sequence[int] = (256, 64, 16)

  @nn.compact
  def __call__(self, x, *, train: bool = False):
    del train
    for width in self.widths[:-1]:
      x = nn.sigmoid(nn.Dense(width)(x))
    x = nn.Dense(self.widths[-1])(x)  # the code: linear
    for width in reversed(self.widths[:-1]):
      x = nn.sigmoid(nn.Dense(width)(x))
    return nn.Dense(784)(x)


def _autoencoder(quick: bool) -> tasks.Workload:
  widths = (32, 8) if quick else (256, 64, 16)
  steps, every, batch = (20, 10, 64) if quick else (400, 20, 128)
  data = tasks.mnist_data(quick)
  train_x, val_x = jnp.asarray(data.train_x), jnp.asarray(data.val_x)

  def build(centered):
    model, plain = _centered(LogisticAutoencoder(widths), centered)

    def batch_of(key):
      return jax.random.randint(key, (batch,), 0, train_x.shape[0])

    def loss_of(forward, index):
      x = train_x[index]
      return optax.sigmoid_binary_cross_entropy(forward(x), x).sum(-1).mean()

    def metric_of(forward):
      return jnp.mean(jnp.sum((nn.sigmoid(forward(val_x)) - val_x) ** 2, -1))

    return tasks.linen_model_task(model, plain, train_x[:2], batch_of,
                                  loss_of, metric_of)
  return tasks.Workload(
      'mnist-autoencoder', 'deep autoencoder with logistic units 784 -> '
      f'{" -> ".join(map(str, widths))} (linear code) -> ... -> 784, '
      f'pixel cross-entropy, MNIST, batch {batch}, {steps} steps',
      tasks.RECONSTRUCTION, False, steps, every, ADAM_GRID, None, build,
      family='autoencoder', validation_size=len(data.val_y))


# ---------------------------------------------------------------------------
# Recurrent network


class RowGRU(nn.Module):
  """A GRU reading an MNIST image ``784 / rows`` pixels (whole rows) per
  step; the last hidden state is classified. The input projection of every row is one
  Dense over the sequence; the recurrent Dense (orthogonal init) is called
  once per step (centered, it records the mean of its last call)."""
  hidden: int = 64
  rows: int = 28
  classes: int = 10

  @nn.compact
  def __call__(self, x, *, train: bool = False):
    del train
    width = self.hidden
    seq = x.reshape(x.shape[0], self.rows, -1)
    gates_in = nn.Dense(3 * width, name='input')(seq)
    recurrent = nn.Dense(3 * width, kernel_init=nn.initializers.orthogonal(),
                         name='recurrent')
    h = jnp.zeros((x.shape[0], width), x.dtype)
    for t in range(self.rows):
      gi, gh = gates_in[:, t], recurrent(h)
      r = nn.sigmoid(gi[:, :width] + gh[:, :width])
      z = nn.sigmoid(gi[:, width:2 * width] + gh[:, width:2 * width])
      n = jnp.tanh(gi[:, 2 * width:] + r * gh[:, 2 * width:])
      h = (1.0 - z) * n + z * h
    return nn.Dense(self.classes, name='head')(h)


def _gru(quick: bool) -> tasks.Workload:
  # 14 steps of two rows: half the sequential steps (and the step cost) of
  # one row a step, which cost 13 ms a step on the loaded 2-core machine.
  hidden, rows = (16, 7) if quick else (64, 14)
  steps, every, batch = (20, 10, 32) if quick else (300, 15, 64)
  data = tasks.mnist_data(quick)

  def build(centered):
    model, plain = _centered(RowGRU(hidden, rows), centered)
    return _classifier(model, plain, data.train_x, data.train_y, data.val_x,
                       data.val_y, batch)
  return tasks.Workload(
      'gru-mnist-rows', f'GRU (hidden {hidden}) over MNIST read as {rows} '
      f'steps of {784 // rows} pixels ({28 // rows} rows), last state classified, '
      f'batch {batch}, '
      f'{steps} steps', tasks.ACCURACY, True, steps, every, ADAM_GRID, None,
      build, family='recurrent', validation_size=len(data.val_y))


# ---------------------------------------------------------------------------
# Vision transformer


class ViTBlock(nnx.Module):
  """Pre-LayerNorm block: (non-causal) self-attention and a GELU MLP."""

  def __init__(self, width: int, heads: int, rngs: nnx.Rngs):
    self.norm1 = nnx.LayerNorm(width, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=width,
                                       decode=False, rngs=rngs)
    self.norm2 = nnx.LayerNorm(width, rngs=rngs)
    self.up = nnx.Linear(width, 2 * width, rngs=rngs)
    self.down = nnx.Linear(2 * width, width, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.norm1(x), deterministic=True)
    return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class ViT(nnx.Module):
  """A tiny ViT: 7x7 patches of a 28x28 image, a learned position
  embedding, pre-LN blocks, mean-pooled tokens, LayerNorm, Linear head."""

  def __init__(self, *, rngs: nnx.Rngs, patch: int = 7, width: int = 64,
               depth: int = 2, heads: int = 4, classes: int = 10):
    self.patch = patch
    tokens = (28 // patch) ** 2
    self.embed = nnx.Linear(patch * patch, width, rngs=rngs)
    self.position = nnx.Param(
        0.02 * jax.random.normal(rngs.params(), (tokens, width)))
    self.layers = nnx.List([ViTBlock(width, heads, rngs)
                            for _ in range(depth)])
    self.norm = nnx.LayerNorm(width, rngs=rngs)
    self.head = nnx.Linear(width, classes, rngs=rngs)

  def __call__(self, images):
    p, side = self.patch, 28 // self.patch
    x = images.reshape(-1, side, p, side, p).transpose(0, 1, 3, 2, 4)
    x = self.embed(x.reshape(-1, side * side, p * p)) + self.position[...]
    for block in self.layers:
      x = block(x)
    return self.head(self.norm(x.mean(axis=1)))


def _vit(quick: bool) -> tasks.Workload:
  width, depth, heads = (16, 1, 2) if quick else (64, 2, 4)
  steps, every, batch = (20, 10, 32) if quick else (300, 15, 64)
  data = tasks.mnist_data(quick)

  def build(centered):
    train_x, train_y = jnp.asarray(data.train_x), jnp.asarray(data.train_y)
    val_x, val_y = jnp.asarray(data.val_x), jnp.asarray(data.val_y)

    def batch_of(key):
      return jax.random.randint(key, (batch,), 0, train_x.shape[0])

    def loss_fn(model, index, rngs):
      del rngs  # no dropout
      return training.cross_entropy(model(train_x[index]), train_y[index])

    return tasks.nnx_task(
        lambda rngs: ViT(rngs=rngs, width=width, depth=depth, heads=heads),
        centered, loss_fn, batch_of,
        lambda model: training.accuracy(model(val_x), val_y),
        muon_dims=tasks.attention_muon_dims)
  return tasks.Workload(
      'vit-mnist', f'tiny vision transformer: 16 patches of 7x7, width '
      f'{width}, {depth} pre-LN blocks, {heads} heads, mean-pooled, MNIST, '
      f'batch {batch}, {steps} steps', tasks.ACCURACY, True, steps, every,
      ADAM_GRID, None, build, family='transformer',
      validation_size=len(data.val_y))


# ---------------------------------------------------------------------------
# Tabular data, raw features


@functools.lru_cache(maxsize=None)
def _tabular(name: str, n_val: int):
  """(train_x, train_y, val_x, val_y, source): a fixed permutation (NumPy
  seed 0), the first ``n_val`` for validation; features left raw."""
  found = datasets.load_bundled_tabular(name)
  order = np.random.default_rng(0).permutation(len(found.labels))
  x, y = found.features[order], found.labels[order]
  return x[n_val:], y[n_val:], x[:n_val], y[:n_val], found.source


def _tabular_task(name: str, n_val: int, width: int, depth: int,
                  classes: int, batch: int, centered: bool) -> tasks.Task:
  """A ReLU MLP classifier on a bundled tabular data set, raw features."""
  train_x, train_y, val_x, val_y, _ = _tabular(name, n_val)
  model = training.MLP(hidden=(width,) * depth, classes=classes,
                       centered=centered)
  return _classifier(model, model.clone(centered=False) if centered else
                     None, train_x, train_y, val_x, val_y, batch)


def _breast_cancer(quick: bool) -> tasks.Workload:
  width, depth, batch = (16, 1, 32) if quick else (64, 2, 32)
  steps, every = (20, 10) if quick else (300, 15)
  n_val = 200

  build = functools.partial(_tabular_task, 'breast_cancer', n_val, width,
                            depth, 2, batch)
  return tasks.Workload(
      'breast-cancer-raw', f'ReLU MLP 30 -> {width} x {depth} -> 2 (He) on '
      'the breast-cancer data set with raw, unscaled features (scales 0.001 '
      f'to 4,000), 369 train / {n_val} validation, batch {batch}, {steps} '
      'steps', tasks.ACCURACY, True, steps, every, ADAM_GRID, None,
      build, family='tabular', validation_size=n_val)


def _digits(quick: bool) -> tasks.Workload:
  width, depth, batch = (16, 1, 32) if quick else (128, 2, 64)
  steps, every = (20, 10) if quick else (300, 15)
  n_val = 597

  build = functools.partial(_tabular_task, 'digits', n_val, width, depth,
                            10, batch)
  return tasks.Workload(
      'digits-raw', f'ReLU MLP 64 -> {width} x {depth} -> 10 (He) on the 8x8 '
      'digits data set with raw pixel counts (0-16, not rescaled), 1,200 '
      f'train / {n_val} validation, batch {batch}, {steps} steps',
      tasks.ACCURACY, True, steps, every, ADAM_GRID, None, build,
      family='tabular', validation_size=n_val)


# ---------------------------------------------------------------------------
# Coordinate networks


@functools.lru_cache(maxsize=None)
def coordinate_image(seed: int, size: int) -> np.ndarray:
  """A fixed grayscale image in [0, 1] (size x size): Gaussian blobs, one
  disc of stripes with a sharp rim and a step edge, from NumPy ``seed``."""
  rng = np.random.default_rng(seed)
  y, x = np.mgrid[-1:1:size * 1j, -1:1:size * 1j]
  image = np.zeros_like(x)
  for _ in range(10):
    cx, cy = rng.uniform(-0.8, 0.8, 2)
    width = rng.uniform(0.08, 0.4)
    image += rng.uniform(-1, 1) * np.exp(
        -((x - cx) ** 2 + (y - cy) ** 2) / (2 * width ** 2))
  cx, cy = rng.uniform(-0.4, 0.4, 2)
  angle, frequency = rng.uniform(0, np.pi), rng.uniform(5, 9)
  stripes = np.sin(frequency * np.pi * (x * np.cos(angle) +
                                        y * np.sin(angle)))
  image += 0.6 * stripes * ((x - cx) ** 2 + (y - cy) ** 2 < 0.35 ** 2)
  image += 0.5 * (x * rng.uniform(-1, 1) + y * rng.uniform(-1, 1) > 0.3)
  image = (image - image.min()) / (image.max() - image.min())
  return image.astype(np.float32)


def _pixels(seed: int, size: int):
  """(train coordinates, train values, validation ...): a fixed half of the
  pixels each (NumPy ``seed``); coordinates in [-1, 1]^2."""
  image = coordinate_image(seed, size)
  y, x = np.mgrid[-1:1:size * 1j, -1:1:size * 1j]
  coords = np.stack([x.ravel(), y.ravel()], -1).astype(np.float32)
  values = image.reshape(-1, 1)
  order = np.random.default_rng(seed + 1).permutation(len(values))
  half = len(values) // 2
  train, val = order[:half], order[half:]
  return coords[train], values[train], coords[val], values[val]


def _psnr(mse):
  return -10.0 * jnp.log10(mse)


def _coordinate_task(model: Any, plain: Optional[nn.Module], seed: int,
                     size: int, batch: int,
                     features: Callable[[jax.Array], jax.Array]
                     ) -> tasks.Task:
  train_c, train_v, val_c, val_v = map(jnp.asarray, _pixels(seed, size))

  def batch_of(key):
    return jax.random.randint(key, (batch,), 0, train_c.shape[0])

  def loss_of(forward, index):
    return jnp.mean((forward(features(train_c[index])) - train_v[index]) ** 2)

  def metric_of(forward):
    return _psnr(jnp.mean((forward(features(val_c)) - val_v) ** 2))

  return tasks.linen_model_task(model, plain, features(train_c[:2]),
                                batch_of, loss_of, metric_of)


def _coordinate_relu(quick: bool) -> tasks.Workload:
  width, depth, size = (32, 2, 32) if quick else (128, 3, 64)
  steps, every, batch = (20, 10, 128) if quick else (500, 25, 256)

  def build(centered):
    model = training.MLP(hidden=(width,) * depth, classes=1,
                         centered=centered)
    return _coordinate_task(model, model.clone(centered=False) if centered
                            else None, 0, size, batch, lambda c: c)
  return tasks.Workload(
      'coord-relu', f'coordinate network: ReLU MLP 2 -> {width} x {depth} -> '
      f'1 (He) fitting a {size}x{size} generated image from raw (x, y), half '
      f'the pixels to train, the other half to validate, batch {batch}, '
      f'{steps} steps', tasks.PSNR, True, steps, every, ADAM_GRID, None,
      build, family='coordinate', validation_size=size * size // 2)


def _coordinate_fourier(quick: bool) -> tasks.Workload:
  width, depth, size, n_freq = (32, 2, 32, 8) if quick else (128, 3, 64, 64)
  steps, every, batch = (20, 10, 128) if quick else (500, 25, 256)
  # Random Fourier features (Tancik et al. 2020), fixed by seed; scale 2.5
  # keeps 3-sigma frequencies (~15 cycles across the image) under the
  # pixel grid's Nyquist limit (32), so held-out pixels can be interpolated.
  frequencies = jnp.asarray(2.5 * np.random.default_rng(7).standard_normal(
      (2, n_freq)).astype(np.float32))

  def features(c):
    angles = 2 * jnp.pi * c @ frequencies
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], -1)

  def build(centered):
    model = training.MLP(hidden=(width,) * depth, classes=1,
                         centered=centered)
    return _coordinate_task(model, model.clone(centered=False) if centered
                            else None, 1, size, batch, features)
  return tasks.Workload(
      'coord-fourier', f'coordinate network on {n_freq} random Fourier '
      f'features (scale 2.5): ReLU MLP {2 * n_freq} -> {width} x {depth} -> 1 '
      f'(He) fitting another {size}x{size} generated image, half the pixels '
      f'each to train and validate, batch {batch}, {steps} steps', tasks.PSNR,
      True, steps, every, ADAM_GRID, None, build, family='coordinate',
      validation_size=size * size // 2)


# ---------------------------------------------------------------------------
# Graph network


@functools.lru_cache(maxsize=None)
def block_graph(nodes: int, communities: int, degree_in: float,
                degree_out: float, dims: int, signal: float, seed: int):
  """A stochastic block model with noisy node features, from NumPy ``seed``.

  Returns (features (nodes, dims), labels, senders, receivers, weights):
  the edges of ``D^-1/2 (A + I) D^-1/2`` (self-loops included), so that
  aggregation is a weighted ``segment_sum``. Each node's features are its
  community's mean (a random direction of norm ``signal``) plus unit
  Gaussian noise: alone a node is hard to classify, its neighbours tell.
  """
  rng = np.random.default_rng(seed)
  labels = rng.integers(0, communities, nodes).astype(np.int32)
  same = labels[:, None] == labels[None, :]
  size = nodes / communities
  p = np.where(same, degree_in / size, degree_out / (nodes - size))
  upper = np.triu(rng.uniform(size=(nodes, nodes)) < p, 1)
  adjacency = upper | upper.T | np.eye(nodes, dtype=bool)
  senders, receivers = np.nonzero(adjacency)
  degree = adjacency.sum(1).astype(np.float32)
  weights = (degree[senders] * degree[receivers]) ** -0.5
  means = rng.standard_normal((communities, dims))
  means *= signal / np.linalg.norm(means, axis=1, keepdims=True)
  features = means[labels] + rng.standard_normal((nodes, dims))
  return (features.astype(np.float32), labels, senders.astype(np.int32),
          receivers.astype(np.int32), weights.astype(np.float32))


def aggregate(h, senders, receivers, weights):
  """``D^-1/2 (A + I) D^-1/2 h`` from the weighted edge list."""
  return jax.ops.segment_sum(weights[:, None] * h[senders], receivers,
                             h.shape[0])


class GCN(nn.Module):
  """Graph convolutional network: ``relu(Dense(A x))`` per hidden layer, then
  ``Dense(A h)`` (Kipf & Welling 2017 with the bias after aggregation).

  Called on ``A x``, aggregated once beforehand: the features are fixed,
  and XLA would otherwise constant-fold that aggregation in every compile.
  """
  graph: Any  # (senders, receivers, weights) as arrays
  hidden: Sequence[int] = (64,)
  classes: int = 4

  @nn.compact
  def __call__(self, aggregated, *, train: bool = False):
    del train
    he = nn.initializers.variance_scaling(2.0, 'fan_in', 'normal')
    x = aggregated
    for i, width in enumerate(self.hidden):
      if i:
        x = aggregate(x, *self.graph)
      x = nn.relu(nn.Dense(width, kernel_init=he)(x))
    return nn.Dense(self.classes, kernel_init=he)(aggregate(x, *self.graph))


def _gcn(quick: bool) -> tasks.Workload:
  nodes, hidden = (300, (16,)) if quick else (1500, (64, 64))
  steps, every, batch = (20, 10, 32) if quick else (300, 15, 128)
  n_val = nodes // 2

  def build(centered):
    features, y, senders, receivers, weights = block_graph(
        nodes, 4, 6.0, 2.0, 16, 1.0, 0)
    graph = tuple(map(jnp.asarray, (senders, receivers, weights)))
    x = np.zeros_like(features)
    np.add.at(x, receivers, weights[:, None] * features[senders])
    x, y = jnp.asarray(x), jnp.asarray(y)
    model, plain = _centered(GCN(graph, hidden), centered)

    def batch_of(key):  # training nodes: the second half
      return n_val + jax.random.randint(key, (batch,), 0, nodes - n_val)

    def loss_of(forward, index):
      return training.cross_entropy(forward(x)[index], y[index])

    def metric_of(forward):
      return training.accuracy(forward(x)[:n_val], y[:n_val])

    return tasks.linen_model_task(model, plain, x, batch_of, loss_of,
                                  metric_of)
  return tasks.Workload(
      'gcn-sbm', f'graph convolutional network ({len(hidden)} hidden x '
      f'{hidden[0]}, ReLU) classifying the nodes of a generated {nodes}-node '
      'stochastic block model (4 communities, mean degree 6 inside, 2 '
      'across, noisy 16-d features), full-graph forward, loss on '
      f'{batch} training nodes, {n_val} validation nodes, {steps} steps',
      tasks.ACCURACY, True, steps, every, ADAM_GRID, None, build,
      family='graph', validation_size=n_val)


# Name -> (factory, family, one line for --help), in run and report order.
REGISTRY: dict[str, tuple[Callable[[bool], tasks.Workload], str, str]] = {
    'breast-cancer-raw': (_breast_cancer, 'tabular', 'ReLU MLP on the '
                          'breast-cancer data set, raw unscaled features'),
    'coord-relu': (_coordinate_relu, 'coordinate', 'ReLU MLP fitting a '
                   'generated image from raw (x, y) (PSNR)'),
    'digits-raw': (_digits, 'tabular', 'ReLU MLP on 8x8 digits, raw pixel '
                   'counts 0-16'),
    'coord-fourier': (_coordinate_fourier, 'coordinate', 'ReLU MLP on '
                      'random Fourier features fitting a generated image '
                      '(PSNR)'),
    'mnist-mlp-layernorm': (_mlp_layernorm, 'mlp', 'ReLU MLP with LayerNorm '
                            'on MNIST'),
    'mnist-mlp-batch1024': (_mlp_big_batch, 'mlp', 'the §6.6 MLP at batch '
                            '1024 on MNIST'),
    'gcn-sbm': (_gcn, 'graph', 'GCN classifying the nodes of a generated '
                'stochastic block model'),
    'mnist-autoencoder': (_autoencoder, 'autoencoder', 'deep autoencoder '
                          'with logistic units on MNIST (squared error)'),
    'gru-mnist-rows': (_gru, 'recurrent', 'GRU reading MNIST two rows a '
                       'step'),
    'vit-mnist': (_vit, 'transformer', 'tiny vision transformer on MNIST '
                  'patches'),
    'cnn-plain': (_cnn_plain, 'convolutional', 'small CNN without '
                  'normalization on MNIST'),
}
