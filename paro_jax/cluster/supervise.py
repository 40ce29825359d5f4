"""Supervising the processes of a launch: their output prefixed per node, stopping them (all
at once, or together after Ctrl-C so that they checkpoint an agreed step), and the reaper that
cleans up after a launcher that was itself killed (paro_jax/cluster/reaper.py)."""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time

from paro_jax import report
from paro_jax.cluster.native_stderr import COORDINATION_ABORT


_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
_UNHEALTHY = "The following tasks are unhealthy (stopped sending heartbeats):"


class Node:
  """A node's process and the threads that pass its output on, each line prefixed `[node K]`.

  Kept out of the terminal (into the launcher's log): Gloo's connection messages, unless
  `show_gloo`, and Python tracebacks, which are those of nodes that lost a peer (the launcher's
  own line names the node that failed first and shows the end of its stderr).
  """

  def __init__(self, index: int, proc: subprocess.Popen, out, err, lock, show_gloo=False):
    self.index, self.proc, self.show_gloo = index, proc, show_gloo
    self.tail = collections.deque(maxlen=15)
    self.in_traceback = self.after_traceback = False
    self.aborting = False  # JAX's coordination service is aborting the process: all is noise
    self.unhealthy: list[int] = []  # the processes that service named (no heartbeats)
    self._listing = False
    self.threads = [
      threading.Thread(target=self._pump, args=(proc.stdout, out, lock, False), daemon=True),
      threading.Thread(target=self._pump, args=(proc.stderr, err, lock, True), daemon=True),
    ]
    for t in self.threads:
      t.start()

  def _pump(self, pipe, sink, lock, keep) -> None:
    prefix = f"[node {self.index}] "
    for raw in iter(pipe.readline, b""):
      line = raw.decode(errors="replace").rstrip("\r\n")
      if keep:
        self.tail.append(line)
      if self._hidden(line, keep):
        report.log(prefix + line)
        continue
      with lock:
        sink.write(prefix + line + "\n")
        sink.flush()
    pipe.close()

  def _hidden(self, line: str, stderr: bool) -> bool:
    if line.startswith("[Gloo] "):
      return not self.show_gloo
    if not stderr:
      return False
    if self.aborting or any(marker in line for marker in COORDINATION_ABORT):
      # JAX's coordination service found a process without heartbeats and aborts this one: its
      # log lines, the processes it names and the C++ check-failure stack go to the log; the
      # launcher's line names the process.
      self.aborting = True
      if _UNHEALTHY in line:
        self._listing = True
      elif self._listing and (m := re.search(r"(\d+)\s*$", line)):
        self.unhealthy.append(int(m.group(1)))
      else:
        self._listing = False
      return True
    if line.startswith(("Traceback (most recent call last)", *_CHAINED)):
      self.in_traceback = True
      return True
    if self.in_traceback:
      if line and not line[0].isspace():
        self.in_traceback = False  # the exception's own line ends the block (into the log too)
        self.after_traceback = True
      return True
    if self.after_traceback and not line.strip():
      return True  # the blank line before a chained exception's "During handling ..."
    self.after_traceback = False
    return False

  def join(self, timeout: float = 5.0) -> None:
    for t in self.threads:
      t.join(timeout)


def describe_exit(code: int) -> str:
  if code < 0:
    try:
      return f"killed by {signal.Signals(-code).name}"
    except ValueError:
      return f"killed by signal {-code}"
  return f"exit code {code}"


def signal_all(nodes: list[Node], sig: signal.Signals) -> None:
  for n in nodes:
    if n.proc.poll() is None:
      try:
        os.killpg(n.proc.pid, sig)  # its own session: the group id is its pid
      except (ProcessLookupError, PermissionError):
        pass


def stop(nodes: list[Node], first: signal.Signals = signal.SIGKILL, grace: float = 10.0) -> None:
  """Send `first` to each live child's process group; SIGKILL what is left after `grace` s.

  Not SIGTERM: jax.distributed's preemption notifier catches it and the process runs on.
  SIGINT lets `paro-jax train` checkpoint and stop (on Ctrl-C); after a failure the others
  are likely blocked in a collective with the dead process, so they get SIGKILL at once.
  """
  live = [n for n in nodes if n.proc.poll() is None]
  for sig in dict.fromkeys((first, signal.SIGKILL)):
    signal_all(live, sig)
    deadline = time.monotonic() + grace
    while live and time.monotonic() < deadline:
      live = [n for n in live if n.proc.poll() is None]
      time.sleep(0.05)
    if not live:
      break
  for n in nodes:
    try:
      n.proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
      pass


def stop_together(nodes: list[Node], grace: float, straggle: float = 30.0) -> None:
  """After Ctrl-C: SIGINT to every node; they checkpoint an agreed step and exit together. Who is
  still running `grace` s later, or `straggle` s after the first node exited (a node that got the
  signal before its handler was in place exits alone, and its peers then hang), gets SIGKILL."""
  signal_all(nodes, signal.SIGINT)
  deadline = time.monotonic() + grace
  while time.monotonic() < deadline:
    codes = [n.proc.poll() for n in nodes]
    if all(c is not None for c in codes):
      return
    if any(c is not None for c in codes):
      deadline = min(deadline, time.monotonic() + straggle)
      straggle = float("inf")  # set the deadline once
    time.sleep(0.05)
  stop(nodes)


class Interrupted(Exception):
  def __init__(self, signum):
    super().__init__(signum)
    self.signum = signum


class Reaper:
  """The process that cleans up if this launcher is SIGKILLed (paro_jax/cluster/reaper.py)."""

  def __init__(self, env: dict):
    self.proc = subprocess.Popen(
      [sys.executable, "-m", "paro_jax.cluster.reaper"],
      stdin=subprocess.PIPE,
      stdout=subprocess.DEVNULL,
      env=env,
      start_new_session=True,  # Ctrl-C on the terminal is not for it
      text=True,
    )

  def tell(self, kind: str, value) -> None:
    try:
      self.proc.stdin.write(f"{kind} {value}\n")
      self.proc.stdin.flush()
    except (BrokenPipeError, OSError):
      pass

  def done(self) -> None:
    try:
      self.proc.stdin.write("done\n")
      self.proc.stdin.close()
    except (BrokenPipeError, OSError):
      pass
    try:
      self.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
      self.proc.kill()
