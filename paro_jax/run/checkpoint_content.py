"""What a checkpoint holds besides the arrays (`RunMeta`; the checksums that verify the arrays
are run/checksums.py's), and how a saved state is read into an engine: the restore target
(shapes, shardings, dtypes as written), the int8 corrections' buffers that carry over or restart,
the check that the model is the run's. run/checkpoint.py's Checkpointer writes and reads with
these."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp

from models.config import LlamaConfig
from paro_jax.core.state import TrainState
from paro_jax.core.engine import Engine
from paro_jax.run.checksums import NonFiniteStateError, state_checksums

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
  data_files: dict | None = None  # the data by content (data/fingerprint.py); None before it
  # the HF config.json the model came from (--init-from's, or --model's): export keeps its fields
  source_config: dict | None = None
  # the chat template the run's chat records were rendered with (its text): eval renders with it,
  # export ships it; None for other data (and before it was recorded)
  chat_template: str | None = None
  # the special token that template ends an assistant's turn with (run/stops.py): export adds it
  # to generation_config.json's stops; None for other data (and before it was recorded)
  end_of_turn: int | None = None
  # a LoRA run's frozen base when the checkpoint does not hold it (run/frozen_base.py): its
  # directory, its weight files' fingerprint and the dtype it trained in; None: the checkpoint
  # holds its base (--keep-base, a random base, a checkpoint written before), or no LoRA
  base: dict | None = None
  # an --outer-sync run's outer loop: {"sync": H, "fragments": F, "delay": TAU, "mix": ALPHA,
  # "state": "G" or "I", "cut": "vocab"}; None without one, and before it was recorded (read as
  # F = 1, TAU = 0, the state at G, H unknown). "cut": the leaves outside the layer stack are cut
  # by vocabulary over the fragments (core/fragments.py); absent: written when the first fragment
  # held the whole embedding and the last the whole head
  outer: dict | None = None

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, d: dict) -> "RunMeta":
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names
    if unknown:
      raise ValueError(f"checkpoint metadata has unknown keys {sorted(unknown)}")
    return cls(**{**d, "mesh": tuple(d["mesh"])})


def abstract_state(engine: Engine) -> TrainState:
  """The TrainState's shapes and dtypes with the engine's target shardings, for restoring; no
  compute-dtype copy of the master (`weights`, not saved: `Engine.with_weights` writes it)."""
  shapes = jax.eval_shape(engine.state_from_params, engine.shapes)
  return jax.tree.map(
    lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
    shapes._replace(weights=None),
    engine.state_shardings._replace(weights=None),
  )


def saved_field(written, field: str):
  """The metadata of the TrainState field `field` as a step saved it, or None if it saved none."""
  return written[field] if field in written else None


def stored_like(written, target: TrainState) -> TrainState:
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


def cast_like(target, shardings):
  """A function converting a state (as written) to the dtypes of `target` at `shardings`; bf16
  to fp32 is exact, so resume and export see the same values whichever dtype they run in. A
  leaf already in its dtype and at its sharding is handed on as it is: through a program it
  would be copied (a LoRA run's frozen base, most of the state's bytes, twice at once)."""

  def cast(state):
    xs, treedef = jax.tree.flatten(state)
    dtypes = [t.dtype for t in treedef.flatten_up_to(target)]
    places = treedef.flatten_up_to(shardings)
    moved = [
      i
      for i, (x, d, s) in enumerate(zip(xs, dtypes, places))
      if x.dtype != d or not isinstance(x, jax.Array) or not x.sharding.is_equivalent_to(s, x.ndim)
    ]
    if moved:
      convert = jax.jit(
        lambda ys: [y.astype(dtypes[i]) for y, i in zip(ys, moved)],
        out_shardings=[places[i] for i in moved],
      )
      for i, y in zip(moved, convert([xs[i] for i in moved])):
        xs[i] = y
    return treedef.unflatten(xs)

  return cast


def residual_target(target: TrainState, meta: RunMeta, engine: Engine, saved):
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


def restart_residual(state: TrainState, engine: Engine, meta: RunMeta) -> TrainState:
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


def reference_target(target: TrainState, saved: bool):
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


def restart_reference(state: TrainState, engine: Engine, meta: RunMeta, what: str) -> TrainState:
  if what == "drop":
    return state._replace(reference=None)
  warnings.warn(
    f"step {meta.step}'s checkpoint has no reference of the delta parameter sync: this run's "
    f"starts from the restored weights",
    stacklevel=3,
  )
  weights = jax.tree.map(lambda w: w.astype(engine.compute_dtype), state.master)
  return state._replace(reference=weights)


class OuterMismatch(ValueError):
  """A checkpoint whose outer loop (core/outer.py) the engine cannot continue: one line."""


# The outer loop's options that fix which step each fragment syncs, and the flags that set them.
OUTER_SCHEDULE = {
  "sync": "--outer-sync",
  "fragments": "--outer-fragments",
  "delay": "--outer-delay",
}


def check_outer_schedule(meta: RunMeta, outer, where: str, residual: bool = False) -> None:
  """Refuse to continue the outer loop of checkpoint `where` on another schedule: the step count
  gives each fragment's position in its round (and which kept weights are in flight) only for
  the H, F and TAU it ran with. `outer`: the engine's OuterOptions. --outer-mix, --outer-lr and
  --outer-momentum hold no state: they may change (a changed mix is said in one line). Another
  --outer-state reshards the outer weights and momentum as they are read (said in one line),
  unless the checkpoint holds a pseudo-gradient residual (`residual`): its elements are laid
  out by the placement's collective, so that is refused in one line."""
  check_outer_state(meta, outer.state, where, residual)
  was = meta.outer or {"fragments": 1, "delay": 0}  # written before they were recorded
  changed = [k for k in OUTER_SCHEDULE if k in was and was[k] != getattr(outer, k)]
  flags = lambda values: " ".join(f"{OUTER_SCHEDULE[k]} {values[k]}" for k in changed)  # noqa: E731
  if changed:
    raise OuterMismatch(
      f"{where} was written with {flags(was)}, this run has "
      f"{flags({k: getattr(outer, k) for k in changed})}: each fragment's place in its round "
      f"would change mid-run; resume with {flags(was)} (or export it and start a new run with "
      f"--init-from)"
    )
  if was["fragments"] > 1 and "cut" not in was:
    check_fragment_cut(meta, where, residual)
  if "mix" in was and was["mix"] != outer.mix:
    warnings.warn(
      f"resuming with --outer-mix {outer.mix:g}, but step {meta.step}'s checkpoint was trained "
      f"with {was['mix']:g}: the restarts merge otherwise from step {meta.step} on",
      stacklevel=4,
    )


def check_fragment_cut(meta: RunMeta, where: str, residual: bool) -> None:
  """check_outer_schedule's word on a checkpoint written when the first fragment held the whole
  embedding and the last the whole head: each fragment's residual span is laid out by them."""
  if residual:
    raise OuterMismatch(
      f"{where} was written when the first fragment held the whole embedding and the last the "
      f"whole head (each fragment now holds its share of their vocabulary), and its "
      f"pseudo-gradient's error-feedback residual is laid out by the fragments it had: export it "
      f"and start a new run with --init-from"
    )
  warnings.warn(
    f"step {meta.step}'s checkpoint was trained with the whole embedding in the first fragment "
    f"and the whole head in the last: from here on each fragment syncs its share of their "
    f"vocabulary",
    stacklevel=5,
  )


def check_outer_state(meta: RunMeta, state: str, where: str, residual: bool) -> None:
  """check_outer_schedule's word on --outer-state (a checkpoint without it: G)."""
  was = (meta.outer or {}).get("state", "G")
  if was == state:
    return
  if residual:
    raise OuterMismatch(
      f"{where} was written with --outer-state {was}, this run has --outer-state {state}, and "
      f"its pseudo-gradient's error-feedback residual is laid out for the state at {was}: "
      f"resume with --outer-state {was}"
    )
  warnings.warn(
    f"step {meta.step}'s checkpoint holds the outer state at {was}: its outer weights and "
    f"momentum are read at {state} (--outer-state {state}) from here on",
    stacklevel=4,
  )


def outer_target(target: TrainState, written, engine: Engine, meta: RunMeta):
  """(what to read, None or the conversion of what was read to the engine's state). A checkpoint
  of the outer loop read by an engine without it (eval, export, a run without --outer-sync) is
  read whole, its groups' states replicated, and gives the engine its outer weights, with a
  fresh optimizer state (said in one line); the other way round, or with another number of
  groups or on another schedule (check_outer_schedule), it is refused (OuterMismatch)."""
  saved = saved_field(written, "outer") is not None
  if target.outer is not None:
    groups = jax.tree.leaves(saved_field(written, "master"))[0].shape[0] if saved else None
    where = f"step {meta.step}'s checkpoint ({meta.strategy} on {meta.mesh[0]}x{meta.mesh[1]})"
    if groups != engine.inter:
      raise OuterMismatch(
        f"{where} was written without --outer-sync: the outer loop cannot continue it; resume "
        f"it without --outer-sync (or export it and start a run with --init-from)"
        if not saved
        else f"{where} holds the states of {groups} groups and --mesh has {engine.inter}: "
        f"resume the outer loop on {groups} groups"
      )
    residual = saved_field(written["outer"], "residual") is not None
    check_outer_schedule(meta, engine.outer, where, residual)
    return target, None
  if not saved:
    return target, None
  from paro_jax.core import outer as outer_loop  # the outer loop's state, as GroupEngine holds it
  from paro_jax.core.config import OuterOptions

  groups = jax.tree.leaves(saved_field(written, "master"))[0].shape[0]
  replicated = jax.sharding.NamedSharding(engine.mesh, jax.sharding.PartitionSpec())
  stacked = lambda tree: jax.tree.map(  # noqa: E731
    lambda s: jax.ShapeDtypeStruct((groups, *s.shape), s.dtype, sharding=replicated), tree
  )
  residual = saved_field(written["outer"], "residual")
  pending = saved_field(written["outer"], "pending")  # --outer-delay's kept weights
  momentum = jax.eval_shape(outer_loop.outer_tx(OuterOptions()).init, target.master)
  read = target._replace(
    master=stacked(target.master),
    opt_state=stacked(target.opt_state),
    residual=None,
    reference=None,
    outer=outer_loop.OuterState(
      target.master,
      jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated), momentum),
      None
      if residual is None
      else jax.ShapeDtypeStruct(residual.shape, jnp.float32, sharding=replicated),
      None if pending is None else stacked(target.master),
    ),
  )

  def convert(state: TrainState) -> TrainState:
    warnings.warn(
      f"step {meta.step}'s checkpoint holds the outer loop's state (--outer-sync): its outer "
      f"weights are read; the groups' own weights and optimizer states are not (resume with "
      f"--outer-sync to continue it exactly)",
      stacklevel=3,
    )
    master = state.outer.params
    return TrainState(
      state.step,
      master,
      engine.tx.init(master),
      state.frozen,
    )

  return read, convert


def verify(state: TrainState, meta: RunMeta, partial: bool = False) -> None:
  """Raise if the restored arrays are not those that were saved (or hold NaN/Inf); `partial`:
  `state` holds some of them (the others None), each checked against its own checksum."""
  sums, non_finite = state_checksums(state)
  if meta.checksums is not None:
    bad = [k for k in (sums if partial else meta.checksums) if sums.get(k) != meta.checksums.get(k)]
    if bad or (set(sums) != set(meta.checksums) and not partial):
      raise ValueError(
        f"checksum mismatch in {len(bad)} of {len(meta.checksums)} arrays (first: "
        f"{(bad or sorted(set(sums) ^ set(meta.checksums)))[0]}): its files are damaged"
      )
  if non_finite:
    raise NonFiniteStateError(f"it holds NaN or Inf values (in {non_finite[0]})")


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
