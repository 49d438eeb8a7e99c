"""``center``: wraps every supported layer of a built NNX model in place."""

from __future__ import annotations

from typing import Any, Callable, Optional

from flax import nnx

from cbp_optax import centering as core
from cbp_optax._paths import path_str
from cbp_optax._stacks import resolve_stack_axes
from cbp_optax.nnx._wrapper import Centered
from cbp_optax.nnx._wrapper import SUPPORTED
from cbp_optax.nnx._wrapper import layer_spec


def centered_paths(model: nnx.Module) -> list[tuple[tuple[Any, ...], Centered]]:
  """``(path, layer)`` of every :class:`Centered` layer inside ``model``."""
  return [(tuple(path), m) for path, m in nnx.iter_modules(model)
          if isinstance(m, Centered)]


def centered_layers(model: nnx.Module) -> list[Centered]:
  return [layer for _, layer in centered_paths(model)]


CenterReport = core.CenterReport


def _set_at(node: Any, path: tuple[Any, ...], value: Any) -> None:
  """Puts ``value`` at ``path``: a module's attribute, or a container item."""
  def is_attribute(node, key):
    return isinstance(node, nnx.Module) and isinstance(key, str)

  for key in path[:-1]:
    node = getattr(node, key) if is_attribute(node, key) else node[key]
  if is_attribute(node, path[-1]):
    setattr(node, path[-1], value)
  else:
    node[path[-1]] = value


def _graph_paths(model: nnx.Module
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


def _check_bias_not_tied(name: str, layer: nnx.Module,
                         variable_paths: dict[int, list[str]]) -> None:
  """Refuses a layer whose bias Variable is held elsewhere too: eq. 10's
  move is right for this layer only (a tied kernel is fine)."""
  paths = variable_paths.get(id(layer.bias), [])
  if len(paths) > 1:
    holders = sorted({p.rpartition('/')[0] or core.MODEL_PATH for p in paths})
    raise core.CannotCenterError(
        f'center: the bias of {name or core.MODEL_PATH!r} is one Variable '
        f'held at {" and ".join(map(repr, paths))}, which its transport would'
        ' move for all; untie it, or leave every holder out: where=lambda '
        f'path, layer: path not in {holders!r}.')


def center(model: nnx.Module, *, where: core.Where = None,
           mean_dtype: Optional[Any] = None,
           axis_name: Optional[Any] = None) -> CenterReport:
  """Centers every supported linear layer of a built model, in place.

  Each ``nnx.Linear``, ``nnx.LinearGeneral``, ``nnx.Conv`` and stride-1
  ``nnx.ConvTranspose`` (exact types, with a bias), stacks included, becomes
  ``Centered(layer)``, computing what it did while ``mu`` is zero.

  Args:
    model: the model; changed in place.
    where: None for all layers, a type or tuple of types, or
      ``where(path, layer) -> bool`` (``path`` like ``'blocks/attn/query'``).
    mean_dtype: dtype of the means; the layer's ``param_dtype`` by default.
    axis_name: see :class:`Centered`.

  Returns:
    A :class:`CenterReport` of the layers centered and left (with why).

  Raises:
    ValueError: ``model`` itself is a layer to center (use :class:`Centered`),
      or one layer is reachable at two paths; a
      :class:`cbp_optax.centering.CannotCenterError` for a layer whose bias
      Variable is tied to another's. Nothing changes when it raises.

  Examples:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import cbp_optax as cbp
    >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)),
    ...                        nnx.LayerNorm(4, rngs=nnx.Rngs(0)))
    >>> x = jnp.ones((8, 3))
    >>> before = model(x)
    >>> print(cbp.nnx.center(model))
    centered (1): layers/0
    left as is (1): layers/1 - LayerNorm: not a layer type centering knows (...)
    >>> type(model.layers[0]).__name__, model.layers[0].mean.shape
    ('Centered', (3,))
    >>> bool(jnp.array_equal(model(x), before))  # mu = 0: the same function
    True

  References:
    Layerwise Conditioned Backpropagation, §4.2, eq. (8).
  """
  if not isinstance(model, nnx.Module):
    raise TypeError('center: model must be an nnx.Module, got '
                    f'{type(model).__name__} (Linen: cbp_optax.linen.center).')
  where = core.check_where(where)
  if mean_dtype is not None:
    core.mean_dtype(mean_dtype, None)
  skipped, chosen = [], []
  inside_centered = set()
  modules = list(nnx.iter_modules(model))
  module_paths, variable_paths = _graph_paths(model)
  for path, module in modules:
    if isinstance(module, Centered):
      inside_centered.add(tuple(path) + ('layer',))
      _check_bias_not_tied(path_str(path), module.layer, variable_paths)
  for path, module in modules:
    name = path_str(path)
    if (isinstance(module, Centered) or tuple(path) in inside_centered
        or not any(isinstance(v, nnx.Param) for v in vars(module).values())):
      continue
    reason = core.skip_reason(where, name, module, layer_spec)
    if reason:
      skipped.append((name or core.MODEL_PATH, reason))
      continue
    if len(paths := module_paths.get(id(module), [name])) > 1:
      raise ValueError(
          f'center: one layer is reachable at {" and ".join(map(repr, paths))}'
          ': a shared layer would be centered at one path only; give each call'
          ' site its own layer, or leave it out with where=.')
    _check_bias_not_tied(name, module, variable_paths)
    if not path:
      raise ValueError('center: the model itself is a linear layer, which '
                       'cannot be replaced in place: use Centered(model).')
    chosen.append((path, module))
  # Every check first: a refused layer leaves the whole model as it was.
  wrapped = [(path, Centered(module, mean_dtype=mean_dtype,
                             axis_name=axis_name))
             for path, module in chosen]
  for path, layer in wrapped:
    _set_at(model, path, layer)
  return CenterReport(centered=sorted(path_str(path) for path, _ in wrapped),
                      skipped=sorted(skipped))


def stacked_blocks(model: nnx.Module,
                   *stack_paths: str) -> Callable[[Any, Any], bool]:
  """The ``stacked=`` predicate of ``cbp.cbp`` / ``cbp.equalize`` for ``model``.

  M1 (eq. 7) sees one block per layer of a stack; roots are found from the
  stacked centered layers, or named (``'blocks'``).

  Args:
    model: the model (after :func:`center`, for automatic detection).
    *stack_paths: module paths of layer stacks, like ``'decoder/blocks'``.

  Returns:
    ``stacked(path, leaf) -> bool``, True for parameters inside a stack.

  Examples:
    Three layers built by ``nnx.vmap`` and a head: four M1 blocks.

    >>> import jax
    >>> from flax import nnx
    >>> import cbp_optax as cbp
    >>> @nnx.vmap(in_axes=0, out_axes=0)
    ... def make_layers(key):
    ...   return nnx.Linear(2, 2, rngs=nnx.Rngs(key))
    >>> layers = make_layers(jax.random.split(jax.random.key(0), 3))
    >>> model = nnx.Sequential(layers, nnx.Linear(2, 1, rngs=nnx.Rngs(1)))
    >>> _ = cbp.nnx.center(model)
    >>> model.layers[0].mean.shape  # one mean per layer of the stack
    (3, 2)
    >>> stacked = cbp.nnx.stacked_blocks(model)
    >>> cbp.block_names(nnx.state(model, nnx.Param), stacked=stacked)
    ('layers/0/layer[0]', 'layers/0/layer[1]', 'layers/0/layer[2]',
     'layers/1/layer')
    >>> tx = cbp.cbp(1e-3, stacked=stacked)

  References:
    Layerwise Conditioned Backpropagation, eq. (7).
  """
  def layers():
    for path, module in nnx.iter_modules(model):
      path = tuple(str(p) for p in path)
      if isinstance(module, Centered):
        mean = module.mean
        yield path, resolve_stack_axes(
            mean.shape, module.spec.mean_shape,
            mean.get_metadata().get('stack_axes')), mean.shape
      elif type(module) in SUPPORTED and path[-1:] != (core.LAYER_KEY,):
        try:
          spec = layer_spec(module)
        except (TypeError, ValueError):
          continue
        if tuple(module.kernel.shape) == spec.kernel_shape:
          yield path, (), None

  return core.stacked_blocks(nnx.state(model, nnx.Param), stack_paths,
                             layers())
