"""Which parts of an optimizer state are parameters, for the bias transport.

A copy of the parameters in an optimizer state (schedule-free's ``z``, SAM's
cache, DoG's initial point, ...) moved with its own kernel, ``b_k += W_k
(mu_new - mu_old)`` (§4.2, eq. 10), keeps its function. A parameter-shaped
subtree is moved in a registered parameter field, left in a known state
class, and refused anywhere else: a guess could change the function.
"""

from __future__ import annotations

import dataclasses
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
  """How a framework's trees hold their leaves: ``is_box(node)``, a mutable
  box around one leaf; ``unbox(box)``; ``store(box, value)``; ``mappings``,
  container types besides ``dict``; ``rebuild(tree, key, child)``, ``tree``
  with ``child`` at ``key`` (None: copied as a ``dict``); ``moved(box)``,
  the model's own box, moved already (it moves once)."""

  is_box: Callable[[Any], bool] = lambda _: False
  unbox: Callable[[Any], Any] = lambda leaf: leaf
  store: Optional[Callable[[Any, Any], None]] = None
  mappings: tuple[type, ...] = ()
  rebuild: Optional[Callable[[Any, Any, Any], Any]] = None
  moved: Callable[[Any], bool] = lambda _: False


PLAIN = TreeKind()

# Registered (by users and cbp_optax's own states): class -> parameter fields.
_PARAMETER_FIELDS: dict[type, tuple[str, ...]] = {}


class UnclassifiedStateError(TypeError):
  """An optimizer state the transport cannot tell statistic from parameters."""


def register_parameter_state(state_type: type, *fields: str) -> None:
  """See :func:`cbp_optax.centering.register_parameter_state`."""
  if not isinstance(state_type, type) or not all(
      isinstance(f, str) for f in fields):
    raise TypeError('register_parameter_state: state_type must be a class and'
                    f' the fields strings, got {state_type!r}, {fields!r}.')
  known = (state_type._fields if hasattr(state_type, '_fields') else
           [f.name for f in dataclasses.fields(state_type)]
           if dataclasses.is_dataclass(state_type) else None)
  if missing := [f for f in fields if known is not None and f not in known]:
    raise ValueError(
        f'register_parameter_state: {state_type.__qualname__} has no field '
        f'{missing[0]!r} (its fields: {", ".join(known)}).')
  _PARAMETER_FIELDS[state_type] = tuple(fields)


class CheckCache:
  """Which optimizers' states were classified already, and for what."""

  def __init__(self, size: int = 16):
    self._size, self._weak = size, weakref.WeakKeyDictionary()
    self._held: list[tuple[Any, Any]] = []  # owners without weak references

  def check(self, owner: Any, signature: Any,
            classify: Callable[[], None]) -> None:
    """Runs ``classify()`` unless it passed for ``owner`` and ``signature``
    (and the registrations since)."""
    signature = (signature, tuple(_PARAMETER_FIELDS.items()))
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


def parameter_fields(state_type: type) -> Optional[tuple[str, ...]]:
  """The fields of ``state_type`` that hold parameters; None if unknown."""
  return _PARAMETER_FIELDS.get(state_type, optax_states()[0].get(state_type))


class LayerMove(NamedTuple):
  """One centered layer, as the transport of a parameter copy sees it."""

  path: Path  # the layer's path (keys) in the parameter tree
  kernel_key: Path  # the kernel's path under ``path``
  bias_key: Path  # the bias's path under ``path``
  bias_shape: tuple[int, ...]  # stack axes included
  kernel: Any  # the model's updated kernel, for a copy without its own
  kernel_trained: bool  # whether the optimizer trains the kernel
  shift: Optional[Callable[[Any, Any], Any]]  # bias + W (mu_new - mu_old)
  kernel_path: Optional[Path] = None  # a shared kernel's full path


def _lookup(tree: Any, path: Path, kind: TreeKind) -> Any:
  for key in path:
    if kind.is_box(tree) or not hasattr(tree, 'keys'):
      return None
    try:
      tree = tree[key] if key in tree else None
    except TypeError:
      return None
  return tree


def _value(leaf: Any, kind: TreeKind) -> Any:
  return kind.unbox(leaf) if kind.is_box(leaf) else leaf


def _shape(leaf: Any, kind: TreeKind) -> Optional[tuple[int, ...]]:
  """An array leaf's (or box's) shape; None for anything else."""
  value = _value(leaf, kind)
  return (tuple(np.shape(value)) if hasattr(value, 'shape')
          and hasattr(value, 'dtype') else None)


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


def _shapes(tree: Any, kind: TreeKind) -> Shapes:
  """Every array leaf's path names and shape."""
  return {path_names(path): shape for path, leaf in
          jax.tree_util.tree_leaves_with_path(tree, is_leaf=kind.is_box)
          if (shape := _shape(leaf, kind)) is not None}


def transport_copy(copy: Any, moves: Sequence[LayerMove], where: str,
                   kind: TreeKind = PLAIN,
                   shapes: Optional[Shapes] = None) -> Any:
  """Moves every centered bias in one parameter copy by its own kernel
  (boxes in place). Refuses (UnclassifiedStateError) a copy holding a layer's
  bias without its kernel or the reverse, or (with ``shapes``) a copy of
  another tree; a 16-bit copy of a centered bias (ValueError)."""
  if copy is None:
    return copy
  if not hasattr(copy, 'keys'):
    raise UnclassifiedStateError(
        f'transport: {where} is registered as holding parameters but holds '
        f'a {type(copy).__name__}, not a tree like the parameters.')
  for names, shape in (() if shapes is None else _shapes(copy, kind).items()):
    if shapes.get(names) != shape:
      found = ('the model has no parameter there' if names not in shapes else
               f"the model's is shaped {shapes[names]}, the copy's {shape}")
      raise UnclassifiedStateError(
          f'transport: {where} is a copy of parameters whose leaf at '
          f"{path_str(names)!r} matches none of the model's ({found}): the "
          'optimizer was built for another tree (a submodule?). Build it on '
          'the transported model, or transport its own tree.')
  for move in moves:
    bias = _lookup(copy, move.path + move.bias_key, kind)
    kernel = _lookup(copy, move.kernel_path or move.path + move.kernel_key,
                     kind)
    has_bias, has_kernel = (_shape(x, kind) is not None for x in (bias, kernel))
    if not has_bias and not has_kernel:
      continue  # this copy does not hold the layer (a partition)
    if has_bias and not has_kernel and not move.kernel_trained:
      kernel, has_kernel = move.kernel, True  # the copy's is the model's
    if not (has_bias and has_kernel):
      held, lacking = ('bias', 'kernel') if has_bias else ('kernel', 'bias')
      raise UnclassifiedStateError(
          f'transport: {where} holds the {held} of the centered layer '
          f'{path_str(move.path)!r} but not its {lacking}, which no bias move '
          'keeps. Give its kernel and bias the same optimizer.')
    shared = kind.is_box(bias) and kind.moved(bias)
    dtype = np.dtype(_value(bias, kind).dtype)
    if not shared and dtype.itemsize < 4:
      raise ValueError(
          f'transport: {where} keeps the bias of the centered layer '
          f'{path_str(move.path)!r} in {dtype}, whose roundings add up over '
          'transports: pass state_dtype=jnp.float32 to cbp.recommended or '
          "optax.contrib's schedule_free(_adamw).")
    if move.shift is not None and not shared:
      new = move.shift(_value(kernel, kind), _value(bias, kind))
      copy = _replace(copy, move.path + move.bias_key, new, kind)
  return copy


def _refusal(owner: Optional[tuple[type, Any]], label: str,
             form: Optional[str] = None) -> str:
  """Why a parameter-sized tree (``form``: one that fits no move) is refused."""
  holder, place = (
      ('The optimizer state', f'directly in a chain or wrapper (at {label})')
      if owner is None else (f'{owner[0].__module__}.{owner[0].__qualname__}',
                             f'in its field {owner[1]!r} (at {label})'))
  keep = ('Keep a copy as a tree like the parameters in a field of a '
          'NamedTuple state, and declare it' if owner is None or form
          else 'Declare it')
  return (f'transport: {holder} holds '
          f'{form or "a tree shaped like the parameters"} {place}: a copy of '
          f'the parameters (moved) or a gradient statistic (left)? {keep}: '
          "cbp_optax.centering.register_parameter_state(StateType, 'field', "
          '...) names the fields holding a copy; register_parameter_state('
          'StateType) declares statistics only.')


def transport_state(state: Any, moves: Sequence[LayerMove], *,
                    what: str = 'opt_state', kind: TreeKind = PLAIN,
                    params: Any = None) -> Any:
  """``state`` with every parameter copy transported (see the module doc);
  with ``LayerMove.shift`` None it only classifies. Raises
  UnclassifiedStateError for an unclassified parameter-shaped tree, a
  refused class, a copy that splits a layer, or (given ``params``) one of
  another tree."""
  if not moves:
    return state
  shapes = None if params is None else _shapes(params, kind)
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
    if hasattr(node, 'keys') and any(
        _shape(_lookup(node, m.path + m.bias_key, kind), kind) == m.bias_shape
        for m in moves):  # shaped like the parameters
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
          f'transported: {refused[state_type]}. Use another optimizer, or '
          'leave centering out.')
    fields = parameter_fields(state_type)
    names = [name for name, _ in children]
    missing = [f for f in (fields or ()) if f not in names]
    if missing and state_type in _PARAMETER_FIELDS:
      raise ValueError(
          f'register_parameter_state: {state_type.__qualname__} has no field '
          f'{missing[0]!r} at {label} (its pytree children: '
          f'{", ".join(map(str, names))}).')
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
        f'{where}: optax.lookahead updates an optax.LookaheadParams pair, not '
        "the model's parameters. Write the step by hand on LookaheadParams "
        'and transport it with cbp_optax.linen.transport(lookahead_params, '
        'centering, opt_state=opt_state).')


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
    raise ValueError(f'eval: the optimizer state holds {len(found)} '
                     'schedule_free states; which gives x?')
  if jax.tree.structure(found[0].z) != jax.tree.structure(params):
    raise ValueError(
        'eval: the schedule_free state covers part of the parameters; use '
        'optax.contrib.schedule_free_eval_params on that part.')
  return optax.contrib.schedule_free_eval_params(found[0], params)


def dimension_numbers_fn(table: dict[tuple[str, ...], Any],
                         kind: TreeKind = PLAIN) -> Callable[[Any], Any]:
  """Muon's ``dims(params)``: ``table[path names]`` at each leaf, else None."""
  return lambda params: jax.tree_util.tree_map_with_path(
      lambda path, _: table.get(path_names(path)), params,
      is_leaf=kind.is_box)
