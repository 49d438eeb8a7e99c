"""The launcher's worker processes: output, exit, and stopping their groups.

Every worker leads its own process group (``start_new_session=True``);
:class:`Worker` forwards its output line by line and notes when it exited,
and :func:`finish` ends what is left of the groups and collects the rest of
the output (used by :mod:`tests.launch`).
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import threading
import time
import warnings
from typing import IO, Optional, Sequence

_TAIL_LINES = 40


def describe_exit(code: int) -> str:
  if code < 0:
    try:
      return f'was killed by {signal.Signals(-code).name}'
    except ValueError:
      return f'was killed by signal {-code}'
  return f'exited with status {code}'


class Worker:
  """One child process, its output pump and the time it was seen to exit."""

  def __init__(self, index: int, proc: subprocess.Popen, stream: Optional[IO],
               lock: threading.Lock, keep_lines: int):
    self.index = index
    self.proc = proc
    self.lines: collections.deque[str] = collections.deque(maxlen=keep_lines)
    self.exited_at: Optional[float] = None
    self._stream = stream
    self._lock = lock
    self.pump = threading.Thread(target=self._pump, daemon=True)
    self.pump.start()
    self.waiter = threading.Thread(target=self._wait, daemon=True)
    self.waiter.start()

  def _pump(self) -> None:
    assert self.proc.stdout is not None
    for raw in iter(self.proc.stdout.readline, b''):
      line = raw.decode('utf-8', errors='replace')
      if not line.endswith('\n'):
        line += '\n'
      self.lines.append(line)
      if self._stream is not None:
        with self._lock:
          try:
            self._stream.write(f'[proc {self.index}] {line}')
            self._stream.flush()
          except (ValueError, OSError):  # stream closed under us
            self._stream = None
    self.proc.stdout.close()

  def _wait(self) -> None:
    self.proc.wait()
    self.exited_at = time.monotonic()

  def tail(self, lines: int = _TAIL_LINES) -> str:
    kept = list(self.lines)[-lines:]
    return ''.join(f'    {line}' for line in kept) or '    (no output)\n'


def _group_alive(pid: int) -> bool:
  try:
    os.killpg(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # pragma: no cover - a process of another user
    return True
  return True


# A killed process is gone (and its group with it) only once its parent has
# reaped it; a worker's orphaned children are reaped by init, which in some
# containers takes a while. How long the launcher waits for that after
# SIGKILL, and for the workers' output pumps to read the rest.
_KILL_WAIT = 10.0
_MIN_PUMP_WAIT = 1.0


def _wait_gone(workers: Sequence[Worker], seconds: float) -> list[Worker]:
  """Waits up to ``seconds`` for the workers' process groups to be gone;
  returns the workers whose group is still there."""
  deadline = time.monotonic() + seconds
  for w in workers:
    try:
      w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      pass
  while (time.monotonic() < deadline
         and any(_group_alive(w.proc.pid) for w in workers)):
    time.sleep(0.01)
  return [w for w in workers if _group_alive(w.proc.pid)]


def stop(workers: Sequence[Worker], grace: float) -> None:
  """Ends every process of every worker's process group and waits until
  all are gone: SIGTERM, SIGKILL after ``grace``, then up to
  :data:`_KILL_WAIT` seconds for the killed processes to be reaped.

  Each worker leads its own session (``start_new_session=True``), so its
  process group holds what it started: the worker, and children it left
  behind even after it exited (a group lives while any member does). A
  process that left the group itself (``setsid``, a daemon) is beyond reach.
  """
  for w in workers:
    w.proc.poll()
  alive = [w for w in workers if _group_alive(w.proc.pid)]
  for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, _KILL_WAIT)):
    if not alive:
      return
    for w in alive:
      try:
        os.killpg(w.proc.pid, sig)
      except (ProcessLookupError, PermissionError):
        pass
    alive = _wait_gone(alive, wait)
  if alive:
    warnings.warn(
        f'tests.launch: the process groups {[w.proc.pid for w in alive]} '
        f'still exist {_KILL_WAIT:g} s after SIGKILL (a process in '
        'uninterruptible sleep, or one its parent has not reaped).',
        RuntimeWarning, stacklevel=2)


def finish(workers: Sequence[Worker], grace: float) -> None:
  """Stops what is left of every worker's process group (see :func:`stop`)
  and collects the rest of their output."""
  stop(workers, grace)
  for w in workers:
    w.pump.join(timeout=max(grace, _MIN_PUMP_WAIT))
