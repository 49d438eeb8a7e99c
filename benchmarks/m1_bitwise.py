"""Record (or compare) M1-path updates and states bit for bit.

``python benchmarks/m1_bitwise.py save OUT.npz`` runs cbp, cbp_robust,
equalize, precondition and cbp with leaf_blocks / kernel_blocks on three
trees x float32/float64, eager and jit, 4 steps, and saves every update and
every state leaf; ``compare OUT.npz`` reruns and counts differing arrays.
The states are flattened to their leaves, concatenated, so a state whose
layout changes (one array per block instead of one vector) compares by
value.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update('jax_enable_x64', True)

import cbp_optax as cbp  # noqa: E402


def trees(dtype):
  key = jax.random.PRNGKey(0)
  ks = jax.random.split(key, 12)
  r = lambda k, s: jax.random.normal(k, s, dtype)  # noqa: E731
  mlp = {'Dense_0': {'kernel': r(ks[0], (5, 7)), 'bias': r(ks[1], (7,))},
         'Dense_1': {'kernel': r(ks[2], (7, 3)), 'bias': r(ks[3], (3,))},
         'Dense_2': {'kernel': r(ks[4], (3, 2)), 'bias': r(ks[5], (2,))}}
  stacked = {'embed': {'kernel': r(ks[6], (4, 6))},
             'layers': {'kernel': r(ks[7], (3, 6, 6)), 'bias': r(ks[8], (3, 6))},
             'head': {'kernel': r(ks[9], (6, 2))}}
  unblocked = {'a': {'kernel': r(ks[10], (4, 4))},
               'b': {'kernel': r(ks[11], (4, 3)), 'scale': r(ks[0], (3,))},
               'free': r(ks[1], (5,))}
  return {'mlp': (mlp, None), 'stacked': (stacked, lambda p, l: any(
      getattr(k, 'key', None) == 'layers' for k in p)),
          'unblocked': (unblocked, None)}


def unblock_free(path, leaf):
  if getattr(path[-1], 'key', None) == 'free':
    return None
  return cbp.layer_blocks(path, leaf)


def optimizers(stacked, name):
  kw = {'stacked': stacked} if stacked is not None else {}
  bf = {'block_fn': unblock_free} if name == 'unblocked' else {}
  out = {
      'cbp': lambda: cbp.cbp(1e-2, **kw, **bf),
      'cbp_robust': lambda: cbp.cbp_robust(1e-2, **kw, **bf),
      'equalize': lambda: cbp.equalize(decay=0.9, **kw, **bf),
      'equalize_robust': lambda: cbp.equalize(min_scale=1.0, max_scale=1.0,
                                               **kw, **bf),
      'precondition': lambda: cbp.precondition(**kw),
      'cbp_leaf': lambda: cbp.cbp(1e-2, block_fn=cbp.leaf_blocks, **kw),
      'cbp_kernel': lambda: cbp.cbp(1e-2, block_fn=cbp.kernel_blocks, **kw),
  }
  return out


def run_all():
  out = {}
  for dtype in (jnp.float32, jnp.float64):
    for tname, (params, stacked) in trees(dtype).items():
      for oname, make in optimizers(stacked, tname).items():
        for mode in ('eager', 'jit'):
          tx = make()
          state = tx.init(params)
          update = jax.jit(tx.update) if mode == 'jit' else tx.update
          for step in range(4):
            grads = jax.tree.map(
                lambda x, s=step: (x * (1.7 ** s) - 0.3 * x * x).astype(
                    x.dtype) * (10.0 ** (hash(x.shape) % 5 - 2)), params)
            updates, state = update(grads, state, params)
            prefix = f'{jnp.dtype(dtype).name}/{tname}/{oname}/{mode}/{step}'
            for i, leaf in enumerate(jax.tree.leaves(updates)):
              out[f'{prefix}/u{i}'] = np.asarray(leaf)
            sl = [np.ravel(np.asarray(x)) for x in jax.tree.leaves(state)]
            out[f'{prefix}/state'] = np.concatenate(
                [x.astype(np.float64) for x in sl]) if sl else np.zeros(0)
  return out


def main():
  what, path = sys.argv[1], sys.argv[2]
  out = run_all()
  if what == 'save':
    np.savez(path, **out)
    print(f'saved {len(out)} arrays to {path}')
    return
  ref = np.load(path)
  differ = [k for k in ref.files
            if k not in out or ref[k].shape != out[k].shape
            or ref[k].dtype != out[k].dtype
            or ref[k].tobytes() != out[k].tobytes()]
  extra = set(out) - set(ref.files)
  print(f'compared {len(ref.files)} arrays: {len(differ)} differ, '
        f'{len(extra)} new')
  for k in differ[:20]:
    print('  differs:', k)
  sys.exit(1 if differ or extra else 0)


if __name__ == '__main__':
  main()
