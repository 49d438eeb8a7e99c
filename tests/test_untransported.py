"""A centered model trained without a transport warns once, naming the fix.

The check runs on the host only: an NNX layer where its count is written
with concrete values (eager calls, ``nnx.jit``'s write-back), a Linen layer
in an eager call. A Linen ``jax.jit`` loop runs no library host code, so it
goes unchecked.
"""

import functools
import warnings

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
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


def test_linen_eager_loop_without_transport_warns_once_with_the_fix():
  # A Linen jax.jit loop (linen_user_loop) returns to no library host code:
  # only eager calls are checked.
  with pytest.warns(UntransportedWarning) as record:
    linen_eager_loop(3 * CALLS)
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


def _host_callbacks(compiled_text):
  return compiled_text.count('python_cpu_callback')


def test_fused_steps_compile_without_the_check():
  """The check runs on the host: the fused programs never call back."""
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


def test_a_user_step_without_transport_calls_back_never():
  model, optimizer = nnx_pair()
  x, y = batch()

  @nnx.jit
  def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: loss_of(m(x), y))(model)
    optimizer.update(model, grads)
    return loss

  compiled = train_step.lower(model, optimizer, x, y).compile()
  assert _host_callbacks(compiled.as_text()) == 0


def test_evaluation_records_nothing_and_never_warns():
  model, _ = nnx_pair()
  model.eval()
  forward = nnx.jit(lambda m, x: m(x))
  x, _ = batch()
  with warnings.catch_warnings():
    warnings.simplefilter('error', UntransportedWarning)
    for _ in range(3 * CALLS):
      forward(model, x)


def test_the_check_changes_no_number(monkeypatch):
  """The same loop with a threshold never reached: bit-equal."""
  with pytest.warns(UntransportedWarning):
    checked = nnx_user_loop(2 * CALLS, transport=False)
  monkeypatch.setattr(_untransported, 'CALLS', 10**9)
  unchecked = nnx_user_loop(2 * CALLS, transport=False)
  chex.assert_trees_all_equal(nnx.state(checked), nnx.state(unchecked))


def test_the_check_reads_the_device_at_doubling_writes_only(monkeypatch):
  """A Python count of the writes otherwise; none once a transport ran."""
  reads = []
  monkeypatch.setattr(_untransported, '_recorded',
                      lambda count: reads.append(1) or False)
  model, _ = nnx_pair()
  model.eval()  # nnx.jit writes the (zero) count back at every call
  forward = nnx.jit(lambda m, x: m(x))
  x, _ = batch()
  for _ in range(4 * CALLS + 1):
    forward(model, x)
  assert len(reads) == 2 * 3  # at CALLS, 2 CALLS and 4 CALLS; two layers
  reads.clear()
  nnx_user_loop(4 * CALLS, transport=True)
  assert not reads


def test_a_training_mode_forward_pass_exports():
  model, _ = nnx_pair()
  graphdef, state = nnx.split(model)
  x, _ = batch()

  def forward(state, x):
    m = nnx.merge(graphdef, state)
    return m(x), nnx.state(m)

  exported = jax.export.export(jax.jit(forward))(state, x)
  chex.assert_trees_all_equal(exported.call(state, x), forward(state, x))


def test_gradients_may_be_taken_with_respect_to_every_collection():
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


def test_an_error_filter_raises_the_warning_from_compiled_nnx_loops():
  # Raised on the host, where nnx.jit writes the count back: the warning
  # itself, not the runtime's error of a host callback.
  with warnings.catch_warnings():
    warnings.simplefilter('error', UntransportedWarning)
    with pytest.raises(UntransportedWarning, match='cbp.nnx.transport'):
      nnx_user_loop(3 * CALLS, transport=False)
  # The error was no warning shown: the normal mode still warns, once.
  with pytest.warns(UntransportedWarning) as record:
    nnx_user_loop(3 * CALLS, transport=False)
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


@pytest.mark.parametrize('loop', [
    nnx_unrolled_loop, functools.partial(nnx_unrolled_loop, separate=True),
    functools.partial(nnx_unrolled_loop, scan=True),
    functools.partial(nnx_unrolled_loop, scan=True, separate=True),
    linen_unrolled_loop],
    ids=['nnx', 'nnx_separate_jits', 'nnx_scan', 'nnx_scan_separate_jits',
         'linen'])
def test_a_layer_applied_more_than_calls_times_per_step_is_no_untransported(
    loop):
  # Each step's forward pass applies the cell CALLS + 1 times; a compiled
  # step writes the count back once.
  with warnings.catch_warnings():
    warnings.simplefilter('error', UntransportedWarning)
    loop(3, transport=True)
    loop(1, transport=False)
  if loop is linen_unrolled_loop:
    return  # a Linen jax.jit loop is unchecked
  # Never transported, an NNX loop warns once, at step CALLS.
  with pytest.warns(UntransportedWarning) as record:
    loop(CALLS, transport=False)
  assert len(record) == 1


def test_forward_passes_at_one_step_and_fresh_models_never_warn():
  # Gradient accumulation (fewer than CALLS forward passes per update, then
  # a transport: CALLS before the first transport warn) and a sweep of
  # fresh models through one compiled step.
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
        grads = [grad(model, x, y) for _ in range(CALLS - 1)]
        update(model, optimizer, jax.tree.map(lambda *g: sum(g), *grads))


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
  key = model.hidden.batch_count.get_metadata('untransported')
  assert model.hidden.mean.get_metadata('untransported') is key
  assert nnx.clone(model).hidden.batch_count.get_metadata(
      'untransported') is key
  assert other.hidden.batch_count.get_metadata('untransported') is not key
  assert nnx.graphdef(model) == nnx.graphdef(other)
