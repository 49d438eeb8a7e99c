"""The workload suite: splits, target rule, arms, resume, profiles, offline builds."""

import json
import math
import pathlib
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import flax.linen as nn
from flax import nnx
import optax
import pytest

import cbp_optax as cbp
from cbp_optax_experiments.reproduce import training
from cbp_optax_experiments.workloads import arms as arms_lib
from cbp_optax_experiments.workloads import cli
from cbp_optax_experiments.workloads import definitions
from cbp_optax_experiments.workloads import protocol
from cbp_optax_experiments.workloads import report
from cbp_optax_experiments.workloads import scoring
from cbp_optax_experiments.workloads import splits
from cbp_optax_experiments.workloads import tasks

# ---------------------------------------------------------------------------
# Splits


def test_every_workload_is_in_exactly_one_split():
  dev, test = set(splits.SPLITS[splits.DEV]), set(splits.SPLITS[splits.TEST])
  assert not dev & test, f'in both splits: {sorted(dev & test)}'
  assert dev | test == set(definitions.NAMES)
  assert set(splits.SPLITS) == {splits.DEV, splits.TEST}
  for name in definitions.NAMES:
    assert splits.split_of(name) in (splits.DEV, splits.TEST)
  with pytest.raises(ValueError, match='0 splits'):
    splits.split_of('no-such-workload')


def test_split_of_refuses_a_workload_in_both(monkeypatch):
  both = {splits.DEV: ('spiral',), splits.TEST: ('spiral',)}
  monkeypatch.setattr(splits, 'SPLITS', both)
  with pytest.raises(ValueError, match='2 splits'):
    splits.split_of('spiral')


def test_cli_refuses_a_workload_outside_its_split(tmp_path, capsys):
  # A bad argument: exit status 2 and one error line, before training.
  with pytest.raises(SystemExit) as info:
    cli.main(['--quick', '--split', 'test', '--workloads', 'spiral',
              '--out', str(tmp_path), '--no-progress'])
  assert info.value.code == 2
  assert ("error: --workloads 'spiral': 'spiral' (dev split) not in the "
          'test split') in capsys.readouterr().err
  assert not list(tmp_path.iterdir())


def test_suite_size_families_and_split_balance():
  assert len(definitions.NAMES) >= 16
  families = {definitions.REGISTRY[n].family for n in definitions.NAMES}
  assert len(families) >= 8 and families <= set(splits.FAMILIES)
  for split in (splits.DEV, splits.TEST):
    names = splits.workloads(split)
    assert len({definitions.REGISTRY[n].family for n in names}) >= 3, split
  sizes = [len(splits.SPLITS[s]) for s in (splits.DEV, splits.TEST)]
  assert abs(sizes[0] - sizes[1]) <= 2, sizes
  with pytest.raises(ValueError, match='unknown split'):
    splits.workloads('train')


def test_the_original_seven_are_dev():
  assert len(definitions.ORIGINAL) == 7
  assert set(definitions.ORIGINAL) <= set(splits.SPLITS[splits.DEV])


def _parameter_count(name):
  task = definitions.workload(name, quick=False).build(False)
  shapes = jax.eval_shape(task.init, jax.random.key(0))[0]
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))


def test_split_follows_the_written_rule():
  # splits' docstring: new workloads of an original family -> test; a new
  # family with one workload -> test; with two, the smaller model -> dev.
  original_families = {definitions.REGISTRY[n].family
                       for n in definitions.ORIGINAL}
  new = [n for n in definitions.NAMES if n not in definitions.ORIGINAL]
  by_family = {}
  for name in new:
    by_family.setdefault(definitions.REGISTRY[name].family, []).append(name)
  for family, names in by_family.items():
    if family in original_families or len(names) == 1:
      assert all(splits.split_of(n) == splits.TEST for n in names), family
    else:
      assert len(names) == 2, family
      small, large = sorted(names, key=_parameter_count)
      assert splits.split_of(small) == splits.DEV, family
      assert splits.split_of(large) == splits.TEST, family


def test_every_choice_was_made_on_dev():
  dev = set(splits.SPLITS[splits.DEV])
  assert splits.CHOSEN_ON
  for choice in splits.CHOSEN_ON:
    assert choice.split == splits.DEV, choice.what
    assert set(choice.workloads) <= dev, choice.what
    assert choice.run, choice.what


def test_registry_has_one_line_per_workload_and_arm():
  for name, entry in definitions.REGISTRY.items():
    assert entry.summary and '\n' not in entry.summary, name
    assert definitions.FACTORIES[name] is entry.factory
  for name, arm in arms_lib.builtin_arms().items():
    assert arm.description and '\n' not in arm.description, name


# ---------------------------------------------------------------------------
# Target rule


def test_target_is_the_best_median_over_the_baselines():
  best = {'adamw': [0.90, 0.95, 0.93], 'nadamw': [0.96, 0.94, 0.80],
          'sgd_nesterov': [0.70, 0.99, None]}
  # Medians: adamw 0.93, nadamw 0.94, sgd 0.70 (None is the worst).
  assert scoring.target(best, higher=True) == (0.94, 'nadamw')
  lower = {'adamw': [3.52, 3.48, 3.43], 'nadamw': [3.41, 3.40, 3.36]}
  assert scoring.target(lower, higher=False) == (3.4, 'nadamw')
  # Even count: the worse of the two middle values; rounding to the easy side.
  assert scoring.median_best([0.5, 0.9, 0.7, 0.6], True) == 0.6
  assert scoring.round_target(0.9567, True) == 0.956
  assert scoring.round_target(3.4011, False) == 3.402
  value, setter = scoring.target({'adamw': [None, None]}, True)
  assert value == -math.inf and setter is None


def test_every_workload_races_to_its_fixed_target():
  # The fixed targets were once ignored by every workload outside the
  # original seven, so each run set those from its own baselines (and tuned
  # against them): two runs raced to different numbers.
  assert set(definitions.TARGETS) == set(definitions.NAMES)
  for name in definitions.NAMES:
    assert definitions.workload(name, quick=False).target == (
        definitions.TARGETS[name]), name
    assert definitions.workload(name, quick=True).target is None, name


def _entry(arms, higher=True):
  return {'higher_is_better': higher, 'arms': {
      name: {'best_metric': best, 'diverged': bad}
      for name, (best, bad) in arms.items()}}


def test_baseline_target_ignores_other_arms_and_diverged_seeds():
  entry = _entry({
      'adamw': ([0.90, 0.92, 0.91], [False] * 3),
      # Reached 0.99 before diverging on every seed: not a target.
      'sgd_nesterov': ([0.99, 0.99, 0.99], [True] * 3),
      'muon': ([0.99, 0.99, 0.99], [False] * 3),  # not a baseline
  })
  value, source, setter = report.baseline_target(entry)
  assert (value, setter) == (0.91, 'adamw')
  assert 'nadamw not run' in source
  report.set_baseline_target(entry)
  assert entry['target'] == 0.91 and entry['target_setter'] == 'adamw'
  assert report.baseline_target(_entry({'muon': ([0.9], [False])}))[0] is None


# ---------------------------------------------------------------------------
# Arms


def test_arm_names_are_stable_and_ordered():
  names = list(arms_lib.builtin_arms())
  assert names[:3] == list(arms_lib.BASELINES)
  expected = {'adamw', 'nadamw', 'sgd_nesterov', 'muon',
              'schedule_free_adamw', 'cbp_kron', 'psgd_kron', 'cbp',
              'cbp_robust'} | {f'{p}_centered' for p in arms_lib.PEERS}
  assert set(names) == expected | {
      a.name for a in arms_lib.CANDIDATES}
  arms = arms_lib.builtin_arms()
  for peer in arms_lib.PEERS:
    plain, centered = arms[peer], arms[f'{peer}_centered']
    assert not plain.centered and centered.centered
    assert centered.make is plain.make
    assert centered.eval_params is plain.eval_params
  assert arms['sgd_nesterov'].grid_scale == arms_lib.SGD_GRID_SCALE
  workload = definitions.workload('spiral', quick=True)
  chex.assert_trees_all_close(arms['sgd_nesterov'].grid(workload),
                              [30 * g for g in workload.grid])
  assert arms['muon'].grid(workload) == list(workload.grid)


@pytest.mark.parametrize('name,reference', [
    ('sgd_nesterov', lambda s: optax.sgd(s, momentum=0.9, nesterov=True)),
])
def test_new_peer_arms_are_the_optax_optimizers(name, reference):
  # With zero kernels the decoupled decay adds nothing: the arm's updates
  # are the optax optimizer's on the same schedule.
  ctx = arms_lib.Context(steps=20)
  params = {'dense': {'kernel': jnp.zeros((3, 2)), 'bias': jnp.zeros(2)}}
  ours = arms_lib.builtin_arms()[name].make(0.1, ctx)
  theirs = reference(ctx.schedule(0.1))
  s1, s2 = ours.init(params), theirs.init(params)
  for i in range(4):
    grads = jax.tree.map(lambda x: jnp.full_like(x, 0.5 + i), params)
    u1, s1 = ours.update(grads, s1, params)
    u2, s2 = theirs.update(grads, s2, params)
    chex.assert_trees_all_close(u1, u2, rtol=1e-6)


def test_psgd_kron_arm_steps_an_nnx_model_as_an_optax_loop():
  # nnx.Optimizer turns psgd-jax's state lists into nnx.State mappings after
  # an update: psgd-jax iterated them as lists (AttributeError at the second
  # NNX update) and a scanned training loop's carry changed structure.
  pytest.importorskip('psgd_jax')
  ctx = arms_lib.Context(steps=20)
  tx = arms_lib.builtin_arms()['psgd_kron'].make(0.1, ctx)
  model = nnx.Conv(1, 4, (3, 3), rngs=nnx.Rngs(0))
  # A copy: the step donates the model's buffers.
  params = jax.tree.map(jnp.copy, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  optimizer = cbp.nnx.Optimizer(model, tx)
  step = cbp.nnx.train_step(lambda m, x: jnp.mean(m(x) ** 2))
  structure = jax.tree.structure(nnx.state(optimizer))
  state = tx.init(params)
  loss = lambda p, x: jnp.mean(nnx.merge(nnx.graphdef(model), p)(x) ** 2)
  for i in range(3):
    x = jnp.full((2, 5, 5, 1), 1.0 + i)
    assert not bool(step(model, optimizer, x).skipped)
    assert jax.tree.structure(nnx.state(optimizer)) == structure
    updates, state = tx.update(jax.grad(loss)(params, x), state, params)
    params = optax.apply_updates(params, updates)
  chex.assert_trees_all_close(nnx.to_pure_dict(nnx.state(model, nnx.Param)),
                              params, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# Step cost over a time window


class _FakeClock:
  """``time.perf_counter`` advancing one second per call."""

  def __init__(self):
    self.now = 0.0

  def __call__(self):
    self.now += 1.0
    return self.now


def _fake_runner(log, name, chunks=3):
  workload = types.SimpleNamespace(steps=2 * chunks, eval_every=2)

  def init(seed, lr):
    log.append((name, 'init'))
    return jnp.zeros(())

  def chunk(carry, c, seed, lr):
    log.append((name, int(c)))
    return carry + 1, None
  return protocol.Runner(init, chunk, lambda carry: carry, workload)


def test_step_cost_runs_each_arm_for_the_window_alternating(monkeypatch):
  monkeypatch.setattr(protocol.time, 'perf_counter', _FakeClock())
  log = []
  runners = [_fake_runner(log, 'a'), _fake_runner(log, 'b')]
  costs = protocol.step_cost(runners, 1e-3, window=5.0, min_chunks=3)
  # Every timed chunk reads 1 s for 2 steps.
  assert costs == [0.5, 0.5]
  chunks = [entry for entry in log if entry[1] != 'init']
  # Alternating, one warm-up round, then 5 timed chunks each (5 s >= window).
  assert [n for n, _ in chunks] == ['a', 'b'] * 6
  # Each runner walks its real trajectory and restarts after the last chunk.
  assert [c for n, c in chunks if n == 'a'] == [0, 1, 2, 0, 1, 2]
  assert [e for e in log if e[0] == 'a'].count(('a', 'init')) == 2
  log.clear()
  protocol.step_cost(runners[:1], 1e-3, window=0.5, min_chunks=3)
  assert len([e for e in log if e[1] != 'init']) == 1 + 3  # min_chunks


# ---------------------------------------------------------------------------
# Record store and resume


def _record(seed=0, lr=1e-3):
  """A diverged run of spiral's --quick size (40 steps, 4 evaluations)."""
  return protocol.RunRecord(seed, lr, np.array([1.0, np.nan] + [0.5] * 38),
                            np.array([0.25, np.inf, 0.5, 0.5]), True, 0.125)


def test_record_store_round_trips_and_rejects_stale_or_corrupt(tmp_path,
                                                              monkeypatch):
  workload = definitions.workload('spiral', quick=True)
  arm = arms_lib.builtin_arms()['adamw']
  store = protocol.RecordStore(tmp_path, {'quick': True})
  identity = store.identity(workload, arm)
  assert store.load_run(identity, 1e-3, 0) is None
  store.save_run(identity, _record())
  loaded = store.load_run(identity, 1e-3, 0)
  np.testing.assert_array_equal(loaded.losses, _record().losses)
  np.testing.assert_array_equal(loaded.metrics, _record().metrics)
  assert (loaded.diverged, loaded.initial_metric) == (True, 0.125)
  # Another data source, or another definition of the arm: not reused.
  other = protocol.RecordStore(tmp_path, {'quick': False})
  assert other.load_run(other.identity(workload, arm), 1e-3, 0) is None
  changed = arms_lib.Arm('adamw', arm.make, description='changed')
  assert store.load_run(store.identity(workload, changed), 1e-3, 0) is None
  # Changed code (a default of the library, say): not reused either.
  with monkeypatch.context() as patch:
    patch.setattr(protocol, 'code_fingerprint', lambda: 'other code')
    assert store.load_run(store.identity(workload, arm), 1e-3, 0) is None
  assert store.load_run(store.identity(workload, arm), 1e-3, 0) is not None
  # A truncated file (a crash of a non-atomic writer) is recomputed.
  path = next(tmp_path.rglob('run_*.json'))
  path.write_text(path.read_text()[:20])
  assert store.load_run(identity, 1e-3, 0) is None
  assert not list(tmp_path.rglob('.*'))  # no temporary files left


def _damaged(value):
  """Edits of a stored record: what a user, a disk or another run can leave
  there."""
  def damage(stored):
    if value == 'not an object':
      return [1, 2]
    if value == 'no value':
      return {'identity': stored['identity']}
    stored['value'] = value(stored['value'])
    return stored
  return damage


@pytest.mark.parametrize('damage', [
    'not an object', 'no value',
    lambda v: [v],                                         # not a record
    lambda v: {k: x for k, x in v.items() if k != 'losses'},
    lambda v: {**v, 'metrics': ['high', 'low']},
    lambda v: {**v, 'diverged': 'no'},
    lambda v: {**v, 'metrics': v['metrics'][:1]},          # a shorter run
    lambda v: {**v, 'seed': 7},                            # another run's
], ids=['list', 'no_value', 'value_list', 'no_losses', 'text_metrics',
        'text_diverged', 'short_metrics', 'other_seed'])
def test_a_damaged_run_record_is_computed_again(tmp_path, damage):
  workload = definitions.workload('spiral', quick=True)
  store = protocol.RecordStore(tmp_path, {'quick': True})
  identity = store.identity(workload, arms_lib.builtin_arms()['adamw'])
  chunks = workload.steps // workload.eval_every
  record = protocol.RunRecord(0, 1e-3, np.ones(workload.steps),
                              np.linspace(0.1, 0.9, chunks), False, 0.1)
  store.save_run(identity, record)
  assert store.load_run(identity, 1e-3, 0) is not None
  (path,) = tmp_path.rglob('run_*.json')
  path.write_text(json.dumps(_damaged(damage)(json.loads(path.read_text()))))
  assert store.load_run(identity, 1e-3, 0) is None
  store.save_run(identity, record)  # computed again, and replaced
  np.testing.assert_array_equal(store.load_run(identity, 1e-3, 0).metrics,
                                record.metrics)


@pytest.mark.parametrize('cost', [
    None, [1.0], {'own': 1.0}, {'own': 'fast', 'reference': 1.0},
    {'own': float('nan'), 'reference': 1.0}, {'own': 1.0, 'reference': 0.0}])
def test_a_damaged_cost_record_is_measured_again(tmp_path, cost):
  workload = definitions.workload('spiral', quick=True)
  store = protocol.RecordStore(tmp_path, {'quick': True})
  identity = store.identity(workload, arms_lib.builtin_arms()['muon'])
  store.save_cost(identity, 1e-3, {'own': 2e-3, 'reference': 1e-3})
  assert store.load_cost(identity, 1e-3) == {'own': 2e-3, 'reference': 1e-3}
  (path,) = tmp_path.rglob('cost_*.json')
  path.write_text(json.dumps({'identity': identity, 'value': cost}))
  assert store.load_cost(identity, 1e-3) is None


def test_atomic_write_keeps_the_old_file_when_interrupted(tmp_path,
                                                          monkeypatch):
  path = tmp_path / 'a' / 'record.json'
  protocol.write_atomically(path, 'old')

  def fail(*args):
    raise KeyboardInterrupt
  monkeypatch.setattr(protocol.os, 'replace', fail)
  with pytest.raises(KeyboardInterrupt):
    protocol.write_atomically(path, 'new')
  assert path.read_text() == 'old'
  assert [p.name for p in path.parent.iterdir()] == ['record.json']


class _Interrupt(BaseException):
  """Stands for Ctrl-C / a killed process (not caught as a failing arm)."""


_ARGS = ['--quick', '--workloads', 'spiral', '--arms', 'adamw', '--seeds',
         '2', '--no-progress']
# Timings: measured again on every run.
_TIMED = ('cost_vs_adamw', 'ms_per_step', 'adamw_ms_per_step_same_process',
          'wall_seconds')


def _comparable(results):
  results = json.loads(json.dumps(results))
  for entry in results['workloads'].values():
    for arm in entry['arms'].values():
      for key in _TIMED:
        arm.pop(key)
  return {'workloads': results['workloads'],
          'steps': results['profiles'][report.STEPS],
          'final': results['profiles'][report.FINAL]}


def test_an_interrupted_run_resumes_to_the_uninterrupted_result(
    tmp_path, monkeypatch):
  whole = tmp_path / 'whole'
  cli.main(_ARGS + ['--out', str(whole)])
  expected = _comparable(report.load(whole))

  resumed = tmp_path / 'resumed'
  original = protocol.Runner.run_many
  calls = []

  def interrupted(self, seeds, lrs, width=None):
    if calls:  # after the tuning grid's batch: inside the edge extension
      raise _Interrupt
    calls.extend(zip(seeds, lrs))
    return original(self, seeds, lrs, width)
  monkeypatch.setattr(protocol.Runner, 'run_many', interrupted)
  with pytest.raises(_Interrupt):
    cli.main(_ARGS + ['--out', str(resumed)])
  stored = list((resumed / 'runs').rglob('run_*.json'))
  grid = len(definitions.workload('spiral', quick=True).grid)
  assert len(stored) == len(calls) == grid

  # Started again: the grid's stored runs are loaded, only the rest computed.
  calls.clear()
  monkeypatch.setattr(protocol.Runner, 'run_many',
                      lambda self, seeds, lrs, width=None: (
                          calls.extend(zip(seeds, lrs)),
                          original(self, seeds, lrs, width))[1])
  cli.main(_ARGS + ['--out', str(resumed)])
  total = len(list((resumed / 'runs').rglob('run_*.json')))
  assert len(calls) == total - grid > 0
  assert _comparable(report.load(resumed)) == expected


# ---------------------------------------------------------------------------
# Profiles


def _arm(steps, cost, finals, initial=0.1, diverged=None):
  n = len(steps)
  return {'steps_to_target': steps, 'cost_vs_adamw': cost,
          'final_metric': finals, 'diverged': diverged or [False] * n,
          'initial_metric': [initial] * n, 'best_metric': finals}


def test_three_profiles_steps_wall_clock_and_final_metric():
  results = {'workloads': {
      'w1': {'higher_is_better': True, 'target': 0.8, 'arms': {
          'adamw': _arm([100, 100, 200], 1.0, [0.8, 0.82, 0.81]),
          'muon': _arm([50, 50, 50], 4.0, [0.9, 0.9, 0.9]),
      }},
      'w2': {'higher_is_better': False, 'target': 2.0, 'arms': {
          'adamw': _arm([100, 100, 100], 1.0, [2.0, 2.0, 2.0], initial=6.0),
          'muon': _arm([None, None, 100], 4.0, [3.0, 3.0, 1.0], initial=6.0,
                       diverged=[True, False, False]),
      }},
  }, 'meta': {}}
  report.rescore(results)
  steps = results['profiles'][report.STEPS]['score']
  wall = results['profiles'][report.WALL_CLOCK]['score']
  final = results['profiles'][report.FINAL]['score']
  # Steps: muon 2x faster on w1, misses w2 (median of a diverged seed).
  assert steps['muon'] == pytest.approx(0.5)
  assert steps['adamw'] == pytest.approx((2 / 3 + 1) / 2)
  # Wall-clock: muon's 4x step cost makes it 2x slower on w1.
  assert wall['adamw'] == pytest.approx(1.0)
  assert wall['muon'] == pytest.approx((2 / 3) / 2)
  # Final: w1 normalized from 0.1 to muon's 0.9; w2 (lower is better) from
  # 6.0 to adamw's 2.0; muon's diverged seed counts as 6.0, median 3.0.
  assert results['workloads']['w1']['normalized_final'] == pytest.approx(
      {'adamw': (0.81 - 0.1) / 0.8, 'muon': 1.0})
  assert results['workloads']['w2']['normalized_final'] == pytest.approx(
      {'adamw': 1.0, 'muon': 3.0 / 4.0})
  assert final['muon'] == pytest.approx((1.0 + 0.75) / 2)
  # The headline is the any-time score; the single-target profile a view.
  assert results['headline'] == report.ANYTIME
  assert results['score'] == results['profiles'][report.ANYTIME]['score']


def test_resolution_reports_seed_std_and_target_gap():
  entry = {'higher_is_better': True, 'target': 0.7, 'target_setter':
           'nadamw', 'validation_size': 1000, 'arms': {
               'adamw': _arm([1, 1, 1], 1.0, [0.6, 0.7, 0.8]),
               'nadamw': _arm([1, 1, 1], 1.0, [0.69, 0.7, 0.71])}}
  res = report.resolution(entry)
  assert res['target_setter'] == 'nadamw'
  assert res['seed_std'] == pytest.approx(0.01)
  assert res['target_gap'] == pytest.approx(0.6)
  assert res['gap_in_std'] == pytest.approx(60.0)


# ---------------------------------------------------------------------------
# Every workload builds offline, from the bundled data


@pytest.fixture
def offline(monkeypatch, tmp_path):
  """No $CBP_OPTAX_MNIST and an empty cache: the bundled subset."""
  monkeypatch.delenv('CBP_OPTAX_MNIST', raising=False)
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path))
  caches = (tasks.mnist_data, definitions._resnet_data)  # pylint: disable=protected-access
  for cache in caches:
    cache.cache_clear()
  yield
  for cache in caches:
    cache.cache_clear()


@pytest.mark.parametrize('name', definitions.NAMES)
def test_every_workload_builds_offline_in_quick(offline, name):
  del offline
  workload = definitions.workload(name, quick=True)
  assert workload.family in splits.FAMILIES
  assert workload.steps % workload.eval_every == 0
  for centered in (False, True):
    task = workload.build(centered)
    key = jax.random.key(0)
    params, state = jax.eval_shape(task.init, key)
    grads_shape = jax.eval_shape(
        lambda p, s: jax.grad(task.loss, has_aux=True)(p, s, key, key),
        params, state)
    chex.assert_trees_all_equal_shapes_and_dtypes(grads_shape[0], params)
    metric = jax.eval_shape(task.evaluate, params, state)
    assert metric.shape == ()
    # The library's step, with a state that holds a parameter copy (z).
    tx = optax.contrib.schedule_free_adamw(1e-3)
    opt_state = jax.eval_shape(tx.init, params)
    carry, out = jax.eval_shape(task.step(tx), params, state, opt_state,
                                key, key)
    chex.assert_trees_all_equal_shapes_and_dtypes(carry,
                                                  (params, state, opt_state))
    assert out.loss.shape == () and out.skipped.dtype == jnp.bool_
  if name == 'resnet8':  # fell back to the bundled subset, no DataError
    assert 'bundled' in definitions._resnet_data(True).description  # pylint: disable=protected-access


@pytest.mark.slow
@pytest.mark.parametrize('name', definitions.NAMES)
def test_every_workload_trains_two_steps_offline(offline, name):
  del offline
  workload = definitions.workload(name, quick=True)
  import dataclasses  # pylint: disable=g-import-not-at-top
  tiny = dataclasses.replace(workload, steps=2, eval_every=1)
  for arm_name in ('adamw', 'cbp_robust'):
    arm = arms_lib.builtin_arms()[arm_name]
    runner = protocol.make_runner(tiny.build(arm.centers(tiny)), arm, tiny)
    losses, metrics, initial = runner.run(0, 1e-3)
    assert losses.shape == (2,) and metrics.shape == (2,)
    assert np.all(np.isfinite(losses)) and math.isfinite(initial), arm_name


def test_centered_models_start_from_the_plain_weights():
  # Every arm of a seed starts from the same initialization.
  # Both ways of centering a Linen model: cbp.linen.center (the
  # autoencoder) and the Centered wrapper with the plain model's weights.
  for name in ('mnist-autoencoder', 'coord-relu'):
    workload = definitions.workload(name, quick=True)
    plain = workload.build(False).init(jax.random.key(3))[0]
    centered = workload.build(True).init(jax.random.key(3))[0]
    chex.assert_trees_all_equal(jax.tree.leaves(plain),
                                jax.tree.leaves(centered))


def test_store_path_is_under_out(tmp_path):
  store = protocol.RecordStore(tmp_path / 'runs')
  workload = definitions.workload('spiral', quick=True)
  identity = store.identity(workload, arms_lib.builtin_arms()['adamw'])
  store.save_run(identity, _record())
  (path,) = (tmp_path / 'runs').rglob('run_*.json')
  assert pathlib.Path(tmp_path / 'runs' / 'spiral' / 'adamw') in path.parents


def _hand_written_step(task, tx, centered, data_key, dropout_key):
  """The suite's Linen loop before it went through ``cbp.linen.train_step``."""
  def step(carry, index):
    params, state, opt_state = carry
    batch_key, drop_key = protocol.step_keys(data_key, dropout_key, index)
    (loss, state), grads = jax.value_and_grad(task.loss, has_aux=True)(
        params, state, batch_key, drop_key)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    if centered:
      params, centering, opt_state = cbp.linen.transport(
          params, state['centering'], training.RHO, opt_state=opt_state)
      state = {**state, 'centering': centering}
    return (params, state, opt_state), loss
  return step


@pytest.mark.parametrize('arm', ['adamw', 'schedule_free_adamw_centered',
                                 'cbp_robust'])
def test_suite_step_is_the_hand_written_loop(offline, arm):
  """The suite trains through the library's fused step; on a Linen workload
  its numbers are the plain composition's (value_and_grad, update,
  transport) over a scanned chunk: bit for bit for a plain arm and for a
  rate fixed at trace time; with the rate traced, as the suite runs, XLA
  fuses a centered step's mean EMA into the fused step's select, one float32
  rounding apart from the second step (4.4e-7 of the loss after 40 steps,
  the largest in the quick suite)."""
  del offline
  workload = definitions.workload('digits-raw', quick=True)
  arm = arms_lib.builtin_arms()[arm]
  centered = arm.centers(workload)
  task = workload.build(centered)
  _, data_key, dropout_key = protocol.seed_keys(0)
  params, state = task.init(jax.random.key(0))

  def chunk(make_step, lr):
    tx = arm.make(lr, protocol.context(task, workload))
    return jax.lax.scan(make_step(tx), (params, state, tx.init(params)),
                        jnp.arange(6))

  def suite(lr):
    return chunk(lambda tx: protocol.make_step(task, tx, data_key,
                                               dropout_key), lr)

  def hand(lr):
    return chunk(lambda tx: _hand_written_step(task, tx, centered, data_key,
                                               dropout_key), lr)

  lr = jnp.float32(1e-2)
  chex.assert_trees_all_equal(jax.jit(lambda: suite(lr))(),
                              jax.jit(lambda: hand(lr))())
  traced = jax.jit(suite)(lr), jax.jit(hand)(lr)
  if centered:
    chex.assert_trees_all_close(*traced, rtol=1e-5, atol=1e-7)
  else:
    chex.assert_trees_all_equal(*traced)


def test_a_skipped_step_counts_the_run_as_diverged(offline):
  """The library step skips a batch whose loss or gradients are not finite
  (here after an infinite step); the suite records its loss as NaN, so the
  run is a miss, as when the non-finite update went through."""
  del offline
  workload = definitions.workload('digits-raw', quick=True)
  task = workload.build(True)
  tx = optax.sgd(jnp.float32(jnp.inf))
  _, data_key, dropout_key = protocol.seed_keys(0)
  params, state = task.init(jax.random.key(0))
  step = protocol.make_step(task, tx, data_key, dropout_key)
  _, losses = jax.jit(lambda c: jax.lax.scan(step, c, jnp.arange(3)))(
      (params, state, tx.init(params)))
  assert np.isfinite(losses[0]) and np.isnan(losses[1:]).all()
  assert protocol.diverged(np.asarray(losses), np.array([0.5]))


# ---------------------------------------------------------------------------
# Defaults: ten seeds, a quick subset, the vmapped path


def test_full_runs_default_to_ten_paired_seeds_and_quick_to_a_subset():
  args = cli.parse(['--split', 'dev'])
  assert args.workloads == cli.ALL and args.arms == cli.DEFAULT
  assert cli.DEFAULT_SEEDS >= 10
  quick = cli.parse(['--quick'])
  assert quick.workloads.split(',') == list(cli.QUICK_WORKLOADS)
  assert quick.arms.split(',') == list(cli.QUICK_ARMS)
  assert any(a in arms_lib.BASELINES for a in cli.QUICK_ARMS)
  assert all(a in arms_lib.builtin_arms() for a in cli.QUICK_ARMS)
  assert all(w in definitions.NAMES for w in cli.QUICK_WORKLOADS)
  # Given flags win; --split keeps its workloads.
  assert cli.parse(['--quick', '--workloads', 'spiral']).workloads == 'spiral'
  assert cli.parse(['--quick', '--split', 'dev']).workloads == cli.ALL
  assert cli.parse(['--quick', '--arm', 'x=m:f']).arms == cli.DEFAULT
  assert cli.parse([]).vmap == 'auto'


def test_the_vmapped_path_gives_the_looped_results(tmp_path):
  args = ['--quick', '--workloads', 'spiral', '--arms', 'adamw', '--seeds',
          '3', '--no-progress']
  assert cli.main(args + ['--vmap', 'on', '--out', str(tmp_path / 'v')]) == 0
  assert cli.main(args + ['--vmap', 'off', '--out', str(tmp_path / 'l')]) == 0
  on, off = (report.load(tmp_path / d) for d in ('v', 'l'))
  assert on['meta']['vmap'] is True and off['meta']['vmap'] is False
  a = on['workloads']['spiral']['arms']['adamw']
  b = off['workloads']['spiral']['arms']['adamw']
  assert a['learning_rate'] == b['learning_rate']
  np.testing.assert_allclose(a['curves'], b['curves'], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# Muon's matrix view of attention kernels: a stack is read from the model


def _axes(dims):
  as_tuple = lambda a: (a,) if isinstance(a, int) else tuple(a)  # noqa: E731
  return as_tuple(dims.reduction_axis), as_tuple(dims.output_axis)


class _AttentionBlock(nnx.Module):
  def __init__(self, width, heads, rngs):
    self.attn = nnx.MultiHeadAttention(heads, width, decode=False, rngs=rngs)
    self.up = nnx.Linear(width, width, rngs=rngs)

  def __call__(self, x):
    return self.up(x + self.attn(x, deterministic=True))


class _ListOfBlocks(nnx.Module):
  """Two attention blocks in a plain list named ``blocks`` (not a stack)."""

  def __init__(self, *, rngs):
    self.blocks = nnx.List([_AttentionBlock(8, 2, rngs) for _ in range(2)])
    self.head = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return self.head(x.mean(axis=1))


@pytest.mark.parametrize('centered', [False, True])
def test_workloads_attention_muon_dims_of_a_list_named_blocks(centered):
  # A list of blocks is no layer stack, whatever its name: each attention
  # kernel is a matrix over its own input and output axes.
  def loss_fn(model, index, rngs):
    del index, rngs
    return jnp.mean(model(jnp.ones((2, 4, 8))) ** 2)

  task = tasks.nnx_task(lambda rngs: _ListOfBlocks(rngs=rngs), centered,
                        loss_fn, lambda key: 0, lambda model: jnp.zeros(()),
                        muon_dims=tasks.attention_muon_dims)
  params, _ = task.init(jax.random.key(0))
  dims = task.muon_dims(params)
  layer = ('layer',) if centered else ()
  for i in (0, 1):
    attn = dims['blocks'][i]['attn']
    for name in ('query', 'key', 'value'):  # (in, heads, head_dim)
      got = attn[name]
      for key in layer + ('kernel',):
        got = got[key]
      assert _axes(got) == ((0,), (1, 2)), (name, got)
    out = attn['out']
    for key in layer + ('kernel',):
      out = out[key]
    assert _axes(out) == ((0, 1), (2,))  # (heads, head_dim, out)
    up = dims['blocks'][i]['up']
    for key in layer + ('kernel',):
      up = up[key]
    assert _axes(up) == ((0,), (1,))
  # Muon takes them: every attention kernel is orthogonalized as a matrix.
  tx = optax.contrib.muon(1e-3, muon_weight_dimension_numbers=task.muon_dims)
  tx.init(params)



class _LinenScanned(nn.Module):
  """Three scanned bias-less (3, 3) layers, then multi-output attention-like
  projections: (3, 3, 3) and (3, 2, 2) kernels, neither a matrix over its
  last axis."""

  @nn.compact
  def __call__(self, x):
    def body(module, h, _):
      return nn.Dense(3, use_bias=False)(h), None
    h, _ = nn.scan(body, length=3, variable_axes={'params': 0},
                   split_rngs={'params': True})(self, x, None)
    h = nn.DenseGeneral((2, 2), use_bias=False, name='heads')(h)
    return nn.DenseGeneral(1, axis=(-2, -1), name='out')(h)


def test_workloads_linen_task_reads_muon_dims_from_its_model():
  task = tasks.linen_model_task(
      _LinenScanned(), None, jnp.ones((2, 3)), lambda key: 0,
      lambda forward, index: jnp.mean(forward(jnp.ones((2, 3))) ** 2),
      lambda forward: jnp.zeros(()))
  params, _ = task.init(jax.random.key(0))
  dims = task.muon_dims(params)
  assert _axes(dims['Dense_0']['kernel']) == ((1,), (2,))  # axis 0: stack
  assert _axes(dims['heads']['kernel']) == ((0,), (1, 2))
  assert _axes(dims['out']['kernel']) == ((0, 1), (2,))
  assert dims['out']['bias'] is None

@pytest.mark.parametrize('centered', [False, True])
def test_workloads_scanned_transformer_keeps_its_layer_axis_as_a_batch_axis(
    offline, centered):
  del offline
  task = definitions.workload('transformer', quick=True).build(centered)
  params, _ = task.init(jax.random.key(0))
  dims = task.muon_dims(params)
  found = []
  for path, leaf in jax.tree_util.tree_leaves_with_path(
      params, is_leaf=lambda x: hasattr(x, 'shape')):
    names = [str(getattr(k, 'key', getattr(k, 'idx', k))) for k in path]
    if 'query' in names and names[-1] == 'kernel':
      got = dims
      for k in path:
        got = got[getattr(k, 'key', getattr(k, 'idx', None))]
      assert leaf.ndim == 4  # (layers, in, heads, head_dim)
      assert _axes(got) == ((1,), (2, 3)), (names, got)
      found.append(names)
  assert found
