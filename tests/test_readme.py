"""The README's Python snippets run as written, its quick start is the one CI
runs, and its results table is the committed test split's."""

import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / 'README.md'
TEST_RESULTS = ROOT / 'results' / 'workloads' / 'test' / 'results.json'

# README row label -> (plain arm, centered arm) in results.json.
ROWS = {
    'schedule-free AdamW': ('schedule_free_adamw',
                            'schedule_free_adamw_centered'),
    'Muon': ('muon', 'muon_centered'),
    'NAdamW': ('nadamw', 'nadamw_centered'),
    'AdamW': ('adamw', 'adamw_centered'),
    '`cbp.recommended`': (None, 'recommended'),
    '`cbp.cbp_robust`': (None, 'cbp_robust'),
    '`cbp.cbp`': (None, 'cbp'),
}


def test_readme_python_blocks_run():
  blocks = re.findall(r'```python\n(.*?)```', README.read_text(), re.S)
  assert len(blocks) >= 3
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


def _results_table(text: str) -> dict[str, tuple[str, str]]:
  section = text.split('## Results', 1)[1].split('\n## ', 1)[0]
  rows = {}
  for line in section.splitlines():
    cells = [c.strip() for c in line.strip().strip('|').split('|')]
    if len(cells) == 3 and cells[0] not in ('optimizer', '---'):
      rows[cells[0]] = (cells[1], cells[2])
  return rows


def test_readme_results_table_is_the_committed_test_split():
  score = json.loads(TEST_RESULTS.read_text())['score']
  table = _results_table(README.read_text())
  assert set(table) == set(ROWS)
  for label, arms in ROWS.items():
    for cell, arm in zip(table[label], arms):
      assert cell == ('' if arm is None else f'{score[arm]:.3f}'), label


def test_readme_names_no_run_dates_or_commits():
  text = README.read_text()
  assert not re.search(r'\b20\d\d-\d\d-\d\d\b', text)
  assert not re.search(r'\b\d{1,2} (Nov|Dec)\b', text)
  assert not re.search(r'\b[0-9a-f]{7,40}\b', text)
