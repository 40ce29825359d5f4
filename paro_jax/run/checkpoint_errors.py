"""A checkpoint that could not be written or read, said once: `CheckpointError`, what a failed
or full-disk write of orbax's becomes, the lines naming the checkpoints a restore could not read,
and the filters that keep orbax's own logging of the same failure (once
per thread, with tracebacks) to one line or none."""

from __future__ import annotations

import errno
import logging
import os


class CheckpointError(OSError):
  """A checkpoint could not be written; the previous one is intact."""

  def __str__(self) -> str:
    return self.strerror or super().__str__()


def no_space(error: BaseException) -> bool:
  """Whether `error` (or what caused it) is a full disk; orbax's tensorstore writer raises a
  ValueError that only says so in its message."""
  while error is not None:
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
      return True
    text = str(error)
    if "No space left on device" in text or "os_error_code='28'" in text:
      return True
    error = error.__cause__ or error.__context__
  return False


class _QuietOrbaxErrors(logging.Filter):
  """Orbax logs each failure of a background write with its traceback, once per thread; the
  Checkpointer raises it once, as a CheckpointError. Keep one line per record, none for a full
  disk (the CheckpointError says it all)."""

  def filter(self, record: logging.LogRecord) -> bool:
    if record.name == "asyncio":
      return not no_space(record.exc_info[1] if record.exc_info else None)
    if "orbax" not in record.pathname or record.levelno < logging.ERROR:
      return True
    if no_space(record.exc_info[1] if record.exc_info else None) or "No space left" in str(
      record.msg
    ):
      return False
    record.exc_info, record.exc_text = None, None
    return True


QUIET_ORBAX = _QuietOrbaxErrors()


def quiet_closed_loop(hook):
  """sys.unraisablehook without orbax's leftovers: after a failed (e.g. full-disk) save,
  TensorStore completes the writes still in flight into orbax's closed event loop, once each;
  the CheckpointError has said what happened."""

  def filtered(unraisable):
    error = unraisable.exc_value
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
      return
    hook(unraisable)

  filtered.paro_jax = True
  return filtered


class ErrorsAsCheckpointError:
  """Turn a failed write (an OSError, or orbax's ValueError for a full disk) into a
  CheckpointError that says what and where."""

  def __init__(self, ckpt):  # a run/checkpoint.py Checkpointer, the save it is writing
    self.ckpt = ckpt

  def __enter__(self):
    return self

  def __exit__(self, kind, error, tb):
    if error is None or isinstance(error, CheckpointError):
      return False
    full = no_space(error)
    if not (full or isinstance(error, OSError)):
      return False
    step, self.ckpt._saving = self.ckpt._saving, None
    where = os.path.join(self.ckpt.directory, f"{step}" if step is not None else "")
    previous = [s for s in self.ckpt._manager.all_steps() if s != step]
    # What the failed save loses: the steps trained since the previous checkpoint.
    kept = (
      f"the previous checkpoint (step {max(previous)}) is intact; steps {max(previous) + 1}-{step} "
      f"are not saved"
      if previous
      else f"no earlier checkpoint exists: the {step} steps trained are not saved"
      if step is not None
      else "no earlier checkpoint exists"
    )
    if full:
      message = (
        f"the disk is full: could not write checkpoint {where}; {kept}. Free space on the "
        f"disk holding {self.ckpt.directory} or pass another --out"
      )
      raise CheckpointError(errno.ENOSPC, message) from error
    message = f"could not write checkpoint {where} ({error}); {kept}"
    raise CheckpointError(error.errno, message) from error


def rotated_steps(steps) -> str:
  """The checkpoint steps a reader lost to rotation, for its line: a few by number, many by
  count and range."""
  steps = sorted(set(steps))
  if len(steps) <= 3:
    named = ", ".join(map(str, steps))
    return f"checkpoint steps {named} were" if len(steps) > 1 else f"checkpoint step {named} was"
  return f"{len(steps)} checkpoints (steps {steps[0]} to {steps[-1]}) were"


def describe_failures(failures) -> str:
  """The damaged checkpoint steps and why, (step, error) pairs, for one line."""
  return "; ".join(
    f"checkpoint step {step} is damaged ({type(e).__name__}: "
    f"{str(e).splitlines()[0][:200] if str(e) else ''})"
    for step, e in failures
  )
