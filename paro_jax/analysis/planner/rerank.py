"""`paro-jax plan --target GPU --compile-top K`: the analytic ranking checked by XLA's estimate.

The analytic model ranks the 14 strategies in microseconds; XLA's estimate of the compiled step
(paro_jax/analysis/gpu/estimate.py; with the node's link shared among the collectives in flight,
`link.link_shared`, as `inspect --target` reports it) takes a compile each, minutes for a 7B
model. So the top K that fit, and every other fitting strategy within `WITHIN` (10%) of the
first, are compiled for the target (`paro-jax inspect --target`, a process each: XLA reads its
network model at start-up), and the pick is the fastest by that estimate among those whose
compiled memory fits the plan's budget (the usable fraction of the device's memory, as the
analytic model's). A strategy that the analytic memory rules out by less than that model's
measured error (`MEMORY_SLACK`) is compiled too when the analytic model puts it ahead of the
first that fits: its compiled memory decides. Both rankings are printed side by side, with each
compile's time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from paro_jax.analysis.gpu import targets  # no jax at import
from paro_jax.core import config  # no jax
from paro_jax.core.flags import step_flags  # no jax
from paro_jax.core.units import human_bytes

WITHIN = 0.10
# The analytic memory (model states + activations) over the compiled program's peak, for the 210
# strategy compiles of experiments/results/gpu_estimates (7b and 65b on 2-16 nodes of 8 H100,
# A=1 and 8): 0.91x to 1.30x. A strategy over the budget by less than 30% by the model may fit.
MEMORY_SLACK = 0.30


def budget(plan) -> float:
  """Bytes per device a strategy may use: the usable fraction of the device's memory."""
  return plan.inputs["device_memory_bytes"] * plan.inputs["usable_memory"]


def candidates(plan, k: int) -> list[str]:
  """The top k fitting strategies by the analytic model, any within WITHIN of the first, and
  any the analytic memory rules out by less than MEMORY_SLACK that it ranks ahead of the first."""
  fitting = sorted((e for e in plan.ranking if e.fits), key=lambda e: e.step_time_s)
  first = fitting[0].step_time_s if fitting else float("inf")
  near = [
    e
    for e in plan.ranking
    if not e.fits
    and e.feasible
    and e.memory_bytes <= budget(plan) * (1 + MEMORY_SLACK)
    and e.step_time_s < first
  ]
  chosen = [
    e.strategy for i, e in enumerate(fitting) if i < k or e.step_time_s <= first * (1 + WITHIN)
  ]
  return chosen + [e.strategy for e in sorted(near, key=lambda e: e.step_time_s)]


def plan_step_flags(inputs: dict, attention: str) -> list[str]:
  """The plan's workload as `paro-jax inspect` flags (all but --strategy)."""
  nodes, per_node = inputs["nodes"], inputs["devices_per_node"]
  step = config.StepConfig(
    model=inputs["model"],
    mesh=(nodes, per_node),
    collectives=inputs["collectives"],
    micro_batches=inputs["micro_batches"],
    batch_size=inputs["micro_batch"] * nodes * per_node,
    seq_len=inputs["seq_len"],
    dtype=inputs["dtype"],
    attention=attention,
    wire=config.WireOptions(
      inter_params=inputs["inter_params"],
      inter_grads=inputs["inter_grads"],
      int8_block=inputs["int8_block"],
      grad_dtype=inputs["grad_dtype"],
    ),
  )
  return step_flags(step, strategy=None)


def compile_estimate(
  strategy: str, step_flags: list[str], target: str, inter_bits_per_s: float | None
) -> dict:
  """XLA's estimate of one strategy's step: `paro-jax inspect --target` with `step_flags` (the
  step's flags but --strategy) and each node's inter-node rate for XLA's network model (None:
  XLA's defaults)."""
  rate = (
    [] if inter_bits_per_s is None else ["--inter-bandwidth", f"{inter_bits_per_s / 1e9:g}gbit"]
  )
  cmd = [
    sys.executable, "-m", "paro_jax", "inspect", "--target", target, *step_flags,
    "--strategy", strategy, *rate, "--json",
  ]  # fmt: skip
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # the child sets XLA's network model from --inter-bandwidth
  # A compile for a target needs no device: on a GPU node the child must not take the GPUs'
  # memory (XLA preallocates most of it) that the run holds.
  env["JAX_PLATFORMS"] = "cpu"
  t = time.perf_counter()
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
  seconds = time.perf_counter() - t
  if proc.returncode:
    lines = proc.stderr.strip().splitlines() or ["no output"]
    return {"strategy": strategy, "error": lines[-1][:300], "compile_s": seconds}
  r = json.loads(proc.stdout)
  e = {k: v for k, v in r["estimate"].items() if k != "computations"}
  nbytes = r["memory"]["compiled_bytes"]
  return {"strategy": strategy, "estimate": e, "compiled_bytes": nbytes, "compile_s": seconds}


def rankable_target(target: str) -> str:
  """The key of a --target XLA's estimate can rank strategies for (a time-based cost model,
  JAX's CUDA plugin installed), else a one-line ValueError saying why not."""
  # numpy (estimate.py's HLO parsing): only for `plan --target`, not at the CLI's start
  from paro_jax.analysis.gpu import estimate

  key = targets.check_target(target)
  if not targets.plugin_available():
    raise ValueError(
      f"--target compiles with JAX's CUDA plugin, not installed: {targets.INSTALL_HINT}"
    )
  reason = estimate.unavailable_reason("", targets.compute_capability(key))
  if reason is not None:
    raise ValueError(f"--target {key}: no step time from XLA to rank by ({reason})")
  return key


def fastest_fitting(compiled: list[dict], budget_bytes: float) -> dict | None:
  """The pick among compiled candidates: the shortest step by XLA's estimate whose compiled
  memory fits `budget_bytes` (None if none does); the first such in `compiled`'s order on a tie."""
  usable = [
    c
    for c in compiled
    if "error" not in c and c["compiled_bytes"] <= budget_bytes and c["estimate"].get("step_s")
  ]
  return min(usable, key=lambda c: c["estimate"]["step_s"], default=None)


def rerank(
  plan,
  k: int,
  target: str,
  attention: str = "auto",
  step_flags: list[str] | None = None,
  inter_bits_per_s: float | None = None,
) -> dict:
  """Compile the candidates and pick by XLA's estimate; returns what `format_rerank` prints.

  `step_flags`: the step's `inspect` flags but --strategy (default: the plan's workload, with
  `attention`); `inter_bits_per_s`: each node's inter-node rate (default: the plan's)."""
  if step_flags is None:
    step_flags = plan_step_flags(plan.inputs, attention)
  if inter_bits_per_s is None:
    inter_bits_per_s = plan.inputs["inter_bandwidth_bytes_per_s"] * 8
  compiled = [
    compile_estimate(s, step_flags, target, inter_bits_per_s) for s in candidates(plan, k)
  ]
  for c in compiled:
    if "error" not in c:
      c["fits"] = c["compiled_bytes"] <= budget(plan)
  best = fastest_fitting(compiled, budget(plan))
  pick = best["strategy"] if best else None
  return {
    "target": target,
    "k": k,
    "within": WITHIN,
    "memory_slack": MEMORY_SLACK,
    "budget_bytes": budget(plan),
    "pick": pick,
    "compiled": compiled,
  }


def format_rerank(plan, r: dict) -> str:
  analytic = {e.strategy: e.step_time_s for e in plan.ranking if e.fits}
  order = sorted(analytic, key=analytic.get)
  by_xla = sorted(r["compiled"], key=lambda c: c.get("estimate", {}).get("step_s") or float("inf"))
  lines = [
    f"compiled for {r['target']}: the analytic top {r['k']}, any within {r['within']:.0%} of its "
    f"first and any faster one over the memory budget by less than {r['memory_slack']:.0%} by "
    "the analytic model; ranked by XLA's estimate with the link shared (a cost model, not a "
    f"measurement); compiled memory held to the plan's budget of {human_bytes(r['budget_bytes'])}",
    f"{'#':>3s} {'strategy':9s}{'step s':>11s}{'compute':>9s}{'exposed':>9s}"
    f"{'repriced':>9s}{'analytic s':>11s}{'analytic #':>11s}{'compile s':>10s}{'memory':>10s}"
    "  set by",
  ]
  for i, c in enumerate(by_xla, 1):
    s = c["strategy"]
    rank = f"{order.index(s) + 1:11d}" if s in order else f"{'over mem':>11s}"
    tail = f"{plan.get(s).step_time_s:11.3f}{rank}{c['compile_s']:10.0f}"
    e = c.get("estimate", {})
    if "error" in c or not e.get("step_s"):
      lines.append(f"{i:3d} {s:9s}{'-':>11s}{'':27s}{tail}  {c.get('error', '')[:60]}")
      continue
    fit = "" if c["fits"] else "  (compiled memory does not fit)"
    repriced = f"{e['step_s_repriced']:9.3f}" if e.get("step_s_repriced") else f"{'-':>9s}"
    lines.append(
      f"{i:3d} {s:9s}{e['step_s']:11.3f}{e['compute_s']:9.3f}{e['exposed_comm_s']:9.3f}"
      f"{repriced}{tail}{human_bytes(c['compiled_bytes']):>10s}  {e.get('step_bound', '-')}{fit}"
    )
  lines.append(
    "step: XLA's estimate with the node's link shared among the collectives in flight, the "
    "longer of XLA's schedule and the link floor (set by: which); repriced: the same with the "
    "matmuls XLA prices out of line with the program's others (the language-model head) at "
    "their typical price (docs/gpu.md)"
  )
  if r["pick"] is None:
    lines.append("no compiled candidate fits: the analytic pick stands unchecked")
  else:
    agree = (
      "agrees with the analytic pick"
      if r["pick"] == plan.pick
      else f"differs from the analytic {plan.pick}"
    )
    lines.append(f"pick by XLA's estimate: {r['pick']} ({agree})")
  return "\n".join(lines)
