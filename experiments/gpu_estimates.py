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

The code is three modules: this one (the command line and the compiles, each in a process of its
own), experiments/gpu_estimates_cell.py (a cell's planner figures, link floors and summary) and
experiments/gpu_estimates_page.py (the page and the plot).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script: the repository's packages importable
from experiments.gpu_estimates_cell import (  # noqa: E402
  BASELINES,
  DEFAULTS,
  GPUS_PER_NODE,
  GROUPS,
  VARIANT_IMPLS,
  cell_key,
  link_floors,
  parse_key,
  planner_times,
  share_the_link,
)
from experiments.gpu_estimates_page import plot, write  # noqa: E402


def child_baseline(args) -> None:
  """Compile a plain-jit baseline for the target, print inspect's `estimate` and `memory`."""
  from paro_jax.analysis.gpu import estimate, targets

  targets.prepare_deviceless_compile()
  nodes, a, gbit = int(args.nodes), int(args.micro_batches), float(args.gbit)
  estimate.prepare_environment(gbit * 1e9, GPUS_PER_NODE)
  import tempfile

  import jax
  import jax.numpy as jnp
  from jax.sharding import AxisType, Mesh

  from experiments.bench.baselines import build
  from paro_jax.core.mesh import make_mesh
  from paro_jax.core.xla_flags import GPU_FLAGS

  grid = make_mesh(nodes, GPUS_PER_NODE, devices=targets.devices(args.target, nodes, GPUS_PER_NODE))
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
      with targets.cudnn_checks(args.target):
        lowered = jstep.lower(state, batch)
      flags = {} if args.xla_defaults else GPU_FLAGS
      compiled = lowered.compile(compiler_options={**flags, "xla_dump_to": dump})
  tokens = a * batch_size * args.seq_len
  e = estimate.estimate(
    compiled.as_text(),
    log[0],
    compute_capability=targets.compute_capability(args.target),
    peak_flops=targets.target_gpu(args.target).peak_flops,
    memory_bandwidth=targets.memory_bandwidth(args.target),
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
  device = targets.target_gpu(args.target).memory_bytes
  memory = {"compiled_bytes": peak, "fits": peak <= device}
  print(json.dumps({"estimate": e, "memory": memory}))


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
    help="compile nothing: the planner's figures and the steps with the link shared "
    "(link.link_shared) again for every saved cell, the page rewritten",
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
  if not args.report_only or command not in commands:  # a report rescores: it writes steps too
    commands.append(command)
  command = "\n".join(commands)  # every run that wrote these results, in order

  def refresh(model, nodes, gbit, a):
    cell = results.setdefault(cell_key(model, nodes, gbit, a), {"xla": {}})
    cell["planner"] = planner_times(args, model, nodes, gbit, a, with_compile_top=True)
    cell["link_floor_s"] = link_floors(args, model, nodes, gbit, a)
    share_the_link(cell)
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
      share_the_link(cell)  # the step on the formulas' floor, as the cell's others
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
