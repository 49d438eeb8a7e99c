"""CBP on a device mesh gives the numbers of one device (issue 6).

The placement helpers are the plain-JAX code of docs/sharding.md, run from
the page itself.

The sharded runs need 8 devices, and the number of simulated CPU devices is
fixed when jax initializes. So that every other test keeps its one-device
process unchanged, :func:`test_sharded_suite_on_eight_simulated_devices`
reruns this file in a subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``; in that subprocess
(or in any run that already has 8 devices) the tests below run directly and
the launcher skips itself.
"""

from __future__ import annotations

import collections
import os
import pathlib
import re
import subprocess
import sys
from typing import Any, Callable, NamedTuple, Optional

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cbp_optax as cbp
from cbp_optax import linen as cbp_linen
from cbp_optax import nnx as cbp_nnx
from tests import test_sharding_helpers as sharding_helpers
from tests.doc_code import run_page

sharding = run_page('sharding.md', definitions_only=True)

DEVICES = 8
ROOT = pathlib.Path(__file__).resolve().parents[1]
HAVE_MESH = jax.device_count() >= DEVICES
needs_mesh = pytest.mark.skipif(
    not HAVE_MESH,
    reason='needs 8 devices; the slow tier reruns this file with 8 simulated '
    'devices (test_sharded_suite_on_eight_simulated_devices)',
)

STEPS = 10
BATCH = 16
DECAY = 0.9
HPARAMS = dict(b1=0.9, b2=0.99, damping=1e-3, decay=0.95)
LR = 1e-3


@pytest.mark.slow
def test_sharded_suite_on_eight_simulated_devices():
  if HAVE_MESH:
    pytest.skip('this process has the devices: the tests below ran here')
  env = dict(os.environ)
  env['XLA_FLAGS'] = (
      env.get('XLA_FLAGS', '')
      + f' --xla_force_host_platform_device_count={DEVICES}'
  ).strip()
  env['JAX_PLATFORMS'] = 'cpu'
  result = subprocess.run(
      [sys.executable, '-m', 'pytest', '-q', '-n', '0', '-p', 'no:cacheprovider',
       str(pathlib.Path(__file__).relative_to(ROOT))],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
  assert ' passed' in result.stdout and 'skipped' in result.stdout, (
      result.stdout[-3000:])


# Models -----------------------------------------------------------------------

MLP_WIDTHS = (16, 64, 32, 8)


class LinenMLP(nn.Module):
  """A centered MLP (Linen)."""

  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    for i, width in enumerate(MLP_WIDTHS[1:]):
      x = cbp_linen.Centered(nn.Dense(width, param_dtype=self.dtype))(x)
      if i < len(MLP_WIDTHS) - 2:
        x = nn.relu(x)
    return x


class NnxConvNet(nnx.Module):
  """A small centered convnet (NNX): two 3x3 convolutions, pooling, a head."""

  def __init__(self, rngs: nnx.Rngs, dtype: Any = jnp.float32):
    conv = lambda a, b, stride: cbp_nnx.Centered(nnx.Conv(
        a, b, (3, 3), strides=stride, padding='SAME', param_dtype=dtype,
        rngs=rngs))
    self.layers = nnx.List([
        conv(3, 8, 1), conv(8, 16, 2),
        cbp_nnx.Centered(nnx.Linear(16, 10, param_dtype=dtype, rngs=rngs)),
    ])

  def __call__(self, x):
    x = nnx.relu(self.layers[0](x))
    x = nnx.relu(self.layers[1](x))
    return self.layers[2](jnp.mean(x, axis=(1, 2)))


def cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def batches(kind: str, dtype: Any, batch: int = BATCH, steps: int = STEPS):
  rng = np.random.default_rng(0)
  shape = (MLP_WIDTHS[0],) if kind == 'mlp' else (6, 6, 3)
  classes = MLP_WIDTHS[-1] if kind == 'mlp' else 10
  # Off-center inputs, so the means move and the transport does work.
  return [
      ((rng.standard_normal((batch, *shape)) + 1.5).astype(dtype),
       rng.integers(0, classes, batch).astype(np.int32))
      for _ in range(steps)
  ]


# Mesh layouts -----------------------------------------------------------------


class Layout(NamedTuple):
  """A mesh and the rule that places model state (params and means) on it."""

  name: str
  mesh_shape: dict[str, int]
  # rule(mesh, tree) -> tree of NamedSharding; the optimizer state follows
  # the parameters through `sharding.optimizer_sharding`.
  rule: Callable[[Any, Any], Any]


def _replicated(mesh, tree):
  return jax.tree.map(lambda _: NamedSharding(mesh, P()), tree)


def _layer_index(path) -> Optional[int]:
  for key in path:
    name = str(getattr(key, 'key', getattr(key, 'idx', '')))
    match = re.fullmatch(r'(?:Centered_)?(\d+)', name)
    if match:
      return int(match.group(1))
  return None


def _tensor_parallel(mesh, tree):
  """Megatron-style: the first hidden width split over 'model'.

  The first layer is column-parallel (kernel output axis and bias), the
  second row-parallel (kernel input axis and its centering means).
  """

  def rule(path, leaf):
    names = [str(getattr(k, 'key', getattr(k, 'name', ''))) for k in path]
    layer, ndim = _layer_index(path), np.ndim(leaf)
    spec = [None] * ndim
    if layer == 0 and 'kernel' in names:
      spec[-1] = 'model'
    elif layer == 0 and 'bias' in names:
      spec[0] = 'model'
    elif layer == 1 and 'kernel' in names:
      spec[-2] = 'model'
    elif layer == 1 and ({'mean', 'batch_mean'} & set(names)):
      spec[0] = 'model'
    return NamedSharding(mesh, P(*spec))

  return jax.tree_util.tree_map_with_path(rule, tree)


def _fsdp(mesh, tree):
  return sharding.fsdp_sharding(tree, mesh, 'data')


LAYOUTS = {
    'data8': Layout('data8', {'data': 8}, _replicated),
    'data4_model2': Layout('data4_model2', {'data': 4, 'model': 2},
                           _tensor_parallel),
    'fsdp8': Layout('fsdp8', {'data': 8}, _fsdp),
}


def make_mesh(layout: Layout) -> jax.sharding.Mesh:
  # Auto axes: XLA's partitioner chooses the collectives (GSPMD), as in
  # ordinary data-parallel and FSDP training.
  return jax.make_mesh(
      tuple(layout.mesh_shape.values()), tuple(layout.mesh_shape),
      axis_types=(AxisType.Auto,) * len(layout.mesh_shape))


# Runs -------------------------------------------------------------------------


class Run(NamedTuple):
  params: Any
  opt_state: Any
  means: Any
  losses: list[float]
  # The shardings the run was given, to check the step kept them.
  placed: Any
  energy: jax.Array  # M1's block energies.


def find_energy(opt_state: Any) -> jax.Array:
  """M1's block energies inside an optimizer state (Linen or NNX)."""
  (m1_state,) = [
      x for x in jax.tree.leaves(
          opt_state, is_leaf=lambda x: isinstance(x, cbp.EqualizeState))
      if isinstance(x, cbp.EqualizeState)]
  return jnp.asarray(m1_state.energy[...])


def linen_setup(dtype, layout: Optional[Layout]):
  model = LinenMLP(dtype)
  data = batches('mlp', dtype)
  variables = model.init(jax.random.key(0), jnp.asarray(data[0][0]))
  tx = cbp.cbp(LR, **HPARAMS)
  params, centering = variables['params'], variables['centering']
  mesh = None
  if layout is not None:
    mesh = make_mesh(layout)
    params = jax.device_put(params, layout.rule(mesh, params))
    centering = jax.device_put(centering, layout.rule(mesh, centering))
  state = cbp_linen.TrainState.create(
      apply_fn=model.apply, params=params, centering=centering, tx=tx)
  if mesh is not None:
    # Derive the moments' sharding from the parameters' (M1's energies and
    # the counters replicated), and initialize the state directly there.
    state = state.replace(opt_state=jax.jit(
        tx.init, out_shardings=sharding.optimizer_sharding(tx, params)
    )(params))
  step = cbp_linen.train_step(
      lambda apply, x, y: cross_entropy(apply(x), y), mean_decay=DECAY)
  return state, step, data, mesh


def run_linen(dtype, layout: Optional[Layout]) -> Run:
  state, step, data, mesh = linen_setup(dtype, layout)
  placed = jax.tree.map(lambda x: x.sharding, (
      state.params, state.opt_state, state.centering))
  losses = []
  for x, y in data:
    if mesh is not None:
      x, y = sharding.shard_batch((x, y), mesh, 'data')
    state, out = step(state, x, y)
    assert not bool(out.skipped)
    losses.append(float(out.loss))
  return Run(state.params, state.opt_state, state.centering, losses, placed,
             find_energy(state.opt_state))


def _place_nnx(model, optimizer, tx, mesh, rule):
  model_state = nnx.state(model)
  nnx.update(model, jax.device_put(model_state, rule(mesh, model_state)))
  opt_sharding = sharding.optimizer_sharding(
      tx, nnx.state(model, nnx.Param))
  # `nnx.Optimizer` wraps each leaf of `tx.init(...)` in a Variable, leaf for
  # leaf, so the derived shardings pair with its leaves in order.
  variables = jax.tree.leaves(
      optimizer.opt_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  shardings = jax.tree.leaves(opt_sharding)
  assert len(variables) == len(shardings)
  for variable, target in zip(variables, shardings):
    variable[...] = jax.device_put(variable[...], target)


def run_nnx(dtype, layout: Optional[Layout]) -> Run:
  model = NnxConvNet(nnx.Rngs(0), dtype)
  tx = cbp.cbp(LR, **HPARAMS)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  mesh = None
  if layout is not None:
    mesh = make_mesh(layout)
    _place_nnx(model, optimizer, tx, mesh, layout.rule)
  placed = jax.tree.map(lambda x: x.sharding, nnx.as_pure(
      (nnx.state(model, nnx.Param), nnx.state(optimizer.opt_state),
       nnx.state(model, nnx.BatchStat))))
  step = cbp_nnx.train_step(
      lambda m, x, y: cross_entropy(m(x), y), mean_decay=DECAY)
  losses = []
  for x, y in batches('conv', dtype):
    if mesh is not None:
      x, y = sharding.shard_batch((x, y), mesh, 'data')
    out = step(model, optimizer, x, y)
    assert not bool(out.skipped)
    losses.append(float(out.loss))
  return Run(
      nnx.as_pure(nnx.state(model, nnx.Param)),
      nnx.as_pure(nnx.state(optimizer.opt_state)),
      nnx.as_pure(nnx.state(model, nnx.BatchStat)), losses, placed,
      find_energy(optimizer.opt_state))


RUNNERS = {'linen_mlp': run_linen, 'nnx_convnet': run_nnx}


def relative_differences(actual: Any, expected: Any) -> tuple[float, float]:
  """Worst leaf of ``||a - e|| / ||e||`` and of ``max|a - e| / max|e||``.

  Integer leaves (step counters) must be equal.
  """
  chex.assert_trees_all_equal_structs(actual, expected)
  normwise = elementwise = 0.0
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    a, e = np.asarray(a), np.asarray(e)
    if not np.issubdtype(e.dtype, np.floating):
      np.testing.assert_array_equal(a, e)
      continue
    tiny = np.finfo(e.dtype).tiny
    normwise = max(normwise, float(
        np.linalg.norm((a - e).ravel()) / max(np.linalg.norm(e.ravel()), tiny)))
    elementwise = max(elementwise, float(
        np.max(np.abs(a - e)) / max(np.max(np.abs(e)), tiny)))
  return normwise, elementwise


_reference_cache: dict[tuple[str, Any], Run] = {}


def single_device_run(model: str, dtype) -> Run:
  """The unsharded run on the default device (computed once per case)."""
  key = (model, dtype)
  if key not in _reference_cache:
    _reference_cache[key] = RUNNERS[model](dtype, None)
  return _reference_cache[key]


def check_shardings_kept(run: Run, layout: str) -> None:
  """The step returns every array with the sharding it was given."""
  final = (run.params, run.opt_state, run.means)
  for path_and_after, before in zip(
      jax.tree_util.tree_flatten_with_path(final)[0],
      jax.tree.leaves(run.placed)):
    path, after = path_and_after
    assert after.sharding.is_equivalent_to(before, after.ndim), (
        jax.tree_util.keystr(path), after.sharding, before)
  # M1's state is one energy per block: small and replicated, whatever the
  # parameters' layout (one block per centered layer, each of which holds a
  # mean, a recorded mean and the count of positions recorded).
  layers = [path for path, _ in jax.tree_util.tree_flatten_with_path(
      run.means)[0] if 'batch_count' in jax.tree_util.keystr(path)]
  assert run.energy.shape == (len(layers),)
  assert run.energy.sharding.is_fully_replicated
  if layout == 'fsdp8':
    # FSDP really sharded the kernels and both of their moments.
    sharded = [x for x in jax.tree.leaves((run.params, run.opt_state))
               if x.ndim >= 2 and not x.sharding.is_fully_replicated]
    assert len(sharded) == 3 * 3, len(sharded)
  if layout == 'data4_model2':
    # Tensor parallel: two kernels, a bias and a layer's means over 'model'.
    over_model = [x for x in jax.tree.leaves((run.params, run.means))
                  if 'model' in tuple(x.sharding.spec)]
    assert len(over_model) >= 5, len(over_model)


# Equality with one device -----------------------------------------------------


@needs_mesh
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.float64],
                         ids=['f32', 'f64'])
@pytest.mark.parametrize('layout', list(LAYOUTS))
@pytest.mark.parametrize('model', list(RUNNERS))
def test_sharded_run_equals_single_device(model, layout, dtype):
  with jax.enable_x64(dtype == jnp.float64):
    expected = single_device_run(model, dtype)
    actual = RUNNERS[model](dtype, LAYOUTS[layout])
    check_shardings_kept(actual, layout)
    differences = {
        'params': relative_differences(actual.params, expected.params),
        'opt_state': relative_differences(
            actual.opt_state, expected.opt_state),
        'means': relative_differences(actual.means, expected.means),
        'loss': relative_differences(
            np.asarray(actual.losses), np.asarray(expected.losses)),
    }
  print(f'\n{model} {layout} {np.dtype(dtype).name} (normwise, elementwise): '
        + ' '.join(f'{k}=({n:.1e}, {e:.1e})'
                   for k, (n, e) in differences.items()))
  for part, (normwise, elementwise) in differences.items():
    if dtype == jnp.float64:
      # Exact up to rounding: any algorithmic difference (per-device means,
      # per-shard block energies) would show at 1e-3 and above.
      assert elementwise <= 1e-12, (part, differences)
    else:
      # Float32 sums over the batch (means, gradients, block energies) are
      # reordered by the sharding: ~1e-7 per step, accumulated over 10 steps.
      assert normwise <= 1e-6, (part, differences)
      assert elementwise <= 1e-5, (part, differences)
  # The run did real work: the means left zero and the loss moved.
  assert max(float(np.max(np.abs(m))) for m in jax.tree.leaves(
      expected.means)) > 0.1
  assert expected.losses[-1] != expected.losses[0]


# The compiled FSDP step -------------------------------------------------------

_ALL_GATHER = re.compile(r'=\s*(.*?)\s+all-gather(?:-start)?\(')
_SHAPE = re.compile(r'\b[a-z]+\d*\[([\d,]*)\]')


def all_gathered_shapes(hlo: str) -> collections.Counter:
  """Result shapes of every all-gather in compiled HLO text."""
  shapes = collections.Counter()
  for result_type in _ALL_GATHER.findall(hlo):
    for dims in _SHAPE.findall(result_type):
      shapes[tuple(int(d) for d in dims.split(',') if d)] += 1
  return shapes


def sharded_matrix_shapes(tree: Any) -> set[tuple[int, ...]]:
  """Full shapes of the sharded kernels (the arrays FSDP must not gather)."""
  return {tuple(x.shape) for x in jax.tree.leaves(tree)
          if x.ndim >= 2 and not x.sharding.is_fully_replicated}


@needs_mesh
def test_fsdp_step_gathers_parameters_only_for_forward_and_backward():
  layout = LAYOUTS['fsdp8']
  state, step, data, mesh = linen_setup(jnp.float32, layout)
  x, y = sharding.shard_batch(data[0], mesh, 'data')
  step_hlo = step.lower(state, x, y).compile().as_text()
  kernels = sharded_matrix_shapes(state.params)
  assert len(kernels) == 3

  # 1. The update alone (M1, M3, the parameter update and the bias
  # transport), on gradients sharded like the parameters: no kernel or
  # moment is gathered. The only gathers allowed are the centering-mean
  # shifts (one vector of input features per layer), which the transport
  # contracts with each device's columns of the kernel.
  param_sharding = jax.tree.map(lambda p: p.sharding, state.params)

  def update(params, opt_state, centering, grads):
    updates, opt_state = state.tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    params, centering = cbp_linen.transport(params, centering, DECAY)
    return params, opt_state, centering

  shardings = jax.tree.map(lambda a: a.sharding, (
      state.params, state.opt_state, state.centering))
  update_hlo = jax.jit(
      update, in_shardings=(*shardings, param_sharding),
      out_shardings=shardings,
  ).lower(state.params, state.opt_state, state.centering,
          state.params).compile().as_text()
  in_update = all_gathered_shapes(update_hlo)
  mean_sizes = sum(m['mean'].value.size for m in state.centering.values())
  print(f'\nall-gathers in the update alone: {dict(in_update)}')
  assert not kernels & set(in_update), in_update
  assert all(len(s) <= 1 for s in in_update), in_update
  assert sum(int(np.prod(s)) * n for s, n in in_update.items()) <= mean_sizes

  # 2. The fused step gathers a kernel no more often than the same
  # forward/backward alone does (gradients reduce-scattered back to the
  # parameters' sharding): the optimizer side adds no gather of its own.
  def loss_and_grad(params, centering, x, y):
    def loss(params):
      logits, _ = state.apply_fn(
          {'params': params, 'centering': centering}, x,
          mutable=['centering'])
      return cross_entropy(logits, y)
    return jax.value_and_grad(loss)(params)

  forward_backward_hlo = jax.jit(
      loss_and_grad, out_shardings=(NamedSharding(mesh, P()), param_sharding)
  ).lower(state.params, state.centering, x, y).compile().as_text()
  in_step = all_gathered_shapes(step_hlo)
  in_forward_backward = all_gathered_shapes(forward_backward_hlo)
  print(f'all-gathers, fused step: {dict(in_step)}; forward/backward alone: '
        f'{dict(in_forward_backward)}')
  for shape in kernels:
    assert in_step[shape] <= in_forward_backward[shape], (
        shape, in_step, in_forward_backward)
  # Whatever else the step gathers is no larger than an input-feature vector
  # (the mean shifts) or already gathered by the forward/backward.
  extra = in_step - in_forward_backward
  assert all(len(s) <= 1 for s in extra), extra


# Refusals ---------------------------------------------------------------------


@needs_mesh
def test_batch_not_divisible_by_data_axis_is_refused():
  mesh = make_mesh(LAYOUTS['data4_model2'])
  x, y = batches('mlp', np.float32, batch=10, steps=1)[0]
  with pytest.raises(ValueError, match='divisible|divide'):
    sharding.shard_batch((x, y), mesh, 'data')
  # The divisible case passes and really splits the batch.
  x, y = sharding.shard_batch((x[:8], y[:8]), mesh, 'data')
  assert x.sharding.spec == P('data')
  assert {s.data.shape[0] for s in x.addressable_shards} == {2}


@needs_mesh
def test_process_rows_in_one_process_are_the_whole_batch():
  mesh = make_mesh(LAYOUTS['data4_model2'])
  assert sharding.process_rows(16, mesh) == slice(0, 16)
  x = np.arange(32.0).reshape(16, 2)
  (placed,) = sharding.shard_process_batch((x,), 16, mesh)
  assert placed.sharding.spec == P('data')
  np.testing.assert_array_equal(np.asarray(placed), x)


# Helpers on one device (no mesh subprocess needed) ----------------------------


def test_optimizer_sharding_follows_params_and_replicates_block_state():
  params, param_sharding = sharding_helpers._params(sharding_helpers._mesh())
  tx = cbp.cbp(1e-3, weight_decay=1e-4)
  derived = sharding.optimizer_sharding(tx, params)
  chex.assert_trees_all_equal_structs(derived, jax.eval_shape(tx.init, params))
  equalize_state, precondition_state = derived[0], derived[1]
  assert equalize_state.energy.spec == P()
  assert equalize_state.count.spec == P()
  assert precondition_state.mu == param_sharding
  assert precondition_state.nu == param_sharding
  state = jax.jit(tx.init, out_shardings=derived)(params)
  assert state[1].mu['a']['kernel'].sharding.spec == P(None, 'data')


def test_fsdp_rule_shards_largest_divisible_dimension():
  mesh = jax.make_mesh((1,), ('data',), axis_types=(AxisType.Auto,))
  # A one-device mesh divides everything; the rule's choice is what counts.
  shapes = {'kernel': jax.ShapeDtypeStruct((16, 64), jnp.float32),
            'bias': jax.ShapeDtypeStruct((64,), jnp.float32),
            'scalar': jax.ShapeDtypeStruct((), jnp.float32)}
  specs = jax.tree.map(lambda s: s.spec,
                       sharding.fsdp_sharding(shapes, mesh, 'data'))
  assert specs == {'kernel': P(None, 'data'), 'bias': P('data'),
                   'scalar': P()}
  specs = jax.tree.map(
      lambda s: s.spec,
      sharding.fsdp_sharding(shapes, mesh, 'data', min_size=100))
  assert specs == {'kernel': P(None, 'data'), 'bias': P(), 'scalar': P()}


@needs_mesh
def test_orbax_restores_onto_the_shardings_of_the_target(tmp_path):
  # docs/checkpointing.md: a one-device counter and a sharded array, saved,
  # come back with the shardings the abstract target gives them.
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  mesh = jax.make_mesh((DEVICES,), ('data',), axis_types=(AxisType.Auto,))
  replicated = NamedSharding(mesh, P())
  state = {
      'params': jax.device_put(jnp.ones((DEVICES, 4)),
                               NamedSharding(mesh, P('data'))),
      'step': jnp.zeros((), jnp.int32),  # one device, as nnx.Optimizer makes it
  }
  target = {
      'params': jax.ShapeDtypeStruct((DEVICES, 4), jnp.float32,
                                     sharding=NamedSharding(mesh, P('data'))),
      'step': jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
  }
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / 'ckpt', state)
  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(tmp_path / 'ckpt', target)
  assert restored['step'].sharding.is_equivalent_to(replicated, 0)
  assert restored['params'].sharding.is_equivalent_to(
      state['params'].sharding, 2)
  total = jax.jit(lambda s: s['params'].sum() + s['step'])(restored)
  assert float(total) == DEVICES * 4


@needs_mesh
def test_nnx_step_follows_state_moved_between_calls():
  # A step compiled for one placement must not be reused for another: a
  # hand-kept executable cache keyed on shapes alone refused the move.
  def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)

  def place(model, optimizer, where):
    nnx.update(model, jax.device_put(nnx.state(model), where))
    nnx.update(optimizer, jax.device_put(nnx.state(optimizer), where))

  mesh = jax.make_mesh((DEVICES,), ('data',), axis_types=(AxisType.Auto,))
  model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.relu,
                         nnx.Linear(8, 1, rngs=nnx.Rngs(1)))
  cbp_nnx.center(model)
  optimizer = cbp_nnx.Optimizer(model, cbp.cbp(LR))
  step = cbp_nnx.train_step(loss_fn)
  x, y = jnp.ones((DEVICES, 4)), jnp.zeros((DEVICES, 1))
  step(model, optimizer, x, y)
  place(model, optimizer, NamedSharding(mesh, P()))
  batch = NamedSharding(mesh, P('data'))
  out = step(model, optimizer, jax.device_put(x, batch),
             jax.device_put(y, batch))
  assert out.loss.sharding.is_equivalent_to(NamedSharding(mesh, P()), 0)
  for leaf in jax.tree.leaves(nnx.state((model, optimizer))):
    assert len(leaf.devices()) == DEVICES
  place(model, optimizer, jax.devices()[1])
  out = step(model, optimizer, jax.device_put(x, jax.devices()[1]),
             jax.device_put(y, jax.devices()[1]))
  assert out.loss.devices() == {jax.devices()[1]}
  assert int(optimizer.step[...]) == 3
