"""Argument checks, declared once per factory in a :class:`Spec`.

Concrete values are judged by value, tracers and arrays (from
``optax.inject_hyperparams``) by shape and dtype; messages read ``"<spec
name>: <argument> must ..., got ..."``. The checks of an update's trees end it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np


def concrete_float(value: Any) -> Optional[float]:
  """Returns ``value`` as a Python float, or None when it is not concrete."""
  if callable(value) or isinstance(value, (jax.core.Tracer, bool, np.bool_)):
    return None
  try:
    array = np.asarray(value)
  except Exception:  # pylint: disable=broad-except
    return None
  return (float(array) if array.shape == () and (
      np.issubdtype(array.dtype, np.integer)
      or np.issubdtype(array.dtype, np.floating)) else None)


def short_repr(value: Any, limit: int = 80) -> str:
  text = repr(value)
  return text if len(text) <= limit else text[:limit - 3] + '...'


def is_array(value: Any) -> bool:
  """A JAX or NumPy array, or a tracer of one."""
  return isinstance(value, (jax.Array, np.ndarray, jax.core.Tracer))


def describe(value: Any) -> str:
  """``the str 'x'``: a value with its type, for a message."""
  return f'the {type(value).__name__} {short_repr(value)}'


@dataclasses.dataclass(frozen=True)
class Spec:
  """One factory's arguments, as its checks need them."""
  name: str  # the factory's public name in messages, or ''
  constraints: Mapping[str, Any]  # argument -> Constraint, in checking order
  leading: tuple[str, ...] = ()  # the positional arguments of an example call
  relations: tuple[Relation, ...] = ()  # conditions across arguments, last

  def example(self, *arguments: str) -> str:
    """The argument list of an example call: ``learning_rate, b1=..., ...``."""
    return ', '.join(self.leading + arguments + ('...',))

  def error(self, kind: type, message: str) -> Exception:
    return kind(f'{self.name}: {message}' if self.name else message)


def static_args_call(spec: Optional[Spec], names: Any) -> str:
  """``optax.inject_hyperparams(<factory>, static_args=names)(...)``."""
  names = tuple(names)
  spec = spec or Spec('', {})
  example = spec.example(*(f'{n}=...' for n in names))
  return (f'optax.inject_hyperparams({spec.name or "factory"}, '
          f'static_args={names!r})({example})')


def static_args_remedy(spec: Optional[Spec], names: Any) -> str:
  """The fix for function arguments ``inject_hyperparams`` called."""
  them = 'it' if len(tuple(names)) == 1 else 'them'
  return (f'optax.inject_hyperparams called {them} with the step count: name '
          f'{them} in its static_args, {static_args_call(spec, names)}.')


class Constraint:
  """What one argument accepts; :meth:`judge` raises where it is not that."""

  def judge(self, spec: Spec, name: str, value: Any) -> None:
    raise NotImplementedError

  def arrived_as_value(self, value: Any) -> bool:
    """Whether ``inject_hyperparams`` passed this function's value at a step."""
    del value
    return False

  def refuse(self, spec: Spec, name: str, value: Any, kind: type,
             message: str) -> None:
    if self.arrived_as_value(value):
      message += ' ' + static_args_remedy(spec, (name,))
    raise spec.error(kind, message)


@dataclasses.dataclass(frozen=True)
class Interval(Constraint):
  """A real number (or a tracer of one) between ``low`` and ``high``."""
  low: float = -math.inf
  high: float = math.inf
  closed: str = 'left'  # the ends that belong: left, right, both, neither
  schedule: bool = False  # a callable is accepted
  optional: bool = False  # None is accepted
  no_schedule: str = ''  # the fix for a schedule inject_hyperparams can't fix

  def judge(self, spec: Spec, name: str, value: Any) -> None:
    if value is None and self.optional:
      return
    if callable(value) and not isinstance(value, (jax.Array, np.ndarray)):
      if self.schedule:
        return
      raise spec.error(TypeError, f'{name} must be a number, got the callable '
                       f'{short_repr(value)}. '
                       + (self.no_schedule or _schedule_remedy(spec, name)))
    if isinstance(value, (bool, np.bool_)):
      raise spec.error(TypeError,
                       f'{name} must be a number, got the bool {value!r}.')
    if isinstance(value, numbers.Real):
      number = float(value)
    elif isinstance(value, (jax.Array, np.ndarray, np.generic)):
      if not (jnp.issubdtype(value.dtype, jnp.floating)
              or jnp.issubdtype(value.dtype, jnp.integer)):
        raise spec.error(TypeError, f'{name} must be a real number, got an '
                         f'array of dtype {value.dtype}.')
      if np.shape(value) != ():
        raise spec.error(ValueError, f'{name} must be a scalar, got an array '
                         f'of shape {np.shape(value)}.')
      number = concrete_float(value)
    else:
      raise spec.error(TypeError, f'{name} must be a real number, got '
                       f'{type(value).__name__} {short_repr(value)}.')
    left, right = (self.closed in (end, 'both') for end in ('left', 'right'))
    low, high = float(self.low), float(self.high)
    if number is not None and not ((number >= low if left else number > low)
            and (number <= high if right else number < high)):
      interval = f'{"[" if left else "("}{low}, {high}{"]" if right else ")"}'
      raise spec.error(ValueError,
                       f'{name} must lie in {interval}, got {value!r}.')


def _schedule_remedy(spec: Spec, name: str) -> str:
  scheduled = [n for n, c in spec.constraints.items()
               if getattr(c, 'schedule', False)]
  which = (f'Only {" and ".join(scheduled)} '
           f'{"takes" if len(scheduled) == 1 else "take"} a schedule directly'
           if scheduled else f'{spec.name or "It"} takes no schedule directly')
  return (f'{which}; schedule {name} with optax.inject_hyperparams('
          f'{spec.name or "factory"})({spec.example(f"{name}=schedule")}).')


# (0, inf), [0, inf) and an EMA decay's [0, 1).
positive = functools.partial(Interval, 0.0, math.inf, closed='neither')
nonnegative = functools.partial(Interval, 0.0, math.inf)
decay = functools.partial(Interval, 0.0, 1.0)


@dataclasses.dataclass(frozen=True)
class Choice(Constraint):
  """One of the strings ``options``."""
  options: tuple[str, ...]

  def judge(self, spec: Spec, name: str, value: Any) -> None:
    if not (is_str := isinstance(value, str)) or value not in self.options:
      raise spec.error(ValueError if is_str else TypeError,
                       f'{name} must be one of {self.options!r}, got '
                       f'{repr(value) if is_str else describe(value)}.')


@dataclasses.dataclass(frozen=True)
class Function(Constraint):
  """A callable (or None, when ``optional``)."""
  optional: bool = True

  def judge(self, spec: Spec, name: str, value: Any) -> None:
    if callable(value) or (self.optional and value is None):
      return
    self.refuse(spec, name, value, TypeError, f'{name} must be a function'
                f'{" or None" if self.optional else ""}, got '
                f'{describe(value)}.')

  def arrived_as_value(self, value: Any) -> bool:
    return not callable(value) and (
        isinstance(value, (numbers.Number, np.generic)) or is_array(value))


@dataclasses.dataclass(frozen=True)
class Count(Constraint):
  """An int ``>= minimum`` (or None, when ``optional``). ``traced``: an array
  (a count ``inject_hyperparams`` schedules) passes too."""
  minimum: int = 1
  optional: bool = False
  traced: bool = False

  def judge(self, spec: Spec, name: str, value: Any) -> None:
    if (value is None and self.optional) or (self.traced and is_array(value)):
      return
    is_int = (isinstance(value, (numbers.Integral, np.integer))
              and not isinstance(value, (bool, np.bool_)))
    if is_int and value >= self.minimum:
      return
    self.refuse(spec, name, value, ValueError if is_int else TypeError,
                f'{name} must be an int >= {self.minimum}'
                f'{" or None" if self.optional else ""}, got {value!r}.')

  def arrived_as_value(self, value: Any) -> bool:
    return not self.traced and is_array(value)


@dataclasses.dataclass(frozen=True)
class FloatDtype(Constraint):
  """A real floating-point dtype, or None (an array is a callable dtype
  ``inject_hyperparams`` called)."""
  why: str = ''

  def judge(self, spec: Spec, name: str, value: Any) -> None:
    if value is None:
      return
    if is_array(value):
      raise spec.error(TypeError, (
          f'{name} must be a dtype, got the array {short_repr(value)}. Pass a '
          f"string ({name}='float32'), or name it in static_args: "
          f'{static_args_call(spec, (name,))}.'))
    float_dtype(name, value, self.why, spec=spec)

  def arrived_as_value(self, value: Any) -> bool:
    return is_array(value)


# The optimizers' statistics dtype.
STATS_DTYPE = FloatDtype(': the statistics are square roots and ratios of '
                         'squared gradients')


@dataclasses.dataclass(frozen=True)
class Relation:
  """``holds(values)``, else a ValueError: ``message`` with the values."""
  holds: Callable[[Mapping[str, Any]], bool]
  message: str


def ordered(low: str, high: str) -> Relation:
  """``values[low] <= values[high]`` where both are concrete."""
  def holds(values):
    a, b = concrete_float(values[low]), concrete_float(values[high])
    return a is None or b is None or a <= b
  return Relation(holds, f'{high} must be >= {low}, got {high}={{{high}!r}} '
                  f'< {low}={{{low}!r}}.')


def needs(name: str, other: str, why: str) -> Relation:
  """``name`` given (not None) only with ``other`` given."""
  return Relation(
      lambda v: v[name] is None or v[other] is not None,
      f'{why}, but {other} is None. Pass {other}=..., or leave {name} out.')


def check(spec: Spec, **values: Any) -> None:
  """Refuses any of ``values`` its constraint in ``spec`` does not accept.

  Function arguments that ``optax.inject_hyperparams`` replaced by values
  are refused together, with the one call that fixes them all.

  Raises:
    TypeError: a value of the wrong type.
    ValueError: a value out of range, a non-scalar array, an unknown option,
      or a relation that does not hold.
  """
  constraints = [(n, c) for n, c in spec.constraints.items() if n in values]
  injected = {n: values[n] for n, c in constraints
              if c.arrived_as_value(values[n])}
  if len(injected) > 1:
    got = ', '.join(f'{n}={short_repr(v)}' for n, v in injected.items())
    raise spec.error(TypeError, f'got {got} where functions or a dtype were '
                     'expected; ' + static_args_remedy(spec, injected))
  for name, constraint in constraints:
    constraint.judge(spec, name, values[name])
  for relation in spec.relations:
    if not relation.holds(values):
      raise spec.error(ValueError, relation.message.format(**values))


def float_dtype(name: str, value: Any, why: str = '',
                spec: Optional[Spec] = None) -> jnp.dtype:
  """``value`` as a real floating-point dtype, or a ``TypeError``."""
  spec = spec or Spec('', {})
  try:
    dtype = jnp.dtype(value)
  except TypeError as e:
    raise spec.error(TypeError, f'{name} must be a real floating-point dtype,'
                     f' got {short_repr(value)}.') from e
  if not jnp.issubdtype(dtype, jnp.floating):
    raise spec.error(TypeError, f'{name} must be a real floating-point dtype '
                     f'(float32, float64, bfloat16...), got {dtype}{why}.')
  return dtype


# --- one-argument checks, for callers without a Spec ---


def _check_one(constraint: Constraint, name: str, value: Any) -> None:
  check(Spec('', {name: constraint}), **{name: value})


check_positive = functools.partial(_check_one, positive())
check_nonnegative = functools.partial(_check_one, nonnegative())
# M2's mean EMA decay (eq. 8): one number in [0, 1), or a tracer.
check_mean_decay = functools.partial(_check_one, decay(no_schedule=(
    'No optax factory takes mean_decay, so optax.inject_hyperparams cannot '
    'schedule it: pass each step\'s value to the transport, '
    'transport(..., mean_decay=schedule(step)).')), 'mean_decay')


def check_bool(name: str, value: Any) -> None:
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f'{name} must be True or False, got {value!r}.')


def check_function(name: str, value: Any, *, optional: bool = False) -> None:
  _check_one(Function(optional=optional), name, value)


def schedule_call_error(argument: str, function: str, value: Any) -> TypeError:
  """A ``(path, leaf)`` function called with the step count alone."""
  return TypeError(
      f'{function} takes (path, leaf) but was called with one argument, '
      f'{short_repr(value)}, as {argument}; '
      + static_args_remedy(None, (argument,)))


# --- the trees an update receives ---


def check_params_match(name: str, updates: Any, params: Any) -> None:
  """Refuses ``params`` (when given) without the leaves and shapes of
  ``updates``, in leaf order."""
  if params is None:
    return
  paths_and_leaves = jax.tree_util.tree_flatten_with_path(updates)[0]
  got = [tuple(jnp.shape(g)) for _, g in paths_and_leaves]
  expected = [tuple(jnp.shape(p)) for p in jax.tree.leaves(params)]
  if got == expected:
    return
  lines = [f'gradient {jax.tree_util.keystr(path)} has shape {g}, its '
           f'parameter {e}' for (path, _), g, e in
           zip(paths_and_leaves, got, expected) if g != e]
  detail = (f'{len(got)} gradient leaves, {len(expected)} parameters'
            if len(got) != len(expected) else
            '; '.join(lines[:5]) + ('; ...' if len(lines) > 5 else ''))
  raise ValueError(f'{name}: the gradients do not match the parameters '
                   f'passed to update ({detail}).')


def check_float_leaves(name: str, tree: Any) -> None:
  """Refuses non-floating leaves, which a scaled update would truncate."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if not jnp.issubdtype(dtype := jnp.result_type(leaf), jnp.floating):
      raise ValueError(
          f'{name}: parameter {jax.tree_util.keystr(path)} has dtype {dtype};'
          ' CBP updates real floating-point parameters only (keep the others'
          ' out with optax.masked or optax.partition).')


def check_real_gradients(name: str, tree: Any) -> None:
  """Refuses complex gradients: CBP would silently drop the imaginary part."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if jnp.issubdtype(dtype := jnp.result_type(leaf), jnp.complexfloating):
      raise TypeError(
          f'{name}: gradient {jax.tree_util.keystr(path)} is complex '
          f'({dtype}); CBP optimizes real parameters and would drop the '
          'imaginary part.')


def output_dtype(grad: Any, param: Any = None) -> jnp.dtype:
  """The dtype of an update: the gradient's; for a non-float gradient, the
  parameter's (when given) or float32 promoted with the gradient's."""
  dtype = jnp.result_type(grad)
  if jnp.issubdtype(dtype, jnp.floating):
    return dtype
  if param is not None and jnp.issubdtype(
      param_dtype := jnp.result_type(param), jnp.floating):
    return param_dtype
  return jnp.promote_types(dtype, jnp.float32)
