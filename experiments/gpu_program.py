"""The GPU program of every strategy, compiled for a GPU cluster on this machine (no GPU needed).

For each strategy and collective implementation, `paro-jax inspect --target` compiles the step
and reads its schedule: the share of per-micro-batch collective bytes with compute inside their
window, HO-Ring steps with both levels in flight on different streams, async/sync counts, and
compiled memory per device beside the planner's estimate. Writes a Markdown table, the JSON of
every report (both after each configuration; `--resume` skips the configurations already there)
and a plot (overlap and memory per configuration).

  python experiments/gpu_program.py --target h100 --model 7b --mesh 2x4 \
      --out experiments/results/gpu_program_7b_2x4
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def inspect(args, strategy: str, impl: str) -> dict:
  cmd = [
    sys.executable, "-m", "paro_jax", "inspect", "--target", args.target, "--mesh", args.mesh,
    "--model", args.model, "--strategy", strategy, "--collectives", impl,
    "--micro-batches", str(args.micro_batches), "--batch-size", str(args.batch_size),
    "--seq-len", str(args.seq_len), "--attention", args.attention, "--json",
  ]  # fmt: skip
  env = {**os.environ, "PYTHONPATH": ROOT}
  env.pop("XLA_FLAGS", None)
  t = time.perf_counter()
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
  if proc.returncode:
    return {"strategy": strategy, "impl": impl, "error": proc.stderr.strip().splitlines()[-1]}
  r = json.loads(proc.stdout)
  r["compile_s"] = time.perf_counter() - t
  return r


def row(r: dict) -> str:
  if "error" in r:
    return f"| {r['strategy']} | {r['impl']} | error: {r['error'][:80]} | | | | | |"
  o, m = r["overlap"], r["memory"]
  frac = o["collective_bytes_fraction"]
  steps = f"{o['horing_steps_concurrent']} / {o['horing_steps']}" if o["horing_steps"] else "-"
  return (
    f"| {r['strategy']} | {r['collectives_impl']} | "
    + ("-" if frac is None else f"{frac:.1%}")
    + f" | {steps} | {o['async_collectives']} / {o['sync_collectives']} | "
    f"{m['compiled_bytes'] / 1e9:.1f} | {m['planned_bytes'] / 1e9:.1f} | "
    f"{m['compiled_bytes'] / m['planned_bytes'] - 1:+.0%} |"
  )


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--target", default="h100")
  ap.add_argument("--model", default="7b")
  ap.add_argument("--mesh", default="2x4")
  ap.add_argument("--micro-batches", type=int, default=2)
  ap.add_argument("--batch-size", type=int, default=None, help="default: one sequence per GPU")
  ap.add_argument("--seq-len", type=int, default=2048)
  ap.add_argument("--strategies", default=None, help="comma-separated (default: all 14)")
  ap.add_argument("--impls", default="xla,horing")
  ap.add_argument("--attention", default="auto", help="as inspect's (auto: cuDNN's kernel)")
  ap.add_argument("--out", required=True)
  ap.add_argument("--resume", action="store_true", help="keep the reports already in --out")
  args = ap.parse_args(argv)
  sys.path.insert(0, ROOT)
  from paro_jax.core.names import parse_mesh_shape
  from paro_jax.core.strategy import VALID_NAMES

  inter, intra = parse_mesh_shape(args.mesh)
  args.batch_size = args.batch_size or inter * intra
  strategies = args.strategies.split(",") if args.strategies else list(VALID_NAMES)
  os.makedirs(args.out, exist_ok=True)
  command = "python experiments/gpu_program.py " + " ".join(
    a if " " not in a else repr(a) for a in (argv if argv is not None else sys.argv[1:])
  )
  path = os.path.join(args.out, "gpu_program.json")
  done = {}
  if args.resume and os.path.exists(path):
    with open(path) as f:
      done = {(r["strategy"], r["impl"]): r for r in json.load(f)["reports"] if "error" not in r}
  reports = []
  for strategy in strategies:
    for impl in args.impls.split(","):
      r = done.get((strategy, impl)) or inspect(args, strategy, impl)
      r.setdefault("impl", impl)
      r.get("overlap", {}).pop("collectives", None)  # per-op rows: in each report, not here
      reports.append(r)
      print(row(r), flush=True)
      write(args, command, reports)
  plot(args, reports)
  return 0


def write(args, command: str, reports: list) -> None:
  from experiments.pages import machine_line  # ROOT is on sys.path once main has put it there

  header = [
    f"# The GPU program: {args.model} on {args.mesh} {args.target}",
    "",
    f"`{command}`",
    "",
    f"Compiled on {datetime.date.today()} ({machine_line()}, no GPU); A={args.micro_batches}, "
    f"{args.batch_size} x {args.seq_len} tokens per micro-batch, --attention {args.attention}. "
    "Nothing ran: the table is what the compiled program schedules, not what it achieves. "
    '"-" in the overlap column: no collective inside the micro-batch loop.',
    "",
    "| strategy | collectives | bytes with compute inside | HO-Ring steps concurrent | "
    "async / sync collectives | compiled GB | planned GB | compiled vs plan |",
    "|---|---|---:|---:|---:|---:|---:|---:|",
  ]
  with open(os.path.join(args.out, "gpu_program.md"), "w") as f:
    f.write("\n".join(header + [row(r) for r in reports]) + "\n")
  with open(os.path.join(args.out, "gpu_program.json"), "w") as f:
    json.dump({"command": command, "reports": reports}, f, indent=1)


def plot(args, reports: list) -> None:
  """gpu_program.png: per strategy, the overlap of each implementation, and compiled memory
  beside the plan."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("no matplotlib: no plot (pip install -e '.[bench]')", file=sys.stderr)
    return
  ok = [r for r in reports if "error" not in r]
  strategies = list(dict.fromkeys(r["strategy"] for r in ok))
  impls = list(dict.fromkeys(r["collectives_impl"] for r in ok))
  by = {(r["strategy"], r["collectives_impl"]): r for r in ok}
  fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
  width = 0.8 / len(impls)
  for k, impl in enumerate(impls):
    xs = [i + k * width for i in range(len(strategies))]
    rs = [by.get((s, impl)) for s in strategies]
    frac = [(r["overlap"]["collective_bytes_fraction"] or 0) if r else 0 for r in rs]
    top.bar(xs, [100 * f for f in frac], width, label=impl)
    mem = [r["memory"]["compiled_bytes"] / 1e9 if r else 0 for r in rs]
    bottom.bar(xs, mem, width, label=f"{impl}: compiled")
  plan = [by[s, impls[0]]["memory"]["planned_bytes"] / 1e9 for s in strategies]
  bottom.scatter(
    [i + 0.4 - width / 2 for i in range(len(strategies))], plan, color="k", marker="_", s=400,
    label="planned", zorder=3,
  )  # fmt: skip
  top.axhline(90, color="grey", ls=":")
  top.set_ylabel("collective bytes with\ncompute in window (%)")
  bottom.set_ylabel("memory per GPU (GB)")
  bottom.set_xticks([i + 0.4 - width / 2 for i in range(len(strategies))], strategies)
  top.legend(), bottom.legend(fontsize=8)
  top.set_title(f"{args.model} on {args.mesh} {args.target}, A={args.micro_batches} (compiled)")
  fig.tight_layout()
  fig.savefig(os.path.join(args.out, "gpu_program.png"), dpi=110)


if __name__ == "__main__":
  sys.exit(main())
