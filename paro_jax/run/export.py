"""`paro-jax export`: the newest checkpoint of a training run as an HF LLaMA directory.

The checkpoint is restored through paro_jax.run.checkpoint onto a one-device engine (strategy NNN,
mesh 1x1) built for the model config the checkpoint records; its fp32 master weights are written
with models.hf.save_hf. A LoRA run's adapters are merged into its (frozen) base weights first:
the export is a plain LLaMA.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from models.hf import save_hf
from models.llama import Llama, LlamaConfig, LoraConfig
from paro_jax.run.checkpoint import CHECKPOINTS, Checkpointer
from paro_jax.core.engine import Engine, OptimConfig, join_trainable
from paro_jax.core.mesh import make_mesh
from paro_jax.core.strategy import parse_strategy


def _newest_meta(ckpt: Checkpointer):
  """The metadata of the newest checkpoint whose metadata reads."""
  for step in reversed(ckpt.steps()):
    try:
      return ckpt.read_meta(step)
    except Exception:  # noqa: BLE001, S112 - a damaged step: restore() below skips it too
      continue
  raise ValueError(f"no readable checkpoint in {ckpt.directory}")


def export_run(run_dir: str, out: str) -> int:
  """Write the newest checkpoint of `run_dir` (train's --out) to `out`; returns its step."""
  directory = os.path.join(run_dir, CHECKPOINTS)
  if not os.path.isdir(directory):
    raise FileNotFoundError(
      f"{run_dir} has no {CHECKPOINTS}/ directory: pass the --out of a `paro-jax train` run"
    )
  ckpt = Checkpointer(directory)
  try:
    if not ckpt.steps():
      raise FileNotFoundError(f"no checkpoint in {directory} to export")
    meta = _newest_meta(ckpt)
    cfg = LlamaConfig(**meta.model_config)
    lora = LoraConfig(**meta.lora) if meta.lora else None
    engine = Engine(
      Llama(cfg, jnp.float32, lora=lora),
      parse_strategy("NNN"),
      make_mesh(1, 1, jax.devices()[:1]),
      OptimConfig(),
    )
    state, meta = ckpt.restore(engine, meta.model_name)
  finally:
    ckpt.close()
  params = state.master
  if lora:
    params = engine.model.merge_lora(
      join_trainable(
        engine.mask, state.master, jax.tree.map(lambda w: w.astype(jnp.float32), state.frozen)
      )
    )
  save_hf(cfg, jax.tree.map(np.asarray, params), out)
  return meta.step
