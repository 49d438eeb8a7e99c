"""The runnable examples (examples/). The ``cbp-optax compare`` job is the
experiments' (experiments/tests/test_cli.py)."""

import ast
import pathlib
import re
import subprocess
import sys

import pytest

from tests.mnist import MNIST_DIR
from tests.mnist import needs_mnist

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(*args):
  result = subprocess.run(
      [sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
      timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout


@needs_mnist
@pytest.mark.parametrize('script', [
    'mnist_nnx.py', pytest.param('mnist_linen.py', marks=pytest.mark.slow)])
def test_example_trains_on_real_mnist(script):
  out = run(f'examples/{script}', '--epochs', '1', '--data-dir',
            str(MNIST_DIR))
  assert 'test set only' in out
  accuracy = float(re.findall(r'test accuracy ([0-9.]+)', out)[-1])
  assert accuracy > 0.8, out


@needs_mnist
def test_mnist_nnx_resumes_from_its_orbax_checkpoint_exactly(tmp_path):
  # --checkpoint-dir: Orbax's CheckpointManager saves after every epoch; a
  # rerun resumes from the latest and prints what the run that never
  # stopped printed for the next epoch.
  args = ['examples/mnist_nnx.py', '--data-dir', str(MNIST_DIR),
          '--batch-size', '4096']
  through = run(*args, '--epochs', '2', '--checkpoint-dir',
                str(tmp_path / 'a'))
  run(*args, '--epochs', '1', '--checkpoint-dir', str(tmp_path / 'b'))
  resumed = run(*args, '--epochs', '2', '--checkpoint-dir',
                str(tmp_path / 'b'))
  assert 'resumed from epoch 1' in resumed
  epoch_2 = [re.findall(r'epoch 2: .*', out) for out in (through, resumed)]
  assert len(epoch_2[0]) == 1 and epoch_2[0] == epoch_2[1], epoch_2
  assert sorted(p.name for p in (tmp_path / 'b').iterdir()) == ['1', '2']


@needs_mnist
# tests/test_centering_models.py centers the same CNN in the default tier.
@pytest.mark.slow
@pytest.mark.parametrize('script', ['center_nnx.py', 'center_linen.py'])
def test_one_call_centering_example_trains_the_unmodified_cnn(script):
  # --center: the default (the recipe) leaves this BatchNorm model plain.
  out = run(f'examples/{script}', '--steps', '60', '--center', '--data-dir',
            str(MNIST_DIR))
  assert re.search(r'centered: .*Conv|centered: conv1', out), out
  accuracy = float(re.findall(r'test accuracy ([0-9.]+)', out)[-1])
  assert accuracy > 0.7, out


def _parsers(path):
  """(ArgumentParser call, [add_argument calls]) of one example, from source."""
  tree = ast.parse(path.read_text())
  parsers, arguments = [], []
  for node in ast.walk(tree):
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
      if node.func.attr == 'ArgumentParser':
        parsers.append(node)
      elif node.func.attr == 'add_argument':
        arguments.append(node)
  return parsers, arguments


EXAMPLES = sorted(p.name for p in (ROOT / 'examples').glob('*.py'))


@pytest.mark.parametrize('script', EXAMPLES)
def test_every_example_flag_has_help_and_shows_its_default(script):
  # From the source (no import of JAX): each parser shows defaults, each flag
  # says what it does (issue 14).
  parsers, arguments = _parsers(ROOT / 'examples' / script)
  assert parsers and arguments, script
  for parser in parsers:
    formatter = {k.arg: k.value for k in parser.keywords}.get(
        'formatter_class')
    assert (isinstance(formatter, ast.Attribute) and
            formatter.attr == 'ArgumentDefaultsHelpFormatter'), script
  for argument in arguments:
    flag = ast.unparse(argument.args[0])
    helps = [k.value for k in argument.keywords if k.arg == 'help']
    assert helps, f'{script}: {flag} has no help text'


# The examples that show how to train a model default to the recommended
# recipe (issue 29); Algorithm 1 stays one flag away. mlp_classic.py (the
# paper's reproduction), mnist_sharded.py and multiprocess_mnist.py (Algorithm
# 1 on many devices equals one device) keep cbp.cbp and have no such flag.
RECIPE_EXAMPLES = ['center_linen.py', 'center_nnx.py', 'mnist_linen.py',
                   'mnist_nnx.py', 'transformer_nnx.py']


@pytest.mark.parametrize('script', RECIPE_EXAMPLES)
def test_training_example_defaults_to_the_recommended_recipe(script):
  source = (ROOT / 'examples' / script).read_text()
  _, arguments = _parsers(ROOT / 'examples' / script)
  optimizer = [a for a in arguments
               if ast.literal_eval(a.args[0]) == '--optimizer']
  assert len(optimizer) == 1, script
  keywords = {k.arg: k.value for k in optimizer[0].keywords}
  assert ast.literal_eval(keywords['default']) == 'recommended', script
  choices = ast.literal_eval(keywords['choices'])
  assert 'recommended' in choices, script
  assert 'cbp' in choices or 'cbp_robust' in choices, script
  assert 'cbp.recommended(' in source, script
  # Read at schedule-free's evaluation point.
  assert 'eval_model(' in source or 'eval_params(' in source, script


def test_example_help_lists_the_defaults():
  out = ' '.join(run('examples/mnist_nnx.py', '--help').split())
  for flag, default in [('--epochs', '3'), ('--batch-size', '256'),
                        ('--learning-rate', '0.003'), ('--seed', '0')]:
    assert re.search(re.escape(flag) + r' [A-Z_]+ [^()]*\(default: '
                     + re.escape(default) + r'\)', out), (flag, out)


@pytest.mark.parametrize('optimizer', ['recommended', 'cbp_robust'])
def test_transformer_example_trains_a_centered_stack(optimizer):
  # Reduced size: two blocks of width 16 (the example's defaults: 4 x 128).
  # recommended (the default): schedule-free, read at cbp.nnx.eval_model.
  out = run('examples/transformer_nnx.py', '--steps', '10', '--depth', '2',
            '--width', '16', '--heads', '2', '--context', '16',
            '--batch-size', '4', '--optimizer', optimizer)
  lines = out.splitlines()
  # The blocks are centered inside their nnx.vmap (the stack axis named,
  # depth == heads here); center(model) then wraps the head and leaves the
  # norms and embeddings.
  assert 'centered (1): head' in lines, out
  left = next(line for line in lines if line.startswith('left as is'))
  assert 'blocks/attn' not in left and 'blocks/up' not in left, out
  assert "layer stacks: stacked_predicate(['blocks'])" in lines, out
  bpb = [float(x) for x in re.findall(r'validation ([0-9.]+) bits', out)]
  assert len(bpb) == 5 and bpb[-1] < bpb[0] < 8.5, out  # 8 bits: uniform
  assert 'skipped steps 0' in out
