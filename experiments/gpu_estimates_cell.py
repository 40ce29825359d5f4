"""A cell of experiments/gpu_estimates.py and what is derived from it without compiling: the
planner's step times (`paro-jax plan --gpu`), each strategy's link floor and the exposed
communication no schedule avoids (exposed_at_least), and the cell's summary against the goals
(Spearman, the pick against XLA's best and the best plain-jit baseline, `--compile-top`'s pick).

A cell is (model, nodes x 8 GPUs, inter-node Gbit/s per node, micro-batches A); its record holds
the compiles by group (GROUPS), each an `estimate` and `memory` of `paro-jax inspect --target`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io

from experiments.bench.stats import spearman

GPUS_PER_NODE = 8
# XLA's own SPMD partitioning of the same step (experiments/bench/baselines.py): every state
# sharded over all GPUs, or over a node's GPUs and replicated across nodes (MaxText's fsdp and
# its data-parallel axis over nodes).
BASELINES = ("jit-fsdp", "jit-hsdp")
# A baseline named NAME@defaults is compiled with XLA's default flags instead of
# paro_jax/core/xla_flags.py's (what a plain-jit user gets: one collective in flight at a time).
DEFAULTS = "@defaults"
GROUPS = ("xla", "baselines", "variants")  # a cell's compiled programs
# Two-level collectives compared in the cells of --variants: paro_jax's rings over one mesh
# level at a time (hring), both levels overlapped (horing), one flat ring (ring).
VARIANT_IMPLS = ("ring", "hring", "horing")


def cell_key(model: str, nodes: int, gbit: float, a: int) -> str:
  return f"{model} {nodes}x{GPUS_PER_NODE} {gbit:g}gbit A={a}"


def parse_key(key: str) -> tuple[str, int, float, int]:
  """(model, nodes, gbit, A) of a cell_key."""
  model, mesh, gbit, a = key.split()
  return model, int(mesh.split("x")[0]), float(gbit.removesuffix("gbit")), int(a.split("=")[1])


def planner_times(
  args,
  model,
  nodes,
  gbit,
  a,
  global_model: str | None = None,
  one_pass_all_reduce=False,
  with_compile_top=False,
) -> dict:
  """`paro-jax plan --gpu <target>`'s step time per strategy (None where it does not fit);
  `global_model` replaces the model of xla's global collectives (to compare with an old one);
  `one_pass_all_reduce` charges an all-reduce half its ring bytes, as this XLA's cost model
  does (a diagnostic of where the two disagree, not the planner's model); `with_compile_top`
  adds the candidates `plan --compile-top` would compile (its default K) and the budget."""
  from unittest import mock

  from paro_jax.analysis.planner import inputs, planner, rerank, step_model
  from paro_jax.analysis.planner.config import PlanConfig
  from paro_jax.analysis.planner.rerank import budget
  from paro_jax.core.names import ALL_REDUCE

  patch = {"xla": global_model} if global_model else {}
  seconds = step_model.collective_seconds

  def one_pass(kind, axes, nbytes, count, cluster):
    return seconds(kind, axes, nbytes / 2 if kind == ALL_REDUCE else nbytes, count, cluster)

  with (
    contextlib.redirect_stdout(io.StringIO()),
    mock.patch.dict(inputs.GLOBAL_MODEL_OF, patch),
    mock.patch.object(step_model, "collective_seconds", one_pass)
    if one_pass_all_reduce
    else contextlib.nullcontext(),
  ):
    cfg = PlanConfig(
      model=model,
      nodes=nodes,
      devices_per_node=GPUS_PER_NODE,
      gpu=args.target,
      inter_bandwidth=f"{gbit:g}gbit",
      # The results page was computed with the 300 GB/s that plan then assumed for every GPU;
      # plan's default is now the --gpu's own (450 GB/s for an H100): pinned until a rerun.
      intra_bandwidth="300GB/s",
      micro_batches=a,
      seq_len=args.seq_len,
      as_json=True,
    )
    p = planner.run_plan(cfg)
  steps = {e.strategy: e.step_time_s if e.fits else None for e in p.ranking}
  if not with_compile_top:
    return {"pick": p.pick, "step_s": steps}
  k = next(f.default for f in dataclasses.fields(PlanConfig) if f.name == "compile_top")
  top = {"k": k, "candidates": rerank.candidates(p, k), "budget": budget(p)}
  return {"pick": p.pick, "step_s": steps, "compile_top": top}


def _inter_traffic(args, model, nodes, gbit, a, name: str):
  """The strategy's inter-node bytes per GPU by phase (costs.step_traffic, every collective over
  both axes in its two-level form)."""
  from paro_jax.analysis.planner import inputs, step_model
  from paro_jax.core.strategy import parse_strategy
  from models.presets import get_config

  w = inputs.Workload(get_config(model), micro_batches=a, seq_len=args.seq_len)
  links = inputs.Links(gbit * 1e9 / 8, 300e9)
  cluster = inputs.Cluster(nodes, GPUS_PER_NODE, links, 1.0)  # its bytes only
  return step_model.traffic_of(parse_strategy(name), w, cluster, two_level=True)


def link_floors(args, model, nodes, gbit, a) -> dict:
  """Each strategy's link floor (estimate.link_floor): the bytes it must send across nodes per
  GPU, every collective over both axes in its two-level form (the traffic formulas, which the
  compiled programs match within 1%: test_inspector), over the GPU's share of its node's link."""
  from paro_jax.analysis.gpu import estimate
  from paro_jax.core.strategy import VALID_NAMES

  floor = {}
  for name in VALID_NAMES:
    t = _inter_traffic(args, model, nodes, gbit, a, name)
    floor[name] = estimate.link_floor(t.inter, 0, nodes, GPUS_PER_NODE, gbit * 1e9)["inter_link_s"]
  return floor


def share_the_link(cell: dict) -> None:
  """Each compiled strategy's estimate (and its collectives variants') with the node's link
  shared among the collectives in flight (link.link_shared): its step at least the
  strategy's link floor, XLA's own step kept as `xla_step_s`. Recomputed from what the cell
  stores (XLA's step and the floors, and for a program compiled since inspect --target splits
  the link's time by computation, that split), nothing compiled; the same again on a cell
  already done.
  A variant moves its strategy's bytes across nodes at least (the two-level form sends the
  fewest). A plain-jit baseline gets the cell's smallest floor: every program that trains
  data-parallel across nodes sends at least a ring all-reduce of the node's gradient shard
  across nodes in bf16 (NNN's, NNI's, III's and IIG's floor alike), whatever XLA's partitioning
  sends beyond it."""
  from paro_jax.analysis.gpu import link

  floors = cell.get("link_floor_s", {})
  for group in GROUPS:
    for name, r in cell.get(group, {}).items():
      floor = min(floors.values()) if group == "baselines" else floors.get(name.split("/")[0])
      if "estimate" in r and floors and floor is not None:
        # a compile since the split was recorded carries its link time by computation
        r["estimate"] = link.link_shared(r["estimate"], floor, None, r.get("computations"))


# Of one micro-batch's compute, the share in its backward (full remat: the forward recomputed,
# then the backward's two matmuls per forward one: 3 of 4 units).
BACKWARD_SHARE = 0.75
BOUNDARY = ("grad sync", "param sync")


def link_phases(args, model, nodes, gbit, a, name: str) -> dict:
  """Seconds on the GPU's share of its node's link of the strategy's inter-node traffic: per
  micro-batch (parameter gathers, gradient reduce-scatters: all A of them), the boundary's
  gradient sync and its parameter sync."""
  from paro_jax.analysis.gpu import estimate

  t = _inter_traffic(args, model, nodes, gbit, a, name)
  share = estimate.link_floor(1.0, 0, nodes, GPUS_PER_NODE, gbit * 1e9)["inter_link_s"]
  inter = {k.rsplit("/", 1)[0]: v * share for k, v in t.phases.items() if k.endswith("/inter")}
  boundary = {p: inter.get(p, 0.0) for p in BOUNDARY}
  return {"micro_batches_s": sum(inter.values()) - sum(boundary.values()), **boundary}


def exposed_at_least(
  per_micro_batch_s: float, grad_sync_s: float, param_sync_s: float, a: int, compute_s: float
) -> float:
  """The exposed communication no schedule of the step avoids. The link carries all of the
  step's inter-node bytes, so at least their time beyond the compute waits; and the boundary
  syncs wait on the gradients of the last micro-batch: the gradient sync can hide behind that
  micro-batch's backward at most, the parameter sync (after the update) behind nothing."""
  window = BACKWARD_SHARE * compute_s / a
  total = per_micro_batch_s + grad_sync_s + param_sync_s
  return max(total - compute_s, param_sync_s + max(0.0, grad_sync_s - window), 0.0)


def a_for_exposed(phases: dict, a: int, compute_s: float, goal: float = 0.10) -> int | None:
  """The fewest micro-batches (compute and per-micro-batch traffic growing with A, the boundary
  syncs not) at which `exposed_at_least` is at most `goal` of the step; None up to 4096."""
  per_mb, per_c = phases["micro_batches_s"] / a, compute_s / a
  for n in range(1, 4097):
    low = exposed_at_least(per_mb * n, phases["grad sync"], phases["param sync"], n, per_c * n)
    if low <= goal * (per_c * n + low):
      return n
  return None


def compiled_ok(r: dict | None) -> bool:
  return bool(r) and "error" not in r and r["fits"] and bool(r["estimate"].get("step_s"))


def summarize(cell: dict, planner_key: str = "planner") -> dict:
  xla = {s: r["estimate"]["step_s"] for s, r in cell["xla"].items() if compiled_ok(r)}
  if planner_key not in cell:
    return {"strategies": 0}
  plan = {s: t for s, t in cell[planner_key]["step_s"].items() if t is not None}
  both = sorted(set(xla) & set(plan))
  out = {"strategies": len(both)}
  if len(both) >= 3:
    out["spearman"] = spearman([plan[s] for s in both], [xla[s] for s in both])
  if xla:
    best = min(xla, key=xla.get)
    pick = cell[planner_key]["pick"]
    out.update(xla_best=best, xla_best_s=xla[best], pick=pick)
    if pick in xla:
      out["pick_vs_best"] = xla[pick] / xla[best]
  jit = {
    b: r["estimate"]["step_s"]
    for b, r in cell.get("baselines", {}).items()
    if compiled_ok(r) and not b.endswith(DEFAULTS)
  }
  if jit:
    best_jit = min(jit, key=jit.get)
    out.update(best_jit=best_jit, best_jit_s=jit[best_jit])
    if out.get("pick") in xla:
      out["pick_vs_jit"] = xla[out["pick"]] / jit[best_jit]
  plain = {
    b: r["estimate"]["step_s"]
    for b, r in cell.get("baselines", {}).items()
    if compiled_ok(r) and b.endswith(DEFAULTS)
  }
  if plain:
    best = min(plain, key=plain.get)
    out.update(best_jit_defaults=best.removesuffix(DEFAULTS), best_jit_defaults_s=plain[best])
  return out


def compile_top(cell: dict) -> dict:
  """What `plan --target --compile-top K` (its default K) picks, from this cell's compiles: the
  fastest by XLA's estimate among its candidates whose compiled memory fits the plan's budget;
  the candidates this grid did not compile are listed instead (its pick is then unknown)."""
  top = cell.get("planner", {}).get("compile_top")
  if top is None:
    return {}
  missing = [c for c in top["candidates"] if c not in cell["xla"]]
  if missing:
    return {"missing": missing}
  from paro_jax.analysis.planner.rerank import fastest_fitting

  compiled = [
    dict(cell["xla"][c], strategy=c) for c in top["candidates"] if compiled_ok(cell["xla"][c])
  ]
  best = fastest_fitting(compiled, top["budget"])
  return {"pick": best["strategy"], "step_s": best["estimate"]["step_s"]} if best else {}


def verdict(s: dict) -> str:
  """What a cell meets of the goals (Spearman >= 0.9, pick / best <= 1.05, pick <= best jit)."""
  if "spearman" not in s or "pick_vs_best" not in s:
    return "incomplete"
  misses = [
    name
    for name, ok in (
      ("Spearman", s["spearman"] >= 0.9),
      ("pick / best", s["pick_vs_best"] <= 1.05),
      ("vs jit", s.get("pick_vs_jit", 0) <= 1.0),
    )
    if not ok
  ]
  if "pick_vs_jit" not in s:
    misses.append("no jit baseline")
  return "met" if not misses else "misses: " + ", ".join(misses)
