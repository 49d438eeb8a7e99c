"""Which parts of an optimizer state are parameters, for the bias transport.

A copy of the parameters in an optimizer state (schedule-free's ``z``,
SAM's cache, DoG's initial point, ...) moved with its own kernel, ``b_k +=
W_k (mu_new - mu_old)`` (eq. 10), keeps its function (and by linearity so do
combinations of copies). A parameter-shaped subtree is moved in a registered
parameter field, left in a known state type, and refused anywhere else,
where a silent guess could change the function. Flax's trees are described
by a :class:`TreeKind`.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import numpy as np
import optax

from cbp_optax._optax_states import OPTAX_PARAMETER_FIELDS
from cbp_optax._optax_states import OPTAX_REFUSED
from cbp_optax._optax_states import OPTAX_STATISTICS
from cbp_optax._optax_states import WRAPPER_FIELDS
from cbp_optax._paths import key_name
from cbp_optax._paths import path_names
from cbp_optax._paths import path_str

Path = tuple[Any, ...]


def _never(_: Any) -> bool:
  return False


def _unboxed(leaf: Any) -> Any:
  return leaf


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

  is_box: Callable[[Any], bool] = _never
  unbox: Callable[[Any], Any] = _unboxed
  store: Optional[Callable[[Any, Any], None]] = None
  mappings: tuple[type, ...] = ()
  rebuild: Optional[Callable[[Any, Any, Any], Any]] = None
  moved: Callable[[Any], bool] = _never


PLAIN = TreeKind()

# Registered by users: state type -> the fields that hold parameters.
_PARAMETER_FIELDS: dict[type, tuple[str, ...]] = {}
# _VERSION grows with every registration, so a cached check is redone.
_VERSION = 0

_CBP_STATISTICS = frozenset({'EqualizeState', 'PreconditionState',
                             'KronPreconditionState'})

_CONTAINERS = (dict, list, tuple, type(None))


class UnclassifiedStateError(TypeError):
  """An optimizer state the transport cannot tell statistic from parameters."""


def _declared_fields(state_type: type) -> Optional[tuple[str, ...]]:
  """The fields a NamedTuple or dataclass declares; None for another class."""
  if hasattr(state_type, '_fields'):
    return tuple(state_type._fields)
  if dataclasses.is_dataclass(state_type):
    return tuple(f.name for f in dataclasses.fields(state_type))
  return None


def _check_fields_present(state_type: type, fields: Sequence[str],
                          names: Sequence[Any], label: str) -> None:
  """Refuses a registered field that a state of that type does not have."""
  missing = [f for f in fields if f not in names]
  if missing:
    raise ValueError(
        f'register_parameter_state: {state_type.__qualname__} was registered '
        f'with the field {missing[0]!r}, which its state at {label} does not '
        f'have (its pytree children: {", ".join(str(n) for n in names)}); '
        'a state type must flatten with its field names as keys.')


def register_parameter_state(state_type: type, *fields: str) -> None:
  """See :func:`cbp_optax.centering.register_parameter_state`."""
  if not isinstance(state_type, type):
    raise TypeError('register_parameter_state: state_type must be a class '
                    f'(the state type), got {state_type!r}.')
  bad = [f for f in fields if not isinstance(f, str)]
  if bad:
    raise TypeError('register_parameter_state: fields are attribute names '
                    f'(strings), got {bad[0]!r}.')
  known = _declared_fields(state_type)
  if known is not None:
    missing = [f for f in fields if f not in known]
    if missing:
      raise ValueError(
          f'register_parameter_state: {state_type.__qualname__} has no '
          f'field {missing[0]!r} (its fields: {", ".join(known)}).')
  global _VERSION
  _PARAMETER_FIELDS[state_type] = tuple(fields)
  _VERSION += 1


class CheckCache:
  """Which optimizers' states were classified already, and for what (a stale
  entry only moves an error into the trace, where it is classified again)."""

  def __init__(self, size: int = 16):
    self._size = size
    self._weak = weakref.WeakKeyDictionary()
    self._held: list[tuple[Any, Any]] = []

  def _get(self, owner: Any) -> Any:
    try:
      return self._weak.get(owner)
    except TypeError:
      return next((sig for held, sig in self._held if held is owner), None)

  def _put(self, owner: Any, signature: Any) -> None:
    try:
      self._weak[owner] = signature
    except TypeError:
      self._held = [(owner, signature)] + [
          entry for entry in self._held if entry[0] is not owner
      ][:self._size - 1]

  def check(self, owner: Any, signature: Any,
            classify: Callable[[], None]) -> None:
    """Runs ``classify()`` unless it passed for ``owner`` and ``signature``."""
    signature = (signature, _VERSION)
    if self._get(owner) == signature:
      return
    classify()
    self._put(owner, signature)


def _is_optax(state_type: type) -> bool:
  return state_type.__module__.split('.')[0] == 'optax'


def _is_cbp(state_type: type) -> bool:
  return (state_type.__module__.split('.')[0] == 'cbp_optax'
          and state_type.__qualname__ in _CBP_STATISTICS)


def parameter_fields(state_type: type) -> Optional[tuple[str, ...]]:
  """The fields of ``state_type`` that hold parameters; None if unknown."""
  if state_type in _PARAMETER_FIELDS:
    return _PARAMETER_FIELDS[state_type]
  name = state_type.__qualname__
  if _is_optax(state_type):
    if name in OPTAX_PARAMETER_FIELDS:
      return OPTAX_PARAMETER_FIELDS[name]
    if name in OPTAX_STATISTICS:
      return ()
  if _is_cbp(state_type):
    return ()
  return None


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


def _is_array(leaf: Any, kind: TreeKind) -> bool:
  value = _value(leaf, kind)
  return hasattr(value, 'shape') and hasattr(value, 'dtype')


def _holds_bias(tree: Any, move: LayerMove, kind: TreeKind) -> bool:
  leaf = _lookup(tree, move.path + move.bias_key, kind)
  return (_is_array(leaf, kind)
          and tuple(np.shape(_value(leaf, kind))) == move.bias_shape)


def parameter_shaped(tree: Any, moves: Sequence[LayerMove],
                     kind: TreeKind = PLAIN) -> bool:
  """True when ``tree`` holds a centered bias's shape at its path."""
  return hasattr(tree, 'keys') and any(
      _holds_bias(tree, m, kind) for m in moves)


def _replace(tree: Any, path: Path, value: Any, kind: TreeKind) -> Any:
  """``tree`` with ``value`` at ``path``: in place for a box."""
  leaf = _lookup(tree, path, kind)
  if kind.is_box(leaf):
    kind.store(leaf, value)
    return tree
  key = path[0]
  child = (value if len(path) == 1
           else _replace(tree[key], path[1:], value, kind))
  if kind.rebuild is not None:
    rebuilt = kind.rebuild(tree, key, child)
    if rebuilt is not None:
      return rebuilt
  new = dict(tree)
  new[key] = child
  return new if type(tree) is dict else type(tree)(new)


def parameter_shapes(params: Any, kind: TreeKind = PLAIN
                     ) -> dict[tuple[str, ...], tuple[int, ...]]:
  """Every array leaf's path names and shape (to match copies against)."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(params,
                                                   is_leaf=kind.is_box)
  return {path_names(path): tuple(np.shape(_value(leaf, kind)))
          for path, leaf in leaves if _is_array(leaf, kind)}


def _check_matches(copy: Any, shapes: dict[tuple[str, ...], tuple[int, ...]],
                   where: str, kind: TreeKind) -> None:
  """Refuses a copy whose leaves are not the model's parameters."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(copy, is_leaf=kind.is_box)
  for path, leaf in leaves:
    if not _is_array(leaf, kind):
      continue
    names = path_names(path)
    shape = tuple(np.shape(_value(leaf, kind)))
    if shapes.get(names) == shape:
      continue
    found = ('the model has no parameter there' if names not in shapes
             else f'the model\'s is shaped {shapes[names]}, the copy\'s '
             f'{shape}')
    raise UnclassifiedStateError(
        f'transport: {where} is a copy of parameters, but its leaf at '
        f'{path_str(names)!r} matches none of the model\'s ({found}): the '
        'optimizer (or opt_state) was built for another tree than the model '
        'given to the transport, such as a submodule (model.head) while the '
        'whole model is transported, and its copies would be left unmoved. '
        'Build the optimizer on the model that is transported (select the '
        'part it trains with wrt=, or optax.masked / optax.partition), or '
        'transport the same tree the optimizer was built for.')


def transport_copy(copy: Any, moves: Sequence[LayerMove], where: str,
                   kind: TreeKind = PLAIN,
                   shapes: Optional[dict[tuple[str, ...],
                                         tuple[int, ...]]] = None) -> Any:
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
    has_bias, has_kernel = _is_array(bias, kind), _is_array(kernel, kind)
    if not has_bias and not has_kernel:
      continue  # this copy does not hold the layer (a partition)
    if has_bias and not has_kernel and not move.kernel_trained:
      kernel = move.kernel  # not trained: the copy's kernel is the model's
      has_kernel = True
    if not (has_bias and has_kernel):
      held, lacking = ('bias', 'kernel') if has_bias else ('kernel', 'bias')
      raise UnclassifiedStateError(
          f'transport: {where} holds the {held} of the centered layer '
          f'{path_str(move.path)!r} but not its {lacking} (a mask or partition '
          'that splits one layer between optimizers): no bias move keeps the '
          'function of such a copy. Give the kernel and the bias of a '
          'centered layer the same optimizer.')
    shared = kind.is_box(bias) and kind.moved(bias)
    dtype = np.dtype(getattr(_value(bias, kind), 'dtype', np.float32))
    if not shared and dtype.itemsize < 4:
      raise ValueError(
          f'transport: {where} keeps the bias of the centered layer '
          f'{path_str(move.path)!r} in {dtype}: every transport would round '
          'it, and the roundings add up over training (the model\'s own '
          '16-bit bias carries a float32 residual, a copy has none). Keep '
          "the optimizer's parameter copies in float32: pass "
          'state_dtype=jnp.float32 to cbp.recommended or to optax.contrib\'s '
          'schedule_free and schedule_free_adamw.')
    if move.shift is not None and not shared:
      new = move.shift(_value(kernel, kind), _value(bias, kind))
      copy = _replace(copy, move.path + move.bias_key, new, kind)
  return copy


def _children(node: Any) -> tuple[list[tuple[Any, Any]], Any]:
  pairs, treedef = jax.tree_util.tree_flatten_with_path(
      node, is_leaf=lambda x: x is not node)
  return [(path[0], child) for path, child in pairs], treedef


def _is_container(node: Any, kind: TreeKind) -> bool:
  return (type(node) in _CONTAINERS
          or isinstance(node, kind.mappings)
          or (isinstance(node, tuple) and not hasattr(node, '_fields')))


def _stop(node: Any, kind: TreeKind) -> bool:
  if kind.is_box(node):
    return True
  _, treedef = jax.tree_util.tree_flatten(
      node, is_leaf=lambda x: x is not node)
  return jax.tree_util.treedef_is_leaf(treedef) and node is not None


def _unclassified(owner: Optional[tuple[type, Any]], label: str) -> str:
  remedy = (
      'Declare it: cbp_optax.centering.register_parameter_state(StateType, '
      "'field', ...) names the fields that hold a copy (or an average) of "
      'the parameters, which the transport then moves with their own '
      'kernels; register_parameter_state(StateType) with no field declares '
      'that the state holds gradient statistics only.')
  if owner is None:
    return (
        f'transport: the optimizer state holds a tree shaped like the '
        f'parameters at {label}, directly in a chain or wrapper rather than '
        'in a state type, so it cannot be told apart from a copy of the '
        'parameters (which the transport must move) or a gradient statistic '
        '(which it must not). Return a NamedTuple state from your transform '
        'and ' + remedy[0].lower() + remedy[1:])
  state_type, field = owner
  return (
      f'transport: the optimizer state type '
      f'{state_type.__module__}.{state_type.__qualname__} holds a tree '
      f'shaped like the parameters in its field {field!r} (at {label}), and '
      'the transport does not know whether it is a copy of the parameters '
      '(to be moved with the biases, so that the function it represents is '
      'unchanged) or a gradient statistic (to be left). ' + remedy)


def _unstructured(owner: Optional[tuple[type, Any]], label: str,
                  what: str) -> str:
  place = ('directly in a chain or wrapper' if owner is None else
           f'in the field {owner[1]!r} of the state type '
           f'{owner[0].__module__}.{owner[0].__qualname__}')
  return (
      f'transport: the optimizer state holds {what} at {label}, {place}. '
      'The transport cannot tell whether it is a copy of the parameters (to '
      'be moved with the biases) or a gradient statistic, and it cannot '
      'move a copy stored in that form. Keep a copy of the parameters as a '
      'tree like them in a field of a state type, and declare it with '
      "cbp_optax.centering.register_parameter_state(StateType, 'field'); "
      'register_parameter_state(StateType) with no field declares that the '
      'state holds gradient statistics only.')


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
  leaf_shapes = None if shapes is None else list(shapes.values())
  size = None if shapes is None else sum(
      int(np.prod(shape)) for shape in leaf_shapes)

  def unknown(owner):
    return owner is None or owner[2] is None

  def walk(node, owner, label):
    if _stop(node, kind):
      if (size is not None and size > 1 and unknown(owner)
          and _is_array(node, kind)
          and np.shape(_value(node, kind)) == (size,)):
        raise UnclassifiedStateError(_unstructured(
            owner and owner[:2], label,
            f'a vector of {size} entries, as many as the parameters (a '
            'raveled copy, as jax.flatten_util.ravel_pytree makes)'))
      return node
    if owner is not None and owner[2] and owner[1] in owner[2]:
      # A field that holds parameters: the copy itself.
      return transport_copy(node, moves, label, kind, shapes)
    if parameter_shaped(node, moves, kind):
      if unknown(owner):
        raise UnclassifiedStateError(_unclassified(
            owner and owner[:2], label))
      return node  # a gradient statistic of a known type
    children, treedef = _children(node)
    if (leaf_shapes is not None and len(leaf_shapes) > 1 and unknown(owner)
        and isinstance(node, (list, tuple)) and not hasattr(node, '_fields')
        and len(children) == len(leaf_shapes)
        and all(_is_array(c, kind) for _, c in children)
        and sorted(tuple(np.shape(_value(c, kind))) for _, c in children)
        == sorted(leaf_shapes)):
      raise UnclassifiedStateError(_unstructured(
          owner and owner[:2], label,
          f'a {type(node).__name__} of {len(children)} arrays shaped like '
          'the parameters\' leaves (a copy as jax.tree.leaves gives it)'))
    if _is_container(node, kind):
      inner = [walk(child, owner, f'{label}[{key_name(k)!r}]')
               for k, child in children]
      return jax.tree_util.tree_unflatten(treedef, inner)
    state_type = type(node)
    if _is_optax(state_type) and state_type.__qualname__ in OPTAX_REFUSED:
      raise UnclassifiedStateError(
          f'transport: optax\'s {state_type.__qualname__} cannot be '
          f'transported: {OPTAX_REFUSED[state_type.__qualname__]}. Train a '
          'centered model with another optimizer, or leave centering out.')
    fields = parameter_fields(state_type)
    if fields and state_type in _PARAMETER_FIELDS:
      _check_fields_present(state_type, fields,
                            [key_name(k) for k, _ in children], label)
    inner = []
    for key, child in children:
      name = key_name(key)
      wrapper = (_is_optax(state_type) and fields is not None
                 and name in WRAPPER_FIELDS)
      child_owner = None if wrapper else (state_type, name, fields)
      inner.append(walk(child, child_owner,
                        f'{label}.{name}' if isinstance(name, str)
                        else f'{label}[{name!r}]'))
    return jax.tree_util.tree_unflatten(treedef, inner)

  return walk(state, None, what)


def find_states(state: Any, state_type: type,
                kind: TreeKind = PLAIN) -> list[Any]:
  """Every node of type ``state_type`` in ``state`` (outermost first)."""
  found = []

  def visit(node):
    if isinstance(node, state_type):
      found.append(node)
      return True
    return kind.is_box(node)

  jax.tree_util.tree_map(lambda x: x, state, is_leaf=visit)
  return found


def check_fusable(state: Any, where: str, kind: TreeKind = PLAIN) -> None:
  """Refuses ``optax.lookahead`` (a parameter pair) in a fused step."""
  if find_states(state, optax.LookaheadState, kind):
    raise TypeError(
        f'{where}: optax.lookahead updates an optax.LookaheadParams pair '
        '(fast and slow parameters), not the model\'s parameters, and the '
        'fused step differentiates and updates the model\'s own: it cannot '
        'run it. Write the step by hand on LookaheadParams (differentiate '
        'at .fast, tx.update(grads, opt_state, lookahead_params)) and '
        'transport both with cbp_optax.linen.transport(lookahead_params, '
        'centering, opt_state=opt_state), which moves the fast and the slow '
        'parameters each by its own kernel.')


def unshared(tree: Any) -> Any:
  """``tree`` with every array copied into a buffer of its own.

  What the adapters hand out as a separate model or parameter tree must
  outlive the donating fused steps, which delete the buffers of the model
  and the state they are given.
  """
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
  (free,) = found
  if jax.tree.structure(free.z) != jax.tree.structure(params):
    raise ValueError(
        'eval: the schedule_free state covers only part of the parameters '
        '(its z is shaped unlike them); compute the evaluation parameters '
        'of that part with optax.contrib.schedule_free_eval_params.')
  return optax.contrib.schedule_free_eval_params(free, params)


def dimension_numbers_fn(table: dict[tuple[str, ...], Any],
                         kind: TreeKind = PLAIN) -> Callable[[Any], Any]:
  """Muon's ``dims(params)``: ``table[path names]`` at each leaf, else None."""
  def dims(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: table.get(path_names(path)), params,
        is_leaf=kind.is_box)

  return dims
