"""The dev/test split of the workloads, fixed in code, and what was chosen where.

Every default, recipe rule and alias of the library is chosen on the dev
workloads only; the test workloads are run to report, never to choose. The
rule was written down on 2026-12-01, before any of the new workloads had been
run by this suite (from the names, families and sizes alone):

1. The seven original workloads (``definitions.ORIGINAL``) are dev: today's
   defaults were chosen on them, so they cannot test those defaults.
2. A new workload of a family that already has an original workload (MLP,
   convolutional, transformer) is test: its family's defaults were chosen on
   its dev sibling, and it asks whether they carry over.
3. A new family with two workloads puts the smaller model in dev and the
   other in test (tabular: breast-cancer-raw, 6.3 k parameters, dev;
   digits-raw, 26 k, test; coordinate: coord-relu, 33 k, dev; coord-fourier,
   50 k, test), so that each split has a member of the family.
4. A new family with one workload is test (autoencoder, recurrent, graph):
   no default may have been fitted to it.

Rules 3 and 4 also keep the dev split's full run (the seven original
workloads are its most expensive) within its time budget.

``CHOSEN_ON`` records, for each default of the library and of the suite that
a run chose, the split and the run it was chosen on (the lead adds an entry
with each new choice; a test checks that each names only dev workloads).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from cbp_optax_experiments.workloads import definitions

DEV = 'dev'
TEST = 'test'

FAMILIES: dict[str, str] = {
    'mlp': 'fully connected ReLU networks on MNIST (plain, LayerNorm, large '
           'batch)',
    'signal-propagation': 'deep ReLU MLPs whose initialization shrinks or '
                          'grows the signal',
    'synthetic-2d': 'low-dimensional synthetic classification (spiral)',
    'convolutional': 'CNNs with BatchNorm, residual without normalization, '
                     'plain',
    'transformer': 'attention models: byte-level LM, vision transformer',
    'tabular': 'real tabular data with raw, unscaled features',
    'coordinate': 'coordinate networks regressing an image from (x, y)',
    'autoencoder': 'deep autoencoder with logistic units',
    'recurrent': 'recurrent network over a sequence',
    'graph': 'graph network on a generated graph',
}

SPLITS: dict[str, tuple[str, ...]] = {
    DEV: ('mnist-mlp', 'init-scale-4', 'spiral', 'deep-mlp', 'tutorial-cnn',
          'resnet8', 'transformer', 'breast-cancer-raw', 'coord-relu'),
    TEST: ('digits-raw', 'coord-fourier', 'mnist-mlp-layernorm',
           'mnist-mlp-batch1024', 'gcn-sbm', 'mnist-autoencoder',
           'gru-mnist-rows', 'vit-mnist', 'cnn-plain'),
}


def split_of(name: str) -> str:
  """``'dev'`` or ``'test'``.

  Raises:
    ValueError: a workload in no split or in both.
  """
  found = [split for split, names in SPLITS.items() if name in names]
  if len(found) != 1:
    raise ValueError(f'workload {name!r} is in {len(found)} splits '
                     f'({found}); every workload is in exactly one')
  return found[0]


def workloads(split: str) -> tuple[str, ...]:
  """The split's workloads in registry (run) order."""
  if split not in SPLITS:
    raise ValueError(f'unknown split {split!r}; choose from '
                     f'{", ".join(SPLITS)}')
  return tuple(n for n in definitions.NAMES if n in SPLITS[split])


class Choice(NamedTuple):
  """Where one default was chosen.

  Attributes:
    what: the default (``module.name=value``, or a rule).
    split: the split whose workloads chose it (``'dev'``); a study outside
      the suite names the dev workload that is its copy.
    workloads: the workloads (or studies) of the run that chose it.
    run: the run: what was compared, the commit that made the change.
  """
  what: str
  split: str
  workloads: Sequence[str]
  run: str


_SEVEN = tuple(definitions.ORIGINAL)

CHOSEN_ON: tuple[Choice, ...] = (
    Choice('cbp_optax.cbp_robust damping=1e-8', DEV, _SEVEN,
           'suite run of 2026-12-01, 8 arms x 3 seeds; commit 8283620'),
    Choice("cbp_optax.cbp_robust zero_moment='normalized'", DEV,
           ('init-scale-4',),
           'init-scale grid: Algorithm 1 diverged in 20 of 30 cells; commit '
           '22a60c6'),
    Choice('cbp_optax.cbp_robust min_scale=max_scale=1.0 (M1 held at one)',
           DEV, ('transformer', 'init-scale-4'),
           'transformer ablation and init-scale grid; commit 22a60c6'),
    Choice('the former recipe: Muon (consistent_rms=0.2) on the centered '
           'model (the suite arm muon_centered_batchnorm_plain)', DEV,
           tuple(SPLITS[DEV]),
           'full dev run of 2026-12-02 (14 arms x 3 seeds, AlgoPerf targets): '
           'muon_centered had the highest headline score (steps 0.728; muon '
           '0.674, nadamw_centered 0.554, cbp_robust 0.400), chosen before '
           'the test split was read'),
    Choice('the recommended recipe leaves a model with BatchNorm plain', DEV,
           ('tutorial-cnn',),
           'same run: every centered arm missed the tutorial CNN\'s target '
           '(muon_centered final 0.896-0.938), plain Muon reached it in 225 '
           'steps (the best)'),
    Choice('cbp_optax.recommended = schedule_free_cbp_robust (cbp_robust\'s '
           'M3 without momentum, clipped to 3, inside schedule_free; centered, '
           'a BatchNorm model plain), by decision.recommend', DEV,
           tuple(SPLITS[DEV]),
           'ten-seed dev run (13 arms x 10 paired seeds) of the rule committed '
           'before it: undominated with muon_centered and '
           'muon_centered_batchnorm_plain, and the cheaper step'),
    Choice('workloads arms.NOT_BY_DEFAULT = muon_centered_batchnorm_plain '
           '(a full run leaves it out, and decision.CANDIDATES drops it)',
           DEV, tuple(SPLITS[DEV]),
           'the ten-seed runs (13 arms): its final metrics equal '
           'muon_centered\'s on every dev and test workload without '
           'BatchNorm and muon\'s on tutorial-cnn, float for float; 11 % of '
           'the vmapped dev run\'s time'),
    Choice('workloads Arm.center_batch_norm_models=False for cbp_robust '
           '(a model with BatchNorm trains plain)', DEV, ('tutorial-cnn',),
           'AdamW centered vs plain, 3 seeds (3.6 vs 0.7 points of '
           'running-average accuracy); commit 0db1723'),
)
