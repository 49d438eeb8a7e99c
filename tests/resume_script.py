"""Trains, saves and resumes a centered model; run as a separate process by
tests/test_checkpoint.py to check that resuming is bit-exact.

  python tests/resume_script.py {linen,nnx} STEPS OUT_DIR [RESUME_FROM]
"""

import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import cbp_optax as cbp
from cbp_optax import checkpoint

DATA_X = np.random.default_rng(0).standard_normal((256, 6)).astype(np.float32)
DATA_Y = (DATA_X.sum(axis=1) > 0).astype(np.int32)


def batch(key_data):
  """The next batch and RNG: the data order lives in the checkpoint too."""
  key, sub = jax.random.split(jax.random.wrap_key_data(key_data))
  idx = np.asarray(jax.random.choice(sub, 256, (32,), replace=False))
  return DATA_X[idx] + 1.0, DATA_Y[idx], jax.random.key_data(key)


def cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


class LinenNet(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.relu(cbp.linen.Centered(nn.Dense(16))(x))
    return cbp.linen.Centered(nn.Dense(2))(x)


def run_linen(steps, out, resume_from):
  model = LinenNet()
  variables = model.init(jax.random.key(0), DATA_X[:1])
  state = {'train': cbp.linen.TrainState.create(
      apply_fn=model.apply, params=variables['params'],
      centering=variables['centering'],
      tx=optax.chain(optax.clip_by_global_norm(5.0), cbp.cbp(1e-2))),
           'rng': jax.random.key_data(jax.random.key(1))}
  if resume_from:
    state = checkpoint.restore(resume_from, state)
  step = cbp.linen.train_step(lambda apply, x, y: cross_entropy(apply(x), y))
  for _ in range(steps):
    x, y, state['rng'] = batch(state['rng'])
    state['train'], _ = step(state['train'], x, y)
  checkpoint.save(out, state)


def run_nnx(steps, out, resume_from):
  rngs = nnx.Rngs(0)
  model = nnx.Sequential(cbp.nnx.Centered(nnx.Linear(6, 16, rngs=rngs)),
                         nnx.relu, cbp.nnx.Centered(nnx.Linear(16, 2, rngs=rngs)))
  optimizer = cbp.nnx.Optimizer(model, cbp.cbp(1e-2, weight_decay=1e-4))
  rng = jax.random.key_data(jax.random.key(1))
  if resume_from:
    restored = checkpoint.restore(
        resume_from, {'train': nnx.state((model, optimizer)), 'rng': rng})
    nnx.update((model, optimizer), restored['train'])
    rng = restored['rng']
  step = cbp.nnx.train_step(lambda m, x, y: cross_entropy(m(x), y))
  for _ in range(steps):
    x, y, rng = batch(rng)
    step(model, optimizer, x, y)
  checkpoint.save(out, {'train': nnx.state((model, optimizer)), 'rng': rng})


if __name__ == '__main__':
  api, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
  resume_from = sys.argv[4] if len(sys.argv) > 4 else None
  {'linen': run_linen, 'nnx': run_nnx}[api](steps, out, resume_from)
