"""`paro-jax plan` and `train --strategy auto`: rank the 14 strategies by predicted step time.

Pure Python (no jax), so a laptop can plan a 128-GPU run. For every strategy:

- traffic: `costs.step_traffic`, bytes each device sends per optimizer step and phase (the one
  formula, docs/design.md's; nothing here re-derives it);
- time of a phase: bytes / bandwidth of its level + latency x collectives. A collective over
  `intra` runs at the intra bandwidth; one over `inter` at each device's share of its node's
  link (node bandwidth / devices per node: all devices of a node send at once). One over both
  axes (global) is modelled by `global_collectives`: "flat" (docs/design.md: every device's ring
  bytes cross the node link at its share; what XLA:CPU over gloo does, checked on the wire by tc
  in the strategy benchmark), "hierarchical" (an intra part, then an inter part carrying 1/m of the
  payload: NCCL's node-ordered rings, paro_jax's hring) or "overlapped" (the two parts at once:
  horing). A probe profile replaces any of these by measured (bandwidth, latency) per
  (collective, level);
- compute: model FLOPs (`LlamaConfig.flops_per_token`, 6 per parameter and token, less the
  weight-gradient third for frozen parameters) / (peak FLOP/s x MFU). Communication and compute
  add up (no overlap) unless `overlap` says what fraction of the per-micro-batch traffic hides
  behind compute; the boundary syncs never overlap;
- memory: model states (`costs.model_state_bytes`: 2Ψ/f(P) + 2Ψ'/f(Gr) + 12Ψ'/f(OS)) plus an
  activation estimate (`activation_bytes`); a strategy fits when that is at most `usable_memory`
  (0.9) of the device memory, leaving room for the CUDA context, communication buffers and
  fragmentation. JAX preallocates 75% of a GPU by default: raise XLA_PYTHON_CLIENT_MEM_FRACTION
  (e.g. to 0.95) for plans that need more.

The pick is the fastest strategy that fits. Predictions within `TIE` (1%) of the fastest are a tie
the model cannot resolve (e.g. ING, INI and IIG with few trainable parameters); among those it
takes the one with the fewest collectives per step (per-collective overhead is the least certain
part of the model), then the least memory.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING

from paro_jax.analysis.costs import model_state_bytes, step_traffic
from paro_jax.core import feedback_rules  # no jax
from paro_jax.core.wire import WireConfig  # no jax
from paro_jax.analysis.hardware import GPUS
from paro_jax.core.names import (
  ALL_GATHER,
  ALL_REDUCE,
  DEFAULT_INT8_BLOCK,
  MIXED_IMPLS,
  INTER,
  LEVELS,
  REDUCE_SCATTER,
  SCHEDULE_COLLECTIVES,
)
from paro_jax.core.strategy import KNOWN_NAMES, VALID_NAMES, Strategy, parse_strategy
from paro_jax.core.units import (
  COMPUTE_DTYPE_BYTES,
  human_bytes,
  human_count,
  parse_bandwidth,
  parse_latency,
  parse_size,
)

if TYPE_CHECKING:  # models/llama.py imports jax; the planner needs only the config's numbers
  from models.llama import LlamaConfig

GLOBAL_MODELS = ("flat", "hierarchical", "overlapped")
# How each --collectives implementation runs a collective over both axes. xla on GPUs is NCCL,
# whose rings visit the devices node by node, so a node's link carries about 1/m of the payload
# per device, as hring does; on CPU (gloo) it is flat (validate_planner.py passes "flat").
GLOBAL_MODEL_OF = {
  "xla": "hierarchical",
  "ring": "flat",
  "hring": "hierarchical",
  "horing": "overlapped",
}
GLOBAL_MODEL_OF |= {mixed: GLOBAL_MODEL_OF[ring] for mixed, ring in MIXED_IMPLS.items()}
TIE = 0.01
USABLE_MEMORY = 0.9
DEFAULT_MFU = 0.5  # compute alone; AMSP reports 51-52% end to end for LLaMA-7B/13B on A800s
# Parameter leaves of models/llama.py: 9 per layer (4 attention weights, 3 MLP weights, 2 norm
# scales), 3 outside (embedding, final norm, head). One collective per leaf and use: the layer
# loop gathers each layer's 9, the boundary syncs see the 12 stacked leaves.
LEAVES_PER_LAYER, OTHER_LEAVES = 9, 3


# --- the inputs ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Links:
  """Links of the cluster. Bandwidths in bytes/s; latencies in seconds per collective."""

  inter_bandwidth: float  # each node's inter-node link, shared by its devices
  intra_bandwidth: float  # per device, inside a node
  inter_latency: float = 50e-6
  intra_latency: float = 10e-6
  global_collectives: str = "hierarchical"
  # (collective, level) -> (bandwidth in per-device ring bytes/s, latency s): a probe profile.
  measured: dict = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if self.global_collectives not in GLOBAL_MODELS:
      raise ValueError(
        f"unknown global collective model {self.global_collectives!r}; choose "
        f"one of {GLOBAL_MODELS}"
      )
    if min(self.inter_bandwidth, self.intra_bandwidth) <= 0:
      raise ValueError("bandwidths must be positive")


@dataclasses.dataclass(frozen=True)
class Cluster:
  nodes: int
  devices_per_node: int
  network: Links
  flop_per_s: float | None  # per device, peak (or measured); None: compute time left out
  mfu: float = DEFAULT_MFU
  device_memory: float | None = None  # bytes; None: no limit (CPU)
  usable_memory: float = USABLE_MEMORY
  overlap: float = 0.0  # fraction of per-micro-batch traffic hidden behind compute (0..1)

  def __post_init__(self):
    if self.nodes < 1 or self.devices_per_node < 1:
      raise ValueError(
        f"--nodes and --devices-per-node must be >= 1, got {self.nodes} and {self.devices_per_node}"
      )
    if not 0 < self.mfu <= 1:
      raise ValueError(f"--mfu must be in (0, 1], got {self.mfu}")
    if not 0 <= self.overlap <= 1:
      raise ValueError(f"overlap must be in [0, 1], got {self.overlap}")
    if not 0 < self.usable_memory <= 1:
      raise ValueError(f"usable memory fraction must be in (0, 1], got {self.usable_memory}")

  @property
  def devices(self) -> int:
    return self.nodes * self.devices_per_node

  @property
  def usable_bytes(self) -> float | None:
    return None if self.device_memory is None else self.device_memory * self.usable_memory


@dataclasses.dataclass(frozen=True)
class Workload:
  """What one optimizer step trains. `micro_batch` is sequences per device and micro-batch."""

  model: LlamaConfig
  micro_batch: int = 1
  micro_batches: int = 8
  seq_len: int = 2048
  params: int | None = None  # Ψ, adapters included; default model.param_count()
  trainable: int | None = None  # Ψ'; default Ψ (full training)
  itemsize: int = 2  # bytes of a compute-dtype value (parameters, gradients, activations)
  remat: bool = True  # the layer stack is recomputed (and regathered) in backward
  wire: WireConfig = WireConfig()  # inter-node wire precision (--inter-params, --inter-grads)
  grad_itemsize: int | None = None  # the gradient accumulator's (--grad-dtype); None: itemsize
  fused_attention: bool = False  # cuDNN's fused kernel (--attention cudnn): no L x L scores

  def __post_init__(self):
    for name in ("micro_batch", "micro_batches", "seq_len"):
      if getattr(self, name) < 1:
        raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
    if self.trainable is not None and not 0 < self.trainable <= self.psi:
      raise ValueError(f"trainable parameters ({self.trainable}) must be in (0, {self.psi}]")

  @property
  def acc_itemsize(self) -> int:
    return self.itemsize if self.grad_itemsize is None else self.grad_itemsize

  @property
  def psi(self) -> int:
    return self.model.param_count() if self.params is None else self.params

  @property
  def psi_trained(self) -> int:
    return self.psi if self.trainable is None else self.trainable

  @property
  def layer_params(self) -> int:
    """Parameters of the layer stack: all but the embedding, final norm and head."""
    return self.psi - self.model.outer_param_count()

  @property
  def tokens_per_device(self) -> int:
    return self.micro_batch * self.seq_len * self.micro_batches


# --- the model of one strategy -----------------------------------------------------------------
def _level(axes: tuple[str, ...]) -> str:
  return "global" if len(axes) == 2 else axes[0]


def schedule(strategy: Strategy, w: Workload) -> dict[str, tuple[str, tuple[str, ...], int]]:
  """`costs.step_traffic` phase key ('phase/level') -> (collective, mesh axes, collectives per
  step), from the strategy's letters; phases without axes move nothing."""
  s, a, layers = strategy, w.micro_batches, w.model.layers
  per_mb = a * (LEAVES_PER_LAYER * layers + OTHER_LEAVES)
  stacked = LEAVES_PER_LAYER + OTHER_LEAVES
  items = [
    ("forward params", s.param_gather_axes, ALL_GATHER, per_mb),
    ("backward params (remat)", s.param_gather_axes, ALL_GATHER, a * LEAVES_PER_LAYER * layers),
    ("backward grads", s.grad_scatter_axes, REDUCE_SCATTER, per_mb),
    ("grad sync", s.sync_scatter_axes, REDUCE_SCATTER, stacked),
    ("grad sync", s.sync_reduce_axes, ALL_REDUCE, stacked),
    ("param sync", s.param_sync_axes, ALL_GATHER, stacked),
  ]
  out = {}
  for phase, axes, kind, count in items:
    # A compressed collective spanning both axes runs as two levels (costs._add_collective).
    codec = w.wire.params_codec if "params" in phase else w.wire.grads_codec
    item = w.acc_itemsize if phase == "grad sync" else w.itemsize
    if INTER in axes and len(axes) == 2 and codec.compresses(item):
      for level in axes:
        key = f"{phase}/{level}"
        assert key not in out, f"two collectives in phase {key} of {s}"
        out[key] = (kind, (level,), count)
      continue
    if axes:
      key = f"{phase}/{'inter' if INTER in axes else 'intra'}"
      assert key not in out, (
        f"two collectives in phase {key} of {s}"
      )  # see docs/design.md's schedule
      out[key] = (kind, axes, count)
  return out


def collective_seconds(
  kind: str, axes: tuple[str, ...], nbytes: float, count: int, cluster: Cluster
) -> float:
  """Time of `count` collectives over `axes` that send `nbytes` per device in all (ring bytes,
  as costs.step_traffic counts them)."""
  net, m, g = cluster.network, cluster.devices_per_node, cluster.nodes
  level = _level(axes)
  if (kind, level) in net.measured:
    bandwidth, latency = net.measured[(kind, level)]
    return count * latency + nbytes / bandwidth
  inter_share = net.inter_bandwidth / m  # all m devices of a node send at once
  if level == "intra":
    return count * net.intra_latency + nbytes / net.intra_bandwidth
  if level == "inter" or net.global_collectives == "flat":
    return count * net.inter_latency + nbytes / inter_share
  # Two levels: the ring bytes over n devices name the payload S; an intra ring moves
  # (m-1)/m S per device, the inter rings (g-1)/g S/m (x2 for an all-reduce).
  n, twice = m * g, 2 if kind == ALL_REDUCE else 1
  payload = nbytes * n / (n - 1) / twice
  t_intra = count * net.intra_latency + twice * (m - 1) / m * payload / net.intra_bandwidth
  t_inter = count * net.inter_latency + twice * (g - 1) / g * payload / m / inter_share
  if net.global_collectives == "overlapped":
    return max(t_intra, t_inter)
  return t_intra + t_inter


def compute_seconds(w: Workload, cluster: Cluster) -> float:
  """Model FLOPs of one step on one device over its FLOP/s x MFU; 0 when FLOP/s is unknown.

  Frozen parameters need no weight gradient: one of the three 2-FLOP matmuls per parameter and
  token (flops_per_token(0) / 3 is that third for all parameters) shrinks by Ψ'/Ψ.
  """
  if not cluster.flop_per_s:
    return 0.0
  frozen = 1 - w.psi_trained / w.psi
  per_token = w.model.flops_per_token(w.seq_len) - frozen * w.model.flops_per_token(0) / 3
  return per_token * w.tokens_per_device / (cluster.flop_per_s * cluster.mfu)


def activation_bytes(strategy: Strategy, w: Workload, inter: int = 1, intra: int = 1) -> dict:
  """Per-device activation memory of one micro-batch with full remat (a rough estimate).

  - boundary: each layer's input, kept for backward: L x b x s x D;
  - layer: one layer's recomputed intermediates and their gradients (x2): q, k, v, attention
    output, gate, up, the two norms, and either the fp32 scores with their probabilities
    (attention written out) or, with the fused kernel, its fp32 softmax statistics per query;
  - logits: fp32 logits and their gradient, b x s x V x 4 x 2;
  - gathered: with P sharded, the full weights of the head and of one layer, two with the
    prefetching layer stack (full remat: this layer's and the next one's); the full gradient of
    one layer before its reduce-scatter, two with the stack (one waits a layer for its
    reduce-scatter);
  - synced_grads: the layers' synced gradients at the OS placement, written while the
    accumulator (at Gr) is still alive: in the last micro-batch's backward on GPUs, at the
    boundary's sync elsewhere. The stack adds each micro-batch's gradients into the accumulator
    in place, so no other gradient buffer of the layer stack is held (engine.py,
    `_make_prefetch_stack`).
  """
  c, b, s, item = w.model, w.micro_batch, w.seq_len, w.itemsize
  q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
  layer_w = w.layer_params // c.layers
  layer_grads = layer_w * w.psi_trained // w.psi
  depth = 2 if w.remat else 1  # the prefetching stack runs with full remat
  # per query and head: a row of fp32 scores and its probabilities, or the kernel's fp32 statistic
  scores = 4 if w.fused_attention else s * (4 + item)
  out = {
    "boundary": c.layers * b * s * c.dim * item,
    "layer": 2
    * (b * s * (2 * q + 2 * kv + 3 * c.mlp + 2 * c.dim) * item + b * c.heads * s * scores),
    "logits": 2 * b * s * c.vocab * 4,
    "gathered": item
    * (
      (strategy.params.name != "N") * (depth * layer_w + c.vocab * c.dim)
      + (depth if w.remat else strategy.grads.name != "N") * layer_grads
    ),
    "synced_grads": w.acc_itemsize
    * c.layers
    * layer_grads
    // strategy.opt.shard_count(inter, intra),
  }
  out["total"] = sum(out.values())
  return out


@dataclasses.dataclass
class Estimate:
  """The planner's prediction for one strategy."""

  strategy: str
  memory: dict  # model_states (params, grads, opt, total), activations (...), total
  fits: bool
  feasible: bool  # the model's sharded dimension divides into the placements
  times: dict  # seconds: compute, param_gathers, grad_traffic, grad_sync, param_sync
  step_time_s: float
  tokens_per_s: float
  traffic: dict  # bytes per device and step: inter, intra, phases (costs.step_traffic)
  collectives: int = 0  # collectives per step
  note: str = ""

  @property
  def memory_bytes(self) -> float:
    return self.memory["total"]

  def as_dict(self) -> dict:
    return {
      "strategy": self.strategy,
      "known_as": KNOWN_NAMES.get(self.strategy),
      "fits": self.fits,
      "feasible": self.feasible,
      "memory_bytes": self.memory_bytes,
      "step_time_s": self.step_time_s,
      "tokens_per_s": self.tokens_per_s,
      "times": self.times,
      "memory": self.memory,
      "traffic": self.traffic,
      "collectives": self.collectives,
      "note": self.note,
    }


PHASE_GROUPS = {
  "forward params": "param_gathers",
  "backward params (remat)": "param_gathers",
  "backward grads": "grad_traffic",
  "grad sync": "grad_sync",
  "param sync": "param_sync",
}


def traffic_of(strategy: Strategy, w: Workload, cluster: Cluster, two_level: bool = False):
  """costs.step_traffic for the workload on the cluster (the bytes every estimate uses);
  `two_level`: each level's bytes of a collective over both axes apart (the two-level rings)."""
  return step_traffic(
    strategy,
    w.psi,
    w.psi_trained,
    cluster.nodes,
    cluster.devices_per_node,
    w.micro_batches,
    w.itemsize,
    w.itemsize,
    regathered=w.layer_params if w.remat else 0,
    wire=w.wire,
    acc_bytes=w.acc_itemsize,
    two_level=two_level,
  )


def estimate(strategy: Strategy, w: Workload, cluster: Cluster) -> Estimate:
  traffic = traffic_of(strategy, w, cluster)
  sched = schedule(strategy, w)
  times = {
    "compute": compute_seconds(w, cluster),
    "param_gathers": 0.0,
    "grad_traffic": 0.0,
    "grad_sync": 0.0,
    "param_sync": 0.0,
  }
  collectives = 0
  for key, nbytes in traffic.phases.items():
    kind, axes, count = sched[key]
    times[PHASE_GROUPS[key.split("/")[0]]] += collective_seconds(kind, axes, nbytes, count, cluster)
    collectives += count
  per_mb = times["param_gathers"] + times["grad_traffic"]
  hidden = cluster.overlap * min(per_mb, times["compute"])
  step = times["compute"] + per_mb - hidden + times["grad_sync"] + times["param_sync"]
  states = model_state_bytes(
    strategy,
    w.psi,
    w.psi_trained,
    cluster.nodes,
    cluster.devices_per_node,
    w.itemsize,
    w.acc_itemsize,
    residual_bytes=feedback_rules.residual_bytes(
      strategy, w.psi_trained, cluster.nodes, cluster.devices_per_node, w.wire, w.acc_itemsize
    ),
    reference_bytes=feedback_rules.reference_bytes(
      strategy, w.psi_trained, cluster.nodes, cluster.devices_per_node, w.wire, w.itemsize
    ),
  )
  acts = activation_bytes(strategy, w, cluster.nodes, cluster.devices_per_node)
  memory = {"model_states": states, "activations": acts, "total": states["total"] + acts["total"]}
  ways = strategy.opt.shard_count(cluster.nodes, cluster.devices_per_node)
  feasible = w.model.dim % ways == 0
  usable = cluster.usable_bytes
  fits = feasible and (usable is None or memory["total"] <= usable)
  note = (
    ""
    if feasible
    else (
      f"the model dimension {w.model.dim} does not split {ways} ways "
      f"(paro_jax shards every leaf along it)"
    )
  )
  tokens = w.tokens_per_device * cluster.devices
  return Estimate(
    strategy.name,
    memory,
    fits,
    feasible,
    times,
    step,
    tokens / step if step > 0 else 0.0,
    {"inter_bytes": traffic.inter, "intra_bytes": traffic.intra, "phases": dict(traffic.phases)},
    collectives,
    note,
  )


# --- the plan ----------------------------------------------------------------------------------
def _named(name: str) -> str:
  return f"{name} ({KNOWN_NAMES[name]})" if name in KNOWN_NAMES else name


@dataclasses.dataclass
class Plan:
  pick: str | None
  explain: str
  ranking: list[Estimate]  # the pick first, then the other fitting ones by step time, then the rest
  inputs: dict

  def get(self, name: str) -> Estimate:
    return next(e for e in self.ranking if e.strategy == name)

  def as_dict(self) -> dict:
    return {
      "pick": self.pick,
      "explain": self.explain,
      "inputs": self.inputs,
      "ranking": [e.as_dict() for e in self.ranking],
    }

  def format(self) -> str:
    lines = [
      f"{'#':>3s} {'strategy':9s}{'known as':13s}{'fits':>5s}{'memory':>11s}"
      f"{'states':>11s}{'step s':>9s}{'compute':>9s}{'gathers':>9s}{'grads':>9s}"
      f"{'grad sync':>10s}{'par sync':>9s}{'tokens/s':>11s}"
    ]
    for i, e in enumerate(self.ranking, 1):
      t = e.times
      fits = "yes" if e.fits else ("n/a" if not e.feasible else "no")
      lines.append(
        f"{i:3d} {e.strategy:9s}{KNOWN_NAMES.get(e.strategy, ''):13s}{fits:>5s}"
        f"{human_bytes(e.memory_bytes):>11s}{human_bytes(e.memory['model_states']['total']):>11s}"
        f"{e.step_time_s:9.3f}{t['compute']:9.3f}{t['param_gathers']:9.3f}"
        f"{t['grad_traffic']:9.3f}{t['grad_sync']:10.3f}{t['param_sync']:9.3f}"
        f"{e.tokens_per_s:11,.0f}"
      )
    return "\n".join(lines + ["", self.explain])


def _explain(
  pick: Estimate | None,
  fastest: Estimate | None,
  fitting: list[Estimate],
  all_: list[Estimate],
  cluster: Cluster,
) -> str:
  usable = cluster.usable_bytes
  room = (
    ""
    if usable is None
    else f" in {human_bytes(usable)} usable per device "
    f"({cluster.usable_memory:.0%} of {human_bytes(cluster.device_memory)})"
  )
  if pick is None:
    lean = min((e for e in all_ if e.feasible), key=lambda e: e.memory_bytes, default=None)
    if lean is None:
      return "nothing fits: no strategy can shard this model on this mesh"
    return (
      f"nothing fits{room}: the leanest, {_named(lean.strategy)}, needs "
      f"{human_bytes(lean.memory_bytes)} per device; use more devices, a smaller "
      f"micro-batch or sequence, or train fewer parameters (LoRA)"
    )
  if len(fitting) == len(all_):
    head = f"all {len(all_)} strategies fit{room}"
  elif all("N" not in e.strategy for e in fitting):
    head = (
      f"memory is tight: only fully sharded strategies (no replicated state) fit{room}: "
      f"{', '.join(e.strategy for e in fitting)}"
    )
  else:
    out = [e.strategy for e in all_ if not e.fits]
    head = (
      f"{len(fitting)} of {len(all_)} strategies fit{room} ({', '.join(out)} "
      f"{'does' if len(out) == 1 else 'do'} not)"
    )
  why = (
    f"pick {_named(pick.strategy)}: {pick.step_time_s:.3f} s/step, "
    f"{pick.tokens_per_s:,.0f} tokens/s, {human_bytes(pick.memory_bytes)} per device"
  )
  if fastest is not pick:
    fewer = fastest.collectives - pick.collectives
    why += f" (within {TIE:.0%} of {fastest.strategy}'s {fastest.step_time_s:.3f} s, with " + (
      f"{fewer:,} fewer collectives per step)" if fewer > 0 else "less memory)"
    )
  tail = []
  rest = [e for e in fitting if e is not pick and e is not fastest]
  if rest:
    tail.append(f"next {rest[0].strategy} {rest[0].step_time_s / pick.step_time_s - 1:+.1%}")
  for ref in ("GGG", "NGG"):
    e = next(x for x in all_ if x.strategy == ref)
    if e is not pick and e.fits:
      tail.append(f"{e.step_time_s / pick.step_time_s:.2f}x the speed of {_named(ref)}")
  costs = {k: v for k, v in pick.times.items() if k != "compute"}
  top = max(costs, key=costs.get)
  if costs[top] > 0:
    tail.append(f"its largest cost after compute is {top.replace('_', ' ')} ({costs[top]:.3f} s)")
  return f"{head}; {why}" + ("; " + "; ".join(tail) if tail else "")


def tie_break(candidates: list[Estimate]) -> Estimate:
  """The fastest; within TIE of it, the fewest collectives per step, then the least memory."""
  fastest = min(candidates, key=lambda e: e.step_time_s)
  near = [e for e in candidates if e.step_time_s <= fastest.step_time_s * (1 + TIE)]
  return min(near, key=lambda e: (e.collectives, e.memory_bytes, e.step_time_s))


def plan(w: Workload, cluster: Cluster, inputs: dict | None = None) -> Plan:
  """Estimate all 14 strategies and pick one (see the module docstring)."""
  all_ = [estimate(parse_strategy(name), w, cluster) for name in VALID_NAMES]
  fitting = sorted((e for e in all_ if e.fits), key=lambda e: e.step_time_s)
  fastest = fitting[0] if fitting else None
  pick = None
  if fastest:
    pick = tie_break(fitting)
  others = sorted((e for e in all_ if not e.fits), key=lambda e: (not e.feasible, e.step_time_s))
  ranking = ([pick] if pick else []) + [e for e in fitting if e is not pick] + others
  return Plan(
    pick.strategy if pick else None,
    _explain(pick, fastest, fitting, all_, cluster),
    ranking,
    inputs or {},
  )


# --- profiles ------------------------------------------------------------------------------------
def load_profile(path: str) -> dict:
  """A `paro-jax probe` JSON; clear errors for a missing or malformed file."""
  try:
    with open(path) as f:
      profile = json.load(f)
  except FileNotFoundError:
    raise ValueError(
      f"profile {path!r} does not exist: write one with `paro-jax probe --out {path}`"
    ) from None
  except json.JSONDecodeError as e:
    raise ValueError(
      f"profile {path!r} is not JSON ({e}); write it with `paro-jax probe`"
    ) from None
  if not isinstance(profile, dict) or not isinstance(profile.get("collectives"), dict):
    raise ValueError(f"profile {path!r} has no 'collectives' table; write it with `paro-jax probe`")
  return profile


def measured_links(profile: dict) -> dict:
  """{(collective, level): (bandwidth, latency)} of a profile, for Links.measured."""
  out = {}
  for kind, levels in profile.get("collectives", {}).items():
    for level, fit in levels.items():
      if kind in SCHEDULE_COLLECTIVES and level in LEVELS and fit.get("bandwidth", 0) > 0:
        out[(kind, level)] = (float(fit["bandwidth"]), max(0.0, float(fit.get("latency", 0.0))))
  return out


def choose_strategy(
  model,
  inter: int,
  intra: int,
  micro_batch: int,
  micro_batches: int,
  seq_len: int,
  itemsize: int,
  profile: dict,
  params: int | None = None,
  trainable: int | None = None,
  device_memory: float | None = None,
  collectives: str = "xla",
  remat: bool = True,
  fused_attention: bool = False,
) -> tuple[str, str]:
  """`train --strategy auto`: the planner's pick for this run, from a probe of its own mesh.

  Everything the profile measured on this mesh is used; what it lacks (a level of size 1 moves
  nothing) takes the defaults. Raises ValueError when nothing fits.
  """
  measured = measured_links(profile)
  network = Links(
    inter_bandwidth=12.5e9,
    intra_bandwidth=300e9,
    global_collectives=GLOBAL_MODEL_OF.get(collectives, "flat"),
    measured=measured,
  )
  cluster = Cluster(
    inter,
    intra,
    network,
    flop_per_s=profile.get("flop_per_s"),
    mfu=DEFAULT_MFU,
    device_memory=device_memory,
  )
  w = Workload(
    model,
    micro_batch,
    micro_batches,
    seq_len,
    params,
    trainable,
    itemsize,
    remat,
    fused_attention=fused_attention,
  )
  p = plan(w, cluster)
  if p.pick is None:
    raise ValueError(f"--strategy auto: {p.explain}")
  return p.pick, p.explain


def run_plan(
  model: str,
  nodes: int,
  devices_per_node: int,
  gpu: str = "a100-80gb",
  device_memory: str | None = None,
  peak_tflops: float | None = None,
  mfu: float = DEFAULT_MFU,
  inter_bandwidth: str = "100gbit",
  intra_bandwidth: str = "300GB/s",
  inter_latency: str = "50us",
  intra_latency: str = "10us",
  micro_batch: int = 1,
  micro_batches: int = 8,
  seq_len: int = 2048,
  trainable_fraction: float = 1.0,
  dtype: str = "bf16",
  collectives: str = "xla",
  overlap: float = 0.0,
  usable_memory: float = USABLE_MEMORY,
  profile: str | None = None,
  as_json: bool = False,
  inter_params: str = "same",
  inter_grads: str = "same",
  int8_block: int = DEFAULT_INT8_BLOCK,
  grad_dtype: str = "compute",
  attention: str = "auto",
) -> Plan:
  """`paro-jax plan`: build the inputs from the command line's strings, plan, print."""
  from models.config import get_config, resolve_attention  # no jax

  gpu = gpu.strip().lower()  # names compare case-insensitively (--gpu H100)
  if gpu not in GPUS:
    raise ValueError(
      f"unknown --gpu {gpu!r}; choose one of {', '.join(GPUS)} (or give "
      f"--device-memory and --peak-tflops)"
    )
  if not 0 < trainable_fraction <= 1:
    raise ValueError(
      f"--trainable-fraction must be in (0, 1] (1: full training, e.g. 0.003 for "
      f"LoRA), got {trainable_fraction}"
    )
  itemsize = COMPUTE_DTYPE_BYTES.get(dtype)
  if itemsize is None:
    raise ValueError(f"unknown --dtype {dtype!r}; choose bf16 or fp32")
  cfg = get_config(model)
  card = GPUS[gpu]
  memory = parse_size(device_memory, "--device-memory") if device_memory else card.memory_bytes
  flops = peak_tflops * 1e12 if peak_tflops else card.peak_flops
  if peak_tflops is not None and peak_tflops <= 0:
    raise ValueError(f"--peak-tflops must be positive, got {peak_tflops}")
  prof = load_profile(profile) if profile else {}
  if prof.get("flop_per_s") and not peak_tflops:
    flops = prof["flop_per_s"]
  if prof.get("device_memory") and not device_memory:  # the probed devices', not the --gpu's
    memory = prof["device_memory"]
  network = Links(
    parse_bandwidth(inter_bandwidth, "--inter-bandwidth"),
    parse_bandwidth(intra_bandwidth, "--intra-bandwidth"),
    parse_latency(inter_latency, "--inter-latency"),
    parse_latency(intra_latency, "--intra-latency"),
    GLOBAL_MODEL_OF[collectives],
    measured_links(prof),
  )
  cluster = Cluster(nodes, devices_per_node, network, flops, mfu, memory, usable_memory, overlap)
  psi = cfg.param_count()
  if grad_dtype not in ("compute", "fp32"):
    raise ValueError(f"unknown --grad-dtype {grad_dtype!r}; choose compute or fp32")
  w = Workload(
    cfg,
    micro_batch,
    micro_batches,
    seq_len,
    psi,
    max(1, round(trainable_fraction * psi)),
    itemsize,
    wire=WireConfig(inter_params, inter_grads, int8_block),
    grad_itemsize=4 if grad_dtype == "fp32" else itemsize,
    # the plan is for GPUs: --attention as a run on them resolves it
    fused_attention=resolve_attention(
      attention, "cuda", "bfloat16" if itemsize == 2 else "float32", cfg.head_dim
    )[0]
    == "cudnn",
  )
  inputs = {
    "model": model,
    "params": psi,
    "trainable": w.psi_trained,
    "nodes": nodes,
    "devices_per_node": devices_per_node,
    "gpu": card.name,
    "device_memory_bytes": memory,
    "usable_memory": usable_memory,
    "flop_per_s": flops,
    "mfu": mfu,
    "inter_bandwidth_bytes_per_s": network.inter_bandwidth,
    "intra_bandwidth_bytes_per_s": network.intra_bandwidth,
    "inter_latency_s": network.inter_latency,
    "intra_latency_s": network.intra_latency,
    "collectives": collectives,
    "global_collectives": network.global_collectives,
    "micro_batch": micro_batch,
    "micro_batches": micro_batches,
    "seq_len": seq_len,
    "dtype": dtype,
    "inter_params": inter_params,
    "inter_grads": inter_grads,
    "int8_block": int8_block,
    "grad_dtype": grad_dtype,
    "overlap": overlap,
    "profile": profile,
    "measured": sorted(f"{k}/{lvl}" for k, lvl in network.measured),
  }
  p = plan(w, cluster, inputs)
  if as_json:
    print(json.dumps(p.as_dict(), indent=2))
  else:
    frac = "" if trainable_fraction == 1 else f", {w.psi_trained / 1e6:,.1f}M trainable"
    probed = " (profile)" if prof.get("device_memory") and not device_memory else ""
    src = "--peak-tflops" if peak_tflops else "profile" if prof.get("flop_per_s") else card.name
    print(
      f"{model} ({human_count(psi)} params{frac}) on {nodes} nodes x {devices_per_node} devices "
      f"of {human_bytes(memory)}{probed}, {flops / 1e12:.3g} TFLOP/s peak ({src}) x MFU "
      f"{mfu:g}; inter "
      f"{network.inter_bandwidth * 8 / 1e9:g} Gbit/s per node, intra "
      f"{network.intra_bandwidth / 1e9:g} GB/s per device, global collectives "
      f"{network.global_collectives} (--collectives {collectives}); A={micro_batches} "
      f"micro-batches of {micro_batch} x {seq_len} tokens per device"
      + (f"; measured links from {profile}: {', '.join(inputs['measured'])}" if profile else "")
    )
    print("memory = model states + activations per device; times in seconds per optimizer step\n")
    print(p.format())
  return p
