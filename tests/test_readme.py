"""The README's Python snippets run as written and its quick start is the one
CI runs (its answer and table: experiments/tests/test_recommendation.py)."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / 'README.md'


def test_readme_python_blocks_run():
  blocks = re.findall(r'```python\n(.*?)```', README.read_text(), re.S)
  # One NNX example and one Linen example.
  assert any('cbp.nnx.' in b for b in blocks)
  assert any('cbp.linen.' in b for b in blocks)
  namespace = {}  # later snippets continue the earlier ones, as in a session
  for block in blocks:
    exec(compile(block, str(README), 'exec'), namespace)  # pylint: disable=exec-used


def test_readme_quick_start_is_two_commands():
  text = README.read_text()
  quick = text.split('## Quick start', 1)[1].split('```bash\n', 1)[1]
  commands = quick.split('```', 1)[0].strip().splitlines()
  assert commands == [
      'pip install ".[flax]" ./experiments && cbp-optax compare',
      'pip install -e ".[test]" -e ./experiments && pytest']
  ci = (ROOT / '.ci/run').read_text()
  assert commands[1] in ci


def test_readme_names_no_run_dates_or_commits():
  text = README.read_text()
  assert not re.search(r'\b20\d\d-\d\d-\d\d\b', text)
  assert not re.search(r'\b\d{1,2} (Nov|Dec)\b', text)
  assert not re.search(r'\b[0-9a-f]{7,40}\b', text)
