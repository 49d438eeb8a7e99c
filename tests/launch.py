"""Run a JAX program as several processes on this machine (``jax.distributed``).

A multi-host JAX program runs one process per host; every process calls
``jax.distributed.initialize`` and then sees the devices of all of them. This
module runs such a program as N processes on *one* machine, all on the
loopback address, which exercises every multi-host code path (global arrays
assembled from per-process data, cross-process collectives, multi-process
checkpoints) without a cluster. On CPU the collectives are gloo's.

A test helper, not part of the library: the multiprocess tests use it.

* :func:`launch` (or ``python -m tests.launch``) starts the workers with
  a free port on 127.0.0.1, prefixes their output with ``[proc i]``, enforces
  a timeout and stops every worker as soon as one fails.
* :func:`initialize_from_env`, called first thing in each worker, reads what
  the launcher passed and calls ``jax.distributed.initialize`` with it,
  bound to 127.0.0.1 only. Outside the launcher it does nothing, so the same
  script also runs as one ordinary process.

Example::

  # worker.py
  from tests import launch
  launch.initialize_from_env()   # before any other JAX call
  import jax
  print(jax.process_index(), jax.process_count(), jax.device_count())

  # on the command line: 2 processes with 2 simulated CPU devices each
  python -m tests.launch --processes 2 --cpu-devices 2 -- worker.py

On a real cluster use the cluster's launcher (SLURM, Kubernetes, a TPU pod's
own) and plain ``jax.distributed.initialize()``; see ``docs/multihost.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import numbers
from typing import Any, IO, Mapping, Optional, Sequence

from cbp_optax import _checks
from tests._workers import Worker
from tests._workers import describe_exit
from tests._workers import finish

__all__ = [
    'ENV_COORDINATOR',
    'ENV_NUM_PROCESSES',
    'ENV_PROCESS_ID',
    'LaunchError',
    'LaunchResult',
    'LaunchTimeout',
    'WorkerFailed',
    'free_port',
    'gloo_available',
    'initialize_from_env',
    'launch',
]

ENV_COORDINATOR = 'CBP_OPTAX_COORDINATOR'
ENV_NUM_PROCESSES = 'CBP_OPTAX_NUM_PROCESSES'
ENV_PROCESS_ID = 'CBP_OPTAX_PROCESS_ID'
ENV_INIT_TIMEOUT = 'CBP_OPTAX_INIT_TIMEOUT'

LOOPBACK = '127.0.0.1'


class LaunchError(RuntimeError):
  """A launched run did not succeed; the message says which process and why."""

  def __init__(self, message: str, result: 'LaunchResult'):
    super().__init__(message)
    self.result = result


class WorkerFailed(LaunchError):
  """A worker exited with a non-zero status (the others were stopped)."""


class LaunchTimeout(LaunchError):
  """The workers did not all finish within the timeout (all were stopped)."""


@dataclasses.dataclass
class LaunchResult:
  """What the workers did.

  Attributes:
    returncodes: exit status of each worker (negative: killed by that
      signal; ``None``: still running when it was stopped, never the case
      after :func:`launch` returns).
    outputs: each worker's output (stdout and stderr interleaved), as lines
      without the ``[proc i]`` prefix.
    seconds: wall time from the first start to the last exit.
  """

  returncodes: list[Optional[int]]
  outputs: list[list[str]]
  seconds: float = 0.0

  def output(self, process: int) -> str:
    """The output of one worker as one string."""
    return ''.join(self.outputs[process])


def free_port(host: str = LOOPBACK) -> int:
  """A TCP port that is free on ``host`` now (the OS picks it)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def gloo_available() -> bool:
  """Whether JAX's CPU backend offers gloo, the collectives multi-process needs.

  JAX has no public query for it; jaxlib's Linux and macOS wheels are built
  with gloo, so this answers by platform.
  """
  return sys.platform.startswith(('linux', 'darwin'))


_MAX_PROCESSES = 1024
_MAX_CPU_DEVICES = 4096


def _check_program(args: Sequence[str], cwd: Optional[str]) -> list[str]:
  """``args`` as a list of strings naming a script, ``-m module`` or
  ``-c code`` that exists, or a clear error naming what is wrong."""
  if isinstance(args, (str, bytes)) or not all(
      isinstance(a, str) for a in args):
    raise TypeError(
        "args must be a list of strings, ['script.py', ...] or ['-m', "
        f"'package.module', ...], got {args!r}.")
  args = list(args)
  if cwd is not None and not os.path.isdir(cwd):
    raise ValueError(f'cwd: {cwd!r} is not a directory.')
  if not args:
    raise ValueError('args is empty: give the script to run, or -m module.')
  first = args[0]
  if first in ('-m', '-c'):
    if len(args) < 2:
      raise ValueError(f'args: {first} needs its argument, got {args!r}.')
    return args
  if first.startswith('-'):
    return args  # other interpreter options: passed on as they are
  path = os.path.join(cwd or os.getcwd(), first)
  if os.path.isdir(path):
    if not os.path.isfile(os.path.join(path, '__main__.py')):
      raise ValueError(
          f'args: {first!r} is a directory without __main__.py, not a '
          'script; give the script (script.py) or -m package.module.')
  elif not os.path.isfile(path):
    raise ValueError(
        f'args: no script {first!r}'
        + (f' in {cwd!r}' if cwd else f' (relative to {os.getcwd()!r})')
        + '; give an existing script, or -m package.module.')
  return args


def launch(
    args: Sequence[str],
    num_processes: int,
    *,
    cpu_devices: Optional[int] = None,
    timeout: float = 600.0,
    env: Optional[Mapping[str, str]] = None,
    cwd: Optional[str] = None,
    stream: Optional[IO[str]] = None,
    python: str = sys.executable,
    init_timeout: int = 60,
    keep_lines: int = 10_000,
    grace: float = 2.0,
    stop_on_failure: bool = True,
) -> LaunchResult:
  """Runs ``python *args`` as ``num_processes`` cooperating JAX processes.

  Every worker gets the coordinator address (127.0.0.1 and a free port), the
  number of processes and its own index in environment variables
  (:data:`ENV_COORDINATOR`, :data:`ENV_NUM_PROCESSES`,
  :data:`ENV_PROCESS_ID`), which :func:`initialize_from_env` reads. Output of
  worker ``i`` (stdout and stderr) is forwarded to ``stream`` line by line as
  ``[proc i] ...``.

  When a worker exits with a non-zero status, the others are stopped at once
  (the survivors of a multi-process run would otherwise wait in a collective
  for a peer that is gone), and :class:`WorkerFailed` names the first worker
  that failed, its exit status and the end of its output. When ``timeout``
  passes first, every worker is stopped and :class:`LaunchTimeout` is raised.

  Args:
    args: arguments after the interpreter: ``['script.py', ...]`` or
      ``['-m', 'package.module', ...]``.
    num_processes: how many processes to start (>= 1).
    cpu_devices: if given, each worker runs on the CPU platform with this many
      simulated devices (``--xla_force_host_platform_device_count``).
    timeout: seconds for the whole run.
    env: environment of the workers (default: this process's), to which the
      launcher's variables are added.
    cwd: working directory of the workers.
    stream: where to forward the prefixed output; ``None`` keeps it only in
      the result. Pass ``sys.stdout`` to see it live.
    python: the interpreter.
    init_timeout: seconds :func:`initialize_from_env` lets
      ``jax.distributed.initialize`` wait for all processes.
    keep_lines: lines of output kept per worker in the result.
    grace: seconds between SIGTERM and SIGKILL when stopping workers.
    stop_on_failure: stop the other workers as soon as one fails (default).
      With False they are left to end on their own (JAX's coordination
      service aborts them once the failed one misses its heartbeats) and
      :class:`WorkerFailed` is raised when all have exited, or
      :class:`LaunchTimeout` at the timeout.

  Every process a worker starts ends with the launch: once all workers have
  exited (or were stopped), whatever is left in their process groups gets
  SIGTERM, then SIGKILL after ``grace``, and ``launch`` returns or raises
  only once every process of those groups is gone (on success, failure,
  timeout or ``KeyboardInterrupt``). The wait is bounded: ``grace`` seconds
  after SIGTERM, then at most 10 s after SIGKILL for the killed processes
  to be reaped (a ``RuntimeWarning`` names any group still there).

  Returns:
    A :class:`LaunchResult` (all exit statuses 0).

  Raises:
    WorkerFailed: a worker exited with a non-zero status.
    LaunchTimeout: the run took longer than ``timeout``.
    TypeError, ValueError: an argument of the wrong type or out of range
      (the message names it), or a script or working directory that does
      not exist, before anything is started.
  """
  args, num_processes, cpu_devices, init_timeout, keep_lines = _check_launch(
      args, num_processes, cpu_devices, timeout, cwd, stream, python,
      init_timeout, keep_lines, grace, stop_on_failure)
  base_env = _worker_env(env, num_processes, cpu_devices, init_timeout)
  lock = threading.Lock()
  workers: list[Worker] = []
  start = time.monotonic()
  try:
    for index in range(num_processes):
      worker_env = dict(base_env)
      worker_env[ENV_PROCESS_ID] = str(index)
      proc = subprocess.Popen(
          [python, *args], env=worker_env, cwd=cwd, stdin=subprocess.DEVNULL,
          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
          start_new_session=True)
      workers.append(Worker(index, proc, stream, lock, keep_lines))
    return _supervise(workers, start, timeout, grace, stop_on_failure)
  except LaunchError:
    raise  # _supervise has stopped everything
  except BaseException:
    # KeyboardInterrupt, or a failure to start a worker: leave nothing behind.
    finish(workers, grace)
    raise


def check_count(name: str, value: Any, *, minimum: int = 0,
                maximum: Optional[int] = None) -> int:
  """A count or size: a Python or NumPy integer (not a bool, float or
  string) in ``[minimum, maximum]``; returned as an int."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(
        f'{name} must be an integer >= {minimum}, got the '
        f'{type(value).__name__} {value!r}.'
    )
  value = int(value)
  if value < minimum or (maximum is not None and value > maximum):
    bound = (f'in [{minimum}, {maximum}]' if maximum is not None
             else f'>= {minimum}')
    raise ValueError(f'{name} must be an integer {bound}, got {value}.')
  return value


def _check_launch(
    args: Sequence[str], num_processes: int, cpu_devices: Optional[int],
    timeout: float, cwd: Optional[str], stream: Optional[IO[str]],
    python: str, init_timeout: int, keep_lines: int, grace: float,
    stop_on_failure: bool,
) -> tuple[list[str], int, Optional[int], int, int]:
  """:func:`launch`'s arguments, checked (and normalized) before any start."""
  args = _check_program(args, cwd)
  num_processes = check_count(
      'num_processes', num_processes, minimum=1, maximum=_MAX_PROCESSES)
  if cpu_devices is not None:
    cpu_devices = check_count(
        'cpu_devices', cpu_devices, minimum=1, maximum=_MAX_CPU_DEVICES)
  _checks.check_positive('timeout', timeout)
  init_timeout = check_count('init_timeout', init_timeout, minimum=1)
  keep_lines = check_count('keep_lines', keep_lines, minimum=0)
  _checks.check_nonnegative('grace', grace)
  _checks.check_bool('stop_on_failure', stop_on_failure)
  if stream is not None and not callable(getattr(stream, 'write', None)):
    raise TypeError(
        f'stream must be a text stream with a write method (sys.stdout, '
        f'io.StringIO()) or None, got {type(stream).__name__}.')
  if shutil.which(python) is None:  # a path is checked as it is, a name on PATH
    raise ValueError(f'python: no executable interpreter at {python!r}.')
  return args, num_processes, cpu_devices, init_timeout, keep_lines


def _worker_env(env: Optional[Mapping[str, str]], num_processes: int,
                cpu_devices: Optional[int], init_timeout: int) -> dict[str, str]:
  """The environment every worker shares (all but its process index)."""
  base_env = dict(os.environ if env is None else env)
  base_env['PYTHONUNBUFFERED'] = '1'
  if cpu_devices is not None:
    flags = [f for f in base_env.get('XLA_FLAGS', '').split()
             if not f.startswith('--xla_force_host_platform_device_count')]
    flags.append(f'--xla_force_host_platform_device_count={cpu_devices}')
    base_env['XLA_FLAGS'] = ' '.join(flags)
    base_env['JAX_PLATFORMS'] = 'cpu'
  base_env[ENV_COORDINATOR] = f'{LOOPBACK}:{free_port()}'
  base_env[ENV_NUM_PROCESSES] = str(num_processes)
  base_env[ENV_INIT_TIMEOUT] = str(int(init_timeout))
  return base_env


def _result(workers: Sequence[Worker], start: float) -> LaunchResult:
  return LaunchResult([w.proc.poll() for w in workers],
                      [list(w.lines) for w in workers],
                      time.monotonic() - start)


def _failure(workers: Sequence[Worker], first: Worker, start: float,
             stop_on_failure: bool) -> WorkerFailed:
  others = [w for w in workers if w is not first]
  if stop_on_failure:
    fate = ('stopped the others '
            f'({", ".join(str(w.index) for w in others) or "none"})')
  else:
    fate = 'then ' + ', '.join(
        f'process {w.index} {describe_exit(w.proc.returncode)} after '
        f'{w.exited_at - start:.1f} s' for w in others)
  return WorkerFailed(
      f'process {first.index} of {len(workers)} '
      f'{describe_exit(first.proc.returncode)} after '
      f'{first.exited_at - start:.1f} s; {fate}. Last output of '
      f'process {first.index}:\n{first.tail()}', _result(workers, start))


def _supervise(workers: Sequence[Worker], start: float, timeout: float,
               grace: float, stop_on_failure: bool) -> LaunchResult:
  """Waits for the workers: all exit 0, one fails, or the timeout passes.

  Whatever happens, what is left of their process groups is stopped (and
  gone) before this returns or raises.
  """
  deadline = start + timeout
  while True:
    exited = [w for w in workers if w.exited_at is not None]
    failed = sorted((w for w in exited if w.proc.returncode != 0),
                    key=lambda w: w.exited_at)
    if failed and (stop_on_failure or len(exited) == len(workers)):
      finish(workers, grace)
      raise _failure(workers, failed[0], start, stop_on_failure)
    if len(exited) == len(workers):
      finish(workers, grace)  # children the workers left running
      return _result(workers, start)
    if time.monotonic() > deadline:
      running = [w.index for w in workers if w.exited_at is None]
      finish(workers, grace)
      tails = ''.join(f'  process {w.index}:\n{w.tail(10)}' for w in workers)
      raise LaunchTimeout(
          f'{len(workers)} processes did not finish within {timeout:g} s '
          f'(still running: {running}); stopped all. Last output:\n{tails}',
          _result(workers, start))
    time.sleep(0.05)


def initialize_from_env(
    *, collectives: str = 'gloo', heartbeat_timeout_seconds: int = 30,
) -> bool:
  """``jax.distributed.initialize`` with what :func:`launch` passed, if any.

  Call it first thing in a worker, before any other JAX computation. Without
  the launcher's environment variables it does nothing and returns False,
  so the same script runs as an ordinary single process. The coordinator
  listens on 127.0.0.1 only (gloo's collectives listen on the address the
  host name resolves to: JAX has no public setting for it).

  Args:
    collectives: CPU collectives implementation (``'gloo'``; ``'mpi'`` needs
      an MPI installation).
    heartbeat_timeout_seconds: after how long without a heartbeat the
      coordination service declares a process dead (JAX's default is 100).

  Returns:
    True if this process joined a multi-process run.

  Raises:
    RuntimeError: the environment names a coordinator that is not on the
      loopback address (this helper is for runs on one machine).
  """
  if collectives not in ('gloo', 'mpi'):
    raise ValueError(
        f"collectives must be 'gloo' or 'mpi', got {collectives!r}.")
  check_count('heartbeat_timeout_seconds', heartbeat_timeout_seconds,
                      minimum=1)
  address = os.environ.get(ENV_COORDINATOR)
  if not address:
    return False
  host, _, port = address.rpartition(':')
  if host != LOOPBACK:
    raise RuntimeError(
        f'{ENV_COORDINATOR}={address!r}: initialize_from_env is for runs on '
        f'one machine and binds to {LOOPBACK} only; on a cluster call '
        'jax.distributed.initialize() yourself.')
  import jax  # pylint: disable=g-import-not-at-top

  jax.config.update('jax_cpu_collectives_implementation', collectives)
  jax.distributed.initialize(
      coordinator_address=address,
      num_processes=int(os.environ[ENV_NUM_PROCESSES]),
      process_id=int(os.environ[ENV_PROCESS_ID]),
      coordinator_bind_address=f'{LOOPBACK}:{port}',
      initialization_timeout=int(os.environ.get(ENV_INIT_TIMEOUT, '60')),
      heartbeat_timeout_seconds=heartbeat_timeout_seconds,
      # cluster auto-detection would look for SLURM/MPI variables; the
      # launcher has given everything.
      cluster_detection_method='deactivate',
  )
  return True


def main(argv: Optional[Sequence[str]] = None) -> int:
  """``python -m tests.launch --processes N [--cpu-devices D] -- prog``."""
  parser = argparse.ArgumentParser(
      prog='python -m tests.launch',
      description='Run a JAX program as N processes on 127.0.0.1. The program '
      'calls tests.launch.initialize_from_env() first.')
  parser.add_argument('--processes', '-n', type=int, required=True)
  parser.add_argument('--cpu-devices', type=int, default=None,
                      help='simulated CPU devices per process')
  parser.add_argument('--timeout', type=float, default=600.0,
                      help='seconds for the whole run (default 600)')
  parser.add_argument('program', nargs=argparse.REMAINDER,
                      help='script.py [args] or -m module [args], after --')
  ns = parser.parse_args(argv)
  program = ns.program[1:] if ns.program[:1] == ['--'] else ns.program
  if not program:
    parser.error('give the program to run after --')
  try:
    launch(program, ns.processes, cpu_devices=ns.cpu_devices,
           timeout=ns.timeout, stream=sys.stdout)
  except (TypeError, ValueError) as e:  # an argument, before any start
    parser.error(str(e))
  except LaunchError as e:
    print(f'tests.launch: {e}', file=sys.stderr)
    return 1
  return 0


if __name__ == '__main__':
  sys.exit(main())
