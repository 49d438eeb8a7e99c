"""The Python code of a docs page, run so that tests use the page's own code."""

import pathlib
import re
import types

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_page(page: str, *, definitions_only: bool = False
             ) -> types.SimpleNamespace:
  """Runs the ```python blocks of ``docs/<page>`` in order, in one namespace.

  Args:
    page: the file name under docs/.
    definitions_only: run only the blocks that start with an import or a
      definition (the helpers a page defines, not its illustrations that use
      names of the reader's program).

  Returns:
    The namespace, as attributes.
  """
  path = ROOT / 'docs' / page
  namespace = {'__name__': f'docs_{path.stem}'}
  for block in re.findall(r'```python\n(.*?)```', path.read_text(), re.S):
    if definitions_only and not block.startswith(('import ', 'def ')):
      continue
    exec(compile(block, str(path), 'exec'), namespace)  # pylint: disable=exec-used
  return types.SimpleNamespace(**namespace)
