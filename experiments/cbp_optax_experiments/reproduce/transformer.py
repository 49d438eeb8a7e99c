"""Beyond the paper: CBP on a byte-level transformer language model, vs AdamW.

The task: next-byte prediction on real text every machine with Python has,
the ``.py`` sources of the Python standard library found at run time
(``sysconfig.get_paths()['stdlib']``; nothing is copied into the repository).
Files under a directory named ``site-packages``, ``dist-packages``, ``test``,
``tests``, ``idlelib`` or ``__pycache__`` are left out. The split is by file:
a file is in the validation split when the SHA-256 of its path relative to
the root (POSIX separators, UTF-8) is 0 mod 10, so validation text is unseen
code. ``--data PATH`` reads one text file (split 90 / 10 by position) or a
directory of text files (every file, same rule by file) instead.

The model: a decoder-only transformer in Flax NNX, written as current Flax
code writes it: byte (256) and position embeddings, pre-LayerNorm blocks
built once with ``nnx.vmap`` (split rngs) and run with ``nnx.scan`` (one
compiled block), causal ``nnx.MultiHeadAttention``, a GELU MLP (4x width),
dropout on the embeddings and both residual branches, a final LayerNorm and
an untied output head.

Arms, all trained through ``cbp_optax.nnx.train_step`` (with a plain model it
is an ordinary fused step, so the step costs compare), with the same
warm-up + cosine schedule and decoupled weight decay 0.1 on the matrices
(kernels) only - embeddings, norms and biases are not decayed:

* AdamW: ``optax.adamw`` on the plain model.
* Adam + Center: ``optax.adamw`` (Adam with the same decoupled decay) on the
  model centered by ``cbp_optax.nnx.center``.
* CBP M1+M3: ``cbp.cbp`` on the plain model, M1 with one block per layer
  slice of the stacked blocks (``stacked_blocks(model, 'blocks')``).
* CBP (full): the centered model, ``cbp.cbp`` with ``stacked_blocks(model)``.

Protocol: a learning-rate grid per arm at seed 0 (full budget), the rate with
the lowest final validation loss is chosen, then seeds 1.. at that rate (the
grid's seed-0 run is reused). Validation loss is in bits per byte on fixed
windows of the validation split.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import os
import pathlib
import platform
import sys
import sysconfig
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm
from flax import nnx

import cbp_optax as cbp
from cbp_optax_experiments.reproduce import plotting
from cbp_optax_experiments.reproduce import stats
from cbp_optax_experiments.reproduce.context import StudyContext, StudyResult

NAME = 'transformer'
TITLE = 'Beyond the paper: byte-level transformer LM, CBP vs AdamW'

VOCAB = 256
EXCLUDED_DIRS = ('site-packages', 'dist-packages', 'test', 'tests', 'idlelib',
                 '__pycache__')
VALIDATION_MODULUS = 10
REFERENCE = 'AdamW'
# 1e-3 was never chosen in a first run (4 x 64, 240 steps) and 1e-2, its top,
# was chosen by every arm; 3e-2 was then better for both CBP arms.
GRID = (3e-3, 1e-2, 3e-2)
WEIGHT_DECAY = 0.1
WARMUP_FRACTION = 0.1
FINAL_LR_FRACTION = 0.1
MEAN_DECAY = 0.99


@dataclasses.dataclass(frozen=True)
class Config:
  """Model size and training budget."""
  depth: int = 4
  width: int = 128
  heads: int = 4
  context: int = 128
  batch: int = 32
  dropout: float = 0.1
  # 20 runs (3 rates + 2 more seeds, 4 arms) of 100 steps: 0.84 s a step at
  # load 2-4 on 2 cores (benchmarks/run.py --archs Transformer), ~30 min with
  # the evaluations; less on an idle machine.
  steps: int = 100
  eval_every: int = 10
  eval_windows: int = 64


QUICK = Config(depth=2, width=32, heads=2, context=32, batch=8, steps=12,
               eval_every=6, eval_windows=16)


# ----------------------------------------------------------------------------
# Data


@dataclasses.dataclass
class Corpus:
  """Training and validation bytes, and where they came from."""
  train: np.ndarray
  validation: np.ndarray
  info: dict[str, Any]


def is_validation(relative_path: str) -> bool:
  """The by-file split: SHA-256 of the relative POSIX path, 0 mod 10."""
  digest = hashlib.sha256(relative_path.encode('utf-8')).hexdigest()
  return int(digest, 16) % VALIDATION_MODULUS == 0


def stdlib_root() -> pathlib.Path:
  return pathlib.Path(sysconfig.get_paths()['stdlib'])


def corpus_files(root: pathlib.Path, suffix: Optional[str]) -> list[str]:
  """Relative POSIX paths under ``root``, sorted, excluded directories left
  out; only names ending in ``suffix`` when given."""
  found = []
  for directory, dirs, files in os.walk(root):
    dirs[:] = sorted(d for d in dirs if d not in EXCLUDED_DIRS)
    for name in files:
      if suffix is None or name.endswith(suffix):
        found.append((pathlib.Path(directory) / name).relative_to(
            root).as_posix())
  return sorted(found)


def split_files(files: Sequence[str]) -> tuple[list[str], list[str]]:
  validation = [f for f in files if is_validation(f)]
  return [f for f in files if not is_validation(f)], validation


def _read(root: pathlib.Path, files: Sequence[str]) -> np.ndarray:
  # Files are joined by a newline, so no window starts mid-token of another.
  chunks = [(root / f).read_bytes() + b'\n' for f in files]
  return np.frombuffer(b''.join(chunks), np.uint8)


def load_corpus(data: Optional[pathlib.Path] = None,
                max_bytes: Optional[int] = None) -> Corpus:
  """The standard library's ``.py`` files, or ``data`` (a file or folder).

  ``max_bytes`` caps each split (the ``--quick`` run reads less).
  """
  if data is not None and pathlib.Path(data).is_file():
    text = np.frombuffer(pathlib.Path(data).read_bytes(), np.uint8)
    cut = int(len(text) * 0.9)
    train, validation = text[:cut], text[cut:]
    info = {'source': str(data), 'rule': 'one file: first 90% train, last '
            '10% validation', 'train_files': 1, 'validation_files': 1}
  else:
    root = pathlib.Path(data) if data is not None else stdlib_root()
    files = corpus_files(root, None if data is not None else '.py')
    train_files, val_files = split_files(files)
    if not train_files or not val_files:
      raise ValueError(f'{root}: need files in both splits, found '
                       f'{len(train_files)} / {len(val_files)}')
    if max_bytes is not None:
      # Enough files for max_bytes, in the fixed sorted order.
      train_files = _prefix_by_size(root, train_files, max_bytes)
      val_files = _prefix_by_size(root, val_files, max_bytes)
    train, validation = _read(root, train_files), _read(root, val_files)
    info = {'source': ('Python standard library' if data is None
                       else str(root)),
            'root': str(root),
            'rule': (f'by file: sha256(relative path) mod '
                     f'{VALIDATION_MODULUS} == 0 -> validation; directories '
                     f'{list(EXCLUDED_DIRS)} excluded'),
            'train_files': len(train_files),
            'validation_files': len(val_files)}
  if max_bytes is not None:
    train, validation = train[:max_bytes], validation[:max_bytes]
  info.update(python=platform.python_version(), train_bytes=int(train.size),
              validation_bytes=int(validation.size))
  return Corpus(train, validation, info)


def _prefix_by_size(root, files, max_bytes):
  total, chosen = 0, []
  for f in files:
    chosen.append(f)
    total += (root / f).stat().st_size
    if total >= max_bytes:
      break
  return chosen


def training_batches(corpus: Corpus, config: Config, seed: int, steps: int):
  """``steps`` batches of random windows of ``context + 1`` bytes."""
  rng = np.random.default_rng(seed)
  span = config.context + 1
  starts = rng.integers(0, corpus.train.size - span, (steps, config.batch))
  return starts


def windows(data: np.ndarray, starts: np.ndarray, span: int) -> np.ndarray:
  return data[starts[..., None] + np.arange(span)].astype(np.int32)


def validation_windows(corpus: Corpus, config: Config) -> np.ndarray:
  """Fixed windows, evenly spaced over the validation split."""
  span = config.context + 1
  starts = np.linspace(0, corpus.validation.size - span,
                       config.eval_windows).astype(np.int64)
  return windows(corpus.validation, starts, span)


# ----------------------------------------------------------------------------
# The model


class Block(nnx.Module):
  """Pre-LayerNorm block: causal self-attention and a GELU MLP, residual."""

  def __init__(self, config: Config, rngs: nnx.Rngs, centered: bool = False):
    width = config.width
    self.norm1 = nnx.LayerNorm(width, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(
        num_heads=config.heads, in_features=width, decode=False, rngs=rngs)
    self.norm2 = nnx.LayerNorm(width, rngs=rngs)
    self.up = nnx.Linear(width, 4 * width, rngs=rngs)
    self.down = nnx.Linear(4 * width, width, rngs=rngs)
    self.dropout = nnx.Dropout(config.dropout)

  def __call__(self, x, key, deterministic: bool):
    mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
    keys = jax.random.split(key)
    h = self.attn(self.norm1(x), mask=mask, deterministic=True)
    x = x + self.dropout(h, deterministic=deterministic, rngs=keys[0])
    h = self.down(nnx.gelu(self.up(self.norm2(x))))
    return x + self.dropout(h, deterministic=deterministic, rngs=keys[1])


class TransformerLM(nnx.Module):
  """Decoder-only byte-level LM; ``model(tokens, rngs)`` gives logits.

  Dropout draws from ``rngs.dropout`` and is off when ``rngs`` is None.
  """

  def __init__(self, config: Config, rngs: nnx.Rngs, centered: bool = False):
    self.depth = config.depth
    self.embed = nnx.Embed(VOCAB, config.width, rngs=rngs)
    self.pos = nnx.Embed(config.context, config.width, rngs=rngs)

    # Centered inside the vmap with the stack axis named, so that center
    # never guesses it from shapes (depth == heads is ambiguous).
    @nnx.split_rngs(splits=config.depth)
    @nnx.vmap(in_axes=(0,), out_axes=0,
              transform_metadata={nnx.PARTITION_NAME: 'layers'})
    def create(rngs):
      block = Block(config, rngs)
      if centered:
        cbp.nnx.center(block)
      return block

    self.blocks = create(rngs)
    self.norm = nnx.LayerNorm(config.width, rngs=rngs)
    self.head = nnx.Linear(config.width, VOCAB, rngs=rngs)
    self.dropout = nnx.Dropout(config.dropout)

  def __call__(self, tokens, rngs: Optional[nnx.Rngs] = None):
    deterministic = rngs is None
    key = jax.random.key(0) if deterministic else rngs.dropout()
    keys = jax.random.split(key, self.depth + 1)
    x = self.embed(tokens) + self.pos(jnp.arange(tokens.shape[1]))
    x = self.dropout(x, deterministic=deterministic, rngs=keys[-1])

    @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=nnx.Carry)
    def body(x, block, key):
      return block(x, key, deterministic)

    x = body(x, self.blocks, keys[:-1])
    return self.head(self.norm(x))


def build_model(config: Config, seed: int, centered: bool) -> TransformerLM:
  model = TransformerLM(config, nnx.Rngs(params=seed), centered)
  if centered:
    cbp.nnx.center(model)
  return model


def lm_loss(model, window, rngs=None):
  """Mean next-byte cross-entropy (nats) of ``window`` [batch, context+1]."""
  logits = model(window[:, :-1], rngs)
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, window[:, 1:]).mean()


def decay_mask(params):
  """True for the matrices that are decayed: kernels (not embeddings, norms,
  biases or centering means)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: _last_key(path) == 'kernel', params)


def _last_key(path) -> str:
  last = path[-1]
  for attr in ('key', 'name', 'idx'):
    if hasattr(last, attr):
      value = str(getattr(last, attr))
      return value if value != 'value' else _last_key(path[:-1])
  return str(last)


def stacked_for(model: nnx.Module, centered: bool):
  """One M1 block per layer slice: found from the centered layers, or named."""
  return (cbp.nnx.stacked_blocks(model) if centered
          else cbp.nnx.stacked_blocks(model, 'blocks'))


@dataclasses.dataclass(frozen=True)
class Arm:
  name: str
  centered: bool
  cbp: bool


ARMS = (Arm('AdamW', False, False), Arm('Adam + Center', True, False),
        Arm('CBP M1+M3', False, True), Arm('CBP (full)', True, True))


def schedule(peak: float, steps: int) -> optax.Schedule:
  warmup = max(1, int(WARMUP_FRACTION * steps))
  return optax.warmup_cosine_decay_schedule(
      0.0, peak, warmup, steps, end_value=peak * FINAL_LR_FRACTION)


def make_tx(arm: Arm, model: nnx.Module, steps: int):
  """The arm's transform with a unit-peak schedule, then ``x peak``.

  The peak rate is an injected hyperparameter (``set_peak``), so every run of
  an arm shares one transform and one compiled step. Both AdamW and CBP apply
  the schedule (and the decoupled decay, added before it) last, so scaling
  their output by ``peak`` is exactly the same update as a ``peak``-high
  schedule.
  """
  lr = schedule(1.0, steps)
  if arm.cbp:
    base = cbp.cbp(lr, weight_decay=WEIGHT_DECAY, mask=decay_mask,
                   stacked=stacked_for(model, arm.centered))
  else:
    base = optax.adamw(lr, weight_decay=WEIGHT_DECAY, mask=decay_mask)
  return peak_scaled(base)


def peak_scaled(base: optax.GradientTransformation):
  """``base`` (built with a unit-peak schedule), then ``x peak`` (set_peak)."""
  return optax.chain(base, optax.inject_hyperparams(optax.scale)(
      step_size=1.0))


def set_peak(optimizer, peak: float) -> None:
  optimizer.opt_state[1].hyperparams['step_size'][...] = jnp.asarray(
      peak, jnp.float32)


class Trainer:
  """One transform and one fused step per arm, shared by its runs."""

  def __init__(self, arm: Any, config: Config, tx_factory=None):
    """``tx_factory(arm, model, steps)``: the arm's transform (make_tx)."""
    self.arm, self.config = arm, config
    self.tx = (tx_factory or make_tx)(
        arm, build_model(config, 0, arm.centered), config.steps)
    self.step = cbp.nnx.train_step(lm_loss, mean_decay=MEAN_DECAY)


# ----------------------------------------------------------------------------
# One run


@dataclasses.dataclass
class Run:
  arm: str
  lr: float
  seed: int
  eval_steps: list[int]
  eval_seconds: list[float]
  val_bpb: list[float]
  train_loss: list[float]
  step_seconds: float
  compile_seconds: float
  skipped: int
  steps: int
  disparity: dict[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def best_bpb(self) -> float:
    finite = [v for v in self.val_bpb if math.isfinite(v)]
    return min(finite) if finite else math.nan

  @property
  def final_bpb(self) -> float:
    return self.val_bpb[-1]


@nnx.jit
def _eval_loss(model, windows_):
  return lm_loss(model, windows_)


def validation_bpb(model, val: np.ndarray, batch: int) -> float:
  model.eval()
  total = 0.0
  for i in range(0, len(val), batch):
    chunk = jnp.asarray(val[i:i + batch])
    total += float(_eval_loss(model, chunk)) * len(chunk)
  model.train()
  return total / len(val) / math.log(2.0)


def m1_profile(optimizer, model, centered: bool) -> dict[str, Any]:
  """Per-block raw gradient RMS-energy norm sqrt(q_l) and the equalized
  s_l sqrt(q_l), from M1's state (``cbp.equalize_stats``)."""
  params = nnx.state(model, nnx.Param)
  found = cbp.equalize_stats(optimizer.opt_state, params,
                             stacked=stacked_for(model, centered))
  names = list(found)
  raw = np.sqrt(np.array([float(found[n].energy) for n in names]))
  scales = np.array([float(found[n].scale) for n in names])
  return {'names': names, 'raw': raw, 'equalized': raw * scales,
          'scales': scales}


def train_run(trainer: Trainer, corpus: Corpus, lr: float, seed: int,
              val: np.ndarray, record_m1: bool = False) -> Run:
  arm, config, step = trainer.arm, trainer.config, trainer.step
  model = build_model(config, seed, arm.centered)
  optimizer = cbp.nnx.Optimizer(model, trainer.tx)
  set_peak(optimizer, lr)
  rngs = nnx.Rngs(dropout=seed + 1000)
  starts = training_batches(corpus, config, seed, config.steps)
  span = config.context + 1
  eval_steps, eval_seconds, val_bpb, train_loss = [0], [0.0], [], []
  val_bpb.append(validation_bpb(model, val, config.batch))
  m1 = {'steps': [], 'raw_disparity': [], 'equalized_disparity': []}
  durations, clock, first = [], 0.0, 0.0
  for t in range(config.steps):
    batch = jnp.asarray(windows(corpus.train, starts[t], span))
    start = time.perf_counter()
    out = step(model, optimizer, batch, rngs)
    loss = float(out.loss)
    seconds = time.perf_counter() - start
    if t == 0:
      first = seconds
    else:
      durations.append(seconds)
    clock += seconds
    train_loss.append(loss)
    if (t + 1) % config.eval_every == 0 or t + 1 == config.steps:
      eval_steps.append(t + 1)
      eval_seconds.append(clock)
      val_bpb.append(validation_bpb(model, val, config.batch))
      if record_m1 and arm.cbp:
        profile = m1_profile(optimizer, model, arm.centered)
        m1['steps'].append(t + 1)
        for key in ('raw', 'equalized'):
          v = profile[key]
          m1[f'{key}_disparity'].append(float(v.max() / v.min()))
        m1['final'] = profile
  step_seconds = float(np.median(durations)) if durations else first
  # The first call of an arm's step compiles and runs one step; later runs
  # of the arm reuse the executable (compile ~0).
  compile_seconds = max(0.0, first - step_seconds)
  # Wall clock counts the first step as one ordinary step, not its compile.
  eval_seconds = [s - compile_seconds if s > 0 else s for s in eval_seconds]
  return Run(arm.name, lr, seed, eval_steps, eval_seconds, val_bpb,
             train_loss, step_seconds, compile_seconds,
             int(optimizer.skipped_steps[...]), config.steps,
             m1 if record_m1 and arm.cbp else {})


# ----------------------------------------------------------------------------
# The study


def first_reach(run: Run, target: float) -> tuple[float, float]:
  """(steps, seconds) at the first evaluation at or below ``target``."""
  for s, sec, v in zip(run.eval_steps, run.eval_seconds, run.val_bpb):
    if math.isfinite(v) and v <= target:
      return float(s), float(sec)
  return math.nan, math.nan


def _fmt(values, digits=3) -> str:
  values = [v for v in values if math.isfinite(v)]
  return stats.format_mean_std(values, digits) if values else 'not reached'


def study(ctx: StudyContext, config: Config, grid: Sequence[float],
          seeds: int, data: Optional[pathlib.Path],
          arms: Sequence[Arm] = ARMS) -> StudyResult:
  start = time.perf_counter()
  corpus = load_corpus(data, max_bytes=400_000 if ctx.quick else None)
  val = validation_windows(corpus, config)
  total = len(arms) * (len(grid) + seeds - 1)
  bar = tqdm.tqdm(total=total, desc=NAME, unit='run', disable=not ctx.progress)
  grid_runs: dict[str, list[Run]] = {}
  seed_runs: dict[str, list[Run]] = {}
  for arm in arms:
    trainer = Trainer(arm, config)
    grid_runs[arm.name] = []
    for lr in grid:
      bar.set_postfix_str(f'{arm.name} lr {lr:g}')
      grid_runs[arm.name].append(
          train_run(trainer, corpus, lr, 0, val, record_m1=True))
      bar.update()
    finals = [r.final_bpb for r in grid_runs[arm.name]]
    finite = [i for i, v in enumerate(finals) if math.isfinite(v)]
    best = min(finite, key=lambda i: finals[i]) if finite else 0
    seed_runs[arm.name] = [grid_runs[arm.name][best]]
    for seed in range(1, seeds):
      bar.set_postfix_str(f'{arm.name} seed {seed}')
      seed_runs[arm.name].append(
          train_run(trainer, corpus, grid[best], seed, val))
      bar.update()
  bar.close()
  summary, md = report(ctx, config, corpus, grid, grid_runs, seed_runs, arms)
  summary['seconds'] = time.perf_counter() - start
  plotting.write_json(ctx.out / 'results.json', {
      **summary,
      'runs': {a: [dataclasses.asdict(r) for r in runs]
               for a, runs in grid_runs.items()},
      'seed_runs': {a: [dataclasses.asdict(r) for r in runs]
                    for a, runs in seed_runs.items()}})
  plotting.write_markdown(ctx.out / 'results.md', TITLE, md)
  return StudyResult(NAME, summary, summary['seconds'])


def report(ctx, config, corpus, grid, grid_runs, seed_runs, arms):
  reference = seed_runs.get(REFERENCE) or next(iter(seed_runs.values()))
  target = float(np.mean([r.final_bpb for r in reference]))
  rows, per_arm = [], {}
  for arm in arms:
    runs = seed_runs[arm.name]
    reach = [first_reach(r, target) for r in runs]
    per_arm[arm.name] = {
        'lr': runs[0].lr,
        'best_bpb': [r.best_bpb for r in runs],
        'final_bpb': [r.final_bpb for r in runs],
        'steps_to_target': [s for s, _ in reach],
        'seconds_to_target': [s for _, s in reach],
        'reached': sum(math.isfinite(s) for s, _ in reach),
        'step_ms': [1e3 * r.step_seconds for r in runs],
        # The arm's step compiles once, in its first run.
        'compile_s': grid_runs[arm.name][0].compile_seconds,
        'skipped_fraction': [r.skipped / r.steps for r in runs],
    }
    p = per_arm[arm.name]
    rows.append([arm.name, f'{p["lr"]:g}', _fmt(p['best_bpb']),
                 _fmt(p['final_bpb']),
                 f'{_fmt(p["steps_to_target"], 0)} ({p["reached"]}/'
                 f'{len(runs)})',
                 _fmt(p['seconds_to_target'], 1), _fmt(p['step_ms'], 1),
                 f'{p["compile_s"]:.1f}',
                 f'{np.mean(p["skipped_fraction"]):.3f}'])
  ref_ms = np.mean(per_arm[reference[0].arm]['step_ms'])
  ref_compile = per_arm[reference[0].arm]['compile_s']
  ratios = {a: {'step_time': float(np.mean(p['step_ms']) / ref_ms),
                'compile': float(p['compile_s'] / ref_compile)
                if ref_compile > 0 else math.nan}
            for a, p in per_arm.items()}
  params = nnx.state(build_model(config, 0, False), nnx.Param)
  n_params = int(sum(np.size(x) for x in jax.tree.leaves(params)))
  info = corpus.info
  setup = (
      f'Data: {info["source"]} (Python {info["python"]}), {info["rule"]}; '
      f'{info["train_files"]} training files ({info["train_bytes"]:,} bytes), '
      f'{info["validation_files"]} validation files '
      f'({info["validation_bytes"]:,} bytes). Model: byte-level decoder-only '
      f'transformer, {config.depth} layers (nnx.vmap + nnx.scan), width '
      f'{config.width}, {config.heads} heads, context {config.context}, '
      f'dropout {config.dropout}, {n_params:,} parameters. Batch '
      f'{config.batch} x {config.context} tokens, {config.steps} steps '
      f'({config.steps * config.batch * config.context:,} training tokens) '
      f'for every run; warm-up {WARMUP_FRACTION:.0%} then cosine to '
      f'{FINAL_LR_FRACTION:g} x peak; decoupled weight decay {WEIGHT_DECAY} '
      f'on kernels only. Peak rate per arm from {list(grid)} by the final '
      f'validation loss at seed 0, then {len(reference)} seeds at that rate. '
      f'Validation: {config.eval_windows} fixed windows every '
      f'{config.eval_every} steps, bits per byte. Target = {REFERENCE}\'s '
      f'mean final validation loss, {target:.4f} bits/byte. Times: median '
      f'step (training only, evaluation excluded), compile = first call '
      f'minus one step; the runs are timed one after the other, so on a '
      f'shared machine their times also measure the load when they ran (the '
      f'benchmark suite interleaves the steps for the cost ratio); jax '
      f'{jax.__version__} on '
      f'{jax.devices()[0].platform}, {os.cpu_count()} CPU(s), load average '
      f'{" / ".join(f"{v:.1f}" for v in os.getloadavg())} at the end.')
  table = plotting.markdown_table(
      ['arm', 'peak lr', 'best val bits/byte', 'final val bits/byte',
       'steps to target (reached)', 'seconds to target', 'ms / step',
       'compile (s)', 'skipped'], rows)
  profile = plotting.markdown_table(
      ['arm'] + [f'lr {lr:g}' for lr in grid],
      [[a] + [f'{r.final_bpb:.4f}' if math.isfinite(r.final_bpb) else 'diverged'
              for r in runs] for a, runs in grid_runs.items()])
  cost = plotting.markdown_table(
      ['arm', f'step time / {REFERENCE}', f'compile time / {REFERENCE}'],
      [[a, f'{r["step_time"]:.2f}', f'{r["compile"]:.2f}']
       for a, r in ratios.items()])
  disparity = plot_disparity(grid_runs, seed_runs,
                             ctx.out / 'transformer_m1_disparity.png')
  plot_curves(seed_runs, ctx.out / 'transformer_curves.png', target)
  verdicts = verdict_lines(per_arm, ratios, disparity)
  summary = {'corpus': info, 'config': dataclasses.asdict(config),
             'parameters': n_params, 'grid': list(grid),
             'target_bpb': target, 'per_arm': per_arm, 'ratios': ratios,
             'm1_disparity': disparity, 'verdicts': verdicts}
  md = [setup, table, '## Cost relative to AdamW', cost,
        '## Learning-rate grid (final validation bits/byte, seed 0)', profile,
        '## M1 block disparity (max / min block gradient norm, CBP arms, '
        'seed 0 at the chosen rate)', disparity_table(disparity),
        '## Verdicts', '\n'.join(f'- {v}' for v in verdicts),
        '![curves](transformer_curves.png)',
        '![M1 disparity](transformer_m1_disparity.png)']
  return summary, md


def _chosen(grid_runs, seed_runs, arm):
  return seed_runs[arm][0]


def plot_curves(seed_runs, path, target):
  fig, axes = plotting.new_axes(1, 2)
  for name, runs in seed_runs.items():
    steps = np.asarray(runs[0].eval_steps)
    curves = np.array([r.val_bpb for r in runs])
    plotting.band(axes[0], steps, curves, name)
    seconds = np.mean([r.eval_seconds for r in runs], axis=0)
    plotting.band(axes[1], seconds, curves, name)
  for ax, label in zip(axes, ('step', 'training seconds')):
    ax.axhline(target, color='gray', ls=':', lw=1, label=f'{REFERENCE} final')
    ax.set_xlabel(label)
    ax.set_ylabel('validation bits / byte')
    finite = [v for r in seed_runs.values() for x in r for v in x.val_bpb[1:]
              if math.isfinite(v)]
    if finite:
      ax.set_ylim(min(finite) - 0.1, min(max(finite), 8.5))
  axes[0].legend(fontsize=7)
  axes[0].set_title('median over seeds, IQR shaded', fontsize=9)
  plotting.save(fig, path)


def plot_disparity(grid_runs, seed_runs, path) -> dict[str, Any]:
  found = {name: _chosen(grid_runs, seed_runs, name).disparity
           for name in seed_runs if _chosen(grid_runs, seed_runs, name).disparity}
  fig, axes = plotting.new_axes(1, 2)
  out = {}
  for name, m1 in found.items():
    if not m1.get('steps'):
      continue
    line, = axes[0].plot(m1['steps'], m1['raw_disparity'], label=f'{name} raw')
    axes[0].plot(m1['steps'], m1['equalized_disparity'], ls='--',
                 color=line.get_color(), label=f'{name} equalized')
    final = m1['final']
    names = final['names']
    x = np.arange(len(names))
    axes[1].semilogy(x, final['raw'], 'o', color=line.get_color(), ms=3,
                     label=f'{name} raw')
    axes[1].semilogy(x, final['equalized'], 'x', color=line.get_color(),
                     ms=3, label=f'{name} equalized')
    out[name] = {'steps': m1['steps'], 'raw': m1['raw_disparity'],
                 'equalized': m1['equalized_disparity'],
                 'final_blocks': {n: [float(r), float(e)] for n, r, e in zip(
                     names, final['raw'], final['equalized'])}}
  axes[0].set_yscale('log')
  axes[0].set_xlabel('step')
  axes[0].set_ylabel('max / min block norm')
  axes[0].legend(fontsize=6)
  axes[1].set_xlabel('M1 block (one per layer slice; order of block_names)')
  axes[1].set_ylabel('sqrt(q_l), s_l sqrt(q_l) at the end')
  axes[1].legend(fontsize=6)
  plotting.save(fig, path)
  return out


def disparity_table(disparity) -> str:
  rows = []
  for name, d in disparity.items():
    if not d['steps']:
      continue
    blocks = d['final_blocks']
    slices = sorted(n for n in blocks if n.startswith('blocks'))
    rows.append([name, len(blocks), len(slices), f'{d["raw"][0]:.1f}',
                 f'{d["equalized"][0]:.1f}', f'{d["raw"][-1]:.1f}',
                 f'{d["equalized"][-1]:.1f}'])
  return plotting.markdown_table(
      ['arm', 'M1 blocks', 'of which layer slices', 'raw, first eval',
       'equalized, first eval', 'raw, end', 'equalized, end'], rows)


def _compare(a: Sequence[float], b: Sequence[float]) -> str:
  a = [v for v in a if math.isfinite(v)]
  b = [v for v in b if math.isfinite(v)]
  if not a or not b:
    return 'n/a'
  diff = np.mean(a) - np.mean(b)
  noise = max(stats.sample_std(a), stats.sample_std(b), 1e-9)
  if diff < -noise:
    return 'better'
  if diff > noise:
    return 'worse'
  return 'tie (within one sd)'


def verdict_lines(per_arm, ratios, disparity) -> list[str]:
  ref = per_arm.get(REFERENCE)
  lines = []
  if ref is None:
    return lines
  for name, p in per_arm.items():
    if name == REFERENCE:
      continue
    word = _compare(p['best_bpb'], ref['best_bpb'])
    lines.append(
        f'{name} vs {REFERENCE}, best validation loss: {word} '
        f'({_fmt(p["best_bpb"])} vs {_fmt(ref["best_bpb"])} bits/byte); '
        f'reached {REFERENCE}\'s final loss in {p["reached"]}/'
        f'{len(p["best_bpb"])} seeds (steps {_fmt(p["steps_to_target"], 0)} '
        f'vs {_fmt(ref["steps_to_target"], 0)}); step time '
        f'{ratios[name]["step_time"]:.2f}x, compile '
        f'{ratios[name]["compile"]:.2f}x {REFERENCE}\'s.')
  for name, d in disparity.items():
    if d['steps']:
      ok = d['equalized'][-1] < d['raw'][-1]
      lines.append(
          f'{name}: M1 {"narrows" if ok else "does not narrow"} the block '
          f'gradient-norm disparity (max/min {d["raw"][-1]:.1f} raw -> '
          f'{d["equalized"][-1]:.1f} equalized at the end, within its '
          f'clip [0.1, 4]).')
  return lines


def run(ctx: StudyContext, data: Optional[pathlib.Path] = None,
        config: Optional[Config] = None,
        grid: Optional[Sequence[float]] = None) -> StudyResult:
  data = data if data is not None else getattr(ctx, 'data', None)
  if config is None:
    config = QUICK if ctx.quick else Config()
  if grid is None:
    grid = (3e-3,) if ctx.quick else GRID
  seeds = ctx.seed_count(paper=3, quick=2)
  return study(ctx, config, grid, seeds, data)


def main(argv: Optional[Sequence[str]] = None) -> int:
  """``python -m cbp_optax_experiments.reproduce.transformer`` with the model flags."""
  parser = argparse.ArgumentParser(prog='cbp_optax_experiments.reproduce.transformer',
                                   description=TITLE)
  parser.add_argument('--out', type=pathlib.Path,
                      default=pathlib.Path('reproduction') / NAME)
  parser.add_argument('--data', type=pathlib.Path, default=None,
                      help='a text file or a directory of text files '
                      '(default: the Python standard library)')
  parser.add_argument('--quick', action='store_true')
  parser.add_argument('--seeds', type=int, default=None)
  parser.add_argument('--grid', default=None, help='e.g. 1e-3,3e-3')
  parser.add_argument('--no-progress', action='store_true')
  for field in dataclasses.fields(Config):
    parser.add_argument(f'--{field.name.replace("_", "-")}', type=field.type
                        if callable(field.type) else type(field.default),
                        default=None)
  args = parser.parse_args(argv)
  base = QUICK if args.quick else Config()
  config = dataclasses.replace(base, **{
      f.name: getattr(args, f.name) for f in dataclasses.fields(Config)
      if getattr(args, f.name) is not None})
  grid = tuple(float(g) for g in args.grid.split(',')) if args.grid else None
  ctx = StudyContext(out=args.out, seeds=args.seeds, quick=args.quick,
                     progress=not args.no_progress)
  result = run(ctx, args.data, config, grid)
  print(f'{NAME}: {result.seconds:.1f} s -> {args.out}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
