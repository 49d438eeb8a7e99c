"""``cbp-optax workloads``: schema, user arms, divergence, pairing, score, merge."""

import dataclasses
import json
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cbp_optax_experiments.workloads import arms as arms_lib
from cbp_optax_experiments.workloads import cli
from cbp_optax_experiments.workloads import definitions
from cbp_optax_experiments.workloads import protocol
from cbp_optax_experiments.workloads import scoring


def user_sgd(schedule):
  """A user arm: SGD with momentum on the shared schedule."""
  return optax.sgd(schedule, momentum=0.9)


def exploding(schedule):
  """A user arm whose updates are NaN: every run diverges."""
  return optax.chain(
      optax.sgd(schedule),
      optax.stateless(lambda u, _: jax.tree.map(lambda x: x * jnp.nan, u)))


def frozen(schedule):
  """A user arm that never moves the parameters."""
  del schedule
  return optax.set_to_zero()


@pytest.fixture(scope='module')
def quick_run(tmp_path_factory):
  out = tmp_path_factory.mktemp('workloads')
  cli.main(['--quick', '--workloads', 'spiral', '--arms', 'adamw,mine,boom',
            '--arm', f'mine={__name__}:user_sgd',
            '--arm', f'boom={__name__}:exploding', '--out', str(out),
            '--no-progress'])
  return out


def test_results_schema(quick_run):
  results = json.loads((quick_run / 'results.json').read_text())
  assert set(results) >= {'workloads', 'score'}
  entry = results['workloads']['spiral']
  assert isinstance(entry['metric'], str)
  assert isinstance(entry['target'], float)
  assert isinstance(entry['budget_steps'], int)
  assert set(entry['arms']) == {'adamw', 'mine', 'boom'}
  for arm in entry['arms'].values():
    assert isinstance(arm['learning_rate'], float)
    assert isinstance(arm['cost_vs_adamw'], float)
    for key in ('steps_to_target', 'diverged', 'final_metric'):
      assert len(arm[key]) == cli.QUICK_SEEDS, key
    assert all(s is None or isinstance(s, int) for s in arm['steps_to_target'])
    assert all(isinstance(d, bool) for d in arm['diverged'])
  assert set(results['score']) == {'adamw', 'mine', 'boom'}
  assert all(0.0 <= s <= 1.0 for s in results['score'].values())
  # Beside each score, its bootstrap interval, in every time profile.
  for profile in ('anytime', 'anytime_wall_clock', 'steps', 'wall_clock'):
    stored = results['profiles'][profile]
    assert set(stored['score_interval']) == set(stored['score'])
    for arm, (low, high) in stored['score_interval'].items():
      assert 0.0 <= low <= high <= 1.0
  # The headline is the any-time score in steps.
  assert results['headline'] == 'anytime'
  assert results['score_interval'] == results['profiles']['anytime'][
      'score_interval']
  assert results['score'] == results['profiles']['anytime']['score']
  ladder = entry['ladder']
  assert ladder['reference'] == 'adamw' and len(ladder['targets']) == 8
  assert set(ladder['reach']) == {'adamw', 'mine', 'boom'}
  assert ladder['reach']['boom'] == [0.0] * 8   # it diverged
  assert entry['statistics']['adamw']['anytime']['mean'] == pytest.approx(
      results['score']['adamw'])
  assert set(entry['statistics']) == {'adamw', 'mine', 'boom'}
  assert entry['statistics']['boom']['steps_to_target'] == {
      'median': None, 'interval': [None, None]}
  # No centered pair and no recipe among these arms: no comparison; a quick
  # run recommends nothing.
  assert results['comparisons'] == [] and results['recommendation'] is None
  assert results['anytime_comparisons'] == []
  # AdamW sets the quick target and reaches it on at least half its seeds.
  assert any(s is not None
             for s in entry['arms']['adamw']['steps_to_target'])
  text = (quick_run / 'results.md').read_text()
  assert 'QUICK RUN' in text and 'Verdict (spiral)' in text
  assert (quick_run / 'performance_profile.png').stat().st_size > 0


def test_diverging_user_arm_is_a_miss(quick_run):
  results = json.loads((quick_run / 'results.json').read_text())
  boom = results['workloads']['spiral']['arms']['boom']
  assert boom['diverged'] == [True] * cli.QUICK_SEEDS
  assert boom['steps_to_target'] == [None] * cli.QUICK_SEEDS
  assert results['score']['boom'] == 0.0
  assert results['workloads']['spiral']['arms']['mine']['diverged'] == [
      False] * cli.QUICK_SEEDS


def test_merge_keeps_other_arms_and_score_only(quick_run):
  before = json.loads((quick_run / 'results.json').read_text())
  cli.main(['--quick', '--workloads', 'spiral', '--arms', 'still',
            '--arm', f'still={__name__}:frozen', '--out', str(quick_run),
            '--no-progress'])
  after = json.loads((quick_run / 'results.json').read_text())
  arms = after['workloads']['spiral']['arms']
  assert set(arms) == {'adamw', 'mine', 'boom', 'still'}
  assert arms['adamw'] == before['workloads']['spiral']['arms']['adamw']
  assert after['workloads']['spiral']['target'] == (
      before['workloads']['spiral']['target'])
  assert set(after['score']) == set(arms)
  (quick_run / 'results.md').unlink()
  cli.main(['--score-only', '--out', str(quick_run)])
  assert 'still' in (quick_run / 'results.md').read_text()


def test_paired_seeds_see_identical_batches():
  workload = definitions.workload('spiral', quick=True)
  plain, centered = workload.build(False), workload.build(True)
  still = arms_lib.user_arm(f'still={__name__}:frozen')
  still_centered = arms_lib.user_arm(f'still={__name__}:frozen',
                                     centered=True)
  arms = arms_lib.builtin_arms()
  losses = {}
  for name, arm, task in (('still', still, plain),
                          ('still_centered', still_centered, centered),
                          ('adamw', arms['adamw'], plain),
                          ('cbp', arms['cbp'], centered)):
    runner = protocol.make_runner(task, arm, workload)
    losses[name] = {seed: runner(seed, 1e-3)[0] for seed in (0, 1)}
  for seed in (0, 1):
    # Frozen parameters: the loss sequence is the batch sequence.
    chex.assert_trees_all_close(losses['still'][seed],
                                losses['still_centered'][seed], rtol=1e-5)
    # Same initialization and first batch for every arm.
    first = {name: runs[seed][0] for name, runs in losses.items()}
    np.testing.assert_allclose(list(first.values()), first['still'],
                               rtol=1e-5)
  assert not np.allclose(losses['still'][0], losses['still'][1])
  _, data_key, _ = protocol.seed_keys(0)
  key_a = protocol.step_keys(data_key, data_key, 3)[0]
  chex.assert_trees_all_equal(plain.batch(key_a), centered.batch(key_a))


@pytest.mark.parametrize('name', ['spiral', 'tutorial-cnn'])
def test_stepping_one_by_one_trains_as_the_scan_does(name):
  # The convolutional workloads call one compiled step per step (XLA:CPU
  # runs convolutions inside a loop many times slower); both paths must give
  # the same run: the per-step losses, and the metrics evaluated on the state
  # each chunk hands on.
  workload = definitions.workload(name, quick=True)
  arm = arms_lib.builtin_arms()['cbp']
  task = workload.build(arm.centered)
  runs = {}
  for scan_steps in (True, False):
    variant = dataclasses.replace(workload, scan_steps=scan_steps)
    runs[scan_steps] = protocol.make_runner(task, arm, variant)(1, 3e-3)
  chex.assert_trees_all_close(runs[True], runs[False], rtol=1e-5, atol=1e-6)
  assert not np.allclose(runs[True][0][0], runs[True][0][-1])


@pytest.mark.parametrize('name', definitions.NAMES)
def test_batch_norm_flag_says_whether_the_model_has_batch_norm(name):
  workload = definitions.workload(name, quick=True)
  _, state = workload.build(False).init(jax.random.key(0))
  paths = [jax.tree_util.keystr(path).lower()
           for path, _ in jax.tree_util.tree_leaves_with_path(state)]
  has_batch_norm = any('batch_norm' in p or 'batch_stats' in p
                       for p in paths)
  assert workload.batch_norm == has_batch_norm


def test_cbp_robust_trains_batch_norm_models_plain():
  arms = arms_lib.builtin_arms()
  cnn = definitions.workload('tutorial-cnn', quick=True)
  mlp = definitions.workload('mnist-mlp', quick=True)
  assert not arms['cbp_robust'].centers(cnn)
  assert arms['cbp_robust'].centers(mlp)
  assert arms['cbp'].centers(cnn) and arms['adamw_centered'].centers(cnn)
  assert not arms['adamw'].centers(mlp)
  user = arms_lib.user_arm(f'mine={__name__}:user_sgd', centered=True)
  assert user.centers(cnn)

def test_profile_score_hand_example():
  inf = math.inf
  times = {'w1': {'a': 10.0, 'b': 10.0, 'c': inf},   # tie a/b, c misses
           'w2': {'a': 20.0, 'b': 10.0, 'c': 50.0},  # c beyond r_max
           'w3': {'a': inf, 'b': inf, 'c': inf}}     # nobody reaches
  ratios = scoring.ratios(times)
  assert ratios['a'] == {'w1': 1.0, 'w2': 2.0, 'w3': inf}
  assert ratios['c'] == {'w1': inf, 'w2': 5.0, 'w3': inf}
  assert scoring.rho(ratios['a'], 1.5) == pytest.approx(1 / 3)
  assert scoring.rho(ratios['a'], 2.0) == pytest.approx(2 / 3)
  found = scoring.scores(times, 'b')
  assert found['a']['score'] == pytest.approx((1 + 2 / 3) / 3)
  assert found['b']['score'] == pytest.approx(2 / 3)
  assert found['c']['score'] == 0.0
  assert found['a']['speedup_vs_reference'] == pytest.approx(math.sqrt(0.5))
  assert found['c']['speedup_vs_reference'] == pytest.approx(0.2)
  assert found['b']['reached'] == 2 and found['c']['reached'] == 1
  # The closed form equals the integral of the step function rho.
  taus = np.linspace(1.0, scoring.R_MAX, 300_001)
  numeric = np.trapezoid([scoring.rho(ratios['a'], t) for t in taus[::100]],
                         taus[::100]) / (scoring.R_MAX - 1)
  assert numeric == pytest.approx(found['a']['score'], abs=1e-3)
  # Median over seeds (a miss is infinite) times the step cost.
  assert scoring.arm_time([10, None, 30], 2.0) == 60.0
  assert scoring.arm_time([None, None, 5], 1.0) == inf


def test_steps_to_target_and_divergence_rules():
  assert protocol.steps_to_target([0.5, 0.8, 0.9], 0.8, 10, True,
                                  False) == 20
  assert protocol.steps_to_target([3.0, 2.0], 2.5, 5, False, False) == 10
  assert protocol.steps_to_target([0.5, 0.9], 0.8, 10, True, True) is None
  assert protocol.steps_to_target([0.5, None], 0.8, 10, True, False) is None
  assert protocol.diverged(np.array([1.0, np.nan]), np.array([0.5]))
  assert protocol.diverged(np.array([1.0] + [10.0] * 50), np.array([0.5]))
  assert not protocol.diverged(np.linspace(2.0, 0.5, 50), np.array([0.5]))


def _tuning_workload(ladder, higher=True):
  return dataclasses.replace(definitions.workload('spiral', quick=True),
                             ladder=ladder, higher_is_better=higher)


def _record(lr, metrics, diverged=False):
  metrics = np.asarray(metrics, np.float64)
  return protocol.RunRecord(1000, lr, np.zeros(4), metrics, diverged, 0.1)


def test_tuning_chooses_the_best_any_time_value_not_the_race_to_one_target():
  # Rate 0.1 climbs early and stalls; 0.3 ends higher, late. Against a
  # ladder of early targets the early climber is worth more; against the
  # area under the curve (no ladder) too; a ladder of one late target
  # prefers the late one.
  early = [0.6, 0.7, 0.7, 0.7, 0.7]
  late = [0.1, 0.2, 0.3, 0.5, 0.8]
  records = {0.1: [_record(0.1, early)], 0.3: [_record(0.3, late)],
             1.0: [_record(1.0, [0.9] * 5, diverged=True)]}
  assert protocol._select(records, _tuning_workload((0.5, 0.6, 0.7))) == 0.1
  assert protocol._select(records, _tuning_workload(None)) == 0.1
  assert protocol._select(records, _tuning_workload((0.8,))) == 0.3
  # Equal any-time values: the better best metric, then the smaller rate.
  assert protocol._select(records, _tuning_workload((2.0,))) == 0.3
  same = {0.3: [_record(0.3, early)], 0.1: [_record(0.1, early)]}
  assert protocol._select(same, _tuning_workload((0.5,))) == 0.1
  # Every rate diverged: none.
  assert protocol._select({1.0: records[1.0]}, _tuning_workload(None)) is None
  # Lower is better: the area is negated.
  down = {0.1: [_record(0.1, [5.0, 4.0, 4.0])],
          0.3: [_record(0.3, [5.0, 5.0, 3.5])]}
  assert protocol._select(down, _tuning_workload(None, higher=False)) == 0.1
  assert protocol.tuning_value(np.array([1.0]), _tuning_workload(None),
                               True) == -math.inf


def test_full_size_workloads_are_tuned_against_their_ladders():
  assert set(definitions.LADDERS) == set(definitions.NAMES)
  for name, ladder in definitions.LADDERS.items():
    assert len(ladder) >= 6, name
  assert definitions.workload('spiral', quick=True).ladder is None


def test_user_arm_spec_errors():
  with pytest.raises(ValueError, match='NAME=module:function'):
    arms_lib.user_arm('nonsense')
  with pytest.raises(ValueError, match='cannot load'):
    arms_lib.user_arm('x=no_such_module_xyz:f')


@pytest.mark.parametrize('workload_name,arm_name', [
    ('spiral', 'adamw'), ('breast-cancer-raw', 'schedule_free_cbp_robust')])
def test_vmapped_seeds_and_rates_equal_the_looped_runs(workload_name,
                                                       arm_name):
  workload = definitions.workload(workload_name, quick=True)
  arm = arms_lib.builtin_arms()[arm_name]
  assert protocol.batchable(workload)[0]
  runner = protocol.make_runner(workload.build(arm.centers(workload)), arm,
                                workload)
  seeds, lrs = [0, 1, 2, 0], [3e-3, 3e-3, 3e-3, 1e-2]
  batched = runner.run_many(seeds, lrs)
  assert len(batched) == 4
  for (seed, lr), (losses, metrics, initial) in zip(zip(seeds, lrs), batched):
    want_losses, want_metrics, want_initial = runner.run(seed, lr)
    np.testing.assert_allclose(losses, want_losses, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(metrics, want_metrics, rtol=2e-5, atol=1e-6)
    assert initial == pytest.approx(want_initial, rel=1e-6)
  # Padded to a wider batch (one compiled program for every batch size):
  # the same runs.
  padded = runner.run_many(seeds[:2], lrs[:2], width=4)
  assert len(padded) == 2
  for got, want in zip(padded, batched[:2]):
    np.testing.assert_allclose(got[1], want[1], rtol=2e-5, atol=1e-6)
  # Different seeds and rates are different runs.
  assert not np.allclose(batched[0][0], batched[1][0])
  assert not np.allclose(batched[0][0], batched[3][0])


def test_convolutional_workloads_loop_and_say_why():
  cnn = definitions.workload('tutorial-cnn', quick=True)
  ok, why = protocol.batchable(cnn)
  assert not ok and 'grouped convolution' in why
  assert protocol.batchable(definitions.workload('spiral', quick=True))[0]


_EDITED_ARM = '''
import optax


def make(schedule):
  {body}
'''


def test_workloads_an_edited_user_arm_is_trained_again(tmp_path,
                                                       monkeypatch):
  # The same --arm NAME=module:function into the same --out after the
  # function changed (a frozen optimizer -> Adam): its stored runs are not
  # reused, the table reports the new optimizer.
  import importlib  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  module = 'user_arm_edited_between_runs'
  source = tmp_path / 'code' / f'{module}.py'
  source.parent.mkdir()
  monkeypatch.syspath_prepend(str(source.parent))
  out = tmp_path / 'out'
  argv = ['--quick', '--workloads', 'spiral', '--arms', 'adamw,mine',
          '--arm', f'mine={module}:make', '--seeds', '2', '--out', str(out),
          '--no-progress']

  def run(body):
    source.write_text(_EDITED_ARM.format(body=body))
    sys.modules.pop(module, None)  # a new process imports the file again
    importlib.invalidate_caches()
    assert cli.main(argv) == 0
    return json.loads((out / 'results.json').read_text())[
        'workloads']['spiral']['arms']['mine']

  frozen_arm = run('del schedule\n  return optax.set_to_zero()')
  # Never moved: every evaluation is the initial metric.
  for curve, initial in zip(frozen_arm['curves'],
                            frozen_arm['initial_metric']):
    assert curve == [initial] * len(curve)
  adam_arm = run('return optax.adam(schedule)')
  # Adam trained: its curves moved away from the initial metric.
  assert any(curve != [initial] * len(curve) for curve, initial in zip(
      adam_arm['curves'], adam_arm['initial_metric']))
  assert adam_arm['code_fingerprint'] != frozen_arm['code_fingerprint']
  # Both versions' runs are kept, each under its own identity.
  assert len(list((out / 'runs' / 'spiral' / 'mine').iterdir())) == 2


def test_workloads_user_arm_fingerprint_follows_its_code(tmp_path,
                                                         monkeypatch):
  import sys  # pylint: disable=g-import-not-at-top
  monkeypatch.syspath_prepend(str(tmp_path))
  fingerprints = []
  for i, body in enumerate(('return optax.sgd(schedule)',
                            'return optax.sgd(schedule)',
                            'return optax.adam(schedule)')):
    name = f'user_arm_fingerprint_{i}'
    (tmp_path / f'{name}.py').write_text(_EDITED_ARM.format(body=body))
    arm = arms_lib.user_arm(f'mine={name}:make')
    fingerprints.append(arm.fingerprint)
    sys.modules.pop(name, None)
  assert fingerprints[0] == fingerprints[1] != fingerprints[2]
  assert arms_lib.builtin_arms()['adamw'].fingerprint == ''
