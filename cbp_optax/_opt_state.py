"""Which parts of an optimizer state are parameters, for the bias transport.

A copy of the parameters in an optimizer state (schedule-free's ``z``, SAM's
cache, DoG's initial point, ...) moved with its own kernel, ``b_k += W_k
(mu_new - mu_old)`` (§4.2, eq. 10), keeps its function (and by linearity so
do combinations of copies). A parameter-shaped subtree is moved in a
registered parameter field, left in a known state class, and refused
anywhere else, where a silent guess could change the function. Flax's trees
are described by a :class:`TreeKind`.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import numpy as np
import optax

from cbp_optax._optax_states import optax_states
from cbp_optax._optax_states import WRAPPER_FIELDS
from cbp_optax._paths import key_name
from cbp_optax._paths import path_names
from cbp_optax._paths import path_str

Path = tuple[Any, ...]
Shapes = dict[tuple[str, ...], tuple[int, ...]]


class TreeKind(NamedTuple):
  """How a framework's trees hold their leaves, for the walks below.

  Attributes:
    is_box: whether a node is a mutable box around one leaf.
    unbox: the array a box holds.
    store: ``store(box, value)`` writes ``value`` into a box.
    mappings: mapping types, besides ``dict``, that are containers.
    rebuild: ``rebuild(tree, key, child)``: ``tree`` with ``child`` at
      ``key``, or None (copied as a ``dict``).
    moved: whether a box is the model's own, moved already (moves once).
  """

  is_box: Callable[[Any], bool] = lambda _: False
  unbox: Callable[[Any], Any] = lambda leaf: leaf
  store: Optional[Callable[[Any, Any], None]] = None
  mappings: tuple[type, ...] = ()
  rebuild: Optional[Callable[[Any, Any, Any], Any]] = None
  moved: Callable[[Any], bool] = lambda _: False


PLAIN = TreeKind()

# Registered by users: state class -> the fields that hold parameters.
_PARAMETER_FIELDS: dict[type, tuple[str, ...]] = {}
# _VERSION grows with every registration, so a cached check is redone.
_VERSION = 0


class UnclassifiedStateError(TypeError):
  """An optimizer state the transport cannot tell statistic from parameters."""


def register_parameter_state(state_type: type, *fields: str) -> None:
  """See :func:`cbp_optax.centering.register_parameter_state`."""
  if not isinstance(state_type, type):
    raise TypeError('register_parameter_state: state_type must be a class '
                    f'(the state type), got {state_type!r}.')
  bad = [f for f in fields if not isinstance(f, str)]
  if bad:
    raise TypeError('register_parameter_state: fields are attribute names '
                    f'(strings), got {bad[0]!r}.')
  known = (state_type._fields if hasattr(state_type, '_fields') else
           [f.name for f in dataclasses.fields(state_type)]
           if dataclasses.is_dataclass(state_type) else None)
  missing = [f for f in fields if known is not None and f not in known]
  if missing:
    raise ValueError(
        f'register_parameter_state: {state_type.__qualname__} has no field '
        f'{missing[0]!r} (its fields: {", ".join(known)}).')
  global _VERSION
  _PARAMETER_FIELDS[state_type] = tuple(fields)
  _VERSION += 1


class CheckCache:
  """Which optimizers' states were classified already, and for what (a stale
  entry only moves an error into the trace, where it is classified again)."""

  def __init__(self, size: int = 16):
    self._size = size
    self._weak = weakref.WeakKeyDictionary()
    self._held: list[tuple[Any, Any]] = []  # owners without weak references

  def check(self, owner: Any, signature: Any,
            classify: Callable[[], None]) -> None:
    """Runs ``classify()`` unless it passed for ``owner`` and ``signature``."""
    signature = (signature, _VERSION)
    try:
      passed = self._weak.get(owner)
    except TypeError:
      passed = next((s for held, s in self._held if held is owner), None)
    if passed == signature:
      return
    classify()
    try:
      self._weak[owner] = signature
    except TypeError:
      self._held = [(owner, signature)] + [
          e for e in self._held if e[0] is not owner][:self._size - 1]


@functools.cache
def _known() -> dict[type, tuple[str, ...]]:
  """optax's audited classes, and this package's states (statistics)."""
  import cbp_optax  # pylint: disable=import-outside-toplevel
  own = (cbp_optax.EqualizeState, cbp_optax.PreconditionState,
         cbp_optax.KronPreconditionState)
  return {**optax_states()[0], **dict.fromkeys(own, ())}


def parameter_fields(state_type: type) -> Optional[tuple[str, ...]]:
  """The fields of ``state_type`` that hold parameters; None if unknown."""
  if state_type in _PARAMETER_FIELDS:
    return _PARAMETER_FIELDS[state_type]
  return _known().get(state_type)


class LayerMove(NamedTuple):
  """One centered layer, as the transport of a parameter copy sees it.

  Attributes:
    path: the layer's path (keys) in the parameter tree.
    kernel_key, bias_key: the kernel's and the bias's paths under ``path``.
    bias_shape: the bias's shape (stack axes included).
    kernel: the model's updated kernel, for a copy without its own.
    kernel_trained: whether the optimizer trains the kernel.
    shift: ``shift(kernel, bias) -> bias + W (mu_new - mu_old)``, or None.
    kernel_path: a shared kernel's full path; None for ``path + kernel_key``.
  """

  path: Path
  kernel_key: Path
  bias_key: Path
  bias_shape: tuple[int, ...]
  kernel: Any
  kernel_trained: bool
  shift: Optional[Callable[[Any, Any], Any]]
  kernel_path: Optional[Path] = None


def _lookup(tree: Any, path: Path, kind: TreeKind) -> Any:
  for key in path:
    if kind.is_box(tree) or not hasattr(tree, 'keys'):
      return None
    try:
      if key not in tree:
        return None
      tree = tree[key]
    except TypeError:
      return None
  return tree


def _value(leaf: Any, kind: TreeKind) -> Any:
  return kind.unbox(leaf) if kind.is_box(leaf) else leaf


def _shape(leaf: Any, kind: TreeKind) -> Optional[tuple[int, ...]]:
  """An array leaf's (or box's) shape; None for anything else."""
  value = _value(leaf, kind)
  if hasattr(value, 'shape') and hasattr(value, 'dtype'):
    return tuple(np.shape(value))
  return None


def parameter_shaped(tree: Any, moves: Sequence[LayerMove],
                     kind: TreeKind = PLAIN) -> bool:
  """True when ``tree`` holds a centered bias's shape at its path."""
  return hasattr(tree, 'keys') and any(
      _shape(_lookup(tree, m.path + m.bias_key, kind), kind) == m.bias_shape
      for m in moves)


def _replace(tree: Any, path: Path, value: Any, kind: TreeKind) -> Any:
  """``tree`` with ``value`` at ``path``: in place for a box."""
  leaf = _lookup(tree, path, kind)
  if kind.is_box(leaf):
    kind.store(leaf, value)
    return tree
  key = path[0]
  child = (value if len(path) == 1
           else _replace(tree[key], path[1:], value, kind))
  rebuilt = kind.rebuild and kind.rebuild(tree, key, child)
  if rebuilt is not None:
    return rebuilt
  new = {**tree, key: child}
  return new if type(tree) is dict else type(tree)(new)


def parameter_shapes(params: Any, kind: TreeKind = PLAIN) -> Shapes:
  """Every array leaf's path names and shape (to match copies against)."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(params,
                                                   is_leaf=kind.is_box)
  return {path_names(path): _shape(leaf, kind) for path, leaf in leaves
          if _shape(leaf, kind) is not None}


def _check_matches(copy: Any, shapes: Shapes, where: str,
                   kind: TreeKind) -> None:
  """Refuses a copy whose leaves are not the model's parameters."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(copy, is_leaf=kind.is_box)
  for path, leaf in leaves:
    names, shape = path_names(path), _shape(leaf, kind)
    if shape is None or shapes.get(names) == shape:
      continue
    found = ('the model has no parameter there' if names not in shapes else
             f"the model's is shaped {shapes[names]}, the copy's {shape}")
    raise UnclassifiedStateError(
        f'transport: {where} is a copy of parameters, but its leaf at '
        f"{path_str(names)!r} matches none of the model's ({found}): the "
        'optimizer (or opt_state) was built for another tree than the one '
        'transported (a submodule, say), and its copies would be left '
        'unmoved. Build the optimizer on the transported model (select the '
        'part it trains with wrt=, optax.masked or optax.partition), or '
        'transport the tree the optimizer was built for.')


def transport_copy(copy: Any, moves: Sequence[LayerMove], where: str,
                   kind: TreeKind = PLAIN,
                   shapes: Optional[Shapes] = None) -> Any:
  """Moves every centered bias in one parameter copy by its own kernel
  (boxes in place); with ``shapes``, a copy of another tree is refused.

  Raises:
    UnclassifiedStateError: a copy holding a layer's bias without its kernel
      (or the reverse), or a copy of another tree than the model's.
    ValueError: a 16-bit copy of a centered bias.
  """
  if copy is None:
    return copy
  if not hasattr(copy, 'keys'):
    raise UnclassifiedStateError(
        f'transport: {where} is registered as holding parameters but holds '
        f'a {type(copy).__name__}, not a tree like the parameters.')
  if shapes is not None:
    _check_matches(copy, shapes, where, kind)
  for move in moves:
    bias = _lookup(copy, move.path + move.bias_key, kind)
    kernel = _lookup(copy, move.kernel_path or move.path + move.kernel_key,
                     kind)
    has_bias = _shape(bias, kind) is not None
    has_kernel = _shape(kernel, kind) is not None
    if not has_bias and not has_kernel:
      continue  # this copy does not hold the layer (a partition)
    if has_bias and not has_kernel and not move.kernel_trained:
      kernel, has_kernel = move.kernel, True  # the copy's is the model's
    if not (has_bias and has_kernel):
      held, lacking = ('bias', 'kernel') if has_bias else ('kernel', 'bias')
      raise UnclassifiedStateError(
          f'transport: {where} holds the {held} of the centered layer '
          f'{path_str(move.path)!r} but not its {lacking} (a mask or '
          'partition that splits one layer between optimizers): no bias '
          'move keeps such a copy\'s function. Give the kernel and the bias '
          'of a centered layer the same optimizer.')
    shared = kind.is_box(bias) and kind.moved(bias)
    dtype = np.dtype(_value(bias, kind).dtype)
    if not shared and dtype.itemsize < 4:
      raise ValueError(
          f'transport: {where} keeps the bias of the centered layer '
          f'{path_str(move.path)!r} in {dtype}: every transport rounds it, '
          'and with no float32 residual (the model\'s own 16-bit bias has '
          'one) the roundings add up. Keep the optimizer\'s parameter '
          'copies in float32: pass state_dtype=jnp.float32 to '
          "cbp.recommended or to optax.contrib's schedule_free(_adamw).")
    if move.shift is not None and not shared:
      new = move.shift(_value(kernel, kind), _value(bias, kind))
      copy = _replace(copy, move.path + move.bias_key, new, kind)
  return copy


def _refusal(owner: Optional[tuple[type, Any]], label: str,
             what: Optional[str] = None) -> str:
  """Why a parameter-sized tree (``what``: in a form no move applies to)
  in an unknown place is refused, and how to declare it."""
  holder = ('the optimizer state' if owner is None else
            f'the optimizer state type {owner[0].__module__}.'
            f'{owner[0].__qualname__}')
  place = (f'at {label}, directly in a chain or wrapper rather than in a '
           'state type' if owner is None else
           f'in its field {owner[1]!r} (at {label})')
  declare = ("cbp_optax.centering.register_parameter_state(StateType, "
             "'field', ...) declares the fields holding a copy (or an "
             'average) of the parameters, moved with their own kernels; '
             'register_parameter_state(StateType) declares gradient '
             'statistics only.')
  if what:
    declare = ('A copy in that form cannot be moved: keep it as a tree like '
               'the parameters in a field of a NamedTuple state. ' + declare)
  elif owner is None:
    declare = 'Return a NamedTuple state from your transform. ' + declare
  return (f'transport: {holder} holds '
          f'{what or "a tree shaped like the parameters"} {place}: a copy '
          'of the parameters (moved with the biases, so that its function '
          'is kept) or a gradient statistic (left)? The transport does not '
          'guess. ' + declare)


def transport_state(
    state: Any, moves: Sequence[LayerMove], *, what: str = 'opt_state',
    kind: TreeKind = PLAIN, params: Any = None,
) -> Any:
  """``state`` with every parameter copy transported (see the module doc).

  With ``LayerMove.shift`` None it only classifies; with ``params``, a copy
  not shaped like the model's parameters is refused.

  Raises:
    UnclassifiedStateError: an unclassified parameter-shaped tree, a refused
      state type, or a copy that splits a layer.
  """
  if not moves:
    return state
  shapes = None if params is None else parameter_shapes(params, kind)
  leaf_shapes = sorted(shapes.values()) if shapes else []
  size = sum(int(np.prod(s)) for s in leaf_shapes)
  optax_fields, refused = optax_states()

  def walk(node, owner, label):
    # owner: (state class, field, its parameter fields) above node, or None.
    unknown = owner is None or owner[2] is None
    children, treedef = jax.tree_util.tree_flatten_with_path(
        node, is_leaf=lambda x: x is not node)
    if (node is None or kind.is_box(node)
        or jax.tree_util.treedef_is_leaf(treedef)):
      if unknown and size > 1 and _shape(node, kind) == (size,):
        raise UnclassifiedStateError(_refusal(
            owner and owner[:2], label,
            f'a vector of {size} entries, as many as the parameters (a '
            'raveled copy, as jax.flatten_util.ravel_pytree makes)'))
      return node
    if owner is not None and owner[2] and owner[1] in owner[2]:
      return transport_copy(node, moves, label, kind, shapes)
    if parameter_shaped(node, moves, kind):
      if unknown:
        raise UnclassifiedStateError(_refusal(owner and owner[:2], label))
      return node  # a gradient statistic of a known class
    children = [(key_name(path[0]), child) for path, child in children]
    named = hasattr(node, '_fields')
    held = [_shape(child, kind) for _, child in children]
    if (unknown and len(leaf_shapes) > 1 and not named and None not in held
        and isinstance(node, (list, tuple)) and sorted(held) == leaf_shapes):
      raise UnclassifiedStateError(_refusal(
          owner and owner[:2], label,
          f'a {type(node).__name__} of {len(children)} arrays shaped like '
          "the parameters' leaves (a copy as jax.tree.leaves gives it)"))
    if (type(node) in (dict, list, tuple) or isinstance(node, kind.mappings)
        or (isinstance(node, tuple) and not named)):
      return jax.tree_util.tree_unflatten(treedef, [
          walk(child, owner, f'{label}[{name!r}]')
          for name, child in children])
    state_type = type(node)
    if state_type in refused:
      raise UnclassifiedStateError(
          f"transport: optax's {state_type.__qualname__} cannot be "
          f'transported: {refused[state_type]}. Train a centered model '
          'with another optimizer, or leave centering out.')
    fields = parameter_fields(state_type)
    names = [name for name, _ in children]
    missing = [f for f in (fields or ()) if f not in names]
    if missing and state_type in _PARAMETER_FIELDS:
      raise ValueError(
          f'register_parameter_state: {state_type.__qualname__} was '
          f'registered with the field {missing[0]!r}, which its state at '
          f'{label} does not have (its pytree children: '
          f'{", ".join(map(str, names))}); a state type must flatten with '
          'its field names as keys.')
    return jax.tree_util.tree_unflatten(treedef, [
        walk(child,
             None if (state_type in optax_fields and name in WRAPPER_FIELDS)
             else (state_type, name, fields),
             f'{label}.{name}' if isinstance(name, str) else
             f'{label}[{name!r}]')
        for name, child in children])

  return walk(state, None, what)


def find_states(state: Any, state_type: type) -> list[Any]:
  """Every NamedTuple ``state_type`` in ``state``, nested ones too (optax's
  search by the class's name, kept to the class itself)."""
  return [found for _, found in optax.tree.get_all_with_path(
      state, state_type.__name__, lambda _, v: isinstance(v, state_type))]


def check_fusable(state: Any, where: str) -> None:
  """Refuses ``optax.lookahead`` (a parameter pair) in a fused step."""
  if find_states(state, optax.LookaheadState):
    raise TypeError(
        f'{where}: optax.lookahead updates an optax.LookaheadParams pair '
        '(fast and slow parameters), and the fused step differentiates and '
        "updates the model's own parameters: it cannot run it. Write the "
        'step by hand on LookaheadParams (differentiate at .fast, '
        'tx.update(grads, opt_state, lookahead_params)) and transport both '
        'with cbp_optax.linen.transport(lookahead_params, centering, '
        'opt_state=opt_state), which moves each by its own kernel.')


def unshared(tree: Any) -> Any:
  """``tree`` with every array copied into a buffer of its own, so that
  what the adapters hand out outlives the donating fused steps."""
  return jax.tree.map(
      lambda x: jax.numpy.copy(x) if isinstance(x, jax.Array) else x, tree)


def evaluation_params(state: Any, params: Any) -> Any:
  """The parameters to evaluate (arrays): schedule-free's ``x`` if ``state``
  has one; ValueError for several, or one over part of ``params``."""
  found = find_states(state, optax.contrib.ScheduleFreeState)
  if not found:
    return params
  if len(found) > 1:
    raise ValueError(
        f'eval: the optimizer state holds {len(found)} schedule_free states; '
        'which one gives the evaluation parameters is ambiguous.')
  if jax.tree.structure(found[0].z) != jax.tree.structure(params):
    raise ValueError(
        'eval: the schedule_free state covers only part of the parameters '
        '(its z is shaped unlike them); compute the evaluation parameters '
        'of that part with optax.contrib.schedule_free_eval_params.')
  return optax.contrib.schedule_free_eval_params(found[0], params)


def dimension_numbers_fn(table: dict[tuple[str, ...], Any],
                         kind: TreeKind = PLAIN) -> Callable[[Any], Any]:
  """Muon's ``dims(params)``: ``table[path names]`` at each leaf, else None."""
  return lambda params: jax.tree_util.tree_map_with_path(
      lambda path, _: table.get(path_names(path)), params,
      is_leaf=kind.is_box)
