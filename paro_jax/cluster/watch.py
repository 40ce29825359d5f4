"""Noticing dead, frozen and stuck processes of a multi-process run.

Inside each process (`paro-jax train`):

- `Heartbeat`: a daemon thread that rewrites a small JSON file every second with the last step the
  process finished (`{"pid", "step", "time"}`). `paro-jax launch` gives each node such a file
  (env `PARO_JAX_HEARTBEAT`) and reads them all (see `Watch`).
- `Watchdog` (`train --progress-timeout S`, meant for SLURM / mpirun, where no launcher of ours
  watches): the process exits by itself, naming itself and its last step, when no step finished
  for S s.
- `PeerLost`: a collective of the run failed (another process died: its connection closed); the
  process exits with one line naming itself and its last step (`peer_lost`).

In the launcher, `Watch` turns the heartbeat files into a verdict: a node whose heartbeat is older
than the heartbeat timeout is frozen (SIGSTOP, a machine that stalls; a dead process is seen
sooner, by its exit), and a node whose step did not advance for the progress timeout is stuck (a
hang in a collective, a deadlock), the first step's compile included.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time

HEARTBEAT_ENV = "PARO_JAX_HEARTBEAT"
LOST_EXIT = 3  # a hang (the watchdog) or a lost peer: both resume from the newest checkpoint


class _Progress:
  """The last step this process finished, shared by the heartbeat and the watchdog."""

  def __init__(self):
    self.step: int | None = None
    self.since = time.monotonic()  # when `step` last changed (or the process started)


PROGRESS = _Progress()


def finished(step: int) -> None:
  """Called by the training loop after each step it finished (its metrics were read)."""
  if step != PROGRESS.step:
    PROGRESS.step, PROGRESS.since = step, time.monotonic()


def last_step() -> str:
  return "none" if PROGRESS.step is None else str(PROGRESS.step)


class PeerLost(RuntimeError):
  """A collective failed in a multi-process run: another process is gone. One line (`str`)."""


def peer_lost(error: BaseException, process: int, processes: int) -> PeerLost:
  """The one line for `error`, a runtime error of a collective, raised in process `process`."""
  # "Gloo all-reduce failed: [external/gloo/.../pair.cc:547] Connection closed by peer [ip]:port"
  what = re.sub(r"\[[^\]]*\.cc:\d+\] ", "", " ".join(str(error).split()))
  what = re.sub(r"^[A-Z_]+: ", "", what)  # the status code (UNKNOWN: ...)
  return PeerLost(
    f"process {process} of {processes}: a collective failed after step {last_step()}, the last "
    f"step this process finished ({what}): another process of the run died or lost its "
    f"connection. Run again with --resume: it continues from the newest checkpoint"
  )


class Heartbeat(threading.Thread):
  def __init__(self, path: str, interval: float = 1.0):
    super().__init__(daemon=True, name="paro-jax-heartbeat")
    self.path, self.interval = path, interval

  def beat(self) -> None:
    tmp = f"{self.path}.tmp"
    with open(tmp, "w") as f:
      json.dump({"pid": os.getpid(), "step": PROGRESS.step, "time": time.time()}, f)
    os.replace(tmp, self.path)  # the reader never sees half a file

  def run(self) -> None:
    while True:
      try:
        self.beat()
      except OSError:
        pass  # the launcher removed the directory: it is going away
      time.sleep(self.interval)


def start_heartbeat(environ=None) -> Heartbeat | None:
  """Start the heartbeat thread when the launcher asked for one (env PARO_JAX_HEARTBEAT)."""
  path = (os.environ if environ is None else environ).get(HEARTBEAT_ENV)
  if not path:
    return None
  beat = Heartbeat(path)
  beat.beat()
  beat.start()
  return beat


class Watchdog(threading.Thread):
  """Exit the process (code 3) when no step finished for `timeout` s; the first step's compile
  counts. `os._exit`: the main thread is likely blocked in a collective that never returns."""

  def __init__(
    self, timeout: float, exit=os._exit, clock=time.monotonic, poll: float = 1.0, who: str = ""
  ):
    super().__init__(daemon=True, name="paro-jax-watchdog")
    self.timeout, self._exit, self._clock, self.poll = timeout, exit, clock, poll
    self.who = who  # "process 1 of 2: " (several processes), else ""
    self.stopped = threading.Event()

  def run(self) -> None:
    while not self.stopped.wait(self.poll):
      idle = self._clock() - PROGRESS.since
      if idle > self.timeout:
        sys.stderr.write(
          f"paro-jax: error: {self.who}no step finished for {idle:.0f} s (--progress-timeout "
          f"{self.timeout:g}); the last step this process finished: {last_step()}. Another "
          f"process is likely dead or hung: exiting\n"
        )
        sys.stderr.flush()
        self._exit(LOST_EXIT)
        return


class Watch:
  """The launcher's view of its nodes' heartbeat files."""

  def __init__(
    self,
    paths: list[str],
    heartbeat_timeout: float,
    progress_timeout: float,
    startup: float = 60.0,
    clock=time.time,
  ):
    self.paths, self.clock, self.startup = paths, clock, startup
    self.heartbeat_timeout, self.progress_timeout = heartbeat_timeout, progress_timeout
    self.started = clock()
    self.steps: list[int | None] = [None] * len(paths)
    self.beats: list[float | None] = [None] * len(paths)  # time of the newest heartbeat
    self.advanced = [self.started] * len(paths)  # when each node's step last changed

  def read(self) -> None:
    now = self.clock()
    for k, path in enumerate(self.paths):
      try:
        with open(path) as f:
          beat = json.load(f)
      except (OSError, ValueError):
        continue
      self.beats[k] = beat["time"]
      if beat["step"] != self.steps[k]:
        self.steps[k], self.advanced[k] = beat["step"], now

  def last_steps(self) -> str:
    """'node 0: step 5, node 1: step 4' (`none` before a node's first step)."""
    return ", ".join(
      f"node {k}: {'none' if s is None else f'step {s}'}" for k, s in enumerate(self.steps)
    )

  def verdict(self) -> tuple[int, str] | None:
    """(node, why) for the first node that is frozen or stuck, else None."""
    now = self.clock()
    for k in range(len(self.paths)):
      # Before its first heartbeat a node gets `startup` s at least (Python starting up).
      seen = self.beats[k]
      limit = self.heartbeat_timeout
      if seen is None:
        seen, limit = self.started, max(limit, self.startup)
      if self.heartbeat_timeout and now - seen > limit:
        what = "since it started" if self.beats[k] is None else f"for {now - seen:.0f} s"
        return k, (
          f"sent no heartbeat {what} (--heartbeat-timeout {self.heartbeat_timeout:g}): it is "
          f"stopped (SIGSTOP) or frozen"
        )
    if self.progress_timeout:
      stuck = [k for k in range(len(self.paths)) if now - self.advanced[k] > self.progress_timeout]
      if stuck:
        # The node behind the others is the likely culprit; the rest wait for it.
        k = min(stuck, key=lambda i: -1 if self.steps[i] is None else self.steps[i])
        return k, (
          f"finished no step for {now - self.advanced[k]:.0f} s (--progress-timeout "
          f"{self.progress_timeout:g}): it is hung"
        )
    return None
