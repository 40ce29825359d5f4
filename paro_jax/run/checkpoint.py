"""Checkpoints of a training run: orbax, asynchronous, atomic, in logical (unsharded) shapes.

A checkpoint is one step directory holding two items: `state` (the TrainState: step, fp32 master
weights and optimizer state) and `meta` (JSON: model config, strategy, mesh, dtype, seed, data
position). Orbax stores every jax.Array by its global shape, so a checkpoint does not depend on
the strategy or mesh that wrote it: restoring reads it straight into the shardings of whatever
engine resumes it (another strategy, another mesh, fewer devices).

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
import warnings

import jax
import orbax.checkpoint as ocp
import tensorstore as ts
from jax.experimental import multihost_utils

from paro_jax.cluster.agree import Agreement, agreed_steps, local_verdict
from paro_jax.core.state import TrainState
from paro_jax.core.engine import Engine
from paro_jax.run.checkpoint_content import (
  NonFiniteStateError,
  RunMeta,
  abstract_state,
  cast_like,
  check_model,
  reference_target,
  residual_target,
  restart_reference,
  restart_residual,
  saved_field,
  state_checksums,
  stored_like,
  verify,
)
from paro_jax.run.checkpoint_errors import (
  QUIET_ORBAX,
  CheckpointError,
  ErrorsAsCheckpointError,
  describe_failures,
  quiet_closed_loop,
  rotated_steps,
)
from paro_jax.run.config import refuse_unsafe_path

# The two items of a checkpoint step (orbax): the arrays and the RunMeta beside them.
STATE_ITEM, META_ITEM = "state", "meta"
CHECKPOINTS = "checkpoints"  # the checkpoint directory inside a run directory (--out)
# How long a reader keeps listing the steps again after one was superseded while it read it: a
# run still saving there (--keep) rotates each checkpoint away once the next one is complete, and
# a reader slower than its saves may lose several in a row.
RELIST_SECONDS = 300.0


class Checkpointer:
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
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
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
    sums, non_finite = state_checksums(state)
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
      self._saving, self._arrays = meta.step, len(sums)
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
    """Complete checkpoints, oldest first."""
    self._manager.reload()
    return sorted(self._manager.all_steps())

  def newest_meta(self) -> RunMeta:
    """The metadata of the newest checkpoint whose metadata reads. A step deleted while it is
    read (rotated away by a run still saving there) is not damaged: the steps are listed again
    and the newer one read."""
    failed: dict[int, Exception] = {}
    deadline = time.monotonic() + RELIST_SECONDS
    while time.monotonic() < deadline:
      steps = [s for s in self.steps() if s not in failed]
      relist = False
      for step in reversed(steps):
        try:
          return self.read_meta(step)
        except Exception as e:  # noqa: BLE001 - any failure to read: the step is skipped
          failed[step] = e
          if self._gone(step, failed):
            relist = True
            break
      if not relist:
        break
    raise FileNotFoundError(
      f"no checkpoint in {self.directory} has readable metadata"
      + (f" ({describe_failures(sorted(failed.items()))})" if failed else "")
    )

  def _gone(self, step: int, tried) -> bool:
    """Whether step `step`, which failed to read, was superseded while it was read: it is no
    longer there (set aside by the run writing), or a newer step not `tried` yet is complete now
    (a run still saving there rotates the older ones away, --keep: their files vanish as they
    are read)."""
    if not os.path.isdir(os.path.join(self.directory, str(step))):
      return True
    return any(s > step and s not in tried for s in self.steps())

  def read_meta(self, step: int) -> RunMeta:
    restored = self._manager.restore(
      step, args=ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()})
    )
    return RunMeta.from_json(restored[META_ITEM])

  def restore(
    self, engine: Engine, model_name: str | None = None, set_aside: bool = False
  ) -> tuple[TrainState, RunMeta]:
    """The newest intact checkpoint, placed with `engine`'s shardings, and its metadata.

    A checkpoint for another model config is an error. One that cannot be read or whose arrays
    do not match their checksums (a truncated or garbled file) is skipped with a warning, falling
    back to the previous step; with `set_aside` the damaged steps are then renamed to
    `damaged-<step>` (no longer steps), so that training can save those steps again.
    """
    # With several processes, each step is taken or skipped by all of them together
    # (paro_jax/cluster/agree.py): one may fail to read a step that another can.
    agreement = Agreement()
    steps = self.steps()
    if not agreement.max(len(steps)):
      raise FileNotFoundError(
        f"no checkpoint in {self.directory} to resume from: start the run "
        f"without --resume first (it saves checkpoints there)"
      )
    target = abstract_state(engine)
    to_target = jax.jit(
      cast_like(target), out_shardings=engine.state_shardings._replace(weights=None)
    )
    failures, gone = [], []  # (step, error) of the damaged ones; the steps deleted while read
    deadline = time.monotonic() + RELIST_SECONDS
    while True:
      found = self._restore_newest(steps, agreement, engine, model_name, target, failures, gone)
      if found is not None:
        step, restored, meta = found
        restored = engine.with_weights(to_target(restored))
        if failures:
          moved = self.set_aside([s for s, _ in failures], "damaged") if set_aside else ""
          warnings.warn(
            f"{describe_failures(failures)}; falling back to step {step}, the newest intact "
            f"checkpoint{moved}",
            stacklevel=2,
          )
        return restored, meta
      # A step deleted while it was read (rotated away by a run still saving there, --keep):
      # the steps are listed again, the newer ones first; a damaged one is not tried again.
      tried = {s for s, _ in failures} | set(gone)
      steps = [s for s in self.steps() if s not in tried]
      if not agreement.all(bool(gone) and time.monotonic() < deadline):
        break
      if not agreement.max(len(steps)):
        break
    if gone:
      raise ValueError(
        f"no intact checkpoint in {self.directory} could be read: {rotated_steps(gone)} rotated "
        f"away while being read (a run still saving there deletes its older checkpoints, "
        f"--keep)"
        + (f"; {describe_failures(failures)}" if failures else "")
        + ". Nothing was changed there: run the same command again (or once that run has "
        "saved its next checkpoint or finished)"
      )
    raise ValueError(
      f"no intact checkpoint in {self.directory}: {describe_failures(failures)}. Nothing was "
      f"changed there: restore its files from a copy, or start a new run with another --out"
    )

  def _restore_newest(self, steps, agreement, engine, model_name, target, failures, gone):
    """(step, state as written, its metadata) of the newest of `steps` that reads and verifies;
    None when none does, or when a step was deleted while it was read (added to `gone`: list
    the steps again). Damaged steps are added to `failures`."""
    for step, listed in agreed_steps(steps, agreement):
      error = FileNotFoundError("not listed on this process")
      if listed:
        error = local_verdict(os.path.join(self.directory, str(step)), META_ITEM)
      if not agreement.all(error is None):
        if agreement.all(self._gone(step, {s for s, _ in failures} | set(gone))):
          gone.append(step)
          return None
        failures.append((step, error or _UnreadableElsewhere()))
        continue
      try:
        meta = self.read_meta(step)
      except Exception as e:  # noqa: BLE001 - any failure to read is a corrupt checkpoint
        if agreement.all(self._gone(step, {s for s, _ in failures} | set(gone))):
          gone.append(step)
          return None
        failures.append((step, e))
        continue
      check_model(meta, engine, model_name, os.path.join(self.directory, str(step)))
      try:
        written = self._manager.item_metadata(step)[STATE_ITEM]  # shapes and dtypes as saved
        step_target, carried = residual_target(
          target, meta, engine, saved_field(written, "residual")
        )
        step_target, reference = reference_target(
          step_target, saved_field(written, "reference") is not None
        )
        # Read every array as it was written (a bf16 run's frozen LoRA base in bf16, even
        # when an fp32 engine reads it): the checksums are of the written bits. Only a verified
        # state is then converted to this engine's dtypes.
        stored = stored_like(written, step_target)
        restored = self._manager.restore(
          step, args=ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(stored)})
        )[STATE_ITEM]
        verify(restored, meta)  # the checksums are global: the same verdict on every process
      except Exception as e:  # noqa: BLE001
        if agreement.all(self._gone(step, {s for s, _ in failures} | set(gone))):
          gone.append(step)
          return None
        failures.append((step, e))
        continue
      if not carried:
        restored = restart_residual(restored, engine, meta)
      if reference is not None:
        restored = restart_reference(restored, engine, meta, reference)
      return step, restored, meta
    return None

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


class _UnreadableElsewhere(OSError):
  """A step this process read but another process could not."""

  def __init__(self):
    super().__init__("unreadable on another process of the run")
