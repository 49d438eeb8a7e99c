"""Helpers for training with CBP on a device mesh (``jax.sharding``).

CBP needs no communication of its own: under ``jax.jit`` with sharded inputs,
XLA inserts the collectives. The centering means (M2) are ``jnp.mean`` over the
*global* batch, the block energies of M1 are sums over whole blocks whatever
their sharding, and M3 is elementwise. What a user would otherwise write by
hand is here:

* :func:`optimizer_sharding` - the sharding of ``tx.init(params)`` derived
  from the parameters' (moments like their parameter, the small per-block M1
  state and the step counters replicated).
* :func:`fsdp_sharding` - a simple fully-sharded rule: every array split along
  its largest dimension that the mesh axis divides.
* :func:`shard_batch` - places a batch along the data axis, refusing a batch
  the axis does not divide. With several processes each passes only its own
  rows (:func:`process_batch_slice` says which).

Example (data parallel, Linen)::

  mesh = jax.make_mesh((jax.device_count(),), ('data',))
  replicated = NamedSharding(mesh, PartitionSpec())
  params = jax.device_put(params, replicated)
  opt_state = jax.jit(
      tx.init, out_shardings=optimizer_sharding(tx, params))(params)
  images, labels = shard_batch((images, labels), mesh)
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import jax
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from cbp_optax import _checks

__all__ = [
    'batch_sharding',
    'check_batch_divisible',
    'fsdp_sharding',
    'optimizer_sharding',
    'process_batch_slice',
    'shard_batch',
]

AxisNames = Union[str, Sequence[str]]


def _axis_size(mesh: Mesh, axes: AxisNames) -> int:
  names = (axes,) if isinstance(axes, str) else tuple(axes)
  for name in names:
    if name not in mesh.shape:
      raise ValueError(
          f'Mesh axis {name!r} is not in the mesh, whose axes are '
          f'{tuple(mesh.axis_names)}.'
      )
  return int(np.prod([mesh.shape[name] for name in names]))


def _mesh_of(shardings: Any) -> Mesh:
  for sharding in jax.tree.leaves(shardings):
    if isinstance(sharding, NamedSharding):
      return sharding.mesh
  raise ValueError(
      'optimizer_sharding needs at least one parameter with a NamedSharding '
      '(place the parameters on a mesh first, or pass param_sharding).'
  )


def optimizer_sharding(
    tx: optax.GradientTransformation,
    params: Any,
    param_sharding: Optional[Any] = None,
) -> Any:
  """The sharding of ``tx.init(params)``, derived from the parameters'.

  Every parameter-shaped subtree of the optimizer state (CBP's moments ``mu``
  and ``nu``, Adam's, ...) gets its parameter's sharding; every other leaf
  (step counters, the per-block energies of M1, whose length is the number of
  blocks) is replicated over the parameters' mesh. Built on
  ``optax.tree_map_params``, so it sees through ``optax.chain``,
  ``inject_hyperparams``, ``optax.masked`` and ``optax.partition`` (whose
  ``MaskedNode`` placeholders hold no arrays and stay as they are).

  Args:
    tx: the optimizer, e.g. ``cbp_optax.cbp(1e-3)``.
    params: the parameters ``tx`` is initialized on: arrays placed with a
      ``NamedSharding``, or ``jax.ShapeDtypeStruct`` s carrying one.
    param_sharding: the parameters' shardings (a tree like ``params``);
      defaults to each leaf's ``.sharding``.

  Returns:
    A tree of ``NamedSharding`` with the structure of ``tx.init(params)``,
    ready for ``jax.jit(tx.init, out_shardings=...)`` or ``jax.device_put``.

  Examples:
    >>> import jax, optax
    >>> import cbp_optax as cbp
    >>> from cbp_optax import sharding
    >>> mesh = jax.make_mesh((1,), ('data',))
    >>> spec = jax.sharding.PartitionSpec()
    >>> params = jax.device_put(
    ...     {'w': jax.numpy.ones(4)}, jax.NamedSharding(mesh, spec))
    >>> tx = cbp.cbp(1e-3)
    >>> state = jax.jit(
    ...     tx.init, out_shardings=sharding.optimizer_sharding(tx, params)
    ... )(params)
    >>> tuple(state[1].nu['w'].sharding.spec)  # M3's moments: like the params
    ()

    With FSDP parameters (a one-device mesh here; the specs are the same on
    more), the moments are split like their parameter and M1's per-block
    energies are replicated:

    >>> import numpy as np
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ('data',))
    >>> params = {'dense': {'kernel': jax.numpy.ones((4, 8)),
    ...                     'bias': jax.numpy.zeros(8)}}
    >>> params = jax.device_put(
    ...     params, sharding.fsdp_sharding(params, mesh, min_size=16))
    >>> shardings = sharding.optimizer_sharding(tx, params)
    >>> tuple(shardings[1].mu['dense']['kernel'].spec)
    (None, 'data')
    >>> tuple(shardings[0].energy.spec)
    ()
  """
  if param_sharding is None:
    param_sharding = jax.tree.map(lambda p: p.sharding, params)
  replicated = NamedSharding(_mesh_of(param_sharding), PartitionSpec())
  abstract_state = jax.eval_shape(tx.init, params)

  def is_masked(x):
    return isinstance(x, optax.MaskedNode)

  # optax.masked / optax.partition keep a MaskedNode (an empty node, no
  # state) where a parameter is masked out; it stays one in the result, so
  # the result has the structure of ``tx.init(params)``.
  return optax.tree_map_params(
      tx,
      lambda leaf, sharding: leaf if is_masked(leaf) else sharding,
      abstract_state,
      param_sharding,
      transform_non_params=lambda _: replicated,
      is_leaf=is_masked,
  )


def fsdp_sharding(
    tree: Any, mesh: Mesh, axis: AxisNames = 'data', *, min_size: int = 0
) -> Any:
  """A fully-sharded (FSDP / ZeRO-3 style) rule for any tree of arrays.

  Each array is split over ``axis`` along its largest dimension that the
  axis size divides (the last such dimension on ties); arrays with no such
  dimension, or with fewer than ``min_size`` elements, are replicated. Use it
  for parameters, for the centering means (they are vectors of input
  features) and, through :func:`optimizer_sharding`, for the moments. A model
  annotated with ``nnx.with_partitioning`` or Linen logical axes does not need
  it.

  Args:
    tree: arrays, ``jax.ShapeDtypeStruct`` s or NNX Variables holding them.
    mesh: the device mesh.
    axis: mesh axis name (or names) to shard over.
    min_size: arrays smaller than this stay replicated (gathering a tiny bias
      costs more than storing it).

  Returns:
    A tree of ``NamedSharding`` with the structure of ``tree``.

  Examples:
    The rule needs only shapes and mesh axis sizes, so an abstract 4-device
    mesh shows what it would do:

    >>> import jax, numpy as np
    >>> from cbp_optax import sharding
    >>> mesh = jax.sharding.AbstractMesh((4,), ('data',))
    >>> tree = {'kernel': jax.ShapeDtypeStruct((6, 8), np.float32),
    ...         'bias': jax.ShapeDtypeStruct((6,), np.float32)}
    >>> specs = sharding.fsdp_sharding(tree, mesh)
    >>> tuple(specs['kernel'].spec), tuple(specs['bias'].spec)
    ((None, 'data'), ())
  """
  min_size = _checks.check_count('min_size', min_size, minimum=0)
  size = _axis_size(mesh, axis)

  def rule(leaf):
    shape = np.shape(leaf)
    candidates = [d for d in range(len(shape)) if shape[d] % size == 0]
    if not candidates or int(np.prod(shape, dtype=np.int64)) < min_size:
      return NamedSharding(mesh, PartitionSpec())
    dim = max(candidates, key=lambda d: (shape[d], d))
    spec = [None] * len(shape)
    spec[dim] = axis
    return NamedSharding(mesh, PartitionSpec(*spec))

  return jax.tree.map(rule, tree)


def batch_sharding(mesh: Mesh, axis: AxisNames = 'data') -> NamedSharding:
  """Leading (batch) dimension split over ``axis``, the rest replicated.

  Args:
    mesh: the device mesh.
    axis: the data axis (or axes).

  Returns:
    ``NamedSharding(mesh, PartitionSpec(axis))``.

  Raises:
    ValueError: ``axis`` is not an axis of ``mesh``.

  Examples:
    >>> import jax
    >>> from cbp_optax import sharding
    >>> mesh = jax.make_mesh((jax.device_count(),), ('data',))
    >>> tuple(sharding.batch_sharding(mesh).spec)
    ('data',)
  """
  _axis_size(mesh, axis)
  return NamedSharding(mesh, PartitionSpec(axis))


def check_batch_divisible(
    batch: Any, mesh: Mesh, axis: AxisNames = 'data'
) -> None:
  """Refuses a batch whose leading dimension ``axis`` does not divide.

  Args:
    batch: a tree of arrays with a common leading batch dimension (the global
      batch).
    mesh: the device mesh.
    axis: the data axis (or axes) the batch is split over.

  Raises:
    ValueError: if a leaf has no batch dimension, or its size is not a
      multiple of the number of devices along ``axis``.

  Examples:
    >>> import jax, numpy as np
    >>> from cbp_optax import sharding
    >>> mesh = jax.sharding.AbstractMesh((4,), ('data',))
    >>> sharding.check_batch_divisible({'x': np.ones((8, 2))}, mesh)
    >>> sharding.check_batch_divisible({'x': np.ones((6, 2))}, mesh)
    Traceback (most recent call last):
      ...
    ValueError: Batch size 6 (of ['x'], shape (6, 2)) is not divisible by the 4 devices of mesh axis 'data'. ...
  """
  size = _axis_size(mesh, axis)
  for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
    shape = np.shape(leaf)
    name = jax.tree_util.keystr(path) or 'the batch'
    if not shape:
      raise ValueError(
          f'{name} is a scalar; every batch leaf needs a leading batch '
          f'dimension to split over mesh axis {axis!r}.'
      )
    if shape[0] % size:
      raise ValueError(
          f'Batch size {shape[0]} (of {name}, shape {shape}) is not divisible '
          f'by the {size} devices of mesh axis {axis!r}. Every device must '
          'hold the same number of examples; use a global batch size that '
          f'is a multiple of {size} (e.g. {shape[0] - shape[0] % size or size}'
          ') or drop the remainder.'
      )


def _local_blocks(mesh: Mesh, axis: AxisNames) -> tuple[int, int, int]:
  """(blocks of ``axis`` this process addresses, first block, axis size).

  The batch dimension split over ``axis`` falls into ``size`` equal blocks,
  one per position along the axis; a process holds the blocks of its own
  devices. Raises if those are not one contiguous run (a mesh whose devices
  interleave processes along the data axis).
  """
  size = _axis_size(mesh, axis)
  sharding = batch_sharding(mesh, axis)
  rows = set()
  for index in sharding.addressable_devices_indices_map((size,)).values():
    rows.add(index[0].indices(size)[0])
  if not rows:
    raise ValueError('This process addresses no device of the mesh.')
  first, count = min(rows), len(rows)
  if rows != set(range(first, first + count)):
    raise ValueError(
        f'The devices of process {jax.process_index()} sit at positions '
        f'{sorted(rows)} of mesh axis {axis!r}, not one contiguous run, so '
        'its rows of the batch are not one slice. Build the mesh with '
        'jax.make_mesh (which keeps each process\'s devices together) or '
        'order the devices by process.'
    )
  return count, first, size


def process_batch_slice(
    global_batch_size: int, mesh: Mesh, axis: AxisNames = 'data'
) -> slice:
  """The rows of a global batch that this process loads and passes on.

  With one process that is the whole batch. With several
  (``jax.distributed.initialize``), each process feeds the devices it holds,
  and under the batch sharding of :func:`batch_sharding` those are one
  contiguous slice of the global batch: ``global_batch[slice]`` is what
  this process gives :func:`shard_batch`. With ``jax.make_mesh`` over ``N``
  processes sharing the data axis equally, process ``p`` gets the ``p``-th
  of ``N`` equal parts; when the data axis does not span the processes (they
  differ along another axis only), each loads the whole batch.

  Args:
    global_batch_size: the batch size summed over all processes; a multiple
      of the devices along ``axis``.
    mesh: the device mesh (over the devices of all processes).
    axis: the data axis (or axes).

  Returns:
    A ``slice`` of ``range(global_batch_size)``.

  Raises:
    ValueError: ``global_batch_size`` is not divisible by the devices along
      ``axis``, or this process's devices are not contiguous along it.

  Examples:
    One process holds the whole batch:

    >>> import jax
    >>> from cbp_optax import sharding
    >>> mesh = jax.make_mesh((jax.device_count(),), ('data',))
    >>> sharding.process_batch_slice(8 * jax.device_count(), mesh) == slice(
    ...     0, 8 * jax.device_count())
    True
  """
  global_batch_size = _checks.check_count('global_batch_size',
                                          global_batch_size, minimum=1)
  count, first, size = _local_blocks(mesh, axis)
  if global_batch_size % size:
    check_batch_divisible(
        jax.ShapeDtypeStruct((global_batch_size,), np.float32), mesh, axis)
  block = global_batch_size // size
  return slice(first * block, (first + count) * block)


def shard_batch(batch: Any, mesh: Mesh, axis: AxisNames = 'data') -> Any:
  """Places a batch split along its leading dimension over ``axis``.

  ``batch`` is what *this process* holds. On one host that is the global
  batch. With several processes (``jax.distributed.initialize``) each passes
  only its own rows, ``global_batch[process_batch_slice(...)]``, and the
  global array is assembled with ``jax.make_array_from_process_local_data``:
  its batch size is the local one times the share of the data axis this
  process holds (times ``jax.process_count()`` for the usual mesh over all
  processes). All processes must pass the same local batch size. The global
  batch size must be a multiple of the devices along ``axis``
  (:func:`check_batch_divisible`).

  Args:
    batch: a tree of host arrays with a common leading batch dimension (this
      process's rows).
    mesh: the device mesh (over the devices of all processes).
    axis: the data axis (or axes).

  Returns:
    The batch as global ``jax.Array`` s sharded with :func:`batch_sharding`.

  Raises:
    ValueError: the global batch size is not divisible by the devices along
      ``axis`` (with several processes: the local batch size is not
      divisible by this process's devices along ``axis``).

  Examples:
    >>> import jax, numpy as np
    >>> from cbp_optax import sharding
    >>> mesh = jax.make_mesh((jax.device_count(),), ('data',))
    >>> global_x = np.arange(8.0 * jax.device_count()).reshape(-1, 2)
    >>> rows = sharding.process_batch_slice(len(global_x), mesh)
    >>> x = sharding.shard_batch(global_x[rows], mesh)
    >>> x.shape == global_x.shape
    True
  """
  sharding = batch_sharding(mesh, axis)
  count, _, size = _local_blocks(mesh, axis)

  def global_shape(leaf) -> tuple[int, ...]:
    shape = np.shape(leaf)
    if not shape or count == size:
      return shape  # this process holds the whole batch dimension
    return (shape[0] // count * size,) + shape[1:]

  if count != size:
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
      shape = np.shape(leaf)
      if shape and shape[0] % count:
        name = jax.tree_util.keystr(path) or 'the batch'
        raise ValueError(
            f'Process-local batch size {shape[0]} (of {name}, shape {shape}) '
            f'is not divisible by the {count} devices process '
            f'{jax.process_index()} holds along mesh axis {axis!r} ({size} '
            f'in all). Every device must hold the same number of examples: '
            f'use a global batch size that is a multiple of {size} and give '
            'each process its process_batch_slice of it.'
        )

  check_batch_divisible(
      jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(global_shape(x), np.result_type(x)),
          batch,
      ),
      mesh,
      axis,
  )

  def place(leaf):
    leaf = np.asarray(leaf)
    return jax.make_array_from_process_local_data(
        sharding, leaf, global_shape(leaf)
    )

  return jax.tree.map(place, batch)
