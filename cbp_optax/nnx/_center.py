"""``center``: wraps every supported layer of a built NNX model in place."""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from cbp_optax import blocks
from cbp_optax import centering as core

from cbp_optax._paths import path_names
from cbp_optax._paths import path_str
from cbp_optax._stacks import resolve_stack_axes
from cbp_optax.nnx._wrapper import Centered
from cbp_optax.nnx._wrapper import SPEC_OF
from cbp_optax.nnx._wrapper import layer_spec


def centered_layers(model: nnx.Module) -> list[Centered]:
  """Every :class:`Centered` layer inside ``model``."""
  return [m for _, m in nnx.iter_modules(model) if isinstance(m, Centered)]


def centered_paths(model: nnx.Module) -> list[tuple[tuple[Any, ...], Centered]]:
  return [(tuple(path), m) for path, m in nnx.iter_modules(model)
          if isinstance(m, Centered)]


def plain_spec(layer: nnx.Module) -> core.LayerSpec:
  """A layer's spec without the checks centering needs (Muon needs none)."""
  if isinstance(layer, nnx.Conv):
    return core.conv_spec(layer.kernel_size, layer.in_features,
                          layer.out_features, layer.feature_group_count)
  if isinstance(layer, nnx.ConvTranspose):
    return core.conv_spec(layer.kernel_size, layer.in_features,
                          layer.out_features, 1, layer.transpose_kernel)
  if isinstance(layer, nnx.LinearGeneral):
    return core.dense_spec(layer.axis, layer.in_features, layer.out_features)
  return core.dense_spec(-1, (layer.in_features,), (layer.out_features,))


CenterReport = core.CenterReport


def _child(node: Any, key: Any) -> Any:
  if isinstance(node, nnx.Module) and isinstance(key, str):
    return getattr(node, key)
  return node[key]


def _set_child(node: Any, key: Any, value: Any) -> None:
  if isinstance(node, nnx.Module) and isinstance(key, str):
    setattr(node, key, value)
  else:
    node[key] = value


def _has_own_params(module: nnx.Module) -> bool:
  return any(isinstance(v, nnx.Param) for v in vars(module).values())


def _graph_paths(
    model: nnx.Module,
) -> tuple[dict[int, list[str]], dict[int, list[str]]]:
  """Every path to every module and every Variable, by ``id``."""
  modules: dict[int, list[str]] = {}
  variables: dict[int, list[str]] = {}

  def walk(node, path, above):
    if isinstance(node, nnx.Module):
      modules.setdefault(id(node), []).append(path_str(path))
    if isinstance(node, nnx.Variable):
      variables.setdefault(id(node), []).append(path_str(path))
    if id(node) in above:
      return
    above = above | {id(node)}
    if isinstance(node, (list, tuple)):
      children = enumerate(node)
    elif isinstance(node, dict):
      children = node.items()
    elif isinstance(node, nnx.Pytree):  # a Module, nnx.List, nnx.Dict
      # Its attributes, as NNX orders them (an nnx.List's indices by number).
      children = sorted(vars(node).items(), key=lambda item: (
          item[0].zfill(20) if item[0].isdigit() else item[0]))
    else:  # a Variable, an array
      return
    for key, child in children:
      walk(child, path + (key,), above)

  walk(model, (), frozenset())
  return modules, variables


def _check_not_shared(paths: list[str]) -> None:
  if len(paths) > 1:
    raise ValueError(
        f'center: one layer is reachable at {" and ".join(map(repr, paths))} '
        '(the same module object at two call sites or under two names). A '
        'shared layer sees two input distributions, and wrapping it at one '
        'path would leave the other path uncentered while the transport '
        'moves the shared bias, changing the function. Give each call site '
        'its own layer, or leave this one out with where=(e.g. where=lambda '
        f'path, layer: path not in {paths!r}).')


def _check_bias_not_tied(
    name: str, layer: nnx.Module, variable_paths: dict[int, list[str]]
) -> None:
  """Refuses a layer whose bias Variable is held elsewhere too: eq. 10's
  move is right for this layer only (a tied kernel is fine)."""
  paths = variable_paths.get(id(layer.bias), [])
  if len(paths) <= 1:
    return
  holders = sorted({p.rpartition('/')[0] or core.MODEL_PATH for p in paths})
  raise core.CannotCenterError(
      f'center: the bias of {name or core.MODEL_PATH!r} is one Variable held '
      f'at {" and ".join(map(repr, paths))} (tied, e.g. b.bias = a.bias). '
      'Centering moves a bias by its own layer\'s W (mu_new - mu_old) at '
      'every transport, which would change what every other holder computes. '
      'Give each layer its own bias (tying only the kernel is fine), or leave '
      f'every holder out: where=lambda path, layer: path not in {holders!r}.')


def center(
    model: nnx.Module, *, where: core.Where = None,
    mean_dtype: Optional[Any] = None, axis_name: Optional[Any] = None,
) -> CenterReport:
  """Centers every supported linear layer of a built model, in place.

  Each ``nnx.Linear``, ``nnx.LinearGeneral``, ``nnx.Conv`` and stride-1
  ``nnx.ConvTranspose`` (exact types, with a bias) becomes ``Centered(layer)``
  wherever it sits (stacks included); with ``mu`` zero, the model computes
  what it did before.

  Args:
    model: the model; changed in place.
    where: None for all layers, a type or tuple of types, or
      ``where(path, layer) -> bool`` (``path`` like ``'blocks/attn/query'``).
    mean_dtype: dtype of the means; the layer's ``param_dtype`` by default.
    axis_name: see :class:`Centered`.

  Returns:
    A :class:`CenterReport` of the layers centered and left (with why).

  Raises:
    ValueError: ``model`` itself is a layer to center (wrap it with
      :class:`Centered`), or one layer is reachable at two paths.
    cbp_optax.centering.CannotCenterError: (a ``ValueError``) a layer whose
      bias Variable is tied to another's. Nothing changes when it raises.

  Examples:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import cbp_optax as cbp
    >>> class MLP(nnx.Module):
    ...   def __init__(self, rngs):
    ...     self.hidden = nnx.Linear(3, 4, rngs=rngs)
    ...     self.norm = nnx.LayerNorm(4, rngs=rngs)
    ...     self.out = nnx.Linear(4, 1, rngs=rngs)
    ...   def __call__(self, x):
    ...     return self.out(nnx.relu(self.norm(self.hidden(x))))
    >>> model = MLP(nnx.Rngs(0))
    >>> x = jnp.ones((8, 3))
    >>> before = model(x)
    >>> report = cbp.nnx.center(model)
    >>> report.centered
    ['hidden', 'out']
    >>> [path for path, reason in report.skipped]
    ['norm']
    >>> type(model.hidden).__name__, model.hidden.mean.shape
    ('Centered', (3,))
    >>> bool(jnp.array_equal(model(x), before))  # mu = 0: the same function
    True

  References:
    Layerwise Conditioned Backpropagation, §4.2, eq. (8).
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(
        f'center: model must be an nnx.Module, got {type(model).__name__}; '
        'for a Linen module use cbp_optax.linen.center.')
  where = core.check_where(where)
  if mean_dtype is not None:
    core.mean_dtype(mean_dtype, None)
  centered, skipped, chosen = [], [], []
  inside_centered = set()
  modules = list(nnx.iter_modules(model))
  module_paths, variable_paths = _graph_paths(model)
  for path, module in modules:
    if isinstance(module, Centered):
      inside_centered.add(tuple(path) + ('layer',))
      _check_bias_not_tied(path_str(path), module.layer, variable_paths)
  for path, module in modules:
    name = path_str(path)
    if isinstance(module, Centered) or tuple(path) in inside_centered:
      continue
    if not _has_own_params(module):
      continue
    try:
      layer_spec(module)
    except (TypeError, ValueError) as error:
      skipped.append((name or core.MODEL_PATH, core.skip_reason(module, error)))
      continue
    if not core.selected(where, name, module):
      skipped.append((name or core.MODEL_PATH, 'not selected by where'))
      continue
    _check_not_shared(module_paths.get(id(module), [name]))
    _check_bias_not_tied(name, module, variable_paths)
    if not path:
      raise ValueError(
          'center: the model itself is a linear layer and cannot be replaced '
          'in place; use cbp_optax.nnx.Centered(model) instead.')
    chosen.append((path, module))
  # Every check first: a refused layer leaves the whole model as it was.
  wrapped = [(path, Centered(module, mean_dtype=mean_dtype,
                             axis_name=axis_name))
             for path, module in chosen]
  for path, layer in wrapped:
    parent = model
    for key in path[:-1]:
      parent = _child(parent, key)
    _set_child(parent, path[-1], layer)
    centered.append(path_str(path))
  return CenterReport(centered=sorted(centered), skipped=sorted(skipped))


def stacked_blocks(
    model: nnx.Module, *stack_paths: str
) -> Callable[[Any, Any], bool]:
  """The ``stacked=`` predicate of ``cbp.cbp`` / ``cbp.equalize`` for ``model``.

  M1 (eq. 7) sees one block per layer of a stack; roots are found from the
  stacked centered layers, or named (``'blocks'``).

  Args:
    model: the model (after :func:`center`, for automatic detection).
    *stack_paths: module paths of layer stacks, like ``'decoder/blocks'``.

  Returns:
    ``stacked(path, leaf) -> bool``, True for parameters inside a stack.

  Examples:
    Three layers built by ``nnx.vmap`` and one head: four M1 blocks.

    >>> import jax
    >>> from flax import nnx
    >>> import cbp_optax as cbp
    >>> @nnx.vmap(in_axes=0, out_axes=0)
    ... def make_layers(key):
    ...   return nnx.Linear(2, 2, rngs=nnx.Rngs(key))
    >>> class Stack(nnx.Module):
    ...   def __init__(self):
    ...     self.blocks = make_layers(jax.random.split(jax.random.key(0), 3))
    ...     self.head = nnx.Linear(2, 1, rngs=nnx.Rngs(1))
    >>> model = Stack()
    >>> cbp.nnx.center(model).centered
    ['blocks', 'head']
    >>> model.blocks.mean.shape  # one mean per layer of the stack
    (3, 2)
    >>> stacked = cbp.nnx.stacked_blocks(model)
    >>> stacked
    stacked_predicate(['blocks'])
    >>> cbp.block_names(nnx.state(model, nnx.Param), stacked=stacked)
    ('blocks/layer[0]', 'blocks/layer[1]', 'blocks/layer[2]', 'head/layer')
    >>> tx = cbp.cbp(1e-3, stacked=stacked)

  References:
    Layerwise Conditioned Backpropagation, eq. (7).
  """
  params = nnx.state(model, nnx.Param)
  shapes = {
      path_names(path): tuple(jnp.shape(leaf))
      for path, leaf in jax.tree_util.tree_leaves_with_path(params)
  }
  roots = blocks.check_stack_paths(shapes, stack_paths)
  if not stack_paths:
    stacks, unstacked = [], []
    for path, module in nnx.iter_modules(model):
      path = tuple(str(p) for p in path)
      if isinstance(module, Centered):
        axes = resolve_stack_axes(
            module.mean.shape, module.spec.mean_shape,
            module.mean.get_metadata().get('stack_axes'))
        if axes and axes[0] == 0:
          stacks.append((path, module.mean.shape[0]))
        elif not axes:
          unstacked.append(path)
      elif type(module) in SPEC_OF and path[-1:] != ('layer',):
        try:
          spec = layer_spec(module)
        except (TypeError, ValueError):
          continue
        if tuple(module.kernel.shape) == spec.kernel_shape:
          unstacked.append(path)
    for path, size in stacks:
      roots.add(blocks.stack_root(shapes, path, size, unstacked))
  return blocks.stacked_predicate(roots)
