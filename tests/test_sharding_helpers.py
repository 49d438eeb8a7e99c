"""The sharding helpers of docs/sharding.md in one process.

``optimizer_sharding`` of ``optax.masked`` / ``optax.partition`` (issue 13,
item 15) and the process-local batch helpers (issue 16) on a one-device
mesh; tests/test_multiprocess.py runs them across processes.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cbp_optax as cbp
from tests.doc_code import run_page

sharding = run_page('sharding.md', definitions_only=True)


def _mesh():
  return jax.make_mesh((1,), ('data',), axis_types=(AxisType.Auto,))


def _params(mesh):
  params = {
      'a': {'kernel': jnp.ones((4, 8)), 'bias': jnp.zeros(8)},
      'b': {'kernel': jnp.ones((8, 2)), 'bias': jnp.zeros(2)},
  }
  param_sharding = {
      'a': {'kernel': NamedSharding(mesh, P(None, 'data')),
            'bias': NamedSharding(mesh, P('data'))},
      'b': {'kernel': NamedSharding(mesh, P('data', None)),
            'bias': NamedSharding(mesh, P())},
  }
  return jax.device_put(params, param_sharding), param_sharding


def _kernels_only(params):
  return jax.tree.map(lambda x: x.ndim > 1, params)


def _labels(params):
  return jax.tree.map(lambda x: 'cbp' if x.ndim > 1 else 'sgd', params)


MASKED = {
    'masked_tree': lambda p: optax.masked(cbp.cbp(1e-3), _kernels_only(p)),
    'masked_callable': lambda p: optax.masked(cbp.cbp(1e-3), _kernels_only),
    'partition_tree': lambda p: optax.partition(
        {'cbp': cbp.cbp(1e-3), 'sgd': optax.sgd(1e-2, momentum=0.9)},
        _labels(p)),
    'partition_callable': lambda p: optax.partition(
        {'cbp': cbp.cbp(1e-3), 'sgd': optax.sgd(1e-2, momentum=0.9)},
        _labels),
    'chain_with_masked': lambda p: optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.masked(cbp.cbp(1e-3), _kernels_only)),
}


@pytest.mark.parametrize('name', list(MASKED))
def test_optimizer_sharding_of_masked_and_partitioned_optimizers(name):
  mesh = _mesh()
  params, param_sharding = _params(mesh)
  tx = MASKED[name](params)
  derived = sharding.optimizer_sharding(tx, params)
  abstract = jax.eval_shape(tx.init, params)
  # One sharding per state array: the masked-out entries (MaskedNode, no
  # arrays) are kept as they are.
  chex.assert_trees_all_equal_structs(derived, abstract)
  state = jax.jit(tx.init, out_shardings=derived)(params)
  # Every moment of a kernel lives like its kernel.
  paths = jax.tree_util.tree_flatten_with_path(state)[0]
  moments = [(jax.tree_util.keystr(p), x) for p, x in paths
             if x.ndim == 2]
  assert moments, paths
  for path, moment in moments:
    layer = 'a' if "['a']" in path else 'b'
    assert moment.sharding == param_sharding[layer]['kernel'], path
  # Everything else (counters, M1's energies, the sgd momenta of biases,
  # which are their parameters' sharding too) is on the mesh.
  for _, leaf in paths:
    assert isinstance(leaf.sharding, NamedSharding)
    assert leaf.sharding.mesh == mesh


def test_optimizer_sharding_of_masked_optimizer_trains():
  # The derived state is usable: an update under jit keeps its shardings.
  mesh = _mesh()
  params, _ = _params(mesh)
  tx = MASKED['partition_callable'](params)
  derived = sharding.optimizer_sharding(tx, params)
  state = jax.jit(tx.init, out_shardings=derived)(params)
  grads = jax.tree.map(jnp.ones_like, params)
  updates, state = jax.jit(tx.update)(grads, state, params)
  chex.assert_trees_all_equal_structs(
      jax.tree.map(lambda x: x.sharding, state), derived)
  assert all(np.all(np.isfinite(u)) for u in jax.tree.leaves(updates))


def test_process_rows_is_the_whole_batch_in_one_process():
  mesh = _mesh()
  assert sharding.process_rows(16, mesh) == slice(0, 16)
  with pytest.raises((ValueError, KeyError)):
    sharding.process_rows(16, mesh, 'batch')


def test_shard_batch_of_process_local_rows_in_one_process():
  mesh = _mesh()
  images = np.arange(24.0).reshape(8, 3)
  labels = np.arange(8, dtype=np.int32)
  rows = sharding.process_rows(len(labels), mesh)
  x, y = sharding.shard_process_batch((images[rows], labels[rows]),
                                      len(labels), mesh)
  assert x.shape == images.shape and y.shape == labels.shape
  assert x.sharding.spec == P('data')
  np.testing.assert_array_equal(np.asarray(x), images)
