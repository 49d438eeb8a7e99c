"""The fused CBP step (Algorithm 1, steps 1-11) for NNX and Linen."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import cbp_optax as cbp
from cbp_optax import linen as cbp_linen
from cbp_optax import nnx as cbp_nnx
from tests import numpy_reference as ref

WIDTHS = (6, 16, 12, 4)
STEPS = 25
HPARAMS = dict(b1=0.9, b2=0.99, damping=1e-3)
DECAY = 0.9
LR = 3e-2


def data(seed=0, n=32):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, WIDTHS[0])) + 1.5  # far from centered
  labels = rng.integers(0, WIDTHS[-1], n)
  return x, labels


def cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def relative_error(actual, expected):
  actual, expected = np.asarray(actual), np.asarray(expected)
  return float(np.max(np.abs(actual - expected))
               / max(np.max(np.abs(expected)), 1e-300))


def reference_for(kernels, biases):
  return ref.CenteredMLPReference(kernels, biases, lr=LR, rho=DECAY, **HPARAMS)


class LinenMLP(nn.Module):
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = True):
    for i, width in enumerate(WIDTHS[1:]):
      x = cbp_linen.Centered(nn.Dense(width, param_dtype=self.dtype))(
          x, use_running_average=not train)
      if i < len(WIDTHS) - 2:
        x = nn.relu(x)
    return x


class NnxMLP(nnx.Module):

  def __init__(self, rngs, dtype=jnp.float32):
    self.layers = nnx.List([
        cbp_nnx.Centered(nnx.Linear(a, b, param_dtype=dtype, rngs=rngs))
        for a, b in zip(WIDTHS[:-1], WIDTHS[1:])
    ])

  def __call__(self, x):
    for i, layer in enumerate(self.layers):
      x = layer(x)
      if i < len(self.layers) - 1:
        x = nnx.relu(x)
    return x


def test_linen_fused_step_matches_numpy_reference():
  x, labels = data()
  with jax.enable_x64(True):
    model = LinenMLP(jnp.float64)
    variables = model.init(jax.random.key(0), jnp.asarray(x))
    names = sorted(variables['params'])
    reference = reference_for(
        [np.asarray(variables['params'][n]['dense']['kernel']) for n in names],
        [np.asarray(variables['params'][n]['dense']['bias']) for n in names])
    state = cbp_linen.TrainState.create(
        apply_fn=model.apply, params=variables['params'],
        centering=variables['centering'],
        tx=cbp.cbp(LR, decay=DECAY, **HPARAMS))
    step = cbp_linen.train_step(
        lambda apply, x, y: cross_entropy(apply(x), y), mean_decay=DECAY)
    worst = 0.0
    for _ in range(STEPS):
      state, out = step(state, jnp.asarray(x), jnp.asarray(labels))
      loss = reference.step(x, labels)
      worst = max(worst, abs(float(out.loss) - loss) / abs(loss))
      for l, n in enumerate(names):
        worst = max(
            worst,
            relative_error(state.params[n]['dense']['kernel'],
                           reference.kernels[l]),
            relative_error(state.params[n]['dense']['bias'],
                           reference.biases[l]),
            relative_error(state.centering[n]['mean'].value, reference.means[l]))
    assert int(state.step) == STEPS
  assert worst <= 1e-9, worst
  # The means moved well away from zero: the test exercised the transport.
  assert np.min(np.abs(reference.means[0])) > 0.5


@pytest.mark.parametrize('graph', [True, False], ids=['graph', 'tree'])
def test_nnx_fused_step_matches_numpy_reference(graph):
  x, labels = data(1)
  with jax.enable_x64(True), nnx.set_graph_mode(graph):
    model = NnxMLP(nnx.Rngs(0), jnp.float64)
    reference = reference_for(
        [np.asarray(l.layer.kernel[...]) for l in model.layers],
        [np.asarray(l.layer.bias[...]) for l in model.layers])
    optimizer = nnx.Optimizer(
        model, cbp.cbp(LR, decay=DECAY, **HPARAMS), wrt=nnx.Param)
    step = cbp_nnx.train_step(
        lambda m, x, y: cross_entropy(m(x), y), mean_decay=DECAY)
    worst = 0.0
    for _ in range(STEPS):
      out = step(model, optimizer, jnp.asarray(x), jnp.asarray(labels))
      loss = reference.step(x, labels)
      worst = max(worst, abs(float(out.loss) - loss) / abs(loss))
      for l, layer in enumerate(model.layers):
        worst = max(
            worst,
            relative_error(layer.layer.kernel[...], reference.kernels[l]),
            relative_error(layer.layer.bias[...], reference.biases[l]),
            relative_error(layer.mean[...], reference.means[l]))
  assert worst <= 1e-9, worst


def _flat(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_linen_nonfinite_batch_skips_everything():
  x, labels = data()
  model = LinenMLP()
  variables = model.init(jax.random.key(0), jnp.asarray(x))
  state = cbp_linen.TrainState.create(
      apply_fn=model.apply, params=variables['params'],
      centering=variables['centering'], tx=cbp.cbp(LR))
  step = cbp_linen.train_step(
      lambda apply, x, y: cross_entropy(apply(x), y), donate=False)
  for _ in range(3):
    state, out = step(state, x, labels)
    assert not bool(out.skipped)
  bad = np.array(x)
  bad[3, 2] = np.nan
  new_state, out = step(state, bad, labels)
  assert bool(out.skipped)
  assert int(new_state.skipped_steps) == 1
  chex.assert_trees_all_equal(
      new_state.replace(skipped_steps=state.skipped_steps), state)
  assert int(new_state.step) == 3
  state, out = step(new_state, x, labels)  # and training goes on
  assert not bool(out.skipped) and int(state.step) == 4


@pytest.mark.parametrize('graph', [True, False], ids=['graph', 'tree'])
def test_nnx_nonfinite_batch_skips_everything(graph):
  x, labels = data()
  with nnx.set_graph_mode(graph):
    model = NnxMLP(nnx.Rngs(0))
    optimizer = cbp_nnx.Optimizer(model, cbp.cbp(LR), wrt=nnx.Param)
    step = cbp_nnx.train_step(lambda m, x, y: cross_entropy(m(x), y))
    for _ in range(3):
      step(model, optimizer, x, labels)
    state_of = lambda: _flat(nnx.state((model, optimizer),
                                       nnx.Not(nnx.PathContains('skipped_steps'))))
    before = state_of()
    assert len(before) > 10  # parameters, moments, energies, means, counts
    bad = np.array(x)
    bad[0, 0] = np.inf
    out = step(model, optimizer, bad, labels)
    assert bool(out.skipped)
    for a, b in zip(before, state_of()):
      np.testing.assert_array_equal(a, b)
    assert int(optimizer.step[...]) == 3
    assert int(optimizer.skipped_steps[...]) == 1


def test_loss_function_aux_metrics_are_returned():
  x, labels = data()
  model = NnxMLP(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, cbp.cbp(LR), wrt=nnx.Param)

  def loss_fn(model, x, y):
    logits = model(x)
    return cross_entropy(logits, y), {'accuracy': jnp.mean(
        jnp.argmax(logits, -1) == y)}

  out = cbp_nnx.train_step(loss_fn)(model, optimizer, x, labels)
  assert set(out.aux) == {'accuracy'}
  with pytest.raises(ValueError, match='scalar'):
    cbp_nnx.train_step(lambda m, x, y: m(x))(model, optimizer, x, labels)


def test_uncentered_model_is_an_ordinary_step():
  x, labels = data()
  make = lambda: nnx.Sequential(
      nnx.Linear(WIDTHS[0], 8, rngs=nnx.Rngs(0)), nnx.relu,
      nnx.Linear(8, WIDTHS[-1], rngs=nnx.Rngs(1)))
  model, twin = make(), make()  # no shared buffers: the step donates
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  twin_optimizer = nnx.Optimizer(twin, optax.adam(1e-2), wrt=nnx.Param)
  loss_fn = lambda m, x, y: cross_entropy(m(x), y)
  step = cbp_nnx.train_step(loss_fn)

  @nnx.jit
  def plain_step(model, optimizer, x, y):
    grads = nnx.grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)

  for _ in range(5):
    step(model, optimizer, x, labels)
    plain_step(twin, twin_optimizer, x, labels)
  for a, b in zip(_flat(nnx.state(model)), _flat(nnx.state(twin))):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_linen_uncentered_model_and_adam_plus_center():
  x, labels = data()
  plain = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(WIDTHS[-1])])
  variables = plain.init(jax.random.key(0), x)
  state = cbp_linen.TrainState.create(
      apply_fn=plain.apply, params=variables['params'], tx=optax.adam(1e-2))
  step = cbp_linen.train_step(lambda apply, x, y: cross_entropy(apply(x), y))
  losses = []
  for _ in range(30):
    state, out = step(state, x, labels)
    losses.append(float(out.loss))
  assert losses[-1] < losses[0]
  # "Adam + Center": centering with any optax optimizer.
  model = LinenMLP()
  variables = model.init(jax.random.key(0), x)
  state = cbp_linen.TrainState.create(
      apply_fn=model.apply, params=variables['params'],
      centering=variables['centering'], tx=optax.adam(1e-2))
  losses = []
  for _ in range(30):
    state, out = step(state, x, labels)
    losses.append(float(out.loss))
  assert losses[-1] < 0.7 * losses[0]
  assert float(jnp.abs(state.centering['Centered_0']['mean'].value).min()) > 0.1


class ResidualBlock(nnx.Module):
  """A ResNet basic block with every convolution centered."""

  def __init__(self, channels, rngs):
    self.conv1 = cbp_nnx.Centered(
        nnx.Conv(channels, channels, (3, 3), padding='SAME', rngs=rngs))
    self.conv2 = cbp_nnx.Centered(
        nnx.Conv(channels, channels, (3, 3), padding='SAME', rngs=rngs))

  def __call__(self, x):
    return nnx.relu(x + self.conv2(nnx.relu(self.conv1(x))))


class SmallResNet(nnx.Module):

  def __init__(self, rngs):
    self.stem = cbp_nnx.Centered(
        nnx.Conv(1, 8, (3, 3), strides=2, padding='SAME', rngs=rngs))
    self.block = ResidualBlock(8, rngs)
    self.head = cbp_nnx.Centered(nnx.Linear(8, 3, rngs=rngs))

  def __call__(self, x):
    x = self.block(nnx.relu(self.stem(x)))
    return self.head(jnp.mean(x, axis=(1, 2)))


def test_resnet_block_trains_and_transport_is_exact():
  rng = np.random.default_rng(0)
  labels = rng.integers(0, 3, 16)
  images = rng.standard_normal((16, 8, 8, 1)) * 0.3 + labels[:, None, None,
                                                             None] * 0.5 + 1.0
  model = SmallResNet(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, cbp.cbp(1e-2), wrt=nnx.Param)
  step = cbp_nnx.train_step(lambda m, x, y: cross_entropy(m(x), y))
  losses = [float(step(model, optimizer, images, labels).loss)
            for _ in range(40)]
  assert losses[-1] < 0.5 * losses[0], losses
  # A further transport moves every mean yet leaves the output unchanged.
  model.eval()
  before = model(images)
  model.train()
  model(images * 2.0 + 1.0)  # records a very different batch mean
  cbp_nnx.transport(model, mean_decay=0.0)
  model.eval()
  after = model(images)
  np.testing.assert_allclose(after, before, rtol=1e-4, atol=1e-4)


def _parameter_sized_copies(hlo_text, params):
  shapes = {','.join(map(str, x.shape)) for x in jax.tree.leaves(params)
            if x.ndim == 2}
  return [line for line in hlo_text.splitlines()
          if ' copy(' in line and any(f'[{s}]' in line.split('=')[1]
                                      for s in shapes)]


def test_linen_step_has_no_parameter_copies_and_region_analysis_is_exact():
  """XLA's CPU copy insertion would copy M3's lagged second moment (read
  after v_t is written into its donated buffer) and the skip conditional's
  operands; the fused step compiles with region analysis, which proves the
  order instead. Same numbers, bit for bit."""
  x, labels = data()
  model = LinenMLP()
  variables = model.init(jax.random.key(0), x)
  state = cbp_linen.TrainState.create(
      apply_fn=model.apply, params=variables['params'],
      centering=variables['centering'], tx=cbp.cbp(LR))
  step = cbp_linen.train_step(lambda apply, x, y: cross_entropy(apply(x), y))
  lowered = step.lower(state, x, labels)
  fused = lowered.compile()
  plain = lowered.compile(
      {'xla_cpu_copy_insertion_use_region_analysis': False})
  if jax.default_backend() == 'cpu':
    assert _parameter_sized_copies(fused.as_text(), state.params) == []
    assert _parameter_sized_copies(plain.as_text(), state.params)  # the bug
  a, b = (jax.tree.map(jnp.copy, state) for _ in range(2))  # both donated
  for _ in range(5):
    a, _ = fused(a, x, labels)
    b, _ = plain(b, x, labels)
  chex.assert_trees_all_equal(a, b)


def test_nnx_step_has_no_parameter_copies_and_region_analysis_is_exact():
  from cbp_optax import _step  # pylint: disable=g-import-not-at-top
  x, labels = data()
  step = cbp_nnx.train_step(lambda m, x, y: cross_entropy(m(x), y))
  pairs = []
  for _ in range(2):
    model = NnxMLP(nnx.Rngs(0))
    pairs.append((model, cbp_nnx.Optimizer(model, cbp.cbp(LR))))
  # An NNX executable is bound to its model's graph: compile per pair.
  fused = step.lower(*pairs[0], x, labels).compile(_step.compiler_options())
  plain = step.lower(*pairs[1], x, labels).compile(
      {'xla_cpu_copy_insertion_use_region_analysis': False})
  params = nnx.state(pairs[0][0], nnx.Param)
  if jax.default_backend() == 'cpu':
    assert _parameter_sized_copies(fused.as_text(), params) == []
    assert _parameter_sized_copies(plain.as_text(), params)
  for _ in range(5):
    fused(*pairs[0], x, labels)
    plain(*pairs[1], x, labels)
  for a, b in zip(_flat(nnx.state(pairs[0])), _flat(nnx.state(pairs[1]))):
    np.testing.assert_array_equal(a, b)


def test_nnx_lower_is_the_program_a_direct_call_runs():
  # step.lower used to lower nnx.jit(step): another program, without the
  # step's CPU compiler options, so its executable copied M3's moment.
  x, labels = data()
  step = cbp_nnx.train_step(lambda m, x, y: cross_entropy(m(x), y))
  lowered_model, direct_model = NnxMLP(nnx.Rngs(0)), NnxMLP(nnx.Rngs(0))
  lowered_opt = cbp_nnx.Optimizer(lowered_model, cbp.cbp(LR))
  direct_opt = cbp_nnx.Optimizer(direct_model, cbp.cbp(LR))
  compiled = step.lower(lowered_model, lowered_opt, x, labels).compile()
  if jax.default_backend() == 'cpu':
    assert _parameter_sized_copies(
        compiled.as_text(), nnx.state(lowered_model, nnx.Param)) == []
  for _ in range(3):
    lowered_out = compiled(lowered_model, lowered_opt, x, labels)
    direct_out = step(direct_model, direct_opt, x, labels)
    np.testing.assert_array_equal(lowered_out.loss, direct_out.loss)
  for a, b in zip(_flat(nnx.state((lowered_model, lowered_opt))),
                  _flat(nnx.state((direct_model, direct_opt)))):
    np.testing.assert_array_equal(a, b)


def test_steps_nested_in_an_undonated_user_jit_copy_no_parameter_buffer():
  """A user's own ``nnx.jit`` / ``jax.jit`` around the fused step donates
  nothing and sets no compiler options. The skip of a non-finite batch is a
  select, not a conditional: a ``lax.cond`` there made XLA copy every
  parameter-sized buffer it passes through, every step."""
  x, labels = data()
  model = NnxMLP(nnx.Rngs(0))
  optimizer = cbp_nnx.Optimizer(model, cbp.cbp(LR))
  nnx_step = cbp_nnx.train_step(lambda m, x, y: cross_entropy(m(x), y))

  @nnx.jit
  def users_nnx_step(model, optimizer, x, y):
    return nnx_step(model, optimizer, x, y).loss

  hlo = users_nnx_step.lower(model, optimizer, x, labels).compile().as_text()
  assert _parameter_sized_copies(hlo, nnx.state(model, nnx.Param)) == []

  linen_model = LinenMLP()
  variables = linen_model.init(jax.random.key(0), x)
  state = cbp_linen.TrainState.create(
      apply_fn=linen_model.apply, params=variables['params'],
      centering=variables['centering'], tx=cbp.cbp(LR))
  linen_step = cbp_linen.train_step(
      lambda apply, x, y: cross_entropy(apply(x), y))
  users_jax_step = jax.jit(lambda state, x, y: linen_step(state, x, y))
  hlo = users_jax_step.lower(state, x, labels).compile().as_text()
  assert _parameter_sized_copies(hlo, state.params) == []


class _LazyCounter(nnx.Module):
  """Creates a statistic at its first call, as lazily built caches do."""

  def __init__(self, rngs):
    self.linear = nnx.Linear(3, 2, rngs=rngs)

  def __call__(self, x):
    if not hasattr(self, 'calls'):
      self.calls = nnx.BatchStat(jnp.zeros((), jnp.int32))
    self.calls[...] += 1
    return self.linear(x)


@pytest.mark.parametrize('donate', [True, False])
def test_nnx_step_keeps_state_the_forward_pass_creates(donate):
  model = _LazyCounter(nnx.Rngs(0))
  cbp.nnx.center(model)
  optimizer = cbp.nnx.Optimizer(model, cbp.cbp(1e-2))
  step = cbp.nnx.train_step(lambda m, x: jnp.mean(m(x) ** 2), donate=donate)
  x = jnp.ones((4, 3))
  before = np.asarray(model.linear.kernel[...])
  for expected_calls in (1, 2, 3):
    out = step(model, optimizer, x)
    assert not bool(out.skipped)
    assert int(model.calls[...]) == expected_calls
  assert int(optimizer.step[...]) == 3
  assert not np.allclose(model.linear.kernel[...], before)


@pytest.mark.parametrize('graph', [True, False])
def test_nnx_step_writes_back_every_variable_in_place(graph):
  """The flat write-back leaves the same Variable objects, with new values."""
  with nnx.set_graph_mode(graph):
    model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.relu,
                           nnx.Linear(4, 1, rngs=nnx.Rngs(1)))
    cbp.nnx.center(model)
    optimizer = cbp.nnx.Optimizer(model, optax.adam(1e-2))
    kernel_variable = model.layers[0].kernel
    mean_variable = model.layers[0].mean
    step = cbp.nnx.train_step(lambda m, x: jnp.mean(m(x) ** 2))
    x = jnp.ones((4, 3)) + 2.0
    step(model, optimizer, x)
    assert model.layers[0].kernel is kernel_variable
    assert model.layers[0].mean is mean_variable
    chex.assert_trees_all_close(mean_variable[...], jnp.full((3,), 0.03))
    assert int(optimizer.step[...]) == 1
    assert int(optimizer.skipped_steps[...]) == 0


@pytest.mark.parametrize('api', ['nnx', 'linen'])
def test_cbp_steps_check_m1_energies_instead_of_every_gradient(api):
  # One is-finite over M1's energy vector replaces one per gradient leaf
  # (the pass over every entry was 6-9% of a step at width 512, CPU).
  x, labels = data()

  def finiteness_checks(tx):
    if api == 'nnx':
      model = NnxMLP(nnx.Rngs(0))
      optimizer = cbp_nnx.Optimizer(model, tx, wrt=nnx.Param)
      step = cbp_nnx.train_step(lambda m, x, y: cross_entropy(m(x), y))
      lowered = step.lower(model, optimizer, x, labels)
    else:
      variables = LinenMLP().init(jax.random.key(0), jnp.asarray(x))
      state = cbp_linen.TrainState.create(
          apply_fn=LinenMLP().apply, params=variables['params'],
          centering=variables['centering'], tx=tx)
      step = cbp_linen.train_step(
          lambda apply, x, y: cross_entropy(apply(x), y))
      lowered = step.lower(state, x, labels)
    return lowered.as_text().count('is_finite')

  gradient_leaves = 2 * (len(WIDTHS) - 1)
  adamw = finiteness_checks(optax.adamw(LR))
  for tx in (cbp.cbp(LR), cbp.cbp_robust(LR)):
    assert adamw - finiteness_checks(tx) == gradient_leaves - 1


def test_staged_tells_an_outer_trace_from_eager_calls():
  """The fused step runs its own executable only outside every transform.

  ``staged`` reads the current trace through ``jax.extend.core``: this fails
  if JAX renames its eager trace or stops reporting it there.
  """
  from cbp_optax import _step  # pylint: disable=g-import-not-at-top
  x = jnp.ones(2)
  assert not _step.staged((x,))
  seen = []

  def record(y):
    seen.append(_step.staged((x,)))  # x closed over: no tracer argument
    return y

  jax.jit(record)(1.0)
  jax.vmap(record)(x)
  jax.grad(record)(1.0)
  assert seen == [True, True, True]
  assert not _step.staged((x,))


class _MaskedConv(nnx.Module):
  """A model holding plain array attributes: a Conv's mask, nnx.data."""

  def __init__(self):
    mask = np.ones((3, 3, 2, 3), np.float32)
    mask[0, 0] = 0.0
    self.conv = nnx.Conv(2, 3, (3, 3), mask=jnp.asarray(mask),
                         rngs=nnx.Rngs(0))
    self.scale = nnx.data(jnp.asarray([1.0, 2.0, 3.0]))

  def __call__(self, x):
    return self.conv(x).mean((1, 2)) * self.scale


def test_nnx_fused_step_on_a_model_with_plain_array_attributes():
  loss = lambda m, x: jnp.mean((m(x) - 1.0) ** 2)
  x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 5, 5, 2))
                  + 2.0, jnp.float32)
  fused, unfused = _MaskedConv(), _MaskedConv()
  for model in (fused, unfused):
    cbp.nnx.center(model)
  fused_opt = cbp.nnx.Optimizer(fused, optax.adam(1e-2))
  unfused_opt = nnx.Optimizer(unfused, optax.adam(1e-2), wrt=nnx.Param)
  step = cbp.nnx.train_step(loss, mean_decay=0.5)

  @nnx.jit
  def unfused_step(model, optimizer, x):
    grads = nnx.grad(loss)(model, x)
    optimizer.update(model, grads)
    cbp.nnx.transport(model, 0.5, optimizer=optimizer)

  for _ in range(3):
    assert not bool(step(fused, fused_opt, x).skipped)
    unfused_step(unfused, unfused_opt, x)
  np.testing.assert_allclose(fused(x), unfused(x), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(fused.scale, jnp.asarray([1.0, 2.0, 3.0]))


def _small_nnx():
  model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.tanh,
                         nnx.Linear(4, 2, rngs=nnx.Rngs(1)))
  cbp.nnx.center(model)
  return model


UNCOMMON = [
    ('sm3', lambda: optax.sm3(0.1)),
    ('polyak_sgd', lambda: optax.polyak_sgd(1.0)),
    ('momo', lambda: optax.contrib.momo(0.1)),
    ('reduce_on_plateau', lambda: optax.chain(
        optax.sgd(0.1), optax.contrib.reduce_on_plateau(patience=1))),
]


@pytest.mark.parametrize('make_tx', [m for _, m in UNCOMMON],
                         ids=[n for n, _ in UNCOMMON])
def test_fused_steps_run_optimizers_of_uncommon_shapes(make_tx):
  # optax.sm3's state lists turn into graph nodes at the first NNX update;
  # polyak_sgd, momo and reduce_on_plateau take the loss as value=.
  loss = lambda m, x: jnp.mean((m(x) - 1.0) ** 2)
  x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 3)) + 2.0,
                  jnp.float32)
  fused, unfused = _small_nnx(), _small_nnx()
  fused_opt = cbp.nnx.Optimizer(fused, make_tx())
  unfused_opt = nnx.Optimizer(unfused, make_tx(), wrt=nnx.Param)
  step = cbp.nnx.train_step(loss, mean_decay=0.5)

  @nnx.jit
  def unfused_step(model, optimizer, x):
    value, grads = nnx.value_and_grad(loss)(model, x)
    extra = ({'value': value} if isinstance(
        optimizer.tx, optax.GradientTransformationExtraArgs) else {})
    optimizer.update(model, grads, **extra)
    cbp.nnx.transport(model, 0.5, optimizer=optimizer)

  for _ in range(3):
    assert not bool(step(fused, fused_opt, x).skipped)
    unfused_step(unfused, unfused_opt, x)
  np.testing.assert_allclose(fused(x), unfused(x), rtol=1e-5, atol=1e-6)
  # Linen: the fused step runs and matches its unfused loop.
  net = cbp.linen.center(nn.Sequential([nn.Dense(4), nn.tanh, nn.Dense(2)]))
  variables = net.init(jax.random.key(0), x)
  tx = make_tx()
  state = cbp.linen.TrainState.create(  # donated: its own arrays
      apply_fn=net.apply, params=jax.tree.map(jnp.copy, variables['params']),
      centering=jax.tree.map(jnp.copy, variables['centering']), tx=tx)
  linen_step = cbp.linen.train_step(
      lambda apply, x: jnp.mean((apply(x) - 1.0) ** 2), mean_decay=0.5)
  params, centering = variables['params'], variables['centering']
  opt_state = tx.init(params)

  @jax.jit
  def linen_unfused(params, centering, opt_state, x):
    def loss_of(p):
      y, changed = net.apply({'params': p, 'centering': centering}, x,
                             mutable=['centering'])
      return jnp.mean((y - 1.0) ** 2), changed
    (value, changed), grads = jax.value_and_grad(loss_of, has_aux=True)(
        params)
    extra = ({'value': value} if isinstance(
        tx, optax.GradientTransformationExtraArgs) else {})
    updates, opt_state = tx.update(grads, opt_state, params, **extra)
    return cbp.linen.transport(optax.apply_updates(params, updates),
                               changed['centering'], 0.5, opt_state=opt_state)

  for _ in range(3):
    state, out = linen_step(state, x)
    assert not bool(out.skipped)
    params, centering, opt_state = linen_unfused(params, centering,
                                                 opt_state, x)
  np.testing.assert_allclose(
      net.apply({'params': state.params, 'centering': state.centering}, x),
      net.apply({'params': params, 'centering': centering}, x),
      rtol=1e-5, atol=1e-6)


def test_fused_steps_refuse_lookahead_with_the_reason():
  tx = lambda: optax.lookahead(optax.sgd(0.1), 2, 0.5)
  x = jnp.ones((4, 3))
  model = _small_nnx()
  optimizer = cbp.nnx.Optimizer(model, tx())
  with pytest.raises(TypeError, match='optax.lookahead.*LookaheadParams'):
    cbp.nnx.train_step(lambda m, x: jnp.mean(m(x) ** 2))(model, optimizer, x)
  net = cbp.linen.center(nn.Dense(2))
  variables = net.init(jax.random.key(0), x)
  state = cbp.linen.TrainState.create(
      apply_fn=net.apply, params=variables['params'],
      centering=variables['centering'], tx=tx())
  with pytest.raises(TypeError, match='optax.lookahead.*LookaheadParams'):
    cbp.linen.train_step(lambda apply, x: jnp.mean(apply(x) ** 2))(state, x)
