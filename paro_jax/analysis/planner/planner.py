"""`paro-jax plan` and `train --strategy auto`: rank the 14 strategies by predicted step time.

The inputs (cluster, links, workload) are in inputs.py, the model of one strategy's step time
in step_model.py (its docstring states the model) and of its memory in memory.py, probe profiles
in profile.py, the check of the ranking by XLA's estimate (`--target`) in rerank.py.

With the outer loop (`--outer-sync H`, DiLoCo: core/outer.py) the candidates are the strategies
of N and I letters as each group's step (step_model.predict_outer: the round's bytes and time
once every H steps); the 14 synchronous strategies are predicted beside them (`synchronous`), for
comparison only: they train another way, and the planner knows speed, not loss.

The pick is the fastest strategy that fits. Predictions within `TIE` (1%) of the fastest are a tie
the model cannot resolve (e.g. ING, INI and IIG with few trainable parameters); among those it
takes the one with the fewest collectives per step (per-collective overhead is the least certain
part of the model), then the least memory.
"""

from __future__ import annotations

import dataclasses
import json

from models.config import resolve_attention  # no jax
from models.presets import get_config  # no jax
from paro_jax.analysis.gpu.hardware import GPUS
from paro_jax.analysis.gpu.targets import TARGETS
from paro_jax.analysis.planner import rerank  # no jax at import
from paro_jax.analysis.planner.config import PlanConfig
from paro_jax.analysis.planner.inputs import (
  DEFAULT_MFU,
  GLOBAL_MODEL_OF,
  TIE,
  Cluster,
  Links,
  Workload,
)
from paro_jax.analysis.planner.profile import load_profile, measured_links
from paro_jax.analysis.planner.step_model import Prediction, predict
from paro_jax.analysis.planner.wording import explain_pick, format_plan, strategy_named
from paro_jax.analysis.planner.memory import outer_state_for
from paro_jax.core.names import AUTO_OUTER_STATE, OUTER_ONLY_FORMATS
from paro_jax.core.strategy import GROUP_NAMES, VALID_NAMES, GroupStrategy, parse_strategy
from paro_jax.core.wire import WireConfig  # no jax
from paro_jax.core.units import (
  COMPUTE_DTYPE_BYTES,
  human_bytes,
  human_count,
  parse_bandwidth,
  parse_latency,
  parse_size,
)


# --- the plan ----------------------------------------------------------------------------------
@dataclasses.dataclass
class Plan:
  pick: str | None
  explain: str
  ranking: list[
    Prediction
  ]  # the pick first, then the other fitting ones by step time, then the rest
  inputs: dict
  xla: dict | None = None  # --compile-top: the candidates' XLA estimates (rerank.py)
  # with the outer loop: the 14 synchronous strategies, fitting ones first by step time
  synchronous: list[Prediction] | None = None

  def get(self, name: str) -> Prediction:
    return next(e for e in self.ranking if e.strategy == name)

  def as_dict(self) -> dict:
    return {
      "pick": self.pick,
      "explain": self.explain,
      "inputs": self.inputs,
      "ranking": [e.as_dict() for e in self.ranking],
      **({"xla": self.xla} if self.xla is not None else {}),
      **(
        {"synchronous": [e.as_dict() for e in self.synchronous]}
        if self.synchronous is not None
        else {}
      ),
    }

  def format(self) -> str:
    return format_plan(self.ranking, self.synchronous, self.explain)


def tie_break(candidates: list[Prediction]) -> Prediction:
  """The fastest; within TIE of it, the fewest collectives per step, then the least memory."""
  fastest = min(candidates, key=lambda e: e.step_time_s)
  near = [e for e in candidates if e.step_time_s <= fastest.step_time_s * (1 + TIE)]
  return min(near, key=lambda e: (e.collectives, e.memory_bytes, e.step_time_s))


def _rank(all_: list[Prediction]) -> tuple[Prediction | None, Prediction | None, list, list]:
  """(pick, fastest, fitting, ranking): the pick first, then the other fitting ones by step
  time, then the rest."""
  fitting = sorted((e for e in all_ if e.fits), key=lambda e: e.step_time_s)
  fastest = fitting[0] if fitting else None
  pick = tie_break(fitting) if fastest else None
  others = sorted((e for e in all_ if not e.fits), key=lambda e: (not e.feasible, e.step_time_s))
  return (
    pick,
    fastest,
    fitting,
    ([pick] if pick else []) + [e for e in fitting if e is not pick] + others,
  )


def _at_outer_state(name: str, w: Workload, cluster: Cluster) -> Workload:
  """`w` with --outer-state auto resolved for strategy `name` (memory.outer_state_for: I where
  it fits, the rule `train --outer-state auto` follows)."""
  if not w.outer_sync or w.outer_state != AUTO_OUTER_STATE:
    return w
  s, usable = GroupStrategy.of(parse_strategy(name)), cluster.usable_bytes
  state = outer_state_for(s, w, cluster.nodes, cluster.devices_per_node, usable)
  return dataclasses.replace(w, outer_state=state)


def plan(w: Workload, cluster: Cluster, inputs: dict | None = None) -> Plan:
  """Predict all 14 strategies and pick one (see the module docstring); with `w.outer_sync`
  the strategies of N and I letters in the outer loop, the 14 synchronous ones beside them."""
  names = GROUP_NAMES if w.outer_sync else VALID_NAMES
  all_ = [
    predict(parse_strategy(name), _at_outer_state(name, w, cluster), cluster) for name in names
  ]
  pick, fastest, fitting, ranking = _rank(all_)
  explain = explain_pick(pick, fastest, fitting, all_, cluster)
  if not w.outer_sync:
    return Plan(pick.strategy if pick else None, explain, ranking, inputs or {})
  # The synchronous steps' gradients take int8 where the pseudo-gradient's format is the outer
  # loop's own (int4): what train would run them with.
  grads = "int8" if w.wire.grads in OUTER_ONLY_FORMATS else w.wire.grads
  params = "int8" if w.wire.params in OUTER_ONLY_FORMATS else w.wire.params
  wire = dataclasses.replace(w.wire, grads=grads, params=params)
  sync = [
    predict(parse_strategy(n), dataclasses.replace(w, outer_sync=None, wire=wire), cluster)
    for n in VALID_NAMES
  ]
  best, _, _, synchronous = _rank(sync)
  explain = f"DiLoCo (--outer-sync {w.outer_sync}), {explain}"
  if pick is None:  # more nodes do not help: each node holds a whole replica
    explain += (
      "; in the outer loop each node holds a whole replica (N and I placements only): use "
      "more devices per node, or drop --outer-sync for a strategy that shards over all devices"
    )
  if pick is not None and w.outer_state == AUTO_OUTER_STATE:
    explain += f"; --outer-state auto: the pick's outer state at {pick.outer_state}"
  if pick is not None and w.outer_fragments > 1:
    busiest = pick.traffic["outer_round"]["busiest_step"]
    explain += (
      f"; in {w.outer_fragments} fragments its busiest sync step moves "
      f"{human_bytes(busiest['inter_bytes'])} per device across nodes in "
      f"{busiest['seconds']:.3f} s (1/{w.outer_fragments} of the round)"
    )
  if pick is not None and best is not None:
    explain += (
      f"; the fastest synchronous strategy{' (int8 on its wire)' if wire != w.wire else ''}, "
      f"{strategy_named(best.strategy)}, "
      f"{best.step_time_s:.3f} s/step: DiLoCo's pick is {best.step_time_s / pick.step_time_s:.2f}x "
      f"its speed (at what loss is not the planner's to say: measure it)"
    )
  return Plan(
    pick.strategy if pick else None, explain, ranking, inputs or {}, synchronous=synchronous
  )


def plan_for_profile(
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
  wire: WireConfig | None = None,
  grad_itemsize: int | None = None,
  outer_sync: int | None = None,
  outer_fragments: int = 1,
  outer_delay: int = 0,
  outer_state: str = "G",
) -> Plan:
  """`train --strategy auto`: the plan for this run, from a probe of its own mesh (with
  `outer_sync`, among the strategies each group can run in the outer loop).

  Everything the profile measured on this mesh is used; what it lacks (a level of size 1 moves
  nothing) takes the defaults. `inputs` holds what plan_compile needs to hold compiled programs
  to the same memory budget.
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
    wire=wire or WireConfig(),
    grad_itemsize=grad_itemsize,
    outer_sync=outer_sync,
    outer_fragments=outer_fragments,
    outer_delay=outer_delay,
    outer_state=outer_state,
  )
  inputs = {
    "nodes": inter,
    "devices_per_node": intra,
    "device_memory_bytes": float("inf") if device_memory is None else device_memory,
    "usable_memory": cluster.usable_memory,
    "measured": sorted(f"{k}/{lvl}" for k, lvl in measured),
  }
  return plan(w, cluster, inputs)


def run_plan(cfg: PlanConfig) -> Plan:
  """`paro-jax plan`: build the inputs from the command line's strings, plan, print.

  With `cfg.target` (a GPU of `inspect --target`), the GPU is that target's and the top
  `cfg.compile_top` strategies are compiled for it and re-ranked by XLA's estimate
  (rerank.py).
  """
  # PlanConfig checked the values; --target is checked here (it needs JAX's CUDA plugin).
  target, gpu = cfg.target, cfg.gpu
  if target is not None:
    target = rerank.rankable_target(target)
    gpu = TARGETS[target][1]
  itemsize = COMPUTE_DTYPE_BYTES[cfg.dtype]
  model_cfg = get_config(cfg.model)
  card = GPUS[gpu]
  device_memory, peak_tflops = cfg.device_memory, cfg.peak_tflops
  memory = parse_size(device_memory, "--device-memory") if device_memory else card.memory_bytes
  flops = peak_tflops * 1e12 if peak_tflops else card.peak_flops
  prof = load_profile(cfg.profile) if cfg.profile else {}
  if prof.get("flop_per_s") and not peak_tflops:
    flops = prof["flop_per_s"]
  if prof.get("device_memory") and not device_memory:  # the probed devices', not the --gpu's
    memory = prof["device_memory"]
  network = Links(
    parse_bandwidth(cfg.inter_bandwidth, "--inter-bandwidth"),
    parse_bandwidth(cfg.intra_bandwidth, "--intra-bandwidth")
    if cfg.intra_bandwidth
    else card.intra_bandwidth,
    parse_latency(cfg.inter_latency, "--inter-latency"),
    parse_latency(cfg.intra_latency, "--intra-latency"),
    GLOBAL_MODEL_OF[cfg.collectives],
    measured_links(prof),
  )
  cluster = Cluster(
    cfg.nodes,
    cfg.devices_per_node,
    network,
    flops,
    cfg.mfu,
    memory,
    cfg.usable_memory,
    cfg.overlap,
  )
  psi = model_cfg.param_count()
  if cfg.outer_fragments > model_cfg.layers:  # train's check (core/fragments.py), its words
    raise ValueError(
      f"--outer-fragments {cfg.outer_fragments} splits the layer stack into fragments, and the "
      f"model has {model_cfg.layers} layers: pass at most {model_cfg.layers}"
    )
  w = Workload(
    model_cfg,
    cfg.micro_batch,
    cfg.micro_batches,
    cfg.seq_len,
    psi,
    max(1, round(cfg.trainable_fraction * psi)),
    itemsize,
    wire=cfg.wire.formats(),
    grad_itemsize=cfg.wire.grad_itemsize(itemsize),
    outer_sync=cfg.outer_sync,
    outer_fragments=cfg.outer_fragments,
    outer_delay=cfg.outer_delay,
    outer_state=cfg.outer_state,
    # the plan is for GPUs: --attention as a run on them resolves it
    fused_attention=resolve_attention(
      cfg.attention, "cuda", "bfloat16" if itemsize == 2 else "float32", model_cfg.head_dim
    )[0]
    == "cudnn",
  )
  inputs = {
    "model": cfg.model,
    "params": psi,
    "trainable": w.psi_trained,
    "nodes": cfg.nodes,
    "devices_per_node": cfg.devices_per_node,
    "gpu": card.name,
    "device_memory_bytes": memory,
    "usable_memory": cfg.usable_memory,
    "flop_per_s": flops,
    "mfu": cfg.mfu,
    "inter_bandwidth_bytes_per_s": network.inter_bandwidth,
    "intra_bandwidth_bytes_per_s": network.intra_bandwidth,
    "inter_latency_s": network.inter_latency,
    "intra_latency_s": network.intra_latency,
    "collectives": cfg.collectives,
    "global_collectives": network.global_collectives,
    "micro_batch": cfg.micro_batch,
    "micro_batches": cfg.micro_batches,
    "seq_len": cfg.seq_len,
    "dtype": cfg.dtype,
    "inter_params": cfg.wire.inter_params,
    "inter_grads": cfg.wire.inter_grads,
    "int8_block": cfg.wire.int8_block,
    "grad_dtype": cfg.wire.grad_dtype,
    "overlap": cfg.overlap,
    "outer_sync": cfg.outer_sync,
    "outer_fragments": cfg.outer_fragments,
    "outer_delay": cfg.outer_delay,
    "outer_state": cfg.outer_state,
    "profile": cfg.profile,
    "measured": sorted(f"{k}/{lvl}" for k, lvl in network.measured),
  }
  p = plan(w, cluster, inputs)
  if target is not None:
    p.xla = rerank.rerank(p, cfg.compile_top, target, cfg.attention)
  if cfg.as_json:
    print(json.dumps(p.as_dict(), indent=2))
  else:
    frac = "" if cfg.trainable_fraction == 1 else f", {w.psi_trained / 1e6:,.1f}M trainable"
    probed = " (profile)" if prof.get("device_memory") and not device_memory else ""
    src = "--peak-tflops" if peak_tflops else "profile" if prof.get("flop_per_s") else card.name
    print(
      f"{cfg.model} ({human_count(psi)} params{frac}) on {cfg.nodes} nodes x "
      f"{cfg.devices_per_node} devices of {human_bytes(memory)}{probed}, {flops / 1e12:.3g} "
      f"TFLOP/s peak ({src}) x MFU {cfg.mfu:g}; inter "
      f"{network.inter_bandwidth * 8 / 1e9:g} Gbit/s per node, intra "
      f"{network.intra_bandwidth / 1e9:g} GB/s per device"
      f"{'' if cfg.intra_bandwidth else f' ({card.name} {card.intra_link})'}, global collectives "
      f"{network.global_collectives} (--collectives {cfg.collectives}); A={cfg.micro_batches} "
      f"micro-batches of {cfg.micro_batch} x {cfg.seq_len} tokens per device"
      + (
        f"; measured links from {cfg.profile}: {', '.join(inputs['measured'])}"
        if cfg.profile
        else ""
      )
      + (
        f"; DiLoCo: the groups sync every {cfg.outer_sync} steps, the pseudo-gradient on the "
        f"wire as --inter-grads {cfg.wire.inter_grads}, the outer state at {cfg.outer_state}"
        + (
          f", in {cfg.outer_fragments} fragments (a sync step moves 1/{cfg.outer_fragments} "
          f"of the round)"
          if cfg.outer_fragments > 1
          else ""
        )
        + (f", --outer-delay {cfg.outer_delay}'s kept weights in memory" if cfg.outer_delay else "")
        if cfg.outer_sync
        else ""
      )
    )
    print("memory = model states + activations per device; times in seconds per optimizer step\n")
    print(p.format())
    if p.xla is not None:
      print("\n" + rerank.format_rerank(p, p.xla))
  return p
