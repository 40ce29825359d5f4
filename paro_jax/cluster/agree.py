"""Processes of one run agreeing on a checkpoint step every one of them can read.

Each process lists and reads a checkpoint through its own view of the file system: a node whose
copy is missing a step or cannot read its files would otherwise fall back to an older step on
its own, and the processes would restore different states (or wait forever in a collective the
others skipped). Here, per candidate step, every process gives its verdict and one all-reduce
decides: the candidate is the newest step any process lists below the last one rejected, and it
is taken only where every process could read it.

The verdict is local and has no collective: orbax's own reads end in a barrier of all processes,
which a process that failed before it would never reach (the others would wait there forever).
"""

from __future__ import annotations

import contextlib
import json
import os

import numpy as np


class Agreement:
  """All-reduces of one int per process (min or max), the same answer on every process."""

  def __init__(self):
    # jax here, not at the top: the verdicts and their files are read without starting it
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    self.jax = jax
    self.many = jax.process_count() > 1
    self._min = self._max = None  # one process: its own value is the answer
    if not self.many:
      return
    # One device per process carries its value (the others pad with the neutral element).
    devices = np.array(jax.devices())
    self.sharding = NamedSharding(Mesh(devices, ("all",)), PartitionSpec("all"))
    self.local = jax.local_device_count()
    replicated = NamedSharding(self.sharding.mesh, PartitionSpec())
    self._min = jax.jit(jnp.min, out_shardings=replicated)
    self._max = jax.jit(jnp.max, out_shardings=replicated)

  def _reduce(self, fn, value: int) -> int:
    if not self.many:
      return int(value)
    local = np.full((self.local,), int(value), np.int64 if self._x64() else np.int32)
    array = self.jax.make_array_from_process_local_data(self.sharding, local)
    return int(fn(array))

  def _x64(self) -> bool:
    return bool(self.jax.config.jax_enable_x64)

  def all(self, ok: bool) -> bool:
    """Whether `ok` holds on every process."""
    return bool(self._reduce(self._min, int(bool(ok))))

  def max(self, value: int) -> int:
    return self._reduce(self._max, value)


class WriterFailed(ValueError):
  """Another process of a job failed in a step of its own: its line says why."""


class OneWriter:
  """Process 0 writes while every process takes part in the collectives around its writes (an
  export's gathers). After each piece of process 0's work the processes agree on whether every
  one went through (`check`), so that an error on one process stops them all at the same point:
  without it the others would wait in the next collective until JAX's heartbeat aborts them."""

  def __init__(self, what: str):
    import jax  # here, as Agreement's

    self.what = what
    self.writer = jax.process_index() == 0
    self.agreement = Agreement()
    self.settled = False  # a failure agreed on: no process takes part in another collective

  def check(self, error: BaseException | None) -> None:
    """On every process, with this process's error (None: its work went through): raise it, or
    WriterFailed where another process failed; return where every one went through."""
    if not self.settled and self.agreement.all(error is None):
      return
    self.settled = True
    if error is not None:
      raise error
    raise WriterFailed(
      f"another process of this {self.what} failed (its own line says why): nothing was "
      f"written; fix that and run it again"
    )

  @contextlib.contextmanager
  def step(self):
    """A piece of work that may fail on some processes only: `check` of its error at its end."""
    error = None
    try:
      yield
    except Exception as e:  # noqa: BLE001 - any error: the others must hear of it, then it is raised
      error = e
    self.check(error)


def agreed_steps(steps: list[int], agreement: Agreement):
  """Candidate steps, newest first, the same on every process: the newest step any process
  lists below the previous candidate. Yields (step, listed here)."""
  mine = sorted(steps)
  bound = None
  while True:
    below = [s for s in mine if bound is None or s < bound]
    candidate = agreement.max(below[-1] if below else -1)
    if candidate < 0:
      return
    yield candidate, candidate in mine
    bound = candidate


def local_verdict(step_dir: str, meta_item: str) -> Exception | None:
  """Why this process cannot read checkpoint `step_dir`, or None: its metadata JSON
  (`<meta_item>/metadata`) must parse, and every file of the step must open and yield its first
  byte. Touches no device and no other process."""
  try:
    with open(os.path.join(step_dir, meta_item, "metadata")) as f:
      json.load(f)
    for parent, _, files in os.walk(step_dir):
      for name in files:
        path = os.path.join(parent, name)
        with open(path, "rb") as f:
          if os.path.getsize(path) and not f.read(1):
            raise OSError(f"{path} yields no data")
  except (OSError, ValueError) as e:
    return e
  return None
