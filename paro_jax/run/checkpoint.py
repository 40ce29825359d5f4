"""Checkpoints of a training run: orbax, asynchronous, atomic, in logical (unsharded) shapes.

A checkpoint is one step directory holding two items: `state` (the TrainState: step, fp32 master
weights and optimizer state) and `meta` (JSON: model config, strategy, mesh, dtype, seed, data
position). Orbax stores every jax.Array by its global shape, so a checkpoint does not depend on
the strategy or mesh that wrote it: restoring reads it straight into the shardings of whatever
engine resumes it (another strategy, another mesh, fewer devices).

Atomicity: orbax writes a step into `<step>.orbax-checkpoint-tmp*` and renames it only once every
item is complete; directories with that suffix are never listed as steps. A save killed halfway,
or one that runs out of disk, leaves the previous checkpoint as it was.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import warnings

import jax
import orbax.checkpoint as ocp

from paro_jax.core.engine import Engine, TrainState

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


def abstract_state(engine: Engine) -> TrainState:
  """The TrainState's shapes and dtypes with the engine's target shardings, for restoring."""
  shapes = jax.eval_shape(engine.state_from_params, engine.shapes)
  return jax.tree.map(
    lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
    shapes,
    engine.state_shardings,
  )


class Checkpointer:
  """Asynchronous, atomic checkpoints of a run in `directory`, keeping the newest `keep`."""

  def __init__(self, directory: str, keep: int = 3):
    if keep < 1:
      raise ValueError(f"keep must be >= 1 (checkpoints to keep), got {keep}")
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(
      max_to_keep=keep,
      create=True,
      enable_async_checkpointing=True,
      # Leftovers of saves that were killed halfway: never a step, removed on start.
      cleanup_tmp_directories=True,
    )
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=(STATE, META))
    self._saving: int | None = None  # the step being written in the background

  # --- writing -----------------------------------------------------------------------------
  def save(self, state: TrainState, meta: RunMeta) -> None:
    """Start writing `state` as step meta.step; returns once the arrays are copied to host."""
    if int(state.step) != meta.step:
      raise ValueError(f"state is at step {int(state.step)} but the metadata says {meta.step}")
    args = ocp.args.Composite(
      **{STATE: ocp.args.StandardSave(state), META: ocp.args.JsonSave(meta.to_json())}
    )
    # A background save that failed raises here, at the start of the next one.
    with self._errors_as_checkpoint_error():
      self._manager.save(meta.step, args=args, force=True)
      self._saving = meta.step

  def wait(self) -> None:
    """Block until the background save is complete (raises its error, if it failed)."""
    with self._errors_as_checkpoint_error():
      self._manager.wait_until_finished()
    self._saving = None

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

  def restore(self, engine: Engine, model_name: str | None = None) -> tuple[TrainState, RunMeta]:
    """The newest readable checkpoint, placed with `engine`'s shardings, and its metadata.

    A checkpoint for another model config is an error. One that cannot be read (a truncated or
    garbled file) is skipped with a warning, falling back to the previous step.
    """
    steps = self.steps()
    if not steps:
      raise FileNotFoundError(
        f"no checkpoint in {self.directory} to resume from: start the run "
        f"without --resume first (it saves checkpoints there)"
      )
    target = abstract_state(engine)
    failures = []
    for step in reversed(steps):
      try:
        meta = self.read_meta(step)
      except Exception as e:  # noqa: BLE001 - any failure to read is a corrupt checkpoint
        failures.append((step, e))
        continue
      check_model(meta, engine, model_name, os.path.join(self.directory, str(step)))
      try:
        restored = self._manager.restore(
          step, args=ocp.args.Composite(**{STATE: ocp.args.StandardRestore(target)})
        )
      except Exception as e:  # noqa: BLE001
        failures.append((step, e))
        continue
      if failures:
        warnings.warn(
          f"{_describe(failures)}; falling back to step {step}, the newest readable checkpoint",
          stacklevel=2,
        )
      return restored[STATE], meta
    raise ValueError(
      f"no readable checkpoint in {self.directory}: {_describe(failures)}. "
      f"Delete the damaged step directories or start a new run with another --out"
    )


class _ErrorsAsCheckpointError:
  """Turn an OSError from orbax's writer into a CheckpointError that says what and where."""

  def __init__(self, ckpt: Checkpointer):
    self.ckpt = ckpt

  def __enter__(self):
    return self

  def __exit__(self, kind, error, tb):
    if error is None or not isinstance(error, OSError) or isinstance(error, CheckpointError):
      return False
    step, self.ckpt._saving = self.ckpt._saving, None
    where = os.path.join(self.ckpt.directory, f"{step}" if step is not None else "")
    previous = [s for s in self.ckpt._manager.all_steps() if s != step]
    kept = (
      f"the previous checkpoint (step {max(previous)}) is intact"
      if previous
      else "no earlier checkpoint exists"
    )
    if error.errno == errno.ENOSPC:
      message = (
        f"the disk is full: could not write checkpoint {where} ({error}); {kept}. Free "
        f"space on the disk holding {self.ckpt.directory} or pass another --out"
      )
    else:
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
  if meta.model_config == mine:
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


def _model_flag(model_name: str) -> str:
  """The train flag that rebuilds a recorded model: a preset, or HF weights (`hf:DIR`)."""
  return (
    f"--init-from {model_name[3:]}" if model_name.startswith("hf:") else f"--model {model_name}"
  )


def _describe(failures) -> str:
  return "; ".join(
    f"checkpoint step {step} is unreadable ({type(e).__name__}: "
    f"{str(e).splitlines()[0][:200] if str(e) else ''})"
    for step, e in failures
  )
