"""M2 under other optimizers: the transport moves every copy of the parameters.

An optimizer whose state holds a copy of the parameters (schedule-free's
``z``, SAM's cache, the initial points of DoG, Prodigy, MADGRAD, Mechanic,
COCOB, a user's EMA) represents a function with it. Each check runs in
float64: train two updates, record means on an input far from centered,
transport with ``mean_decay=0`` and the optimizer, and compare the function
at every copy (and schedule-free's evaluation point) before and after.
Gradient statistics must come out bit for bit unchanged.
"""

import functools
from typing import NamedTuple

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import cbp_optax as cbp
from cbp_optax import centering as core

F64_TOLERANCE = 1e-12
F64 = jnp.float64


def inputs(shape, seed, offset=2.0, dtype=F64):
  """Normal inputs far from centered (float64 unless asked: call it inside
  ``jax.enable_x64`` for float64)."""
  return jnp.asarray(
      np.random.default_rng(seed).standard_normal(shape) + offset, dtype)


def max_relative(a, b):
  return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def random_like(tree, seed):
  leaves, treedef = jax.tree.flatten(tree)
  rng = np.random.default_rng(seed)
  return jax.tree.unflatten(treedef, [
      jnp.asarray(rng.standard_normal(np.shape(x)), F64) for x in leaves])


class ParamEmaState(NamedTuple):
  count: jax.Array
  ema: optax.Params


core.register_parameter_state(ParamEmaState, 'ema')


def param_ema(decay):
  """An EMA of the parameters, as a user's own transform keeps it."""

  def init(params):
    return ParamEmaState(jnp.zeros([], jnp.int32),
                         jax.tree.map(jnp.copy, params))

  def update(updates, state, params):
    new = optax.apply_updates(params, updates)
    ema = jax.tree.map(lambda e, p: decay * e + (1 - decay) * p, state.ema,
                       new)
    return updates, ParamEmaState(state.count + 1, ema)

  return optax.GradientTransformation(init, update)


# (name, optimizer, the state fields holding parameter copies)
COVERED = [
    ('schedule_free_sgd', lambda: optax.contrib.schedule_free_sgd(0.1, b1=0.8),
     ('z',)),
    ('schedule_free_adamw',
     lambda: optax.contrib.schedule_free_adamw(0.05, b1=0.8), ('z',)),
    ('schedule_free_cbp',
     lambda: optax.contrib.schedule_free(cbp.cbp(0.05), 0.05, b1=0.8),
     ('z',)),
    ('schedule_free_nested', lambda: optax.chain(
        optax.clip_by_global_norm(10.0),
        optax.inject_hyperparams(optax.contrib.schedule_free_adamw)(
            learning_rate=0.05, b1=0.8)), ('z',)),
    ('sam', lambda: optax.contrib.sam(optax.sgd(0.1), optax.sgd(0.05),
                                      sync_period=2), ('cache',)),
    ('dog', lambda: optax.contrib.dog(0.5), ('init_params',)),
    ('dowg', lambda: optax.contrib.dowg(0.5), ('init_params',)),
    ('distance_over_gradients', lambda: optax.chain(
        optax.scale_by_distance_over_gradients(param_dtype=F64),
        optax.scale(-0.5)), ('init_params',)),
    ('prodigy', lambda: optax.contrib.prodigy(0.5), ('params0',)),
    ('madgrad', lambda: optax.contrib.madgrad(0.05), ('x0',)),
    ('mechanic', lambda: optax.contrib.mechanize(optax.adam(0.05)), ('x0',)),
    ('cocob', lambda: optax.contrib.cocob(), ('init_particles',)),
    ('user_ema', lambda: optax.chain(optax.adam(0.05), param_ema(0.5)),
     ('ema',)),
]


def every_covered():
  """One chain of every covered transform: its state holds every kind of
  copy at once (each classified where it sits), so one update and one
  transport check them all. The chain is not an optimizer anyone would run:
  what matters is that each copy keeps its function."""
  return optax.chain(*[make() for _, make, _ in COVERED])


COPY_FIELDS = sorted({f for _, _, fields in COVERED for f in fields})


def copies_of(opt_state, fields=COPY_FIELDS):
  """Every parameter copy in the state, by field name (optax's own lookup)."""
  found = {}
  for field in fields:
    for path, copy in optax.tree.get_all_with_path(opt_state, field):
      if copy is not None:
        found[f'{jax.tree_util.keystr(path)}.{field}'] = copy
  return found


def test_the_chain_holds_a_copy_of_every_covered_kind():
  params = {'w': jnp.ones((2, 2)), 'b': jnp.ones(2)}
  state = every_covered().init(params)
  kinds = {type(s).__name__ for s in jax.tree.leaves(
      state, is_leaf=lambda x: hasattr(x, '_fields'))
      if hasattr(s, '_fields')}
  for expected in ('ScheduleFreeState', 'SAMState', 'DoGState', 'DoWGState',
                   'ScaleByDistanceOverGradientsState', 'ProdigyState',
                   'MadgradState', 'MechanicState', 'COCOBState',
                   'ParamEmaState'):
    assert expected in kinds, expected
  # schedule-free four times (sgd, adamw, cbp, nested), DoG-like three
  # times, MADGRAD and Mechanic's x0, and one each of the others.
  assert len(copies_of(state)) == 4 + 1 + 3 + 1 + 2 + 1 + 1


def flat(tree):
  return {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def assert_every_copy_keeps_its_function(function, copies, before, after):
  """Each transported copy in ``after`` computes what it did before
  (``before``, to float64 tolerance), while the same copy left unmoved
  (``copies``) would not: the means moved far."""
  assert after.keys() == before.keys() and len(after) == 13
  for key, copy in after.items():
    change = max_relative(function(copy), before[key])
    assert change <= F64_TOLERANCE, (key, change)
    assert max_relative(function(copies[key]), before[key]) > 1e-3, key


def assert_only_copy_biases_moved(before, after, fields):
  """Gradient statistics and kernels bit for bit; only copies' biases move."""
  before, after = flat(before), flat(after)
  assert before.keys() == after.keys()
  moved = [k for k in before if not np.array_equal(before[k], after[k])]
  assert moved
  for key in moved:
    assert "'bias'" in key and any(f'.{f}' in key or f"'{f}'" in key
                                   for f in fields), key


# ----------------------------------------------------------------------------
# NNX: a convolution, a stack of two dense layers (nnx.vmap), a dense head

class NnxNet(nnx.Module):

  def __init__(self, rngs):
    self.conv = nnx.Conv(2, 3, (3, 3), padding='SAME', param_dtype=F64,
                         rngs=rngs)

    @nnx.split_rngs(splits=2)
    @nnx.vmap(in_axes=0, out_axes=0,
              transform_metadata={nnx.PARTITION_NAME: 'layers'})
    def create(rngs):
      return nnx.Linear(3, 3, param_dtype=F64, rngs=rngs)

    self.stack = create(rngs)
    self.head = nnx.Linear(3, 2, param_dtype=F64, rngs=rngs)

  def __call__(self, x):
    h = jnp.tanh(self.conv(x))

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(h, layer):
      return jnp.tanh(layer(h))

    return self.head(body(h, self.stack).mean((1, 2)))


X_SHAPE = (2, 4, 4, 2)


@nnx.jit(static_argnums=2)
def nnx_transport(model, optimizer, mean_decay):
  cbp.nnx.transport(model, mean_decay, optimizer=optimizer)


@nnx.jit
def nnx_record(model, x):
  model(x)


def nnx_trained(make_tx):
  """A centered NNX model and its optimizer after an update and a transport."""
  model = NnxNet(nnx.Rngs(0))
  assert cbp.nnx.center(model).centered == ['conv', 'head', 'stack']
  optimizer = cbp.nnx.Optimizer(model, make_tx())
  nnx_record(model, inputs(X_SHAPE, 1, 1.0))
  nnx.jit(lambda m, o, g: o.update(m, g))(
      model, optimizer, random_like(nnx.state(model, nnx.Param), 1))
  nnx_transport(model, optimizer, 0.5)
  return model, optimizer


@functools.partial(jax.jit, static_argnums=0)
def _apply(graphdef, params, rest, x):
  copy = nnx.merge(graphdef, params, rest)
  copy.eval()
  return copy(x)


def nnx_function(model, params, x):
  """The model's function at a parameter tree ``params`` (arrays)."""
  graphdef, _, rest = nnx.split(model, nnx.Param, ...)
  return _apply(graphdef, params, nnx.as_pure(rest), x)


def perturbed(tree, seed):
  return jax.tree.map(lambda p, r: p + 0.3 * r, tree, random_like(tree, seed))


def test_nnx_transport_keeps_every_copys_function():
  with jax.enable_x64(True):
    model = NnxNet(nnx.Rngs(0))
    cbp.nnx.center(model)
    optimizer = cbp.nnx.Optimizer(model, every_covered())
    # The copies are the initial parameters; the model's move away from
    # them (as an update would), so each copy has a kernel of its own.
    nnx.update(model, perturbed(nnx.state(model, nnx.Param), 1))
    nnx_record(model, inputs(X_SHAPE, 1, 1.0))
    nnx_transport(model, optimizer, 0.5)
    x = inputs(X_SHAPE, 3)
    state_before = jax.tree.map(np.asarray, nnx.as_pure(optimizer.opt_state))
    copies = {k: nnx.as_pure(c) for k, c in
              copies_of(optimizer.opt_state).items()}
    before = {k: nnx_function(model, c, x) for k, c in copies.items()}
    nnx_record(model, inputs(X_SHAPE, 4, 6.0))  # far from the current means
    nnx_transport(model, optimizer, 0.0)
    after = {k: nnx.as_pure(c) for k, c in
             copies_of(optimizer.opt_state).items()}
    assert_every_copy_keeps_its_function(
        lambda c: nnx_function(model, c, x), copies, before, after)
    assert_only_copy_biases_moved(state_before,
                                  nnx.as_pure(optimizer.opt_state),
                                  COPY_FIELDS)


def test_nnx_transport_keeps_schedule_free_eval_point():
  with jax.enable_x64(True):
    model, optimizer = nnx_trained(COVERED[1][1])
    x = inputs(X_SHAPE, 3)
    forward = nnx.jit(lambda m, x: m(x))
    evaluated = forward(cbp.nnx.eval_model(model, optimizer), x)
    model(inputs(X_SHAPE, 4, 6.0))
    moved, moved_optimizer = nnx.clone((model, optimizer))
    cbp.nnx.transport(moved, 0.0, optimizer=moved_optimizer)
    change = max_relative(
        forward(cbp.nnx.eval_model(moved, moved_optimizer), x), evaluated)
    assert change <= F64_TOLERANCE, change
    # The bug: a transport without the optimizer moved only the model, so
    # schedule-free's evaluation point computed another function.
    cbp.nnx.transport(model, 0.0)
    assert max_relative(forward(cbp.nnx.eval_model(model, optimizer), x),
                        evaluated) > 1e-3


@functools.partial(jax.jit, static_argnums=(0, 4))
def _functional_transport(graphdef, params, rest, opt_state, mean_decay):
  model = nnx.merge(graphdef, params, rest)
  opt_state = cbp.nnx.transport(model, mean_decay, opt_state=opt_state)
  _, params, rest = nnx.split(model, nnx.Param, ...)
  return nnx.as_pure(params), nnx.as_pure(rest), opt_state


def test_nnx_functional_transport_moves_the_optax_state_copies():
  # The functional style: nnx.split, an optax state on the pure Param state.
  with jax.enable_x64(True):
    model = NnxNet(nnx.Rngs(0))
    cbp.nnx.center(model)
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    tx = every_covered()
    opt_state = tx.init(params)
    nnx.update(model, perturbed(nnx.state(model, nnx.Param), 1))
    nnx_record(model, inputs(X_SHAPE, 1, 1.0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params, rest, opt_state = _functional_transport(
        graphdef, nnx.as_pure(params), nnx.as_pure(rest), opt_state, 0.5)
    model = nnx.merge(graphdef, params, rest)
    x = inputs(X_SHAPE, 3)
    copies = copies_of(opt_state)
    before = {k: nnx_function(model, c, x) for k, c in copies.items()}
    state_before = jax.tree.map(np.asarray, opt_state)
    nnx_record(model, inputs(X_SHAPE, 4, 6.0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params, rest, opt_state = _functional_transport(
        graphdef, nnx.as_pure(params), nnx.as_pure(rest), opt_state, 0.0)
    model = nnx.merge(graphdef, params, rest)
    after = copies_of(opt_state)
    assert_every_copy_keeps_its_function(
        lambda c: nnx_function(model, c, x), copies, before, after)
    assert_only_copy_biases_moved(state_before, opt_state, COPY_FIELDS)


@pytest.mark.parametrize('name', ['every_covered'] + [
    n for n, _, _ in COVERED if n in ('dog', 'prodigy', 'cocob', 'sam')])
def test_nnx_functional_transport_of_a_state_holding_the_models_variables(
    name):
  # ``tx.init(nnx.state(model, nnx.Param))`` (Variables, not arrays): the
  # copies of DoG, Prodigy, COCOB and SAM are the model's own Variables; each
  # bias must move once (as the model's), not once more as the copy's.
  make = (every_covered if name == 'every_covered'
          else dict((n, m) for n, m, _ in COVERED)[name])
  with jax.enable_x64(True):
    model = NnxNet(nnx.Rngs(0))
    cbp.nnx.center(model)
    opt_state = make().init(nnx.state(model, nnx.Param))
    x = inputs(X_SHAPE, 3)
    function = lambda c: nnx_function(model, c, x)
    nnx_record(model, inputs(X_SHAPE, 1, 1.0))
    opt_state = cbp.nnx.transport(model, 0.5, opt_state=opt_state)
    copies = {k: nnx.as_pure(c) for k, c in copies_of(opt_state).items()}
    before = {k: function(c) for k, c in copies.items()}
    model_before = function(nnx.as_pure(nnx.state(model, nnx.Param)))
    nnx_record(model, inputs(X_SHAPE, 4, 6.0))
    opt_state = cbp.nnx.transport(model, 0.0, opt_state=opt_state)
    change = max_relative(function(nnx.as_pure(nnx.state(model, nnx.Param))),
                          model_before)
    assert change <= F64_TOLERANCE, change
    for key, copy in copies_of(opt_state).items():
      change = max_relative(function(nnx.as_pure(copy)), before[key])
      assert change <= F64_TOLERANCE, (key, change)


class _DenseNormDense(nnx.Module):

  def __init__(self, rngs):
    self.dense1 = nnx.Linear(3, 4, rngs=rngs)
    self.norm = nnx.BatchNorm(4, rngs=rngs)
    self.dense2 = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, x):
    return self.dense2(self.norm(self.dense1(x)))


def test_nnx_functional_transport_keeps_the_state_structure():
  # An uncentered sibling (the BatchNorm) is a nested State in the optax
  # state; rebuilding its parent must not change the pytree structure, or
  # the optimizer's next update fails on a structure mismatch.
  model = _DenseNormDense(nnx.Rngs(0))
  cbp.nnx.center(model)
  tx = optax.contrib.schedule_free_adamw(0.1)
  opt_state = tx.init(nnx.as_pure(nnx.state(model, nnx.Param)))
  nnx_record(model, inputs((5, 3), 1, 1.0, dtype=jnp.float32))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params, rest, moved = _functional_transport(
      graphdef, nnx.as_pure(params), nnx.as_pure(rest), opt_state, 0.0)
  chex.assert_trees_all_equal_structs(moved, opt_state)
  updates, _ = tx.update(jax.tree.map(jnp.ones_like, params), moved, params)
  chex.assert_trees_all_equal_structs(updates, params)


def test_nnx_transport_takes_optimizer_or_opt_state_not_both():
  model = nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
  cbp.nnx.center(model)
  optimizer = cbp.nnx.Optimizer(model, optax.sgd(0.1))
  with pytest.raises(ValueError, match='not both'):
    cbp.nnx.transport(model, optimizer=optimizer,
                      opt_state=optimizer.opt_state)


def test_nnx_functional_transport_refuses_an_unclassified_state():
  model = nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
  cbp.nnx.center(model)
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  bias_before = np.asarray(model.layers[0].layer.bias[...])
  with pytest.raises(cbp.centering.UnclassifiedStateError):
    cbp.nnx.transport(model, 0.0, opt_state=UnregisteredEmaState(params))
  # Refused before anything moved.
  np.testing.assert_array_equal(model.layers[0].layer.bias[...], bias_before)


def test_nnx_copy_of_an_untrained_kernel_moves_by_the_models_kernel():
  # Training the biases only: the copies hold biases, the kernel is the
  # model's own.
  with jax.enable_x64(True):
    model = NnxNet(nnx.Rngs(0))
    cbp.nnx.center(model)
    wrt = nnx.All(nnx.Param, nnx.PathContains('bias'))
    optimizer = cbp.nnx.Optimizer(
        model, optax.contrib.schedule_free_sgd(0.1, b1=0.8), wrt=wrt)
    grads = random_like(nnx.state(model, wrt), 1)
    model(inputs(X_SHAPE, 1, 1.0))
    optimizer.update(model, grads)
    cbp.nnx.transport(model, 0.5, optimizer=optimizer)
    x = inputs(X_SHAPE, 3)
    evaluated = cbp.nnx.eval_model(model, optimizer)(x)
    model(inputs(X_SHAPE, 4, 6.0))
    cbp.nnx.transport(model, 0.0, optimizer=optimizer)
    change = max_relative(cbp.nnx.eval_model(model, optimizer)(x), evaluated)
  assert change <= F64_TOLERANCE, change


# ----------------------------------------------------------------------------
# Linen: the same network, the stack under nn.scan

class Block(nn.Module):
  dtype: jnp.dtype = F64

  @nn.compact
  def __call__(self, h, _):
    return jnp.tanh(nn.Dense(3, param_dtype=self.dtype)(h)), None


class LinenNet(nn.Module):
  dtype: jnp.dtype = F64

  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.Conv(3, (3, 3), padding='SAME', param_dtype=self.dtype)(x))
    stack = nn.scan(Block, length=2, split_rngs={'params': True},
                    variable_axes={'params': 0, 'centering': 0})
    h, _ = stack(self.dtype, name='stack')(h, None)
    return nn.Dense(2, param_dtype=self.dtype)(h.mean((1, 2)))


def linen_trained(make_tx, params_of=lambda p: p):
  model = cbp.linen.center(LinenNet())
  variables = model.init(jax.random.key(0), inputs(X_SHAPE, 0))
  params, centering = variables['params'], variables['centering']
  tx = make_tx()
  params = params_of(params)
  opt_state = tx.init(params)
  fast = params.fast if isinstance(params, optax.LookaheadParams) else params
  _, changed = model.apply({'params': fast, 'centering': centering},
                           inputs(X_SHAPE, 1, 1.0), mutable=['centering'])
  updates, opt_state = tx.update(random_like(fast, 1), opt_state, params)
  params, centering, opt_state = cbp.linen.transport(
      optax.apply_updates(params, updates), changed['centering'], 0.5,
      opt_state=opt_state)
  return model, params, centering, opt_state


def test_linen_transport_keeps_every_copys_function():
  with jax.enable_x64(True):
    model = cbp.linen.center(LinenNet())
    variables = model.init(jax.random.key(0), inputs(X_SHAPE, 0))
    opt_state = every_covered().init(variables['params'])
    params = perturbed(variables['params'], 1)  # copies: the initial ones
    apply = jax.jit(model.apply)
    record = jax.jit(lambda v, x: model.apply(v, x, mutable=['centering'])[1])
    move = jax.jit(lambda p, c, o, d: cbp.linen.transport(p, c, d,
                                                          opt_state=o))
    changed = record({'params': params, 'centering': variables['centering']},
                     inputs(X_SHAPE, 1, 1.0))
    params, centering, opt_state = move(params, changed['centering'],
                                        opt_state, 0.5)
    x = inputs(X_SHAPE, 3)
    f = lambda p, c: apply({'params': p, 'centering': c}, x)
    copies = copies_of(opt_state)
    before = {k: f(c, centering) for k, c in copies.items()}
    changed = record({'params': params, 'centering': centering},
                     inputs(X_SHAPE, 4, 6.0))
    _, new_centering, new_state = move(params, changed['centering'],
                                       opt_state, 0.0)
    after = copies_of(new_state)
    assert_every_copy_keeps_its_function(
        lambda c: f(c, new_centering), copies, before, after)
    assert_only_copy_biases_moved(opt_state, new_state, COPY_FIELDS)


def test_linen_transport_keeps_schedule_free_eval_point():
  with jax.enable_x64(True):
    model, params, centering, opt_state = linen_trained(COVERED[1][1])
    x = inputs(X_SHAPE, 3)
    apply = jax.jit(model.apply)
    f = lambda p, s, c: apply(
        {'params': cbp.linen.eval_params(p, s), 'centering': c}, x)
    evaluated = f(params, opt_state, centering)
    _, changed = model.apply({'params': params, 'centering': centering},
                             inputs(X_SHAPE, 4, 6.0), mutable=['centering'])
    moved = cbp.linen.transport(params, changed['centering'], 0.0,
                                opt_state=opt_state)
    change = max_relative(f(moved[0], moved[2], moved[1]), evaluated)
    assert change <= F64_TOLERANCE, change
    stale = cbp.linen.transport(params, changed['centering'], 0.0)
    assert max_relative(f(stale[0], opt_state, stale[1]), evaluated) > 1e-3


def test_linen_lookahead_moves_fast_and_slow_parameters():
  with jax.enable_x64(True):
    model, params, centering, opt_state = linen_trained(
        lambda: optax.lookahead(optax.sgd(0.1), sync_period=3,
                                slow_step_size=0.5),
        params_of=optax.LookaheadParams.init_synced)
    assert not np.allclose(params.fast['Dense_0']['bias'],
                           params.slow['Dense_0']['bias'])
    x = inputs(X_SHAPE, 3)
    f = lambda p, c: model.apply({'params': p, 'centering': c}, x)
    before = f(params.fast, centering), f(params.slow, centering)
    _, changed = model.apply({'params': params.fast, 'centering': centering},
                             inputs(X_SHAPE, 4, 6.0), mutable=['centering'])
    new_params, new_centering, _ = cbp.linen.transport(
        params, changed['centering'], 0.0, opt_state=opt_state)
    assert isinstance(new_params, optax.LookaheadParams)
    for new, old in zip(new_params, before):
      assert max_relative(f(new, new_centering), old) <= F64_TOLERANCE
    chex.assert_trees_all_equal(cbp.linen.eval_params(new_params),
                                new_params.slow)


# ----------------------------------------------------------------------------
# States the transport cannot classify are refused, before anything traces

class UnregisteredEmaState(NamedTuple):
  ema: optax.Params


def unregistered_ema():
  return optax.GradientTransformation(
      lambda params: UnregisteredEmaState(params),
      lambda updates, state, params=None: (updates, state))


def raw_copy():
  # A transform whose state is a bare copy of the parameters, in no type.
  return optax.GradientTransformation(
      lambda params: jax.tree.map(jnp.copy, params),
      lambda updates, state, params=None: (updates, state))


def small_nnx():
  model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.tanh,
                         nnx.Linear(4, 2, rngs=nnx.Rngs(1)))
  cbp.nnx.center(model)
  return model


@pytest.mark.parametrize('make_tx, expected', [
    (lambda: optax.chain(optax.adam(1e-2), unregistered_ema()),
     "UnregisteredEmaState holds a tree shaped like the parameters in its "
     "field 'ema'"),
    (lambda: optax.chain(optax.adam(1e-2), raw_copy()),
     'directly in a chain or wrapper'),
    (optax.lbfgs, 'ScaleByLBFGSState cannot be transported'),
], ids=['unregistered_type', 'bare_tree', 'lbfgs'])
def test_unclassified_state_is_refused_with_the_remedy(make_tx, expected):
  with pytest.raises(core.UnclassifiedStateError, match=expected) as error:
    cbp.nnx.Optimizer(small_nnx(), make_tx())
  if 'lbfgs' not in expected.lower():
    assert 'register_parameter_state' in str(error.value)
  # A plain nnx.Optimizer is refused at the first step, before tracing.
  model = small_nnx()
  optimizer = nnx.Optimizer(model, make_tx(), wrt=nnx.Param)
  before = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
  step = cbp.nnx.train_step(lambda m, x: jnp.mean(m(x) ** 2))
  with pytest.raises(core.UnclassifiedStateError, match=expected):
    step(model, optimizer, jnp.ones((4, 3)))
  chex.assert_trees_all_equal(
      jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model))), before)
  # Linen: the same, at the fused step's call and in transport.
  net = cbp.linen.center(nn.Dense(2))
  variables = net.init(jax.random.key(0), jnp.ones((4, 3)))
  state = cbp.linen.TrainState.create(
      apply_fn=net.apply, params=variables['params'],
      centering=variables['centering'], tx=make_tx())
  with pytest.raises(core.UnclassifiedStateError, match=expected):
    cbp.linen.train_step(lambda apply, x: jnp.mean(apply(x) ** 2))(
        state, jnp.ones((4, 3)))
  with pytest.raises(core.UnclassifiedStateError, match=expected):
    cbp.linen.transport(state.params, state.centering,
                        opt_state=state.opt_state)


def test_uncentered_model_accepts_any_state():
  model = nnx.Sequential(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
  optimizer = cbp.nnx.Optimizer(model, optax.chain(optax.adam(1e-2),
                                                   raw_copy()))
  out = cbp.nnx.train_step(lambda m, x: jnp.mean(m(x) ** 2))(
      model, optimizer, jnp.ones((4, 3)))
  assert not bool(out.skipped)


def test_registering_a_statistic_state_lets_it_through_untouched():
  class EmaOfSquares(NamedTuple):
    squares: optax.Updates

  core.register_parameter_state(EmaOfSquares)
  tx = optax.chain(optax.sgd(0.1), optax.GradientTransformation(
      lambda params: EmaOfSquares(jax.tree.map(jnp.ones_like, params)),
      lambda updates, state, params=None: (updates, state)))
  model = small_nnx()
  optimizer = cbp.nnx.Optimizer(model, tx)
  before = jax.tree.map(np.asarray, nnx.as_pure(optimizer.opt_state))
  cbp.nnx.train_step(lambda m, x: jnp.mean(m(x) ** 2), mean_decay=0.0)(
      model, optimizer, jnp.ones((4, 3)) + 2.0)
  chex.assert_trees_all_equal(nnx.as_pure(optimizer.opt_state)[1], before[1])


def test_register_parameter_state_checks_its_arguments():
  with pytest.raises(ValueError, match="no field 'emma'"):
    core.register_parameter_state(ParamEmaState, 'emma')
  with pytest.raises(TypeError, match='must be a class'):
    core.register_parameter_state(ParamEmaState(0, {}), 'ema')
  with pytest.raises(TypeError, match='strings'):
    core.register_parameter_state(ParamEmaState, 0)


def test_copy_that_splits_a_layer_between_optimizers_is_refused():
  # Schedule-free for the kernels, Adam for the biases: z holds kernels
  # without their biases, and no bias move keeps such a copy's function.
  def labels(params):
    return jax.tree_util.tree_map_with_path(
        lambda p, _: 'sf' if 'kernel' in jax.tree_util.keystr(p) else 'adam',
        params)

  tx = optax.partition({'sf': optax.contrib.schedule_free_sgd(0.1),
                        'adam': optax.adam(0.1)}, labels)
  with pytest.raises(core.UnclassifiedStateError,
                     match="holds the kernel of the centered layer "
                           "'layers/0' but not its bias"):
    cbp.nnx.Optimizer(small_nnx(), tx)


def test_optimizer_built_for_a_submodule_is_refused_on_the_whole_model():
  # An optimizer (or opt_state) built for model.head, and the transport
  # called on the whole model: no path of z matches, and z was left unmoved.
  tx = lambda: optax.contrib.schedule_free_sgd(0.1)
  expected = "'layer/bias'.*built for another tree"
  model = small_nnx()
  head = model.layers[2]
  optimizer = cbp.nnx.Optimizer(head, tx())
  model(jnp.ones((4, 3)) + 2.0)
  with pytest.raises(core.UnclassifiedStateError, match=expected):
    cbp.nnx.transport(model, 0.0, optimizer=optimizer)
  opt_state = tx().init(nnx.as_pure(nnx.state(head, nnx.Param)))
  with pytest.raises(core.UnclassifiedStateError, match=expected):
    cbp.nnx.transport(model, 0.0, opt_state=opt_state)
  step = cbp.nnx.train_step(lambda m, x: jnp.mean(m(x) ** 2))
  with pytest.raises(core.UnclassifiedStateError, match=expected):
    step(model, optimizer, jnp.ones((4, 3)))
  # Linen: an opt_state built on params['Dense_1'].
  net = cbp.linen.center(LinenNet(jnp.float32))
  variables = net.init(jax.random.key(0), inputs(X_SHAPE, 0,
                                                 dtype=jnp.float32))
  head_state = tx().init(variables['params']['Dense_0'])
  with pytest.raises(core.UnclassifiedStateError,
                     match="'bias'.*built for another tree"):
    cbp.linen.transport(variables['params'], variables['centering'],
                        opt_state=head_state)
  # The optimizer of the whole model, restricted with wrt=, is accepted.
  model = small_nnx()
  cbp.nnx.Optimizer(model, tx(), wrt=nnx.All(nnx.Param,
                                             nnx.PathContains('2')))


# ----------------------------------------------------------------------------
# Schedule-free through the library's own paths

def test_nnx_fused_and_unfused_steps_agree_and_keep_eval_point():
  """The fused step transports z itself; the unfused loop with
  ``transport(..., optimizer=)`` computes the same step."""
  loss = lambda m, x: jnp.mean((m(x) - 1.0) ** 2)
  x = inputs((8, 3), 1, 2.0, jnp.float32)
  tx = lambda: optax.contrib.schedule_free_adamw(0.05, b1=0.8)
  fused_model, unfused_model = small_nnx(), small_nnx()
  fused_opt = cbp.nnx.Optimizer(fused_model, tx())
  unfused_opt = nnx.Optimizer(unfused_model, tx(), wrt=nnx.Param)
  step = cbp.nnx.train_step(loss, mean_decay=0.5)

  @nnx.jit
  def unfused(model, optimizer, x):
    grads = nnx.grad(loss)(model, x)
    optimizer.update(model, grads)
    cbp.nnx.transport(model, 0.5, optimizer=optimizer)

  for _ in range(3):
    step(fused_model, fused_opt, x)
    unfused(unfused_model, unfused_opt, x)
  chex.assert_trees_all_close(nnx.as_pure(fused_opt.opt_state),
                              nnx.as_pure(unfused_opt.opt_state), rtol=1e-6)
  chex.assert_trees_all_close(
      cbp.nnx.eval_model(fused_model, fused_opt)(x),
      cbp.nnx.eval_model(unfused_model, unfused_opt)(x), rtol=1e-6)


def plain_equivalent(model, optimizer):
  """The uncentered network the centered one's evaluation point computes:
  ``b = b~ - W mu`` at schedule-free's ``x``."""
  x_params = optax.contrib.schedule_free_eval_params(
      nnx.as_pure(optimizer.opt_state),
      nnx.as_pure(nnx.state(model, nnx.Param)))
  layers = []
  for i in (0, 2):
    centered = model.layers[i]
    kernel = x_params['layers'][i]['layer']['kernel']
    bias = x_params['layers'][i]['layer']['bias']
    plain = nnx.Linear(*kernel.shape, param_dtype=F64, rngs=nnx.Rngs(0))
    plain.kernel[...] = kernel
    plain.bias[...] = bias - centered.mean[...] @ kernel
    layers.append(plain)
  return nnx.Sequential(layers[0], nnx.tanh, layers[1])


def test_nnx_eval_model_is_the_plain_models_equivalent():
  with jax.enable_x64(True):
    model = nnx.Sequential(
        nnx.Linear(3, 4, param_dtype=F64, rngs=nnx.Rngs(0)), nnx.tanh,
        nnx.Linear(4, 2, param_dtype=F64, rngs=nnx.Rngs(1)))
    cbp.nnx.center(model)
    optimizer = cbp.nnx.Optimizer(
        model, optax.contrib.schedule_free_adamw(0.05, b1=0.8))
    step = cbp.nnx.train_step(lambda m, x: jnp.mean((m(x) - 1.0) ** 2),
                              mean_decay=0.5)
    for seed in range(3):
      step(model, optimizer, inputs((8, 3), seed, 2.0 + seed))
    x = inputs((8, 3), 7)
    batch_means = [model.layers[i].batch_mean[...] for i in (0, 2)]
    evaluated = cbp.nnx.eval_model(model, optimizer)
    assert evaluated.layers[0].use_running_average
    change = max_relative(evaluated(x), plain_equivalent(model, optimizer)(x))
    assert change <= F64_TOLERANCE, change
    # The evaluation point is not the training point, and the model itself
    # is left in training mode, recording nothing from the evaluation.
    model.eval()
    assert max_relative(model(x), evaluated(x)) > 1e-3
    model.train()
    for i, recorded in zip((0, 2), batch_means):
      np.testing.assert_array_equal(model.layers[i].batch_mean[...], recorded)


def test_linen_fused_step_transports_z_like_the_unfused_loop():
  loss = lambda apply, x: jnp.mean((apply(x) - 1.0) ** 2)
  with jax.enable_x64(True):
    model = cbp.linen.center(nn.Sequential([
        nn.Dense(4, param_dtype=F64), jnp.tanh, nn.Dense(2, param_dtype=F64)]))
    variables = model.init(jax.random.key(0), inputs((8, 3), 0))
    tx = optax.contrib.schedule_free_adamw(0.05, b1=0.8)
    state = cbp.linen.TrainState.create(
        apply_fn=model.apply, params=variables['params'],
        centering=variables['centering'], tx=tx)
    step = cbp.linen.train_step(loss, mean_decay=0.5, donate=False)
    params, centering, opt_state = (variables['params'],
                                    variables['centering'], tx.init(
                                        variables['params']))
    for seed in range(2):
      x = inputs((8, 3), seed, 1.0 + seed)
      state, _ = step(state, x)

      def loss_of(p):
        out, changed = model.apply({'params': p, 'centering': centering}, x,
                                   mutable=['centering'])
        return jnp.mean((out - 1.0) ** 2), changed['centering']

      grads, recorded = jax.jit(jax.grad(loss_of, has_aux=True))(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      params, centering, opt_state = cbp.linen.transport(
          optax.apply_updates(params, updates), recorded, 0.5,
          opt_state=opt_state)
    chex.assert_trees_all_close(state.opt_state, opt_state, rtol=1e-12)
    x = inputs((8, 3), 9)
    chex.assert_trees_all_close(
        model.apply({'params': cbp.linen.eval_params(
            state.params, state.opt_state), 'centering': state.centering}, x),
        model.apply({'params': cbp.linen.eval_params(params, opt_state),
                     'centering': centering}, x), rtol=1e-12)


@pytest.mark.parametrize('make_tx', [
    lambda: optax.contrib.sam(optax.sgd(0.1), optax.sgd(0.1)),
    lambda: optax.contrib.dog(0.1),
], ids=['sam', 'dog'])
def test_fused_steps_take_optimizers_that_keep_the_initial_arrays(make_tx):
  """Their ``init`` keeps the parameter arrays themselves: the donating step
  failed with "Attempt to donate the same buffer twice"."""
  x = jnp.ones((4, 3)) + 1.0
  model = small_nnx()
  optimizer = cbp.nnx.Optimizer(model, make_tx())
  out = cbp.nnx.train_step(lambda m, x: jnp.mean(m(x) ** 2))(
      model, optimizer, x)
  assert not bool(out.skipped)
  net = cbp.linen.center(nn.Dense(2))
  variables = net.init(jax.random.key(0), x)
  state = cbp.linen.TrainState.create(
      apply_fn=net.apply, params=variables['params'],
      centering=variables['centering'], tx=make_tx())
  state, out = cbp.linen.train_step(lambda apply, x: jnp.mean(apply(x) ** 2))(
      state, x)
  assert not bool(out.skipped) and int(state.step) == 1


def test_nnx_skipped_step_leaves_z():
  model = small_nnx()
  optimizer = cbp.nnx.Optimizer(model, optax.contrib.schedule_free_sgd(0.1))
  step = cbp.nnx.train_step(lambda m, x, y: jnp.mean((m(x) - y) ** 2))
  step(model, optimizer, jnp.ones((4, 3)) + 1.0, jnp.zeros((4, 2)))
  before = jax.tree.map(np.asarray, nnx.as_pure(optimizer.opt_state))
  out = step(model, optimizer, jnp.ones((4, 3)), jnp.full((4, 2), jnp.nan))
  assert bool(out.skipped) and int(optimizer.skipped_steps[...]) == 1
  chex.assert_trees_all_equal(nnx.as_pure(optimizer.opt_state), before)


def test_nnx_checkpoint_resume_with_schedule_free_is_bit_exact(tmp_path):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  loss = lambda m, x: jnp.mean((m(x) - 1.0) ** 2)
  step = cbp.nnx.train_step(loss, mean_decay=0.5)
  x = [jnp.ones((4, 3)) * (1.0 + i) for i in range(4)]

  def fresh():
    model = small_nnx()
    return model, cbp.nnx.Optimizer(model, optax.contrib.schedule_free_adamw(
        0.05, b1=0.8))

  model, optimizer = fresh()
  for batch in x[:2]:
    step(model, optimizer, batch)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / 'c', nnx.state((model, optimizer)))
  for batch in x[2:]:
    step(model, optimizer, batch)
  graphdef, abstract = nnx.split(nnx.eval_shape(fresh))
  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(tmp_path / 'c', abstract)
  resumed, resumed_opt = nnx.merge(graphdef, restored)
  for batch in x[2:]:
    step(resumed, resumed_opt, batch)
  chex.assert_trees_all_equal(nnx.as_pure(nnx.state((resumed, resumed_opt))),
                              nnx.as_pure(nnx.state((model, optimizer))))
  chex.assert_trees_all_equal(
      cbp.nnx.eval_model(resumed, resumed_opt)(x[0]),
      cbp.nnx.eval_model(model, optimizer)(x[0]))


# ----------------------------------------------------------------------------
# Muon's dimension numbers for centered kernels

class MuonNet(nnx.Module):

  def __init__(self, rngs):
    self.conv = nnx.Conv(2, 3, (3, 3), padding='SAME', rngs=rngs)

    @nnx.split_rngs(splits=2)
    @nnx.vmap(in_axes=0, out_axes=0)
    def create(rngs):
      return nnx.Linear(3, 3, rngs=rngs)

    self.stack = create(rngs)
    self.proj = nnx.LinearGeneral(3, (2, 4), rngs=rngs)
    self.head = nnx.Linear(8, 2, rngs=rngs)
    self.plain = nnx.Linear(2, 2, use_bias=False, rngs=rngs)

  def __call__(self, x):
    h = jnp.tanh(self.conv(x))

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(h, layer):
      return jnp.tanh(layer(h))

    h = self.proj(body(h, self.stack).mean((1, 2)))
    return self.plain(self.head(h.reshape(h.shape[0], -1)))


def muon_matrices(update, dims):
  """The update as the batch of matrices Muon orthogonalized."""
  reduction, output = dims.reduction_axis, dims.output_axis
  batch = [a for a in range(update.ndim) if a not in reduction + output]
  moved = jnp.transpose(update, batch + list(reduction) + list(output))
  rows = int(np.prod([update.shape[a] for a in reduction]))
  cols = int(np.prod([update.shape[a] for a in output]))
  return moved.reshape(-1, rows, cols)


def assert_orthogonalized(update, dims):
  for matrix in muon_matrices(update, dims):
    singular = np.linalg.svd(np.asarray(matrix, np.float64), compute_uv=False)
    singular /= singular.max()
    # Newton-Schulz (5 steps) drives every singular value towards one.
    assert singular.min() > 0.5, singular


def muon_update(tx, params):
  grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(1), p.shape),
                       params)
  return jax.jit(tx.update)(grads, tx.init(params), params)[0]


def muon_momentum(state):
  """The momentum of Muon's own branch (the kernels it orthogonalizes)."""
  return state.inner_states['muon'].inner_state[0].mu


def test_nnx_muon_dimension_numbers_treat_centered_kernels_as_matrices():
  model = MuonNet(nnx.Rngs(0))
  assert cbp.nnx.center(model).centered == ['conv', 'head', 'proj', 'stack']
  dims = cbp.nnx.muon_dimension_numbers(model)
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  table = dims(params)
  expected = {
      'conv': ((0, 1, 2), (3,)),
      'stack': ((1,), (2,)),  # axis 0 is the stack: a batch axis
      'proj': ((0,), (1, 2)),
      'head': ((0,), (1,)),
  }
  for name, (reduction, output) in expected.items():
    got = table[name]['layer']['kernel']
    assert (got.reduction_axis, got.output_axis) == (reduction, output), name
    assert table[name]['layer']['bias'] is None
  assert table['plain']['kernel'] == optax.contrib.MuonDimensionNumbers(
      (0,), (1,))
  tx = optax.contrib.muon(1.0, muon_weight_dimension_numbers=dims)
  updates = muon_update(tx, params)
  for name in expected:
    assert_orthogonalized(updates[name]['layer']['kernel'],
                          table[name]['layer']['kernel'])
  # Muon's own branch holds them (without the helper, the 4-D conv kernel
  # and the 3-D stack went to AdamW); the optimizer accepts its state.
  optimizer = cbp.nnx.Optimizer(model, tx)
  mu = muon_momentum(nnx.as_pure(optimizer.opt_state))
  assert all(not isinstance(mu[name]['layer']['kernel'], optax.MaskedNode)
             for name in expected)
  assert isinstance(mu['conv']['layer']['bias'], optax.MaskedNode)
  default = muon_momentum(optax.contrib.muon(1.0).init(params))
  assert isinstance(default['conv']['layer']['kernel'], optax.MaskedNode)
  assert isinstance(default['stack']['layer']['kernel'], optax.MaskedNode)


def linen_muon_model():
  model = cbp.linen.center(LinenNet(dtype=jnp.float32))
  variables = model.init(jax.random.key(0), jnp.ones(X_SHAPE))
  return model, variables['params'], variables['centering']


def test_linen_muon_dimension_numbers_treat_centered_kernels_as_matrices():
  _, params, centering = linen_muon_model()
  dims = cbp.linen.muon_dimension_numbers(params, centering)
  table = dims(params)
  expected = {
      ('Conv_0',): ((0, 1, 2), (3,)),
      ('stack', 'Dense_0'): ((1,), (2,)),
      ('Dense_0',): ((0,), (1,)),
  }
  for path, (reduction, output) in expected.items():
    node = table
    for key in path:
      node = node[key]
    got = node['kernel']
    assert (got.reduction_axis, got.output_axis) == (reduction, output), path
    assert node['bias'] is None
  tx = optax.contrib.muon(1.0, muon_weight_dimension_numbers=dims)
  updates = muon_update(tx, params)
  assert_orthogonalized(updates['Conv_0']['kernel'], table['Conv_0']['kernel'])
  assert_orthogonalized(updates['stack']['Dense_0']['kernel'],
                        table['stack']['Dense_0']['kernel'])
  mu = muon_momentum(tx.init(params))
  assert not isinstance(mu['Conv_0']['kernel'], optax.MaskedNode)
  assert isinstance(mu['Conv_0']['bias'], optax.MaskedNode)

  # The model form reads the same views from the layers themselves.
  model, _, _ = linen_muon_model()
  from_model = cbp.linen.muon_dimension_numbers(
      model, jax.random.key(0), jnp.ones(X_SHAPE))(params)
  assert jax.tree.leaves(from_model, is_leaf=is_view) == jax.tree.leaves(
      table, is_leaf=is_view)


def is_view(x):
  return x is None or isinstance(x, optax.contrib.MuonDimensionNumbers)


def views(table):
  """``{'a/b/kernel': (reduction, output)}`` for every kernel Muon sees."""
  return {
      '/'.join(str(getattr(k, 'key', k)) for k in path):
      (tuple(d.reduction_axis), tuple(d.output_axis))
      for path, d in jax.tree_util.tree_leaves_with_path(
          table, is_leaf=is_view) if d is not None}


def linen_views(module, x):
  """The Linen views from the model, after checking that the parameters
  alone are refused (their shapes cannot tell these kernels apart)."""
  params = module.init(jax.random.key(0), x)['params']
  with pytest.raises(ValueError, match='belongs to no centered layer'):
    cbp.linen.muon_dimension_numbers(params, {})
  with pytest.raises(TypeError, match='what its init takes'):
    cbp.linen.muon_dimension_numbers(module)  # no rngs and inputs
  dims = cbp.linen.muon_dimension_numbers(module, jax.random.key(0), x)
  tx = optax.contrib.muon(1.0, muon_weight_dimension_numbers=dims)
  updates, table = muon_update(tx, params), dims(params)
  for path, view in views(table).items():
    node, dim = updates, table
    for key in path.split('/'):
      node, dim = node[key], dim[key]
    assert_orthogonalized(node, dim)
  return views(table)


def nnx_views(model):
  dims = cbp.nnx.muon_dimension_numbers(model)
  return views(dims(nnx.as_pure(nnx.state(model, nnx.Param))))


class _BiasLessBlock(nn.Module):

  @nn.compact
  def __call__(self, h, _):
    return nn.Dense(4, use_bias=False)(h), None


class _BiasLessStacks(nn.Module):
  """Four bias-less layers scanned (stack axis 0) and four vmapped with
  their stack axis at 1: kernels (4, 4, 4), the same shape either way."""

  @nn.compact
  def __call__(self, x):
    scan = nn.scan(_BiasLessBlock, length=4, split_rngs={'params': True},
                   variable_axes={'params': 0})
    h, _ = scan(name='scanned')(x, None)
    vmap = nn.vmap(nn.Dense, in_axes=0, out_axes=0, split_rngs={'params': True},
                   variable_axes={'params': 1})
    return vmap(4, use_bias=False, name='mapped')(jnp.stack([h] * 4))


def test_linen_muon_dimension_numbers_of_bias_less_layer_stacks():
  got = linen_views(_BiasLessStacks(), jnp.ones((2, 4)))
  assert got == {'scanned/Dense_0/kernel': ((1,), (2,)),
                 'mapped/kernel': ((0,), (2,))}

  @nnx.split_rngs(splits=4)
  @nnx.vmap(in_axes=0, out_axes=0)
  def create(rngs):
    return nnx.Linear(4, 4, use_bias=False, rngs=rngs)

  assert nnx_views(nnx.Dict(scanned=create(nnx.Rngs(0)))) == {
      'scanned/kernel': ((1,), (2,))}


def test_linen_muon_dimension_numbers_of_bias_less_attention():
  x = jnp.ones((2, 3, 4))
  got = linen_views(nn.MultiHeadDotProductAttention(
      num_heads=2, qkv_features=6, out_features=5, use_bias=False), x)
  expected = {f'{name}/kernel': ((0,), (1, 2))
              for name in ('query', 'key', 'value')}
  expected['out/kernel'] = ((0, 1), (2,))
  assert got == expected
  assert nnx_views(nnx.MultiHeadAttention(
      num_heads=2, in_features=4, qkv_features=6, out_features=5,
      use_bias=False, decode=False, rngs=nnx.Rngs(0))) == expected


def test_linen_muon_dimension_numbers_of_multi_output_dense_general():
  got = linen_views(nn.DenseGeneral((3, 5), use_bias=False),
                    jnp.ones((2, 4)))
  assert got == {'kernel': ((0,), (1, 2))}
  assert nnx_views(nnx.LinearGeneral(4, (3, 5), use_bias=False,
                                     rngs=nnx.Rngs(0))) == got


def test_linen_muon_dimension_numbers_of_an_einsum_kernel():
  # The equation, not the axis order, says which axis is contracted.
  got = linen_views(nn.Einsum((5, 4), 'bi,oi->bo', use_bias=False),
                    jnp.ones((2, 4)))
  assert got == {'kernel': ((1,), (0,))}
  assert nnx_views(nnx.Einsum('bi,oi->bo', (5, 4), rngs=nnx.Rngs(0))) == got


def test_muon_dimension_numbers_of_a_transposed_kernel():
  # transpose_kernel=True stores (*window, C_out, C_in): C_in is reduced.
  x, expected = jnp.ones((1, 5, 5, 2)), {'kernel': ((0, 1, 3), (2,))}
  layer = nn.ConvTranspose(4, (3, 3), transpose_kernel=True)
  assert linen_views(layer, x) == expected
  model = nnx.ConvTranspose(2, 4, (3, 3), transpose_kernel=True,
                            rngs=nnx.Rngs(0))
  try:
    cbp.nnx.Centered(model)
  except TypeError:
    return  # centering does not know transposed convolutions
  assert nnx_views(model) == expected
  sequential = nnx.Sequential(model)
  cbp.nnx.center(sequential)
  assert nnx_views(sequential) == {'layers/0/layer/kernel': expected['kernel']}
  variables = cbp.linen.center(layer).init(jax.random.key(0), x)
  assert views(cbp.linen.muon_dimension_numbers(
      variables['params'], variables['centering'])(
          variables['params'])) == expected

@pytest.mark.slow
def test_muon_with_the_helper_trains_centered_models():
  x = jnp.ones(X_SHAPE) + 1.0
  model = MuonNet(nnx.Rngs(0))
  cbp.nnx.center(model)
  optimizer = cbp.nnx.Optimizer(model, optax.contrib.muon(
      0.05, muon_weight_dimension_numbers=cbp.nnx.muon_dimension_numbers(
          model)))
  step = cbp.nnx.train_step(lambda m, x: jnp.mean((m(x) - 1.0) ** 2))
  losses = [float(step(model, optimizer, x).loss) for _ in range(4)]
  assert losses[-1] < losses[0], losses
  model, params, centering = linen_muon_model()
  state = cbp.linen.TrainState.create(
      apply_fn=model.apply, params=params, centering=centering,
      tx=optax.contrib.muon(0.05, muon_weight_dimension_numbers=(
          cbp.linen.muon_dimension_numbers(params, centering))))
  step = cbp.linen.train_step(lambda apply, x: jnp.mean((apply(x) - 1.) ** 2))
  losses = []
  for _ in range(4):
    state, out = step(state, x)
    losses.append(float(out.loss))
  assert losses[-1] < losses[0], losses


class _SharedKernel(nnx.Module):
  """Two dense layers sharing one kernel (tied weights), each its own bias."""

  def __init__(self, rngs):
    self.first = nnx.Linear(3, 3, param_dtype=F64, rngs=rngs)
    self.second = nnx.Linear(3, 3, param_dtype=F64, rngs=rngs)
    self.second.kernel = self.first.kernel
    self.head = nnx.Linear(3, 2, param_dtype=F64, rngs=rngs)

  def __call__(self, x):
    return self.head(jnp.tanh(self.second(jnp.tanh(self.first(x)))))


@pytest.mark.parametrize('name', ['schedule_free_sgd', 'sam'])
def test_nnx_shared_kernel_copies_move_by_the_copys_kernel(name):
  # The second layer's kernel sits at the first's path in every copy: its
  # bias must move by the copy's kernel, not the model's.
  make = dict((n, m) for n, m, _ in COVERED)[name]
  with jax.enable_x64(True):
    model = _SharedKernel(nnx.Rngs(0))
    cbp.nnx.center(model)
    optimizer = cbp.nnx.Optimizer(model, make())
    nnx.update(model, perturbed(nnx.state(model, nnx.Param), 1))
    record = nnx.jit(lambda m, x: m(x))
    record(model, inputs((5, 3), 1, 1.0))
    cbp.nnx.transport(model, 0.5, optimizer=optimizer)
    x = inputs((5, 3), 3)
    function = lambda c: nnx_function(model, c, x)
    copies = {k: nnx.as_pure(c) for k, c in
              copies_of(optimizer.opt_state).items()}
    assert copies
    before = {k: function(c) for k, c in copies.items()}
    record(model, inputs((5, 3), 4, 6.0))
    cbp.nnx.transport(model, 0.0, optimizer=optimizer)
    for key, copy in copies_of(optimizer.opt_state).items():
      change = max_relative(function(nnx.as_pure(copy)), before[key])
      assert change <= F64_TOLERANCE, (key, change)


def test_nnx_muon_dimension_numbers_taken_before_center():
  # Taken before center, the helper sees the centered paths once muon asks.
  before, after = MuonNet(nnx.Rngs(0)), MuonNet(nnx.Rngs(0))
  early = cbp.nnx.muon_dimension_numbers(before)
  cbp.nnx.center(before)
  cbp.nnx.center(after)
  late = cbp.nnx.muon_dimension_numbers(after)
  params = nnx.as_pure(nnx.state(before, nnx.Param))
  got = early(params)
  assert got['conv']['layer']['kernel'] is not None
  assert jax.tree.leaves(got, is_leaf=lambda x: x is None) == jax.tree.leaves(
      late(params), is_leaf=lambda x: x is None)


# ----------------------------------------------------------------------------
# What eval_model and eval_params hand out outlives the donating steps

EVAL_OPTIMIZERS = {
    'recommended': lambda: cbp.recommended(1e-2, warmup_steps=2),
    'adam': lambda: optax.adam(1e-2),
}


@pytest.mark.parametrize('name', sorted(EVAL_OPTIMIZERS))
def test_nnx_eval_model_outlives_the_donating_step(name):
  model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.relu,
                         nnx.Linear(4, 2, rngs=nnx.Rngs(1)))
  cbp.nnx.center(model)
  optimizer = cbp.nnx.Optimizer(model, EVAL_OPTIMIZERS[name]())
  step = cbp.nnx.train_step(lambda m, x: jnp.mean((m(x) - 1.0) ** 2))
  x = jnp.linspace(-1.0, 2.0, 12).reshape(4, 3)
  step(model, optimizer, x)
  copies = [cbp.nnx.eval_model(model, optimizer), cbp.nnx.eval_model(model)]
  outputs = [np.asarray(copy(x)) for copy in copies]
  step(model, optimizer, x)  # donates the model's and optimizer's buffers
  for copy, output in zip(copies, outputs):
    np.testing.assert_array_equal(copy(x), output)


@pytest.mark.parametrize('name', sorted(EVAL_OPTIMIZERS))
def test_linen_eval_params_outlive_the_donating_step(name):
  model = cbp.linen.center(nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(2)]))
  x = jnp.linspace(-1.0, 2.0, 12).reshape(4, 3)
  variables = model.init(jax.random.key(0), x)
  state = cbp.linen.TrainState.create(
      apply_fn=model.apply, params=variables['params'],
      centering=variables['centering'], tx=EVAL_OPTIMIZERS[name]())
  step = cbp.linen.train_step(
      lambda apply, x: jnp.mean((apply(x) - 1.0) ** 2))
  state, _ = step(state, x)
  held = [cbp.linen.eval_params(state.params, state.opt_state),
          cbp.linen.eval_params(state.params)]
  # Read through a computation: np.asarray would cache the values.
  read = lambda params: jax.tree.map(lambda a: np.asarray(a + 0), params)
  values = [read(params) for params in held]
  state, _ = step(state, x)  # donates the state's buffers
  for params, value in zip(held, values):
    chex.assert_trees_all_equal(read(params), value)
