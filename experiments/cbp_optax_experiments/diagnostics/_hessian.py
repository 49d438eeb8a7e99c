"""Hessian-vector products, random probes and power iteration on any tree.

The curvature half of :mod:`cbp_optax_experiments.diagnostics`: ``H v`` is
forward-over-reverse (``jax.jvp`` of ``jax.grad``), and every function works
on a parameter pytree in the floating dtype of its leaves.
"""

from __future__ import annotations

from typing import Any, Callable

import chex
import jax
import jax.numpy as jnp

LossFn = Callable[[Any], chex.Numeric]


def hvp(loss_fn: LossFn, params: Any, vector: Any) -> Any:
  """``H v`` by forward-over-reverse differentiation."""
  return jax.jvp(jax.grad(loss_fn), (params,), (vector,))[1]


# The largest count of probes or iterations: JAX's loop bounds and the
# number of keys split are int32 (beyond it, an OverflowError from inside).
MAX_COUNT = 2**31 - 1


def check_key(key: Any) -> None:
  """One PRNG key: typed (``jax.random.key``) or raw (``jax.random.PRNGKey``)."""
  dtype, shape = getattr(key, 'dtype', None), getattr(key, 'shape', None)
  typed = dtype is not None and jax.dtypes.issubdtype(dtype,
                                                      jax.dtypes.prng_key)
  if (typed and shape == ()) or (dtype == jnp.uint32 and shape == (2,)):
    return
  got = (f'the {type(key).__name__} {key!r}' if shape is None
         else f'an array of shape {shape} and dtype {dtype}')
  raise TypeError('key must be one PRNG key, jax.random.key(0) (or a raw '
                  f'jax.random.PRNGKey(0)), got {got}.')


def float_leaves(params: Any) -> None:
  for leaf in jax.tree.leaves(params):
    if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
      raise TypeError(
          'Hessian diagnostics need floating-point parameters, got a leaf of '
          f'dtype {jnp.result_type(leaf)}.')


def rademacher_like(key: chex.PRNGKey, params: Any) -> Any:
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(key, max(len(leaves), 1))
  return jax.tree.unflatten(treedef, [
      jax.random.rademacher(k, jnp.shape(leaf), jnp.result_type(leaf))
      for k, leaf in zip(keys, leaves)
  ])


def mean_and_stderr(samples: chex.Array) -> tuple[chex.Array, chex.Array]:
  n = samples.shape[0]
  mean = jnp.mean(samples, axis=0)
  if n < 2:
    return mean, jnp.full_like(mean, jnp.inf)
  return mean, jnp.std(samples, axis=0, ddof=1) / jnp.sqrt(n).astype(
      samples.dtype)



def tree_dot(a: Any, b: Any, dtype) -> chex.Array:
  return sum((jnp.sum(x.astype(dtype) * y.astype(dtype))
              for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))),
             jnp.zeros((), dtype))


def power_iteration(loss_fn, params, key, num_iters, mask, dtype):
  """Power iteration on ``P H P`` with ``P`` the 0/1 ``mask`` tree (or None)."""
  restrict = (lambda t: t) if mask is None else (
      lambda t: jax.tree.map(lambda x, m: x * m.astype(x.dtype), t, mask))
  vector = restrict(jax.tree.map(
      lambda leaf, k: jax.random.normal(k, jnp.shape(leaf),
                                        jnp.result_type(leaf)),
      params, split_like(key, params)))

  def normalize(v):
    norm = jnp.sqrt(tree_dot(v, v, dtype))
    safe = jnp.where(norm > 0, norm, 1.0)
    return jax.tree.map(lambda x: (x / safe).astype(x.dtype), v)

  def body(_, v):
    return normalize(restrict(hvp(loss_fn, params, v)))

  vector = jax.lax.fori_loop(0, num_iters, body, normalize(vector))
  hv = restrict(hvp(loss_fn, params, vector))
  eigenvalue = tree_dot(vector, hv, dtype)
  error = jax.tree.map(lambda h, v: h - eigenvalue.astype(h.dtype) * v, hv,
                       vector)
  residual = jnp.sqrt(tree_dot(error, error, dtype))
  return eigenvalue, residual, vector


def split_like(key: chex.PRNGKey, tree: Any) -> Any:
  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(
      treedef, list(jax.random.split(key, max(len(leaves), 1)))[:len(leaves)])
