"""CBP inside the training loops users already have (their own jit)."""

import pathlib
import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import cbp_optax as cbp

ROOT = pathlib.Path(__file__).resolve().parents[1]


class NnxNet(nnx.Module):
  """Linear -> BatchNorm -> relu -> dropout -> Linear: every kind of state."""

  def __init__(self, rngs):
    self.hidden = nnx.Linear(6, 8, rngs=rngs)
    self.norm = nnx.BatchNorm(8, rngs=rngs)
    self.dropout = nnx.Dropout(0.1, rngs=rngs)
    self.out = nnx.Linear(8, 4, rngs=rngs)

  def __call__(self, x):
    return self.out(self.dropout(nnx.relu(self.norm(self.hidden(x)))))


class LinenNet(nn.Module):

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Dense(8)(x)
    x = nn.BatchNorm(use_running_average=not train)(x)
    x = nn.Dropout(0.1, deterministic=not train)(nn.relu(x))
    return nn.Dense(4)(x)


def batch():
  x = jax.random.normal(jax.random.key(1), (16, 6)) + 1.0
  return x, jnp.arange(16) % 4


def nnx_loss(model, x, y):
  logits = model(x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), logits


def comparable(tree):
  return [jax.random.key_data(x)
          if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else np.asarray(x)
          for x in jax.tree.leaves(tree)]


def assert_bit_equal(a, b):
  a, b = comparable(a), comparable(b)
  assert len(a) == len(b)
  for u, v in zip(a, b):
    np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize('graph', [True, False], ids=['graph', 'tree'])
def test_nnx_step_inside_a_tutorial_nnx_jit_step_is_bit_equal(graph):
  """The Flax tutorial's ``@nnx.jit def train_step(model, optimizer,
  metrics, ...)`` with the fused step inside: the same numbers as the fused
  step called directly (it failed: a lowered and compiled function cannot be
  traced)."""
  step = cbp.nnx.train_step(nnx_loss)

  @nnx.jit
  def train_step(model, optimizer, metrics, x, y):
    out = step(model, optimizer, x, y)
    metrics.update(loss=out.loss, logits=out.aux, labels=y)
    return out

  with nnx.set_graph_mode(graph):
    pairs = []
    for _ in range(2):
      model = NnxNet(nnx.Rngs(0))
      cbp.nnx.center(model)
      pairs.append((model, cbp.nnx.Optimizer(model, cbp.cbp(1e-2))))
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(),
                              loss=nnx.metrics.Average('loss'))
    x, y = batch()
    for _ in range(3):
      direct = step(*pairs[0], x, y)
      nested = train_step(*pairs[1], metrics, x, y)
      assert_bit_equal(direct, nested)
    assert_bit_equal(nnx.state(pairs[0]), nnx.state(pairs[1]))
    assert int(pairs[1][1].step[...]) == 3
    assert np.isfinite(float(metrics.compute()['loss']))


def test_linen_step_inside_users_jax_jit_is_bit_equal():
  model = cbp.linen.center(LinenNet())
  x, y = batch()
  variables = model.init(jax.random.key(0), x, train=False)

  def loss_fn(apply, x, y, key):
    logits = apply(x, rngs={'dropout': key})
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  step = cbp.linen.train_step(loss_fn)

  @jax.jit
  def train_step(state, x, y, key):
    state, out = step(state, x, y, key)
    return state, out, jnp.sum(out.loss)  # the user's own metric beside it

  state = cbp.linen.TrainState.create(
      apply_fn=model.apply, params=variables['params'],
      centering=variables['centering'],
      model_state={'batch_stats': variables['batch_stats']},
      tx=cbp.cbp(1e-2))
  a, b = (jax.tree.map(jnp.copy, state) for _ in range(2))  # both donated
  for i in range(3):
    key = jax.random.key(i)
    a, out_a = step(a, x, y, key)
    b, out_b, _ = train_step(b, x, y, key)
    chex.assert_trees_all_equal(out_a, out_b)
  chex.assert_trees_all_equal(a, b)
  assert int(b.step) == 3


def test_docs_own_train_step_snippets_run_and_agree():
  """The "Your own train step" section of the docs runs as written; the
  unfused path (optimizer.update + transport in the user's nnx.jit) computes
  the fused step."""
  page = (ROOT / 'docs/using-cbp-on-your-model.md').read_text()
  section = page.split('## Your own train step', 1)[1].split('\n## ', 1)[0]
  blocks = re.findall(r'```python\n(.*?)```', section, re.S)
  assert len(blocks) == 2
  namespace = {}
  for block in blocks:
    exec(compile(block, 'docs/using-cbp-on-your-model.md', 'exec'), namespace)  # pylint: disable=exec-used
  fused = nnx.state(namespace['model'], nnx.Param)
  plain = nnx.state(namespace['plain_model'], nnx.Param)
  means = [nnx.state(namespace[k], cbp.nnx.CenteringMean)
           for k in ('model', 'plain_model')]
  chex.assert_trees_all_close(fused, plain, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(*means, rtol=1e-5, atol=1e-6)
  assert float(jnp.max(jnp.abs(means[1]['layers'][0]['mean'][...]))) > 0.01
  assert int(namespace['optimizer'].step[...]) == 5


def _mlp():
  return nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.relu,
                        nnx.Linear(4, 1, rngs=nnx.Rngs(1)))


def _mse(model, x):
  return jnp.mean(model(x) ** 2)


@pytest.mark.parametrize('tx', [cbp.cbp(1e-3), optax.adam(1e-3)],
                         ids=['cbp', 'adam'])
@pytest.mark.parametrize('loop', ['fused', 'own'])
def test_centering_after_the_optimizer_says_to_build_it_after(tx, loop):
  """It said "precondition: the gradient tree does not match the state..."
  with two PyTreeDefs (cbp), or optax's "pytree structure error" (adam)."""
  model = _mlp()
  optimizer = cbp.nnx.Optimizer(model, tx)
  cbp.nnx.center(model)
  x = jnp.ones((2, 3))
  match = (r"center moved 'layers/0/\w+' to 'layers/0/layer/\w+'.*Build the "
           r'optimizer .* after calling center')
  with pytest.raises(ValueError, match=match):
    if loop == 'fused':
      cbp.nnx.train_step(_mse)(model, optimizer, x)
    else:
      optimizer.update(model, nnx.grad(_mse)(model, x))


def test_plain_nnx_optimizer_with_cbp_names_the_late_centering_too():
  model = _mlp()
  optimizer = nnx.Optimizer(model, cbp.cbp(1e-3), wrt=nnx.Param)
  cbp.nnx.center(model)
  with pytest.raises(ValueError, match='precondition: the model was centered '
                     'after the optimizer was built'):
    optimizer.update(model, nnx.grad(_mse)(model, jnp.ones((2, 3))))


def test_wrong_step_arguments_say_what_to_pass():
  """Swapped, the NNX step said "'Sequential' object has no attribute
  'wrt'"; too few arguments named train_step.<locals>.step_with_options."""
  model = _mlp()
  optimizer = cbp.nnx.Optimizer(model, cbp.cbp(1e-3))
  step = cbp.nnx.train_step(_mse)
  x = jnp.ones((2, 3))
  with pytest.raises(TypeError, match='got the optimizer first and a '
                     'Sequential second: pass the model first'):
    step(optimizer, model, x)
  with pytest.raises(TypeError, match='takes an nnx.Optimizer .* second, got '
                     'a Sequential'):
    step(model, model, x)
  with pytest.raises(TypeError, match=r'takes the model and the optimizer '
                     r'first, got 1 argument\(s\)') as info:
    step(model)
  assert '<locals>' not in str(info.value)
  linen_step = cbp.linen.train_step(lambda apply, x: jnp.mean(apply(x)))
  for args in [(), ({'params': {}}, x)]:
    with pytest.raises(TypeError, match='takes a cbp_optax.linen.TrainState '
                       'first') as info:
      linen_step(*args)
    assert '<locals>' not in str(info.value)


def test_direct_call_donates_and_compiles_once(caplog):
  """Called directly the step is still one donated executable, compiled on
  the first call only (jax.jit's cache, keyed by the model's structure)."""
  model = _mlp()
  cbp.nnx.center(model)
  optimizer = cbp.nnx.Optimizer(model, cbp.cbp(1e-3))
  step = cbp.nnx.train_step(_mse)
  x = jnp.ones((2, 3))
  step(model, optimizer, x)
  kernel = model.layers[0].layer.kernel[...]
  with jax.log_compiles(), caplog.at_level('WARNING'):
    for _ in range(3):
      step(model, optimizer, x)
  assert not [r for r in caplog.records if 'Compiling' in r.getMessage()]
  assert kernel.is_deleted()  # donated to the step
  assert int(optimizer.step[...]) == 4


def test_the_optax_transform_says_late_centering_in_no_framework_words():
  # It said "cbp.nnx.center moved ..." and named nnx.Optimizer for any
  # caller of the framework-free transform.
  tx = cbp.precondition()
  state = tx.init({'h': {'kernel': jnp.ones((2, 2)), 'bias': jnp.zeros(2)}})
  moved = {'h': {'layer': {'kernel': jnp.ones((2, 2)),
                           'bias': jnp.zeros(2)}}}
  with pytest.raises(ValueError, match=(
      "precondition: the model was centered after the optimizer was built: "
      "centering moved 'h/bias' to 'h/layer/bias'.*Build the optimizer "
      'after centering the model.')) as caught:
    tx.update(moved, state)
  assert 'nnx' not in str(caught.value)


def test_docs_plain_linen_optax_loop_runs_and_moves_the_means():
  """The Linen optax loop (moved from the README) runs as written, and its
  transport moved the means off zero."""
  page = (ROOT / 'docs/using-cbp-on-your-model.md').read_text()
  section = page.split('## A plain optax loop (Linen)', 1)[1].split(
      '\n## ', 1)[0]
  blocks = re.findall(r'```python\n(.*?)```', section, re.S)
  assert len(blocks) == 1
  namespace = {}
  exec(compile(blocks[0], 'docs/using-cbp-on-your-model.md', 'exec'),  # pylint: disable=exec-used
       namespace)
  assert np.isfinite(float(namespace['loss']))
  means = jax.tree.leaves(namespace['centering'])
  assert max(float(jnp.max(jnp.abs(m))) for m in means) > 0.01
