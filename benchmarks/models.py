"""The paper's Table 4 architectures, in Flax Linen and Flax NNX.

* MLP: 784 -> width x 4 hidden (ReLU) -> 10. Widths 256 / 1024 / 4096 give the
  paper's 0.40M / 4.0M / 53.6M parameters.
* ResNet-8 (§6.6): 3x3 stem conv to 16 channels, one basic block per stage at
  16 / 32 / 64 channels (stride 2 and a 1x1 projection shortcut where the width
  changes), global average pooling, Dense to 10: 77,706 parameters, the
  paper's count.
* Transformer (beyond the paper): the byte-level decoder-only LM of
  ``cbp-optax reproduce transformer`` (4 pre-LayerNorm blocks built with
  ``nnx.vmap`` and run with ``nnx.scan``, width 128, 4 heads, context 128),
  NNX only; centered with ``cbp.nnx.center`` (attention projections and MLP),
  dropout off (no ``rngs``), batch x 128 tokens.
* CNN (the user-path section): the Flax MNIST tutorials' CNN, 28x28x1 ->
  3x3 conv to 32 channels, ReLU, 2x2 average pool, 3x3 conv to 64, ReLU,
  pool, Dense 3136 -> 256, ReLU, Dense -> 10 (824,458 parameters); ``width``
  scales the channels (32 / 64 / 256 at width 32).

``centered=True`` wraps every Dense and every convolution in the library's
``Centered`` (M2); otherwise the layers are plain. Only the public API of
``cbp_optax`` is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import cbp_optax as cbp

MLP_DEPTH = 4
MNIST_FEATURES = 784
MNIST_SHAPE = (28, 28, 1)
CIFAR_SHAPE = (32, 32, 3)
NUM_CLASSES = 10
RESNET_WIDTHS = (16, 32, 64)
CNN_WIDTH = 32
TRANSFORMER_WIDTH = 128
TRANSFORMER_CONTEXT = 128


@dataclass(frozen=True)
class Arch:
  """One benchmarked architecture.

  Attributes:
    name: label used in tables, e.g. ``'MLP-1024'``.
    kind: ``'mlp'``, ``'resnet8'``, ``'cnn'`` or ``'transformer'``.
    width: hidden width of the MLP, base channels of the CNN, model width of
      the transformer (unused for ResNet-8).
    depth: hidden layers of the MLP, blocks of the transformer.
    context: tokens per sequence of the transformer.
  """

  name: str
  kind: str
  width: int = 0
  depth: int = MLP_DEPTH
  context: int = TRANSFORMER_CONTEXT

  def input_shape(self, batch: int) -> tuple[int, ...]:
    if self.kind == 'transformer':
      return (batch, self.context)
    if self.kind == 'mlp':
      return (batch, MNIST_FEATURES)
    if self.kind == 'cnn':
      return (batch,) + MNIST_SHAPE
    return (batch,) + CIFAR_SHAPE


def mlp(width: int, depth: int = MLP_DEPTH) -> Arch:
  """784 -> width x depth -> 10: ``'MLP-1024'`` (depth 4, the paper's) or
  ``'MLP-2x1024'``."""
  name = f'MLP-{width}' if depth == MLP_DEPTH else f'MLP-{depth}x{width}'
  return Arch(name=name, kind='mlp', width=width, depth=depth)


def cnn(width: int = CNN_WIDTH) -> Arch:
  """The Flax MNIST tutorials' CNN, ``'CNN'`` at its own width of 32."""
  name = 'CNN' if width == CNN_WIDTH else f'CNN-{width}'
  return Arch(name=name, kind='cnn', width=width)


def transformer(width: int = TRANSFORMER_WIDTH, depth: int = 4,
                context: int = TRANSFORMER_CONTEXT) -> Arch:
  """The byte-level LM; ``'Transformer'`` at its default size."""
  default = (width, depth, context) == (TRANSFORMER_WIDTH, 4,
                                        TRANSFORMER_CONTEXT)
  name = ('Transformer' if default
          else f'Transformer-{depth}x{width}-ctx{context}')
  return Arch(name=name, kind='transformer', width=width, depth=depth,
              context=context)


RESNET8 = Arch(name='ResNet-8', kind='resnet8')
TRANSFORMER = transformer()
# Layer stacks of each kind: M1 gets one block per layer slice of them.
STACKS = {'transformer': ('blocks',)}


def make_batch(arch: Arch, batch: int, seed: int = 0):
  """Random inputs (offset from zero, as real activations are) and labels.

  Transformer: random bytes and their next-byte labels, [batch, context].
  """
  rng = np.random.default_rng(seed)
  if arch.kind == 'transformer':
    text = rng.integers(0, 256, (batch, arch.context + 1))
    return (jnp.asarray(text[:, :-1], jnp.int32),
            jnp.asarray(text[:, 1:], jnp.int32))
  images = rng.standard_normal(arch.input_shape(batch)).astype(np.float32)
  labels = rng.integers(0, NUM_CLASSES, batch).astype(np.int32)
  return jnp.asarray(images + 0.5), jnp.asarray(labels)


def _identity(layer):
  return layer


# ----------------------------------------------------------------- Linen


class LinenMLP(nn.Module):
  """784 -> width x depth -> 10, every Dense optionally centered."""

  width: int
  centered: bool = False
  depth: int = MLP_DEPTH

  @nn.compact
  def __call__(self, x):
    wrap = cbp.linen.Centered if self.centered else _identity
    for _ in range(self.depth):
      x = nn.relu(wrap(nn.Dense(self.width))(x))
    return wrap(nn.Dense(NUM_CLASSES))(x)


class LinenBasicBlock(nn.Module):
  """Two 3x3 convs with a residual; 1x1 projection when the shape changes."""

  features: int
  strides: int
  centered: bool

  @nn.compact
  def __call__(self, x):
    wrap = cbp.linen.Centered if self.centered else _identity
    y = nn.relu(wrap(nn.Conv(self.features, (3, 3), self.strides,
                             padding='SAME'))(x))
    y = wrap(nn.Conv(self.features, (3, 3), padding='SAME'))(y)
    shortcut = x
    if self.strides != 1 or x.shape[-1] != self.features:
      shortcut = wrap(nn.Conv(self.features, (1, 1), self.strides,
                              padding='VALID'))(x)
    return nn.relu(y + shortcut)


class LinenResNet8(nn.Module):
  """The paper's eight-layer ResNet (16-32-64, one basic block per stage)."""

  centered: bool = False

  @nn.compact
  def __call__(self, x):
    wrap = cbp.linen.Centered if self.centered else _identity
    x = nn.relu(wrap(nn.Conv(RESNET_WIDTHS[0], (3, 3), padding='SAME'))(x))
    for stage, features in enumerate(RESNET_WIDTHS):
      x = LinenBasicBlock(features, 1 if stage == 0 else 2, self.centered)(x)
    x = jnp.mean(x, axis=(1, 2))
    return wrap(nn.Dense(NUM_CLASSES))(x)


class LinenCNN(nn.Module):
  """The Flax MNIST tutorial CNN, every layer optionally centered."""

  width: int = CNN_WIDTH
  centered: bool = False

  @nn.compact
  def __call__(self, x):
    wrap = cbp.linen.Centered if self.centered else _identity
    for features in (self.width, 2 * self.width):
      x = nn.relu(wrap(nn.Conv(features, (3, 3)))(x))
      x = nn.avg_pool(x, (2, 2), strides=(2, 2))
    x = x.reshape((x.shape[0], -1))
    x = nn.relu(wrap(nn.Dense(8 * self.width))(x))
    return wrap(nn.Dense(NUM_CLASSES))(x)


def linen_model(arch: Arch, centered: bool) -> nn.Module:
  if arch.kind == 'transformer':
    raise ValueError('The Transformer is benchmarked in NNX only: --api nnx.')
  if arch.kind == 'mlp':
    return LinenMLP(arch.width, centered, arch.depth)
  if arch.kind == 'cnn':
    return LinenCNN(arch.width, centered)
  return LinenResNet8(centered)


# ------------------------------------------------------------------- NNX


class NnxMLP(nnx.Module):
  """784 -> width x depth -> 10, every Linear optionally centered."""

  def __init__(self, width: int, centered: bool, rngs: nnx.Rngs,
               depth: int = MLP_DEPTH):
    wrap = cbp.nnx.Centered if centered else _identity
    sizes = [MNIST_FEATURES] + [width] * depth + [NUM_CLASSES]
    self.layers = nnx.List([
        wrap(nnx.Linear(a, b, rngs=rngs)) for a, b in zip(sizes, sizes[1:])
    ])

  def __call__(self, x):
    for layer in self.layers[:-1]:
      x = nnx.relu(layer(x))
    return self.layers[-1](x)


class NnxBasicBlock(nnx.Module):
  """Two 3x3 convs with a residual; 1x1 projection when the shape changes."""

  def __init__(self, in_features: int, features: int, strides: int,
               centered: bool, rngs: nnx.Rngs):
    wrap = cbp.nnx.Centered if centered else _identity
    self.conv1 = wrap(nnx.Conv(in_features, features, (3, 3), strides,
                               padding='SAME', rngs=rngs))
    self.conv2 = wrap(nnx.Conv(features, features, (3, 3), padding='SAME',
                               rngs=rngs))
    projection = None
    if strides != 1 or in_features != features:
      projection = wrap(nnx.Conv(in_features, features, (1, 1), strides,
                                 padding='VALID', rngs=rngs))
    # A module-or-None attribute must be declared data explicitly in NNX.
    self.projection = nnx.data(projection)

  def __call__(self, x):
    y = self.conv2(nnx.relu(self.conv1(x)))
    shortcut = x if self.projection is None else self.projection(x)
    return nnx.relu(y + shortcut)


class NnxResNet8(nnx.Module):
  """The paper's eight-layer ResNet (16-32-64, one basic block per stage)."""

  def __init__(self, centered: bool, rngs: nnx.Rngs):
    wrap = cbp.nnx.Centered if centered else _identity
    self.stem = wrap(nnx.Conv(CIFAR_SHAPE[-1], RESNET_WIDTHS[0], (3, 3),
                              padding='SAME', rngs=rngs))
    blocks = []
    in_features = RESNET_WIDTHS[0]
    for stage, features in enumerate(RESNET_WIDTHS):
      blocks.append(NnxBasicBlock(in_features, features,
                                  1 if stage == 0 else 2, centered, rngs))
      in_features = features
    self.blocks = nnx.List(blocks)
    self.head = wrap(nnx.Linear(in_features, NUM_CLASSES, rngs=rngs))

  def __call__(self, x):
    x = nnx.relu(self.stem(x))
    for block in self.blocks:
      x = block(x)
    return self.head(jnp.mean(x, axis=(1, 2)))


class NnxCNN(nnx.Module):
  """The Flax NNX tutorial CNN, every layer optionally centered."""

  def __init__(self, width: int, centered: bool, rngs: nnx.Rngs):
    wrap = cbp.nnx.Centered if centered else _identity
    side = MNIST_SHAPE[0] // 4  # two 2x2 pools
    self.conv1 = wrap(nnx.Conv(MNIST_SHAPE[-1], width, (3, 3), rngs=rngs))
    self.conv2 = wrap(nnx.Conv(width, 2 * width, (3, 3), rngs=rngs))
    self.linear1 = wrap(nnx.Linear(side * side * 2 * width, 8 * width,
                                   rngs=rngs))
    self.linear2 = wrap(nnx.Linear(8 * width, NUM_CLASSES, rngs=rngs))

  def __call__(self, x):
    for conv in (self.conv1, self.conv2):
      x = nnx.avg_pool(nnx.relu(conv(x)), (2, 2), strides=(2, 2))
    x = x.reshape(x.shape[0], -1)
    return self.linear2(nnx.relu(self.linear1(x)))


def nnx_model(arch: Arch, centered: bool, seed: int = 0) -> nnx.Module:
  rngs = nnx.Rngs(seed)
  if arch.kind == 'transformer':
    from cbp_optax_experiments.reproduce import transformer  # pylint: disable=g-import-not-at-top
    config = transformer.Config(depth=arch.depth, width=arch.width,
                                heads=max(1, arch.width // 32),
                                context=arch.context)
    # Built as the study builds it: the blocks centered inside their vmap,
    # the stack axis named (center refuses to guess it when depth == heads).
    return transformer.build_model(config, seed, centered)
  if arch.kind == 'mlp':
    return NnxMLP(arch.width, centered, rngs, arch.depth)
  if arch.kind == 'cnn':
    return NnxCNN(arch.width, centered, rngs)
  return NnxResNet8(centered, rngs)


def count_params(tree) -> int:
  return int(sum(np.size(leaf) for leaf in jax.tree.leaves(tree)))


def tree_bytes(tree) -> int:
  return int(sum(np.size(leaf) * np.dtype(jnp.result_type(leaf)).itemsize
                 for leaf in jax.tree.leaves(tree)))


def kernel_shapes(params) -> list[tuple[int, ...]]:
  """Shapes of the weight leaves of rank >= 2 (kernels), one per layer."""
  return [tuple(np.shape(leaf)) for leaf in jax.tree.leaves(params)
          if np.ndim(leaf) >= 2]


def layer_count(params) -> int:
  """Number of layers L, i.e. of M1 blocks (one per kernel/bias pair)."""
  return len(cbp.block_names(params))


LossFn = Callable[..., jax.Array]
ALL_ARCHS: Sequence[Arch] = (mlp(256), mlp(1024), mlp(4096), RESNET8)
# Selected by name (--archs Transformer --api nnx); not in the default set,
# which every API runs.
EXTRA_ARCHS: Sequence[Arch] = (TRANSFORMER,)


def stacked_for(arch: Arch, model) -> Any:
  """The ``stacked=`` predicate of ``arch``'s NNX model, or None."""
  paths = STACKS.get(arch.kind)
  return cbp.nnx.stacked_blocks(model, *paths) if paths else None
