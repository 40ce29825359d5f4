"""Cleans up after a `paro-jax launch` that was itself killed (SIGKILL, OOM killer).

The launcher starts this as `python -m paro_jax.cluster.reaper` in its own session, with a pipe on
its stdin, and writes to it what it creates: `group PID` (a node's process group), `ns NAME` (a
network namespace), `dir PATH` (a temporary directory). A normal exit of the launcher ends with
`done`. When the pipe closes without `done` (the launcher died without cleaning up), the reaper
SIGKILLs the nodes' process groups and every process left in the namespaces, deletes the
namespaces and the directories, and exits: nothing of the launch is left a few seconds later.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys


def reap(groups: list[int], namespaces: list[str], dirs: list[str]) -> None:
  for pgid in groups:
    try:
      os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass
  for ns in namespaces:
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    for pid in pids.split():
      try:
        os.kill(int(pid), signal.SIGKILL)
      except (ProcessLookupError, PermissionError, ValueError):
        pass
  for ns in reversed(namespaces):
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
  for d in dirs:
    shutil.rmtree(d, ignore_errors=True)


def main() -> None:
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle
  groups, namespaces, dirs = [], [], []
  for line in sys.stdin:
    kind, _, value = line.strip().partition(" ")
    if kind == "done":
      return
    if kind == "group":
      groups.append(int(value))
    elif kind == "ns":
      namespaces.append(value)
    elif kind == "dir":
      dirs.append(value)
  reap(groups, namespaces, dirs)  # EOF without `done`: the launcher is gone


if __name__ == "__main__":
  main()
