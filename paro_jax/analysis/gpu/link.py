"""The step with the node's inter-node link shared among the collectives in flight.

XLA's network model (paro_jax/analysis/gpu/estimate.py) gives each collective in flight the
GPU's whole share of its node's link, so its step can be shorter than the link allows
(`estimate.link_floor`). `link_shared` gives the least a re-simulation of the schedule with
the link shared can give, from the scheduled step (estimate.compose), the floor and, where the
scheduled HLO allows, the link's time split by the computation issuing it
(`link_by_computation`); `inspect --target`, `plan --compile-top` and `train --strategy auto`
report and rank by it.
"""

from __future__ import annotations

# What set the step of `link_shared`: XLA's schedule, or the link's share carrying the step's
# inter-node bytes (the floor).
BOUND_SCHEDULE, BOUND_LINK = "schedule", "link"


def link_by_computation(
  hlo_text: str, nodes: int, gpus_per_node: int, inter_bits_per_s: float
) -> dict[str, float] | None:
  """Seconds per step the link is busy for the collectives issued in each computation (their
  bytes across nodes as link_floor counts them, over the GPU's share); the values add up to
  link_floor's `inter_link_s`. None where an inter-node collective is in flight across a loop or
  a call (a `while`, `call` or `conditional` between its start and done): its bytes may then
  cross while another computation runs, and only the step as a whole bounds them."""
  from paro_jax.analysis.hlo import collectives, overlap  # the HLO parsers, at use
  from paro_jax.core.names import LEVEL_GLOBAL, LEVEL_INTER

  devices = nodes * gpus_per_node
  share = inter_bits_per_s / 8 / gpus_per_node
  crossing = {LEVEL_INTER: 1.0, LEVEL_GLOBAL: (nodes - 1) / (devices - 1) if devices > 1 else 0}
  ops: dict[str, list[str]] = {}  # computation -> its instructions' ops, in schedule order
  for comp, _, instr in collectives.walk(hlo_text):
    ops.setdefault(comp, []).extend([] if instr is None else [instr[2]])
  windows = overlap.collective_windows(hlo_text)
  out: dict[str, float] = {}
  for c in collectives.parse_collectives(hlo_text):
    frac = crossing.get(collectives.level_of(c, gpus_per_node), 0.0)
    if not frac:
      continue
    w = windows[c.name]
    if {"while", "call", "conditional"} & set(ops[w.computation][w.start + 1 : w.done]):
      return None
    sent = max(collectives.device_bytes(c, devices).values(), default=0.0) * c.count
    out[w.computation] = out.get(w.computation, 0.0) + sent * frac / share
  return out


def link_shared(
  e: dict,
  inter_link_s: float | None,
  link_s_by_computation: dict[str, float] | None = None,
  computations: list[dict] | None = None,
) -> dict:
  """The step with the node's link shared among the collectives in flight: `e` (an `estimate`)
  with `step_s` the least a re-simulation of its schedule with the link shared can give (the
  scheduled step, estimate.compose's, kept as `schedule_step_s`), the exposed communication,
  tokens/s and MFU with it, and `step_bound` naming which bound set it.

  XLA's network model gives each GPU its share of the node's link (network_options) but gives
  it whole to each collective in flight, so with several in flight it moves more bytes per
  second than the link has, and the waiting on collectives compose takes from XLA's scheduler
  is too short. Re-simulating the timeline with the link shared among them (each transfer
  slowed by the others in flight, kernels as the schedule ordered them) never gives less than
  the scheduled step (a transfer at most as fast as XLA's, nothing earlier) nor, in each
  computation that runs on its own (the entry, a loop body: compose's rows, executions x time
  per step), less than the link's time for the collectives issued there
  (`link_s_by_computation`, per step; a collective starts and is done in one computation, and
  what runs between holds no other one): the step is the larger of the scheduled step and the
  sum over computations of the larger of the two. It is reached where the transfers slowed by
  sharing stay under the compute scheduled beside them in the same computation. Without the
  split (None: a collective in flight across a loop, or not known) the step as a whole bounds
  it: the larger of the scheduled step and `inter_link_s` (link_floor's, the split's sum).
  Where the link does not bind (one node, a fast link, no --inter-bandwidth: None) it is the
  scheduled step. `computations` are compose's rows (default e["computations"]); the split is
  kept in the result, so applying it again, with another floor for the same bytes, gives the
  same step."""
  if e.get("step_s") is None:
    return e
  # the step as scheduled, before the link is shared (kept, so applying this again is a no-op)
  scheduled = e.get("schedule_step_s", e["step_s"])
  split = link_s_by_computation
  if split is None:
    split = e.get("link_s_by_computation")
  rows = {
    r["computation"]: r["executions"] * r["time_s"]
    for r in computations or e.get("computations") or []
  }
  step = max(scheduled, inter_link_s or 0.0)
  if split and rows and set(split) <= set(rows):
    step = max(step, sum(max(t, split.get(c, 0.0)) for c, t in rows.items()))
  rescale = e["step_s"] / step  # tokens/s and MFU are per second of the step
  return {
    **e,
    "schedule_step_s": scheduled,
    "step_s": step,
    **({} if split is None else {"link_s_by_computation": split}),
    "exposed_comm_s": step - e["compute_s"],
    "tokens_per_s": e["tokens_per_s"] * rescale,
    "mfu": e["mfu"] * rescale,
    **(
      {"step_s_repriced": max(e["step_s_repriced"], inter_link_s or 0.0)}
      if e.get("step_s_repriced") is not None
      else {}
    ),
    "step_bound": BOUND_LINK if step > scheduled else BOUND_SCHEDULE,
  }
