"""CBP across processes with ``jax.distributed`` on this machine (issue 16).

Each test starts real worker processes (``tests/multiprocess_worker.py``)
through :func:`tests.launch.launch`: every process gets 2 simulated CPU
devices, the coordinator listens on 127.0.0.1 only (each worker checks its
listening sockets in /proc), and every run is
bounded by the launcher's timeout. A run with 2 processes x
2 devices is compared with 1 process x 4 devices (the same global mesh
``(data=4)``): final parameters, optimizer state (CBP's moments and M1's
block energies) and centering means after 10 steps of full CBP, and the
losses. Checkpoints written by 2 processes are restored by 1 and by 2.

The default tier runs NNX, data parallel, float64; ``-m slow`` adds Linen,
FSDP, float32, the plain one-device run, restoring a 1-process checkpoint on
2 processes, and examples/multiprocess_mnist.py on 2 processes vs 1.
"""

from __future__ import annotations

import io
import pathlib
import re
import subprocess
import sys
from typing import Optional

import numpy as np
import pytest

from tests import launch

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT = 300  # seconds per launched run; only reached if something hangs
STEPS = 10
SAVE_AT = 5

needs_gloo = pytest.mark.skipif(
    not launch.gloo_available(),
    reason='this jaxlib has no gloo CPU collectives '
    '(jax_cpu_collectives_implementation=gloo), needed to run JAX as '
    'several processes on CPU')


def run_workers(processes: int, devices: int, out: pathlib.Path,
                *worker_args: str, timeout: float = TIMEOUT
                ) -> launch.LaunchResult:
  """``processes`` workers with ``devices`` CPU devices each; returns once done."""
  # launch replaces any device count in XLA_FLAGS with cpu_devices and keeps
  # the other flags (the test session's compile settings).
  return launch.launch(
      ['-m', 'tests.multiprocess_worker', '--out', str(out), *worker_args],
      processes, cpu_devices=devices, timeout=timeout, cwd=str(ROOT),
      stream=sys.stdout)


def load(path: pathlib.Path) -> dict[str, np.ndarray]:
  with np.load(path) as data:
    return dict(data)


def max_differences(actual: dict[str, np.ndarray],
                    expected: dict[str, np.ndarray]) -> dict[str, float]:
  """Worst ``max |a - e|`` per quantity (params, opt_state, means, losses).

  The keys (paths of every array) must agree; integer arrays (step
  counters) must be equal. ``losses`` of a resumed run are compared with
  the last losses of the uninterrupted one.
  """
  assert sorted(actual) == sorted(expected)
  worst: dict[str, float] = {}
  for key, e in expected.items():
    a = actual[key]
    if key == 'losses':
      e = e[len(e) - len(a):]
    assert a.shape == e.shape, key
    if not np.issubdtype(e.dtype, np.floating):
      np.testing.assert_array_equal(a, e, err_msg=key)
      continue
    part = key.split('[')[0]
    difference = float(np.max(np.abs(a - e))) if e.size else 0.0
    worst[part] = max(worst.get(part, 0.0), difference)
  return worst


def check_equal(name: str, actual, expected, tolerance: float) -> None:
  worst = max_differences(actual, expected)
  print(f'\n{name}: max |difference| ' + ', '.join(
      f'{k}={v:.1e}' for k, v in sorted(worst.items())))
  assert set(worst) == {'params', 'opt_state', 'means', 'losses'}, worst
  for part, difference in worst.items():
    assert difference <= tolerance, (part, worst)


def check_real_work(result: dict[str, np.ndarray]) -> None:
  """The run moved the means and the loss, so equality is not vacuous."""
  means = [v for k, v in result.items() if k.startswith('means')]
  assert max(float(np.max(np.abs(m))) for m in means) > 0.1
  losses = result['losses']
  assert len(losses) == STEPS and losses[-1] != losses[0]


class Runs:
  """The runs shared by several tests (each launched once per session)."""

  def __init__(self, directory: pathlib.Path):
    self.directory = directory
    self._cache: dict[tuple, dict[str, np.ndarray]] = {}

  def get(self, processes: int, devices: int, framework: str = 'nnx',
          layout: str = 'data', dtype: str = 'float64',
          restore: Optional[tuple] = None, mesh: str = 'data'
          ) -> dict[str, np.ndarray]:
    """Final state of a run; uninterrupted runs also save at ``SAVE_AT``.

    ``restore`` names the uninterrupted run (its key) whose checkpoint this
    run resumes from.
    """
    if restore is not None:
      # The full key of the run whose checkpoint is resumed (the model,
      # layout and dtype of this one unless given).
      restore = tuple(restore) + (framework, layout, dtype)[len(restore) - 2:]
    key = (processes, devices, framework, layout, dtype, restore, mesh)
    if key not in self._cache:
      name = '_'.join(map(str, key[:5])) + (
          '_from_' + '_'.join(map(str, restore[:2])) if restore else ''
      ) + f'_{mesh}'
      out = self.directory / f'{name}.npz'
      args = ['--framework', framework, '--layout', layout, '--dtype', dtype,
              '--steps', str(STEPS), '--mesh', mesh]
      if restore is None:
        args += ['--save-at', str(SAVE_AT),
                 '--save-dir', str(self.checkpoint(key))]
      else:
        self.get(*restore)  # writes the checkpoint
        args += ['--restore', str(self.checkpoint(restore)),
                 '--start', str(SAVE_AT)]
      run_workers(processes, devices, out, *args)
      self._cache[key] = load(out)
    return self._cache[key]

  def checkpoint(self, key: tuple) -> pathlib.Path:
    return self.directory / ('ckpt_' + '_'.join(map(str, key[:5]))
                             + '_' + (key[6] if len(key) > 6 else 'data'))


@pytest.fixture(scope='module')
def runs(tmp_path_factory) -> Runs:
  return Runs(tmp_path_factory.mktemp('multiprocess'))


# Same numbers on 2 processes as on 1 -------------------------------------------


@needs_gloo
def test_two_processes_equal_one_process_nnx(runs):
  two = runs.get(2, 2)
  one = runs.get(1, 4)
  check_real_work(one)
  # Exact up to float rounding: per-process means or block energies (no
  # cross-process reduction) would differ at 1e-3 and above.
  check_equal('nnx data float64, 2x2 vs 1x4', two, one, 1e-12)


@needs_gloo
@pytest.mark.slow
@pytest.mark.parametrize('framework,layout', [
    ('linen', 'data'), ('linen', 'fsdp'), ('nnx', 'fsdp')])
def test_two_processes_equal_one_process_more_layouts(runs, framework, layout):
  two = runs.get(2, 2, framework, layout)
  one = runs.get(1, 4, framework, layout)
  check_real_work(one)
  check_equal(f'{framework} {layout} float64, 2x2 vs 1x4', two, one, 1e-12)


@needs_gloo
@pytest.mark.slow
def test_data_axis_within_each_process(runs):
  # Mesh (model=2, data=2) with 'model' across the processes: each process
  # holds the whole data axis, so process_rows gives it the whole
  # batch and shard_process_batch keeps the local size as the global one.
  two = runs.get(2, 2, mesh='model_data')
  one = runs.get(1, 4, mesh='model_data')
  check_real_work(one)
  check_equal('nnx data float64, mesh (model=2, data=2), 2x2 vs 1x4', two,
              one, 1e-12)


@needs_gloo
@pytest.mark.slow
def test_two_processes_equal_one_process_float32(runs):
  two = runs.get(2, 2, dtype='float32')
  one = runs.get(1, 4, dtype='float32')
  worst = max_differences(two, one)
  print(f'\nnnx data float32, 2x2 vs 1x4: max |difference| {worst}')
  for part, difference in worst.items():
    scale = max(float(np.max(np.abs(v))) for k, v in one.items()
                if k.startswith(part) and v.size and
                np.issubdtype(v.dtype, np.floating))
    assert difference <= 1e-6 * scale, (part, worst)


@needs_gloo
@pytest.mark.slow
@pytest.mark.parametrize('framework', ['nnx', 'linen'])
def test_two_processes_equal_one_unsharded_device(runs, framework):
  # Against the plain one-device run, the sums over the batch are ordered
  # differently: equal to float64 rounding.
  two = runs.get(2, 2, framework)
  one = runs.get(1, 1, framework)
  check_equal(f'{framework} data float64, 2x2 vs 1 device', two, one, 1e-12)


@needs_gloo
@pytest.mark.slow
def test_example_prints_the_same_final_loss_on_two_processes_as_on_one():
  finals = {}
  for processes in (2, 1):
    result = subprocess.run(
        [sys.executable, str(ROOT / 'examples' / 'multiprocess_mnist.py'),
         '--processes', str(processes), '--synthetic', '--steps', '20',
         '--batch-size', '64', '--timeout', str(TIMEOUT)],
        cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT + 60)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    finals[processes] = re.findall(r'final loss (\S+)', result.stdout)
    assert len(finals[processes]) == 1, result.stdout[-3000:]
  print(f'\nexample final loss: {finals}')
  assert finals[2] == finals[1]


# Checkpoints across process counts ---------------------------------------------


@needs_gloo
@pytest.mark.slow
def test_checkpoint_from_two_processes_resumes_on_two(runs):
  uninterrupted = runs.get(2, 2)
  resumed = runs.get(2, 2, restore=(2, 2))
  check_equal('2 processes -> checkpoint -> 2 processes', resumed,
              uninterrupted, 1e-12)


@needs_gloo
def test_checkpoint_from_two_processes_resumes_on_one(runs):
  uninterrupted = runs.get(2, 2)
  resumed = runs.get(1, 4, restore=(2, 2))
  check_equal('2 processes -> checkpoint -> 1 process', resumed,
              uninterrupted, 1e-12)


@needs_gloo
@pytest.mark.slow
def test_checkpoint_from_one_process_resumes_on_two(runs):
  uninterrupted = runs.get(1, 4)
  resumed = runs.get(2, 2, restore=(1, 4))
  check_equal('1 process -> checkpoint -> 2 processes', resumed,
              uninterrupted, 1e-12)


@needs_gloo
@pytest.mark.slow
@pytest.mark.parametrize('framework,layout', [('linen', 'fsdp'),
                                              ('nnx', 'fsdp')])
def test_sharded_checkpoint_resumes_on_one_process(runs, framework, layout):
  uninterrupted = runs.get(2, 2, framework, layout)
  resumed = runs.get(1, 4, framework, layout,
                     restore=(2, 2, framework, layout))
  check_equal(f'{framework} {layout}: 2 processes -> 1', resumed,
              uninterrupted, 1e-12)


# The launcher -------------------------------------------------------------------


@needs_gloo
def test_worker_dying_mid_run_fails_the_launch(tmp_path):
  # Process 1 exits abruptly after step 3; process 0 would wait for it in
  # the next step's collectives. The launcher stops it and says who failed.
  with pytest.raises(launch.WorkerFailed) as info:
    run_workers(2, 2, tmp_path / 'never.npz', '--die-at', '3',
                '--die-process', '1')
  message = str(info.value)
  print(f'\n{message}')
  assert 'process 1 of 2 exited with status 7' in message
  assert 'dying on purpose after step 3' in message
  assert all(code is not None for code in info.value.result.returncodes)
  assert not (tmp_path / 'never.npz').exists()


@needs_gloo
@pytest.mark.slow
def test_survivors_of_a_dead_worker_abort_on_their_own(tmp_path):
  # Without the launcher stopping them, JAX's coordination service notices
  # the missing heartbeats (initialize_from_env: 30 s) and aborts the
  # survivor: a bounded failure, not a hang, but slower than the launcher.
  with pytest.raises(launch.WorkerFailed) as info:
    launch.launch(
        ['-m', 'tests.multiprocess_worker', '--die-at', '3',
         '--out', str(tmp_path / 'never.npz')],
        2, cpu_devices=2, timeout=TIMEOUT, cwd=str(ROOT),
        stream=sys.stdout, stop_on_failure=False)
  message = str(info.value)
  print(f'\n{message}')
  assert 'process 1 of 2 exited with status 7' in message
  survivor = info.value.result
  assert survivor.returncodes[0] not in (0, None), survivor.returncodes
  assert 'JAX distributed service detected fatal errors' in survivor.output(0)


def test_launch_timeout_stops_every_worker():
  with pytest.raises(launch.LaunchTimeout, match='did not finish within 3 s'
                     ) as info:
    launch.launch(['-c', 'import time; print("waiting", flush=True); '
                   'time.sleep(600)'], 2, timeout=3)
  # Both workers were stopped (by a signal), none is left running.
  codes = info.value.result.returncodes
  assert all(code is not None and code < 0 for code in codes), codes
  assert 'waiting' in str(info.value)


def test_launch_forwards_prefixed_output_and_environment():
  stream = io.StringIO()
  result = launch.launch(
      ['-c', 'import os; print(os.environ["CBP_OPTAX_PROCESS_ID"], '
       'os.environ["CBP_OPTAX_NUM_PROCESSES"], '
       'os.environ["CBP_OPTAX_COORDINATOR"].rsplit(":", 1)[0])'],
      2, timeout=60, stream=stream)
  assert result.returncodes == [0, 0]
  lines = set(stream.getvalue().splitlines())
  assert {'[proc 0] 0 2 127.0.0.1', '[proc 1] 1 2 127.0.0.1'} <= lines
  assert result.output(1) == '1 2 127.0.0.1\n'


def test_launch_command_line(capsys):
  assert launch.main(['--processes', '2', '--timeout', '60', '--', '-c',
                      'print("hello")']) == 0
  assert '[proc 1] hello' in capsys.readouterr().out
  assert launch.main(['--processes', '2', '--timeout', '60', '--', '-c',
                      'import sys; sys.exit(3)']) == 1
  assert 'exited with status 3' in capsys.readouterr().err


def test_launch_refuses_no_processes():
  with pytest.raises(ValueError,
                     match=r'num_processes must be an integer in \[1, 1024\]'):
    launch.launch(['-c', 'pass'], 0)


def test_initialize_from_env_outside_a_launch_does_nothing(monkeypatch):
  monkeypatch.delenv(launch.ENV_COORDINATOR, raising=False)
  assert launch.initialize_from_env() is False


def test_initialize_from_env_refuses_a_remote_coordinator(monkeypatch):
  monkeypatch.setenv(launch.ENV_COORDINATOR, '10.0.0.1:1234')
  with pytest.raises(RuntimeError, match='binds to 127.0.0.1 only'):
    launch.initialize_from_env()
