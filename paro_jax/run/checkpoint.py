"""Checkpoints of a training run: orbax, asynchronous, atomic, in logical (unsharded) shapes.

A checkpoint is one step directory holding two items: `state` (the TrainState: step, fp32 master
weights and optimizer state) and `meta` (JSON: model config, strategy, mesh, dtype, seed, data
position). Orbax stores every jax.Array by its global shape, so a checkpoint does not depend on
the strategy or mesh that wrote it: restoring reads it straight into the shardings of whatever
engine resumes it (another strategy, another mesh, fewer devices).

Atomicity: orbax writes a step into `<step>.orbax-checkpoint-tmp*` and renames it only once every
item is complete; directories with that suffix are never listed as steps. A save killed halfway,
or one that runs out of disk, leaves the previous checkpoint as it was.

Integrity: `meta` records two 32-bit checksums of every array of the state (computed on the
devices from the arrays' bits and logical positions, so independent of sharding), and a save
refuses a state with non-finite values. A restore recomputes the checksums: a checkpoint whose
files were truncated or garbled is never loaded. Training falls back to the newest intact step and
moves the damaged newer ones aside (`damaged-<step>`), so the run saves those steps again normally.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import sys
import warnings

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import tensorstore as ts
from jax import lax
from jax.experimental import multihost_utils

from models.config import LlamaConfig
from paro_jax.cluster.agree import Agreement, agreed_steps, local_verdict
from paro_jax.core.engine import Engine, TrainState
from paro_jax.run.config import refuse_unsafe_path

STATE, META = "state", "meta"
CHECKPOINTS = "checkpoints"  # the checkpoint directory inside a run directory (--out)
FORMAT = 1


@dataclasses.dataclass(frozen=True)
class RunMeta:
  """What a checkpoint records besides the arrays; `step` is also the data position."""

  step: int
  seed: int
  model_name: str
  model_config: dict  # dataclasses.asdict(LlamaConfig)
  strategy: str
  mesh: tuple[int, int]  # (inter, intra)
  dtype: str
  data: dict  # what batch `step` is a function of, besides (seed, step)
  format: int = FORMAT
  lora: dict | None = None  # dataclasses.asdict(LoraConfig) of a LoRA run
  checksums: dict | None = None  # leaf path -> [h1, h2] (state_checksums); set by save
  train: dict | None = None  # what the learning-rate schedule depends on: steps, lr, warmup

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, d: dict) -> "RunMeta":
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names
    if unknown:
      raise ValueError(f"checkpoint metadata has unknown keys {sorted(unknown)}")
    return cls(**{**d, "mesh": tuple(d["mesh"])})


class CheckpointError(OSError):
  """A checkpoint could not be written; the previous one is intact."""

  def __str__(self) -> str:
    return self.strerror or super().__str__()


class NonFiniteStateError(ValueError):
  """A state holding NaN or Inf: never saved, never exported."""


def _leaf_checksum(x: jax.Array) -> jax.Array:
  """Two wrapping 32-bit sums of the bits of `x`, weighted by logical position: any change of
  one element changes the first; the order of summation (the sharding) changes neither."""
  bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
  words = lax.bitcast_convert_type(x, bits).astype(jnp.uint32)
  index, stride = jnp.zeros(words.shape, jnp.uint32), 1
  for d in reversed(range(words.ndim)):  # the flat position, without a (sharded) reshape
    index = index + lax.broadcasted_iota(jnp.uint32, words.shape, d) * jnp.uint32(stride % 2**32)
    stride *= words.shape[d]
  h1 = jnp.sum(words * (index * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32)
  mixed = (words ^ (words >> jnp.uint32(15))) * jnp.uint32(0x2C1B3C6D)
  h2 = jnp.sum(mixed ^ (index * jnp.uint32(0x9E3779B1)), dtype=jnp.uint32)
  return jnp.stack([h1, h2])


@jax.jit
def _integrity(state):
  """(checksum of every leaf, whether every floating-point leaf is finite)."""
  sums = jax.tree.map(_leaf_checksum, state)
  finite = [
    jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.inexact)
  ]
  return sums, jnp.all(jnp.stack(finite)) if finite else jnp.bool_(True)


def state_checksums(state) -> tuple[dict, bool]:
  """{leaf path: [h1, h2]} of a state's arrays, and whether all its floats are finite."""
  sums, finite = _integrity(state)
  paths = jax.tree_util.tree_leaves_with_path(jax.device_get(sums))
  return {jax.tree_util.keystr(p): [int(v) for v in h] for p, h in paths}, bool(finite)


def abstract_state(engine: Engine) -> TrainState:
  """The TrainState's shapes and dtypes with the engine's target shardings, for restoring."""
  shapes = jax.eval_shape(engine.state_from_params, engine.shapes)
  return jax.tree.map(
    lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
    shapes,
    engine.state_shardings,
  )


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
    handlers = {STATE: ocp.StandardCheckpointHandler(), META: ocp.JsonCheckpointHandler()}
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
      sys.unraisablehook = _quiet_closed_loop(sys.unraisablehook)
    for name in ("absl", "", "asyncio"):
      logging.getLogger(name).addFilter(_QUIET)
      for handler in logging.getLogger(name).handlers:
        handler.addFilter(_QUIET)

  # --- writing -----------------------------------------------------------------------------
  def save(self, state: TrainState, meta: RunMeta) -> None:
    """Start writing `state` as step meta.step; returns once the arrays are copied to host."""
    if self._read_only:
      raise ValueError(f"{self.directory} was opened read-only (to export it): not saved")
    if int(state.step) != meta.step:
      raise ValueError(f"state is at step {int(state.step)} but the metadata says {meta.step}")
    sums, finite = state_checksums(state)
    if not finite:
      raise NonFiniteStateError(
        f"the weights or optimizer state of step {meta.step} hold NaN or Inf values: not saved "
        f"as a checkpoint in {self.directory} (its newest checkpoint is kept). Lower --lr"
      )
    meta = dataclasses.replace(meta, checksums=sums)
    args = ocp.args.Composite(
      **{STATE: ocp.args.StandardSave(state), META: ocp.args.JsonSave(meta.to_json())}
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
    return _ErrorsAsCheckpointError(self)

  # --- reading -----------------------------------------------------------------------------
  def steps(self) -> list[int]:
    """Complete checkpoints, oldest first."""
    self._manager.reload()
    return sorted(self._manager.all_steps())

  def read_meta(self, step: int) -> RunMeta:
    restored = self._manager.restore(
      step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()})
    )
    return RunMeta.from_json(restored[META])

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
    to_target = jax.jit(_cast_like(target), out_shardings=engine.state_shardings)
    failures = []
    for step, listed in agreed_steps(steps, agreement):
      error = FileNotFoundError("not listed on this process")
      if listed:
        error = local_verdict(os.path.join(self.directory, str(step)), META)
      if not agreement.all(error is None):
        failures.append((step, error or _UnreadableElsewhere()))
        continue
      try:
        meta = self.read_meta(step)
      except Exception as e:  # noqa: BLE001 - any failure to read is a corrupt checkpoint
        failures.append((step, e))
        continue
      check_model(meta, engine, model_name, os.path.join(self.directory, str(step)))
      try:
        written = self._manager.item_metadata(step)[STATE]  # shapes and dtypes as saved
        step_target, carried = _residual_target(target, meta, engine, _saved(written, "residual"))
        step_target, reference = _reference_target(
          step_target, _saved(written, "reference") is not None
        )
        # Read every array as it was written (a bf16 run's frozen LoRA base in bf16, even
        # when an fp32 engine reads it): the checksums are of the written bits. Only a verified
        # state is then converted to this engine's dtypes.
        stored = _stored_like(written, step_target)
        restored = self._manager.restore(
          step, args=ocp.args.Composite(**{STATE: ocp.args.StandardRestore(stored)})
        )[STATE]
        _verify(restored, meta)  # the checksums are global: the same verdict on every process
      except Exception as e:  # noqa: BLE001
        failures.append((step, e))
        continue
      if not carried:
        restored = _restart_residual(restored, engine, meta)
      if reference is not None:
        restored = _restart_reference(restored, engine, meta, reference)
      restored = to_target(restored)
      if failures:
        moved = self.set_aside([s for s, _ in failures], "damaged") if set_aside else ""
        warnings.warn(
          f"{_describe(failures)}; falling back to step {step}, the newest intact "
          f"checkpoint{moved}",
          stacklevel=2,
        )
      return restored, meta
    raise ValueError(
      f"no intact checkpoint in {self.directory}: {_describe(failures)}. Nothing was "
      f"changed there: restore its files from a copy, or start a new run with another --out"
    )

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
    with open(os.path.join(step_dir, META, "metadata")) as f:
      json.load(f)
    base = {"driver": "file", "path": os.path.join(step_dir, STATE) + "/"}
    keys = ts.KvStore.open({"driver": "ocdbt", "base": base}).result().list().result()
  except Exception as e:  # noqa: BLE001 - any failure to read is the answer
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
  listed = sum(k.endswith((b"/.zarray", b"/zarr.json")) for k in keys)
  if listed != arrays:
    return f"its array index lists {listed} of its {arrays} arrays"
  return None


def _saved(written, field: str):
  """The metadata of the TrainState field `field` as a step saved it, or None if it saved none."""
  return written[field] if field in written else None


def _stored_like(written, target: TrainState) -> TrainState:
  """`target` (shapes and shardings) with the dtypes of `written` (a step's saved metadata)."""
  dtypes = {_names(p): m.dtype for p, m in jax.tree_util.tree_leaves_with_path(written)}
  missing = [
    jax.tree_util.keystr(p)
    for p, _ in jax.tree_util.tree_leaves_with_path(target)
    if _names(p) not in dtypes
  ]
  if missing:
    raise ValueError(f"{len(missing)} arrays are missing (first: {missing[0]})")
  return jax.tree_util.tree_map_with_path(
    lambda p, s: jax.ShapeDtypeStruct(s.shape, dtypes[_names(p)], sharding=s.sharding), target
  )


def _names(path) -> tuple:
  """A leaf's path as plain names and indices: orbax's metadata tree spells the TrainState's
  fields and optax's named tuples as dict keys."""
  return tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", None))) for k in path)


def _cast_like(target):
  """A function converting a state (as written) to the dtypes of `target`; bf16 to fp32 is
  exact, so resume and export see the same values whichever dtype they run in."""

  def cast(state):
    return jax.tree.map(lambda x, t: x.astype(t.dtype), state, target)

  return cast


def _residual_target(target: TrainState, meta: RunMeta, engine: Engine, saved):
  """(what to read, whether the error-feedback residual carries over). The residual is each
  device's own (core/feedback.py): laid out by strategy and mesh, it carries over only to the
  same strategy on the same mesh; otherwise it is read as saved (or not at all) and restarts."""
  want = target.residual
  same = meta.strategy == engine.strategy.name and tuple(meta.mesh) == (engine.inter, engine.intra)
  if saved is None or want is None or not same or tuple(saved.shape) != tuple(want.shape):
    if saved is None:
      return target._replace(residual=None), want is None
    replicated = jax.sharding.NamedSharding(engine.mesh, jax.sharding.PartitionSpec())
    read = jax.ShapeDtypeStruct(tuple(saved.shape), jnp.float32, sharding=replicated)
    return target._replace(residual=read), False
  return target, True


def _restart_residual(state: TrainState, engine: Engine, meta: RunMeta) -> TrainState:
  """The state with the engine's fresh residual (zeros, or none), said in one line."""
  fresh = None
  if engine.error_feedback:
    sharding = engine.state_shardings.residual
    fresh = jax.device_put(jnp.zeros(engine.inter * engine.intra * engine.residual_size), sharding)
  if state.residual is None:
    what = f"step {meta.step}'s checkpoint has no error-feedback residual: this run's starts at 0"
  else:
    what = (
      f"the error-feedback residual of step {meta.step}'s checkpoint ({meta.strategy} on "
      f"{meta.mesh[0]}x{meta.mesh[1]}) does not carry over to {engine.strategy.name} on "
      f"{engine.inter}x{engine.intra} with error feedback {engine.feedback_note}: "
      f"{'it restarts at 0' if fresh is not None else 'dropped'} (one step's rounding error)"
    )
  warnings.warn(what, stacklevel=3)
  return state._replace(residual=fresh)


def _reference_target(target: TrainState, saved: bool):
  """(what to read, what to do with the delta parameter sync's reference after the checks). The
  reference is the weights every device received at the last sync (core/feedback.py): a run
  with the delta sync resumed from a step saved without it starts one from the restored weights
  ("start"); a run without it drops a saved one ("drop"), which is still read, so that the step's
  checksums cover what was written."""
  if saved and target.reference is None:
    return target._replace(reference=target.master), "drop"  # the master's shapes and shardings
  if not saved and target.reference is not None:
    return target._replace(reference=None), "start"
  return target, None


def _restart_reference(state: TrainState, engine: Engine, meta: RunMeta, what: str) -> TrainState:
  if what == "drop":
    return state._replace(reference=None)
  warnings.warn(
    f"step {meta.step}'s checkpoint has no reference of the delta parameter sync: this run's "
    f"starts from the restored weights",
    stacklevel=3,
  )
  weights = jax.tree.map(lambda w: w.astype(engine.compute_dtype), state.master)
  return state._replace(reference=weights)


def _verify(state: TrainState, meta: RunMeta) -> None:
  """Raise if the restored arrays are not those that were saved (or hold NaN/Inf)."""
  sums, finite = state_checksums(state)
  if meta.checksums is not None:
    bad = [k for k in meta.checksums if sums.get(k) != meta.checksums[k]]
    if bad or set(sums) != set(meta.checksums):
      raise ValueError(
        f"checksum mismatch in {len(bad)} of {len(meta.checksums)} arrays (first: "
        f"{(bad or sorted(set(sums) ^ set(meta.checksums)))[0]}): its files are damaged"
      )
  if not finite:
    raise NonFiniteStateError("it holds NaN or Inf values")


def _no_space(error: BaseException) -> bool:
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
      return not _no_space(record.exc_info[1] if record.exc_info else None)
    if "orbax" not in record.pathname or record.levelno < logging.ERROR:
      return True
    if _no_space(record.exc_info[1] if record.exc_info else None) or "No space left" in str(
      record.msg
    ):
      return False
    record.exc_info, record.exc_text = None, None
    return True


_QUIET = _QuietOrbaxErrors()


def _quiet_closed_loop(hook):
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


class _ErrorsAsCheckpointError:
  """Turn a failed write (an OSError, or orbax's ValueError for a full disk) into a
  CheckpointError that says what and where."""

  def __init__(self, ckpt: Checkpointer):
    self.ckpt = ckpt

  def __enter__(self):
    return self

  def __exit__(self, kind, error, tb):
    if error is None or isinstance(error, CheckpointError):
      return False
    full = _no_space(error)
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


def check_model(meta: RunMeta, engine: Engine, model_name: str | None, where: str) -> None:
  """A checkpoint for another model is refused, naming both configs and the fix."""
  mine = dataclasses.asdict(engine.model.cfg)
  lora = dataclasses.asdict(engine.model.lora) if engine.model.lora else None
  same = lambda d: None if d is None else {**d, "targets": tuple(d["targets"])}  # JSON: a list
  if same(meta.lora) != same(lora):

    def flags(d):
      return (
        "no LoRA flags"
        if d is None
        else f"--lora-rank {d['rank']} --lora-alpha {d['alpha']} "
        f"--lora-targets {','.join(d['targets'])}"
      )

    raise ValueError(
      f"checkpoint {where} was written with {flags(meta.lora)}, this run has "
      f"{flags(lora)}: resume with the checkpoint's LoRA flags, or start a new run "
      f"with another --out"
    )
  if _read_config(meta.model_config) == engine.model.cfg:
    return
  differ = ", ".join(
    f"{k}: {meta.model_config.get(k)} vs {mine.get(k)}"
    for k in sorted(set(mine) | set(meta.model_config))
    if meta.model_config.get(k) != mine.get(k)
  )
  raise ValueError(
    f"checkpoint {where} is for model {meta.model_name!r} {meta.model_config}, but this run "
    f"builds model {model_name!r} {mine} (checkpoint vs run: {differ}). Resume with "
    f"{_model_flag(meta.model_name)}, or start a new run with another --out"
  )


def _read_config(recorded: dict) -> LlamaConfig | None:
  """The recorded model config; a field added since it was written takes its default (None: a
  config this version cannot read)."""
  try:
    return LlamaConfig(**recorded)
  except (TypeError, ValueError):
    return None


def _model_flag(model_name: str) -> str:
  """The train flag that rebuilds a recorded model: a preset, or HF weights (`hf:DIR`)."""
  return (
    f"--init-from {model_name[3:]}" if model_name.startswith("hf:") else f"--model {model_name}"
  )


class _UnreadableElsewhere(OSError):
  """A step this process read but another process could not."""

  def __init__(self):
    super().__init__("unreadable on another process of the run")


def _describe(failures) -> str:
  return "; ".join(
    f"checkpoint step {step} is damaged ({type(e).__name__}: "
    f"{str(e).splitlines()[0][:200] if str(e) else ''})"
    for step, e in failures
  )
