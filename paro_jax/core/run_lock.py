"""The lock that keeps two runs out of one output directory: `paro-jax train`'s run directory,
`paro-jax prepare-data`'s `--out`. An flock on `DIR/.paro-jax.lock`, held for the whole run by the
process that writes the directory (process 0 of a run); the second run is refused in one line
naming the holder. No jax, no numpy."""

from __future__ import annotations

import fcntl
import os

from paro_jax import report

LOCK = ".paro-jax.lock"  # held (flock) by the process writing the directory


class RunLock:
  """An exclusive lock on an output directory while a run writes it (`main`: the process that
  takes it; the others hold nothing). `what` names the run in the refusal; `remove`: the lock
  file is removed when the lock is released (a directory of data is left as it was, or holding
  only what the run wrote)."""

  def __init__(self, out: str, main: bool, what: str = "run", remove: bool = False):
    self.path, self.main, self.what, self.fd = os.path.join(out, LOCK), main, what, None
    self.remove = remove

  def __enter__(self):
    if not self.main:
      return self
    while True:
      try:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      except FileNotFoundError:  # removed by a run that failed in it (below): made again
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        continue
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        holder = os.read(fd, 100).decode(errors="replace").strip() or "another process"
        os.close(fd)
        where = report.shown(os.path.dirname(self.path))
        raise ValueError(
          f"{where} is in use by another {self.what} ({holder}): wait for it to finish, stop it, "
          f"or pass another --out"
        ) from None
      # A lock removed by its holder (`remove`, or with the directory a failed run made): a lock
      # taken on the file it unlinked meanwhile guards nothing; take the new one.
      try:
        same = os.path.samestat(os.fstat(fd), os.stat(self.path))
      except FileNotFoundError:
        same = False
      if same:
        break
      os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {os.uname().nodename}".encode())
    self.fd = fd
    return self

  def __exit__(self, *_exc):
    if self.fd is not None:
      if self.remove:  # while still held: a run taking it next finds the file gone and makes one
        try:
          os.unlink(self.path)
        except FileNotFoundError:
          pass
      os.close(self.fd)  # releases the lock
      self.fd = None
