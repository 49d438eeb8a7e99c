"""Hardening, round three (issue 33, items 7, 8, 9 and 15): checkpoints that
never delete what is not theirs, paths and keys that either round-trip or are
refused before anything is written, empty states, and a launcher that returns
only once every process it ended is gone.

Each test here failed before the fix it names (the issue's item number).
Every refused or failed save is checked to leave the directory exactly as it
was: no lock file, no partial folder, no folder it created.
"""

import hashlib
import os
import pathlib
import sys
import time

import chex
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from cbp_optax import checkpoint

ROOT = pathlib.Path(__file__).resolve().parents[1]


def small_state(k=1):
  return {'step': jnp.asarray(k, jnp.int32), 'w': jnp.arange(3.0) + k}


def snapshot(root):
  """Every entry under ``root`` (hidden ones too): its kind and content."""
  entries = {}
  for folder, dirs, files in os.walk(root):
    for name in dirs + files:
      path = pathlib.Path(folder) / name
      key = str(path.relative_to(root))
      if path.is_symlink():
        entries[key] = ('link', os.readlink(path))
      elif path.is_dir():
        entries[key] = ('dir',)
      else:
        entries[key] = ('file', hashlib.sha256(path.read_bytes()).hexdigest())
  return entries


def refused_leaving_all_as_it_was(root, save, error, match):
  before = snapshot(root)
  with pytest.raises(error, match=match):
    save()
  assert snapshot(root) == before


# --- item 7: force=True replaces only a checkpoint save wrote -------------------


def folder_with_results_and_a_checkpoint(path):
  path.mkdir()
  (path / 'results.csv').write_text('step,loss\n1,0.5\n')
  checkpoint.save(path / 'step_1', small_state())
  return r"a directory holding 'results.csv', 'step_1'"


def plain_file(path):
  path.write_text('not a checkpoint')
  return 'it is a file'


def checkpoint_with_notes(path):
  checkpoint.save(path, small_state())
  (path / 'notes.txt').write_text('keep me')
  return "a directory holding 'notes.txt'"


def orbax_checkpoint_of_another_writer(path):
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path, {'w': np.arange(3.0)})
  checkpointer.wait_until_finished()
  return 'a checkpoint that cbp_optax.checkpoint.save did not write'


def link_to_a_checkpoint(path):
  checkpoint.save(path.parent / 'target', small_state())
  path.symlink_to(path.parent / 'target')
  return 'a symbolic link'


def dangling_link(path):
  path.symlink_to(path.parent / 'nowhere')
  return 'a symbolic link'


@pytest.mark.parametrize('make', [
    folder_with_results_and_a_checkpoint, plain_file, checkpoint_with_notes,
    orbax_checkpoint_of_another_writer, link_to_a_checkpoint, dangling_link])
@pytest.mark.parametrize('force', [True, False])
def test_save_deletes_nothing_it_did_not_write(tmp_path, make, force):
  # Item 7: a folder with results.csv and a step_1 checkpoint, or a plain
  # file, became one checkpoint.
  path = tmp_path / 'run'
  what = make(path)
  refused_leaving_all_as_it_was(
      tmp_path, lambda: checkpoint.save(path, small_state(2), force=force),
      checkpoint.CheckpointError, f'Cannot save to {path}: .*{what}')


def test_force_replaces_its_own_checkpoint_and_an_empty_folder(tmp_path):
  checkpoint.save(tmp_path / 'c', small_state(1))
  checkpoint.save(tmp_path / 'c', small_state(2), force=True)
  chex.assert_trees_all_equal(
      checkpoint.restore(tmp_path / 'c', small_state(0)), small_state(2))
  (tmp_path / 'empty').mkdir()  # nothing in it to lose
  checkpoint.save(tmp_path / 'empty', small_state(3), force=True)
  chex.assert_trees_all_equal(
      checkpoint.restore(tmp_path / 'empty', small_state(0)), small_state(3))
  assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
      'c', 'empty']


def test_a_file_put_in_the_checkpoint_during_a_save_is_kept(tmp_path,
                                                            monkeypatch):
  # What is at the path is checked again before the swap: while the new
  # checkpoint was written, someone put a file into the old one.
  directory = tmp_path / 'c'
  checkpoint.save(directory, small_state(1))

  def sync(name):
    if name == 'save_written':
      (directory / 'late.txt').write_text('written during the save')

  monkeypatch.setattr(checkpoint, '_sync', sync)
  with pytest.raises(checkpoint.CheckpointError, match="holding 'late.txt'"):
    checkpoint.save(directory, small_state(2), force=True)
  assert (directory / 'late.txt').read_text() == 'written during the save'
  assert sorted(p.name for p in tmp_path.iterdir()) == ['.c.cbp-lock',
                                                        '.c.cbp-swap', 'c']
  (directory / 'late.txt').unlink()
  chex.assert_trees_all_equal(checkpoint.restore(directory, small_state(0)),
                              small_state(1))


def test_a_refused_save_leaves_no_lock_file(tmp_path):
  # Item 9's "leaves a lock file behind", for every refusal: the lock file
  # and the folders above the checkpoint are created only for a save that
  # goes ahead.
  checkpoint.save(tmp_path / 'a' / 'c', small_state())
  (tmp_path / 'a' / '.c.cbp-lock').unlink()
  refused_leaving_all_as_it_was(
      tmp_path, lambda: checkpoint.save(tmp_path / 'a' / 'c', small_state()),
      checkpoint.CheckpointError, 'it exists.*force=True')
  refused_leaving_all_as_it_was(
      tmp_path, lambda: checkpoint.save(tmp_path / 'b' / 'c' / 'x[1]',
                                        small_state()),
      checkpoint.CheckpointError, 'contains')


class FailingCheckpointer(ocp.StandardCheckpointer):
  """Starts writing (a partial folder), then fails like a full disk."""

  def save(self, directory, *args, **kwargs):
    tmp = pathlib.Path(f'{directory}.orbax-checkpoint-tmp')
    tmp.mkdir()
    (tmp / 'ocdbt.process_0').write_bytes(b'partial')
    raise OSError(28, 'No space left on device')


@pytest.mark.parametrize('existing', [False, True])
def test_a_failed_write_leaves_the_directory_as_it_was(tmp_path, monkeypatch,
                                                       existing):
  directory = tmp_path / 'runs' / 'lr_0.1' / 'step_1'
  if existing:
    checkpoint.save(directory, small_state(1))
  monkeypatch.setattr(checkpoint.ocp, 'StandardCheckpointer',
                      FailingCheckpointer)
  before = snapshot(tmp_path)
  with pytest.raises(OSError, match='No space left'):
    checkpoint.save(directory, small_state(2), force=True)
  after = snapshot(tmp_path)
  if existing:  # the lock file of the first save stays, nothing else changed
    assert after == before
  else:
    assert after == before == {}
  monkeypatch.undo()
  if existing:
    chex.assert_trees_all_equal(
        checkpoint.restore(directory, small_state(0)), small_state(1))
  checkpoint.save(directory, small_state(3), force=True)  # nothing in the way
  chex.assert_trees_all_equal(checkpoint.restore(directory, small_state(0)),
                              small_state(3))


# --- item 8: paths and keys orbax treats specially ------------------------------


@pytest.mark.parametrize('name', ['step[1]', 'lr[0.1]/step_1', 'a[xy]b',
                                  'a*b', 'a?b', 'a\\b', 'in[0]/deep/c'])
def test_path_orbax_reads_as_a_pattern_is_refused_before_writing(tmp_path,
                                                                 name):
  # Item 8: `step[1]` and `lr[0.1]/step_1` saved "successfully", then restore
  # said "no readable metadata" (orbax globs `<path>/ocdbt.process_*`, so the
  # data was never assembled); `a\b` too (tensorstore splits at '\'); `*`
  # and `?` match the folders of other saves being written beside it.
  refused_leaving_all_as_it_was(
      tmp_path, lambda: checkpoint.save(tmp_path / name, small_state()),
      checkpoint.CheckpointError, 'contains .* orbax reads as a pattern')


def test_a_checkpoint_under_a_bracket_path_restores(tmp_path):
  # Reading is not affected: a checkpoint moved under such a path restores.
  checkpoint.save(tmp_path / 'c', small_state(4))
  (tmp_path / 'lr[0.1]').mkdir()
  (tmp_path / 'c').rename(tmp_path / 'lr[0.1]' / 'step[1]')
  chex.assert_trees_all_equal(
      checkpoint.restore(tmp_path / 'lr[0.1]' / 'step[1]', small_state(0)),
      small_state(4))


def test_other_punctuation_in_paths_round_trips(tmp_path):
  # Probed: each of string.punctuation, space, tab, newline and non-ASCII
  # letters in a name; all but the five refused above round-trip.
  for k, name in enumerate(['a.b', 'a b', "a'b,c=d;e", 'x{1}%2#3', '~-+@!$&',
                            'é☃', 'line\nbreak']):
    path = tmp_path / f'{k}' / name
    checkpoint.save(path, small_state(k))
    chex.assert_trees_all_equal(checkpoint.restore(path, small_state(0)),
                                small_state(k))


def test_path_refusals_name_the_problem(tmp_path):
  (tmp_path / 'file').write_text('x')
  cases = [
      (tmp_path / 'file' / 'c', 'file is a file, not a directory'),
      (tmp_path / ('n' * 230), 'at most 225 bytes'),
      (tmp_path / 'sub' / '..', 'give the checkpoint folder its own name'),
      (pathlib.Path('/'), 'give the checkpoint folder its own name'),
      (str(tmp_path / 'a\0b'), 'NUL byte'),
  ]
  for path, match in cases:
    refused_leaving_all_as_it_was(
        tmp_path, lambda: checkpoint.save(path, small_state()),
        checkpoint.CheckpointError, match)


@pytest.mark.parametrize('state, first, second', [
    ({'a.b': jnp.ones(2), 'a': {'b': jnp.zeros(2)}}, r"\['a'\]\['b'\]",
     r"\['a.b'\]"),
    ({'a.b': jnp.ones(2), 'a': {'b': jnp.zeros(5)}}, r"\['a'\]\['b'\]",
     r"\['a.b'\]"),
    ({'a': [jnp.ones(2)], 'a.0': jnp.zeros(2)}, r"\['a'\]\['0'\]",
     r"\['a.0'\]"),
    ({'x/': jnp.ones(2), 'x': jnp.zeros(2)}, r"\['x'\]", r"\['x/'\]"),
    ({'p': {'q.r': {'s': jnp.ones(1)}, 'q': {'r.s': jnp.zeros(1)}}},
     r"\['p'\]\['q'\]\['r.s'\]", r"\['p'\]\['q.r'\]\['s'\]"),
])
def test_keys_orbax_would_store_under_one_name_are_refused(tmp_path, state,
                                                           first, second):
  # Item 8: 'a.b' and a/b merged at save (restore then failed its digest);
  # with other shapes, a raw tensorstore error and a partial folder.
  refused_leaving_all_as_it_was(
      tmp_path, lambda: checkpoint.save(tmp_path / 'c', state),
      checkpoint.CheckpointError,
      f'entries {first} and {second} would be stored under one name')


def test_keys_with_dots_slashes_and_others_round_trip_when_distinct(tmp_path):
  state = {'a.c': jnp.ones(2), 'a/b': jnp.full(2, 2.0),
           'a': {'b': jnp.full(2, 3.0), 'd': jnp.full(2, 4.0)},
           '': jnp.full(1, 5.0), 'a//b': jnp.full(1, 6.0),
           '../x': jnp.full(1, 7.0), 'é\\[0]*?': jnp.full(1, 8.0),
           'layers': {0: jnp.full(1, 9.0), 1: jnp.full(1, 10.0)}}
  checkpoint.save(tmp_path / 'c', state)
  chex.assert_trees_all_equal(
      checkpoint.restore(tmp_path / 'c', jax.tree.map(jnp.zeros_like, state)),
      state)


@pytest.mark.parametrize('state, error, match', [
    ({1: jnp.ones(1), '1': jnp.zeros(1)}, TypeError,
     'not a pytree JAX can flatten'),
    ({(1, 2): jnp.ones(1), 'z': jnp.zeros(1)}, TypeError,
     'not a pytree JAX can flatten'),
    ({'a': 'hello', 'b': jnp.ones(1)}, TypeError,
     r"entry \['a'\] is a str, not an array"),
    ({'a': {'b': np.array([1, 'x'], object)}}, TypeError,
     r"entry \['a'\]\['b'\] is a ndarray, not an array"),
    ({'a': 2**70}, TypeError, r"entry \['a'\] is a int, not an array"),
])
def test_states_orbax_cannot_store_are_refused_before_writing(tmp_path, state,
                                                              error, match):
  # A tuple key beside a string key saved, then restore failed ("Comparator
  # raised exception"); the others were raw errors without the entry.
  refused_leaving_all_as_it_was(
      tmp_path, lambda: checkpoint.save(tmp_path / 'c', state), error,
      f'Cannot save to {tmp_path / "c"}: .*{match}')


# --- item 9: a state with no arrays -----------------------------------------------


@pytest.mark.parametrize('state', [
    {}, [], {'a': {}, 'b': []}, {'a': jnp.zeros((0, 3))},
    nnx.State({}), {'opt': (), 'none': None}])
def test_a_state_without_arrays_round_trips(tmp_path, state):
  # Item 9: "Cannot save arrays with zero size: ... cbp_optax_sha256", and a
  # lock file left behind.
  checkpoint.save(tmp_path / 'c', state)
  restored = checkpoint.restore(tmp_path / 'c', state)
  assert type(restored) is type(state)
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  chex.assert_trees_all_equal(restored, state)
  with pytest.raises(checkpoint.CheckpointMismatchError,
                     match='missing from the checkpoint: w'):
    checkpoint.restore(tmp_path / 'c', small_state())
  checkpoint.save(tmp_path / 'c', state, force=True)  # its own: replaceable


# --- several processes: process 0's refusal is raised on every process -------------


REFUSED_ON_EVERY_PROCESS = '''
import sys
import time
from cbp_optax import launch
launch.initialize_from_env()
import jax
import jax.numpy as jnp
from cbp_optax import checkpoint
try:
  checkpoint.save(sys.argv[1], {'w': jnp.ones(3)}, force=True)
except checkpoint.CheckpointError as e:
  print('refused', jax.process_index(), str(e).split('it is a directory ')[1],
        flush=True)
  sys.exit(0)
sys.exit(5)
'''


@pytest.mark.slow
@pytest.mark.skipif(not __import__('cbp_optax.launch').launch.gloo_available(),
                    reason='this jaxlib has no gloo CPU collectives')
def test_a_refusal_on_process_0_is_raised_on_every_process(tmp_path):
  # Process 0 alone looks at the files; the others waited for it at the next
  # barrier, and the run hung until the launcher's timeout.
  from cbp_optax import launch
  (tmp_path / 'run').mkdir()
  (tmp_path / 'run' / 'results.csv').write_text('keep me')
  result = launch.launch(['-c', REFUSED_ON_EVERY_PROCESS, str(tmp_path / 'run')],
                         2, cpu_devices=1, timeout=60, cwd=str(ROOT),
                         stream=sys.stdout)
  assert result.returncodes == [0, 0]
  for process in (0, 1):
    assert (f"refused {process} holding 'results.csv'"
            in result.output(process)), result.output(process)
  assert (tmp_path / 'run' / 'results.csv').read_text() == 'keep me'


# --- item 15: launch returns only once every process it ended is gone ---------------


# A worker that starts a child ignoring SIGTERM and records its process group
# and the child. Then both workers exit 0 ('exit0'), process 0 exits 1 once
# process 1 has recorded ('exit1'), or the workers sleep ignoring SIGTERM
# themselves until they are stopped.
GROUP_WORKER = '''
import os, pathlib, signal, subprocess, sys, time
out, how = pathlib.Path(sys.argv[1]), sys.argv[2]
index = os.environ['CBP_OPTAX_PROCESS_ID']
child = subprocess.Popen(
    [sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, '
     'signal.SIG_IGN); print("ready", flush=True); time.sleep(120)'],
    stdout=subprocess.PIPE)
child.stdout.readline()
(out / f'{index}.tmp').write_text(f'{os.getpgid(0)} {child.pid}')
(out / f'{index}.tmp').rename(out / f'{index}.pids')
if how == 'exit0':
  sys.exit(0)
if how == 'exit1' and index == '0':
  while not (out / '1.pids').exists():
    time.sleep(0.01)
  sys.exit(1)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(120)
'''


def group_gone(pgid):
  try:
    os.killpg(pgid, 0)
  except ProcessLookupError:
    return True
  return False


@pytest.mark.parametrize('how, grace', [
    ('exit0', 0.2), ('exit1', 0.2), ('timeout', 0.2), ('interrupt', 0.2),
    ('exit0', 0.0),
    # Each waits for init to reap the killed children (about 2 s here).
    pytest.param('exit1', 0.0, marks=pytest.mark.slow),
    pytest.param('timeout', 0.0, marks=pytest.mark.slow),
    pytest.param('interrupt', 0.0, marks=pytest.mark.slow)])
def test_launch_returns_once_every_group_it_ended_is_gone(tmp_path, how, grace):
  # Item 15: a worker's child was still present just after launch returned
  # (gone 0.5 s later); with grace=0, still running.
  import _thread
  import threading
  from cbp_optax import launch

  def interrupt_once_both_recorded():
    deadline = time.monotonic() + 60
    while (len(list(tmp_path.glob('*.pids'))) < 2
           and time.monotonic() < deadline):
      time.sleep(0.02)
    _thread.interrupt_main()

  call = lambda: launch.launch(
      ['-c', GROUP_WORKER, str(tmp_path), how], 2,
      timeout=2.5 if how == 'timeout' else 60, grace=grace)
  if how == 'exit0':
    call()
  else:
    if how == 'interrupt':
      threading.Thread(target=interrupt_once_both_recorded, daemon=True).start()
    error = {'exit1': launch.WorkerFailed, 'timeout': launch.LaunchTimeout,
             'interrupt': KeyboardInterrupt}[how]
    with pytest.raises(error):
      call()
  recorded = [tuple(map(int, p.read_text().split()))
              for p in sorted(tmp_path.glob('*.pids'))]
  assert len(recorded) == 2, recorded
  left = [(pgid, child) for pgid, child in recorded if not group_gone(pgid)]
  assert not left, left
  assert not any(pathlib.Path(f'/proc/{child}').exists()
                 for _, child in recorded)


def test_launch_refuses_an_interpreter_it_cannot_run(tmp_path):
  # Probed beside item 15: a `python` that is a file without the execute bit
  # passed the checks, then Popen raised a raw PermissionError.
  from cbp_optax import launch
  python = tmp_path / 'python'
  python.write_text('#!/bin/sh\n')
  for bad in (str(python), str(tmp_path / 'missing'), 'no-such-python-3'):
    with pytest.raises(ValueError, match='no executable interpreter at'):
      launch.launch(['-c', 'pass'], 1, python=bad)
