"""The ``cbp-optax`` command line: parsing, ``compare --out`` and
``reproduce``'s summary and ``--download``, run in-process on small inputs."""

import json
import pathlib
import subprocess
import sys
import types

import numpy as np
import pytest

from cbp_optax_experiments import cli
from cbp_optax_experiments import datasets
from cbp_optax_experiments.reproduce import cli as reproduce_cli
from tests.mnist import MNIST_DIR
from tests.mnist import needs_mnist

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ['--steps', '3', '--width', '8', '--depth', '1', '--batch-size', '16']


@pytest.fixture
def offline(tmp_path, monkeypatch):
  """No $CBP_OPTAX_MNIST, an empty user cache, and no network."""
  monkeypatch.delenv('CBP_OPTAX_MNIST', raising=False)
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'cache'))

  def urlopen(url, timeout):
    raise OSError(f'no network for {url}')

  monkeypatch.setattr(datasets.urllib.request, 'urlopen', urlopen)


def test_version(capsys):
  with pytest.raises(SystemExit) as info:
    cli.main(['--version'])
  assert info.value.code == 0
  assert capsys.readouterr().out.strip() == f'cbp-optax {cli._version()}'
  assert cli._version()[0].isdigit()


@pytest.mark.parametrize('argv, message', [
    (['foo'], "invalid choice: 'foo'"),
    ([], 'the following arguments are required'),
    (['--steps', '3'], 'invalid choice'),
])
def test_unknown_or_missing_command_is_an_error(capsys, argv, message):
  with pytest.raises(SystemExit) as info:
    cli.main(argv)
  assert info.value.code == 2
  error = capsys.readouterr().err
  assert message in error and 'compare' in error and 'reproduce' in error


def test_options_before_the_command_are_refused(capsys):
  with pytest.raises(SystemExit) as info:
    cli.main(['--bogus', 'compare'])
  assert info.value.code == 2
  assert 'before the command: --bogus' in capsys.readouterr().err


def assert_every_flag_has_help_and_a_default(parser):
  options = [a for a in parser._actions
             if a.option_strings and a.dest != 'help']
  assert options
  formatter = parser._get_formatter()
  for action in options:
    assert action.help, action.option_strings
    # What --help prints for the flag: its text, then its default.
    assert '%(default)' in formatter._get_help_string(action), (
        action.option_strings)
    # The formatter adds "(default: ...)": the text must not say it again.
    assert '(default' not in action.help, action.option_strings
  assert parser.format_help().count('(default:') >= len(options)


def test_every_compare_flag_has_help_and_a_default():
  assert_every_flag_has_help_and_a_default(cli.compare_parser())


def test_every_reproduce_flag_has_help_and_a_default(monkeypatch):
  parsers = []

  def parse_args(self, argv=None, namespace=None):
    parsers.append(self)
    raise SystemExit(0)

  monkeypatch.setattr(reproduce_cli.argparse.ArgumentParser, 'parse_args',
                      parse_args)
  with pytest.raises(SystemExit):
    reproduce_cli.parse(['quadratic'])
  assert_every_flag_has_help_and_a_default(parsers[0])


def test_compare_offline_uses_the_bundled_subset_and_writes_its_results(
    tmp_path, offline, capsys):
  out = tmp_path / 'out'
  assert cli.main(['compare', *TINY, '--out', str(out)]) == 0
  printed = capsys.readouterr().out
  assert 'MNIST subset bundled with cbp_optax' in printed
  assert 'could not be downloaded' in printed
  results = json.loads((out / 'results.json').read_text())
  methods = [m['method'] for m in results['methods']]
  assert methods == ['Adam', 'Adam + Center', 'CBP (M1+M2+M3)',
                     cli.RECOMMENDED]
  for method in results['methods']:
    assert len(method['train_loss']) == 3
    assert np.all(np.isfinite(method['train_loss']))
    assert method['train_loss_ema'] == pytest.approx(
        method['train_loss_ema_curve'][-1])
    assert 0.0 <= method['test_accuracy'] <= 1.0
    # Timed step by step beside Adam (2 timed steps: the first compiles).
    low, mid, high = method['ratio_to_adam_quartiles']
    assert 0 < low <= mid <= high
    assert method['ms_per_step'] == method['ms_per_step_quartiles'][1]
  assert results['methods'][0]['ratio_to_adam_quartiles'] == [1.0, 1.0, 1.0]
  assert results['config']['steps'] == 3
  assert 'bundled' in results['config']['data_source']
  table = (out / 'results.md').read_text()
  assert all(f'| {name}' in table for name in methods)
  assert '/ Adam, median [IQR]' in table and '1.00 [1.00, 1.00]' in table
  assert (out / 'loss_curves.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_compare_out_without_matplotlib_names_the_extra_before_training(
    tmp_path, offline, monkeypatch):
  for name in [m for m in sys.modules if m.startswith('matplotlib')]:
    monkeypatch.delitem(sys.modules, name)
  monkeypatch.setitem(sys.modules, 'matplotlib', None)  # import fails
  monkeypatch.setattr(datasets, 'find_mnist', lambda *a, **k: pytest.fail(
      'loaded data before checking for matplotlib'))
  with pytest.raises(SystemExit,
                     match=r'pip install \./experiments'):
    cli.main(['compare', *TINY, '--out', str(tmp_path / 'out')])
  assert not (tmp_path / 'out').exists()


def fake_study(title):
  def run(ctx):
    ctx.out.mkdir(parents=True, exist_ok=True)
    (ctx.out / 'results.md').write_text(f'# {title}\n\nnumbers\n')
    return types.SimpleNamespace(summary={'title': title})
  return types.SimpleNamespace(TITLE=title, run=run)


@pytest.fixture
def fake_studies(monkeypatch):
  """Every study replaced by an instant one, and no XLA flag change."""
  monkeypatch.setattr(reproduce_cli, '_prefer_fast_cpu_convolutions',
                      lambda: None)
  real_import = reproduce_cli.importlib.import_module
  studies = {f'cbp_optax_experiments.reproduce.{module}'
             for module in reproduce_cli.STUDIES.values()}

  def import_module(name, package=None):
    if name in studies:
      return fake_study('Title of ' + name.rsplit('.', 1)[-1])
    return real_import(name, package)

  monkeypatch.setattr(reproduce_cli.importlib, 'import_module', import_module)


def test_reproduce_summary_accumulates_studies(tmp_path, fake_studies):
  out = ['--out', str(tmp_path), '--no-progress']
  assert reproduce_cli.main(['quadratic', '--quick', *out]) == 0
  assert reproduce_cli.main(['disparity', 'factorial', *out]) == 0
  first = json.loads((tmp_path / 'summary.json').read_text())
  assert list(first) == ['quadratic', 'disparity', 'factorial']
  assert first['quadratic']['command'] == 'cbp-optax reproduce quadratic --quick'
  assert first['factorial']['title'] == 'Title of factorial'
  # A rerun replaces its own row and keeps the others.
  assert reproduce_cli.main(['quadratic', *out]) == 0
  summary = json.loads((tmp_path / 'summary.json').read_text())
  assert list(summary) == ['quadratic', 'disparity', 'factorial']
  assert summary['quadratic']['command'] == 'cbp-optax reproduce quadratic'
  assert summary['disparity'] == first['disparity']
  markdown = (tmp_path / 'summary.md').read_text()
  rows = [line for line in markdown.splitlines() if line.startswith('| ')][1:]
  assert [row.split('|')[1].strip() for row in rows] == [
      'quadratic', 'disparity', 'factorial']
  assert 'Title of disparity' in markdown


@pytest.mark.parametrize('old, warning', [
    ('{not json', 'unreadable'), ('[1, 2]', 'not a study summary')])
def test_reproduce_summary_survives_an_unusable_old_summary(
    tmp_path, fake_studies, capsys, old, warning):
  (tmp_path / 'summary.json').write_text(old)
  assert reproduce_cli.main(['quadratic', '--out', str(tmp_path),
                             '--no-progress']) == 0
  assert list(json.loads((tmp_path / 'summary.json').read_text())) == [
      'quadratic']
  assert warning in capsys.readouterr().err


@pytest.mark.parametrize('argv, downloads', [
    (['mnist', '--download'], [True]),
    (['mnist'], []),
    (['quadratic', '--download'], []),  # no real-data study: nothing to fetch
])
def test_reproduce_download_fetches_mnist_only_for_real_data_studies(
    tmp_path, fake_studies, monkeypatch, argv, downloads):
  calls = []

  def find_mnist(data_dir=None, *, download=True, bundled=False):
    calls.append((data_dir, download, bundled))
    return types.SimpleNamespace(source='fake MNIST')

  monkeypatch.setattr(datasets, 'find_mnist', find_mnist)
  assert reproduce_cli.main([*argv, '--out', str(tmp_path / 'o'),
                             '--data-dir', str(tmp_path / 'd'),
                             '--no-progress']) == 0
  assert [download for _, download, _ in calls] == downloads
  assert all(d == tmp_path / 'd' and not b for d, _, b in calls)


def test_a_quick_run_says_so_in_its_results(tmp_path, fake_studies):
  out = ['--out', str(tmp_path), '--no-progress']
  assert reproduce_cli.main(['quadratic', '--quick', *out]) == 0
  assert reproduce_cli.main(['disparity', *out]) == 0
  quick = (tmp_path / 'quadratic' / 'results.md').read_text().splitlines()
  assert quick[0] == '# Title of quadratic'
  assert quick[2].startswith('> Quick run (`--quick`)')
  assert 'numbers' in quick[3:]
  full = (tmp_path / 'disparity' / 'results.md').read_text()
  assert 'Quick run' not in full


# The default tier runs the compare job offline (above); this one on real
# MNIST, in a subprocess.
@pytest.mark.slow
@needs_mnist
def test_compare_job_prints_a_table():
  done = subprocess.run(
      [sys.executable, '-m', 'cbp_optax_experiments.cli', 'compare',
       '--steps', '20', '--width', '32', '--data-dir', str(MNIST_DIR)],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  out = done.stdout
  lines = [l for l in out.splitlines() if l.startswith('| ')]
  assert [l.split('|')[1].strip() for l in lines[1:]] == [
      'Adam', 'Adam + Center', 'CBP (M1+M2+M3)', cli.RECOMMENDED]


# --- a missing extra: the command names it ------------------------------------

EXTRA = ('matplotlib', 'scipy', 'tqdm')


@pytest.mark.parametrize('missing', EXTRA)
def test_cli_names_the_extra_when_a_dependency_is_missing(missing):
  # `reproduce` on a study that needs all three; the dependency is made
  # unimportable before anything is loaded.
  code = (
      'import sys\n'
      f'sys.modules[{missing!r}] = None\n'
      'from cbp_optax_experiments import cli\n'
      "from cbp_optax_experiments.reproduce import cli as reproduce_cli\n"
      'reproduce_cli._prefer_fast_cpu_convolutions = lambda: None\n'
      "sys.exit(cli.main(['reproduce', 'quadratic', '--quick', '--out', "
      "'/nonexistent/never-written']))\n")
  result = subprocess.run([sys.executable, '-c', code], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          check=False)
  assert result.returncode != 0
  assert 'Traceback' not in result.stderr, result.stderr
  message = result.stderr.strip().splitlines()
  assert len(message) == 1, result.stderr
  assert missing in message[0]
  assert "pip install ./experiments" in message[0]


def test_cli_extra_check_covers_imports_deeper_than_the_commands(monkeypatch):
  def needs_scipy(argv):
    del argv
    import scipy.special  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
    return 0

  monkeypatch.setitem(sys.modules, 'scipy', None)
  monkeypatch.setitem(cli._COMMANDS, 'compare',
                      (needs_scipy, cli._COMMANDS['compare'][1]))
  with pytest.raises(SystemExit,
                     match=r"needs scipy.*pip install \./experiments"):
    cli.main(['compare'])


def test_cli_lets_other_import_errors_through(monkeypatch):
  def needs_something_else(argv):
    del argv
    import not_a_real_module_cbp  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
    return 0

  monkeypatch.setitem(cli._COMMANDS, 'compare',
                      (needs_something_else, cli._COMMANDS['compare'][1]))
  with pytest.raises(ModuleNotFoundError, match='not_a_real_module_cbp'):
    cli.main(['compare'])


def test_reproduce_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
  from cbp_optax_experiments.reproduce import cli as reproduce_cli  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(reproduce_cli, '_prefer_fast_cpu_convolutions',
                      lambda: None)
  for name in [m for m in sys.modules if m.startswith('matplotlib')] + [
      'cbp_optax_experiments.reproduce.plotting']:
    monkeypatch.delitem(sys.modules, name, raising=False)
  monkeypatch.setitem(sys.modules, 'matplotlib', None)  # import fails
  with pytest.raises(SystemExit, match=r'pip install \./experiments'):
    reproduce_cli.main(['quadratic', '--quick', '--out', str(tmp_path)])
