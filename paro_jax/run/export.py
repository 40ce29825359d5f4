"""`paro-jax export`: the newest checkpoint of a training run as an HF LLaMA directory.

The checkpoint is restored through paro_jax.run.checkpoint onto a one-device engine (strategy NNN,
mesh 1x1) built for the model config the checkpoint records; its fp32 master weights are written
with models.hf.save_hf. A LoRA run's adapters are merged into its (frozen) base weights first:
the export is a plain LLaMA.

The files are written into a hidden directory beside --out (`.NAME.partial-PID`) and moved into
place once complete: a failed export (a full disk, Ctrl-C) leaves --out as it was.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np

from safetensors import SafetensorError

from models.hf import CONFIG, save_hf
from models.llama import Llama, LlamaConfig, LoraConfig
from paro_jax.run.checkpoint import CHECKPOINTS, Checkpointer
from paro_jax.run.prepare import pid_alive
from paro_jax.core.engine import Engine, OptimConfig
from paro_jax.core.shards import join_trainable
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


def _check_out(out: str, overwrite: bool) -> None:
  if os.path.isfile(out):
    raise ValueError(f"--out {out} is a file: pass a directory to write the HF model into")
  if os.path.isdir(out) and os.listdir(out) and not overwrite:
    raise ValueError(
      f"--out {out} already exists and is not empty: pass another --out, or --overwrite to "
      f"replace its config.json and model.safetensors"
    )


def export_run(run_dir: str, out: str, overwrite: bool = False) -> int:
  """Write the newest intact checkpoint of `run_dir` (train's --out) to `out`; returns its step.
  An existing non-empty `out` needs `overwrite`; the HF directory the run started from (its
  --init-from) is never overwritten, and its config.json fields are kept."""
  _check_out(out, overwrite)
  directory = os.path.join(run_dir, CHECKPOINTS)
  if not os.path.isdir(directory):
    raise FileNotFoundError(
      f"{run_dir} has no {CHECKPOINTS}/ directory: pass the --out of a `paro-jax train` run"
    )
  ckpt = Checkpointer(directory, read_only=True)
  try:
    if not ckpt.steps():
      raise FileNotFoundError(f"no checkpoint in {directory} to export")
    meta = _newest_meta(ckpt)
    base = None
    if meta.model_name.startswith("hf:"):
      source = meta.model_name[3:]
      if os.path.isdir(source) and os.path.isdir(out) and os.path.samefile(source, out):
        raise ValueError(
          f"--out {out} is the HF directory the run started from (--init-from): pass another "
          f"--out; overwriting it would lose the original weights"
        )
      try:
        with open(os.path.join(source, CONFIG)) as f:
          base = json.load(f)
      except (OSError, ValueError):
        base = None  # the source is gone or unreadable: write our fields only
      if not isinstance(base, dict):
        base = None
    cfg = LlamaConfig(**meta.model_config)
    lora = LoraConfig(**meta.lora) if meta.lora else None
    engine = Engine(
      Llama(cfg, jnp.float32, lora=lora),
      parse_strategy("NNN"),
      make_mesh(1, 1, jax.devices()[:1]),
      OptimConfig(),
    )
    # The one restore path resume uses: it verifies the checksums of the arrays as written
    # (whatever dtype the run trained in) and never returns NaN/Inf weights.
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
  params = jax.tree.map(np.asarray, params)
  if not all(np.isfinite(w).all() for w in jax.tree.leaves(params)):
    raise ValueError(
      f"checkpoint step {meta.step} of {run_dir} holds NaN or Inf weights: not exported"
    )
  _write(cfg, params, out, base)
  return meta.step


def _write(cfg: LlamaConfig, params, out: str, base: dict | None) -> None:
  """save_hf into `.NAME.partial-PID` beside `out`, then into place: a new `out` is that
  directory renamed; an existing one (--overwrite) gets each file replaced, its others kept."""
  parent, name = os.path.split(os.path.abspath(out))
  os.makedirs(parent, exist_ok=True)
  stem = os.path.join(parent, f".{name}.partial-")
  for stale in glob.glob(glob.escape(stem) + "*"):  # of an export that was killed (-9)
    pid = stale[len(stem) :]
    if pid.isdigit() and not pid_alive(int(pid)):
      shutil.rmtree(stale, ignore_errors=True)
  partial = f"{stem}{os.getpid()}"
  try:
    save_hf(cfg, params, partial, base_config=base)
    if os.path.isdir(out) and os.listdir(out):
      for file in os.listdir(partial):
        os.replace(os.path.join(partial, file), os.path.join(out, file))
    else:
      if os.path.isdir(out):
        os.rmdir(out)  # empty: renamed over
      os.rename(partial, out)
  except (OSError, SafetensorError) as e:
    full = getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "os error 28" in str(e)
    what = "the disk is full" if full else " ".join(str(e).split())
    fix = f"free space on the disk holding {out}" if full else "fix that"
    raise ValueError(
      f"{what}: could not write the HF model to {out}; --out is as it was (nothing was "
      f"written there): {fix}, or pass another --out"
    ) from None
  finally:
    shutil.rmtree(partial, ignore_errors=True)
