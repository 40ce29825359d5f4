"""A process's stderr with native fatal errors folded into its log (under SLURM and mpirun).

JAX's distributed client aborts its process from C++ (glog `F` line, "*** Check failure stack
trace: ***", ~25 frames) when its coordination service is gone: what a process stopped by
SIGSTOP meets when the scheduler continues it to end the job, after another process named it
(cluster/watch.py PeerWatch) and ended the run. The abort happens the moment the process runs
again, before any Python code can act, and writes to file descriptor 2. So the process's stderr
is a pipe to a small child process, forked before jax starts, that passes everything on unchanged
until a native fatal error begins (or the coordination service's error that comes before it);
from there on it writes one line naming it and the log, and the rest (the error, the stack) into
the log. `paro-jax launch` does the same for its nodes
itself (cluster/supervise.py).
"""

from __future__ import annotations

import os
import re
import signal
import sys

# glog's lines (`F1126 23:06:49.468845 8224 client.h:80] ...`: severity, date, time, thread,
# file:line) and the header of a FATAL one's stack.
GLOG = re.compile(rb"^([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [^\]]*\] ?(.*)$")
STACK = b"*** Check failure stack trace: ***"
# JAX's distributed client and service on their way to that abort (warnings and errors about
# the coordination service and the preemption notices it carries), and what follows them on
# lines of their own (gRPC's details, the tasks named): into the log, not the terminal.
NATIVE_NOISE = (b"coordination", b"preemption")
# What JAX's coordination service and client log as they abort the processes (jaxlib 0.10.2):
# the service's error, in process 0, then each client's (cluster/supervise.py reads a launch's).
COORDINATION_ABORT = (
  "Use error polling to propagate the following error",  # the service, in process 0
  "Terminating process because the JAX distributed service",  # each client
)
# A line that starts a record of its own (ends the lines that continue a folded native message).
_RECORD = (b"paro-jax:", b"{", b"[", b"Traceback", b"srun:")


def fold(log_path: str, who: str = "") -> None:
  """From now on this process's fd 2 goes through a child that folds native fatal errors into
  `log_path` (appended). Call before jax starts (no threads yet: a fork is safe). The child
  is `python -m paro_jax.cluster.native_stderr`, so that it is not taken for the task itself."""
  read, write = os.pipe()
  if os.fork() == 0:
    os.close(write)
    os.set_inheritable(read, True)
    argv = [sys.executable, "-m", "paro_jax.cluster.native_stderr", str(read), log_path, who]
    try:
      os.execv(sys.executable, argv)
    finally:
      os._exit(1)  # not reached unless the exec failed
  os.close(read)
  os.dup2(write, 2)
  os.close(write)


def _serve(read: int, log_path: str, who: str) -> None:
  """The child: pass stderr on until the parent's writers are gone."""
  # The scheduler signals the whole task when it ends the job: the child reads to the end.
  for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, signal.SIG_IGN)
  _pump(read, 2, log_path, who)


def _pump(read: int, out: int, log_path: str, who: str) -> None:
  """Pass `read` on to `out` line by line (a partial line at once), except JAX's own native
  messages about its coordination service (into the log) and, from a FATAL line or a stack on,
  everything (one line here naming it)."""
  pending, folding, noise = b"", False, False
  while chunk := os.read(read, 1 << 16):
    pending += chunk
    *lines, pending = pending.split(b"\n")
    for line in lines:
      glog = GLOG.match(line)
      if not folding and ((glog and glog.group(1) == b"F") or line.startswith(STACK)):
        folding = True
        what = (glog.group(2) if glog else line).decode(errors="replace")[:300]
        _write(
          out,
          f"paro-jax: error: {who}aborted by a native fatal error: {what} (the rest of it and "
          f"its stack are in {log_path})\n".encode(),
        )
      elif glog:
        noise = any(word in line.lower() for word in NATIVE_NOISE)
      elif noise and (not line.strip() or line.startswith(_RECORD)):
        noise = False
      if folding or noise:
        _append(log_path, line + b"\n")
      else:
        _write(out, line + b"\n")
    # A partial line (a progress bar's \r updates) at once, unless it may begin a glog line.
    if pending and not (folding or noise or re.match(rb"[IWEF]\d", pending)):
      _write(out, pending)
      pending = b""
  if pending:
    if folding or noise:
      _append(log_path, pending)
    else:
      _write(out, pending)


def _write(fd: int, data: bytes) -> None:
  while data:
    data = data[os.write(fd, data) :]


def _append(path: str, data: bytes) -> None:
  try:
    with open(path, "ab") as f:
      f.write(data)
  except OSError:
    pass  # no log to keep it in: dropped rather than shown


if __name__ == "__main__":
  _serve(int(sys.argv[1]), sys.argv[2], sys.argv[3])
