"""M1's parameter blocks: leaves that share one equalizing scale (§4.1, eq. 7).

By default a block is one layer: the leaves that share a parent path.
``block_fn(path, leaf)`` regroups leaves; ``stacked(path, leaf)`` marks
leaves with a leading layer-stack axis, each slice of which is a block.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Collection, Hashable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from cbp_optax import _checks
from cbp_optax._paths import path_names
from cbp_optax._paths import path_str

__all__ = ['BlockLayout', 'block_layout', 'block_names', 'kernel_blocks',
           'layer_blocks', 'leaf_blocks', 'no_blocks']

KeyPath = tuple[Any, ...]
BlockFn = Callable[[KeyPath, Any], Hashable]
StackedFn = Callable[[KeyPath, Any], bool]


# The leaf of a one-argument call, which only inject_hyperparams makes.
_NO_LEAF = object()


def _preset(fn):
  """Makes a ``block_fn`` preset refuse ``inject_hyperparams``' step call."""

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    if len(args) == 1 and not kwargs:
      raise _checks.schedule_call_error('block_fn', f'cbp.{fn.__name__}',
                                        args[0])
    return fn(*args, **kwargs)

  return wrapper


class BlockLayout(NamedTuple):
  """Static assignment of the leaves of a tree to M1 blocks.

  Attributes:
    names: one name per block, in state order.
    groups: per group of leaves sharing a block key, their indices in
      ``jax.tree.leaves`` order.
    group_starts: index of each group's first block in ``names``.
    group_stacks: None for a group that is one block, else the length of its
      leading layer axis (one block per slice).
  """

  names: tuple[str, ...]
  groups: tuple[tuple[int, ...], ...]
  group_starts: tuple[int, ...]
  group_stacks: tuple[Optional[int], ...]


def strip_variable_suffix(path: KeyPath) -> KeyPath:
  # nnx.Optimizer inits on Variables (`.value` paths), updates with arrays:
  # both get the same block keys.
  if (path and isinstance(path[-1], jax.tree_util.GetAttrKey)
      and path[-1].name == 'value'):
    return path[:-1]
  return path


def _block_name(block_key: Hashable) -> str:
  tu = jax.tree_util
  if isinstance(block_key, tuple) and all(isinstance(k, (
      tu.DictKey, tu.GetAttrKey, tu.SequenceKey, tu.FlattenedIndexKey))
                                          for k in block_key):
    return path_str(block_key)
  return str(block_key)


def default_block_key(path: KeyPath, leaf: Any) -> Hashable:
  """One block per layer: a leaf's parent path; a root leaf is its own block."""
  del leaf
  return path[:-1] if len(path) > 1 else path


@_preset
def layer_blocks(path: KeyPath, leaf: Any) -> Hashable:
  """``block_fn`` preset, the default: one M1 block per layer (eq. 7).

  The leaves that share a parent path (a layer's kernel and bias) form one
  block: Algorithm 1's grouping.

  Examples:
    >>> import jax.numpy as jnp
    >>> import cbp_optax as cbp
    >>> params = {'dense': {'kernel': jnp.ones((2, 2)), 'bias': jnp.ones(2)},
    ...           'norm': {'scale': jnp.ones(2)}}
    >>> cbp.block_names(params, block_fn=cbp.layer_blocks)
    ('dense', 'norm')
  """
  return default_block_key(path, leaf)


@_preset
def leaf_blocks(path: KeyPath, leaf: Any) -> Hashable:
  """``block_fn`` preset: one M1 block per parameter tensor.

  Examples:
    >>> import jax.numpy as jnp
    >>> import cbp_optax as cbp
    >>> params = {'dense': {'kernel': jnp.ones((2, 2)), 'bias': jnp.ones(2)}}
    >>> cbp.block_names(params, block_fn=cbp.leaf_blocks)
    ('dense/bias', 'dense/kernel')
  """
  del leaf
  return path


@_preset
def no_blocks(path: KeyPath, leaf: Any) -> Hashable:
  r"""``block_fn`` preset: no leaf is in a block, so M1 is the identity.

  :math:`S_t = I` at every step: the update is M3's alone (with M2 when the
  model is centered). Not Algorithm 1; Lemma 1's bounds hold with
  :math:`s_{\min} = s_{\max} = 1`.

  Examples:
    >>> import jax.numpy as jnp
    >>> import cbp_optax as cbp
    >>> params = {'dense': {'kernel': jnp.ones((2, 2)), 'bias': jnp.ones(2)}}
    >>> cbp.block_names(params, block_fn=cbp.no_blocks)
    ()
  """
  del path, leaf
  return None


@_preset
def kernel_blocks(path: KeyPath, leaf: Any) -> Hashable:
  """``block_fn`` preset: M1 equalizes the weight matrices only.

  Each leaf named ``kernel`` is one block (per slice when stacked); every
  other leaf (biases, norm scales, embeddings) passes through with
  :math:`s = 1` and is not part of the target :math:`c` of eq. (6). Not
  Algorithm 1's grouping: eq. (7) then pulls only the layers' matrices,
  whose gradient energies are comparable, to one energy.

  Examples:
    >>> import jax.numpy as jnp
    >>> import cbp_optax as cbp
    >>> params = {'dense': {'kernel': jnp.ones((2, 2)), 'bias': jnp.ones(2)},
    ...           'embed': {'embedding': jnp.ones((5, 2))},
    ...           'norm': {'scale': jnp.ones(2)}}
    >>> cbp.block_names(params, block_fn=cbp.kernel_blocks)
    ('dense',)
  """
  return (default_block_key(path, leaf)
          if path_names(path[-1:]) == ('kernel',) else None)


def _hashable_key(key: Any, path: KeyPath) -> Hashable:
  """A ``block_fn`` result as a dict key (lists become tuples)."""
  if isinstance(key, list):
    key = tuple(_hashable_key(k, path) for k in key)
  try:
    hash(key)
  except TypeError:
    raise TypeError(
        f'block_fn returned the unhashable {type(key).__name__} {key!r} for '
        f'leaf {jax.tree_util.keystr(path)}; it must return a hashable key '
        'or None.') from None
  return key


def block_layout(tree: Any, *, block_fn: Optional[BlockFn] = None,
                 stacked: Optional[StackedFn] = None) -> BlockLayout:
  """Assigns the leaves of ``tree`` to M1 blocks (eq. 7).

  Args:
    tree: parameters or gradients (arrays, or NNX Variables).
    block_fn: ``block_fn(path, leaf) -> hashable``; leaves with equal keys
      form one block; a leaf whose key is None, or of size zero, is in no
      block (M1 leaves it unscaled). Default: :func:`layer_blocks`.
    stacked: ``stacked(path, leaf) -> bool``; True for a leaf with a leading
      layer axis, each slice of which is a block of its own.

  Returns:
    The static :class:`BlockLayout`.

  Examples:
    >>> import jax.numpy as jnp
    >>> from cbp_optax import blocks
    >>> params = {
    ...     'Dense_0': {'kernel': jnp.ones((3, 2)), 'bias': jnp.zeros(2)},
    ...     'layers': {'kernel': jnp.ones((2, 2, 2)), 'bias': jnp.zeros((2, 2))},
    ... }
    >>> layout = blocks.block_layout(
    ...     params, stacked=lambda path, leaf: path[0].key == 'layers')
    >>> layout.names
    ('Dense_0', 'layers[0]', 'layers[1]')
    >>> layout.groups  # leaf indices, in jax.tree.leaves order
    ((0, 1), (2, 3))

  References:
    Layerwise Conditioned Backpropagation, eq. (7).
  """
  _checks.check_function('block_fn', block_fn, optional=True)
  _checks.check_function('stacked', stacked, optional=True)
  key_fn = block_fn or default_block_key
  paths_and_leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  group_index: dict[Hashable, int] = {}  # in first-seen order
  groups: list[list[int]] = []
  stacks: list[Optional[int]] = []
  for leaf_index, (path, leaf) in enumerate(paths_and_leaves):
    path = strip_variable_suffix(path)
    key = _hashable_key(key_fn(path, leaf), path)
    if key is None or math.prod(getattr(leaf, 'shape', ())) == 0:
      # An empty block would add a zero to the mean of eq. (6).
      continue
    stack = None
    if stacked is not None and stacked(path, leaf):
      if not (shape := jnp.shape(leaf)):
        raise ValueError(f'Leaf {jax.tree_util.keystr(path)} is declared '
                         'stacked but is a scalar.')
      stack = shape[0]
    if (group := group_index.setdefault(key, len(groups))) == len(groups):
      groups.append([])
      stacks.append(stack)
    if stacks[group] != stack:
      raise ValueError(
          f'Block {_block_name(key)!r} mixes leaves with different layer '
          f'stacks ({stacks[group]} and {stack}, at leaf '
          f'{jax.tree_util.keystr(path)}).')
    groups[group].append(leaf_index)

  names: list[str] = []  # block names
  starts: list[int] = []  # each group's first block
  for key, stack in zip(group_index, stacks):
    starts.append(len(names))
    name = _block_name(key)
    names.extend([name] if stack is None else
                 [f'{name}[{i}]' for i in range(stack)])
  return BlockLayout(tuple(names), tuple(tuple(g) for g in groups),
                     tuple(starts), tuple(stacks))


def block_names(params: Any, *, block_fn: Optional[BlockFn] = None,
                stacked: Optional[StackedFn] = None) -> tuple[str, ...]:
  """Names of the M1 blocks (eq. 7) of ``params``, in the order of
  :class:`cbp_optax.EqualizeState` ``.energy`` (the :math:`q_l` of eq. 5).

  Args:
    params: parameters (arrays, or NNX Variables).
    block_fn: the grouping, see :func:`block_layout`.
    stacked: the layer-stack declaration, see :func:`block_layout`.

  Returns:
    The block names, like ``('Dense_0', 'Dense_1')``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import cbp_optax as cbp
    >>> params = {'Dense_0': {'kernel': jnp.ones((3, 2)), 'bias': jnp.zeros(2)},
    ...           'Dense_1': {'kernel': jnp.ones((2, 1)), 'bias': jnp.zeros(1)}}
    >>> cbp.block_names(params)
    ('Dense_0', 'Dense_1')
    >>> cbp.equalize().init(params).energy.shape
    (2,)

  References:
    Layerwise Conditioned Backpropagation, eq. (7).
  """
  return block_layout(params, block_fn=block_fn, stacked=stacked).names


def stack_root(param_shapes: dict[tuple[str, ...], tuple[int, ...]],
               layer_path: tuple[str, ...], stack_size: int,
               unstacked: Collection[tuple[str, ...]] = ()) -> tuple[str, ...]:
  """The highest module above a stacked layer that is all one layer stack.

  Walks up from ``layer_path`` while every parameter under the module has a
  leading axis of ``stack_size`` and none of the ``unstacked`` layers (whose
  shapes are their own, like a head ``Linear(4, 4)`` beside a stack of four) is
  under it."""
  root = layer_path
  for depth in range(len(layer_path), -1, -1):
    prefix = layer_path[:depth]
    under = [s for p, s in param_shapes.items() if p[:depth] == prefix]
    if (not under or any(not s or s[0] != stack_size for s in under)
        or any(tuple(u[:depth]) == prefix for u in unstacked)):
      break
    root = prefix
  return root


def check_stack_paths(param_shapes: dict[tuple[str, ...], tuple[int, ...]],
                      stack_paths: Collection[str]) -> set[tuple[str, ...]]:
  """``stack_paths`` (``'decoder/blocks'``) as key tuples, each naming a
  module with parameters."""
  roots = set()
  for stack_path in stack_paths:
    if not isinstance(stack_path, str) or not stack_path:
      raise TypeError("stack paths must be module paths like 'decoder/blocks',"
                      f' got {stack_path!r}.')
    root = tuple(stack_path.split('/'))
    if not any(p[:len(root)] == root for p in param_shapes):
      names = sorted('/'.join(p[:-1] if p[-1:] == ('value',) else p)
                     for p in param_shapes)
      raise ValueError(
          f'stacked_blocks: no parameter is under {stack_path!r}; the '
          f'parameters are {names[:20]}'
          + (' ...' if len(names) > 20 else '') + '.')
    roots.add(root)
  return roots


class stacked_predicate:  # pylint: disable=invalid-name
  """``stacked(path, leaf)``: True for leaves under one of ``roots``; equal
  and hashing equal for equal roots."""

  def __init__(self, roots):
    self.roots = frozenset(tuple(r) for r in roots)

  def __call__(self, path: Any, leaf: Any = _NO_LEAF) -> bool:
    if leaf is _NO_LEAF:
      raise _checks.schedule_call_error('stacked', repr(self), path)
    del leaf
    names = path_names(strip_variable_suffix(path))
    return any(names[:len(root)] == root for root in self.roots)

  __eq__ = lambda self, other: (isinstance(other, stacked_predicate)
                                and self.roots == other.roots)
  __hash__ = lambda self: hash(self.roots)
  __repr__ = lambda self: (
      f'stacked_predicate({sorted("/".join(r) for r in self.roots)})')
