"""``cbp-optax workloads``'s command line fails before it trains.

``cbp-optax workloads``: every argument is checked before anything trains (an
empty or repeated name, a seed count below one, a user arm that shadows a
built-in one, a ``--centered`` that names no ``--arm``, an ``--out`` that is a
file, results in ``--out`` that this run cannot be compared with); a damaged
results.json is one error naming the file and the field, on every path that
reads it; a run whose arms fail says so and exits non-zero; results.json is
replaced in one step. ``cbp-optax compare``: the same classes of bad
arguments. All cheap: validation stops before training, and training is
replaced by a stub where a run must get that far.
"""

import copy
import json
import os
import pathlib
import re

import numpy as np
import pytest

from cbp_optax_experiments import cli as top_cli
from cbp_optax_experiments import datasets
from cbp_optax_experiments import outputs
from cbp_optax_experiments.reproduce import cli as reproduce_cli
from cbp_optax_experiments.workloads import arms as arms_lib
from cbp_optax_experiments.workloads import cli
from cbp_optax_experiments.workloads import definitions
from cbp_optax_experiments.workloads import protocol
from cbp_optax_experiments.workloads import report
from cbp_optax_experiments.workloads import splits
from cbp_optax_experiments.workloads import statistics as stats_lib
from cbp_optax_experiments.workloads import tasks

REFERENCE = arms_lib.REFERENCE


def sgd(schedule):
  """A user arm for the arguments below (never trained)."""
  import optax  # pylint: disable=g-import-not-at-top
  return optax.sgd(schedule)


MINE = f'mine={__name__}:sgd'


@pytest.fixture
def no_training(monkeypatch):
  """Training, and the data a run loads, fail the test if reached."""
  def evaluate_arm(*args, **kwargs):
    pytest.fail('trained although an argument is bad')

  def mnist_data(quick):
    pytest.fail('loaded the data although an argument is bad')

  monkeypatch.setattr(protocol, 'evaluate_arm', evaluate_arm)
  # definitions' workloads read it from there, families' from tasks.
  monkeypatch.setattr(definitions, 'mnist_data', mnist_data)
  monkeypatch.setattr(tasks, 'mnist_data', mnist_data)


def fails_with(capsys, argv, message):
  """``argv`` exits with status 2 and one ``error:`` line holding
  ``message``."""
  with pytest.raises(SystemExit) as info:
    cli.main(argv)
  assert info.value.code == 2, info.value.code
  err = capsys.readouterr().err
  errors = [line for line in err.splitlines() if 'error:' in line]
  assert len(errors) == 1, err
  assert errors[0].startswith('cbp-optax workloads: error: '), err
  assert message in errors[0], err
  return errors[0]


def quick_argv(out):
  return ['--quick', '--no-progress', '--workloads', 'spiral', '--arms',
          REFERENCE, '--out', str(out)]


# ---------------------------------------------------------------------------
# Item 11: every argument checked before anything trains.


@pytest.mark.parametrize('extra, message', [
    (['--workloads', ','], "--workloads ',': an empty name"),
    (['--workloads', 'spiral,'], "--workloads 'spiral,': an empty name"),
    (['--workloads', ''], "--workloads '': an empty name"),
    (['--workloads', 'spirl'], "unknown workload 'spirl'"),
    (['--workloads', 'all,spiral'], "unknown workload 'all'"),
    (['--workloads', 'spiral,spiral'], "'spiral' named more than once"),
    (['--arms', ','], "--arms ',': an empty name"),
    (['--arms', 'adamw,,nadamw'], 'an empty name'),
    (['--arms', 'adam'], "unknown arm 'adam'"),
    (['--arms', 'adamw,adamw'], "'adamw' named more than once"),
    (['--seeds', '0'], "argument --seeds: expected a count N >= 1"),
    (['--seeds', '-2'], "got '-2'"),
    (['--seeds', '1.5'], "got '1.5'"),
    (['--seeds', '0,1'], "got '0,1'"),
    (['--seeds', '1001'], 'the tuning seed(s) [1000]'),
    (['--arm', f'{REFERENCE}=optax:adam'],
     f"'{REFERENCE}' is a built-in arm (it sets the targets)"),
    (['--arm', 'nadamw=optax:adam', '--arms', 'nadamw'],
     "'nadamw' is a built-in arm"),
    (['--arm', MINE, '--arm', MINE, '--arms', 'mine'],
     "'mine' given more than once"),
    (['--arm', f'a|b={__name__}:sgd', '--arms', 'a|b'], "the name 'a|b'"),
    (['--arm', f'a,b={__name__}:sgd'], "the name 'a,b'"),
    (['--arm', f'all={__name__}:sgd'], "the name 'all'"),
    (['--arm', f'default={__name__}:sgd'], "the name 'default'"),
    (['--arms', 'adamw,default'], "unknown arm 'default'"),
    (['--arm', 'nonsense'], 'NAME=module:function'),
    (['--arm', 'x=no_such_module_xyz:f', '--arms', 'x'], 'cannot load'),
    (['--arm', 'x=os:getcwd', '--arms', 'x'],
     "--arm 'x=os:getcwd': calling it on a schedule raised TypeError"),
    (['--arm', 'x=builtins:str', '--arms', 'x'],
     'it returned str, not an optax GradientTransformation'),
    (['--arm', MINE], '--arms \'adamw\' leaves out the --arm mine'),
    (['--centered', 'mnie'], '--centered mnie: no --arm of that name'),
    (['--arm', MINE, '--arms', 'mine,adamw', '--centered', 'mnie'],
     '--centered mnie: no --arm of that name (--arm names: mine)'),
    (['--centered', REFERENCE], f'--centered {REFERENCE}: a built-in arm'),
    (['--centered', 'cbp'], '--centered cbp: a built-in arm'),
    (['--arm', MINE, '--arms', 'mine,adamw', '--centered', 'mine',
      '--centered', 'mine'], '--centered mine: given more than once'),
    (['--arms', 'cbp'], 'spiral has no target to race to (--quick'),
    (['--split', 'train'], "argument --split: expected one of dev, test "
     "(splits.py), got 'train'"),
    (['--split', 'all'], "got 'all'"),
    (['--split', ''], "got ''"),
    (['--split', 'test'], "--workloads 'spiral': 'spiral' (dev split) not in "
     'the test split'),
    (['--split', 'dev', '--workloads', 'spiral,gcn-sbm,vit-mnist'],
     "'gcn-sbm' (test split), 'vit-mnist' (test split) not in the dev split"),
])
def test_a_bad_argument_is_one_error_before_anything_trains(
    tmp_path, capsys, no_training, extra, message):
  out = tmp_path / 'out'
  fails_with(capsys, quick_argv(out) + extra, message)
  assert not out.exists()


def test_set_targets_without_the_reference_is_an_error(
    tmp_path, capsys, no_training):
  fails_with(capsys, ['--set-targets', '--workloads', 'spiral', '--arms',
                      'cbp', '--out', str(tmp_path / 'o')],
             'spiral has no target to race to (--set-targets')


@pytest.mark.parametrize('where', ['file', 'below_a_file'])
def test_out_naming_a_file_is_an_error_before_training(
    tmp_path, capsys, no_training, where):
  (tmp_path / 'f').write_text('keep me')
  out = tmp_path / 'f' if where == 'file' else tmp_path / 'f' / 'sub'
  fails_with(capsys, quick_argv(out), 'is a file, not a folder'
             if where != 'file' else 'a file, not a folder')
  assert (tmp_path / 'f').read_text() == 'keep me'


def test_data_dir_without_mnist_is_an_error(tmp_path, capsys, no_training):
  (tmp_path / 'empty').mkdir()
  fails_with(capsys, quick_argv(tmp_path / 'o') + [
      '--data-dir', str(tmp_path / 'empty')],
             f'--data-dir {tmp_path / "empty"}: No MNIST IDX files')


# ---------------------------------------------------------------------------
# The dev/test split: each split is scored on its own.


def test_split_runs_its_workloads_into_its_own_folder(tmp_path):
  args = cli.parse(['--quick', '--split', 'test'])
  assert args.out == pathlib.Path('workloads') / 'test'
  assert cli.parse(['--quick']).out == pathlib.Path('workloads')
  checked = cli.plan(cli.parse(['--quick', '--split', 'dev', '--arms',
                                REFERENCE, '--out', str(tmp_path)]))
  assert [w.name for w in checked.workloads] == list(splits.workloads('dev'))
  checked = cli.plan(cli.parse(['--quick', '--split', 'dev', '--workloads',
                                'coord-relu,spiral', '--arms', REFERENCE,
                                '--out', str(tmp_path)]))
  assert [w.name for w in checked.workloads] == ['coord-relu', 'spiral']


@pytest.mark.parametrize('held, extra, message', [
    ('dev', ['--split', 'dev'], None),
    ('test', ['--split', 'dev'], 'holds results of the test split and this '
     'run is of the dev split: give --split test to use them, or another '
     '--out (each split is scored on its own; --split dev defaults to '
     'workloads/dev)'),
    (None, ['--split', 'dev'], 'holds results of both splits (a run without '
     '--split) and this run is of the dev split: drop --split to use them'),
    ('dev', [], 'holds results of the dev split and this run is of both '
     'splits (a run without --split): give --split dev to use them, or '
     'another --out (each split is scored on its own)'),
])
def test_results_of_another_split_are_not_merged_into(
    tmp_path, capsys, no_training, held, extra, message):
  write_results(tmp_path, valid_results(split=held))
  before = (tmp_path / report.RESULTS).read_text()
  argv = quick_argv(tmp_path) + extra
  if message is None:
    assert cli.plan(cli.parse(argv)).results['meta']['split'] == held
  else:
    fails_with(capsys, argv, message)
  assert (tmp_path / report.RESULTS).read_text() == before


def test_score_only_takes_split_and_checks_it(tmp_path, capsys):
  write_results(tmp_path, valid_results(split='dev'))
  fails_with(capsys, ['--score-only', '--split', 'test', '--out',
                      str(tmp_path)], 'holds results of the dev split and '
             'this run is of the test split')
  assert cli.main(['--score-only', '--split', 'dev', '--out',
                   str(tmp_path)]) == 0
  assert 'Split: **dev**' in (tmp_path / 'results.md').read_text()


def test_a_split_run_records_its_split(tmp_path, monkeypatch, stub_training):
  monkeypatch.chdir(tmp_path)
  assert cli.main(['--quick', '--no-progress', '--split', 'dev',
                   '--workloads', 'spiral', '--arms', REFERENCE]) == 0
  results = report.load(tmp_path / 'workloads' / 'dev')
  assert results['meta']['split'] == 'dev'
  assert '(dev split)' in (tmp_path / 'workloads' / 'dev' /
                           'results.md').read_text()


def test_runs_folder_that_is_a_file_is_an_error_before_training(
    tmp_path, capsys, no_training):
  (tmp_path / cli.RUNS).write_text('keep me')
  fails_with(capsys, quick_argv(tmp_path),
             f'--out {tmp_path / cli.RUNS}: a file, not a folder')
  assert (tmp_path / cli.RUNS).read_text() == 'keep me'


def test_data_dir_is_in_place_before_a_workload_loads_data(
    tmp_path, monkeypatch):
  # The workloads load (and cache) MNIST when built: --data-dir must be the
  # source by then, not only once training starts.
  monkeypatch.delenv('CBP_OPTAX_MNIST', raising=False)  # restored after
  monkeypatch.setattr(datasets, 'load_mnist', lambda data_dir: None)
  seen = []
  build = definitions.workload
  monkeypatch.setattr(definitions, 'workload', lambda name, quick: (
      seen.append(os.environ.get('CBP_OPTAX_MNIST')), build(name, quick))[1])
  cli.plan(cli.parse(quick_argv(tmp_path / 'o') + [
      '--data-dir', str(tmp_path)]))
  assert seen == [str(tmp_path)]


def test_earlier_baselines_in_out_set_the_target(tmp_path, stub_training):
  # AlgoPerf's rule over every baseline in the folder: a run of one more
  # arm races to the target its earlier AdamW sets (best metric 0.4 on
  # both seeds), not to a target written there by hand (0.5).
  write_results(tmp_path, valid_results())
  assert cli.main(quick_argv(tmp_path) + ['--arm', MINE,
                                          '--arms', 'mine']) == 0
  entry = report.load(tmp_path)['workloads']['spiral']
  assert entry['target'] == 0.4 and entry['target_setter'] == REFERENCE
  assert 'best median of the tuned baselines (adamw)' in entry[
      'target_source']
  assert set(entry['arms']) == {REFERENCE, 'mine'}


@pytest.mark.parametrize('extra, flag', [
    (['--quick'], '--quick'), (['--arms', 'nadamw'], '--arms'),
    (['--arms', 'all'], '--arms'),
    (['--workloads', 'spiral'], '--workloads'), (['--seeds', '2'], '--seeds'),
    (['--arm', MINE], '--arm'), (['--set-targets'], '--set-targets'),
])
def test_score_only_refuses_the_flags_it_would_ignore(
    tmp_path, capsys, no_training, extra, flag):
  write_results(tmp_path, valid_results())
  before = (tmp_path / report.RESULTS).read_text()
  fails_with(capsys, ['--score-only', '--out', str(tmp_path)] + extra,
             f'it takes no {flag}')
  assert (tmp_path / report.RESULTS).read_text() == before
  assert not (tmp_path / 'results.md').exists()


def test_score_only_without_results_is_an_error(tmp_path, capsys):
  fails_with(capsys, ['--score-only', '--out', str(tmp_path)],
             f'--score-only: no {tmp_path / report.RESULTS}')


# ---------------------------------------------------------------------------
# The registries: --help lists them, the arguments accept them.


def test_help_lists_every_workload_and_arm_and_each_default_once(capsys):
  with pytest.raises(SystemExit) as info:
    cli.main(['--help'])
  assert info.value.code == 0
  text = capsys.readouterr().out
  lines = text.splitlines()
  # Each workload once, with its split and the registry's one-line summary.
  for name in definitions.NAMES:
    words = definitions.REGISTRY[name].summary.split()[:2]
    tag = f'[{splits.split_of(name)}]'
    assert sum(line.split()[:4] == [name, tag, *words]
               for line in lines) == 1, name
  for name, arm in arms_lib.builtin_arms().items():
    words = arm.description.split()[:1]
    assert any(line.split()[:2] == [name, *words] for line in lines), name
  assert '(default: None)' not in text
  # One "(default: ...)" at most per flag, none doubled.
  flat = ' '.join(text.split())
  assert '(default: all) (default' not in flat
  for action in cli.make_parser()._actions:
    if action.help:
      shown = cli._HelpFormatter('x')._get_help_string(action)
      assert shown.count('(default:') <= 1, action.option_strings
  assert 'exit status: 0 when every' in flat and '2 for a bad argument' in flat


def test_new_registry_entries_reach_help_and_arguments(
    monkeypatch, capsys, tmp_path, no_training):
  spiral = definitions.FACTORIES['spiral']
  monkeypatch.setitem(definitions.REGISTRY, 'spiral-2', definitions.Entry(
      spiral, 'synthetic-2d', 'a second spiral'))
  monkeypatch.setitem(definitions.FACTORIES, 'spiral-2', spiral)
  monkeypatch.setattr(definitions, 'NAMES', (*definitions.NAMES, 'spiral-2'))
  builtin = arms_lib.builtin_arms
  extra = arms_lib.Arm('extra_arm', lambda lr, ctx: None,
                       description='an arm added to the registry')
  bare = arms_lib.Arm('bare_arm', lambda lr, ctx: None)  # no description
  monkeypatch.setattr(arms_lib, 'builtin_arms',
                      lambda: {**builtin(), 'extra_arm': extra,
                               'bare_arm': bare})
  with pytest.raises(SystemExit):
    cli.main(['--help'])
  text = capsys.readouterr().out
  # In no split yet: listed without one.
  assert any(line.split() == ['spiral-2', 'a', 'second', 'spiral']
             for line in text.splitlines())
  assert 'extra_arm  ' in text and 'an arm added to the registry' in text
  assert any(line.split() == ['bare_arm', '(no', 'description)']
             for line in text.splitlines())
  # Accepted by name, and shadowing it is refused.
  checked = cli.plan(cli.parse(quick_argv(tmp_path / 'o') + [
      '--workloads', 'spiral-2', '--arms', 'extra_arm,adamw']))
  assert [a.name for a in checked.arms] == [REFERENCE, 'extra_arm']
  assert [w.name for w in checked.workloads] == ['spiral']  # its factory
  fails_with(capsys, quick_argv(tmp_path / 'o') + [
      '--arm', 'extra_arm=optax:adam'], "'extra_arm' is a built-in arm")


def test_targets_come_from_the_registry_s_baselines(
    monkeypatch, tmp_path, capsys, stub_training):
  # AlgoPerf's rule: several baselines set the target, where the arms
  # module names them; any of them in --arms gives a --quick run a target.
  monkeypatch.setattr(arms_lib, 'BASELINES', (REFERENCE, 'nadamw'),
                      raising=False)
  checked = cli.plan(cli.parse(quick_argv(tmp_path) + [
      '--arms', 'cbp,nadamw']))
  assert [a.name for a in checked.arms] == ['nadamw', 'cbp']
  calls, fail = stub_training
  fail.update({REFERENCE, 'nadamw'})
  assert cli.main(quick_argv(tmp_path) + [
      '--arms', f'cbp,nadamw,{REFERENCE}']) == 1
  # Both baselines are tried before the others are given up.
  assert calls == [('spiral', 'nadamw'), ('spiral', REFERENCE)]
  assert ('spiral / cbp: not run (no target: adamw, which sets it, failed)'
          in capsys.readouterr().err)


def test_plan_of_good_arguments(tmp_path):
  checked = cli.plan(cli.parse([
      '--workloads', ' spiral , mnist-mlp', '--arms', f'mine,{REFERENCE}',
      '--arm', MINE, '--centered', 'mine', '--seeds', '4', '--out',
      str(tmp_path / 'new' / 'deeper')]))
  assert [w.name for w in checked.workloads] == ['spiral', 'mnist-mlp']
  assert [a.name for a in checked.arms] == [REFERENCE, 'mine']
  assert checked.arms[1].centered
  assert checked.seeds == (0, 1, 2, 3)
  assert checked.results is None
  every = cli.plan(cli.parse(['--quick', '--workloads', 'all', '--arms',
                              'all', '--out', str(tmp_path / 'o')]))
  assert [w.name for w in every.workloads] == list(definitions.NAMES)
  assert {a.name for a in every.arms} == set(arms_lib.builtin_arms())
  assert every.seeds == tuple(range(cli.QUICK_SEEDS))
  quick = cli.plan(cli.parse(['--quick', '--out', str(tmp_path / 'q')]))
  assert [w.name for w in quick.workloads] == list(cli.QUICK_WORKLOADS)
  full = cli.plan(cli.parse(['--split', 'dev', '--out', str(tmp_path / 'f')]))
  assert full.seeds == tuple(range(cli.DEFAULT_SEEDS))
  assert [a.name for a in full.arms] == list(arms_lib.default_arms())
  assert not (tmp_path / 'new').exists()  # planning writes nothing


# ---------------------------------------------------------------------------
# Item 10: damaged results.json, on every reading path.


def valid_results(quick=True, seeds=(0, 1, 2), split=None):
  """A results.json as a run writes it: spiral, AdamW, ``seeds``, of
  ``split`` (None: a run without --split)."""
  workload = definitions.workload('spiral', quick)
  entry = report.workload_entry(workload, 0.5, 'set by hand')
  chunks = workload.steps // workload.eval_every
  curve = [0.1 * (i + 1) for i in range(chunks)]
  entry['arms'][REFERENCE] = {
      'learning_rate': 0.001, 'seeds': list(seeds),
      'steps_to_target': [None] * len(seeds),
      'diverged': [False] * len(seeds), 'final_metric': [curve[-1]] * len(
          seeds), 'best_metric': [curve[-1]] * len(seeds),
      'curves': [curve] * len(seeds), 'cost_vs_adamw': 1.0,
      'initial_metric': [0.05] * len(seeds), 'description': 'optax.adamw'}
  report.apply_target(entry)
  return {'workloads': {'spiral': entry}, 'score': {},
          'meta': {'quick': quick, 'seeds': list(seeds), 'split': split}}


def write_results(out, results):
  out.mkdir(parents=True, exist_ok=True)
  (out / report.RESULTS).write_text(json.dumps(results))


def _set(path, value):
  def damage(results):
    *parents, last = path
    node = results
    for key in parents:
      node = node[key]
    if value is KeyError:
      del node[last]
    else:
      node[last] = value
    return results
  return damage


ARM = ('workloads', 'spiral', 'arms', REFERENCE)
DAMAGES = {
    'not_json': ('{"workloads": {', 'not valid JSON (Expecting'),
    'a_list': ('[1, 2]', 'the top level must be an object, got [1, 2]'),
    'no_meta': (_set(('meta',), KeyError), 'meta is missing'),
    'no_quick': (_set(('meta', 'quick'), KeyError), 'meta.quick is missing'),
    'workloads_list': (_set(('workloads',), []),
                       'workloads must be an object, got []'),
    'entry_number': (_set(('workloads', 'spiral'), 3),
                     'workloads.spiral must be an object, got 3'),
    'no_eval_every': (_set(('workloads', 'spiral', 'eval_every'), KeyError),
                      'workloads.spiral.eval_every is missing'),
    'target_text': (_set(('workloads', 'spiral', 'target'), 'high'),
                    'workloads.spiral.target must be a number or null, got '
                    '"high"'),
    'arms_list': (_set(('workloads', 'spiral', 'arms'), [1]),
                  'workloads.spiral.arms must be an object'),
    'no_curves': (_set(ARM + ('curves',), KeyError),
                  'workloads.spiral.arms.adamw.curves is missing'),
    'diverged_text': (_set(ARM + ('diverged',), 'yes'),
                      'arms.adamw.diverged must be a list of true or false'),
    'nan_cost': (_set(ARM + ('cost_vs_adamw',), float('nan')),
                 'cost_vs_adamw must be a positive number, got nan'),
    'short_curves': (_set(ARM + ('curves',), [[0.5]]),
                     'lengths seeds 3, steps_to_target 3, diverged 3, '
                     'final_metric 3, best_metric 3, curves 1'),
    'no_seeds': (lambda r: {**r, 'workloads': {'spiral': {
        **r['workloads']['spiral'], 'arms': {REFERENCE: {
            **r['workloads']['spiral']['arms'][REFERENCE],
            **{k: [] for k in ('seeds', 'steps_to_target', 'diverged',
                               'final_metric', 'best_metric',
                               'curves')}}}}}},
                 'one value per evaluation seed (at least one)'),
    # The fields of the suite's split, checked where present.
    'split_text': (_set(('meta', 'split'), 'train'),
                   'meta.split must be null or one of "dev", "test", got '
                   '"train"'),
    'family_number': (_set(('workloads', 'spiral', 'family'), 3),
                      'workloads.spiral.family must be a string, got 3'),
    'validation_size_zero': (_set(('workloads', 'spiral', 'validation_size'),
                                  0), 'validation_size must be a positive '
                             'integer or null, got 0'),
    'target_setter_list': (_set(('workloads', 'spiral', 'target_setter'),
                                [REFERENCE]),
                           'target_setter must be an arm name or null'),
    'initial_metric_text': (_set(ARM + ('initial_metric',), ['low', 'low']),
                            'arms.adamw.initial_metric must be a list of '
                            'numbers or nulls'),
    'short_initial_metric': (_set(ARM + ('initial_metric',), [0.1]),
                             'curves 3, initial_metric 1'),
}


@pytest.mark.parametrize('path', ['score_only', 'resume'])
@pytest.mark.parametrize('damage', list(DAMAGES))
def test_damaged_results_is_one_error_naming_the_file_and_field(
    tmp_path, capsys, no_training, path, damage):
  change, message = DAMAGES[damage]
  text = change if isinstance(change, str) else json.dumps(
      change(valid_results()))
  (tmp_path / report.RESULTS).write_text(text)
  argv = (['--score-only', '--out', str(tmp_path)] if path == 'score_only'
          else quick_argv(tmp_path))
  line = fails_with(capsys, argv, message)
  assert f'{tmp_path / report.RESULTS} is damaged: ' in line
  assert (tmp_path / report.RESULTS).read_text() == text  # left as it was
  assert not (tmp_path / 'results.md').exists()


def test_results_that_cannot_be_read_name_the_file(
    tmp_path, capsys, no_training):
  (tmp_path / report.RESULTS).mkdir()
  fails_with(capsys, quick_argv(tmp_path),
             f'{tmp_path / report.RESULTS} cannot be read')
  (tmp_path / report.RESULTS).rmdir()
  (tmp_path / report.RESULTS).write_bytes(b'\xff\xfe{')
  fails_with(capsys, ['--score-only', '--out', str(tmp_path)],
             f'{tmp_path / report.RESULTS} cannot be read')


def test_the_committed_suite_results_pass_the_check():
  path = (pathlib.Path(__file__).resolve().parents[2] / 'results'
          / 'workloads' / 'seven-workload-2026-12-01' / 'results.json')
  report.validate(json.loads(path.read_text()))


def test_score_only_of_valid_results_still_works(tmp_path, capsys):
  write_results(tmp_path, valid_results())
  assert cli.main(['--score-only', '--out', str(tmp_path),
                   '--no-progress']) == 0
  assert 'rescored' in capsys.readouterr().out
  assert 'Verdict (spiral)' in (tmp_path / 'results.md').read_text()


# ---------------------------------------------------------------------------
# Results in --out that this run cannot share tables with.


@pytest.mark.parametrize('old, extra, message', [
    (dict(quick=False, seeds=(0, 1, 2)), [],
     "holds a full-size run's results and this is a --quick run"),
    (dict(quick=True, seeds=(0, 1)), ['--seeds', '3'],
     'on the evaluation seeds [0, 1], not [0, 1, 2]: give --seeds 2, or '
     'another --out'),
    (dict(quick=True, seeds=(5, 6)), [], 'on the evaluation seeds [5, 6], '
     'not [0, 1, 2]: give the same seeds'),
])
def test_merging_unpaired_results_is_an_error_and_keeps_them(
    tmp_path, capsys, no_training, old, extra, message):
  write_results(tmp_path, valid_results(**old))
  before = (tmp_path / report.RESULTS).read_text()
  fails_with(capsys, quick_argv(tmp_path) + extra, message)
  assert (tmp_path / report.RESULTS).read_text() == before


def test_merging_a_changed_workload_is_an_error(tmp_path, capsys,
                                                no_training):
  results = valid_results()
  results['workloads']['spiral']['budget_steps'] *= 2
  write_results(tmp_path, results)
  fails_with(capsys, quick_argv(tmp_path),
             'holds spiral with another budget_steps (80 there, 40 now)')


def test_a_user_arm_merges_into_results_that_hold_the_target(tmp_path):
  # The README's recipe: one more arm into an earlier run's folder, without
  # rerunning AdamW (its target is in results.json).
  write_results(tmp_path, valid_results())
  checked = cli.plan(cli.parse(quick_argv(tmp_path) + [
      '--arm', MINE, '--arms', 'mine']))
  assert [a.name for a in checked.arms] == ['mine']


# ---------------------------------------------------------------------------
# Item 10: failed arms, and writing.


def fake_outcome(workload, seeds):
  chunks = workload.steps // workload.eval_every
  metrics = np.linspace(0.2, 0.9, chunks)
  runs = [protocol.RunRecord(s, 1e-3, np.ones(workload.steps), metrics,
                             False) for s in seeds]
  return protocol.ArmOutcome(1e-3, {1e-3: runs[:1]}, runs, 1.0, 1e-3, 1e-3,
                             0.1, False)


@pytest.fixture
def stub_training(monkeypatch):
  """``evaluate_arm`` returns a made-up outcome at once, or raises on the
  third run of the (workload, arm) pairs (or arms) in ``fail``; ``calls``
  records what ran."""
  calls, fail = [], set()

  def evaluate_arm(workload, arm, reference, seeds, on_run=None,
                   **kwargs):
    calls.append((workload.name, arm.name))
    if (workload.name, arm.name) in fail or arm.name in fail:
      on_run()
      on_run()  # two runs done, then the third raises
      raise RuntimeError(f'{arm.name} broke')
    return fake_outcome(workload, seeds)

  monkeypatch.setattr(protocol, 'evaluate_arm', evaluate_arm)
  return calls, fail


def test_every_arm_failing_exits_1_and_writes_nothing(
    tmp_path, capsys, stub_training):
  calls, fail = stub_training
  fail.update({REFERENCE, 'cbp'})
  out = tmp_path / 'out'
  code = cli.main(['--quick', '--no-progress', '--workloads',
                   'spiral,mnist-mlp', '--arms', f'cbp,{REFERENCE}',
                   '--out', str(out)])
  assert code == 1
  captured = capsys.readouterr()
  assert 'wrote' not in captured.out
  assert not out.exists()
  assert ('error: 4 of 4 (workload, arm) failed; nothing was written'
          in captured.err)
  assert 'spiral / adamw: RuntimeError: adamw broke' in captured.err
  # AdamW sets a --quick run's target: the others are not trained for
  # nothing, and say why.
  assert calls == [('spiral', REFERENCE), ('mnist-mlp', REFERENCE)]
  assert ('spiral / cbp: not run (no target: adamw, which sets it, failed)'
          in captured.err)


def test_a_partly_failed_run_writes_the_rest_and_exits_1(
    tmp_path, capsys, stub_training):
  calls, fail = stub_training
  fail.add(('mnist-mlp', 'nadamw'))
  code = cli.main(['--quick', '--no-progress', '--workloads',
                   'spiral,mnist-mlp', '--arms', f'{REFERENCE},nadamw',
                   '--out', str(tmp_path)])
  assert code == 1
  captured = capsys.readouterr()
  assert f'wrote {tmp_path / "results.md"}' in captured.out
  assert 'error: 1 of 4 (workload, arm) failed:' in captured.err
  assert ('mnist-mlp / nadamw: RuntimeError: nadamw broke (after 2 completed '
          'runs)') in captured.err
  results = report.load(tmp_path)
  assert set(results['workloads']['spiral']['arms']) == {REFERENCE, 'nadamw'}
  assert set(results['workloads']['mnist-mlp']['arms']) == {REFERENCE}
  assert len(calls) == 4


def test_a_run_that_succeeds_exits_0(tmp_path, capsys, stub_training):
  argv = [a for a in quick_argv(tmp_path) if a != '--no-progress']
  assert cli.main(argv) == 0  # with the progress bar
  assert 'error' not in capsys.readouterr().err
  assert report.load(tmp_path)['workloads']['spiral']['target'] is not None


def test_an_unwritable_out_is_one_message_not_a_traceback(
    tmp_path, monkeypatch, stub_training):
  def write(out, results):
    raise PermissionError(13, 'Permission denied')

  monkeypatch.setattr(report, 'write', write)
  with pytest.raises(SystemExit) as info:
    cli.main(quick_argv(tmp_path / 'o'))
  assert 'error: cannot write the results into' in str(info.value.code)
  assert 'Permission denied' in str(info.value.code)


def test_an_interrupted_write_leaves_the_previous_results_whole(
    tmp_path, monkeypatch):
  results = valid_results()
  report.write(tmp_path, copy.deepcopy(results))
  before = (tmp_path / report.RESULTS).read_text()
  changed = copy.deepcopy(results)
  changed['workloads']['spiral']['description'] = 'the new results'

  def replace(src, dst):  # the process dies between writing and renaming
    raise OSError(28, 'No space left on device')

  monkeypatch.setattr(os, 'replace', replace)
  with pytest.raises(OSError, match='No space left'):
    report.write(tmp_path, changed)
  assert (tmp_path / report.RESULTS).read_text() == before
  assert sorted(p.name for p in tmp_path.iterdir()) == [
      'performance_profile.png', 'performance_profile_wall_clock.png',
      report.RESULTS, 'results.md']
  monkeypatch.undo()
  report.write(tmp_path, changed)
  assert report.load(tmp_path)['workloads']['spiral']['description'] == (
      'the new results')


# ---------------------------------------------------------------------------
# cbp-optax compare: the same classes.


TINY = ['--steps', '3', '--width', '8', '--depth', '1', '--batch-size', '16']


@pytest.mark.parametrize('extra, message', [
    (['--steps', '0'], 'argument --steps: expected an integer >= 2'),
    (['--steps', '1'], "(the first step compiles and is not timed), got '1'"),
    (['--steps', '-5'], "got '-5'"),
    (['--batch-size', '0'], 'argument --batch-size: expected an integer >= 1'),
    (['--width', '0'], 'argument --width: expected an integer >= 1'),
    (['--width', '-1'], 'argument --width'),
    (['--depth', '-1'], 'argument --depth: expected an integer >= 0'),
    (['--seed', '-1'], 'argument --seed: expected an integer >= 0'),
    (['--lr-adam', '-1'], 'argument --lr-adam: expected a finite learning '
     'rate > 0'),
    (['--lr-adam', 'nan'], "got 'nan'"),
    (['--lr-cbp', 'inf'], "argument --lr-cbp: expected a finite learning "
     "rate > 0, got 'inf'"),
    (['--lr-cbp', '0'], 'argument --lr-cbp'),
    (['--out', '{file}'], '--out {file}: a file, not a folder'),
    (['--out', '{file}/sub'], '{file} is a file, not a folder'),
    (['--data-dir', '{file}'], '--data-dir {file}: a file, not a folder'),
])
def test_compare_bad_arguments_fail_before_reading_data(
    tmp_path, capsys, monkeypatch, extra, message):
  monkeypatch.setattr(datasets, 'find_mnist', lambda *a, **k: pytest.fail(
      'read the data although an argument is bad'))
  file = tmp_path / 'file'
  file.write_text('keep me')
  extra = [e.format(file=file) for e in extra]
  with pytest.raises(SystemExit) as info:
    top_cli.main(['compare', *TINY, *extra])
  assert info.value.code == 2
  err = capsys.readouterr().err
  assert err.splitlines()[-1].startswith('cbp-optax compare: error: ')
  assert message.format(file=file) in err
  assert file.read_text() == 'keep me'


def test_compare_without_mnist_is_one_line(tmp_path, monkeypatch):
  monkeypatch.delenv('CBP_OPTAX_MNIST', raising=False)
  with pytest.raises(SystemExit) as info:
    top_cli.main(['compare', *TINY, '--no-download', '--data-dir',
                  str(tmp_path / 'nowhere')])
  assert str(info.value.code).startswith(
      f'cbp-optax compare: error: No MNIST IDX files in {tmp_path}')


def test_the_default_arms_leave_out_not_by_default_and_keep_user_arms(
    tmp_path):
  builtin = list(arms_lib.builtin_arms())
  assert set(arms_lib.NOT_BY_DEFAULT) < set(builtin)
  assert list(arms_lib.default_arms()) == [
      name for name in builtin if name not in arms_lib.NOT_BY_DEFAULT]
  out = ['--out', str(tmp_path / 'o')]
  mine = cli.plan(cli.parse(['--arm', MINE, '--centered', 'mine'] + out))
  assert [a.name for a in mine.arms] == [*arms_lib.default_arms(), 'mine']
  named = cli.plan(cli.parse(['--arms', 'default'] + out))
  assert [a.name for a in named.arms] == list(arms_lib.default_arms())
  every = cli.plan(cli.parse(['--arms', 'all'] + out))
  assert [a.name for a in every.arms] == builtin
  # A run that sets its own targets trains every baseline, first.
  setting = cli.plan(cli.parse(['--set-targets'] + out))
  names = [a.name for a in setting.arms]
  assert names[:len(arms_lib.BASELINES)] == list(arms_lib.BASELINES)
  assert set(names) == set(arms_lib.default_arms()) | set(arms_lib.BASELINES)


def test_help_marks_the_arms_a_default_run_leaves_out():
  # One paragraph per arm in the listing: its name, then its description.
  listed = {block.split()[0]: ' '.join(block.split())
            for block in re.split(r'\n  (?=\S)', cli.epilog())}
  for name in arms_lib.builtin_arms():
    marked = listed[name].endswith('(not in the default arms)')
    assert marked == (name in arms_lib.NOT_BY_DEFAULT), listed[name]


# ---------------------------------------------------------------------------
# --workload: the user's own model through the same protocol

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / 'examples'


def not_a_workload(quick):
  del quick
  return {'name': 'nope'}


def test_own_workload_runs_end_to_end_with_ladder_and_verdict(
    tmp_path, monkeypatch, capsys):
  monkeypatch.syspath_prepend(str(EXAMPLES))
  out = tmp_path / 'moons'
  assert cli.main(['--quick', '--workload', 'moons=own_workload:moons',
                   '--arms', 'adamw,adamw_centered', '--out', str(out),
                   '--no-progress']) == 0
  results = json.loads((out / 'results.json').read_text())
  assert list(results['workloads']) == ['moons']
  entry = results['workloads']['moons']
  assert 'user workload own_workload:moons' in entry['description']
  assert len(entry['ladder']['targets']) == 8
  assert set(results['profiles']['anytime']['score']) == {
      'adamw', 'adamw_centered'}
  pooled = [c for c in results['anytime_comparisons']
            if c['workload'] == 'pooled']
  assert [(c['a'], c['b']) for c in pooled] == [('adamw_centered', 'adamw')]
  assert pooled[0]['verdict'] in (stats_lib.BETTER, stats_lib.WORSE,
                                  stats_lib.NO_DIFFERENCE)
  printed = capsys.readouterr().out
  assert 'adamw_centered | adamw |' in printed
  assert '### moons' in (out / 'results.md').read_text()


def test_own_workload_refusals(tmp_path, capsys, no_training, monkeypatch):
  monkeypatch.syspath_prepend(str(EXAMPLES))
  out = str(tmp_path / 'o')
  fails_with(capsys, ['--quick', '--workload',
                      f'x={__name__}:not_a_workload', '--out', out],
             'returned dict, not a Workload')
  fails_with(capsys, ['--quick', '--workload', 'x=nowhere_module:f',
                      '--out', out], 'cannot load')
  fails_with(capsys, ['--quick', '--workload', 'spiral=own_workload:moons',
                      '--out', out], "is a built-in workload's name")
  fails_with(capsys, ['--quick', '--workload', 'm=own_workload:moons',
                      '--workloads', 'spiral', '--out', out],
             'leaves out the --workload m')
  fails_with(capsys, ['--workload', 'm=own_workload:moons', '--split', 'dev',
                      '--out', out], 'is in no split')
  fails_with(capsys, ['--quick', '--workload', 'bad', '--out', out],
             'NAME=module:function')


# No command replaces the results another command wrote in its --out.


def write_compare_results(out):
  out.mkdir(parents=True, exist_ok=True)
  (out / 'results.md').write_text('# cbp-optax compare\n\ntable\n')
  (out / report.RESULTS).write_text(json.dumps({'config': {}, 'methods': []}))


def contents(out):
  return {p.name: p.read_text() for p in sorted(out.iterdir()) if p.is_file()}


def test_compare_refuses_an_out_holding_the_workloads_results(
    tmp_path, capsys, monkeypatch):
  monkeypatch.setattr(datasets, 'find_mnist', lambda *a, **k: pytest.fail(
      'read the data although --out holds another command\'s results'))
  write_results(tmp_path, valid_results())
  (tmp_path / 'results.md').write_text('# Workloads\n')
  before = contents(tmp_path)
  with pytest.raises(SystemExit) as info:
    top_cli.main(['compare', *TINY, '--out', str(tmp_path)])
  assert info.value.code == 2
  assert 'written by cbp-optax workloads' in capsys.readouterr().err
  assert contents(tmp_path) == before


def test_workloads_and_reproduce_refuse_an_out_holding_compares_results(
    tmp_path, capsys, no_training):
  write_compare_results(tmp_path)
  before = contents(tmp_path)
  fails_with(capsys, quick_argv(tmp_path), 'written by cbp-optax compare')
  fails_with(capsys, ['--score-only', '--out', str(tmp_path)],
             'written by cbp-optax compare')
  write_compare_results(tmp_path / 'quadratic')
  with pytest.raises(SystemExit) as info:
    reproduce_cli.parse(['quadratic', '--out', str(tmp_path)])
  assert info.value.code == 2
  assert 'results of cbp-optax compare' in capsys.readouterr().err
  assert contents(tmp_path) == before


def test_compare_may_replace_its_own_results(tmp_path):
  write_compare_results(tmp_path)
  outputs.check_results_owner(tmp_path, outputs.COMPARE)  # no error
  outputs.check_results_owner(tmp_path / 'empty', outputs.COMPARE)
  (tmp_path / report.RESULTS).write_text('{"not": "compare"}')
  with pytest.raises(ValueError, match='written by another command'):
    outputs.check_results_owner(tmp_path, outputs.COMPARE)
