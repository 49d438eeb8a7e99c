"""Your own model through the workload suite: does centering help it?

A workload the suite does not contain, written from scratch: a small NNX
MLP on two interleaved half-moons. ``moons(quick)`` has the signature of the
suite's own factories and builds the workload with its public helpers
(``definitions.nnx_task``, ``definitions.Workload``). Run it with the
optimizers you care about, plain and centered::

  python examples/own_workload.py --quick --out /tmp/moons

which runs ``cbp-optax workloads --workload moons=own_workload:moons
--arms adamw,adamw_centered,muon,muon_centered`` (the same command works
from this folder, or with it on PYTHONPATH; drop ``--quick`` for the full
size and ten seeds). The report (``/tmp/moons/results.md``) gives each arm's
any-time score with its interval and, per optimizer, whether centering
made it significantly better, no different or worse, and by how much.
"""

import argparse

from flax import nnx
import jax
import jax.numpy as jnp
import optax

from cbp_optax_experiments.workloads import definitions


def _moons(key, n):
  """``n`` points on two interleaved half-moons, with noise; labels 0/1."""
  k_angle, k_label, k_noise = jax.random.split(key, 3)
  angle = jax.random.uniform(k_angle, (n,), maxval=jnp.pi)
  label = jax.random.bernoulli(k_label, 0.5, (n,)).astype(jnp.int32)
  x = jnp.where(label == 0, jnp.cos(angle), 1.0 - jnp.cos(angle))
  y = jnp.where(label == 0, jnp.sin(angle), 0.5 - jnp.sin(angle))
  points = jnp.stack([x, y], axis=1) + 0.15 * jax.random.normal(
      k_noise, (n, 2))
  return points + 3.0, label   # off-center inputs: what M2 removes


class MoonsMLP(nnx.Module):

  def __init__(self, width: int, depth: int, *, rngs: nnx.Rngs):
    sizes = [2] + [width] * depth
    self.hidden = nnx.List([nnx.Linear(a, b, rngs=rngs)
                            for a, b in zip(sizes, sizes[1:])])
    self.out = nnx.Linear(width, 2, rngs=rngs)

  def __call__(self, x):
    for layer in self.hidden:
      x = nnx.relu(layer(x))
    return self.out(x)


def moons(quick: bool) -> definitions.Workload:
  width, depth = (16, 2) if quick else (64, 4)
  steps, every, batch = (40, 10, 64) if quick else (400, 20, 128)
  train_x, train_y = _moons(jax.random.key(0), 2048)
  val_x, val_y = _moons(jax.random.key(1), 512)

  def build(centered: bool) -> definitions.Task:
    def loss_fn(model, index, rngs):
      del rngs  # no dropout
      logits = model(train_x[index])
      return optax.softmax_cross_entropy_with_integer_labels(
          logits, train_y[index]).mean()

    def metric(model):
      return jnp.mean(jnp.argmax(model(val_x), -1) == val_y)

    return definitions.nnx_task(
        lambda rngs: MoonsMLP(width, depth, rngs=rngs), centered, loss_fn,
        lambda key: jax.random.randint(key, (batch,), 0, train_x.shape[0]),
        metric)

  return definitions.Workload(
      'moons', f'two half-moons, ReLU MLP {depth} x {width}, batch {batch}, '
      f'{steps} steps', definitions.ACCURACY, True, steps, every,
      (1e-3, 3e-3, 1e-2, 3e-2), None, build, family='synthetic-2d',
      validation_size=int(val_y.shape[0]))


def main():
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument('--arms', default='adamw,adamw_centered,muon,'
                      'muon_centered', help='the optimizers to compare '
                      '(cbp-optax workloads --help lists them)')
  parser.add_argument('--quick', action='store_true',
                      help='tiny sizes and three seeds (a smoke test)')
  parser.add_argument('--out', default='/tmp/moons',
                      help='output folder for results.json / results.md')
  args = parser.parse_args()
  # Imported here: the function above is all the suite needs.
  from cbp_optax_experiments.workloads import cli  # pylint: disable=g-import-not-at-top
  argv = ['--workload', 'moons=own_workload:moons', '--arms', args.arms,
          '--out', args.out] + (['--quick'] if args.quick else [])
  raise SystemExit(cli.main(argv))


if __name__ == '__main__':
  main()
