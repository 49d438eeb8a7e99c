"""The answer to "what should I use?" on the pages that give it is the
decision rule's choice on the committed dev results, in the same words and
with the committed numbers (``summary``)."""

import json
import pathlib
import re

import pytest

from cbp_optax_experiments.workloads import decision
from cbp_optax_experiments.workloads import summary

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEV = ROOT / 'results' / 'workloads' / 'dev' / 'results.json'
PAGES = ('README.md', 'docs/faq.md', 'docs/reproduction/workloads.md')


@pytest.fixture(scope='module')
def dev():
  return json.loads(DEV.read_text())


def _plain(text: str) -> str:
  """Text without markup: roles, backticks, emphasis and line breaks."""
  text = re.sub(r'\{[a-z]+\}`', '`', text)
  text = text.replace('`', '').replace('*', '')
  return ' '.join(text.split())


def test_the_committed_dev_run_has_ten_seeds_and_the_rule_s_choice(dev):
  assert dev['meta']['split'] == 'dev' and len(dev['meta']['seeds']) >= 10
  # The rule applied now gives what the run stored.
  assert decision.recommend(dev).arm == dev['recommendation']['arm']


@pytest.mark.parametrize('path', PAGES)
def test_each_page_gives_the_dev_answer(dev, path):
  page = (ROOT / path).read_text()
  assert _plain(summary.dev_answer(dev)) in _plain(page), path


def test_the_readme_table_is_the_committed_dev_split(dev):
  readme = (ROOT / 'README.md').read_text()
  assert summary.results_table(dev) in readme
