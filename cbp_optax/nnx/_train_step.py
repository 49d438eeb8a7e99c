"""The fused NNX step: Algorithm 1 as one compiled iteration.

``jax.jit`` over ``nnx.flatten``'s values, not ``nnx.jit``, which takes no
XLA ``compiler_options`` (:func:`cbp_optax._step.compiler_options`).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from cbp_optax import _checks
from cbp_optax._equalize import check_recorded_bounds
from cbp_optax import _opt_state
from cbp_optax import _step
from cbp_optax import centering as core
from cbp_optax._step import StepOutput
from cbp_optax._paths import path_str
from cbp_optax.nnx._center import centered_layers
from cbp_optax.nnx._transport import check_optimizer_state
from cbp_optax.nnx._transport import transport_model
from cbp_optax.nnx._wrapper import Centered
from cbp_optax.nnx._wrapper import RecordedCount

# The NNX words of centering.centered_after_init's message.
_LATE_CENTERING = dict(
    center='cbp.nnx.center',
    remedy=('Build the optimizer (nnx.Optimizer / cbp.nnx.Optimizer) after '
            'calling center.'))


class Optimizer(nnx.Optimizer):
  """``nnx.Optimizer`` that also counts the steps :func:`train_step` skipped.

  ``step`` counts updates applied, ``skipped_steps`` non-finite batches. An
  unclassifiable state raises
  :class:`cbp_optax.centering.UnclassifiedStateError` here.

  Examples:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import cbp_optax as cbp
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> optimizer = cbp.nnx.Optimizer(model, cbp.cbp(1e-3))
    >>> step = cbp.nnx.train_step(lambda m, x, y: jnp.mean((m(x) - y) ** 2))
    >>> x = jnp.ones((4, 2))
    >>> out = step(model, optimizer, x, jnp.full((4, 1), jnp.nan))
    >>> bool(out.skipped), int(optimizer.step[...]), int(optimizer.skipped_steps[...])
    (True, 0, 1)
    >>> out = step(model, optimizer, x, jnp.zeros((4, 1)))
    >>> bool(out.skipped), int(optimizer.step[...]), int(optimizer.skipped_steps[...])
    (False, 1, 1)
  """

  def __init__(self, model: nnx.Module, tx: Any, *, wrt: Any = nnx.Param):
    super().__init__(model, tx, wrt=wrt)
    self.skipped_steps = nnx.OptState(jnp.zeros((), jnp.int32))
    check_optimizer_state(model, self, 'Optimizer')

  def update(self, model: nnx.Module, grads: Any, /, **kwargs: Any) -> Any:
    """``nnx.Optimizer.update``; says so when ``center`` came after it."""
    try:
      return super().update(model, grads, **kwargs)
    except (TypeError, ValueError) as error:
      hint = core.centered_after_init(grads, nnx.state(self),
                                      **_LATE_CENTERING)
      if hint:
        raise ValueError(f'Optimizer.update: {hint}') from error
      raise


def _is_node(x: Any) -> bool:
  return isinstance(x, (nnx.Pytree, nnx.Variable))


def _graph_nodes(tree: Any) -> list[Any]:
  return [x for x in jax.tree.leaves(tree, is_leaf=_is_node) if _is_node(x)]


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Slot:
  """Where a graph-node argument sat in a step's ``args`` (static)."""

  index: int


def _slots(args: Any, nodes: list[Any]) -> Any:
  index = {id(node): i for i, node in enumerate(nodes)}
  return jax.tree.map(
      lambda x: _Slot(index[id(x)]) if _is_node(x) else x, args,
      is_leaf=_is_node)


def _fill_slots(slotted: Any, nodes: Sequence[Any]) -> Any:
  return jax.tree.map(
      lambda x: nodes[x.index] if isinstance(x, _Slot) else x, slotted,
      is_leaf=lambda x: isinstance(x, _Slot))


def _check_step_arguments(model: Any, optimizer: Any) -> None:
  if isinstance(model, nnx.Optimizer) and not isinstance(
      optimizer, nnx.Optimizer):
    raise TypeError(
        'train_step: step(model, optimizer, *args) got the optimizer first '
        f'and a {type(optimizer).__name__} second: pass the model first, '
        'then the optimizer.')
  if not isinstance(optimizer, nnx.Optimizer):
    raise TypeError(
        'train_step: step(model, optimizer, *args) takes an nnx.Optimizer '
        f'(or cbp_optax.nnx.Optimizer) second, got a '
        f'{type(optimizer).__name__}.')


def _check_training_mode(model: nnx.Module) -> None:
  evaluating = [path_str(p) for p, m in nnx.iter_modules(model)
                if isinstance(m, Centered) and m.use_running_average]
  if evaluating:
    raise ValueError(
        'train_step: the model is in evaluation mode (centered layers '
        f'{evaluating[:3]} record no batch mean, so the transport would move '
        'mu toward a stale one). Call model.train() before training.')


def _check_has_params(params: nnx.State, optimizer: nnx.Optimizer) -> None:
  if 0 not in params:
    raise ValueError(
        'train_step: the model has no variable the optimizer trains (its '
        f'wrt filter is {optimizer.wrt!r}); there are no gradients to take. '
        'Give the model parameters (nnx.Param), or build the optimizer with '
        'wrt= naming the variables to train.')


def _select(ok: Any, apply_step: Callable[..., None],
            skip_step: Callable[..., None], *operands: Any) -> None:
  """``nnx.cond(ok, apply_step, skip_step, *operands)`` as a leafwise select."""
  nodes = _graph_nodes(operands)
  start = nnx.as_pure(nnx.state(nodes))
  apply_step(*operands)
  applied = nnx.as_pure(nnx.state(nodes))
  ok = _step.decide(ok, applied)
  nnx.update(nodes, start)
  skip_step(*operands)
  skipped = nnx.as_pure(nnx.state(nodes))
  applied_leaves, treedef = jax.tree.flatten(applied)
  skipped_leaves, skipped_def = jax.tree.flatten(skipped)
  if treedef != skipped_def and len(applied_leaves) == len(skipped_leaves):
    # An update that made a state list a graph node (optax.sm3): same leaves.
    skipped = jax.tree.unflatten(treedef, skipped_leaves)
  nnx.update(nodes, _step.select_leaves(ok, applied, skipped))


def _flat_arguments(args: Sequence[Any], donate: bool,
                    classified: _opt_state.CheckCache) -> tuple[Any, Any]:
  """``(variables, (graphdef, values, extra))`` of a step's arguments."""
  if len(args) < 2:
    raise TypeError(
        'train_step: step(model, optimizer, *args) takes the model and the '
        f'optimizer first, got {len(args)} argument(s).')
  model, optimizer, *args = args
  _check_step_arguments(model, optimizer)
  def classify():
    _opt_state.check_fusable(optimizer.opt_state, 'train_step')
    check_optimizer_state(model, optimizer, 'train_step')
    check_recorded_bounds(optimizer.tx, nnx.as_pure(optimizer.opt_state),
                          nnx.as_pure(nnx.state(model, optimizer.wrt)))

  classified.check(optimizer, (weakref.ref(model), optimizer.tx), classify)
  nodes = _graph_nodes(args)
  graphdef, flat = nnx.flatten((model, optimizer, nodes))
  variables = flat.leaves
  # Plain array attributes (a Conv's mask) are undonated constants.
  values = [variable.get_raw_value() if isinstance(variable, nnx.Variable)
            else None for variable in variables]
  constants = {i: leaf for i, leaf in enumerate(variables)
               if not isinstance(leaf, nnx.Variable)}
  if donate:
    values = _step.unaliased(values)
    if constants:
      donated = {id(x) for x in jax.tree.leaves(values)}
      constants = {i: jnp.copy(x) if id(x) in donated else x
                   for i, x in constants.items()}
  return variables, (graphdef, values, (constants, _slots(args, nodes)))


def _on_flat_values(step: Callable[..., StepOutput], graphdef: Any,
                    values: list[Any], extra: Any) -> tuple[Any, Any]:
  """``step`` on :func:`_flat_arguments`' values: new values and output."""
  constants, slotted_args = extra
  values = list(values)
  for i, constant in constants.items():
    values[i] = constant
  model, optimizer, nodes = nnx.unflatten(graphdef, values)
  out = step(model, optimizer, *_fill_slots(slotted_args, nodes))
  new_graphdef, new_values = nnx.flatten((model, optimizer, nodes),
                                              with_paths=False)
  if constants and new_graphdef == graphdef:
    new_values = [None if i in constants else value
                  for i, value in enumerate(new_values)]
  if new_graphdef != graphdef:
    # The forward pass changed the graph (a lazy cache): the whole state.
    return nnx.state((model, optimizer, nodes)), out
  return new_values, out


def _write_back(args: Sequence[Any], variables: Sequence[Any],
                new_values: Any) -> None:
  """Stores a step's new values (or an ``nnx.State``) in the graph of ``args``."""
  if isinstance(new_values, nnx.State):
    model, optimizer, *rest = args
    nnx.update((model, optimizer, _graph_nodes(rest)), new_values)
    return
  for variable, value in zip(variables, new_values, strict=True):
    if isinstance(variable, nnx.Variable):
      variable.set_raw_value(value)


class _CompiledStep:
  """A compiled fused step, called as the step is."""

  def __init__(self, compiled: Any, split_arguments: Callable[..., Any]):
    self._compiled = compiled
    self._split_arguments = split_arguments

  def __call__(self, *args: Any) -> StepOutput:
    variables, (_, values, slotted) = self._split_arguments(args)
    new_values, out = self._compiled(values, slotted)
    _write_back(args, variables, new_values)
    return out

  def as_text(self, *args: Any, **kwargs: Any) -> str:
    return self._compiled.as_text(*args, **kwargs)


class _LoweredStep:
  """``step.lower(model, optimizer, *args)``: the program a call runs."""

  def __init__(self, lowered: Any, split_arguments: Callable[..., Any]):
    self._lowered = lowered
    self._split_arguments = split_arguments

  def as_text(self, *args: Any, **kwargs: Any) -> str:
    return self._lowered.as_text(*args, **kwargs)

  def compile(self, compiler_options: Optional[dict[str, Any]] = None
              ) -> _CompiledStep:
    """Compiles with the step's own options, or ``compiler_options``."""
    compiled = (self._lowered.compile() if compiler_options is None
                else self._lowered.compile(compiler_options))
    return _CompiledStep(compiled, self._split_arguments)


def train_step(
    loss_fn: Callable[..., Any], *, mean_decay: Any = 0.99,
    donate: bool = True,
) -> Callable[..., StepOutput]:
  """One jit-compiled CBP iteration for an NNX model (Algorithm 1, steps 1-11).

  ``step(model, optimizer, *args)`` runs ``loss_fn(model, *args)``, the backward
  pass, ``optimizer.update`` (any optax transform: ``cbp.cbp``, ``optax.adam``
  for "Adam + Center", ...) and :func:`transport` of the model and the
  optimizer's parameter copies, as one donated program (also callable inside
  your own ``@nnx.jit``, bit for bit). ``args`` may hold arrays or graph nodes
  (``nnx.Rngs``). A non-finite loss, gradient or statistic skips the step:
  nothing changes, ``StepOutput.skipped`` is True and an :class:`Optimizer`
  counts it. ``step.lower(model, optimizer, *args)`` lowers a call's program.

  Args:
    loss_fn: ``loss_fn(model, *args)`` returning a scalar loss or ``(loss,
      aux)``; the model must be in training mode (``model.train()``).
    mean_decay: the EMA decay ``rho`` of the centering means, in ``[0, 1)``.
    donate: donate the model and optimizer buffers to the step.

  Returns:
    ``step(model, optimizer, *args) -> StepOutput``, updating in place.

  Raises:
    ValueError: a ``mean_decay`` outside ``[0, 1)`` (at construction); a
      model whose centered layers are in evaluation mode (at the call).
    TypeError: ``step(optimizer, model, ...)``, a second argument that is
      not an ``nnx.Optimizer``, or an unclassifiable optimizer state
      (:class:`cbp_optax.centering.UnclassifiedStateError`, before tracing).

  Examples:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import cbp_optax as cbp
    >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.relu,
    ...                        nnx.Linear(4, 1, rngs=nnx.Rngs(1)))
    >>> _ = cbp.nnx.center(model)
    >>> optimizer = cbp.nnx.Optimizer(model, cbp.cbp(1e-3))
    >>> def loss_fn(model, x, y):
    ...   return jnp.mean((model(x) - y) ** 2)
    >>> step = cbp.nnx.train_step(loss_fn, mean_decay=0.99)
    >>> x, y = jnp.ones((8, 3)), jnp.zeros((8, 1))
    >>> out = step(model, optimizer, x, y)
    >>> out.loss.shape, out.loss.dtype, bool(out.skipped)
    ((), dtype('float32'), False)
    >>> int(optimizer.step[...])
    1
    >>> print(model.layers[0].mean[...])  # 0.99 * 0 + 0.01 * mean(x)
    [0.01 0.01 0.01]

  References:
    Layerwise Conditioned Backpropagation, Algorithm 1.
  """
  _checks.check_mean_decay(mean_decay)
  _checks.check_function('loss_fn', loss_fn)
  _checks.check_bool('donate', donate)

  def step(model, optimizer, *args):
    _check_training_mode(model)
    nodes = _graph_nodes(args)
    # Split with the graph-node arguments, so shared references stay shared.
    graphdef, params, rest = nnx.split((model, nodes), optimizer.wrt, ...)
    _check_has_params(params, optimizer)
    node_params = {k: v for k, v in params.items() if k != 0}
    rest = nnx.as_pure(rest)

    def loss_of(model_params):
      # Pure in the parameters; merged Variables take the forward's writes.
      inner_model, inner_nodes = nnx.merge(
          graphdef, nnx.State({0: model_params, **node_params}), rest)
      swap = dict(zip(map(id, nodes), inner_nodes))
      inner_args = jax.tree.map(lambda x: swap.get(id(x), x), args,
                                is_leaf=_is_node)
      loss, aux = _step.split_loss(loss_fn(inner_model, *inner_args))
      _step.check_scalar_loss(loss)
      # Not the recorded counts, which the transport zeroes.
      changed = nnx.state((inner_model, inner_nodes), nnx.All(
          nnx.Not(optimizer.wrt), nnx.Not(RecordedCount)))
      return loss, (aux, changed)

    def apply_step(model, optimizer, nodes, grads, changed):
      changed, loss = changed
      nnx.update((model, nodes), changed)
      _step.update_with_loss(functools.partial(optimizer.update, model, grads),
                             optimizer.tx, loss)

    def skip_step(model, optimizer, nodes, grads, changed):
      del model, nodes, grads, changed
      if isinstance(optimizer, Optimizer):
        optimizer.skipped_steps[...] += 1

    _, out = _step.conditioned_update(
        loss_of, params[0], apply_step, skip_step, _select,
        model, optimizer, nodes,
        grads_finite=_step.gradients_finite(
            nnx.as_pure(optimizer.opt_state),
            lambda _: nnx.as_pure(optimizer.opt_state)))
    if centered_layers(model):
      # After the skip select, where the update writes the kernels.
      _select(jnp.logical_not(out.skipped),
              lambda model, optimizer: transport_model(
                  model, mean_decay, optimizer, None, recorded_only=False),
              lambda model, optimizer: None, model, optimizer)
    return out

  def pure_step(graphdef, values, extra):
    return _on_flat_values(step, graphdef, values, extra)

  jitted = _step.jit_step(pure_step, static_argnums=(0,),
                          donate_argnums=(1,) if donate else ())

  classified = _opt_state.CheckCache()

  def split_arguments(args):
    return _flat_arguments(args, donate, classified)

  def train(*args):
    variables, jitted_args = split_arguments(args)
    try:
      new_values, out = jitted(*jitted_args)
    except (TypeError, ValueError) as error:
      model, optimizer = args[:2]
      hint = core.centered_after_init(nnx.state(model, optimizer.wrt),
                                      nnx.state(optimizer),
                                      **_LATE_CENTERING)
      if hint:
        raise ValueError(f'train_step: {hint}') from error
      raise
    _write_back(args, variables, new_values)
    return out

  def lower(*args):
    graphdef, values, slotted = split_arguments(args)[1]
    return _LoweredStep(jitted.lower(graphdef, values, slotted),
                        split_arguments)

  train.lower = lower
  return train
