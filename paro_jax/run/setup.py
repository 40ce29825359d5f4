"""Setting up a run of `paro-jax train` from its RunConfig: the model, strategy (`--strategy auto`
included), the check that it fits, the data and the engine (`build`); the state it starts from,
fresh or resumed (`start_state`); the metadata its checkpoints carry; the metrics rows a resumed
run keeps. Every bad input fails here, before anything compiles."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings

import jax
import jax.numpy as jnp

from models.config import resolve_attention
from models.hf_config import CONFIG, read_config
from models.presets import get_config
from paro_jax.hf.stream import import_hf
from paro_jax.analysis.planner.auto import auto_strategy
from paro_jax.core.state import DTYPES, OptimConfig, TrainState
from paro_jax.core.engine import Engine
from paro_jax.core.factory import build_engine, build_model
from paro_jax.core.mesh import make_mesh
from paro_jax.core.names import AUTO_COLLECTIVES, AUTO_OUTER_STATE, resolve_collectives
from paro_jax.core.strategy import parse_strategy
from paro_jax.run.checkpoint import Checkpointer
from paro_jax.run.checkpoint_content import RunMeta
from paro_jax.run.frozen_base import base_identity
from paro_jax.run.config import RunConfig
from paro_jax.data.streams import Batches, expand_paths, load_tokens, split_eval
from paro_jax.data.instruct import TEXT
from paro_jax.data.sources import data_format, hf_directory, instruction_batches
from paro_jax.data.fingerprint import data_change, data_fingerprint
from paro_jax.data.tokenizers import (
  BYTES,
  check_resumed_tokenizer,
  resolve_tokenizer,
  tokenizer_identity,
)
from paro_jax.run.fit import check_fits, resolve_outer_state, run_memory
from paro_jax.run.metrics import METRICS, dump_row, read_rows


def build(cfg: RunConfig):
  """Model, engine and batches for a run; every bad input fails here, before any compile."""
  auto = cfg.strategy.strip().lower() == "auto"
  strategy = None if auto else parse_strategy(cfg.strategy)
  model_cfg = read_config(cfg.init_from) if cfg.init_from else get_config(cfg.model)
  mesh = make_mesh(*cfg.mesh) if cfg.mesh else make_mesh()
  platform, processes = jax.devices()[0].platform, jax.process_count()
  window = model_cfg.sliding_window
  packed_window = cfg.data.pack and window is not None and window < cfg.seq_len
  attention, why = resolve_attention(
    cfg.attention, platform, DTYPES[cfg.dtype], model_cfg.head_dim, packed_window
  )
  if cfg.attention == "auto" and platform != "cpu" and jax.process_index() == 0:
    print(f"paro-jax: --attention {why}: {attention}", flush=True)
  model = build_model(cfg, model_cfg, attention)
  collectives, _ = resolve_collectives(cfg.collectives, platform, processes)
  if (
    auto
  ):  # probe this mesh, plan, and on H100/H200 check by XLA's estimate (analysis/planner/auto.py)
    name, why, table = auto_strategy(
      mesh,
      cfg,
      model_cfg,
      model.param_count(),
      model.trainable_count(),
      collectives,
      attention,
      cfg.compile_top,
    )
    if jax.process_index() == 0:
      if table:
        print(table, flush=True)
      print(f"paro-jax: --strategy auto picked {name}: {why}", flush=True)
    strategy = parse_strategy(name)
  inter, intra = mesh.devices.shape
  if cfg.outer.sync is not None and cfg.outer.state == AUTO_OUTER_STATE:
    state, why = resolve_outer_state(
      cfg, model, strategy, inter, intra, platform != "cpu", jax.local_devices()
    )
    if jax.process_index() == 0:
      print(f"paro-jax: --outer-state auto: {state} ({why})", flush=True)
    cfg = dataclasses.replace(cfg, outer=dataclasses.replace(cfg.outer, state=state))
  need = run_memory(cfg, model, strategy, inter, intra, gpu=platform != "cpu")
  check_fits(cfg, strategy, need, inter, intra, jax.local_devices())
  collectives, why = resolve_collectives(cfg.collectives, platform, processes, strategy)
  if cfg.collectives == AUTO_COLLECTIVES and jax.process_index() == 0:
    print(f"paro-jax: --collectives {why}: {collectives}", flush=True)
  batches, eval_batches = run_batches(cfg, model_cfg.vocab)
  o = cfg.optimizer
  optim = OptimConfig(learning_rate=o.lr, warmup_steps=o.warmup, total_steps=o.steps)
  engine = build_engine(
    cfg, model_cfg, mesh, optim, strategy=strategy, attention=attention, collectives=collectives
  )
  engine.check_batch_size(cfg.batch_size)
  if line := cfg.fine_tune_lr_warning():  # once every input is known good
    warnings.warn(line, stacklevel=2)
  return engine, batches, eval_batches


def with_tokenizer(cfg: RunConfig, vocab: int | None = None) -> RunConfig:
  """`cfg` with the tokenizer its data is read with (data/tokenizers.py resolve_tokenizer:
  --tokenizer, else --init-from's tokenizer.json, else bytes where the model's vocabulary is)."""
  if vocab is None:
    vocab = (read_config(cfg.init_from) if cfg.init_from else get_config(cfg.model)).vocab
  files = expand_paths(cfg.data.paths) if cfg.data.paths else []
  return dataclasses.replace(cfg, data=resolve_tokenizer(cfg.data, cfg.init_from, vocab, files))


def run_batches(cfg: RunConfig, vocab: int):
  """The run's batches and its eval batches (None without --eval-every): windows of a token
  stream (data/streams.py), or instruction examples with their loss masks (data/examples.py)."""
  data = with_tokenizer(cfg, vocab).data
  files = expand_paths(data.paths) if data.paths else []
  fmt = data_format(files, data.text_field, data.data_format)
  eval_rows = cfg.micro_batches * cfg.eval.batches if cfg.eval.every else None
  if fmt != TEXT:
    batches, eval_batches, dropped = instruction_batches(
      data,
      files,
      fmt,
      hf_directory(data, cfg.init_from),
      vocab,
      cfg.micro_batches,
      cfg.batch_size,
      cfg.seq_len,
      cfg.seed,
      eval_rows,
    )
    batches.note = dropped
    return batches, eval_batches
  tokens, eval_tokens = split_eval(load_tokens(data, vocab), data.eval_fraction)
  batches = Batches(tokens, cfg.micro_batches, cfg.batch_size, cfg.seq_len, cfg.seed)
  if eval_rows is None:
    return batches, None
  # --eval-batches K: one eval batch of K step batches, so one program scores them all (K
  # programs in flight at once can deadlock XLA:CPU's collectives).
  what = f"the eval split (the last {data.eval_fraction:g} of the tokens)"
  return batches, Batches(eval_tokens, eval_rows, cfg.batch_size, cfg.seq_len, cfg.seed, what=what)


def place_batch(engine: Engine, batches: Batches, step: int) -> jax.Array:
  """Batch `step` on the mesh; with several processes each reads and places only its rows.
  The eval batches may hold more micro-batches than a step."""
  other = batches.shape[0] != engine.micro_batches
  if jax.process_count() == 1:
    return engine.shard_batch(batches(step), any_micro_batches=other)
  rows = batches.process_rows(jax.process_index(), jax.process_count())
  return engine.shard_local_batch(batches(step, rows), batches.shape, any_micro_batches=other)


def model_name(cfg: RunConfig) -> str:
  """The preset, or `hf:DIR` for a run started from HF weights."""
  return f"hf:{cfg.init_from}" if cfg.init_from else cfg.model


def run_meta(
  cfg: RunConfig,
  engine: Engine,
  step: int,
  data_files: dict | None,
  chat_template: str | None = None,
) -> RunMeta:
  """What checkpoint `step` records besides the arrays; `data_files`: the run's data by content
  (data/fingerprint.py); `chat_template`: the text its chat records were rendered with."""
  return RunMeta(
    step=step,
    seed=cfg.seed,
    model_name=model_name(cfg),
    model_config=dataclasses.asdict(engine.model.cfg),
    strategy=str(engine.strategy),
    mesh=(engine.inter, engine.intra),
    dtype=cfg.dtype,
    data=recorded_data(cfg),
    lora=dataclasses.asdict(engine.model.lora) if engine.model.lora else None,
    train=lr_schedule_inputs(cfg),
    data_files=data_files,
    source_config=source_config(cfg.init_from or cfg.model),
    chat_template=chat_template,
    base=base_identity(cfg.init_from)
    if engine.lora and cfg.init_from and not cfg.checkpoints.keep_base
    else None,
    outer=None
    if cfg.outer.sync is None
    else {
      **{k: getattr(cfg.outer, k) for k in ("sync", "fragments", "delay", "mix")},
      "state": engine.outer.state,  # --outer-state auto as resolved
      "cut": "vocab",  # core/fragments.py: the embedding and the head cut over the fragments
    },
  )


def source_config(model: str) -> dict | None:
  """The HF config.json (as a dict) of --init-from's directory or of --model's file or
  directory; None for a preset."""
  path = os.path.join(model, CONFIG) if os.path.isdir(model) else model
  if not (path.endswith(".json") and os.path.isfile(path)):
    return None
  try:
    with open(path) as f:
      config = json.load(f)
  except (OSError, ValueError):  # build() read it: changed since, the export keeps less
    return None
  return config if isinstance(config, dict) else None


# RunMeta.data's `document_ends` of a run whose documents end with the tokenizer's EOS (and
# start with its BOS where its post-processor adds one); a checkpoint written before has none.
DOCUMENT_ENDS = "post-processor+eos"


def recorded_data(cfg: RunConfig) -> dict:
  """What a checkpoint records of the data (RunMeta.data): its options and the batch shape
  (RunConfig.data_position), the tokenizer's identity (its file's hash), and how documents are
  separated."""
  tokenizer = cfg.data.tokenizer
  return {
    **cfg.data_position(),
    "tokenizer_identity": tokenizer_identity(tokenizer),
    "document_ends": None if tokenizer in (None, BYTES) else DOCUMENT_ENDS,
  }


def lr_schedule_inputs(cfg: RunConfig) -> dict:
  """What the learning-rate schedule depends on."""
  return dataclasses.asdict(cfg.optimizer)  # steps, lr, warmup


def imported_state(engine: Engine, directory: str, rng) -> TrainState:
  """Step 0 from HF weights, each process reading only its devices' slices (hf/stream.py):
  the fp32 master straight at its OS placement; with LoRA, the HF weights are the frozen base,
  straight at P in the compute dtype, and the adapters start fresh (B = 0)."""
  shardings, cfg = engine.state_shardings, engine.model.cfg  # its config: build read it
  if engine.lora:
    frozen = import_hf(directory, cfg, shardings.frozen, engine.compute_dtype)
    return engine.state_from_master(engine.fresh_adapters(rng), frozen)
  return engine.state_from_master(import_hf(directory, cfg, shardings.master, jnp.float32))


def start_state(
  cfg: RunConfig,
  engine: Engine,
  ckpt: Checkpointer,
  data_files: dict,
  chat_template: str | None = None,
) -> TrainState:
  """A fresh state (random, or --init-from's weights), or with --resume the newest intact
  checkpoint placed for this engine; a resume on other data (`data_files`, this run's
  fingerprint, against the checkpoint's; `chat_template`, the text its chat records are rendered
  with) or other batch settings is said."""
  if not cfg.checkpoints.resume:
    if ckpt.steps():
      raise ValueError(
        f"{ckpt.directory} already holds checkpoints (steps {ckpt.steps()}): pass "
        f"--resume to continue that run, or another --out to start a new one"
      )
    if cfg.init_from:
      return imported_state(engine, cfg.init_from, jax.random.key(cfg.seed))
    return engine.init_state(jax.random.key(cfg.seed))
  state, meta = ckpt.restore(engine, model_name(cfg), set_aside=True)
  was = {"seed": meta.seed, **meta.data}
  now = json.loads(json.dumps({"seed": cfg.seed, **recorded_data(cfg)}))  # tuples as lists
  check_resumed_tokenizer(was, now, meta.step)  # refused: the ids would mean other text
  differ = lambda what: (  # noqa: E731
    f"the batches after step {meta.step} differ from an uninterrupted run's ({what})"
  )
  if was.get("document_ends") != now["document_ends"]:
    warnings.warn(
      f"checkpoint step {meta.step} was trained before documents (text files, JSONL and "
      f"Parquet records) ended with the tokenizer's end-of-sequence token: "
      + differ("that run's batches cannot be read again"),
      stacklevel=2,
    )
  if meta.data_files is not None:  # the data compared by content, not by the paths naming it
    change = data_change(meta.data_files, data_files)
    if change:
      warnings.warn(
        f"resuming on other data than the checkpoint's (step {meta.step}): {change}: "
        + differ("restore the data to continue the same run"),
        stacklevel=2,
      )
    was.pop("paths", None)
  compared = ["tokenizer", "tokenizer_identity", "document_ends"]
  if None not in (meta.chat_template, chat_template):  # by content, not by the path naming it
    compared.append("chat_template")
    if meta.chat_template != chat_template:
      given = cfg.data.chat_template or "the model directory's"
      warnings.warn(
        f"resuming with another chat template ({given}) than checkpoint step {meta.step} was "
        f"trained with: the chat records are rendered otherwise, and the export ships the new "
        f"one: " + differ("pass the template it trained with to continue the same run"),
        stacklevel=2,
      )
  for key in was:
    if key in compared:
      continue  # compared above
    if was[key] != now.get(key):
      warnings.warn(
        f"resuming with {key}={now.get(key)!r}, but the checkpoint was trained with "
        f"{was[key]!r}: " + differ("pass the checkpoint's value to continue the same run"),
        stacklevel=2,
      )
  schedule = lr_schedule_inputs(cfg)
  if meta.train is not None and meta.train != schedule:
    changed = [k for k in ("steps", "lr", "warmup") if meta.train.get(k) != schedule[k]]
    warnings.warn(
      f"resuming with {' '.join(f'--{k} {schedule[k]:g}' for k in changed)}, but the "
      f"checkpoint (step {meta.step}) was trained with "
      f"{' '.join(f'--{k} {meta.train[k]:g}' for k in changed)}: the learning-rate schedule "
      f"changed from step {meta.step} on",
      stacklevel=2,
    )
  print(
    f"paro-jax: resumed from {ckpt.directory}/{meta.step} (saved by strategy {meta.strategy} "
    f"on mesh {meta.mesh[0]}x{meta.mesh[1]})",
    flush=True,
  )
  return state


def starting_point(
  cfg: RunConfig, engine: Engine, ckpt: Checkpointer, main: bool, chat_template: str | None = None
) -> tuple[RunConfig, TrainState, list[str], dict]:
  """(the run's config as it runs, the state it starts from, the metrics rows it keeps, its
  data's fingerprint) for the run directory as it is: a run that stopped before its first
  checkpoint has nothing to resume, so its metrics are set aside (not deleted) and the run starts
  over, with or without --resume (process 0 decides: the others follow, or it fails alone)."""
  metrics_path = os.path.join(cfg.out, METRICS)
  written = os.path.exists(metrics_path) and os.path.getsize(metrics_path)
  if not ckpt.steps() and (written or not main):
    cfg = dataclasses.replace(cfg, checkpoints=dataclasses.replace(cfg.checkpoints, resume=False))
    if main:
      set_aside_metrics(metrics_path)
  data_files = data_fingerprint(cfg.data)
  state = start_state(cfg, engine, ckpt, data_files, chat_template)
  rows = kept_rows(metrics_path, int(state.step)) if main and cfg.checkpoints.resume else []
  return cfg, state, rows, data_files


def set_aside_metrics(metrics_path: str) -> None:
  """Rename the metrics of a run that saved no checkpoint to metrics.unsaved-<n>.jsonl."""
  stem, n = metrics_path[: -len(".jsonl")], 1
  while os.path.exists(f"{stem}.unsaved-{n}.jsonl"):
    n += 1
  os.rename(metrics_path, f"{stem}.unsaved-{n}.jsonl")
  print(
    f"paro-jax: {os.path.dirname(metrics_path) or '.'} holds the metrics of a run that stopped "
    f"before its first checkpoint: kept as {stem}.unsaved-{n}.jsonl; starting from step 0",
    flush=True,
  )


def kept_rows(metrics_path: str, upto: int) -> list[str]:
  """The metrics rows of steps <= upto: a resumed run redoes (and rewrites) the later ones."""
  if not os.path.exists(metrics_path):
    return []
  return [dump_row(r) for r in read_rows(metrics_path) if r["step"] <= upto]
