"""Weight decay in cbp.cbp, cbp.cbp_robust and cbp.recommended: one
convention (``weight_decay=None`` decays nothing, ``mask=None`` the matrices
of any pytree), and messages true for the factory that raises them."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import cbp_optax as cbp

FACTORIES = {
    'cbp': cbp.cbp,
    'cbp_robust': cbp.cbp_robust,
    'recommended': cbp.recommended,
}


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=['weight', 'bias'], meta_fields=[])
@dataclasses.dataclass
class EquinoxLikeLinear:
  weight: jax.Array
  bias: jax.Array


def _w(*shape):
  return jnp.arange(1.0, 1.0 + np.prod(shape)).reshape(shape)


# Trees without a leaf named kernel: the former default of cbp.recommended
# decayed none of their leaves.
TREES = {
    'dict': {'w': _w(3, 4), 'b': _w(4)},
    'list_of_tuples': [(_w(3, 4), _w(4)), (_w(4, 2), _w(2))],
    'equinox_like': EquinoxLikeLinear(_w(3, 4), _w(4)),
    'haiku_style': {'linear': {'w': _w(3, 4), 'b': _w(4)},
                    'conv2_d': {'w': _w(3, 3, 2, 4), 'b': _w(4)},
                    'layer_norm': {'scale': _w(4), 'offset': _w(4)}},
}


def decayed(tx, params):
  """Which leaves a step with zero gradients moves: the decayed ones."""
  grads = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(grads, tx.init(params), params)
  # Schedule-free's y - y rounds to a few ulps; a decay moves by 5 %.
  return jax.tree.map(lambda u, p: bool(jnp.any(jnp.abs(u) > 1e-3 * p)),
                      updates, params)


@pytest.mark.parametrize('tree', sorted(TREES))
@pytest.mark.parametrize('name', sorted(FACTORIES))
def test_the_default_decays_the_matrices_of_any_pytree(name, tree):
  params = TREES[tree]
  got = decayed(FACTORIES[name](0.1, weight_decay=0.5), params)
  assert got == jax.tree.map(lambda x: x.ndim >= 2, params)
  assert any(jax.tree.leaves(got))


class HandWritten(nnx.Module):

  def __init__(self, rngs):
    self.w = nnx.Param(jax.random.normal(rngs.params(), (3, 4)))
    self.lora = nnx.LoRA(4, 2, 4, rngs=rngs)
    self.lora.lora_b[...] = jnp.ones((2, 4))  # initialized to zero
    self.embed = nnx.Embed(5, 4, rngs=rngs)
    self.norm = nnx.LayerNorm(4, rngs=rngs)
    self.dense = nnx.Linear(4, 4, rngs=rngs)

    @nnx.vmap(in_axes=0, out_axes=0)
    def stack(key):
      return nnx.Linear(4, 4, bias_init=nnx.initializers.ones,
                        rngs=nnx.Rngs(key))

    self.stack = stack(jax.random.split(rngs.params(), 3))


@pytest.mark.parametrize('name', sorted(FACTORIES))
def test_nnx_hand_written_and_lora_matrices_are_decayed(name):
  model = HandWritten(nnx.Rngs(0))
  cbp.nnx.center(model)
  optimizer = cbp.nnx.Optimizer(model, FACTORIES[name](0.1, weight_decay=0.5))
  before = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  optimizer.update(model, jax.tree.map(jnp.zeros_like,
                                       nnx.state(model, nnx.Param)))
  after = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  moved = {jax.tree_util.keystr(path) for path, changed in
           jax.tree_util.tree_leaves_with_path(jax.tree.map(
               lambda a, b: bool(jnp.any(jnp.abs(a - b) > 1e-3 * jnp.abs(a))),
               before, after))
           if changed}
  assert moved == {"['w']", "['lora']['lora_a']", "['lora']['lora_b']",
                   "['dense']['layer']['kernel']",
                   "['stack']['layer']['kernel']"}
  # Stacked biases (rank 2), embeddings, norm scales: not decayed; centering
  # means are no parameters.
  assert after['stack']['layer']['bias'].ndim == 2


@pytest.mark.parametrize('name', sorted(FACTORIES))
def test_weight_decay_none_decays_nothing_in_every_factory(name):
  params = TREES['dict']
  assert not any(jax.tree.leaves(decayed(
      FACTORIES[name](0.1, weight_decay=None), params)))
  with pytest.raises(ValueError, match='mask selects .* weight_decay is None'):
    FACTORIES[name](0.1, weight_decay=None, mask={'w': True, 'b': False})


@pytest.mark.parametrize('name', sorted(FACTORIES))
def test_the_single_bool_mask_refusal_is_true_for_its_factory(name):
  with pytest.raises(TypeError) as caught:
    FACTORIES[name](0.1, weight_decay=0.5, mask=True)
  message = str(caught.value)
  # Each claim of the message holds (the two tests above check them).
  assert 'Leave mask out to decay every leaf of rank >= 2' in message
  assert 'pass weight_decay=None to decay nothing' in message
  assert 'leave weight_decay out' not in message
  assert 'to decay every parameter' not in message
  params = TREES['dict']
  assert decayed(FACTORIES[name](0.1, weight_decay=0.5), params) == {
      'w': True, 'b': False}


def test_recommended_decays_the_matrices_by_default_and_none_when_injected_none():
  params = TREES['haiku_style']
  assert decayed(cbp.recommended(0.1), params) == jax.tree.map(
      lambda x: x.ndim >= 2, params)
  injected = optax.inject_hyperparams(cbp.recommended)(0.1, weight_decay=None)
  assert not any(jax.tree.leaves(decayed(injected, params)))
