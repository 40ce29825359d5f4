"""Before any compile: refuse a run that cannot fit, in one line with the estimate and the fix.

The estimate is the planner's memory model (paro_jax.analysis.planner: model states at their
placements, plus one micro-batch's activations at the run's sequence length, micro-batch and
remat), per device, against the memory of the devices: a GPU's own memory, or on the CPU the
host's available memory shared by its virtual devices. A run started from HF weights is also held
to its config's `max_position_embeddings`.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp

from paro_jax.analysis.costs import model_state_bytes
from paro_jax.analysis.planner import Workload, activation_bytes
from paro_jax.core.engine import DTYPES

GIB = 2**30


def host_available_bytes() -> int | None:
  """MemAvailable of /proc/meminfo (None where there is none)."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    return None
  return None


def device_memory(devices) -> tuple[int | None, str]:
  """(bytes one device may use, what that is), or (None, why not known)."""
  device = devices[0]
  if device.platform == "cpu":
    available = host_available_bytes()
    if available is None:
      return None, "the host's available memory is unknown"
    return available // len(devices), (
      f"{available / GIB:.1f} GiB of available host memory shared by {len(devices)} CPU devices"
    )
  try:
    limit = (device.memory_stats() or {}).get("bytes_limit")
  except Exception:  # noqa: BLE001 - a backend without memory statistics: nothing to check
    limit = None
  if not limit:
    return None, f"the memory of {device.device_kind} is unknown"
  return int(limit), f"{limit / GIB:.1f} GiB on each {device.device_kind}"


def position_limit(init_from: str | None) -> int | None:
  """The `max_position_embeddings` of an HF model directory's config.json (None: no limit)."""
  if not init_from:
    return None
  try:
    with open(os.path.join(init_from, "config.json")) as f:
      return json.load(f).get("max_position_embeddings")
  except (OSError, ValueError):
    return None


def check_fits(cfg, model, strategy, inter: int, intra: int, attention: str, devices) -> None:
  """Raise a ValueError naming the estimate and the fix when the run cannot fit."""
  limit = position_limit(cfg.init_from)
  if limit and cfg.seq_len > limit:
    raise ValueError(
      f"--seq-len {cfg.seq_len} is longer than the {limit} positions of {cfg.init_from} "
      f"(max_position_embeddings in its config.json): pass --seq-len {limit} or less"
    )
  if not cfg.memory_check:
    return
  itemsize = jnp.dtype(DTYPES[cfg.dtype]).itemsize
  grad_itemsize = cfg.wire.grad_itemsize(itemsize)
  per_device = cfg.batch_size // (inter * intra)
  work = Workload(
    model.cfg,
    micro_batch=max(per_device, 1),
    micro_batches=cfg.micro_batches,
    seq_len=cfg.seq_len,
    params=model.param_count(),
    trainable=model.trainable_count(),
    itemsize=itemsize,
    remat=cfg.remat != "none",
    grad_itemsize=grad_itemsize,
    fused_attention=attention == "cudnn",
  )
  states = model_state_bytes(
    strategy, work.psi, work.psi_trained, inter, intra, itemsize, grad_itemsize
  )["total"]
  acts = activation_bytes(strategy, work, inter, intra)["total"]
  usable, what = device_memory(devices)
  if usable is None or states + acts <= usable:
    return
  more = "use more devices, "
  if str(strategy) != "GGG":
    more = "use more devices or a strategy that shards more (more G), "
  raise ValueError(
    f"this run needs about {(states + acts) / GIB:.1f} GiB per device (model states "
    f"{states / GIB:.1f} GiB with strategy {strategy}, activations {acts / GIB:.1f} GiB for "
    f"{work.micro_batch} sequence(s) of {cfg.seq_len} tokens per device; the planner's estimate), "
    f"more than the {what}: lower --seq-len or --batch-size (raise --micro-batches to keep the "
    f"tokens per step), {more}or pass --no-memory-check to try anyway"
  )
