"""How a run of `paro-jax train` stops: the signals (SIGINT, SIGTERM) that ask it to stop at a step
boundary, the vote by which several processes stop at the same step, and the exceptions a stopped
run raises (the lock that keeps two runs out of one directory: core/run_lock.py)."""

from __future__ import annotations

import os
import signal
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from paro_jax.run.checkpoint import Checkpointer


class NonFiniteSteps(ValueError):
  """Too many consecutive steps with a non-finite loss or gradient norm."""


class Diverged(ValueError):
  """The divergence guard stopped the run: too many steps in a row out of their band."""


class Interrupted(KeyboardInterrupt):
  """The run was stopped by a signal (SIGINT, SIGTERM) after checkpointing."""

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum


class StopSignals:
  """The first SIGINT or SIGTERM asks the loop to stop at the next step boundary (it then logs
  and checkpoints the finished step and exits); a second one exits at once, without waiting for
  the checkpoint (a checkpoint is only ever listed once complete).

  Only in the main thread. With several processes, the processes agree each step on whether any
  of them was asked to stop (`StopVote`), so they all stop after the same step and save it
  together."""

  def __init__(self):
    self.signum: int | None = None
    self.dispatched = 0  # train_step calls returned (the first one includes the compile)
    self.dispatched_at_signal = 0
    self.ckpt: Checkpointer | None = None  # the run's, once opened: what a stop interrupts
    self._old = {}
    self._after_failure_signum: int | None = None

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGINT, signal.SIGTERM):
        self._old[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, exc_type, *_exc):
    if self.signum is not None:
      # Stopped: what is left (the checkpointer's close, jax.distributed's shutdown at exit) can
      # wait on the other processes, and a signal then (srun's SIGTERM once another task has
      # exited 143) must still end this one with 128 + the signal, as documented, not by the
      # signal's default action ("Terminated"): the handler stays.
      return
    # `paro-jax train`'s own handler until the loop (run/train_command.py): its job ends here
    cli = any(getattr(old, "until_the_loop", False) for old in self._old.values())
    if cli and exc_type is not None and not issubclass(exc_type, KeyboardInterrupt):
      # The run failed: its one line comes next (cli.py). A signal now (srun's SIGTERM to the
      # other tasks once one is lost) must not cut it off: the first is noted, a second ends the
      # process at once.
      for sig in self._old:
        signal.signal(sig, self._after_failure)
      return
    for sig, old in self._old.items():
      if getattr(old, "until_the_loop", False):  # after the loop: Python's own behaviour
        old = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
      signal.signal(sig, old)

  def _after_failure(self, signum, _frame):
    if self._after_failure_signum is not None:
      os._exit(128 + signum)
    self._after_failure_signum = signum

  def _handle(self, signum, _frame):
    if self.signum is not None:
      os.write(2, f"\nparo-jax: stopped at once; {self._interrupted()}\n".encode())
      os._exit(128 + signum)
    self.signum, self.dispatched_at_signal = signum, self.dispatched
    what = (
      "stopping at a step all processes agree on and checkpointing it"
      if jax.process_count() > 1
      else "stopping before the first step (no checkpoint)"
      if self.dispatched == 0
      else "stopping after this step and checkpointing it"
    )
    name = signal.Signals(signum).name
    os.write(2, f"\nparo-jax: {name}: {what}; send it again to stop at once\n".encode())

  def agreed(self) -> None:
    """Some process was asked to stop (StopVote): this one stops after the same step."""
    self.signum = self.signum or signal.SIGINT
    self.dispatched_at_signal = self.dispatched

  @property
  def stopping(self) -> bool:
    return self.signum is not None

  def _interrupted(self) -> str:
    """What stopping at once leaves behind."""
    step = self.ckpt.writing() if self.ckpt is not None else None
    if step is not None:
      return f"checkpoint step {step} was being written and is not kept (the previous one is)"
    when = " during the first compile" if self.dispatched == 0 else ""
    return f"no checkpoint was being written{when}"


class StopVote:
  """With several processes: whether any process was asked to stop, the same answer on all.

  A one-int all-reduce (max) over every device, dispatched at each step like the step itself; its
  result is read after the previous step's metrics were, so the host waits for nothing new."""

  def __init__(self):
    mesh = Mesh(np.array(jax.devices()), ("all",))
    self.sharding = NamedSharding(mesh, PartitionSpec("all"))
    self.local = jax.local_device_count()
    self.reduce = jax.jit(jnp.max, out_shardings=NamedSharding(mesh, PartitionSpec()))

  def __call__(self, flag: bool) -> jax.Array:
    local = np.full((self.local,), int(flag), np.int32)
    return self.reduce(jax.make_array_from_process_local_data(self.sharding, local))
