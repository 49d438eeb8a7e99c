"""Checkpoints: bit-exact resume in a new process, refusal of mismatches."""

import pathlib
import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import cbp_optax as cbp
from cbp_optax import checkpoint
from cbp_optax_experiments import configurations

SCRIPT = pathlib.Path(__file__).with_name('resume_script.py')


def train(api, steps, out, resume_from=None):
  args = [sys.executable, str(SCRIPT), api, str(steps), str(out)]
  if resume_from:
    args.append(str(resume_from))
  result = subprocess.run(args, capture_output=True, text=True, timeout=600,
                          cwd=SCRIPT.parents[1])
  assert result.returncode == 0, result.stderr[-3000:]


def saved_arrays(path):
  tree = ocp.StandardCheckpointer().restore(path)
  return {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


# One framework in the default tier: both share the resume code path.
@pytest.mark.parametrize('api', [pytest.param('linen', marks=pytest.mark.slow),
                                 'nnx'])
def test_resume_in_new_process_is_bit_exact(api, tmp_path):
  train(api, 7, tmp_path / 'first')
  train(api, 5, tmp_path / 'resumed', resume_from=tmp_path / 'first')
  train(api, 12, tmp_path / 'straight')
  resumed, straight = (saved_arrays(tmp_path / 'resumed'),
                       saved_arrays(tmp_path / 'straight'))
  assert resumed.keys() == straight.keys() and len(resumed) > 10
  for key in straight:
    np.testing.assert_array_equal(resumed[key], straight[key], err_msg=key)
  first = saved_arrays(tmp_path / 'first')
  assert any(not np.array_equal(first[k], straight[k]) for k in straight)


class Net(nn.Module):
  width: int = 8

  @nn.compact
  def __call__(self, x):
    return cbp.linen.Centered(nn.Dense(self.width))(x)


def make_state(width=8, tx=None):
  model = Net(width)
  variables = model.init(jax.random.key(0), jnp.ones((2, 3)))
  return cbp.linen.TrainState.create(
      apply_fn=model.apply, params=variables['params'],
      centering=variables['centering'], tx=tx or cbp.cbp(1e-2))


def test_roundtrip_restores_values_and_types(tmp_path):
  state = make_state()
  state = state.replace(params=jax.tree.map(lambda x: x + 1.5, state.params))
  checkpoint.save(tmp_path / 'c', state)
  restored = checkpoint.restore(tmp_path / 'c', make_state())
  assert isinstance(restored, cbp.linen.TrainState)
  assert isinstance(restored.opt_state[0], cbp.EqualizeState)
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize('other, expected', [
    (lambda: make_state(width=9), r'dense/kernel: checkpoint has float32\[3, 8\]'),
    (lambda: make_state(tx=optax.adam(1e-2)), 'not expected, in the checkpoint: '
     'opt_state/0/energy'),
])
def test_mismatched_checkpoint_is_refused_with_a_diff(tmp_path, other,
                                                      expected):
  checkpoint.save(tmp_path / 'c', make_state())
  with pytest.raises(checkpoint.CheckpointMismatchError, match=expected):
    checkpoint.restore(tmp_path / 'c', other())


def test_nnx_state_roundtrip(tmp_path):
  model = nnx.Sequential(cbp.nnx.Centered(nnx.Linear(3, 2, rngs=nnx.Rngs(0))))
  optimizer = cbp.nnx.Optimizer(model, cbp.cbp(1e-2))
  model.layers[0].mean[...] = jnp.arange(3.0)
  checkpoint.save(tmp_path / 'c', nnx.state((model, optimizer)))
  fresh = nnx.Sequential(cbp.nnx.Centered(nnx.Linear(3, 2, rngs=nnx.Rngs(5))))
  fresh_optimizer = cbp.nnx.Optimizer(fresh, cbp.cbp(1e-2))
  nnx.update((fresh, fresh_optimizer), checkpoint.restore(
      tmp_path / 'c', nnx.state((fresh, fresh_optimizer))))
  np.testing.assert_array_equal(fresh.layers[0].mean[...], jnp.arange(3.0))
  np.testing.assert_array_equal(fresh.layers[0].layer.kernel[...],
                                model.layers[0].layer.kernel[...])


def test_mismatch_message_starts_with_a_summary_line(tmp_path):
  checkpoint.save(tmp_path / 'c', make_state())
  with pytest.raises(checkpoint.CheckpointMismatchError) as caught:
    checkpoint.restore(tmp_path / 'c', make_state(tx=optax.adam(1e-2)))
  first = str(caught.value).splitlines()[0]
  assert re.search(r'\d+ array\(s\) missing from the checkpoint, [1-9]\d* '
                   r'not expected, \d+ of another shape or dtype \(of \d+ '
                   r'expected, \d+ saved\)', first), first


@pytest.mark.parametrize('make_tx', [
    lambda lr: configurations.cbp_study(
        lr, **configurations.TRANSFORMER_COMBINATION),
    lambda lr: cbp.cbp(lr, block_fn=cbp.no_blocks)])
def test_state_with_no_m1_blocks_roundtrips(tmp_path, make_tx):
  # M1 with no blocks keeps a zero-size energy vector, which orbax refuses to
  # write; it is stored as an empty node and rebuilt from `like`.
  state = make_state(tx=make_tx(1e-2))
  assert state.opt_state[0].energy.shape == (0,)
  state = state.apply_gradients(
      grads=jax.tree.map(jnp.ones_like, state.params))
  checkpoint.save(tmp_path / 'c', state)
  restored = checkpoint.restore(tmp_path / 'c', make_state(tx=make_tx(1e-2)))
  assert restored.opt_state[0].energy.shape == (0,)
  assert restored.opt_state[0].energy.dtype == jnp.float32
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(a, b)
  # A checkpoint with M1 blocks does not restore into a state without them.
  checkpoint.save(tmp_path / 'with_blocks', make_state())
  with pytest.raises(checkpoint.CheckpointMismatchError, match='energy'):
    checkpoint.restore(tmp_path / 'with_blocks',
                       make_state(tx=make_tx(1e-2)))
