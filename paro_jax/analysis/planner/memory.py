"""A run's memory per device: the one model `paro-jax plan`, `train`'s check before compiling
(run/fit.py) and its start-up banner, and `inspect --target`'s "planned" print, and the one reading
of how much memory a device has.

Pure Python (no jax): `plan` runs without it; `available_memory` is handed the devices.
"""

from __future__ import annotations

import dataclasses

from models.config import tiles, vocab_tiled  # no jax
from paro_jax.analysis.planner.costs import model_state_bytes
from paro_jax.analysis.planner.inputs import Workload
from paro_jax.core import feedback_rules  # no jax
from paro_jax.core.strategy import Strategy
from paro_jax.core.wire import WireConfig

GIB = 2**30


def step_memory(strategy: Strategy, w: Workload, inter: int, intra: int, gpu: bool = True) -> dict:
  """Per-device bytes of one step of `w` with `strategy` on an `inter` x `intra` mesh:
  {"model_states": {params, grads, opt, [residual], [reference], total}, "activations": {...,
  total}, "total"}. Model states are `costs.model_state_bytes` at the placements, with the fp32
  error-feedback residual and the delta sync's reference where `w`'s wire formats and flags turn
  them on (core/feedback_rules.py); activations are `activation_bytes`. `gpu`: the step program
  of GPUs (the planner plans for them; a run on CPUs passes False). With the outer loop
  (`w.outer_sync`) the step's own wire formats do not apply (it has no collective across nodes),
  and the outer weights and momentum add OUTER_STATE_BYTES per trained parameter over all
  devices (over a node's with `w.outer_state` I), with the pseudo-gradient's residual where its
  wire compresses, and with `w.outer_delay` the weights kept for the delayed exchange
  (`kept`)."""
  if w.outer_sync:
    return _with_outer(strategy, dataclasses.replace(w, outer_sync=None), inter, intra, gpu)
  states = model_state_bytes(
    strategy,
    w.psi,
    w.psi_trained,
    inter,
    intra,
    w.itemsize,
    w.acc_itemsize,
    residual_bytes=feedback_rules.residual_bytes(
      strategy, w.psi_trained, inter, intra, w.wire, w.acc_itemsize, w.error_feedback
    ),
    reference_bytes=feedback_rules.reference_bytes(
      strategy, w.psi_trained, inter, intra, w.wire, w.itemsize, w.param_delta
    ),
  )
  if gpu and w.micro_batches == 1 and w.remat and not states.get("residual"):
    # On GPUs each layer's gradient is synced inside the last micro-batch's backward (the Engine's
    # program StepProgram.SYNC_IN_BACKWARD, core/step.py: with the prefetching stack, off with
    # error feedback). With one micro-batch there is no earlier sum to add it to, so the layer
    # stack's accumulator at Gr is never allocated (65b IIG on 4 x 8 H100, A=1: 53.0 GB
    # compiled, 72.3 GB planned with it, experiments/results/gpu_estimates).
    stack = (
      w.acc_itemsize
      * (w.layer_params * w.psi_trained // w.psi)
      // strategy.grads.shard_count(inter, intra)
    )
    states = {**states, "grads": states["grads"] - stack, "total": states["total"] - stack}
  acts = activation_bytes(strategy, w, inter, intra)
  return {"model_states": states, "activations": acts, "total": states["total"] + acts["total"]}


# Bytes per trained parameter the outer loop adds: the fp32 outer weights and their fp32 Nesterov
# momentum (core/outer.py OuterState), divided by all devices (--outer-state G) or by a node's
# devices (I: each node holds its copy).
OUTER_STATE_BYTES = 8
KEPT_BYTES = 4  # --outer-delay's kept weights: fp32, per trained parameter at OS


def outer_state_for(
  strategy: Strategy, w: Workload, inter: int, intra: int, usable: float | None, gpu: bool = True
) -> str:
  """--outer-state auto: I (a round sends 2w bytes a parameter across nodes, not 8 + w) where
  the step's memory with the outer state at I fits `usable` bytes per device (None: no limit),
  else G (8 bytes a parameter over all devices instead of a node's)."""
  at_node = step_memory(strategy, dataclasses.replace(w, outer_state="I"), inter, intra, gpu)
  return "I" if usable is None or at_node["total"] <= usable else "G"


def _with_outer(strategy: Strategy, inner: Workload, inter: int, intra: int, gpu: bool) -> dict:
  """`step_memory` of a group's step (`inner`, with the step's wire formats left out) plus the
  outer loop's state."""
  plain = dataclasses.replace(inner, wire=WireConfig(), error_feedback=None, param_delta=None)
  need = step_memory(strategy, plain, inter, intra, gpu)
  ways = intra if inner.outer_state == "I" else inter * intra
  outer = OUTER_STATE_BYTES * -(-inner.psi_trained // ways) + feedback_rules.outer_residual_bytes(
    strategy, inner.psi_trained, inter, intra, inner.wire, inner.error_feedback, inner.outer_state
  )
  states = {**need["model_states"], "outer": outer}
  if inner.outer_delay:
    # --outer-delay: each group's fp32 master weights as of a fragment's sync step, a whole copy
    # at OS (core/groups.py `_keep`: OuterState.pending, stacked like the master)
    states["kept"] = KEPT_BYTES * inner.psi_trained // strategy.opt.shard_count(inter, intra)
  added = sum(v for k, v in states.items() if k in ("outer", "kept"))
  states["total"] += added
  return {**need, "model_states": states, "total": need["total"] + added}


def activation_bytes(strategy: Strategy, w: Workload, inter: int = 1, intra: int = 1) -> dict:
  """Per-device activation memory of one micro-batch with full remat (a rough estimate).

  - boundary: each layer's input, kept for backward: L x b x s x D;
  - layer: one layer's recomputed intermediates and their gradients (x2): q, k, v, attention
    output, gate, up, the two norms, and either the fp32 scores with their probabilities
    (attention written out) or, with the fused kernel, its fp32 softmax statistics per query;
  - logits: where the vocabulary needs several tiles (models/config.py `vocab_tiled`), the
    loss's one tile at a time (models/loss.py): a tile's fp32 logits, their fp32 softmax and its
    cotangent rounded to the compute dtype, b x s x C x (4 + 4 + item) for a tile of C columns,
    and the input's gradient summed over the tiles in fp32, b x s x D x 4 (the logits of the
    whole micro-batch are never held); else the fp32 logits and their gradient, b x s x V x 4 x 2;
  - gathered: with P sharded, the full weights of the head (of one vocabulary tile, C x D,
    where the vocabulary needs several: models/loss.py) and of one layer, two with the
    prefetching layer stack (full remat: this layer's and the next one's); the full gradient of
    one layer before its reduce-scatter, two with the stack (one waits a layer for its
    reduce-scatter); with tied embeddings of one tile, the table's full gradient (with several,
    each tile's gradient is reduce-scattered into the sink as it is made);
  - synced_grads: the layers' synced gradients at the OS placement, written while the
    accumulator (at Gr) is still alive: in the last micro-batch's backward on GPUs, at the
    boundary's sync elsewhere. The stack adds each micro-batch's gradients into the accumulator
    in place, so no other gradient buffer of the layer stack is held (core/prefetch.py).
  """
  c, b, s, item = w.model, w.micro_batch, w.seq_len, w.itemsize
  q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
  layer_w = w.layer_params // c.layers
  layer_grads = layer_w * w.psi_trained // w.psi
  depth = 2 if w.remat else 1  # the prefetching stack runs with full remat
  # per query and head: a row of fp32 scores and its probabilities, or the kernel's fp32 statistic
  scores = 4 if w.fused_attention else s * (4 + item)
  tiled = vocab_tiled(c.vocab)
  head_rows = tiles(c.vocab)[1] if tiled else c.vocab  # of the head gathered at once
  out = {
    "boundary": c.layers * b * s * c.dim * item,
    "layer": 2
    * (b * s * (2 * q + 2 * kv + 3 * c.mlp + 2 * c.dim) * item + b * c.heads * s * scores),
    "logits": b * s * (tiles(c.vocab)[1] * (8 + item) + c.dim * 4)
    if tiled
    else 2 * b * s * c.vocab * 4,
    "gathered": item
    * (
      (strategy.params.name != "N") * (depth * layer_w + head_rows * c.dim)
      + (depth if w.remat else strategy.grads.name != "N") * layer_grads
      # A tied table's full gradient: the head's part waits through backward for the
      # embedding's (models/llama.py), in every strategy (llama3.2-1b NNI on 2x4 H100: 0.5 GB).
      + (c.tie_embeddings and w.psi_trained == w.psi and not tiled) * c.vocab * c.dim
    ),
    "synced_grads": w.acc_itemsize
    * c.layers
    * layer_grads
    // strategy.opt.shard_count(inter, intra),
  }
  out["total"] = sum(out.values())
  return out


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


def available_memory(devices) -> tuple[int | None, str]:
  """(bytes one of `devices` may use, what that is), or (None, why not known): a GPU's allocator
  limit; on the CPU the host's available memory shared by `devices` (the virtual devices of this
  process: pass jax.local_devices())."""
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
