"""The package layout: the core never reaches into the experiments.

``cbp_optax`` is the optimizer (jax, optax, chex; Flax for its adapters).
``cbp_optax_experiments``, a distribution of its own under ``experiments/``,
holds the reproduction suite, the ``cbp-optax`` command and the dataset
readers, with their plotting, statistics and progress bars (matplotlib,
scipy, tqdm).
"""

import ast
import io
import json
import pathlib
import re
import subprocess
import sys
import textwrap
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CORE = ROOT / 'cbp_optax'
EXTRA = ('matplotlib', 'scipy', 'tqdm')
CORE_MODULES = ('cbp_optax', 'cbp_optax.nnx', 'cbp_optax.linen')
# Issue 29: a library module a reader can hold in mind, a function that fits
# on a screen (code lines: docstrings, comments and blank lines left out).
MAX_MODULE_LINES = 600
MAX_FUNCTION_CODE_LINES = 80
_NOT_CODE = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
             tokenize.DEDENT, tokenize.ENCODING, tokenize.ENDMARKER)


def run_python(code: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, '-c', code], cwd=ROOT,
                        capture_output=True, text=True, timeout=300,
                        check=False)


def test_importing_the_core_loads_no_experiment_module_or_extra():
  code = (f'import sys\nimport {", ".join(CORE_MODULES)}\n'
          'import json\nprint(json.dumps(sorted(sys.modules)))')
  result = run_python(code)
  assert result.returncode == 0, result.stderr
  loaded = json.loads(result.stdout.strip().splitlines()[-1])
  leaked = [name for name in loaded
            if name.partition('.')[0] in EXTRA + ('cbp_optax_experiments',)]
  assert not leaked, f'importing the core loaded {leaked}'


def test_no_core_file_names_the_experiments():
  files = sorted(CORE.rglob('*.py'))
  assert files
  for path in files:
    text = path.read_text()
    assert 'cbp_optax_experiments' not in text, path
    for node in ast.walk(ast.parse(text)):
      if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom) and not node.level:
        names = [node.module or '']
      else:
        continue
      for name in names:
        assert name.partition('.')[0] not in EXTRA, (path, name)


# What a library docstring or comment must not carry: run dates, commit ids,
# reruns and issue numbers (the history lives on one docs page).
RUN_HISTORY = re.compile(r'\b20\d\d-\d\d-\d\d\b|\b\d{1,2} (?:Nov|Dec)\b|'
                         r'\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b|'
                         r'\brerun|\bissue \d+', re.I)


def test_no_library_file_names_a_run_date_commit_rerun_or_issue():
  for path in sorted(CORE.rglob('*.py')):
    found = RUN_HISTORY.findall(path.read_text())
    assert not found, (path, found)
  assert RUN_HISTORY.search('the rerun of 2026-12-04 at commit 8e31e91')


def test_no_module_name_collides_with_a_public_name():
  # optax's house style: private implementation modules, public names
  # re-exported, so `import cbp_optax.equalize` never shadows the function.
  import importlib.util  # pylint: disable=g-import-not-at-top
  import cbp_optax  # pylint: disable=g-import-not-at-top
  modules = {path.stem for path in CORE.glob('*.py')}
  modules |= {path.parent.name for path in CORE.glob('*/__init__.py')}
  for name in cbp_optax.__all__:
    obj = getattr(cbp_optax, name)
    if callable(obj) and not isinstance(obj, type(cbp_optax)):
      assert name not in modules, name
      assert importlib.util.find_spec(f'cbp_optax.{name}') is None, name


def _imports_within(package: pathlib.Path) -> dict[str, set[str]]:
  prefix = f'cbp_optax.{package.name}.'
  graph = {}
  for path in sorted(package.glob('_*.py')):
    if path.name == '__init__.py':
      continue
    tree = ast.parse(path.read_text())
    graph[path.stem] = {node.module[len(prefix):]
                        for node in ast.walk(tree)
                        if isinstance(node, ast.ImportFrom) and node.module
                        and node.module.startswith(prefix)}
  return graph


def test_the_framework_packages_mirror_each_other_file_for_file():
  nnx, linen = _imports_within(CORE / 'nnx'), _imports_within(CORE / 'linen')
  assert set(nnx) == set(linen) == {
      '_wrapper', '_center', '_transport', '_train_step'}
  for graph in (nnx, linen):
    assert not graph['_wrapper'], graph  # the wrapper needs nothing else
    # Imports flow one way: no module reaches itself through others.
    for start in graph:
      seen, todo = set(), list(graph[start])
      while todo:
        name = todo.pop()
        assert name != start, (start, graph)
        if name not in seen:
          seen.add(name)
          todo.extend(graph[name])


def _library_imports() -> dict[str, set[str]]:
  """``{module: the cbp_optax modules it imports}``, lazy imports included."""
  paths = {'.'.join(path.relative_to(ROOT).with_suffix('').parts)
           .removesuffix('.__init__'): path for path in CORE.rglob('*.py')}
  graph = {}
  for module, path in paths.items():
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        names |= {alias.name for alias in node.names}
      elif isinstance(node, ast.ImportFrom) and node.module:
        assert not node.level, (path, 'relative import')
        names |= {f'{node.module}.{alias.name}' if
                  f'{node.module}.{alias.name}' in paths else node.module
                  for alias in node.names}
    graph[module] = (names & set(paths)) - {module}
  return graph


def test_the_library_imports_form_no_circle():
  graph = _library_imports()
  assert 'cbp_optax._stacks' in graph['cbp_optax.centering'], graph
  done, path = set(), []

  def visit(module):
    assert module not in path, ' -> '.join(path[path.index(module):]
                                           + [module])
    if module not in done:
      path.append(module)
      for imported in sorted(graph[module]):
        visit(imported)
      path.pop()
      done.add(module)

  for module in sorted(graph):
    visit(module)


def _code_lines(source: str) -> set[int]:
  """The numbers of the lines that hold code, docstrings left out."""
  lines = set()
  for token in tokenize.generate_tokens(io.StringIO(source).readline):
    if token.type not in _NOT_CODE:
      lines.update(range(token.start[0], token.end[0] + 1))
  for node in ast.walk(ast.parse(source)):
    if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                          ast.AsyncFunctionDef))
        and ast.get_docstring(node, clean=False) is not None):
      lines -= set(range(node.body[0].lineno, node.body[0].end_lineno + 1))
  return lines


def _function_code_lines(source: str) -> dict[str, int]:
  """``{'name:line': code lines}`` of every function, nested ones within."""
  code = _code_lines(source)
  return {f'{node.name}:{node.lineno}':
              len(code & set(range(node.lineno, node.end_lineno + 1)))
          for node in ast.walk(ast.parse(source))
          if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_code_lines_leave_out_docstrings_comments_and_blank_lines():
  source = textwrap.dedent('''\
      def f(x):
        """A docstring

        over three lines."""
        # a comment

        y = {"a": 1,
             "b": """a string that is code"""}  # a comment after code
        return y
      ''')
  assert _function_code_lines(source) == {'f:1': 4}


def test_no_library_module_or_function_is_too_long():
  too_long = []
  for path in sorted(CORE.rglob('*.py')):
    source, name = path.read_text(), path.relative_to(ROOT)
    lines = len(source.splitlines())
    if lines > MAX_MODULE_LINES:
      too_long.append(f'{name}: {lines} lines')
    too_long += [f'{name}: {function}: {count} code lines'
                 for function, count in _function_code_lines(source).items()
                 if count > MAX_FUNCTION_CODE_LINES]
  assert not too_long, (
      f'over {MAX_MODULE_LINES} lines a module or {MAX_FUNCTION_CODE_LINES} '
      'code lines a function:\n' + '\n'.join(too_long))


def test_the_experiments_ship_as_their_own_package_with_the_data():
  experiments = ROOT / 'experiments' / 'cbp_optax_experiments'
  for path in ('__init__.py', 'cli.py', 'datasets.py',
               'reproduce/__init__.py', 'reproduce/__main__.py',
               'data/mnist_subset.npz', 'data/README.md'):
    assert (experiments / path).is_file(), path
  for path in ('cli.py', 'datasets.py', 'reproduce', 'data'):
    assert not (CORE / path).exists(), path
  library = (ROOT / 'pyproject.toml').read_text()
  assert 'cbp_optax_experiments' not in library.split('[tool.ruff]')[0]
  assert 'include = ["cbp_optax", "cbp_optax.*"]' in library
  assert 'flax' not in library.split('dependencies = [', 1)[1].split(']')[0]
  own = (ROOT / 'experiments' / 'pyproject.toml').read_text()
  assert 'cbp-optax = "cbp_optax_experiments.cli:main"' in own
  assert '"cbp-optax[flax]"' in own
  assert 'data/mnist_subset.npz' in own


# The optax transforms and the framework-free core: their messages name no
# framework package (issue 29: precondition said "cbp.nnx.center moved ...",
# the core's stack-axis remedy named cbp.nnx.Centered).
FRAMEWORK_FREE = ('_alias.py', '_checks.py', '_equalize.py', '_energies.py',
                  '_weight_decay.py', '_precondition.py', '_recipe.py', '_stacks.py',
                  '_bias_shift.py', '_layer_spec.py', 'blocks.py',
                  'centering.py')
FRAMEWORK_WORDS = ('nnx', 'linen', 'nn.scan', 'nn.vmap')


def _message_strings(tree: ast.Module) -> list[str]:
  """The string constants of a module, docstrings left out."""
  docstrings = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef,
                         ast.AsyncFunctionDef)):
      body = node.body
      if (body and isinstance(body[0], ast.Expr)
          and isinstance(body[0].value, ast.Constant)):
        docstrings.add(id(body[0].value))
  return [node.value for node in ast.walk(tree)
          if isinstance(node, ast.Constant) and isinstance(node.value, str)
          and id(node) not in docstrings]


@pytest.mark.parametrize('name', FRAMEWORK_FREE)
def test_framework_free_messages_name_no_framework_package(name):
  tree = ast.parse((CORE / name).read_text())
  found = [text for text in _message_strings(tree)
           if any(word in text for word in FRAMEWORK_WORDS)]
  assert not found, f'{name} names a framework in {found}'


def _toctree_entries(index: str) -> set[str]:
  entries, inside = set(), False
  for line in index.splitlines():
    if line.startswith('```{toctree}'):
      inside = True
    elif line.startswith('```'):
      inside = False
    elif inside and line and not line.startswith(':'):
      entries.add(line.strip())
  return entries


def test_every_docs_page_is_in_a_toctree():
  # sphinx-build -W in .ci/run fails on a page no toctree lists; this says
  # so in the default suite, before the docs are built.
  docs = ROOT / 'docs'
  pages = {str(p.relative_to(docs).with_suffix(''))
           for p in docs.rglob('*.md') if '_build' not in p.parts}
  listed = _toctree_entries((docs / 'index.md').read_text())
  assert pages - listed - {'index'} == set()
  assert listed - pages == set()


def test_docs_hold_pages_not_result_files():
  # Run results (JSON) live under results/ at the repository root; docs/
  # holds the pages that report them.
  docs = ROOT / 'docs'
  found = [str(p.relative_to(ROOT)) for p in docs.rglob('*.json')
           if '_build' not in p.parts]
  assert not found, found


TOP_LEVEL_PAGES = ('README.md', 'BENCHMARKS.md', 'CONTRIBUTING.md',
                   'REPRODUCTION.md')


@pytest.mark.parametrize('name', TOP_LEVEL_PAGES)
def test_top_level_pages_link_to_files_that_exist(name):
  # The Sphinx build checks the pages under docs/; these four are also read
  # on their own (on a forge, in an editor), where a broken link is silent.
  text = (ROOT / name).read_text()
  targets = re.findall(r'\]\(([^)\s]+)\)', text)
  missing = []
  for target in targets:
    path = target.split('#', 1)[0]
    if not path or '://' in path or path.startswith('mailto:'):
      continue
    if not (ROOT / path).exists():
      missing.append(target)
  assert not missing, missing


def _private_imports(path: pathlib.Path) -> list[str]:
  """The ``_private`` names (not modules) ``path`` imports from cbp_optax."""
  found = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module and (
        node.module.startswith('cbp_optax')):
      package = ROOT.joinpath(*node.module.split('.'))
      for alias in node.names:
        is_module = (package / f'{alias.name}.py').exists() or (
            package / alias.name).is_dir()
        if alias.name.startswith('_') and not is_module:
          found.append(f'{node.module}.{alias.name}')
  return found


def test_the_adapters_and_the_centering_core_share_no_private_names():
  """Names one module of nnx/, linen/ or the centering core uses from
  another are public within the package (no underscore); the path helpers
  live in cbp_optax._paths."""
  files = [*(CORE / 'nnx').glob('*.py'), *(CORE / 'linen').glob('*.py')]
  files += [CORE / f'{name}.py' for name in (
      'centering', '_opt_state', '_step', '_untransported', '_stacks',
      '_bias_shift', '_layer_spec', '_flax_state', '_paths')]
  found = {p.relative_to(ROOT).as_posix(): _private_imports(p) for p in files}
  assert {k: v for k, v in found.items() if v} == {}


def test_the_library_imports_no_private_jax_or_flax_module():
  for path in CORE.rglob('*.py'):
    for node in ast.walk(ast.parse(path.read_text())):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import)
               else [node.module or ''] if isinstance(node, ast.ImportFrom)
               else [])
      for name in names:
        assert not name.startswith('jax._src'), (path, name)
        assert 'graphlib' not in name, (path, name)
      if isinstance(node, ast.ImportFrom) and node.module in (
          'flax.nnx', 'jax', 'jax.core'):
        assert all(a.name != 'graphlib' and not a.name.startswith('_')
                   for a in node.names), (path, ast.dump(node))


# The public faces and how many names they document in total.
FACES = ('cbp_optax', 'cbp_optax.nnx', 'cbp_optax.linen', 'cbp_optax.centering',
         'cbp_optax.blocks')
MAX_PUBLIC_NAMES = 50


def test_the_public_surface_is_small():
  # What a user has to learn: each public object once, however many faces
  # re-export it (cbp_optax.leaf_blocks is cbp_optax.blocks.leaf_blocks);
  # the faces themselves (modules) are not counted.
  import importlib  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  names = {}
  for face in FACES:
    module = importlib.import_module(face)
    exported = getattr(module, '__all__', ())
    assert len(set(exported)) == len(exported), face
    for name in exported:
      assert hasattr(module, name), (face, name)
      value = getattr(module, name)
      if isinstance(value, types.ModuleType):
        continue
      key = id(value) if callable(value) else f'{face}.{name}'
      names.setdefault(key, f'{face}.{name}')
  assert 0 < len(names) <= MAX_PUBLIC_NAMES, sorted(names.values())
