"""Checkpoints through Orbax's public API: the code of docs/checkpointing.md.

Every optimizer the README and the workload suite name, on a centered model
with dropout (typed PRNG keys) in NNX and in Linen: two steps, a save, a
restore into a fresh model and optimizer, one more step, and every array
equal to a run that never stopped. The functions used are the ones the
docs page defines, executed from the page itself.
"""

import pathlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import cbp_optax as cbp

PAGE = pathlib.Path(__file__).resolve().parents[1] / 'docs' / 'checkpointing.md'


def run_page(replace=(), names=None):
  """The namespace of the page's Python blocks, run in order; ``replace``:
  (text, by) pairs, each of which must occur on the page."""
  text = PAGE.read_text()
  for old, new in replace:
    assert old in text, old
    text = text.replace(old, new)
  namespace = {'__name__': 'checkpointing_page', **(names or {})}
  for block in re.findall(r'```python\n(.*?)```', text, re.S):
    exec(compile(block, str(PAGE), 'exec'), namespace)  # pylint: disable=exec-used
  return namespace


DOC = run_page()


def kernels(params):
  return jax.tree_util.tree_map_with_path(
      lambda path, _: 'kernel' in jax.tree_util.keystr(path), params)


# name -> tx(muon_dims): every optimizer of the README and the workloads.
# SGD with momentum runs on the plain model: the transport refuses its
# TraceState on a centered one until it is declared (the workload suite
# runs SGD plain too).
PLAIN = ('sgd_momentum',)
OPTIMIZERS = {
    'cbp': lambda dims: cbp.cbp(1e-2),
    'cbp_robust': lambda dims: cbp.cbp_robust(1e-2),
    'precondition_kron': lambda dims: optax.chain(
        cbp.precondition_kron(every=1, dimension_numbers=dims),
        optax.scale_by_learning_rate(1e-2)),
    'recommended': lambda dims: cbp.recommended(1e-2, warmup_steps=2),
    'adamw': lambda dims: optax.adamw(1e-2),
    'nadamw': lambda dims: optax.nadamw(1e-2),
    'sgd_momentum': lambda dims: optax.sgd(1e-2, momentum=0.9),
    'muon': lambda dims: optax.contrib.muon(
        1e-2, muon_weight_dimension_numbers=dims),
    'schedule_free_adamw': lambda dims: optax.contrib.schedule_free_adamw(
        1e-2),
    'masked': lambda dims: optax.masked(optax.adam(1e-2), kernels),
}

X = jax.random.normal(jax.random.key(1), (8, 4))
Y = jax.random.normal(jax.random.key(2), (8, 3))


def as_numpy(tree):
  """Every leaf as a NumPy array (typed keys as their key data)."""
  def leaf(x):
    if jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    return np.asarray(x)
  return jax.tree.map(leaf, tree)


def assert_bit_equal(a, b):
  """Same leaves at the same paths, bit for bit (static fields aside)."""
  a = jax.tree_util.tree_flatten_with_path(as_numpy(a))[0]
  b = jax.tree_util.tree_flatten_with_path(as_numpy(b))[0]
  assert [jax.tree_util.keystr(p) for p, _ in a] == [
      jax.tree_util.keystr(p) for p, _ in b]
  assert a
  for (path, x), (_, y) in zip(a, b):
    assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(path)
    np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


# NNX ----------------------------------------------------------------------------


def nnx_build(name):
  def build():
    model = DOC['MLP'](nnx.Rngs(0))
    if name not in PLAIN:
      cbp.nnx.center(model)
    tx = OPTIMIZERS[name](cbp.nnx.muon_dimension_numbers(model))
    return model, cbp.nnx.Optimizer(model, tx)
  return build


def nnx_loss(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


@pytest.mark.parametrize('name', sorted(OPTIMIZERS))
def test_nnx_resume_is_bit_exact(name, tmp_path):
  build = nnx_build(name)
  step = cbp.nnx.train_step(nnx_loss)
  model, optimizer = build()
  for _ in range(2):
    step(model, optimizer, X, Y)
  DOC['save_nnx'](str(tmp_path / 'c'), model, optimizer)
  before = as_numpy(nnx.state((model, optimizer)))
  step(model, optimizer, X, Y)  # the run that never stopped

  fresh_model, fresh_optimizer = DOC['restore_nnx'](str(tmp_path / 'c'), build)
  assert_bit_equal(nnx.state((fresh_model, fresh_optimizer)), before)
  step(fresh_model, fresh_optimizer, X, Y)
  assert_bit_equal(nnx.state((fresh_model, fresh_optimizer)),
                   nnx.state((model, optimizer)))
  assert int(fresh_optimizer.step[...]) == 3
  # The run moved: equality is not that of two untouched models.
  moved = jax.tree.leaves(as_numpy(nnx.state(fresh_model, nnx.Param)))
  initial = jax.tree.leaves(as_numpy(nnx.state(build()[0], nnx.Param)))
  assert not all(np.array_equal(a, b) for a, b in zip(moved, initial))


# Linen --------------------------------------------------------------------------


class LinenMLP(nn.Module):

  @nn.compact
  def __call__(self, x, train: bool = True):
    h = nn.relu(nn.Dense(16, name='hidden')(x))
    h = nn.Dropout(0.1, deterministic=not train)(h)
    return nn.Dense(3, name='out')(h)


def linen_state(name):
  module = LinenMLP() if name in PLAIN else cbp.linen.center(LinenMLP())
  variables = module.init(jax.random.key(0), X, train=False)
  centering = variables.get('centering', {})
  dims = cbp.linen.muon_dimension_numbers(module, jax.random.key(0), X,
                                          train=False)
  return cbp.linen.TrainState.create(
      apply_fn=module.apply, params=variables['params'],
      centering=centering, tx=OPTIMIZERS[name](dims))


def linen_loss(apply_fn, x, y, key):
  out = apply_fn(x, rngs={'dropout': key})
  return jnp.mean((out - y) ** 2)


@pytest.mark.parametrize('name', sorted(OPTIMIZERS))
def test_linen_resume_is_bit_exact(name, tmp_path):
  step = cbp.linen.train_step(linen_loss)
  state = linen_state(name)
  key = jax.random.key(3)
  for _ in range(2):
    key, sub = jax.random.split(key)
    state, _ = step(state, X, Y, sub)
  DOC['save_linen'](str(tmp_path / 'c'), {'train': state, 'key': key})
  before = as_numpy({'train': state, 'key': key})
  _, sub = jax.random.split(key)
  state, _ = step(state, X, Y, sub)

  restored = DOC['restore_linen'](
      str(tmp_path / 'c'),
      {'train': linen_state(name), 'key': jax.random.key(0)})
  assert_bit_equal(restored, before)
  assert jnp.issubdtype(restored['key'].dtype, jax.dtypes.prng_key)
  _, sub = jax.random.split(restored['key'])
  resumed, _ = step(restored['train'], X, Y, sub)
  assert_bit_equal(resumed, state)
  assert int(resumed.step) == 3
  assert resumed.tx is restored['train'].tx


# The page's other recipes --------------------------------------------------------


def test_checkpoint_manager_resumes_the_newest_step(tmp_path):
  latest, kept = DOC['save_every_step'](str(tmp_path / 'm'), 3)
  assert (latest, list(kept)) == (3, [2, 3])
  model, optimizer = DOC['resume_latest'](str(tmp_path / 'm'))
  reference_model, reference_optimizer = DOC['build']()
  for _ in range(3):
    DOC['step'](reference_model, reference_optimizer, DOC['x'], DOC['y'])
  assert_bit_equal(nnx.state((model, optimizer)),
                   nnx.state((reference_model, reference_optimizer)))


# The page's code itself, with each optimizer swapped in ---------------------------

# The page's optimizers, and each optimizer as the page's code spells it
# (Muon reads its dimension numbers from the page's model or module).
PAGE_NNX_TX = 'cbp.recommended(1e-2, warmup_steps=10)'
PAGE_LINEN_TX = 'tx=cbp.cbp(1e-2))'
SPELLED = {
    'cbp': 'cbp.cbp(1e-2)',
    'cbp_robust': 'cbp.cbp_robust(1e-2)',
    'recommended': 'cbp.recommended(1e-2, warmup_steps=2)',
    'adamw': 'optax.adamw(1e-2)',
    'nadamw': 'optax.nadamw(1e-2)',
    'muon': 'optax.contrib.muon(1e-2, muon_weight_dimension_numbers={dims})',
    'schedule_free_adamw': 'optax.contrib.schedule_free_adamw(1e-2)',
    'masked': 'optax.masked(optax.adam(1e-2), kernels)',
    'precondition_kron': (
        'optax.chain(cbp.precondition_kron(every=1, dimension_numbers={dims}),'
        ' optax.scale_by_learning_rate(1e-2))'),
}
NNX_DIMS = 'cbp.nnx.muon_dimension_numbers(model)'
LINEN_DIMS = 'cbp.linen.muon_dimension_numbers(module, jax.random.key(0), x)'


def test_the_page_names_every_centered_optimizer():
  assert set(SPELLED) == set(OPTIMIZERS) - set(PLAIN)


@pytest.mark.parametrize('name', sorted(SPELLED))
def test_the_pages_code_resumes_bit_exact_with_each_optimizer(name):
  nnx_tx = SPELLED[name].format(dims=NNX_DIMS)
  linen_tx = SPELLED[name].format(dims=LINEN_DIMS)
  page = run_page(replace=[(PAGE_NNX_TX, nnx_tx),
                           (PAGE_LINEN_TX, f'tx={linen_tx})')],
                  names={'optax': optax, 'kernels': kernels})
  # NNX: the page stepped, saved, restored and stepped once more.
  model, optimizer = page['build']()
  for _ in range(2):
    page['step'](model, optimizer, page['x'], page['y'])
  assert_bit_equal(nnx.state((page['model'], page['optimizer'])),
                   nnx.state((model, optimizer)))
  # Linen: likewise, from fresh_state.
  state = page['fresh_state']()
  for _ in range(2):
    state, _ = page['linen_step'](state, page['x'], page['y'])
  assert_bit_equal(page['state'], state)
  assert int(page['state'].step) == 2


# What Orbax would save but not restore is refused at save -------------------------


@pytest.mark.parametrize('where', ['step[1]', 'lr[0.1]/step_1'])
def test_the_page_refuses_a_path_orbax_reads_as_a_pattern(where, tmp_path):
  model, optimizer = nnx_build('recommended')()
  path = str(tmp_path / where)
  with pytest.raises(ValueError, match=re.escape(repr(path))):
    DOC['save_nnx'](path, model, optimizer)
  with pytest.raises(ValueError, match='square brackets'):
    DOC['save_linen'](path, {'w': jnp.arange(3)})
  assert not (tmp_path / where).exists()


class DottedLinen(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(2, name='a.b')(x) + Inner(name='a')(x)


class Inner(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(2, name='b')(x)


def test_the_page_refuses_names_that_join_to_one_dotted_name(tmp_path):
  with pytest.raises(ValueError, match=r"\['a\.b'\]"):
    DOC['save_linen'](str(tmp_path / 'raw'),
                      {'a.b': jnp.ones(2), 'a': {'b': jnp.zeros(2)}})
  module = cbp.linen.center(DottedLinen())
  variables = module.init(jax.random.key(0), X)
  state = cbp.linen.TrainState.create(
      apply_fn=module.apply, params=variables['params'],
      centering=variables['centering'], tx=cbp.recommended(1e-2))
  with pytest.raises(ValueError, match=r"saved as \[.*'[a-z0-9.]*a\.b\."):
    DOC['save_linen'](str(tmp_path / 'linen'), state)

  model = nnx.Dict({'a.b': nnx.Linear(2, 2, rngs=nnx.Rngs(0)),
                    'a': nnx.Dict({'b': nnx.Linear(2, 2, rngs=nnx.Rngs(1))})})
  cbp.nnx.center(model)
  optimizer = cbp.nnx.Optimizer(model, cbp.recommended(1e-2))
  with pytest.raises(ValueError, match=r"saved as \[.*'[a-z0-9.]*a\.b\."):
    DOC['save_nnx'](str(tmp_path / 'nnx'), model, optimizer)
  assert not list(tmp_path.iterdir())


# A state restored into another configuration is refused --------------------------


def test_a_cbp_robust_checkpoint_is_refused_by_a_cbp_build(
    tmp_path, monkeypatch):
  # cbp.cbp with cbp_robust's clip has its state's structure: the restore
  # succeeded, and M1's bounds (1, 1) were silently replaced by (0.1, 4).
  monkeypatch.setitem(OPTIMIZERS, 'cbp_clipped',
                      lambda dims: cbp.cbp(1e-2, update_clip=3.0))
  model, optimizer = nnx_build('cbp_robust')()
  step = cbp.nnx.train_step(nnx_loss)
  step(model, optimizer, X, Y)
  DOC['save_nnx'](str(tmp_path / 'nnx'), model, optimizer)
  model, optimizer = DOC['restore_nnx'](str(tmp_path / 'nnx'),
                                        nnx_build('cbp_clipped'))
  with pytest.raises(ValueError, match='records min_scale=1 but this '
                     'transform has min_scale=0.1'):
    step(model, optimizer, X, Y)

  linen_step = cbp.linen.train_step(linen_loss)
  state, _ = linen_step(linen_state('cbp_robust'), X, Y, jax.random.key(0))
  DOC['save_linen'](str(tmp_path / 'linen'), state)
  restored = DOC['restore_linen'](str(tmp_path / 'linen'),
                                  linen_state('cbp_clipped'))
  with pytest.raises(ValueError, match='records min_scale=1'):
    linen_step(restored, X, Y, jax.random.key(0))
  # The same configuration resumes.
  restored = DOC['restore_linen'](str(tmp_path / 'linen'),
                                  linen_state('cbp_robust'))
  linen_step(restored, X, Y, jax.random.key(0))
