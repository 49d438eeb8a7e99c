"""The optimizer arms: one schedule and one weight-decay policy for all.

Every arm that takes a schedule gets the same one: linear warm-up over the
first ``WARMUP_FRACTION`` of the budget to the peak learning rate, cosine
decay to ``FINAL_FRACTION`` of it (``optax.warmup_cosine_decay_schedule``).
Every arm that takes a decoupled weight decay gets ``WEIGHT_DECAY`` on the
kernels only (not biases, norms, embeddings or centering means), multiplied
by the scheduled rate as in ``optax.adamw``. Schedule-free AdamW replaces the
cosine by its own averaging and keeps the warm-up.

SGD with Nesterov momentum searches the workload's grid times
``SGD_GRID_SCALE`` (its rates are larger than Adam's by about that factor);
every other arm searches the grid as it is.

``BASELINES`` are the arms a workload's target is set from (AlgoPerf's
rule: the best of their tuned medians; ``scoring.target``). Every peer
optimizer also has a ``<peer>_centered`` arm: the same optimizer on the
centered model (M2), transported after each update. A run trains
``default_arms()``, every built-in arm but ``NOT_BY_DEFAULT``, unless told
otherwise.

A user arm (``--arm NAME=module:function``) is a callable taking the
schedule (``optax.Schedule``; a number works too) and returning an optax
``GradientTransformation``; ``--centered NAME`` trains it on the centered
model (M2).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib
import inspect
import io
import pathlib
import types
from typing import Any, Callable, NamedTuple, Optional

import jax
import optax

import cbp_optax as cbp
from cbp_optax_experiments.reproduce import transformer

# The protocol's settings below were set a priori with the suite (commit
# f087e46, before its first run), not chosen by comparing runs; a setting
# that a run chooses is recorded in ``splits.CHOSEN_ON``.
WARMUP_FRACTION = 0.1
FINAL_FRACTION = 0.1
WEIGHT_DECAY = 0.01
# optax.contrib.muon: the scale that makes its update RMS match AdamW's, so
# the shared learning-rate grid means the same for both.
MUON_CONSISTENT_RMS = 0.2
SGD_MOMENTUM = 0.9  # AlgoPerf's Nesterov baseline's; a priori
# Set a priori (not from a run): SGD's usual rates are ~30x Adam's, so its
# grid is the workload's times this (3e-4..1e-2 -> 9e-3..0.3).
SGD_GRID_SCALE = 30.0
REFERENCE = 'adamw'
# AlgoPerf's target-setting baselines, run first on every workload.
BASELINES = ('adamw', 'nadamw', 'sgd_nesterov')
# The peers whose ``<peer>_centered`` arm is built.
PEERS = ('adamw', 'nadamw', 'muon', 'schedule_free_adamw', 'cbp_kron',
         'psgd_kron')


@dataclasses.dataclass(frozen=True)
class Context:
  """What an arm may use besides the learning rate (one per workload)."""
  steps: int
  stacked: Any = None     # cbp's ``stacked=`` for layer-stacked models
  muon_dims: Any = None   # optax.contrib.muon's weight dimension numbers

  @property
  def warmup(self) -> int:
    return max(1, int(WARMUP_FRACTION * self.steps))

  def schedule(self, peak) -> optax.Schedule:
    """Warm-up + cosine to ``peak`` (a number or a traced scalar): the unit
    schedule times ``peak`` (optax's tests the peak's value in Python)."""
    unit = optax.warmup_cosine_decay_schedule(
        0.0, 1.0, self.warmup, self.steps, end_value=FINAL_FRACTION)
    return lambda count: peak * unit(count)


decay_mask = transformer.decay_mask


@dataclasses.dataclass(frozen=True)
class Arm:
  """An optimizer: ``make(peak_lr, context) -> GradientTransformation``.

  Attributes:
    name: identifier used by ``--arms`` and in the results.
    make: builds the transform; ``peak_lr`` may be a tracer (the grid is
      one compiled program per arm).
    centered: train the centered model (M2) and transport after each update.
    center_batch_norm_models: with ``centered``, center also the models that
      have BatchNorm layers (``Workload.batch_norm``); False trains their
      plain model (``cbp_robust``'s recipe: see :meth:`centers`).
    eval_params: ``eval_params(opt_state, params)``: the parameters the
      metric is computed at (schedule-free's averaged iterate); None: params.
    description: one line for the report.
    grid_scale: the arm searches the workload's grid times this.
    fingerprint: a hash of a user arm's code (``code_fingerprint``), part of
      its stored runs' identity so that an edited function is run again;
      empty for the built-in arms (the suite's own code is hashed by
      ``protocol.code_fingerprint``).
  """
  name: str
  make: Callable[[Any, Context], optax.GradientTransformation]
  centered: bool = False
  center_batch_norm_models: bool = True
  eval_params: Optional[Callable[[Any, Any], Any]] = None
  description: str = ''
  grid_scale: float = 1.0
  fingerprint: str = ''

  def grid(self, workload: Any) -> list[float]:
    """The learning rates this arm tries first on ``workload``."""
    return [lr * self.grid_scale for lr in workload.grid]

  def centers(self, workload: Any) -> bool:
    """Whether this arm trains ``workload``'s centered model.

    ``cbp_robust`` leaves a model with BatchNorm plain: BatchNorm already
    removes the mean that M2 removes (the paper's §7 reads M2 as the
    mean-removal half of normalization), and centering the tutorial CNN's
    Linear layer after its last BatchNorm cost 3.6 points of running-average
    accuracy that recalibrating the statistics gave back (AdamW, 3 seeds; 0.7
    plain; docs/using-cbp-on-your-model.md).
    """
    return self.centered and (self.center_batch_norm_models
                              or not workload.batch_norm)


def _adamw(lr, ctx):
  return optax.adamw(ctx.schedule(lr), weight_decay=WEIGHT_DECAY,
                     mask=decay_mask)


def _nadamw(lr, ctx):
  return optax.nadamw(ctx.schedule(lr), weight_decay=WEIGHT_DECAY,
                      mask=decay_mask)


def _muon(lr, ctx):
  return optax.contrib.muon(
      ctx.schedule(lr), weight_decay=WEIGHT_DECAY,
      weight_decay_mask=decay_mask, adam_weight_decay=0.0,
      muon_weight_dimension_numbers=ctx.muon_dims,
      consistent_rms=MUON_CONSISTENT_RMS)


def _schedule_free_adamw(lr, ctx):
  """``optax.contrib.schedule_free_adamw`` with the kernel-only decay mask:
  the same chain that function builds (it takes no mask), warm-up included."""
  rate = optax.warmup_constant_schedule(0.0, lr, ctx.warmup)
  base = optax.chain(
      optax.scale_by_rms(decay=0.999, eps=1e-8, eps_in_sqrt=False,
                         bias_correction=True),
      optax.add_decayed_weights(WEIGHT_DECAY, decay_mask),
      optax.scale_by_learning_rate(rate))
  return optax.contrib.schedule_free(base, learning_rate=rate, b1=0.9)


def _sgd_nesterov(lr, ctx):
  """SGD with Nesterov momentum 0.9 and the shared decoupled decay (times
  the scheduled rate, kernels only)."""
  return optax.chain(
      optax.trace(decay=SGD_MOMENTUM, nesterov=True),
      optax.add_decayed_weights(WEIGHT_DECAY, decay_mask),
      optax.scale_by_learning_rate(ctx.schedule(lr)))


def _cbp(lr, ctx):
  return cbp.cbp(ctx.schedule(lr), weight_decay=WEIGHT_DECAY,
                 mask=decay_mask, stacked=ctx.stacked)


def _with_supported(factory, lr, ctx):
  """``factory(schedule, **policy)`` with the policy arguments it accepts."""
  accepted = inspect.signature(factory).parameters
  policy = dict(weight_decay=WEIGHT_DECAY, mask=decay_mask,
                stacked=ctx.stacked)
  return factory(ctx.schedule(lr),
                 **{k: v for k, v in policy.items() if k in accepted})


def _cbp_kron(lr, ctx):
  """``cbp.cbp_kron``: cbp_robust with the Kronecker-factored M3 (§8.2), the
  matrices viewed as Muon views them (``ctx.muon_dims``), the kernel-only
  decay."""
  return cbp.cbp_kron(ctx.schedule(lr), weight_decay=WEIGHT_DECAY,
                      mask=decay_mask, stacked=ctx.stacked,
                      dimension_numbers=ctx.muon_dims)


class PSGDKronState(NamedTuple):
  """psgd_jax's PSGD Kron state (its momentum and its triangular
  preconditioners, gradient statistics only), in a type the transport can
  be told about (``cbp.centering.register_parameter_state``). ``leaves``:
  its leaves under zero-padded string keys. nnx.Optimizer turns a state's
  lists into nnx.State mappings after an update (not at init): psgd-jax
  iterated them as lists, and a scanned loop's carry changed structure."""
  leaves: Any


def _psgd_kron(lr, ctx):
  """PSGD Kron (Li; psgd-jax's ``scale_by_kron``, momentum 0.9, its
  preconditioner-update schedule), the kernel-only decay, the schedule."""
  from psgd_jax import kron as psgd  # pylint: disable=g-import-not-at-top
  inner = psgd.scale_by_kron(b1=0.9)

  def own_init(params):
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its sizes
      return inner.init(params)

  def flat(state):
    return PSGDKronState({f'{i:06d}': leaf for i, leaf
                          in enumerate(jax.tree.leaves(state))})

  def update(updates, state, params=None, **extra):
    structure = jax.tree.structure(jax.eval_shape(own_init, updates))
    own = jax.tree.unflatten(structure, jax.tree.leaves(state.leaves))
    updates, new = inner.update(updates, own, params, **extra)
    return updates, flat(new)

  init = lambda params: flat(own_init(params))
  return optax.chain(
      optax.GradientTransformationExtraArgs(init, update),
      optax.add_decayed_weights(WEIGHT_DECAY, decay_mask),
      optax.scale_by_learning_rate(ctx.schedule(lr)))


def _peer_arms() -> list[Arm]:
  return [
      Arm('adamw', _adamw, description='optax.adamw'),
      Arm('nadamw', _nadamw, description='optax.nadamw'),
      Arm('muon', _muon, description='optax.contrib.muon (AdamW on '
          f'non-matrix leaves), consistent_rms={MUON_CONSISTENT_RMS:g}'),
      Arm('schedule_free_adamw', _schedule_free_adamw,
          eval_params=optax.contrib.schedule_free_eval_params,
          description='optax.contrib.schedule_free AdamW, scored at its '
          'evaluation parameters'),
      Arm('cbp_kron', _cbp_kron, description='cbp.cbp_kron: cbp_robust with '
          'the Kronecker-factored M3 (§8.2), matrices as Muon views them'),
      Arm('psgd_kron', _psgd_kron, description='PSGD Kron (psgd-jax '
          'scale_by_kron, momentum 0.9)'),
  ]


def _centered(arm: Arm) -> Arm:
  # The task's transport moves the optimizer state's copies of the weights
  # too (schedule-free's z), so no transport changes the function at any of
  # them, the evaluation point included.
  return dataclasses.replace(
      arm, name=f'{arm.name}_centered', centered=True,
      description=f'{arm.description}, on the centered model (M2)')


# PSGD Kron's state holds gradient statistics only: nothing to transport.
cbp.centering.register_parameter_state(PSGDKronState)


def builtin_arms() -> dict[str, Arm]:
  """The built-in arms, in run order (the baselines first): the peers, SGD
  with Nesterov momentum, each peer on the centered model, the CBP arms
  (``cbp_robust`` only where the library has it), then ``CANDIDATES``."""
  peers = _peer_arms()
  arms = [
      *peers,
      Arm('sgd_nesterov', _sgd_nesterov, grid_scale=SGD_GRID_SCALE,
          description=f'SGD with Nesterov momentum {SGD_MOMENTUM:g} and '
          f'decoupled decay, grid x{SGD_GRID_SCALE:g}'),
      *[_centered(arm) for arm in peers],
      Arm('cbp', _cbp, centered=True,
          description='cbp.cbp (Algorithm 1) on the centered model (full '
          'CBP)'),
  ]
  if hasattr(cbp, 'cbp_robust'):
    arms.append(Arm('cbp_robust',
                    lambda lr, ctx: _with_supported(cbp.cbp_robust, lr, ctx),
                    centered=True, center_batch_norm_models=False,
                    description='cbp.cbp_robust on the centered model (the '
                    'plain one where the model has BatchNorm)'))
  arms.extend(CANDIDATES)
  order = {name: i for i, name in enumerate(BASELINES)}
  arms.sort(key=lambda arm: order.get(arm.name, len(order)))
  return {arm.name: arm for arm in arms}


def _recommended(lr, ctx):
  """The library's recipe, ``cbp.recommended``: ``optax.contrib.schedule_free``
  (``b1=0.9``, optax's ``weight_lr_power=2``) around cbp_robust's M3 without
  momentum (``g / (sqrt(v_{t-1}) + 1e-8)``, the zero moment of step 1
  replaced by the current gradient's), each coordinate clipped to [-3, 3],
  the kernel-only decay, and the warm-up then a constant rate, as
  ``_schedule_free_adamw`` builds schedule-free AdamW."""
  return cbp.recommended(lr, warmup_steps=ctx.warmup,
                         weight_decay=WEIGHT_DECAY, mask=decay_mask)


# Arms beyond the peers, each following the recipe's model rule (centered,
# a BatchNorm model plain): Muon (a candidate of the ten-seed dev run, now
# outside the default arms, ``NOT_BY_DEFAULT``) and the library's recipe,
# cbp.recommended, chosen on the dev split only (splits.CHOSEN_ON).
# The M1 variants that moved the equalizing scales after a normalizing
# optimizer (after cbp_robust's M3, after Muon) were dropped: on both
# three-seed dev runs the one after Muon scored below Muon itself, the one
# after M3 more than 0.25 below Muon and on either side of cbp_robust, which
# holds M1 at one.
CANDIDATES: tuple[Arm, ...] = (
    Arm('muon_centered_batchnorm_plain', _muon, centered=True,
        center_batch_norm_models=False,
        description='optax.contrib.muon (consistent_rms=0.2, no decay on '
        'its AdamW leaves) on the centered model (the plain one where the '
        'model has BatchNorm)'),
    Arm('schedule_free_cbp_robust', _recommended, centered=True,
        center_batch_norm_models=False,
        eval_params=optax.contrib.schedule_free_eval_params,
        description='cbp.recommended: optax.contrib.schedule_free (b1 0.9) '
        'around cbp.precondition with cbp_robust\'s damping, zero-moment '
        'rule and clip and no momentum, on the centered model (plain with '
        'BatchNorm), scored at its evaluation parameters'),
)
# The arm that cbp.recommended builds.
RECOMMENDED = 'schedule_free_cbp_robust'
# Built-in arms that a run trains only when ``--arms`` names them (or is
# 'all'). Muon with BatchNorm models plain builds the same program as
# muon_centered on a model without BatchNorm and as muon on one with it, so
# each of its runs repeats one of theirs (splits.CHOSEN_ON).
NOT_BY_DEFAULT = ('muon_centered_batchnorm_plain',)


def default_arms() -> dict[str, Arm]:
  """The arms of a run without ``--arms``: ``builtin_arms()`` but
  ``NOT_BY_DEFAULT``, in run order."""
  return {name: arm for name, arm in builtin_arms().items()
          if name not in NOT_BY_DEFAULT}


def _code_bytes(code: types.CodeType) -> bytes:
  """A code object's bytecode, names and constants, nested code (inner
  functions, lambdas, comprehensions) included."""
  parts = [code.co_code, repr(code.co_names).encode(),
           repr(code.co_varnames).encode()]
  for const in code.co_consts:
    parts.append(_code_bytes(const) if isinstance(const, types.CodeType)
                 else repr(const).encode())
  return b'\0'.join(parts)


def code_fingerprint(factory: Callable[..., Any]) -> str:
  """A hash of the code behind a user arm's ``factory``: its bytecode (nested
  functions and constants included), its defaults, and the source of the
  module that defines it (the helpers it calls there). Editing the function
  or its module changes it; code in other modules it imports does not.

  Args:
    factory: the user's ``function(schedule)`` (a ``functools.partial`` of
      one included).

  Returns:
    16 hex digits.
  """
  digest = hashlib.sha256()
  target = factory
  while isinstance(target, functools.partial):
    digest.update(repr((target.args, sorted(target.keywords.items()))
                       ).encode())
    target = target.func
  code = getattr(target, '__code__', None)
  if code is None:  # a callable object: the code of its __call__
    code = getattr(getattr(target, '__call__', None), '__code__', None)
  if code is not None:
    digest.update(_code_bytes(code))
  digest.update(repr(getattr(target, '__defaults__', None)).encode())
  digest.update(repr(getattr(target, '__kwdefaults__', None)).encode())
  module = inspect.getmodule(target)
  source = getattr(module, '__file__', None)
  if source and pathlib.Path(source).is_file():
    digest.update(pathlib.Path(source).read_bytes())
  return digest.hexdigest()[:16]


def load_spec(flag: str, spec: str) -> tuple[str, str, Callable[..., Any]]:
  """``NAME=module:function`` -> ``(NAME, 'module:function', function)``.

  Raises:
    ValueError: a malformed spec, or a module / function that is not found
      or not callable; the message starts with ``flag`` and the spec.
  """
  name, sep, target = spec.partition('=')
  module_name, colon, function_name = target.partition(':')
  if not sep or not colon or not name or not module_name or not function_name:
    raise ValueError(f'{flag} expects NAME=module:function, got {spec!r}')
  try:
    factory = getattr(importlib.import_module(module_name), function_name)
  except (ImportError, AttributeError) as e:
    raise ValueError(f'{flag} {spec!r}: cannot load {target!r} ({e})') from e
  if not callable(factory):
    raise ValueError(f'{flag} {spec!r}: {target!r} is not callable')
  return name, target, factory


def user_arm(spec: str, centered: bool = False) -> Arm:
  """``NAME=module:function`` -> an arm calling ``function(schedule)``.

  The arm's ``fingerprint`` is ``code_fingerprint(function)``: a run into an
  ``--out`` whose stored runs were made by another version of the function
  trains it again.

  Raises:
    ValueError: a malformed spec, or a module / function that is not found.
  """
  name, target, factory = load_spec('--arm', spec)
  return Arm(name, lambda lr, ctx: factory(ctx.schedule(lr)),
             centered=centered,
             description=f'user arm {target}'
             + (' on the centered model' if centered else ''),
             fingerprint=code_fingerprint(factory))
