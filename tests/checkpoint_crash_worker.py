"""Saves a checkpoint over and over until killed; run by tests/test_hardening.py.

  python tests/checkpoint_crash_worker.py DIRECTORY

Save ``k`` writes the state ``state(k)`` with ``force=True`` over save
``k - 1`` and then prints ``saved k``, so the parent knows which saves had
returned when it killed the process: the checkpoint must then restore to
the last of them, or to the one that was being written.
"""

import sys

import jax.numpy as jnp

from cbp_optax import checkpoint


def state(k: int):
  # Several arrays, one of them large enough that a save takes a while.
  return {'step': jnp.asarray(k, jnp.int32),
          'w': jnp.full((256, 256), float(k), jnp.float32),
          'b': {'x': jnp.arange(7.0) + k}}


def main(directory: str) -> None:
  k = 0
  while True:
    k += 1
    checkpoint.save(directory, state(k), force=True)
    print(f'saved {k}', flush=True)


if __name__ == '__main__':
  main(sys.argv[1])
