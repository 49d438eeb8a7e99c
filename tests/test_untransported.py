"""A centered model trained without a transport warns once, naming the fix."""

import functools
import warnings

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import cbp_optax as cbp
from cbp_optax import _untransported
from cbp_optax.centering import UntransportedWarning

CALLS = 5  # the threshold, lowered so that a test runs a few steps only


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
  monkeypatch.setattr(_untransported, 'CALLS', CALLS)
  monkeypatch.setattr(_untransported, '_warned', set())


def batch():
  x = jax.random.normal(jax.random.key(1), (16, 6)) + 1.0
  return x, jnp.arange(16) % 4


def loss_of(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


class NnxNet(nnx.Module):

  def __init__(self, rngs):
    self.hidden = nnx.Linear(6, 8, rngs=rngs)
    self.out = nnx.Linear(8, 4, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.hidden(x)))


class LinenNet(nn.Module):

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.relu(nn.Dense(8)(x))
    return nn.Dense(4)(x)


def nnx_pair(tx=None):
  model = NnxNet(nnx.Rngs(0))
  cbp.nnx.center(model)
  return model, nnx.Optimizer(model, tx or optax.adam(1e-2), wrt=nnx.Param)


def nnx_user_loop(steps, *, transport):
  model, optimizer = nnx_pair()

  @nnx.jit
  def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: loss_of(m(x), y))(model)
    optimizer.update(model, grads)
    if transport:
      cbp.nnx.transport(model, optimizer=optimizer)
    return loss

  x, y = batch()
  for _ in range(steps):
    train_step(model, optimizer, x, y)
  jax.effects_barrier()
  return model


def linen_user_loop(steps, *, transport):
  model = cbp.linen.center(LinenNet())
  x, y = batch()
  variables = model.init(jax.random.key(0), x)
  tx = optax.adam(1e-2)
  params, centering = variables['params'], variables['centering']
  opt_state = tx.init(params)

  @jax.jit
  def train_step(params, centering, opt_state, x, y):
    def loss_fn(p):
      logits, changed = model.apply({'params': p, 'centering': centering}, x,
                                    mutable=['centering'])
      return loss_of(logits, y), changed['centering']
    (loss, centering), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    if transport:
      params, centering, opt_state = cbp.linen.transport(
          params, centering, opt_state=opt_state)
    return params, centering, opt_state, loss

  for _ in range(steps):
    params, centering, opt_state, _ = train_step(
        params, centering, opt_state, x, y)
  jax.effects_barrier()
  return params, centering


def test_nnx_step_without_transport_warns_once_with_the_fix():
  with pytest.warns(UntransportedWarning) as record:
    nnx_user_loop(3 * CALLS, transport=False)
  assert len(record) == 1
  text = str(record[0].message)
  assert 'cbp.nnx.transport(model, optimizer=optimizer)' in text
  assert 'cbp.nnx.train_step' in text


def test_nnx_warns_at_the_threshold_not_before():
  with warnings.catch_warnings():
    warnings.simplefilter('error', UntransportedWarning)
    nnx_user_loop(CALLS - 1, transport=False)
  with pytest.warns(UntransportedWarning):
    nnx_user_loop(CALLS, transport=False)


def test_linen_step_without_transport_warns_once_with_the_fix():
  with pytest.warns(UntransportedWarning) as record:
    linen_user_loop(3 * CALLS, transport=False)
  assert len(record) == 1
  text = str(record[0].message)
  assert 'cbp.linen.transport(' in text and 'cbp.linen.train_step' in text


@pytest.mark.parametrize('loop', [nnx_user_loop, linen_user_loop])
def test_loops_that_transport_never_warn(loop):
  with warnings.catch_warnings():
    warnings.simplefilter('error', UntransportedWarning)
    loop(3 * CALLS, transport=True)


def test_fused_steps_never_warn():
  x, y = batch()
  with warnings.catch_warnings():
    warnings.simplefilter('error', UntransportedWarning)
    model, _ = nnx_pair()
    optimizer = cbp.nnx.Optimizer(model, cbp.cbp(1e-2))
    step = cbp.nnx.train_step(lambda m, x, y: loss_of(m(x), y))
    for _ in range(3 * CALLS):
      step(model, optimizer, x, y)
    linen_model = cbp.linen.center(LinenNet())
    variables = linen_model.init(jax.random.key(0), x)
    state = cbp.linen.TrainState.create(
        apply_fn=linen_model.apply, params=variables['params'],
        centering=variables['centering'], tx=cbp.cbp(1e-2))
    linen_step = cbp.linen.train_step(
        lambda apply, x, y: loss_of(apply(x), y))
    for _ in range(3 * CALLS):
      state, _ = linen_step(state, x, y)
    jax.effects_barrier()


def _host_callbacks(compiled_text):
  return compiled_text.count('python_cpu_callback')


def test_fused_steps_compile_without_the_check():
  """The fused steps transport: their programs call back to the host never.

  Their finiteness check reads the recorded count, so a checked count would
  stay in the program (one callback per centered layer and step).
  """
  x, y = batch()
  model, _ = nnx_pair()
  optimizer = cbp.nnx.Optimizer(model, optax.adam(1e-2))
  step = cbp.nnx.train_step(lambda m, x, y: loss_of(m(x), y))

  @nnx.jit
  def nested(model, optimizer, x, y):
    return step(model, optimizer, x, y).loss

  linen_model = cbp.linen.center(LinenNet())
  variables = linen_model.init(jax.random.key(0), x)
  state = cbp.linen.TrainState.create(
      apply_fn=linen_model.apply, params=variables['params'],
      centering=variables['centering'], tx=optax.adam(1e-2))
  linen_step = cbp.linen.train_step(lambda apply, x, y: loss_of(apply(x), y))
  programs = {
      'nnx direct': step.lower(model, optimizer, x, y).compile(),
      'nnx nested': nested.lower(model, optimizer, x, y).compile(),
      'linen': jax.jit(linen_step).lower(state, x, y).compile(),
  }
  assert {name: _host_callbacks(p.as_text()) for name, p in programs.items()
          } == dict.fromkeys(programs, 0)


def test_a_user_step_without_transport_keeps_the_check():
  model, optimizer = nnx_pair()
  x, y = batch()

  @nnx.jit
  def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: loss_of(m(x), y))(model)
    optimizer.update(model, grads)
    return loss

  compiled = train_step.lower(model, optimizer, x, y).compile()
  assert _host_callbacks(compiled.as_text()) == 2  # one per centered layer


def test_evaluation_records_nothing_and_never_warns():
  model, _ = nnx_pair()
  model.eval()
  forward = nnx.jit(lambda m, x: m(x))
  x, _ = batch()
  with warnings.catch_warnings():
    warnings.simplefilter('error', UntransportedWarning)
    for _ in range(3 * CALLS):
      forward(model, x)
    jax.effects_barrier()


def test_the_check_changes_no_number(monkeypatch):
  """The same loop with the check left out of the program: bit-equal."""
  with pytest.warns(UntransportedWarning):
    checked = nnx_user_loop(2 * CALLS, transport=False)
  monkeypatch.setattr(_untransported, '_ignored', lambda framework: True)
  unchecked = nnx_user_loop(2 * CALLS, transport=False)
  chex.assert_trees_all_equal(nnx.state(checked), nnx.state(unchecked))


def test_a_batched_count_calls_back_rarely_not_every_call(monkeypatch):
  """Under ``vmap`` the predicate is batched; a plain ``cond`` would become
  a select and call back at every step."""
  calls = []
  monkeypatch.setattr(_untransported, '_decide',
                      lambda *args: calls.append(args[0]) or np.int32(0))

  @jax.jit
  def step(counts, kernel):
    def one(count):
      return _untransported.check(count, count + 16.0, 16, 'nnx', 'layer',
                                  jnp.zeros(3), kernel)
    return jax.vmap(jax.vmap(one))(counts)

  counts = jnp.zeros((2, 3, 1))
  for i in range(3 * CALLS):
    counts = step(counts, jnp.full((3, 2), float(i)))
  chex.assert_trees_all_equal(counts, jnp.full((2, 3, 1), 48.0 * CALLS))
  jax.effects_barrier()
  # The start, and the crossings of the threshold and of twice it.
  assert calls == ['nnx'] * 3


def test_ignoring_the_warning_removes_the_check_so_export_works():
  model, _ = nnx_pair()
  graphdef, state = nnx.split(model)
  x, _ = batch()

  def forward(state, x):
    m = nnx.merge(graphdef, state)
    return m(x), nnx.state(m)

  with pytest.raises(NotImplementedError, match='host_callbacks'):
    jax.export.export(jax.jit(forward))(state, x)
  # A new function: jit caches a trace, with or without the check, by it.
  unchecked = lambda state, x: forward(state, x)  # pylint: disable=unnecessary-lambda
  with warnings.catch_warnings():
    warnings.filterwarnings('ignore', category=UntransportedWarning)
    exported = jax.export.export(jax.jit(unchecked))(state, x)
  chex.assert_trees_all_equal(exported.call(state, x), forward(state, x))


def test_gradients_may_be_taken_with_respect_to_every_collection():
  """A pure_callback has no JVP: the check is the identity to it."""
  model = cbp.linen.center(LinenNet())
  x, y = batch()
  variables = model.init(jax.random.key(0), x)

  def loss_fn(variables):
    logits, changed = model.apply(variables, x, mutable=['centering'])
    return loss_of(logits, y), changed

  grads, changed = jax.jit(jax.grad(loss_fn, has_aux=True))(variables)
  chex.assert_trees_all_equal_structs(grads, variables)
  assert float(changed['centering']['Dense_0']['batch_count'][0]) == 16.0


def nudge(model):
  """An update's change of every parameter (each step has its kernels)."""
  nnx.update(model, jax.tree.map(lambda p: p + 1e-3,
                                 nnx.state(model, nnx.Param)))


def raises_eagerly(model, x):
  """CALLS eager training steps under an error filter raise the warning."""
  with warnings.catch_warnings():
    warnings.simplefilter('error', UntransportedWarning)
    with pytest.raises(UntransportedWarning, match='cbp.nnx.transport'):
      for _ in range(CALLS):
        model(x)
        nudge(model)


def test_eager_calls_raise_the_warning_itself_under_an_error_filter():
  # Decided in Python, not in a host callback (whose exception reached the
  # caller as the runtime's INTERNAL callback error).
  x, _ = batch()
  model, _ = nnx_pair()
  raises_eagerly(model, x)
  _untransported._warned.clear()
  linen_model = cbp.linen.center(LinenNet())
  variables = linen_model.init(jax.random.key(0), x)
  with warnings.catch_warnings():
    warnings.simplefilter('error', UntransportedWarning)
    with pytest.raises(UntransportedWarning, match='cbp.linen.transport'):
      for _ in range(CALLS):
        _, changed = linen_model.apply(variables, x, mutable=['centering'])
        variables = {**variables, **changed,
                     'params': jax.tree.map(lambda p: p + 1e-3,
                                            variables['params'])}


@pytest.mark.parametrize('loop,framework', [(nnx_user_loop, 'nnx'),
                                            (linen_user_loop, 'linen')])
def test_an_error_filter_fails_compiled_loops_with_the_fix_and_keeps_the_once(
    loop, framework):
  # A host callback's exception reaches the caller of a compiled program as
  # the runtime's error (its type is lost), with the warning's text in it.
  with warnings.catch_warnings():
    warnings.simplefilter('error', UntransportedWarning)
    with pytest.raises(Exception) as error:  # noqa: B017 (the runtime's type)
      loop(3 * CALLS, transport=False)
  assert _untransported.message(framework) in str(error.value)
  # The error was no warning shown: the normal mode still warns, once.
  with pytest.warns(UntransportedWarning) as record:
    loop(3 * CALLS, transport=False)
  assert len(record) == 1


def test_an_eager_error_keeps_the_once():
  x, _ = batch()
  model, _ = nnx_pair()
  raises_eagerly(model, x)
  with pytest.warns(UntransportedWarning) as record:
    model(x)
    nnx_user_loop(3 * CALLS, transport=False)
  assert len(record) == 1


class NnxUnrolled(nnx.Module):
  """One centered layer applied ``CALLS + 1`` times in one forward pass."""

  def __init__(self, rngs, scan=False):
    self.cell = nnx.Linear(6, 6, rngs=rngs)
    self.out = nnx.Linear(6, 4, rngs=rngs)
    self.scan = scan

  def __call__(self, x):
    if self.scan:
      @nnx.scan(in_axes=(nnx.Carry,), out_axes=nnx.Carry, length=CALLS + 1)
      def body(carry):
        x, cell = carry
        return jnp.tanh(cell(x)), cell
      return self.out(body((x, self.cell))[0])
    for _ in range(CALLS + 1):
      x = jnp.tanh(self.cell(x))
    return self.out(x)


class LinenUnrolled(nn.Module):

  @nn.compact
  def __call__(self, x, train: bool = True):
    cell = nn.Dense(6)
    for _ in range(CALLS + 1):
      x = jnp.tanh(cell(x))
    return nn.Dense(4)(x)


def nnx_unrolled_loop(steps, *, transport, separate=False, scan=False):
  model = NnxUnrolled(nnx.Rngs(0), scan)
  cbp.nnx.center(model)
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  @nnx.jit
  def update(model, optimizer, x, y):
    grads = nnx.grad(lambda m: loss_of(m(x), y))(model)
    optimizer.update(model, grads)
    if transport and not separate:
      cbp.nnx.transport(model, optimizer=optimizer)

  move = nnx.jit(lambda m, o: cbp.nnx.transport(m, optimizer=o))
  x, y = batch()
  for _ in range(steps):
    update(model, optimizer, x, y)
    if transport and separate:
      move(model, optimizer)
  jax.effects_barrier()


def linen_unrolled_loop(steps, *, transport):
  model = cbp.linen.center(LinenUnrolled())
  x, y = batch()
  variables = model.init(jax.random.key(0), x)
  params, centering = variables['params'], variables['centering']

  @jax.jit
  def update(params, centering, x, y):
    def loss_fn(p):
      logits, changed = model.apply({'params': p, 'centering': centering}, x,
                                    mutable=['centering'])
      return loss_of(logits, y), changed['centering']
    grads, centering = jax.grad(loss_fn, has_aux=True)(params)
    params = jax.tree.map(lambda p, g: p - 1e-2 * g, params, grads)
    if transport:
      params, centering = cbp.linen.transport(params, centering)
    return params, centering

  for _ in range(steps):
    params, centering = update(params, centering, x, y)
  jax.effects_barrier()


@pytest.mark.parametrize('loop', [
    nnx_unrolled_loop, functools.partial(nnx_unrolled_loop, separate=True),
    functools.partial(nnx_unrolled_loop, scan=True),
    functools.partial(nnx_unrolled_loop, scan=True, separate=True),
    linen_unrolled_loop],
    ids=['nnx', 'nnx_separate_jits', 'nnx_scan', 'nnx_scan_separate_jits',
         'linen'])
def test_a_layer_applied_more_than_calls_times_per_step_is_no_untransported(
    loop):
  # Each step's forward pass applies the cell CALLS + 1 times: the count
  # crossed CALLS calls' worth inside the first step, which warned.
  with warnings.catch_warnings():
    warnings.simplefilter('error', UntransportedWarning)
    loop(3, transport=True)
  # Never transported, it warns once, at the second step.
  with warnings.catch_warnings():
    warnings.simplefilter('error', UntransportedWarning)
    loop(1, transport=False)
  with pytest.warns(UntransportedWarning) as record:
    loop(3, transport=False)
  assert len(record) == 1


def test_forward_passes_at_one_step_and_fresh_models_never_warn():
  # Gradient accumulation (CALLS forward passes per update, then a
  # transport) and a sweep of fresh models through one compiled step.
  x, y = batch()
  grad = nnx.jit(lambda m, x, y: nnx.grad(lambda m: loss_of(m(x), y))(m))

  @nnx.jit
  def update(model, optimizer, grads):
    optimizer.update(model, grads)
    cbp.nnx.transport(model, optimizer=optimizer)

  with warnings.catch_warnings():
    warnings.simplefilter('error', UntransportedWarning)
    for _ in range(3):
      model, optimizer = nnx_pair()
      for _ in range(3):
        grads = [grad(model, x, y) for _ in range(2 * CALLS)]
        update(model, optimizer, jax.tree.map(lambda *g: sum(g), *grads))
    jax.effects_barrier()


# Eager loops: each eager nnx.grad (jax.grad) call runs the layer on a new
# module object, so a key by the module's id never repeated.


def nnx_eager_loop(steps):
  model, optimizer = nnx_pair()
  x, y = batch()
  for _ in range(steps):
    optimizer.update(model, nnx.grad(lambda m: loss_of(m(x), y))(model))
  return model


def linen_eager_loop(steps):
  model = cbp.linen.center(LinenNet())
  x, y = batch()
  variables = model.init(jax.random.key(0), x)
  tx = optax.adam(1e-2)
  params, centering = variables['params'], variables['centering']
  opt_state = tx.init(params)
  for _ in range(steps):
    def loss_fn(p, centering=centering):
      logits, changed = model.apply({'params': p, 'centering': centering}, x,
                                    mutable=['centering'])
      return loss_of(logits, y), changed['centering']
    grads, centering = jax.grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  return params


@pytest.mark.parametrize('loop,framework', [(nnx_eager_loop, 'nnx'),
                                            (linen_eager_loop, 'linen')])
def test_an_eager_grad_loop_warns_once_and_raises_under_an_error_filter(
    loop, framework):
  with pytest.warns(UntransportedWarning,
                    match=f'cbp.{framework}.transport') as record:
    loop(3 * CALLS)
  assert len(record) == 1
  _untransported._warned.clear()
  with warnings.catch_warnings():
    warnings.simplefilter('error', UntransportedWarning)
    with pytest.raises(UntransportedWarning, match=f'cbp.{framework}'):
      loop(3 * CALLS)


def test_copies_of_a_model_share_its_key_and_equal_models_their_graph():
  model, _ = nnx_pair()
  other, _ = nnx_pair()
  key = model.hidden.untransported_key
  assert nnx.clone(model).hidden.untransported_key is key
  assert other.hidden.untransported_key is not key
  assert nnx.graphdef(model) == nnx.graphdef(other)
