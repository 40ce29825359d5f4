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
- `PeerWatch` (`train --heartbeat-timeout S` under SLURM / mpirun): the processes beat through
  JAX's coordination key-value store; a process whose beat stopped for S s (SIGSTOP, a stalled
  machine) is named by the others, which exit (124). JAX's coordination service is given a
  longer heartbeat timeout (cluster/distributed.py): it would abort the healthy processes first
  (SIGABRT and a C++ stack), naming no one.

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


FROZEN_EXIT = 124  # a process named frozen (or stuck), as `paro-jax launch` exits
BEAT_PREFIX = "paro_jax/beat/"  # PeerWatch's keys in JAX's coordination key-value store
DONE = "done"


class PeerWatch(threading.Thread):
  """Each process writes a counter under BEAT_PREFIX + its index every `interval` s and reads the
  others' (one round trip to the store, which JAX's coordination service keeps in process 0). A
  peer whose counter did not change for `timeout` s, or a store that answered no round trip for
  that long (process 0 itself frozen), is named, and this process exits with FROZEN_EXIT. A
  process that ends writes `done` (`stop`) and is no longer watched."""

  def __init__(
    self,
    client,
    process: int,
    processes: int,
    timeout: float,
    interval: float = 1.0,
    exit=os._exit,
    clock=time.monotonic,
  ):
    super().__init__(daemon=True, name="paro-jax-peer-watch")
    self.client, self.process, self.processes = client, process, processes
    self.timeout, self.interval, self._exit, self._clock = timeout, interval, exit, clock
    self.answered = clock()  # the last round trip the store answered
    self.changed = {k: self.answered for k in range(processes) if k != process}
    self.seen: dict[int, str] = {}
    self.stopped = threading.Event()
    self._beats = threading.Thread(target=self._beat, daemon=True, name="paro-jax-beat")

  def start(self) -> None:
    self._beats.start()
    super().start()

  def _beat(self) -> None:
    n = 0
    while not self.stopped.is_set():
      n += 1
      try:
        self.client.key_value_set(f"{BEAT_PREFIX}{self.process}", str(n), allow_overwrite=True)
        beats = self.client.key_value_dir_get(BEAT_PREFIX)
      except Exception:  # noqa: BLE001 - the service shut down (the run is ending): stop watching
        self.stopped.set()
        return
      self.observe(beats)
      self.stopped.wait(self.interval)

  def observe(self, beats) -> None:
    """One answered round trip: the (key, counter) pairs of every process."""
    now = self.answered = self._clock()
    for key, value in beats:
      k = int(key.rsplit("/", 1)[1])
      if k not in self.changed:
        continue
      if value == DONE:
        del self.changed[k]
      elif value != self.seen.get(k):
        self.seen[k], self.changed[k] = value, now

  def verdict(self) -> str | None:
    now = self._clock()
    if now - self.answered > self.timeout and self.process != 0:
      return (
        f"process 0, which runs JAX's coordination service, answered no heartbeat for "
        f"{now - self.answered:.0f} s"
      )
    late = [k for k, t in self.changed.items() if now - t > self.timeout]
    if late:
      k = min(late, key=self.changed.get)
      return f"process {k} sent no heartbeat for {now - self.changed[k]:.0f} s"
    return None

  def run(self) -> None:
    last = self._clock()
    while not self.stopped.wait(self.interval):
      now = self._clock()
      if now - last > self.timeout / 2:
        # This process was itself stopped (SIGSTOP) and just continued: what it saw of the
        # others is that old, not theirs. Start over rather than blame a peer.
        self.answered = now
        self.changed = dict.fromkeys(self.changed, now)
      last = now
      why = self.verdict()
      if why:
        sys.stderr.write(
          f"paro-jax: error: process {self.process} of {self.processes}: {why} "
          f"(--heartbeat-timeout {self.timeout:g}): it is stopped (SIGSTOP) or frozen; exiting. "
          f"The last step this process finished: {last_step()}\n"
        )
        sys.stderr.flush()
        self._exit(FROZEN_EXIT)
        return

  def stop(self) -> None:
    """This process is ending: say so to the others, stop beating. Waits at most a few seconds
    (a frozen process 0 answers nothing)."""
    if self.stopped.is_set():
      return
    self.stopped.set()
    self._beats.join(timeout=2 * self.interval + 1)
    done = threading.Thread(target=self._done, daemon=True, name="paro-jax-beat-done")
    done.start()
    done.join(timeout=2 * self.interval + 1)

  def _done(self) -> None:
    try:
      self.client.key_value_set(f"{BEAT_PREFIX}{self.process}", DONE, allow_overwrite=True)
    except Exception:  # noqa: BLE001, S110 - the service is gone: nobody is left to tell
      pass


def start_peer_watch(timeout: float, environ=None) -> PeerWatch | None:
  """A PeerWatch for a multi-process run that no `paro-jax launch` watches (its nodes have env
  PARO_JAX_HEARTBEAT); None for one process or `timeout` 0. After jax.distributed.initialize."""
  env = os.environ if environ is None else environ
  if not timeout or HEARTBEAT_ENV in env:
    return None
  # jax.distributed's client (jax 0.10 has no public accessor; orbax reads it the same way).
  from jax._src.distributed import global_state

  if global_state.client is None or not global_state.num_processes > 1:
    return None
  peers = PeerWatch(
    global_state.client, global_state.process_id, global_state.num_processes, timeout
  )
  peers.start()
  return peers


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
