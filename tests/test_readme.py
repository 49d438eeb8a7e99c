"""The README's Python snippets run as written."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / 'README.md'


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
  assert commands == ['pip install . && cbp-optax compare',
                      'pip install -e ".[test]" && pytest']
  ci = (README.parent / '.ci/run').read_text()
  assert commands[1] in ci
