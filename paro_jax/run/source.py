"""The model a command reads (`paro-jax eval`, `paro-jax generate`): SOURCE, a run directory
(train's --out: its newest intact checkpoint, weights only) or an HF directory, opened without
jax, then its weights read onto an engine's strategy and mesh at the P placement."""

from __future__ import annotations

import dataclasses
import os

from models.config import LlamaConfig, LoraConfig
from models.hf_config import CONFIG, read_config
from paro_jax.core.config import LoraOptions
from paro_jax.core.factory import build_engine
from paro_jax.core.mesh import make_mesh
from paro_jax.hf.stream import import_hf
from paro_jax.run.checkpoint import CHECKPOINTS, Checkpointer
from paro_jax.run.fit import position_limit


@dataclasses.dataclass(frozen=True)
class Source:
  """A model to score: its config, adapters and HF directory (tokenizer, chat template)."""

  kind: str  # "run" or "hf"
  path: str
  config: LlamaConfig
  lora: LoraConfig | None
  hf_dir: str | None  # the HF directory (the run's --init-from), if any
  model_name: str | None  # a run's, as its checkpoints record it
  tokenizer: str | None = None  # a run's, as its checkpoints record it (None: not recorded)
  chat_template: str | None = None  # the text a run's chat records were rendered with
  seq_len: int | None = None  # a run's --seq-len, as its checkpoints record it
  max_positions: int | None = None  # the model's max_position_embeddings (None: not known)


def open_source(source: str) -> Source:
  """What SOURCE is, read without jax: a run directory or an HF directory; else one line."""
  if os.path.isdir(os.path.join(source, CHECKPOINTS)):
    ckpt = Checkpointer(os.path.join(source, CHECKPOINTS), read_only=True)
    try:
      meta = ckpt.newest_meta()  # a damaged step is skipped (restore() skips it too)
    except FileNotFoundError as e:
      raise FileNotFoundError(f"{source}/{CHECKPOINTS} holds no readable checkpoint to read: {e}")
    finally:
      ckpt.close()
    hf_dir = meta.model_name[3:] if meta.model_name.startswith("hf:") else None
    lora = LoraConfig(**meta.lora) if meta.lora else None
    cfg = LlamaConfig(**meta.model_config)
    tokenizer = meta.data.get("tokenizer")
    positions = (meta.source_config or {}).get("max_position_embeddings") or position_limit(hf_dir)
    return Source(
      "run",
      source,
      cfg,
      lora,
      hf_dir,
      meta.model_name,
      tokenizer,
      meta.chat_template,
      meta.data.get("seq_len"),
      positions,
    )
  if os.path.isfile(os.path.join(source, CONFIG)):
    positions = position_limit(source)
    return Source("hf", source, read_config(source), None, source, None, max_positions=positions)
  raise FileNotFoundError(
    f"{source} is neither a run directory (train's --out, with {CHECKPOINTS}/) nor an HF model "
    f"directory (with {CONFIG}): pass one of them"
  )


def source_engine(source: Source, cfg):
  """The engine that runs the source's model (with its adapters) on the step and mesh of `cfg`
  (a command's config: its `step(lora)` and `mesh`), and the source's weights for it:
  compute-dtype parameters at the strategy's P placement, what a forward holds, and nothing of
  an optimizer. An HF directory is read straight into them, each
  process reading its devices' slices (hf/stream.py); of a run's newest intact checkpoint only
  the weights are read (checksums verified, any strategy or mesh), then cast and gathered."""
  mesh = make_mesh(*cfg.mesh) if cfg.mesh else make_mesh()
  engine = build_engine(cfg.step(LoraOptions.of(source.lora)), source.config, mesh)
  if source.kind == "hf":
    return engine, import_hf(
      source.path, source.config, engine.param_shardings, engine.compute_dtype
    )
  ckpt = Checkpointer(os.path.join(source.path, CHECKPOINTS), read_only=True)
  try:
    state, _ = ckpt.restore(engine, source.model_name, weights_only=True)
  finally:
    ckpt.close()
  return engine, engine.params(state)
