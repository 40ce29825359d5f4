"""XLA's estimate of the step on a GPU cluster against the analytic planner, cell by cell.

A cell is (model, nodes x 8 GPUs, inter-node Gbit/s per node, micro-batches A), one 2048-token
sequence per GPU per micro-batch. In each, every strategy is compiled for the target with
`paro-jax inspect --target ... --inter-bandwidth` (a process each: XLA reads its network model
at start-up) and its `estimate.step_s` is set beside `paro-jax plan`'s step time for the same
cell: Spearman's rank correlation over the strategies that fit in both, and the estimated step of
the planner's pick over the best estimated step. Writes `gpu_estimates.json` after every compile
(`--resume` keeps what is there), `README.md` (command, date, machine, the tables) and
`gpu_estimates.png` (planner against XLA, per cell).

  nice -n 10 python experiments/gpu_estimates.py --models 7b --nodes 2,4 --gbit 25,100,400 \
      --micro-batches 1,8 --out experiments/results/gpu_estimates --resume
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import dataclasses
import io
import itertools
import json
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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


# What holds the pick's communication back in XLA's schedule (read from the scheduled HLO of
# NNI: each backward layer body starts its layer's inter-node all-reduce and waits for it).
EXPOSED_WHY = (
  "each layer's gradient sync (a reduce-scatter in the node, issued one layer ahead, then an "
  "all-reduce across nodes of the node's 1/8 shard, 50.6 MB for a 7b layer) starts once the "
  "layer's gradient is final and is waited for at the end of the next layer's backward. At 100 "
  "Gbit/s per node that all-reduce takes 24.9 ms in XLA's model against about 4 ms of one "
  "layer's backward compute: the link, not the schedule, holds it back; no order of the same "
  "collectives could hide more than the last micro-batch's backward compute (about 0.12 s), "
  "because the gradients are final only there."
)
# The cells whose pick's exposed communication the page breaks down.
EXPOSED_CELLS = ("7b 4x8 100gbit A=1", "7b 4x8 100gbit A=8")
# What the compiles showed beyond the tables (checked as each says; see docs/gpu.md).
NOTES = [
  "",
  "How the estimate is composed and what it gets wrong:",
  "",
  "- Computations XLA does not cost (a layer body without an async collective: the forward "
  "of every strategy with replicated parameters) are charged their roofline scaled by XLA's "
  "costs over the loop bodies it costed. Scaled over all costed computations instead (the "
  "first composition, whose cells were compiled again), the entry's head matmul, which "
  "XLA's model prices untuned at 44 ms "
  "(81x its 0.54 ms roofline; 7b, 2 x 8, in every strategy), inflated them: NNI's forward "
  "layer body on 7b 2 x 8 was charged 2.06 ms, now 1.47 ms. XLA's own per-kernel costs of "
  "the same kernels where it does cost them (`--xla_dump_latency_hiding_schedule`: each "
  "instruction's simulated start and end) give 1.53 ms for that body (11 of its 18 kernels "
  "found in the backward body; the other 7 at the scaled roofline): the roofline part is "
  "within about 5% of XLA's own figures there, where it was 35% above.",
  "- With A > 1 the head matmul sits in the micro-batch loop's body, which XLA costs only for "
  "strategies with a collective in it (INI, III, IIG: the embedding's and head's gathers); "
  "the others get the scaled roofline for it. 7b 4 x 8, A=8: XLA prices INI's head matmuls "
  "at 55.5 ms per micro-batch (44.0 + 5.8 + 5.7 ms, against 1.6 ms of roofline; "
  "schedule dump), 7 x 53.9 ms = 0.38 s of INI's 2.80 s against NNI's 2.42 s: without "
  "that price the two tie. Cells with A=8 order INI, III and IIG behind NNI by this.",
  "- XLA (jaxlib 0.10.2) prices an all-reduce as one ring pass ((n-1)/n of the buffer per "
  "GPU over its NIC share): NNI's inter-node all-reduce of a layer's 1/8 gradient shard "
  "(50.6 MB over 4 nodes at 100 Gbit/s) costs 24.7 ms there, 0.75 x 50.6 MB / 1.5625 GB/s x "
  "1.025 = 24.9 ms. A ring all-reduce sends twice that (reduce-scatter, then all-gather; "
  "later XLA multiplies by two rounds, `NumRounds` in `sol_gpu_cost_model.cc`). The planner "
  "charges the two passes, so strategies that sync by an all-reduce (the `N`/`I` gradients "
  "with an inter-node sync: NNI, INI, III, NII) are cheaper in this XLA's estimate, relative "
  "to the others, than on the wire.",
  "- XLA's model prices each async collective as if it had the link to itself, and "
  "paro_jax's GPU flags (paro_jax/core/xla_flags.py) let up to 4 be in flight at once, so a "
  "program that splits its traffic into several collectives in flight together gets up to 4x "
  "the link in the estimate. `jit-hsdp`'s gradient sync is, per layer, 7 all-reduces of the "
  "full gradients over all GPUs (XLA's partitioner reduces the whole gradient, then keeps the "
  "node's shard): on the wire 1.29x the inter-node bytes of NNI's (a reduce-scatter in the "
  "node, then an all-reduce of 1/8 across nodes), but 4 at a time in the estimate. The column "
  "`best jit, XLA's default flags` compiles the baselines as a plain-jit user gets them (one "
  "collective in flight); there the same 7 all-reduces queue.",
  "- `ring` is paro_jax's flat ring of collective-permutes, which XLA prices step by step "
  "(each step its own transfer and latency); `xla` is NCCL's one-level ring over all GPUs, "
  "the paper's Ring; `hring` and `horing` are paro_jax's two-level rings (horing: the intra "
  "and inter steps in flight together on two streams).",
  "",
  "Compile time (where it goes, and what was tried; 7b 4 x 8, A=8, IIG, 100 Gbit/s, profiled "
  "with cProfile and XLA's VLOG timers): 25 s in all, of which tracing and lowering 7.5 s and "
  "XLA 13.5 s; inside XLA the HLO passes and the scheduling take 1.3 s and the code generation "
  "(LLVM IR emission, Triton, ptxas) the rest, which the estimate does not need but no option "
  "of this jaxlib skips. `--xla_gpu_disable_gpuasm_optimizations`, "
  "`--xla_llvm_disable_expensive_passes` and `--xla_backend_optimization_level=0` left the "
  "estimate identical (2.92958706 s) and gained nothing measurable (17.2 s and 20.7 s, within "
  "the load's noise); `--xla_gpu_enable_triton_gemm=false` changes the estimate by -1.6%, so "
  "it was not used. A compile takes 12-30 s on a quiet machine; this grid ran beside other "
  "jobs (load average 15-21 on 2 cores), at 15-90 s a compile, so the later cells compile 8 "
  "of the 14 strategies (NNI, INI, III, IIG, NIG, IGG, NGG, GGG: the top, the middle and the "
  "bottom of the full cells; for 65b IIG, IGG, GIG and GGG, the ones that fit) and their "
  "Spearman and XLA's best are over those.",
]


def child_baseline(args) -> None:
  """Compile a plain-jit baseline for the target, print inspect's `estimate` and `memory`."""
  from paro_jax.analysis import estimate, gpu

  gpu.prepare_environment()
  nodes, a, gbit = int(args.nodes), int(args.micro_batches), float(args.gbit)
  estimate.prepare_environment(gbit * 1e9, GPUS_PER_NODE)
  import tempfile

  import jax
  import jax.numpy as jnp
  from jax.sharding import AxisType, Mesh

  from experiments.bench.baselines import build
  from paro_jax.core.mesh import make_mesh
  from paro_jax.core.xla_flags import GPU_FLAGS

  grid = make_mesh(nodes, GPUS_PER_NODE, devices=gpu.devices(args.target, nodes, GPUS_PER_NODE))
  mesh = Mesh(grid.devices, grid.axis_names, axis_types=(AxisType.Auto,) * 2)
  # bf16 and cuDNN's attention, as `inspect --target` resolves them for the strategies
  model, jinit, jstep, state_sh, batch_sh = build(
    args.child_baseline, args.models, "bf16", a, 1, mesh, "full", "cudnn"
  )
  shapes = jax.eval_shape(jinit, jax.random.key(0))
  state = jax.tree.map(
    lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, state_sh
  )
  batch_size = nodes * GPUS_PER_NODE
  batch = jax.ShapeDtypeStruct((a, batch_size, args.seq_len + 1), jnp.int32, sharding=batch_sh)
  with tempfile.TemporaryDirectory(prefix="paro-jax-dump-") as dump:
    with estimate.captured_stderr() as log:
      with gpu.cudnn_checks(args.target):
        lowered = jstep.lower(state, batch)
      flags = {} if args.xla_defaults else GPU_FLAGS
      compiled = lowered.compile(compiler_options={**flags, "xla_dump_to": dump})
  tokens = a * batch_size * args.seq_len
  e = estimate.estimate(
    compiled.as_text(),
    log[0],
    compute_capability=gpu.compute_capability(args.target),
    peak_flops=gpu.target_gpu(args.target).peak_flops,
    memory_bandwidth=gpu.memory_bandwidth(args.target),
    devices=nodes * GPUS_PER_NODE,
    tokens_per_step=tokens,
    flops_per_step=model.cfg.flops_per_token(args.seq_len) * tokens,
    inter_bits_per_s=gbit * 1e9,
    gpus_per_node=GPUS_PER_NODE,
  )
  m = compiled.memory_analysis()
  peak = (
    m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
  )
  device = gpu.target_gpu(args.target).memory_bytes
  memory = {"compiled_bytes": peak, "fits": peak <= device}
  print(json.dumps({"estimate": e, "memory": memory}))


def cell_key(model: str, nodes: int, gbit: float, a: int) -> str:
  return f"{model} {nodes}x{GPUS_PER_NODE} {gbit:g}gbit A={a}"


def xla_estimate(args, model, nodes, gbit, a, strategy, collectives="xla") -> dict:
  """inspect --target's report of one strategy in one cell (its estimate and memory); a
  plain-jit baseline (BASELINES) is compiled by this script's --child-baseline instead."""
  if strategy.removesuffix(DEFAULTS) in BASELINES:
    cmd = [
      sys.executable, os.path.abspath(__file__),
      "--child-baseline", strategy.removesuffix(DEFAULTS),
      *(["--xla-defaults"] if strategy.endswith(DEFAULTS) else []),
      "--target", args.target, "--models", model, "--nodes", str(nodes), "--gbit", f"{gbit:g}",
      "--micro-batches", str(a), "--seq-len", str(args.seq_len), "--out", "-",
    ]  # fmt: skip
  else:
    cmd = [
      sys.executable, "-m", "paro_jax", "inspect", "--target", args.target,
      "--mesh", f"{nodes}x{GPUS_PER_NODE}", "--model", model, "--strategy", strategy,
      "--collectives", collectives, "--micro-batches", str(a),
      "--batch-size", str(nodes * GPUS_PER_NODE), "--seq-len", str(args.seq_len),
      "--inter-bandwidth", f"{gbit:g}gbit", "--json",
    ]  # fmt: skip
  env = {**os.environ, "PYTHONPATH": ROOT}
  env.pop("XLA_FLAGS", None)
  t = time.perf_counter()
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
  if proc.returncode:
    lines = proc.stderr.strip().splitlines() or ["no output"]
    return {"error": lines[-1][:300], "compile_s": time.perf_counter() - t}
  r = json.loads(proc.stdout)
  return {
    "estimate": {k: v for k, v in r["estimate"].items() if k != "computations"},
    "computations": r["estimate"].get("computations"),
    "fits": r["memory"]["fits"],
    "compiled_bytes": r["memory"]["compiled_bytes"],
    "compile_s": time.perf_counter() - t,
  }


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

  from paro_jax.analysis import plan_compile, planner, step_model
  from paro_jax.analysis.config import PlanConfig
  from paro_jax.analysis.plan_compile import budget
  from paro_jax.core.names import ALL_REDUCE

  patch = {"xla": global_model} if global_model else {}
  seconds = step_model.collective_seconds

  def one_pass(kind, axes, nbytes, count, cluster):
    return seconds(kind, axes, nbytes / 2 if kind == ALL_REDUCE else nbytes, count, cluster)

  with (
    contextlib.redirect_stdout(io.StringIO()),
    mock.patch.dict(planner.GLOBAL_MODEL_OF, patch),
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
      micro_batches=a,
      seq_len=args.seq_len,
      as_json=True,
    )
    p = planner.run_plan(cfg)
  steps = {e.strategy: e.step_time_s if e.fits else None for e in p.ranking}
  if not with_compile_top:
    return {"pick": p.pick, "step_s": steps}
  k = next(f.default for f in dataclasses.fields(PlanConfig) if f.name == "compile_top")
  top = {"k": k, "candidates": plan_compile.candidates(p, k), "budget": budget(p)}
  return {"pick": p.pick, "step_s": steps, "compile_top": top}


def _inter_traffic(args, model, nodes, gbit, a, name: str):
  """The strategy's inter-node bytes per GPU by phase (costs.step_traffic, every collective over
  both axes in its two-level form)."""
  from paro_jax.analysis import planner, step_model
  from paro_jax.core.strategy import parse_strategy
  from models.config import get_config

  w = planner.Workload(get_config(model), micro_batches=a, seq_len=args.seq_len)
  links = planner.Links(gbit * 1e9 / 8, 300e9)
  cluster = planner.Cluster(nodes, GPUS_PER_NODE, links, 1.0)  # its bytes only
  return step_model.traffic_of(parse_strategy(name), w, cluster, two_level=True)


def link_floors(args, model, nodes, gbit, a) -> dict:
  """Each strategy's link floor (estimate.link_floor): the bytes it must send across nodes per
  GPU, every collective over both axes in its two-level form (the traffic formulas, which the
  compiled programs match within 1%: test_inspector), over the GPU's share of its node's link."""
  from paro_jax.analysis import estimate
  from paro_jax.core.strategy import VALID_NAMES

  floor = {}
  for name in VALID_NAMES:
    t = _inter_traffic(args, model, nodes, gbit, a, name)
    floor[name] = estimate.link_floor(t.inter, 0, nodes, GPUS_PER_NODE, gbit * 1e9)["inter_link_s"]
  return floor


# Of one micro-batch's compute, the share in its backward (full remat: the forward recomputed,
# then the backward's two matmuls per forward one: 3 of 4 units).
BACKWARD_SHARE = 0.75
BOUNDARY = ("grad sync", "param sync")


def link_phases(args, model, nodes, gbit, a, name: str) -> dict:
  """Seconds on the GPU's share of its node's link of the strategy's inter-node traffic: per
  micro-batch (parameter gathers, gradient reduce-scatters: all A of them), the boundary's
  gradient sync and its parameter sync."""
  from paro_jax.analysis import estimate

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


def _ok(r: dict | None) -> bool:
  return bool(r) and "error" not in r and r["fits"] and bool(r["estimate"].get("step_s"))


def summarize(cell: dict, planner_key: str = "planner") -> dict:
  from experiments.bench.stats import spearman

  xla = {s: r["estimate"]["step_s"] for s, r in cell["xla"].items() if _ok(r)}
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
    if _ok(r) and not b.endswith(DEFAULTS)
  }
  if jit:
    best_jit = min(jit, key=jit.get)
    out.update(best_jit=best_jit, best_jit_s=jit[best_jit])
    if out.get("pick") in xla:
      out["pick_vs_jit"] = xla[out["pick"]] / jit[best_jit]
  plain = {
    b: r["estimate"]["step_s"]
    for b, r in cell.get("baselines", {}).items()
    if _ok(r) and b.endswith(DEFAULTS)
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
  from paro_jax.analysis.plan_compile import fastest_fitting

  compiled = [dict(cell["xla"][c], strategy=c) for c in top["candidates"] if _ok(cell["xla"][c])]
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


def paper_row(key: str, cell: dict) -> str:
  def step(s):
    r = cell["xla"].get(s)
    return r["estimate"]["step_s"] if _ok(r) else None

  paro = {s: step(s) for s in ("IIG", "IGG", "NIG") if step(s)}
  if not paro:
    return f"| {key} | - | - | - | - |"
  best = min(paro, key=paro.get)
  ratio = lambda ref: f"{step(ref) / paro[best]:.2f}x" if step(ref) else "does not fit / -"
  per_gpu = cell["xla"][best]["estimate"]["tokens_per_s"] / (
    int(key.split()[1].split("x")[0]) * GPUS_PER_NODE
  )
  return (
    f"| {key} | {best} ({paro[best]:.3f} s) | {ratio('GGG')} | {ratio('NGG')} | {per_gpu:,.0f} |"
  )


def _row(key: str, name: str, r: dict, plan: str, floor: float | None = None) -> str:
  link = "-" if floor is None else f"{floor:.3f}"
  if "error" in r:
    return f"| {key} | {name} | error: {r['error'][:60]} | | | | {plan} | {link} | |"
  e = r["estimate"]
  if e.get("step_s") is None:
    return f"| {key} | {name} | none | | | | {plan} | {link} | {r['compile_s']:.0f} |"
  fit = "" if r["fits"] else " (does not fit)"
  below = " (below)" if floor is not None and e["step_s"] < floor else ""
  return (
    f"| {key} | {name} | {e['step_s']:.3f}{fit} | {e['compute_s']:.3f} | "
    f"{e['exposed_comm_s']:.3f} | {e['mfu']:.1%} | {plan} | {link}{below} | "
    f"{r['compile_s']:.0f} |"
  )


def below_floor(results: dict) -> dict[str, tuple[int, int]]:
  """Per cell: how many fitting compiled strategies have an estimated step shorter than their
  link floor, of how many."""
  out = {}
  for key, cell in results.items():
    floors = cell.get("link_floor_s", {})
    steps = [
      (r["estimate"]["step_s"], floors[s]) for s, r in cell["xla"].items() if _ok(r) and s in floors
    ]
    out[key] = (sum(step < floor for step, floor in steps), len(steps))
  return out


def exposed_section(results: dict) -> list[str]:
  """Where the planner's pick waits on communication in XLA's schedule, for the cells of
  EXPOSED_CELLS: per sequenced computation, its executions and the waiting they add up to."""
  out = []
  for key in EXPOSED_CELLS:
    cell = results.get(key)
    if not cell or cell["planner"]["pick"] not in cell["xla"]:
      continue
    pick = cell["planner"]["pick"]
    r = cell["xla"][pick]
    if not _ok(r):
      continue
    e = r["estimate"]
    out += [
      "",
      f"Exposed communication of the planner's pick ({pick}) in {key}: "
      f"{e['exposed_comm_s']:.3f} s of {e['step_s']:.3f} s, "
      f"{e['exposed_comm_s'] / e['step_s']:.0%} "
      "of the step, by computation of XLA's schedule (time and waiting per execution):",
      "",
      "| computation | executions | time per execution ms | waiting per execution ms | "
      "waiting per step s |",
      "|---|---:|---:|---:|---:|",
    ]
    for row in r["computations"]:
      out.append(
        f"| {row['computation']} ({row['source']}) | {row['executions']} | "
        f"{row['time_s'] * 1e3:.2f} | {row['wait_s'] * 1e3:.2f} | "
        f"{row['executions'] * row['wait_s']:.3f} |"
      )
    top = max(r["computations"], key=lambda row: row["executions"] * row["wait_s"])
    out += [
      "",
      f"Most of the waiting is in {top['computation']} ({top['executions']} executions, "
      f"{top['wait_s'] * 1e3:.2f} ms of {top['time_s'] * 1e3:.2f} ms each waiting), "
      "the backward layer loop of the last micro-batch: " + EXPOSED_WHY,
    ]
  return out


def _a_range(needs: list[int | None]) -> str:
  """The range of `a_for_exposed` results; None (none up to 4096) as more than 4096."""
  found = [n for n in needs if n is not None]
  high = "more than 4096" if None in needs or not found else str(max(found))
  return f"{min(found)}-{high}" if found else high


def bound_section(args, results: dict) -> list[str]:
  """For the pick of `plan --compile-top` at 100 Gbit/s per node on 4 and 16 nodes: XLA's exposed
  communication beside what no schedule of the same traffic avoids (exposed_at_least)."""
  rows, shares, needs = [], [], []
  for key, cell in results.items():
    model, nodes, gbit, a = parse_key(key)
    pick = compile_top(cell).get("pick")
    if gbit != 100 or nodes not in (4, 16) or pick is None:
      continue
    e = cell["xla"][pick]["estimate"]
    ph = link_phases(args, model, nodes, gbit, a, pick)
    low = exposed_at_least(
      ph["micro_batches_s"], ph["grad sync"], ph["param sync"], a, e["compute_s"]
    )
    need = a_for_exposed(ph, a, e["compute_s"])
    shares.append(low / (e["compute_s"] + low))
    needs.append(need)
    rows.append(
      f"| {key} | {pick} | {e['step_s']:.3f} | {e['exposed_comm_s']:.3f} "
      f"({e['exposed_comm_s'] / e['step_s']:.0%}) | {ph['micro_batches_s']:.3f} | "
      f"{ph['grad sync']:.3f} | {ph['param sync']:.3f} | "
      f"{BACKWARD_SHARE * e['compute_s'] / a:.3f} | {low:.3f} "
      f"({low / (e['compute_s'] + low):.0%}) | {need if need else '> 4096'} |"
    )
  if not rows:
    return []
  return [
    "",
    "Exposed communication that no schedule avoids, for the pick of `plan --target h100 "
    "--compile-top 3` at 100 Gbit/s per node on 4 and 16 nodes. Seconds on the GPU's share of "
    "its node's link (the link floor's terms, by phase): the per-micro-batch traffic (parameter "
    "gathers and gradient reduce-scatters across nodes, all A micro-batches), the boundary's "
    "gradient sync and parameter sync. The link carries all of it, so at least its time beyond "
    "the compute (XLA's compute of the pick) waits; and the boundary syncs wait on the last "
    "micro-batch's gradients: the gradient sync can hide behind that micro-batch's backward at "
    f"most (the window: {BACKWARD_SHARE:g} of its compute, full remat), the parameter sync (after "
    "the update) behind nothing. `exposed at least` is the larger of the two, with its share of "
    "the shortest step it allows; `A for <= 10%` the fewest micro-batches at which that share is "
    "10% or less (compute and per-micro-batch traffic growing with A, the boundary syncs not). "
    "Where XLA's exposed communication is below the bound, its model gives the collectives more "
    "link than there is (see the notes below).",
    "",
    "| cell | pick | XLA step s | XLA exposed s | link: micro-batches s | link: grad sync s | "
    "link: param sync s | backward window s | exposed at least s | A for <= 10% |",
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    *rows,
    "",
    f"In all {len(rows)} cells the bound alone is {min(shares):.0%}-{max(shares):.0%} of the "
    "shortest step, so no order of the same collectives brings the exposed communication to 10%: "
    "the inter-node bytes of the boundary syncs are what holds these steps back, not XLA's "
    f"schedule. 10% would take {_a_range(needs)} micro-batches per step at these links "
    "(the boundary syncs then hide behind that much more compute), or fewer bytes across nodes "
    "(`--inter-grads int8 --inter-params int8`: docs/collectives.md).",
  ]


def dates(results: dict) -> list[str]:
  """The days the cells' programs were compiled on."""
  return sorted(
    {
      r["date"]
      for c in results.values()
      for g in GROUPS
      for r in c.get(g, {}).values()
      if "date" in r
    }
  )


def write(args, command: str, results: dict) -> None:
  from experiments.pages import machine_line  # ROOT is on sys.path once main has put it there

  with open(os.path.join(args.out, "gpu_estimates.json"), "w") as f:
    json.dump({"commands": command.split("\n"), "cells": results}, f, indent=1)
  lines = [
    "# XLA's estimate of the step against the analytic planner",
    "",
    "```",
    command,
    "```",
    "",
    f"Compiled on {' and '.join(dates(results))} ({machine_line()}, no GPU; each compile's date "
    f"in gpu_estimates.json) for {args.target}, "
    f"{GPUS_PER_NODE} GPUs per node, one "
    f"{args.seq_len}-token sequence per GPU per micro-batch, `--collectives xla`. Nothing ran: "
    "XLA's figures are its cost model's (paro_jax/analysis/estimate.py; docs/gpu.md), the "
    "planner's are `paro-jax plan --gpu " + args.target + "` with its defaults. The plain-jit "
    "baselines are XLA's own SPMD partitioning of the same step (bf16, full remat, cuDNN "
    "attention; experiments/bench/baselines.py): `jit-fsdp` shards every state over all GPUs, "
    "`jit-hsdp` over a node's GPUs, replicated across nodes; both compiled with the same XLA "
    "flags (paro_jax/core/xla_flags.py) and costed by the same estimate.",
    "",
    "Goal: Spearman >= 0.9 and the pick's estimated step within 5% of the best (pick / best <= "
    "1.05) in every cell, and the pick at least as fast as the better plain-jit baseline "
    "(pick / best jit <= 1). The planner models xla's global collectives as NCCL's rings over "
    "all GPUs (as XLA's cost model does); the two-level columns are the model it used before; "
    "the one-pass columns charge an all-reduce as this XLA does (half a ring all-reduce's "
    "bytes, see below): a diagnostic, not the planner.",
    "",
    "| cell | strategies | Spearman | planner's pick | XLA's best | pick / best | best jit | "
    "pick / best jit | goals | Spearman, two-level | pick / best, two-level | best jit, XLA's "
    "default flags | Spearman, one-pass all-reduce | pick / best, one-pass all-reduce |",
    "|---|---:|---:|---|---|---:|---|---:|---|---:|---:|---|---:|---:|",
  ]
  fmt = lambda x, f: "-" if x is None else format(x, f)
  for key, cell in results.items():
    s, old = summarize(cell), summarize(cell, "planner_two_level")
    one = summarize(cell, "planner_one_pass")
    best = f"{s['xla_best']} ({s['xla_best_s']:.3f} s)" if "xla_best" in s else "-"
    jit = f"{s['best_jit']} ({s['best_jit_s']:.3f} s)" if "best_jit" in s else "-"
    plain = (
      f"{s['best_jit_defaults']} ({s['best_jit_defaults_s']:.3f} s)"
      if "best_jit_defaults" in s
      else "-"
    )
    lines.append(
      f"| {key} | {s['strategies']} | {fmt(s.get('spearman'), '.2f')} | {s.get('pick', '-')} | "
      f"{best} | {fmt(s.get('pick_vs_best'), '.3f')} | {jit} | "
      f"{fmt(s.get('pick_vs_jit'), '.3f')} | {verdict(s)} | {fmt(old.get('spearman'), '.2f')} | "
      f"{fmt(old.get('pick_vs_best'), '.3f')} | {plain} | {fmt(one.get('spearman'), '.2f')} | "
      f"{fmt(one.get('pick_vs_best'), '.3f')} |"
    )
  k = next(iter(results.values())).get("planner", {}).get("compile_top", {}).get("k", "K")
  lines += [
    "",
    f"`paro-jax plan --target {args.target} --compile-top {k}` (and `--strategy auto` "
    f"with a target) compiles the analytic top {k}, any fitting strategy within 10% of the first "
    "and any faster one the analytic memory rules out by less than 30%, and picks the fastest "
    "by XLA's estimate whose compiled memory fits the budget (docs/planner.md). Its pick in "
    "each cell, from this grid's compiles of the same candidates (where the grid compiled them "
    "all):",
    "",
    "| cell | candidates | pick | pick / XLA's best | pick / best jit | not compiled here |",
    "|---|---|---|---:|---:|---|",
  ]
  for key, cell in results.items():
    s, top = summarize(cell), compile_top(cell)
    cands = ", ".join(cell.get("planner", {}).get("compile_top", {}).get("candidates", []))
    if "pick" in top:
      best = fmt(top["step_s"] / s["xla_best_s"], ".3f") if "xla_best_s" in s else "-"
      jit = fmt(top["step_s"] / s["best_jit_s"], ".3f") if "best_jit_s" in s else "-"
      lines.append(f"| {key} | {cands} | {top['pick']} | {best} | {jit} | |")
    else:
      lines.append(f"| {key} | {cands} | - | - | - | {', '.join(top.get('missing', []))} |")
  variants = [(k, c) for k, c in results.items() if c.get("variants")]
  if variants:
    lines += [
      "",
      "The same strategy with its collectives over both axes run by NCCL (`xla`), by one flat "
      "ring (`ring`), by a ring per level one after the other (`hring`) or overlapped "
      "(`horing`, HO-Ring), seconds per step by the same estimate (exposed communication in "
      "brackets); the paper reports HO-Ring +32.6% to +36.5% throughput over Ring.",
      "",
      "| cell | strategy | xla | ring | hring | horing | horing vs ring | horing vs xla |",
      "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for key, cell in variants:
      for strategy in sorted({v.split("/")[0] for v in cell["variants"]}):
        runs = {"xla": cell["xla"].get(strategy)}
        runs.update({i: cell["variants"].get(f"{strategy}/{i}") for i in VARIANT_IMPLS})
        step = {i: r["estimate"]["step_s"] for i, r in runs.items() if _ok(r)}
        show = lambda i: (
          f"{step[i]:.3f} ({runs[i]['estimate']['exposed_comm_s']:.3f})" if i in step else "-"
        )
        vs = lambda i: f"{step[i] / step['horing']:.2f}x" if {i, "horing"} <= set(step) else "-"
        lines.append(
          f"| {key} | {strategy} | {show('xla')} | {show('ring')} | {show('hring')} | "
          f"{show('horing')} | {vs('ring')} | {vs('xla')} |"
        )
  lines += [
    "",
    "The paper's comparison by the same estimate: the best of IIG, IGG and NIG against ZeRO-3 "
    "(GGG) and ZeRO-2 (NGG); the paper reports 1.19x-2.50x over ZeRO (8 x A100 per node, "
    "public cloud). A strategy whose compiled memory does not fit is left out.",
    "",
    "| cell | best of IIG/IGG/NIG | x ZeRO-3 (GGG) | x ZeRO-2 (NGG) | tokens/s per GPU |",
    "|---|---|---:|---:|---:|",
  ]
  for key, cell in results.items():
    lines.append(paper_row(key, cell))
  lines += exposed_section(results)
  lines += bound_section(args, results)
  lines += NOTES
  below = below_floor(results)
  lines += [
    "",
    "Per strategy, seconds per step (XLA: step / compute / exposed communication; planner: "
    "step), the link floor (the strategy's inter-node bytes per GPU, by the traffic formulas "
    "the compiled programs match within 1%, over the GPU's share of its node's link: no "
    "schedule is shorter; `(below)` where XLA's step is shorter, because its model gives each "
    "collective in flight the whole link), compile time of the estimate (on a machine shared "
    "with other jobs). XLA's step is below the link floor in "
    f"{sum(b for b, _ in below.values())} of {sum(n for _, n in below.values())} fitting "
    "compiles (" + ", ".join(f"{key}: {b} of {n}" for key, (b, n) in below.items()) + "):",
    "",
    "| cell | strategy | XLA step | XLA compute | XLA exposed | MFU | planner step | link floor "
    "s | compile s |",
    "|---|---|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for key, cell in results.items():
    for strategy, r in cell["xla"].items():
      plan = cell["planner"]["step_s"].get(strategy)
      floor = cell.get("link_floor_s", {}).get(strategy)
      plan = "does not fit" if plan is None else f"{plan:.3f}"
      lines.append(_row(key, strategy, r, plan, floor))
    for name, r in {**cell.get("baselines", {}), **cell.get("variants", {})}.items():
      lines.append(_row(key, name, r, "-"))
  with open(os.path.join(args.out, "README.md"), "w") as f:
    f.write("\n".join(lines) + "\n")


def plot(args, results: dict) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 6))
  for key, cell in results.items():
    pts = [
      (cell["planner"]["step_s"].get(s), r["estimate"]["step_s"])
      for s, r in cell["xla"].items()
      if "error" not in r and r["estimate"].get("step_s") and cell["planner"]["step_s"].get(s)
    ]
    if pts:
      ax.scatter(*zip(*pts), label=key, s=18)
  lims = ax.get_xlim()
  ax.plot(lims, lims, "k:", lw=1)
  ax.set(xscale="log", yscale="log", xlabel="planner step s", ylabel="XLA estimate step s")
  ax.legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(os.path.join(args.out, "gpu_estimates.png"), dpi=120)


def parse_key(key: str) -> tuple[str, int, float, int]:
  """(model, nodes, gbit, A) of a cell_key."""
  model, mesh, gbit, a = key.split()
  return model, int(mesh.split("x")[0]), float(gbit.removesuffix("gbit")), int(a.split("=")[1])


def parse_cells(args) -> list[tuple[str, int, float, int]]:
  """The cells to compile: --cells MODEL:NODES:GBIT:A,... in that order, else the product of
  --models, --nodes, --micro-batches and --gbit."""
  if args.cells:
    out = []
    for item in args.cells.split(","):
      parts = item.split(":")
      if len(parts) != 4:
        raise SystemExit(f"--cells: {item!r} is not MODEL:NODES:GBIT:A, e.g. 7b:4:100:1")
      out.append((parts[0], int(parts[1]), float(parts[2]), int(parts[3])))
    return out
  return [
    (m, n, g, a)
    for m, n, a, g in itertools.product(
      args.models.split(","),
      [int(n) for n in args.nodes.split(",")],
      [int(a) for a in args.micro_batches.split(",")],
      [float(g) for g in args.gbit.split(",")],
    )
  ]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--target", default="h100")
  ap.add_argument("--models", default="7b")
  ap.add_argument("--nodes", default="2,4")
  ap.add_argument("--gbit", default="25,100,400", help="inter-node Gbit/s per node")
  ap.add_argument("--micro-batches", default="1,8")
  ap.add_argument(
    "--cells", default=None, help="MODEL:NODES:GBIT:A,... (instead of the product above)"
  )
  ap.add_argument("--seq-len", type=int, default=2048)
  ap.add_argument("--strategies", default=None, help="comma-separated (default: all 14)")
  ap.add_argument(
    "--baselines", default=",".join(BASELINES), help="plain-jit baselines to compile ('' none)"
  )
  ap.add_argument(
    "--variants",
    default="",
    help="strategies to compile again with --collectives ring, hring and horing",
  )
  ap.add_argument("--out", required=True)
  ap.add_argument("--resume", action="store_true", help="keep the estimates already in --out")
  ap.add_argument("--redo", default=None, help="with --resume: compile these strategies again")
  ap.add_argument(
    "--report-only",
    action="store_true",
    help="compile nothing: the planner's figures again for every saved cell, the page rewritten",
  )
  ap.add_argument(
    "--merge",
    default=None,
    metavar="DIR",
    help="add the compiles of another run's --out (its gpu_estimates.json) to --out's, then "
    "write the page (compiles nothing)",
  )
  ap.add_argument("--child-baseline", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--xla-defaults", action="store_true", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  sys.path.insert(0, ROOT)
  if args.child_baseline:
    child_baseline(args)
    return 0
  from paro_jax.core.strategy import VALID_NAMES

  strategies = args.strategies.split(",") if args.strategies else list(VALID_NAMES)
  baselines = [b for b in args.baselines.split(",") if b]
  variants = [v for v in args.variants.split(",") if v]
  os.makedirs(args.out, exist_ok=True)
  command = "python experiments/gpu_estimates.py " + shlex.join(
    argv if argv is not None else sys.argv[1:]
  )
  path = os.path.join(args.out, "gpu_estimates.json")
  results, commands = {}, []
  if (args.resume or args.report_only or args.merge) and os.path.exists(path):
    with open(path) as f:
      saved = json.load(f)
    results = saved["cells"]
    commands = saved.get("commands", [saved["command"]] if "command" in saved else [])
  if args.merge:
    with open(os.path.join(args.merge, "gpu_estimates.json")) as f:
      other = json.load(f)
    commands += [c for c in other["commands"] if c not in commands]
    for key, cell in other["cells"].items():
      mine = results.setdefault(key, {"xla": {}})
      for group in GROUPS:
        for name, r in cell.get(group, {}).items():
          if name not in mine.setdefault(group, {}) or "error" in mine[group][name]:
            mine[group][name] = r
  if not args.report_only:
    commands.append(command)
  command = "\n".join(commands)  # every run that wrote these results, in order

  def refresh(model, nodes, gbit, a):
    cell = results.setdefault(cell_key(model, nodes, gbit, a), {"xla": {}})
    cell["planner"] = planner_times(args, model, nodes, gbit, a, with_compile_top=True)
    cell["link_floor_s"] = link_floors(args, model, nodes, gbit, a)
    cell["planner_two_level"] = planner_times(args, model, nodes, gbit, a, "hierarchical")
    cell["planner_one_pass"] = planner_times(args, model, nodes, gbit, a, None, True)
    return cell

  for key in list(results):  # the planner as it is now, for every cell already compiled
    refresh(*parse_key(key))
  if args.report_only or args.merge:
    write(args, command, results)
    plot(args, results)
    return 0
  for model, nodes, gbit, a in parse_cells(args):
    key = cell_key(model, nodes, gbit, a)
    if args.redo:  # compiled before a fix: compile these again
      for strategy in args.redo.split(","):
        results.get(key, {}).get("xla", {}).pop(strategy, None)
    cell = refresh(model, nodes, gbit, a)
    todo = [("xla", s, s, "xla") for s in strategies]
    todo += [("baselines", b, b, "xla") for b in baselines]
    todo += [("variants", f"{v}/{i}", v, i) for v in variants for i in VARIANT_IMPLS]
    for group, name, strategy, collectives in todo:
      done = cell.setdefault(group, {})
      if name in done and "error" not in done[name]:
        continue
      done[name] = xla_estimate(args, model, nodes, gbit, a, strategy, collectives)
      r = done[name]
      r["date"] = str(datetime.date.today())
      step = r.get("estimate", {}).get("step_s")
      print(
        f"{key} {name}: " + (r.get("error") or f"{step:.3f} s") + f" ({r['compile_s']:.0f} s)",
        flush=True,
      )
      write(args, command, results)
  write(args, command, results)
  plot(args, results)
  return 0


if __name__ == "__main__":
  sys.exit(main())
