"""Reading a run's checkpoints back: the newest intact step, placed with an engine's shardings
(whole, or its weights alone), its metadata; a step rotated away while it is read (a run still
saving there, --keep) makes the reader list the steps again, a damaged one is skipped. Mixed into
run/checkpoint.py's Checkpointer, which writes them."""

from __future__ import annotations

import os
import time
import warnings

import orbax.checkpoint as ocp

from paro_jax.cluster.agree import Agreement, agreed_steps, local_verdict
from paro_jax.core.engine import Engine
from paro_jax.core.state import TrainState
from paro_jax.run.checkpoint_content import (
  OuterMismatch,
  RunMeta,
  abstract_state,
  cast_like,
  check_model,
  outer_target,
  reference_target,
  residual_target,
  restart_reference,
  restart_residual,
  saved_field,
  stored_like,
  verify,
)
from paro_jax.run.checkpoint_errors import describe_failures, rotated_steps
from paro_jax.run.frozen_base import BaseChanged, check_base, reimport_base

# The two items of a checkpoint step (orbax): the arrays and the RunMeta beside them.
STATE_ITEM, META_ITEM = "state", "meta"
# How long a reader keeps listing the steps again after one was superseded while it read it: a
# run still saving there (--keep) rotates each checkpoint away once the next one is complete, and
# a reader slower than its saves may lose several in a row.
RELIST_SECONDS = 300.0


class Restorer:
  """The reading half of the Checkpointer (it holds `directory`, `_manager`, `steps()` and
  `set_aside()`)."""

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
    self,
    engine: Engine,
    model_name: str | None = None,
    set_aside: bool = False,
    weights_only: bool = False,
    frozen: bool = True,
  ) -> tuple[TrainState, RunMeta]:
    """The newest intact checkpoint, placed with `engine`'s shardings, and its metadata.
    `weights_only`: only its weights are read (the master and a LoRA run's frozen base, as
    saved, at their placements; the other fields None): nothing of the optimizer is read or
    allocated (eval); without `frozen`, the master alone (a LoRA run's adapters: export
    --adapter). A LoRA checkpoint without its frozen base reads the base again from the directory
    it records (run/frozen_base.py; BaseChanged if it is gone or changed).

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
    to_target = cast_like(target, engine.state_shardings._replace(weights=None))
    parts = None if not weights_only else ("master", "frozen") if frozen else ("master",)
    failures, gone = [], []  # (step, error) of the damaged ones; the steps deleted while read
    deadline = time.monotonic() + RELIST_SECONDS
    while True:
      found = self._restore_newest(
        steps, agreement, engine, model_name, target, failures, gone, parts
      )
      if found is not None:
        step, restored, meta, partial = found
        if not partial:  # a whole state: in the engine's dtypes, with its compute-dtype copy
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

  def _restore_newest(self, steps, agreement, engine, model_name, target, failures, gone, parts):
    """(step, state as written, its metadata, whether only its weights were read) of the newest
    of `steps` that reads and verifies; None when none does, or when a step was deleted while it
    was read (added to `gone`: list the steps again). Damaged steps are added to `failures`."""
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
      where = os.path.join(self.directory, str(step))
      check_model(meta, engine, model_name, where)
      try:
        written = self._manager.item_metadata(step)[STATE_ITEM]  # shapes and dtypes as saved
        # a LoRA checkpoint without its frozen base: the base is read again from its directory
        base_less = meta.base is not None and saved_field(written, "frozen") is None
        held = target._replace(frozen=None) if base_less else target  # what the step holds
        step_target, carried = residual_target(held, meta, engine, saved_field(written, "residual"))
        step_target, reference = reference_target(
          step_target, saved_field(written, "reference") is not None
        )
        step_target, from_outer = outer_target(step_target, written, engine, meta)
        # Read every array as it was written (a bf16 run's frozen LoRA base in bf16, even
        # when an fp32 engine reads it): the checksums are of the written bits. Only a verified
        # state is then converted to this engine's dtypes.
        partial = parts is not None and from_outer is None  # an outer loop's: read whole
        if partial:
          restored = self._read_weights(step, written, held, parts)
        else:
          stored = stored_like(written, step_target)
          restored = self._manager.restore(
            step, args=ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(stored)})
          )[STATE_ITEM]
        # the checksums are global: the same verdict on every process
        verify(restored, meta, partial=partial or base_less)
      except OuterMismatch:
        raise
      except Exception as e:  # noqa: BLE001
        if agreement.all(self._gone(step, {s for s, _ in failures} | set(gone))):
          gone.append(step)
          return None
        failures.append((step, e))
        continue
      # A base gone or changed is refused (BaseChanged), never skipped: an older step has the
      # same base. Export --adapter reads no base at all.
      if base_less and (parts is None or "frozen" in parts):
        restored = restored._replace(frozen=self._reimport(meta, engine, where, agreement))
      if from_outer is not None:  # the outer weights of the outer loop's checkpoint
        restored = from_outer(restored)
      if not partial:
        if not carried:
          restored = restart_residual(restored, engine, meta)
        if reference is not None:
          restored = restart_reference(restored, engine, meta, reference)
      return step, restored, meta, partial
    return None

  @staticmethod
  def _reimport(meta: RunMeta, engine: Engine, where: str, agreement: Agreement):
    """The frozen base of checkpoint `where`, read again from the directory it records; its
    fingerprint is checked on every process, and all of them refuse it if one does."""
    try:
      check_base(meta.base, where)
      problem = None
    except BaseChanged as e:
      problem = e
    if not agreement.all(problem is None):
      raise problem or BaseChanged(
        f"checkpoint {where} holds no frozen base: it is read from {meta.base['directory']}, "
        f"which another process of the run finds gone or changed; restore the base it was "
        f"trained on there on every node, or train with --keep-base"
      )
    return reimport_base(meta.base, engine, engine.state_shardings.frozen, meta.checksums, where)

  def _read_weights(self, step: int, written, target: TrainState, parts) -> TrainState:
    """The `parts` ("master", "frozen") of step `step`'s state alone (orbax's partial restore),
    in the dtypes written, at `target`'s shardings; the others None (and a frozen base the
    checkpoint does not hold: `target.frozen` None)."""
    part = {name: getattr(target, name) for name in parts if getattr(target, name) is not None}
    stored = stored_like(written, part)
    args = ocp.args.PyTreeRestore(
      item=stored,
      restore_args=ocp.checkpoint_utils.construct_restore_args(stored),
      partial_restore=True,
    )
    path = os.path.join(self.directory, str(step), STATE_ITEM)
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as reader:
      read = reader.restore(path, args=args)
    return TrainState(None, read["master"], None, read.get("frozen"))


class _UnreadableElsewhere(OSError):
  """A step this process read but another process could not."""

  def __init__(self):
    super().__init__("unreadable on another process of the run")
