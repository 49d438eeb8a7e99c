"""One answer to "what should I use?": every page that gives it gives the
decision rule's choice on the committed dev results, in the same words, with
the committed numbers (``summary.answer``)."""

import ast
import json
import pathlib
import re

import pytest

import cbp_optax as cbp
from cbp_optax_experiments import cli
from cbp_optax_experiments.workloads import decision
from cbp_optax_experiments.workloads import summary

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / 'results' / 'workloads'
# Each page that gives the recommendation; a module's page is its docstring.
PAGES = ('README.md', 'docs/faq.md', 'examples/mnist_nnx.py',
         'examples/mnist_linen.py')


def _load(split):
  return json.loads((RESULTS / split / 'results.json').read_text())


@pytest.fixture(scope='module')
def answer():
  return summary.answer(_load('dev'), _load('test'))


def _plain(text: str) -> str:
  """Text without markup: roles, backticks, emphasis and line breaks."""
  text = re.sub(r'\{[a-z]+\}`', '`', text)
  text = text.replace('`', '').replace('*', '')
  return ' '.join(text.split())


def _page(path: str) -> str:
  text = (ROOT / path).read_text()
  if path.endswith('.py'):
    return ast.get_docstring(ast.parse(text)) or ''
  return text


def test_the_committed_dev_results_choose_what_the_library_recommends():
  dev = _load('dev')
  assert dev['meta']['split'] == 'dev' and len(dev['meta']['seeds']) >= 10
  # The rule applied now, and as the run stored it.
  assert decision.recommend(dev).arm == summary.RECOMMENDED_ARM
  assert dev['recommendation']['arm'] == summary.RECOMMENDED_ARM
  assert _load('test')['meta']['seeds'] == dev['meta']['seeds']


@pytest.mark.parametrize('path', PAGES)
def test_each_page_gives_the_answer(answer, path):
  assert _plain(answer) in _plain(_page(path)), path


def test_the_recommended_docstring_gives_the_answer(answer):
  assert _plain(answer) in _plain(cbp.recommended.__doc__)


def test_compare_prints_the_answer(answer):
  assert _plain(answer) in _plain(cli.RECOMMENDATION)


def test_the_readme_table_is_the_committed_test_split():
  readme = (ROOT / 'README.md').read_text()
  assert summary.results_table(_load('test')) in readme


def test_the_workloads_page_table_is_the_committed_runs():
  page = (ROOT / 'docs' / 'reproduction' / 'workloads.md').read_text()
  assert summary.score_table(_load('dev'), _load('test')) in page
