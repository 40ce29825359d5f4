"""Checkpoints of a training run: orbax, asynchronous, atomic, in logical (unsharded) shapes.

A checkpoint is one step directory holding two items: `state` (the TrainState: step, fp32 master
weights and optimizer state; a LoRA run from --init-from leaves its frozen base out, recording
where it is read again from: run/frozen_base.py) and `meta` (JSON: model config, strategy, mesh,
dtype, seed, data position). Orbax stores every jax.Array by its global shape, so a checkpoint
does not depend on the strategy or mesh that wrote it: restoring reads it straight into the
shardings of whatever engine resumes it (another strategy, another mesh, fewer devices).

Atomicity: orbax writes a step into `<step>.orbax-checkpoint-tmp*` and renames it only once every
item is complete; directories with that suffix are never listed as steps. A save killed halfway,
or one that runs out of disk, leaves the previous checkpoint as it was.

Integrity (run/checkpoint_content.py): `meta` records two 32-bit checksums of every array of the
state (computed on the devices from the arrays' bits and logical positions, so independent of
sharding), and a save refuses a state with non-finite values. A restore recomputes the checksums:
a checkpoint whose files were truncated or garbled is never loaded. Training falls back to the
newest intact step and moves the damaged newer ones aside (`damaged-<step>`), so the run saves
those steps again normally. A failed write is one CheckpointError (run/checkpoint_errors.py).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import sys
import time

import jax
import orbax.checkpoint as ocp
import tensorstore as ts
from jax.experimental import multihost_utils

from paro_jax.cluster.agree import Agreement
from paro_jax.core.state import TrainState
from paro_jax.run.checkpoint_content import RunMeta
from paro_jax.run.checksums import NonFiniteStateError, state_checksums
from paro_jax.run.checkpoint_restore import META_ITEM, STATE_ITEM, Restorer
from paro_jax.run.checkpoint_errors import (
  QUIET_ORBAX,
  CheckpointError,
  ErrorsAsCheckpointError,
  quiet_closed_loop,
)
from paro_jax.run.config import refuse_unsafe_path
from paro_jax.run.frozen_base import frozen_dtype

CHECKPOINTS = "checkpoints"  # the checkpoint directory inside a run directory (--out)
# How many times the steps are listed when one vanishes while listed (rotated away, --keep).
LIST_TRIES = 20


class Checkpointer(Restorer):
  """Asynchronous, atomic checkpoints of a run in `directory`, keeping the newest `keep` and the
  one `protect` names (the newest known good one: a run that diverges later still has it)."""

  def __init__(self, directory: str, keep: int = 3, read_only: bool = False):
    """`read_only`: a reader (export) that changes nothing in `directory`, not even the
    leftovers of a save in flight of a run that is still writing there."""
    if keep < 1:
      raise ValueError(f"keep must be >= 1 (checkpoints to keep), got {keep}")
    refuse_unsafe_path(str(directory), "checkpoint directory")
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(
      max_to_keep=None,  # rotated here (_rotate), where a protected step is kept
      create=not read_only,
      enable_async_checkpointing=True,
      # Leftovers of saves that were killed halfway: never a step, removed on start.
      cleanup_tmp_directories=not read_only,
    )
    handlers = {STATE_ITEM: ocp.StandardCheckpointHandler(), META_ITEM: ocp.JsonCheckpointHandler()}
    self._manager = _relisted(
      lambda: ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
    )
    self._read_only = read_only
    self.keep = keep
    self._protected: int | None = None
    self._saving: int | None = None  # the step being written in the background
    self._arrays = 0  # how many arrays that step holds (its index must list them all)
    self._agreement: Agreement | None = None  # for the verdict on a save's readability
    # orbax logs through absl's logger (or the root one); asyncio reports each of orbax's write
    # tasks that failed on a full disk once more, at exit
    if not getattr(sys.unraisablehook, "paro_jax", False):
      sys.unraisablehook = quiet_closed_loop(sys.unraisablehook)
    for name in ("absl", "", "asyncio"):
      logging.getLogger(name).addFilter(QUIET_ORBAX)
      for handler in logging.getLogger(name).handlers:
        handler.addFilter(QUIET_ORBAX)

  # --- writing -----------------------------------------------------------------------------
  def save(self, state: TrainState, meta: RunMeta) -> None:
    """Start writing `state` as step meta.step; returns once the arrays are copied to host."""
    if self._read_only:
      raise ValueError(f"{self.directory} was opened read-only (to export it): not saved")
    if int(state.step) != meta.step:
      raise ValueError(f"state is at step {int(state.step)} but the metadata says {meta.step}")
    state = state._replace(weights=None)  # the master's compute-dtype copy: written on restore
    # the checksums cover the frozen base even when it is not written: the restore checks the
    # base it reads again from its directory against them (run/frozen_base.py)
    sums, non_finite = state_checksums(state)
    if meta.base is not None and state.frozen is not None:
      meta = dataclasses.replace(meta, base={**meta.base, "dtype": frozen_dtype(state.frozen)})
      state = state._replace(frozen=None)
    if non_finite:
      self.wait()  # the previous save, if one is in flight, is what the run keeps
      kept = self.steps()
      raise NonFiniteStateError(
        f"the state of step {meta.step} holds NaN or Inf values in {len(non_finite)} of its "
        f"{len(sums)} arrays (first: {non_finite[0]}): not saved as a checkpoint in "
        f"{self.directory}; "
        + (
          f"its newest checkpoint, step {kept[-1]}, is kept: continue from it with --resume and "
          f"a lower --lr"
          if kept
          else f"no checkpoint was saved before it: the {meta.step} steps trained are lost; run "
          f"again with a lower --lr"
        )
      )
    meta = dataclasses.replace(meta, checksums=sums)
    args = ocp.args.Composite(
      **{STATE_ITEM: ocp.args.StandardSave(state), META_ITEM: ocp.args.JsonSave(meta.to_json())}
    )
    # A background save that failed raises here, at the start of the next one.
    with self._errors_as_checkpoint_error():
      self._manager.wait_until_finished()
      self._check_readable()  # before rotating: a save that cannot be read back replaces nothing
      self._saving = None  # the previous save is complete: an error from here on is this one's
      self._rotate()  # once the previous save is complete: it counts among the newest
      self._saving, self._arrays = meta.step, len(jax.tree.leaves(state))
      self._manager.save(meta.step, args=args, force=True)

  def writing(self) -> int | None:
    """The step being written in the background right now, if any."""
    if self._saving is None or not self._manager.is_saving_in_progress():
      return None
    return self._saving

  def protect(self, step: int) -> None:
    """Keep checkpoint `step` whatever `keep` says, until another step is protected."""
    self._protected = step

  def wait(self) -> None:
    """Block until the background save is complete (raises its error, if it failed)."""
    with self._errors_as_checkpoint_error():
      self._manager.wait_until_finished()
      self._check_readable()
    self._saving = None
    if not self._read_only:
      self._rotate()

  def _check_readable(self) -> None:
    """Raise a CheckpointError if the save just completed cannot be read back: its metadata
    must parse and its array index (the merged OCDBT manifest) must list every array. Process 0
    looks (its merge is the one that completed); the processes agree on its verdict."""
    step = self._saving
    if step is None:
      return
    problem = None
    if jax.process_index() == 0:
      problem = _unreadable(os.path.join(self.directory, str(step)), self._arrays)
    if jax.process_count() > 1:
      self._agreement = self._agreement or Agreement()
      if not self._agreement.all(problem is None):
        problem = problem or "process 0 could not read it back"
    if problem is not None:
      self._saving = None
      raise CheckpointError(
        errno.EIO,
        f"checkpoint {os.path.join(self.directory, str(step))} was written but cannot be read "
        f"back ({problem}); the older checkpoints are kept, and a resume will skip this one",
      )

  def _rotate(self) -> None:
    """Delete the complete checkpoints older than the newest `keep`, except the protected one."""
    steps = sorted(self._manager.all_steps())
    for step in steps[: max(0, len(steps) - self.keep)]:
      if step != self._protected:
        self._manager.delete(step)

  def close(self) -> None:
    self.wait()
    self._manager.close()

  def _errors_as_checkpoint_error(self):
    return ErrorsAsCheckpointError(self)

  # --- reading -----------------------------------------------------------------------------
  def steps(self) -> list[int]:
    """Complete checkpoints, oldest first (listed again when one vanished while listed)."""

    def listed():
      self._manager.reload()
      return sorted(self._manager.all_steps())

    return _relisted(listed)

  def set_aside(self, steps: list[int], why: str) -> str:
    """Rename step directories to `<why>-<step>` (no longer steps; process 0, the others wait),
    and say where they are."""
    names = []
    for step in steps:
      name, n = f"{why}-{step}", 1
      while os.path.exists(os.path.join(self.directory, name)):
        n += 1
        name = f"{why}-{step}-{n}"
      names.append(name)
      if jax.process_index() == 0 and os.path.exists(os.path.join(self.directory, str(step))):
        os.rename(os.path.join(self.directory, str(step)), os.path.join(self.directory, name))
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("paro-jax: damaged checkpoints set aside")
    self._manager.reload()
    return f" (the {why} ones are kept as {', '.join(names)} in {self.directory})"


def _unreadable(step_dir: str, arrays: int) -> str | None:
  """Why a complete save in `step_dir` could not be restored, or None: its metadata JSON must
  parse, and the index of its arrays (orbax's OCDBT database) must list each of them."""
  try:
    with open(os.path.join(step_dir, META_ITEM, "metadata")) as f:
      json.load(f)
    base = {"driver": "file", "path": os.path.join(step_dir, STATE_ITEM) + "/"}
    keys = ts.KvStore.open({"driver": "ocdbt", "base": base}).result().list().result()
  except Exception as e:  # noqa: BLE001 - any failure to read is the answer
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
  listed = sum(k.endswith((b"/.zarray", b"/zarr.json")) for k in keys)
  if listed != arrays:
    return f"its array index lists {listed} of its {arrays} arrays"
  return None


def _relisted(list_steps):
  """`list_steps()`, again when a step vanished while it was listed: orbax reads each step's
  files as it lists them, and a run still saving there rotates the older ones away (--keep).
  A step deleted between orbax's `exists()` and `is_dir()` of it is a NotADirectoryError."""
  for _ in range(LIST_TRIES - 1):
    try:
      return list_steps()
    except (FileNotFoundError, NotADirectoryError):
      time.sleep(0.1)
  return list_steps()
