"""M2 under other optimizers: the transport moves every copy of the parameters."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import cbp_optax as cbp


def small_nnx():
  model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.tanh,
                         nnx.Linear(4, 2, rngs=nnx.Rngs(1)))
  cbp.nnx.center(model)
  return model


@pytest.mark.parametrize('make_tx', [
    lambda: optax.contrib.sam(optax.sgd(0.1), optax.sgd(0.1)),
    lambda: optax.contrib.dog(0.1),
], ids=['sam', 'dog'])
def test_fused_steps_take_optimizers_that_keep_the_initial_arrays(make_tx):
  """Their ``init`` keeps the parameter arrays themselves: the donating step
  failed with "Attempt to donate the same buffer twice"."""
  x = jnp.ones((4, 3)) + 1.0
  model = small_nnx()
  optimizer = cbp.nnx.Optimizer(model, make_tx())
  out = cbp.nnx.train_step(lambda m, x: jnp.mean(m(x) ** 2))(
      model, optimizer, x)
  assert not bool(out.skipped)
  net = cbp.linen.center(nn.Dense(2))
  variables = net.init(jax.random.key(0), x)
  state = cbp.linen.TrainState.create(
      apply_fn=net.apply, params=variables['params'],
      centering=variables['centering'], tx=make_tx())
  state, out = cbp.linen.train_step(lambda apply, x: jnp.mean(apply(x) ** 2))(
      state, x)
  assert not bool(out.skipped) and int(state.step) == 1
