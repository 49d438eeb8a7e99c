"""The transformer study (``cbp-optax reproduce transformer``): the --quick run
end to end, the by-file split, exact centering of the study's own model, one
M1 block per layer slice, and no parameter-sized copies in its fused step."""

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import cbp_optax as cbp
from cbp_optax import _step
from cbp_optax_experiments.reproduce import cli
from cbp_optax_experiments.reproduce import transformer as tf
from cbp_optax_experiments.reproduce.context import StudyContext

SMALL = tf.Config(depth=3, width=32, heads=2, context=16, batch=4,
                  dropout=0.1, steps=4, eval_every=2, eval_windows=8)


def tokens(config, seed=0, batch=None):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.integers(0, tf.VOCAB,
                                  (batch or config.batch, config.context + 1)),
                     jnp.int32)


@pytest.mark.slow
def test_quick_study_end_to_end(tmp_path):
  assert cli.STUDIES['transformer'] == 'transformer'
  assert cli.parse(['transformer', '--data', 'x.txt']).data.name == 'x.txt'
  out = tmp_path / 'transformer'
  result = tf.run(StudyContext(out=out, quick=True, progress=False))
  results = json.loads((out / 'results.json').read_text())
  per_arm = results['per_arm']
  assert list(per_arm) == [a.name for a in tf.ARMS]
  assert results['corpus']['python'] and results['corpus']['train_bytes'] > 0
  for name, runs in results['seed_runs'].items():
    assert len(runs) == 2, name
    for run in runs:
      # Every arm learns: validation loss falls from ~8 bits (uniform).
      assert run['val_bpb'][0] > 7.5
      assert run['val_bpb'][-1] < run['val_bpb'][0] - 0.5, (name, run)
      assert run['skipped'] == 0
    assert per_arm[name]['compile_s'] > 0
  # M1's blocks: one per layer slice of each stacked layer (8 per layer).
  for name in ('CBP M1+M3', 'CBP (full)'):
    blocks = result.summary['m1_disparity'][name]['final_blocks']
    assert sum(n.startswith('blocks/') for n in blocks) == 8 * tf.QUICK.depth
  table = (out / 'results.md').read_text()
  assert all(f'| {a.name} |' in table for a in tf.ARMS)
  for png in ('transformer_curves.png', 'transformer_m1_disparity.png'):
    assert (out / png).read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_by_file_split_is_deterministic_and_disjoint():
  files = tf.corpus_files(tf.stdlib_root(), '.py')
  assert len(files) > 100 and files == sorted(files)
  assert not any(part in tf.EXCLUDED_DIRS for f in files
                 for part in f.split('/')[:-1])
  train, validation = tf.split_files(files)
  assert (train, validation) == tf.split_files(files)
  again = tf.split_files(list(reversed(files)))  # order does not matter
  assert (set(train), set(validation)) == tuple(map(set, again))
  assert not set(train) & set(validation)
  assert sorted(train + validation) == files
  assert 0.05 < len(validation) / len(files) < 0.2
  # The documented rule, recomputed independently.
  import hashlib  # pylint: disable=g-import-not-at-top
  for f in files[:50]:
    expected = int(hashlib.sha256(f.encode()).hexdigest(), 16) % 10 == 0
    assert tf.is_validation(f) == expected


def test_data_option_reads_a_folder_by_file_and_a_single_file(tmp_path):
  folder = tmp_path / 'corpus'
  folder.mkdir()
  for i in range(100):
    (folder / f'doc{i}.txt').write_text(f'document {i} ' * 50)
  corpus = tf.load_corpus(folder)
  assert corpus.info['train_files'] + corpus.info['validation_files'] == 100
  assert corpus.info['validation_files'] > 0
  single = tmp_path / 'one.txt'
  single.write_bytes(bytes(range(256)) * 10)
  corpus = tf.load_corpus(single)
  assert (corpus.train.size, corpus.validation.size) == (2304, 256)


@pytest.mark.slow  # The default tier: test_centering_models' scanned transformer.
def test_centered_transformer_outputs_unchanged_by_transport():
  model = tf.build_model(SMALL, 0, centered=False)
  x_eval = tokens(SMALL, 1)[:, :-1]
  model.eval()
  before = model(x_eval)
  model.train()
  report = cbp.nnx.center(model)
  assert {'blocks/attn/query', 'blocks/attn/key', 'blocks/attn/value',
          'blocks/attn/out', 'blocks/up', 'blocks/down',
          'head'} <= set(report.centered)
  model.eval()
  np.testing.assert_array_equal(model(x_eval), before)
  model.train()
  model(tokens(SMALL, 2)[:, :-1])  # records this batch's means
  cbp.nnx.transport(model, 0.0)   # mu jumps to them: the largest move
  means = [np.asarray(m.mean[...]) for m in cbp.nnx.centered_layers(model)]
  assert all(np.abs(m).max() > 1e-2 for m in means)
  model.eval()
  after = model(x_eval)
  change = float(jnp.max(jnp.abs(after - before)) / jnp.max(jnp.abs(before)))
  assert after.dtype == jnp.float32
  assert change <= 1e-6, change


# tests/test_centering_models.py checks the scanned transformer's stack
# blocks in the default tier.
@pytest.mark.slow
@pytest.mark.parametrize('centered', [False, True], ids=['plain', 'centered'])
def test_m1_sees_one_block_per_layer_slice(centered):
  model = tf.build_model(SMALL, 0, centered)
  stacked = tf.stacked_for(model, centered)
  params = nnx.state(model, nnx.Param)
  names = cbp.block_names(params, stacked=stacked)
  layers = ('attn/query', 'attn/key', 'attn/value', 'attn/out', 'up', 'down',
            'norm1', 'norm2')
  for layer in layers:
    assert sum(n.startswith(f'blocks/{layer}') for n in names) == SMALL.depth
  assert len(names) == len(layers) * SMALL.depth + 4  # embed pos norm head
  if centered:  # found from the centered layers = named by hand
    named = cbp.nnx.stacked_blocks(model, 'blocks')
    assert names == cbp.block_names(params, stacked=named)
  # And the optimizer state agrees after a step.
  trainer = tf.Trainer(tf.ARMS[3 if centered else 2], SMALL)
  optimizer = cbp.nnx.Optimizer(model, trainer.tx)
  tf.set_peak(optimizer, 1e-3)
  out = trainer.step(model, optimizer, tokens(SMALL), nnx.Rngs(dropout=0))
  assert math.isfinite(float(out.loss)) and not bool(out.skipped)
  found = cbp.equalize_stats(optimizer.opt_state, params, stacked=stacked)
  assert list(found) == list(names)


def test_weight_decay_mask_is_kernels_only():
  model = tf.build_model(SMALL, 0, centered=True)
  mask = tf.decay_mask(nnx.state(model, nnx.Param))
  decayed = {jax.tree_util.keystr(p) for p, v in
             jax.tree_util.tree_leaves_with_path(mask) if v}
  assert len(decayed) == 7  # q, k, v, out, up, down, head
  assert all('kernel' in p for p in decayed)


_COPY = re.compile(r'= \w+\[([\d,]*)\]\{[^}]*\} copy\((%[\w.\-]+)\)')


def kernel_sized_copies(hlo_text, params):
  """``copy`` instructions of a stacked kernel's shape, except copies of a
  broadcast: those materialize the zeros the backward scan accumulates the
  kernel gradients into (the plain AdamW step has them too); they copy no
  state."""
  kernels = jax.tree.leaves(jax.tree.map(
      lambda x, is_kernel: x if is_kernel else None, params,
      tf.decay_mask(params)))
  shapes = {','.join(map(str, x.shape)) for x in kernels}
  found = []
  for line in hlo_text.splitlines():
    match = _COPY.search(line)
    if match and match.group(1) in shapes and 'broadcast' not in match.group(2):
      found.append(line.strip()[:120])
  return found


@pytest.mark.slow
def test_full_cbp_step_on_scanned_transformer_has_no_parameter_copies():
  # Sizes all distinct, so a shape names one kind of buffer.
  config = tf.Config(depth=3, width=24, heads=2, context=20, batch=5)
  model = tf.build_model(config, 0, centered=True)
  trainer = tf.Trainer(tf.ARMS[3], config)
  optimizer = cbp.nnx.Optimizer(model, trainer.tx)
  args = (tokens(config), nnx.Rngs(dropout=0))
  lowered = trainer.step.lower(model, optimizer, *args)
  params = nnx.state(model, nnx.Param)
  if jax.default_backend() == 'cpu':
    fused = lowered.compile(_step.compiler_options())
    assert kernel_sized_copies(fused.as_text(), params) == []
    # The check can fail: without region analysis XLA copies M3's lagged
    # second moment.
    plain = lowered.compile(
        {'xla_cpu_copy_insertion_use_region_analysis': False})
    assert kernel_sized_copies(plain.as_text(), params)


@pytest.mark.slow
def test_ablation_quick_pairs_seeds_and_reports_each_arm(tmp_path):
  from cbp_optax_experiments.reproduce import transformer_ablation as ab  # pylint: disable=g-import-not-at-top
  assert cli.STUDIES['transformer-ablation'] == 'transformer_ablation'
  out = tmp_path / 'ablation'
  name = 'former cbp_transformer'
  result = ab.run(StudyContext(out=out, quick=True, progress=False),
                  arms=[name])
  per_arm = result.summary['per_arm']
  assert list(per_arm) == ['AdamW', name]  # AdamW always runs
  assert per_arm['AdamW']['paired_t_pvalue'] is None
  assert 0.0 <= per_arm[name]['paired_t_pvalue'] <= 1.0
  assert len(per_arm[name]['final_bpb']) == 2
  # Same seed, same batches and initialization: the step-0 evaluation agrees
  # across the uncentered and centered models (centering is exact).
  runs = json.loads((out / 'results.json').read_text())['seed_runs']
  first = {arm: [r['val_bpb'][0] for r in rs] for arm, rs in runs.items()}
  np.testing.assert_allclose(first['AdamW'], first[name], rtol=1e-5)
  assert per_arm[name]['options']['block_fn'] == 'no_blocks'
  assert per_arm['AdamW']['step_ratio'] > 0
  assert 0.2 < per_arm[name]['step_ratio'] < 5.0
  table = (out / 'results.md').read_text()
  assert all(f'| {arm} |' in table for arm in per_arm)


def test_ablation_paper_arms_build_and_step():
  from cbp_optax_experiments.reproduce import transformer_ablation as ab  # pylint: disable=g-import-not-at-top
  params = {'Dense_0': {'kernel': jnp.ones((3, 2)), 'bias': jnp.zeros(2)}}
  for method in ab.paper_arms():
    tx = method.make_tx(1e-3)
    updates, _ = tx.update(params, tx.init(params), params)
    assert all(np.all(np.isfinite(u)) for u in jax.tree.leaves(updates))
