"""The timed variants: one fused, donated train step each, for Linen or NNX.

Every variant goes through the library's fused step (``cbp.linen.train_step``
or ``cbp.nnx.train_step``): forward, backward, the optax update, the centering
transport where the model is centered, and the skip of non-finite batches.
SGD and Adam therefore pay the same finiteness check as CBP, so the ratios
isolate what CBP adds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import cbp_optax as cbp
from benchmarks import models

LEARNING_RATE = 1e-3
# XLA's copy insertion, by default, orders instructions only by data
# dependence; region analysis proves that M3's last read of v_{t-1} precedes
# the in-place write of v_t, so the lag copy disappears. Buffer assignment
# only: results are bitwise identical (checked by the suite). The library's
# fused steps compile with it on CPU (since 4f3fcf3 / c47de21); the
# "no RA" variant turns it off to show what it saves.
REGION_ANALYSIS = {'xla_cpu_copy_insertion_use_region_analysis': True}
NO_REGION_ANALYSIS = {'xla_cpu_copy_insertion_use_region_analysis': False}


def shipped_options() -> Optional[dict]:
  """What ``cbp.nnx.train_step`` passes to its AOT compile on this backend.

  Mirrored here because the NNX runner compiles ``step.lower(...)`` itself
  (to read the HLO and time compilation apart from the first step).
  """
  return dict(REGION_ANALYSIS) if jax.default_backend() == 'cpu' else None


@dataclass(frozen=True)
class Variant:
  """A row of the timing table.

  Attributes:
    name: label in tables.
    centered: wrap every layer in ``Centered`` (M2).
    make_tx: builds the optax transform.
    compiler_options: per-executable XLA options.
  """

  name: str
  centered: bool
  make_tx: Callable[[], optax.GradientTransformation]
  compiler_options: Optional[dict] = None
  m1: bool = False  # make_tx takes stacked= (M1 per layer slice)


def _cbp(stacked=None) -> optax.GradientTransformation:
  return cbp.cbp(LEARNING_RATE, stacked=stacked)


SGD = Variant('SGD', False, lambda: optax.sgd(LEARNING_RATE))
ADAM = Variant('Adam', False, lambda: optax.adam(LEARNING_RATE))
ADAM_CENTER = Variant('Adam+Center', True, lambda: optax.adam(LEARNING_RATE))
CBP_M1M3 = Variant('CBP M1+M3', False, _cbp, m1=True)
CBP_FULL = Variant('CBP', True, _cbp, m1=True)
CBP_FULL_RA = Variant('CBP (RA)', True, _cbp, REGION_ANALYSIS, m1=True)
CBP_FULL_NO_RA = Variant('CBP (no RA)', True, _cbp, NO_REGION_ANALYSIS,
                         m1=True)
VARIANTS = (SGD, ADAM, ADAM_CENTER, CBP_M1M3, CBP_FULL, CBP_FULL_NO_RA)
# The transformer is also timed against AdamW (optax defaults), the optimizer
# its users compare with.
ADAMW = Variant('AdamW', False, lambda: optax.adamw(LEARNING_RATE))


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@dataclass
class Runner:
  """A compiled step bound to its own state; ``step()`` runs and blocks.

  Attributes:
    variant: what is timed.
    api: ``'linen'`` or ``'nnx'``.
    step: advances the state by one iteration and waits for it.
    compile_s: trace + compile time (NNX: first call, including one step).
    hlo: the compiled module's text, for the copy count.
    params: the initial parameters (shapes for reports).
    opt_state_bytes: bytes of the optimizer state.
    centering_bytes: bytes of the centering buffers (mu and recorded means).
    memory: XLA's memory analysis of the step executable, in bytes.
    read_state: returns the current parameters, optimizer and centering
      state (to compare runs).
  """

  variant: Variant
  api: str
  step: Callable[[], None]
  compile_s: float
  hlo: str
  params: Any
  opt_state_bytes: int
  centering_bytes: int
  memory: dict = field(default_factory=dict)
  read_state: Callable[[], Any] = lambda: None


def _memory_analysis(compiled) -> dict:
  try:
    stats = compiled.memory_analysis()
  except Exception:  # Not every backend reports it.
    return {}
  if stats is None:
    return {}
  names = ('argument_size_in_bytes', 'output_size_in_bytes',
           'alias_size_in_bytes', 'temp_size_in_bytes')
  return {name: int(getattr(stats, name, 0)) for name in names}


def linen_runner(arch: models.Arch, variant: Variant, batch: int) -> Runner:
  """Builds, compiles (timed) and binds a Linen fused step."""
  images, labels = models.make_batch(arch, batch)
  model = models.linen_model(arch, variant.centered)
  variables = model.init(jax.random.key(0), images)
  state = cbp.linen.TrainState.create(
      apply_fn=model.apply, params=variables['params'],
      centering=variables.get('centering', {}), tx=variant.make_tx())

  def loss_fn(apply, images, labels):
    return cross_entropy(apply(images), labels)

  jitted = cbp.linen.train_step(loss_fn)
  start = time.perf_counter()
  compiled = jitted.lower(state, images, labels).compile(
      variant.compiler_options)
  compile_s = time.perf_counter() - start
  holder = {'state': state}

  def step() -> None:
    holder['state'], out = compiled(holder['state'], images, labels)
    jax.block_until_ready((holder['state'], out))

  return Runner(
      variant=variant, api='linen', step=step, compile_s=compile_s,
      hlo=compiled.as_text(), params=variables['params'],
      opt_state_bytes=models.tree_bytes(state.opt_state),
      centering_bytes=models.tree_bytes(state.centering),
      memory=_memory_analysis(compiled),
      read_state=lambda: holder['state'])


def nnx_runner(arch: models.Arch, variant: Variant, batch: int) -> Runner:
  """Builds, compiles (timed) and binds an NNX fused step.

  ``nnx.jit(...).lower(...).compile(options)`` returns an NNX ``Compiled``
  that takes the model and optimizer themselves and updates them in place,
  like the jitted step, with the per-executable options applied.
  """
  images, labels = models.make_batch(arch, batch)
  model = models.nnx_model(arch, variant.centered)
  stacked = models.stacked_for(arch, model)
  tx = (variant.make_tx(stacked=stacked) if variant.m1 and stacked
        else variant.make_tx())
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  params = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
  opt_state_bytes = models.tree_bytes(nnx.state(optimizer))
  centering_bytes = models.tree_bytes(nnx.state(model, nnx.BatchStat))

  def loss_fn(model, images, labels):
    return cross_entropy(model(images), labels)

  jitted = cbp.nnx.train_step(loss_fn)
  start = time.perf_counter()
  options = dict(shipped_options() or {}, **(variant.compiler_options or {}))
  compiled = jitted.lower(model, optimizer, images, labels).compile(
      options or None)
  compile_s = time.perf_counter() - start

  def step() -> None:
    jax.block_until_ready(compiled(model, optimizer, images, labels))

  return Runner(
      variant=variant, api='nnx', step=step, compile_s=compile_s,
      hlo=compiled.as_text(), params=params, opt_state_bytes=opt_state_bytes,
      centering_bytes=centering_bytes, memory=_memory_analysis(compiled),
      read_state=lambda: nnx.state((model, optimizer)))


def make_runner(api: str, arch: models.Arch, variant: Variant,
                batch: int) -> Runner:
  if api == 'linen':
    return linen_runner(arch, variant, batch)
  if api == 'nnx':
    return nnx_runner(arch, variant, batch)
  raise ValueError(f'Unknown api {api!r}; use linen or nnx.')


def variants_for(names: Optional[list[str]] = None,
                 arch: Optional[models.Arch] = None) -> list[Variant]:
  """The variants named (all by default), in table order; AdamW too for
  the transformer."""
  variants = list(VARIANTS)
  if arch is not None and arch.kind == 'transformer':
    variants.insert(2, ADAMW)
  return [v for v in variants if names is None or v.name in names]
