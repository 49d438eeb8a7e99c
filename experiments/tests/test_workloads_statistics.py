"""Seed statistics and the decision rule of the workload suite, on synthetic
results with known answers."""

import copy
import math

import numpy as np
import pytest

from cbp_optax_experiments.workloads import scoring
from cbp_optax_experiments.workloads import statistics as stats


def _arm(steps, finals=None, cost=1.0, seeds=None):
  n = len(steps)
  return {'seeds': list(seeds if seeds is not None else range(n)),
          'steps_to_target': list(steps),
          'diverged': [False] * n,
          'final_metric': list(finals if finals is not None else [0.9] * n),
          'initial_metric': [0.1] * n, 'cost_vs_adamw': cost}


def _results(per_workload, budget=1000):
  return {'workloads': {
      name: {'budget_steps': budget, 'higher_is_better': True,
             'arms': arms} for name, arms in per_workload.items()}}


# ---------------------------------------------------------------------------
# Intervals


def test_median_interval_of_constant_values_is_a_point():
  assert stats.median_interval([7.0] * 10) == (7.0, 7.0, 7.0)


def test_median_interval_brackets_the_median_and_is_reproducible():
  values = np.arange(1.0, 12.0)
  median, low, high = stats.median_interval(values)
  assert median == 6.0 and low < 6.0 < high
  assert 1.0 <= low and high <= 11.0
  assert stats.median_interval(values) == (median, low, high)


def test_censored_medians_are_infinite_never_nan():
  # Six misses of ten: the median is a miss; the interval reaches infinity.
  steps = stats.steps_values([100, 120, 140, 160, None, None, None, None,
                              None, None])
  median, low, high = stats.median_interval(steps)
  assert median == math.inf and high == math.inf and not math.isnan(low)
  # Two misses of ten: a finite median, a finite low bound.
  steps = stats.steps_values([100] * 8 + [None] * 2)
  assert stats.median_interval(steps)[:2] == (100.0, 100.0)
  assert stats.median_interval(stats.steps_values([None] * 3)) == (
      math.inf, math.inf, math.inf)


def test_arm_intervals_write_infinity_as_null_and_diverged_finals_as_initial():
  entry = _results({'w': {
      'a': _arm([None] * 4, finals=[None, 0.5, 0.5, 0.5]),
      'b': _arm([20] * 4)}})['workloads']['w']
  entry['arms']['a']['diverged'] = [True, False, False, False]
  out = stats.arm_intervals(entry)
  assert out['a']['steps_to_target'] == {'median': None,
                                         'interval': [None, None]}
  assert out['b']['steps_to_target'] == {'median': 20.0,
                                         'interval': [20.0, 20.0]}
  # The diverged seed's final counts as the initial metric 0.1.
  np.testing.assert_allclose(
      stats.final_values(entry['arms']['a'], 0.1), [0.1, 0.5, 0.5, 0.5])
  assert out['a']['final_metric']['median'] == 0.5


def test_score_interval_of_seed_free_results_is_the_score():
  results = _results({
      'w1': {'a': _arm([100] * 5), 'b': _arm([200] * 5, cost=0.25)},
      'w2': {'a': _arm([None] * 5), 'b': _arm([50] * 5, cost=0.25)}})
  times = {w: {a: scoring.arm_time(r['steps_to_target'], 1.0)
               for a, r in e['arms'].items()}
           for w, e in results['workloads'].items()}
  expected = scoring.scores(times, 'a')
  got = stats.score_intervals(results)
  for arm in ('a', 'b'):
    assert got[arm] == pytest.approx([expected[arm]['score']] * 2)
  # Wall clock: b's steps cost a quarter: best on both workloads.
  assert stats.score_intervals(results, wall_clock=True)['b'] == [1.0, 1.0]


def test_score_interval_widens_with_seed_noise_and_covers_the_score():
  rng = np.random.default_rng(3)
  results = _results({
      f'w{i}': {'a': _arm(list(rng.integers(80, 130, 10))),
                'b': _arm(list(rng.integers(90, 140, 10)))}
      for i in range(4)})
  times = {w: {a: scoring.arm_time(r['steps_to_target'], 1.0)
               for a, r in e['arms'].items()}
           for w, e in results['workloads'].items()}
  score = scoring.scores(times, 'a')
  got = stats.score_intervals(results)
  for arm in ('a', 'b'):
    low, high = got[arm]
    assert low < high
    assert low <= score[arm]['score'] <= high


# ---------------------------------------------------------------------------
# Paired comparisons


def test_holm_known_values():
  assert stats.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
  assert stats.holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])
  assert stats.holm([]) == []


def test_log_ratios_censor_misses_at_twice_the_budget():
  d = stats.log_ratios([100, None, None, 50], [200, 100, None, None], 100)
  np.testing.assert_allclose(d, [1.0, math.log2(100 / 200), 0.0,
                                 math.log2(200 / 50)])


def test_wilcoxon_zero_differences_and_direction():
  assert stats.wilcoxon_p(np.zeros(10)) == 1.0
  assert stats.wilcoxon_p(np.ones(10)) < 0.01
  assert stats.signed_rank_direction(np.array([1.0, 2.0, -0.5])) == 1
  assert stats.signed_rank_direction(np.array([-1.0, -2.0, 0.5])) == -1
  assert stats.signed_rank_direction(np.array([1.0, -1.0, 0.0])) == 0


def _three_arms(n=10):
  return _results({f'w{i}': {
      'fast': _arm([100] * n), 'slow': _arm([200] * n),
      'fast_centered': _arm([100] * n),
      stats.RECIPE: _arm([100 + 5 * (s % 2) for s in range(n)])}
      for i in range(3)})


def test_comparisons_known_answers():
  results = _three_arms()
  records = stats.compare(results, [('fast', 'slow'), ('slow', 'fast'),
                                    ('fast_centered', 'fast')])
  pooled = {(r['a'], r['b']): r for r in records if r['workload'] == 'pooled'}
  fast = pooled[('fast', 'slow')]
  assert fast['n'] == 30 and fast['median'] == 1.0
  assert fast['interval'] == [1.0, 1.0] and fast['speedup'] == 2.0
  assert fast['verdict'] == stats.BETTER and fast['p_holm'] < 0.05
  assert pooled[('slow', 'fast')]['verdict'] == stats.WORSE
  same = pooled[('fast_centered', 'fast')]
  assert same['p'] == 1.0 and same['verdict'] == stats.NO_DIFFERENCE
  per = [r for r in records if r['workload'] != 'pooled']
  assert len(per) == 9 and {r['workload'] for r in per} == {'w0', 'w1', 'w2'}
  # Holm over the per-workload family: 3 identical tests of fast vs slow.
  ten = [r for r in per if (r['a'], r['b']) == ('fast', 'slow')]
  assert all(r['p_holm'] >= r['p'] for r in ten)


def test_the_default_family_is_centered_vs_plain_and_the_recipe_vs_all():
  recipe = stats.RECIPE
  pairs = stats.comparison_pairs(['fast', 'slow', 'fast_centered', recipe])
  assert pairs == [('fast_centered', 'fast'), (recipe, 'fast'),
                   (recipe, 'slow'), (recipe, 'fast_centered')]
  assert stats.comparison_pairs(['a', 'b_centered']) == []


def test_small_noisy_differences_are_not_significant():
  rng = np.random.default_rng(0)
  results = _results({f'w{i}': {
      'a': _arm(list(100 + rng.integers(-20, 21, 10))),
      'b': _arm(list(100 + rng.integers(-20, 21, 10)))} for i in range(2)})
  pooled = stats.compare(results, [('a', 'b')])[0]
  assert pooled['workload'] == 'pooled'
  assert pooled['verdict'] == stats.NO_DIFFERENCE
  low, high = pooled['interval']
  assert low <= pooled['median'] <= high and low < 0 < high


def test_seeds_are_matched_by_value_not_position():
  results = _results({'w': {
      'a': _arm([100, 200], seeds=[0, 1]),
      'b': _arm([400, 100], seeds=[1, 0])}})
  d = stats.paired_steps(results['workloads']['w'], 'a', 'b')
  np.testing.assert_allclose(d, [0.0, 1.0])


# ---------------------------------------------------------------------------
# Stability


def test_stability_same_results_are_stable():
  results = _three_arms()
  report = stats.stability(results, copy.deepcopy(results))
  assert report['stable'] and report['intervals_overlap']
  assert report['flips'] == [] and report['changed'] == []


def test_stability_reports_disjoint_intervals_and_flips():
  first = _three_arms()
  second = copy.deepcopy(first)
  for entry in second['workloads'].values():
    entry['arms']['fast']['steps_to_target'] = [400] * 10
  report = stats.stability(first, second)
  assert not report['stable'] and not report['intervals_overlap']
  assert any('fast on w0' in line for line in report['disjoint'])
  # The recipe, 0-5% slower than fast, becomes 4x faster than it.
  assert any(line.startswith(f'{stats.RECIPE} vs fast:')
             for line in report['flips'])


# ---------------------------------------------------------------------------
# The decision rule

from cbp_optax_experiments.workloads import arms as arms_lib  # noqa: E402
from cbp_optax_experiments.workloads import decision  # noqa: E402
from cbp_optax_experiments.workloads import summary  # noqa: E402


def _dev(arms_steps, n=10, workloads=3):
  results = _results({f'w{i}': {name: _arm(steps(i, n))
                                for name, steps in arms_steps.items()}
                      for i in range(workloads)})
  results['meta'] = {'split': 'dev'}
  return results


def _const(value):
  return lambda i, n: [value] * n


def _noisy(center, seed):
  return lambda i, n: list(center + np.random.default_rng(
      (seed, i)).integers(-10, 11, n))


_TWO = (decision.Candidate('cheap', decision.ELEMENTWISE, ('lr',)),
        decision.Candidate('costly', decision.MATRIX, ('lr', 'ns')))


def test_candidates_are_built_in_arms_with_costs_and_hyperparameters():
  builtin = arms_lib.builtin_arms()
  names = [c.arm for c in decision.CANDIDATES]
  for peer in ('schedule_free_adamw', 'muon', 'nadamw', 'adamw'):
    assert f'{peer}_centered' in names
  assert {'cbp_robust', arms_lib.RECOMMENDED} <= set(names)
  # A full run trains every candidate (one it does not train is left out
  # of the decision).
  assert set(names) <= set(arms_lib.default_arms())
  assert not set(names) & set(arms_lib.NOT_BY_DEFAULT)
  for c in decision.CANDIDATES:
    assert c.arm in builtin and builtin[c.arm].centered
    assert c.cost_class in (decision.ELEMENTWISE, decision.MATRIX)
    assert c.hyperparameters and 'learning_rate' in c.hyperparameters
  costs = {c.arm: c.cost_class for c in decision.CANDIDATES}
  assert costs['muon_centered'] == decision.MATRIX
  assert costs['adamw_centered'] == decision.ELEMENTWISE


def test_a_costlier_candidate_that_is_clearly_faster_wins():
  results = _dev({'cheap': _noisy(200, 0), 'costly': _noisy(100, 1)})
  rec = decision.recommend_by_target(results, _TWO, resamples=300)
  assert rec.arm == 'costly' and rec.beaten_by['cheap'] == ('costly',)
  assert rec.undominated == ('costly',) and 'only candidate' in rec.reason


def test_without_a_significant_difference_the_cheaper_step_wins():
  results = _dev({'cheap': _noisy(100, 0), 'costly': _noisy(98, 1)})
  rec = decision.recommend_by_target(results, _TWO, resamples=300)
  assert rec.arm == 'cheap' and set(rec.undominated) == {'cheap', 'costly'}
  assert 'cheapest step' in rec.reason


def test_same_cost_class_breaks_ties_by_fewer_hyperparameters():
  candidates = (decision.Candidate('many', decision.ELEMENTWISE,
                                   ('lr', 'b1', 'b2')),
                decision.Candidate('few', decision.ELEMENTWISE, ('lr',)))
  results = _dev({'many': _const(100), 'few': _const(100)})
  assert decision.recommend_by_target(results, candidates, resamples=100).arm == 'few'


def test_significant_pairs_need_the_score_interval_margin_too():
  # costly is 1% faster on every seed: significant, and its score interval
  # [1, 1] is above cheap's 0.997, but 1% is below the margin (1.1x).
  steps = {'cheap': _const(100), 'costly': _const(99)}
  rec = decision.recommend_by_target(_dev(steps), _TWO, resamples=100)
  assert rec.arm == 'cheap' and rec.beaten_by['cheap'] == ()
  assert decision.recommend_by_target(_dev(steps), _TWO, resamples=100,
                            min_speedup=1.0).arm == 'costly'
  # 2x faster on one workload of four, the same elsewhere: the pooled median
  # speedup is 1, below the margin, whatever the test says.
  steps = {'cheap': _const(100),
           'costly': lambda i, n: [50 if i == 0 else 100] * n}
  rec = decision.recommend_by_target(_dev(steps, workloads=4), _TWO, resamples=100)
  assert rec.arm == 'cheap'


def test_the_rule_refuses_test_results_and_too_few_seeds():
  results = _dev({'cheap': _const(100), 'costly': _const(50)})
  results['meta']['split'] = 'test'
  with pytest.raises(ValueError, match='dev split only'):
    decision.recommend_by_target(results, _TWO)
  results = _dev({'cheap': _const(100), 'costly': _const(50)}, n=3)
  with pytest.raises(ValueError, match='fewer than 10 seeds'):
    decision.recommend_by_target(results, _TWO)
  results = _dev({'cheap': _const(100), 'costly': _const(50)})
  del results['workloads']['w1']['arms']['costly']
  rec = decision.recommend_by_target(results, _TWO, resamples=100)
  assert rec.arm == 'cheap' and 'did not run w1' in rec.left_out['costly']
  assert decision.maybe_recommend({'workloads': {}}) is None


# ---------------------------------------------------------------------------
# cbp-optax workloads --compare-runs

import json  # noqa: E402

from cbp_optax_experiments.workloads import cli  # noqa: E402


def _results_file(path, results):
  """``results`` with the fields a results.json must have, written there."""
  results = copy.deepcopy(results)
  results['meta'] = {'quick': False, 'split': 'dev', 'seeds': list(range(10))}
  for entry in results['workloads'].values():
    entry.update(metric='validation accuracy', target=0.9, eval_every=100,
                 grid=[1e-3], description='synthetic', target_source='hand')
    for arm in entry['arms'].values():
      n = len(arm['seeds'])
      arm.update(learning_rate=1e-3, best_metric=[0.9] * n,
                 curves=[[0.5] * 10] * n)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(results))
  return path


def _section(text, title):
  """The indented lines under the line starting with ``title``."""
  lines = text.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith(title))
  out = []
  for line in lines[start + 1:]:
    if not line.startswith(' '):
      break
    out.append(line.strip())
  return out


def test_workloads_compare_runs_of_the_same_results_is_stable(tmp_path,
                                                              capsys):
  a = _results_file(tmp_path / 'a' / 'results.json', _three_arms())
  b = _results_file(tmp_path / 'b' / 'results.json', _three_arms())
  # A file or the folder holding results.json.
  assert cli.main(['--compare-runs', str(a), str(b.parent)]) == 0
  out = capsys.readouterr().out
  per_arm = _section(out, 'Intervals')
  assert sorted(line.split()[0] for line in per_arm) == sorted(
      ['fast', 'slow', 'fast_centered', stats.RECIPE])
  assert all(line.split()[1] == 'overlap' for line in per_arm)
  assert _section(out, 'Paired verdicts') == ['none']
  assert 'Stable: yes' in out


def test_workloads_compare_runs_lists_disjoint_arms_and_flips(tmp_path,
                                                              capsys):
  first = _three_arms()
  second = copy.deepcopy(first)
  for entry in second['workloads'].values():
    entry['arms']['fast']['steps_to_target'] = [400] * 10
  a = _results_file(tmp_path / 'a.json', first)
  b = _results_file(tmp_path / 'b.json', second)
  assert cli.main(['--compare-runs', str(a), str(b)]) == 0
  out = capsys.readouterr().out
  per_arm = {line.split()[0]: line for line in _section(out, 'Intervals')
             if not line.startswith(('score', 'steps'))}
  assert 'DISJOINT' in per_arm['fast']
  assert per_arm['slow'].split()[1] == 'overlap'
  assert 'steps to target of fast on w0' in out
  # The recipe, 0-5% slower than fast in A, is 4x faster than it in B.
  assert _section(out, 'Paired verdicts') == [
      f'{stats.RECIPE} vs fast: {stats.WORSE} -> {stats.BETTER}']
  assert 'Stable: no' in out


def test_the_centering_sentence_computes_comparisons_not_stored():
  results = _anytime_results({'adamw': _rates(0.1, 0),
                              'adamw_centered': _rates(0.2, 1)})
  results.pop('meta')
  assert 'anytime_comparisons' not in results
  text = summary.centering_sentence(results)
  assert text.startswith('On this run, pooled over the 30 (workload, seed) '
                         'pairs of the any-time score, centering is '
                         'significantly better than plain for AdamW'), text
  # No centered pair at all: said so, not a crash.
  results = _anytime_results({'adamw': _rates(0.1, 0)})
  assert 'no peer ran both plain and centered' in (
      summary.centering_sentence(results))


def test_the_stability_table_marks_disjoint_arms_and_flips():
  first = _three_arms()
  first['meta'] = {'vmap': False}
  second = copy.deepcopy(first)
  second['meta'] = {'vmap': True}
  for entry in second['workloads'].values():
    entry['arms']['fast']['steps_to_target'] = [400] * 10
  table = summary.stability_table(first, second)
  rows = {line.split(' | ')[0].strip('| '): line
          for line in table.splitlines() if line.startswith('| ')}
  assert 'looped' in table.splitlines()[0] and 'vmapped' in table
  assert rows['fast'].endswith('| no |') and rows['slow'].endswith('| yes |')
  assert '9 of 12 overlap: disjoint steps to target of fast on w0' in table
  assert '1 flipped between significantly better and significantly worse' \
      in table
  assert 'Stable (every interval overlaps, no verdict flips): no.' in table
  same = summary.stability_table(first, copy.deepcopy(first))
  assert 'looped (A)' in same and '12 of 12 overlap.' in same
  assert 'Stable (every interval overlaps, no verdict flips): yes.' in same


@pytest.mark.parametrize('extra, message', [
    (['--quick'], '--compare-runs compares two results.json as they stand: '
     'it takes no --quick'),
    (['--out', 'x'], 'it takes no --out'),
    (['--score-only'], 'it takes no --score-only'),
])
def test_workloads_compare_runs_refuses_other_flags(tmp_path, capsys, extra,
                                                    message):
  a = _results_file(tmp_path / 'a.json', _three_arms())
  with pytest.raises(SystemExit) as info:
    cli.main(['--compare-runs', str(a), str(a), *extra])
  assert info.value.code == 2
  assert message in capsys.readouterr().err


def test_workloads_compare_runs_of_a_missing_or_damaged_file(tmp_path,
                                                             capsys):
  a = _results_file(tmp_path / 'a.json', _three_arms())
  with pytest.raises(SystemExit) as info:
    cli.main(['--compare-runs', str(a), str(tmp_path / 'nowhere.json')])
  assert info.value.code == 2
  assert 'nowhere.json: no such file' in capsys.readouterr().err
  (tmp_path / 'bad.json').write_text('{"workloads": {}}')
  with pytest.raises(SystemExit) as info:
    cli.main(['--compare-runs', str(a), str(tmp_path / 'bad.json')])
  assert info.value.code == 2
  assert 'bad.json is damaged: meta is missing' in capsys.readouterr().err


def test_centering_verdicts_count_workloads_and_pool_the_seeds():
  # Centered AdamW climbs twice as fast on two workloads of three, equally
  # on one; centered Muon equals Muon everywhere; a peer without its
  # centered arm is not listed.
  results = _anytime_results({
      'adamw': _rates(0.05, 0),
      'adamw_centered': lambda i, n: _rates(0.1 if i < 2 else 0.05, 1)(i, n),
      'muon': _rates(0.1, 2), 'muon_centered': _rates(0.1, 2),
      'nadamw': _rates(0.1, 3)})
  verdicts = summary.centering_verdicts(results)
  assert set(verdicts) == {'adamw', 'muon'}
  adamw = verdicts['adamw']
  assert adamw['verdict'] == stats.BETTER and adamw['n'] == 30
  assert adamw['counts'] == {stats.BETTER: 2, stats.NO_DIFFERENCE: 1,
                             stats.WORSE: 0}
  assert adamw['interval'][0] <= adamw['difference'] <= adamw['interval'][1]
  assert adamw['difference'] > 0.1
  assert verdicts['muon']['verdict'] == stats.NO_DIFFERENCE
  assert verdicts['muon']['difference'] == 0.0


def test_the_answer_names_the_dev_choice_and_needs_the_test_split():
  names = [c.arm for c in decision.CANDIDATES]
  dev = _anytime_results({name: _rates(0.2 if name == 'muon_centered'
                                       else 0.05, 0, 0.0)
                          for name in names}, split='dev')
  dev = {**dev, 'meta': {'split': 'dev'}}
  for entry in dev['workloads'].values():
    for arm in entry['arms'].values():
      arm['curves'] = arm['curves'] * 1   # ten seeds each
  assert decision.recommend(dev).arm == 'muon_centered'
  test = copy.deepcopy(dev)
  test['meta']['split'] = 'test'
  text = summary.answer(dev, test)
  assert text.startswith('Use ' + summary.RECIPES['muon_centered'])
  assert '10 paired seeds' in text
  with pytest.raises(ValueError, match='test split'):
    summary.answer(dev, dev)
  # On test it is better than every other arm (all slower), worse than none.
  assert 'significantly worse than' not in text
  assert 'significantly better than' in text
  assert summary.dev_ties(dev) == ''  # it beat every other candidate
  assert set(summary.RECIPES) == set(names)


def test_the_answer_names_the_arms_test_found_better_than_the_choice():
  names = [c.arm for c in decision.CANDIDATES]
  dev = _anytime_results({name: _rates(0.2 if name == 'muon_centered'
                                       else 0.05, 0, 0.0) for name in names})
  test = _anytime_results({name: _rates(0.2 if name == 'adamw_centered'
                                        else 0.05, 0, 0.0) for name in names},
                          split='test')
  text = summary.answer(dev, test)
  # The difference is the choice's value minus the other's.
  assert ('it is significantly worse than AdamW centered (0.900 [0.900, '
          '0.900], mean paired difference -0.450)') in text, text


# ---------------------------------------------------------------------------
# The any-time score: intervals, paired comparisons, the rule's version 2

_LADDER = [0.2, 0.4, 0.6, 0.8, 1.0]


def _ramp(rate, n=20):
  """A curve that climbs ``rate`` per evaluation, capped at 1."""
  return [min(1.0, rate * (k + 1)) for k in range(n)]


def _curves(rates, cost=1.0):
  return {'seeds': list(range(len(rates))),
          'curves': [_ramp(r) for r in rates],
          'diverged': [False] * len(rates), 'cost_vs_adamw': cost,
          'steps_to_target': [None] * len(rates)}


def _anytime_results(per_arm_rates, workloads=3, split='dev'):
  """Every workload has the same ladder; ``per_arm_rates``: arm ->
  ``rates(i, n) -> list`` of per-seed climbing rates on workload i."""
  return {'meta': {'split': split}, 'workloads': {
      f'w{i}': {'higher_is_better': True, 'budget_steps': 200,
                'ladder': {'targets': list(_LADDER)},
                'arms': {arm: _curves(rates(i, 10))
                         for arm, rates in per_arm_rates.items()}}
      for i in range(workloads)}}


def _rates(center, seed, spread=0.01):
  return lambda i, n: list(center + np.random.default_rng(
      (seed, i)).uniform(-spread, spread, n))


def test_anytime_scores_are_means_over_workloads_with_paired_intervals():
  results = _anytime_results({'fast': lambda i, n: [0.2] * n,
                              'slow': lambda i, n: [0.05] * n})
  found = stats.anytime_scores(results, resamples=200)
  # fast reaches the k-th target (0.2 k) at evaluation k of 20.
  fast = np.mean([(20 - k + 1) / 20 for k in range(1, 6)])
  slow = np.mean([(20 - k + 1) / 20 for k in (4, 8, 12, 16, 20)])
  assert found['fast']['score'] == pytest.approx(fast)
  assert found['slow']['score'] == pytest.approx(slow)
  assert found['fast']['interval'] == pytest.approx([fast, fast])
  assert found['fast']['workloads'] == 3
  # Wall-clock: twice the step cost moves every reach to twice as late.
  for entry in results['workloads'].values():
    entry['arms']['fast']['cost_vs_adamw'] = 2.0
  wall = stats.anytime_scores(results, wall_clock=True, resamples=50)
  assert wall['fast']['score'] == pytest.approx(
      np.mean([(20 - 2 * k + 1) / 20 for k in range(1, 6)]))


def test_anytime_comparisons_known_answers_and_family():
  results = _anytime_results({
      'adamw': _rates(0.1, 0), 'adamw_centered': _rates(0.2, 1),
      'muon': _rates(0.1, 2), 'muon_centered': _rates(0.1, 2),
      'cbp_robust': _rates(0.05, 3), 'cbp': _rates(0.1, 4),
      'cbp_kron_centered': _rates(0.1, 6), stats.RECIPE: _rates(0.1, 5)})
  found = stats.compare_anytime(results, resamples=200)
  pooled = {(c['a'], c['b']): c for c in found if c['workload'] == 'pooled'}
  assert ('adamw_centered', 'adamw') in pooled
  assert ('muon_centered', 'muon') in pooled
  assert stats.M3_PAIR in pooled and stats.ALGORITHM_1_PAIR in pooled
  # Of the Kronecker family, the pairs whose arms both ran.
  assert ('cbp_kron_centered', 'muon_centered') in pooled
  assert ('cbp_kron_centered', 'cbp_robust') in pooled
  assert ('cbp_kron_centered', 'psgd_kron') not in pooled
  assert (stats.RECIPE, 'adamw') in pooled
  assert len({frozenset(p) for p in pooled}) == len(pooled)  # no pair twice
  centered = pooled[('adamw_centered', 'adamw')]
  assert centered['verdict'] == stats.BETTER and centered['n'] == 30
  assert centered['interval'][0] <= centered['difference'] <= (
      centered['interval'][1])
  assert centered['difference'] > 0.1
  assert pooled[('muon_centered', 'muon')]['verdict'] == stats.NO_DIFFERENCE
  assert pooled[('muon_centered', 'muon')]['difference'] == 0.0
  assert pooled[stats.M3_PAIR]['verdict'] == stats.WORSE
  # The difference is the difference of the two scores.
  scores = stats.anytime_scores(results, resamples=10)
  assert centered['difference'] == pytest.approx(
      scores['adamw_centered']['score'] - scores['adamw']['score'])


def test_anytime_rule_a_clearly_better_costlier_candidate_wins():
  results = _anytime_results({'cheap': _rates(0.06, 0),
                              'costly': _rates(0.12, 1)})
  rec = decision.recommend(results, _TWO, resamples=200)
  assert rec.arm == 'costly' and rec.beaten_by['cheap'] == ('costly',)
  assert 'any-time score' in rec.reason


def test_anytime_rule_needs_the_margin_and_prefers_the_cheaper_step():
  # costly is better on every seed, but by less than MIN_DIFFERENCE.
  results = _anytime_results({'cheap': _rates(0.1, 0, 0.0),
                              'costly': _rates(0.115, 1, 0.0)})
  scores = stats.anytime_scores(results, resamples=10)
  gap = scores['costly']['score'] - scores['cheap']['score']
  assert 0 < gap < decision.MIN_DIFFERENCE
  rec = decision.recommend(results, _TWO, resamples=100)
  assert rec.arm == 'cheap' and set(rec.undominated) == {'cheap', 'costly'}
  assert decision.recommend(results, _TWO, resamples=100,
                            min_difference=0.0).arm == 'costly'


def test_anytime_rule_refuses_test_results_and_results_without_ladders():
  results = _anytime_results({'cheap': _rates(0.1, 0),
                              'costly': _rates(0.2, 1)}, split='test')
  with pytest.raises(ValueError, match='dev split only'):
    decision.recommend(results, _TWO)
  results['meta']['split'] = 'dev'
  del results['workloads']['w1']['ladder']
  with pytest.raises(ValueError, match='no ladder of targets on w1'):
    decision.recommend(results, _TWO)
