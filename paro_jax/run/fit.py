"""Before any compile: refuse a run that cannot fit, in one line with the estimate and the fix.

The estimate is the planner's memory model (analysis/planner/memory.py step_memory: model states
at their placements with the int8 corrections' buffers, plus one micro-batch's activations at the
run's sequence length, micro-batch and remat), per device, against the memory of the devices
(analysis/planner/memory.py available_memory: a GPU's own memory, or on the CPU the host's
available memory shared by its virtual devices). `paro-jax plan` prints the same figure for the same
workload, and the run's start-up banner this one. A run started from HF weights is also held to
its config's `max_position_embeddings`.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp

from paro_jax.analysis.planner import memory
from paro_jax.analysis.planner.memory import GIB, step_memory
from paro_jax.analysis.planner.inputs import Workload
from paro_jax.core.strategy import GroupStrategy


def position_limit(init_from: str | None) -> int | None:
  """The `max_position_embeddings` of an HF model directory's config.json (None: no limit)."""
  if not init_from:
    return None
  try:
    with open(os.path.join(init_from, "config.json")) as f:
      return json.load(f).get("max_position_embeddings")
  except (OSError, ValueError):
    return None


def sequences_per_device(cfg, inter: int, intra: int) -> int:
  """Sequences of one micro-batch on each device."""
  return max(cfg.batch_size // (inter * intra), 1)


def run_memory(cfg, model, strategy, inter: int, intra: int, gpu: bool) -> dict:
  """analysis/planner/memory.py step_memory of the run `cfg`: `model` (models/llama.py Llama, its
  parameter counts and resolved attention) with `strategy` on an `inter` x `intra` mesh of GPUs
  (`gpu`) or CPUs."""
  return step_memory(strategy, run_workload(cfg, model, inter, intra), inter, intra, gpu=gpu)


def resolve_outer_state(cfg, model, strategy, inter: int, intra: int, gpu: bool, devices):
  """(state, why) of --outer-state auto for this run (memory.outer_state_for, the planner's
  rule): I where its memory with the outer state at I fits the devices' (`devices`: this
  process's), else G."""
  usable, what = memory.available_memory(devices)
  work = run_workload(cfg, model, inter, intra)
  state = memory.outer_state_for(GroupStrategy.of(strategy), work, inter, intra, usable, gpu)
  if state == "I":
    return state, "a round sends the pseudo-gradient alone; the memory fits"
  return state, f"with the outer state at I the run would not fit the {what}"


def run_workload(cfg, model, inter: int, intra: int) -> Workload:
  """The planner's Workload of the run `cfg` with `model` on an `inter` x `intra` mesh."""
  itemsize = jnp.dtype(model.dtype).itemsize
  return Workload(
    model.cfg,
    micro_batch=sequences_per_device(cfg, inter, intra),
    micro_batches=cfg.micro_batches,
    seq_len=cfg.seq_len,
    params=model.param_count(),
    trainable=model.trainable_count(),
    itemsize=itemsize,
    remat=cfg.remat != "none",
    wire=cfg.wire.formats(),
    grad_itemsize=cfg.wire.grad_itemsize(itemsize),
    fused_attention=model.attention == "cudnn",
    error_feedback=cfg.error_feedback,
    param_delta=cfg.param_delta,
    outer_sync=cfg.outer.sync,
    outer_fragments=cfg.outer.fragments,
    outer_delay=cfg.outer.delay,
    outer_state=cfg.outer.state,
  )


def check_fits(cfg, strategy, need: dict, inter: int, intra: int, devices) -> None:
  """Raise a ValueError naming the estimate `need` (run_memory's) and the fix when the run
  cannot fit on `devices` (this process's)."""
  limit = position_limit(cfg.init_from)
  if limit and cfg.seq_len > limit:
    raise ValueError(
      f"--seq-len {cfg.seq_len} is longer than the {limit} positions of {cfg.init_from} "
      f"(max_position_embeddings in its config.json): pass --seq-len {limit} or less"
    )
  if not cfg.memory_check:
    return
  usable, what = memory.available_memory(devices)
  if usable is None or need["total"] <= usable:
    return
  more = "use more devices, "
  if str(strategy) != "GGG":
    more = "use more devices or a strategy that shards more (more G), "
  states, acts = need["model_states"], need["activations"]["total"]
  raise ValueError(
    f"this run needs about {need['total'] / GIB:.1f} GiB per device (model states "
    f"{states['total'] / GIB:.1f} GiB with strategy {strategy}{_int8_buffers(states)}, "
    f"activations {acts / GIB:.1f} GiB for {sequences_per_device(cfg, inter, intra)} "
    f"sequence(s) of {cfg.seq_len} tokens per device; the planner's estimate), more than the "
    f"{what}: lower --seq-len or --batch-size (raise --micro-batches to keep the tokens per "
    f"step), {more}or pass --no-memory-check to try anyway"
  )


def _int8_buffers(states: dict) -> str:
  """What the int8 corrections add to the model states, where they run."""
  parts = [
    f"{name} {states[key] / GIB:.1f} GiB"
    for key, name in (("residual", "error-feedback residual"), ("reference", "delta reference"))
    if key in states
  ]
  return f" ({' and '.join(parts)} included)" if parts else ""
