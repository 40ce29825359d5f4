"""The planner's model of one strategy's step: time per phase, memory, fit.

Pure Python (no jax), so a laptop can plan a 128-GPU run. For every strategy:

- traffic: `costs.step_traffic`, bytes each device sends per optimizer step and phase (the one
  formula, docs/design.md's; nothing here re-derives it);
- time of a phase: bytes / bandwidth of its level + latency x collectives. A collective over
  `intra` runs at the intra bandwidth; one over `inter` at each device's share of its node's
  link (node bandwidth / devices per node: all devices of a node send at once). One over both
  axes (global) is modelled by `global_collectives`: "flat" (docs/design.md: every device's ring
  bytes cross the node link at its share; what XLA:CPU over gloo does, checked on the wire by tc
  in the strategy benchmark), "hierarchical" (an intra part, then an inter part carrying 1/m of the
  payload: paro_jax's hring), "overlapped" (the two parts at once: horing) or "rings" (NCCL's
  rings over all devices, one per NIC: a node's link carries each device's ring bytes once, the
  NVLink hops beside them; as XLA's cost model prices NCCL's collectives). A probe profile
  replaces any of these by measured (bandwidth, latency) per
  (collective, level);
- compute: model FLOPs (`LlamaConfig.flops_per_token`, 6 per parameter and token, less the
  weight-gradient third for frozen parameters) / (peak FLOP/s x MFU). Communication and compute
  add up (no overlap) unless `overlap` says what fraction of the per-micro-batch traffic hides
  behind compute; the boundary syncs never overlap;
- memory: memory.step_memory, the one model of a run's memory (model states 2Ψ/f(P) + 2Ψ'/f(Gr)
  + 12Ψ'/f(OS), the int8 corrections' buffers, activations); a strategy fits when that is at most
  `usable_memory`
  (0.9) of the device memory, leaving room for the CUDA context, communication buffers and
  fragmentation. JAX preallocates 75% of a GPU by default: raise XLA_PYTHON_CLIENT_MEM_FRACTION
  (e.g. to 0.95) for plans that need more.

The pick among the strategies is planner.py's.
"""

from __future__ import annotations

import dataclasses

from models.config import vocab_passes  # no jax
from paro_jax.analysis.planner.costs import (
  OUTER_PHASES,
  outer_phase_axes,
  outer_round_traffic,
  step_traffic,
)
from paro_jax.analysis.planner.memory import step_memory
from paro_jax.analysis.planner.inputs import LEAVES_PER_LAYER, OTHER_LEAVES, Cluster, Workload
from paro_jax.core.names import (
  ALL_GATHER,
  ALL_REDUCE,
  INTER,
  INTRA,
  LEVEL_GLOBAL,
  LEVEL_INTER,
  LEVEL_INTRA,
  REDUCE_SCATTER,
)
from paro_jax.core.strategy import KNOWN_NAMES, GroupStrategy, Strategy
from paro_jax.core.wire import WireConfig


def _level(axes: tuple[str, ...]) -> str:
  """The link level a collective over mesh `axes` (one or both) spans."""
  return LEVEL_GLOBAL if len(axes) == 2 else {INTRA: LEVEL_INTRA, INTER: LEVEL_INTER}[axes[0]]


def phase_collectives(
  strategy: Strategy, w: Workload
) -> dict[str, tuple[str, tuple[str, ...], int]]:
  """`costs.step_traffic` phase key ('phase/level') -> (collective, mesh axes, collectives per
  step), from the strategy's letters; phases without axes move nothing."""
  s, a, layers = strategy, w.micro_batches, w.model.layers
  # the layers' leaves and the final norm, then the table's and head's passes: one collective
  # per vocabulary tile and pass (models/config.py VocabPasses)
  v, stack = vocab_passes(w.model), LEAVES_PER_LAYER * layers
  stacked = LEAVES_PER_LAYER + OTHER_LEAVES
  items = [
    ("forward params", s.param_gather_axes, ALL_GATHER, a * (stack + 1 + v.forward * v.tiles)),
    (
      "backward params (remat)",
      s.param_gather_axes,
      ALL_GATHER,
      a * (stack + v.backward * v.tiles),
    ),
    (
      "backward grads",
      s.grad_scatter_axes,
      REDUCE_SCATTER,
      a * (stack + 1 + v.scattered * v.tiles),
    ),
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
  if net.global_collectives == "rings":  # the slowest link of a pipelined ring sets its pace
    over_nodes = count * net.inter_latency + nbytes / net.inter_bandwidth
    return max(over_nodes, count * net.intra_latency + nbytes / net.intra_bandwidth)
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


@dataclasses.dataclass
class Prediction:
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
  outer_sync: int | None = None  # H of the outer loop (DiLoCo) the step runs in; None: off
  outer_state: str | None = None  # where its outer state lives (--outer-state G or I); None: off

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
      **({"outer_sync": self.outer_sync} if self.outer_sync else {}),
      **({"outer_state": self.outer_state} if self.outer_sync else {}),
    }


PHASE_GROUPS = {
  "forward params": "param_gathers",
  "backward params (remat)": "param_gathers",
  "backward grads": "grad_traffic",
  "grad sync": "grad_sync",
  "param sync": "param_sync",
}


def traffic_of(strategy: Strategy, w: Workload, cluster: Cluster, two_level: bool = False):
  """costs.step_traffic for the workload on the cluster (the bytes every prediction uses);
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
    vocab_extra=vocab_passes(w.model).beyond_stored(trained=w.psi_trained == w.psi),
  )


def predict(strategy: Strategy, w: Workload, cluster: Cluster) -> Prediction:
  """The step of `strategy`; with `w.outer_sync` (H) the step of each group in the outer loop
  (`predict_outer`)."""
  if w.outer_sync:
    return predict_outer(strategy, w, cluster)
  traffic = traffic_of(strategy, w, cluster)
  sched = phase_collectives(strategy, w)
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
  memory = step_memory(strategy, w, cluster.nodes, cluster.devices_per_node)
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
  return Prediction(
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


def outer_round(strategy: GroupStrategy, w: Workload, cluster: Cluster):
  """(traffic, seconds, collectives, the busiest sync step's seconds) of one round of the outer
  loop (costs.outer_round_traffic), each of its collectives priced by `collective_seconds`
  as the step's are: one collective per stacked leaf (the round syncs the 12 leaves, core/
  outer.py). A compressed collective over both axes runs as two levels (costs._add_collective),
  each priced at its own level, as phase_collectives does for the step. With F =
  `w.outer_fragments` (core/fragments.py) each fragment's sync step moves 1/F of the bytes (the
  planner splits them evenly: a fragment holds 1/F of the layers and of the embedding's and the
  head's vocabulary, the last also the final norm) on a slice of the 9 leaves of the layer stack
  and of the embedding and the head, the last fragment's also on the norm: the round is F such
  steps."""
  state = w.outer_state
  traffic = outer_round_traffic(
    strategy, w.psi_trained, cluster.nodes, cluster.devices_per_node, w.wire, state=state
  )
  kinds = {p: kind for p, kind, _ in OUTER_PHASES[state]}
  phases = [key.split("/")[0] for key in traffic.phases]
  frags = w.outer_fragments
  seconds, collectives, busiest = 0.0, 0, 0.0
  for f in range(frags):
    count = LEAVES_PER_LAYER + OTHER_LEAVES - (f < frags - 1)  # the norm: the last fragment's
    step = 0.0
    for key, nbytes in traffic.phases.items():
      phase, level = key.split("/")
      axes = (level,) if phases.count(phase) == 2 else outer_phase_axes(strategy, state, phase)
      step += collective_seconds(kinds[phase], axes, nbytes / frags, count, cluster)
      collectives += count
    seconds, busiest = seconds + step, max(busiest, step)
  return traffic, seconds, collectives, busiest


def predict_outer(strategy: Strategy, w: Workload, cluster: Cluster) -> Prediction:
  """A step of the outer loop (DiLoCo, core/outer.py) with `strategy` (N and I letters) as each
  group's step, every H = `w.outer_sync` steps a round's end: the group's step has no
  collective across nodes (its traffic is `step_traffic` of the GroupStrategy, inside the node),
  and the round's three collectives (`outer_round`, in F fragments' sync steps with
  `w.outer_fragments`) cost 1/H of their bytes and time per step
  (`times["outer_sync"]`, never overlapped). The groups' few metrics floats summed across
  nodes each step are left out, as the synchronous steps' loss sums are. Memory: step_memory
  with the outer state."""
  inner = GroupStrategy.of(strategy)  # refuses a G placement
  h = w.outer_sync
  step_w = dataclasses.replace(
    w,
    wire=WireConfig(),
    error_feedback=None,
    param_delta=None,
    outer_sync=None,
    outer_fragments=1,
    outer_delay=0,
  )
  base = predict(inner, step_w, cluster)
  traffic, seconds, collectives, busiest = outer_round(inner, w, cluster)
  times = {**base.times, "outer_sync": seconds / h}
  step = base.step_time_s + times["outer_sync"]
  phases = dict(base.traffic["phases"])
  for key, nbytes in traffic.phases.items():
    phases[key] = nbytes / h
  memory = step_memory(inner, w, cluster.nodes, cluster.devices_per_node)
  usable = cluster.usable_bytes
  tokens = w.tokens_per_device * cluster.devices
  return dataclasses.replace(
    base,
    memory=memory,
    fits=base.feasible and (usable is None or memory["total"] <= usable),
    times=times,
    step_time_s=step,
    tokens_per_s=tokens / step if step > 0 else 0.0,
    traffic={
      "inter_bytes": base.traffic["inter_bytes"] + traffic.inter / h,
      "intra_bytes": base.traffic["intra_bytes"] + traffic.intra / h,
      "phases": phases,
      "outer_round": {
        "inter_bytes": traffic.inter,
        "intra_bytes": traffic.intra,
        "seconds": seconds,
        # --outer-fragments F: a sync step moves one fragment's share (all of it for F = 1)
        "fragments": w.outer_fragments,
        "busiest_step": {
          "inter_bytes": traffic.inter / w.outer_fragments,
          "intra_bytes": traffic.intra / w.outer_fragments,
          "seconds": busiest,
        },
      },
    },
    collectives=base.collectives + collectives / h,
    outer_sync=h,
    outer_state=w.outer_state,
  )
