"""Throughput of PaRO strategies on an emulated 2-node cluster, across link regimes.

Every run is a real multi-process training run: `paro_jax.cluster.launch.launch` starts one
process per "node" (2 nodes x 4 virtual CPU devices), each in its own network namespace, joined by
a veth pair whose egress is shaped with tc tbf (rate only: latency is not emulated).

  1. Calibrate: the FLOP/s of one virtual device (paro_jax's model FLOPs,
     `LlamaConfig.flops_per_token(seq_len) * tokens`, over the time of a forward+backward of the
     per-device micro-batch). Two figures: one device alone in a 1-process run, and each of 8
     devices running their own micro-batch at once (they share this machine's cores, as the 8
     devices of the emulated cluster do). The second one (`effective`) sets the link rates.
  2. Regimes: real clusters named by FLOP per inter-node byte (a device's effective FLOP/s over
     its share of the node's network). The emulated link rate of a regime is
       (effective device FLOP/s x devices per node) / (FLOP per byte)
     clamped to what tc accepts; plus fixed rates named in --regimes (e.g. 1gbit), plus an
     "unshaped" reference (100gbit, the same namespaces) that every overhead is relative to.
  3. For each (regime, configuration, A) one launch of `train --steps K`; from the run's
     metrics.jsonl (written by process 0): median step time over the steps after `--skip`
     (the first includes compilation), tokens/s, communication overhead (step time / the same
     configuration's step time on the unshaped link), inter-node bytes per optimizer step counted
     by tc on the wire (sum of both nodes' egress; per-step deltas), beside the compiled-HLO
     figure (paro_jax.analysis.inspect.inspector.report) and the formula
     (paro_jax.analysis.planner.costs), and the per-device model-state memory.
  4. Baselines "as most JAX users would write it": one plain `jax.jit` training step (same model,
     remat, optax AdamW with global-norm clipping) with NamedSharding annotations only, XLA
     partitioning the rest: `jit-fsdp` (every state sharded over all 8 devices) and `jit-hsdp`
     (sharded over the 4 devices of a node, replicated across nodes). They run as children of the
     launcher (`python experiments/bench_strategies.py --child baseline ...`).
  5. Outputs under --out: strategies.json (command line, machine, calibration, regimes, every
     run), strategies.md (tables), strategies.png (throughput relative to the reference per
     regime), and runs/REGIME/LABEL_A*/ (metrics.jsonl and the launcher's log of each run).

A configuration is a strategy with its collectives, or a baseline; it is named by its label:
the strategy's letters (`GGG`), with `/IMPL` added when it runs with collectives other than
--collectives (`GGG/horing`; --collectives-for asks for those). Each label is its own
configuration in every table.

Smoke test (a few minutes):
  python experiments/bench_strategies.py --model tiny --strategies IIG,GGG --baselines jit-fsdp \
      --micro-batches 1 --steps 4 --regimes 1gbit --out experiments/results/strategies_smoke
Full run (see the estimate a smoke run prints):
  python experiments/bench_strategies.py --model small --micro-batches 1,4,8 \
      --regimes infiniband,paper_cloud,commodity,1gbit
The same: `python -m experiments.bench.strategies ...`.

Needs root with `ip` and `tc` (else the launcher falls back to unshaped loopback and the byte
counts are missing). The hidden `--child calibrate|inspect|baseline` modes are what the
orchestrator runs in subprocesses; the orchestrator itself never imports jax. The code, one job
a module, is in experiments/bench/ (its __init__ lists them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import sys
import time

from experiments.bench import calibration, configs, estimates, report, runs, traffic
from experiments.bench.configs import (
  BASELINES,
  DEFAULT_REFERENCE,
  DEVICES_PER_NODE,
  NODES,
  REMAT,
)
from experiments.bench.torch_peer import REMAT as TORCH_REMAT
from experiments.pages import machine_line


def parser() -> argparse.ArgumentParser:
  from paro_jax.core.names import (  # imports no jax
    AUTO_COLLECTIVES,
    COLLECTIVE_IMPLS,
    DEFAULT_INT8_BLOCK,
    WIRE_FORMATS,
  )

  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--model", default="small")
  ap.add_argument("--strategies", default=None, help="comma-separated (default: all 14)")
  ap.add_argument(
    "--baselines",
    default=",".join(BASELINES),
    help=f"comma-separated subset of {BASELINES} ('' for none)",
  )
  ap.add_argument("--micro-batches", default="1,4,8", help="A values, comma-separated")
  ap.add_argument(
    "--regimes",
    default="infiniband,paper_cloud,commodity,1gbit",
    help=f"named ({', '.join(calibration.REGIMES)}) or fixed tc rates (e.g. 1gbit); the "
    f"unshaped reference is always run",
  )
  ap.add_argument(
    "--batch-size",
    type=int,
    default=32,
    help="global micro-batch in sequences (default 32 x 512: 2,048 tokens per device "
    "and micro-batch, as one 2,048-token sequence per GPU in the papers)",
  )
  ap.add_argument("--seq-len", type=int, default=512)
  ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
  ap.add_argument(
    "--remat",
    default="full",
    choices=REMAT,
    help="what backward recomputes, for every configuration: the strategies' `train --remat` "
    "and the jit baselines' model; the torch peers checkpoint every decoder layer with full "
    "(the same recomputation) and nothing with none (layer has no torch counterpart)",
  )
  ap.add_argument(
    "--collectives",
    default=AUTO_COLLECTIVES,
    choices=(AUTO_COLLECTIVES, *COLLECTIVE_IMPLS),
    help="the strategies' collectives (default auto: what `train --collectives auto` picks on "
    "this emulated cluster, hring+xla where a strategy has collectives over both axes, else "
    "xla), except where --collectives-for names others",
  )
  ap.add_argument(
    "--torch-peers",
    default="",
    help="PyTorch peers to run beside the strategies, comma-separated, or 'all': "
    "full_shard,hsdp,hsdp_deferred,ddp_no_sync (experiments/bench/torch_peer.py; needs the "
    "[bench] extra)",
  )
  ap.add_argument(
    "--collectives-for",
    action="append",
    default=None,
    metavar="STRATEGIES=IMPLS",
    help="run these strategies once per collectives implementation listed, e.g. "
    "GGG,IGG=xla,hring,horing (repeatable; added to --strategies if absent). Labelled "
    "NAME/IMPL (GGG/horing), or NAME where IMPL is --collectives",
  )
  ap.add_argument(
    "--reference",
    default=None,
    metavar="LABEL",
    help=f"the configuration the 'vs' columns and the plot compare with (default "
    f"{DEFAULT_REFERENCE}; --report: the one strategies.json was written with)",
  )
  ap.add_argument(
    "--inter-params",
    default="same",
    choices=WIRE_FORMATS,
    help="wire precision of the parameter gathers across nodes (strategies only)",
  )
  ap.add_argument(
    "--inter-grads",
    default="same",
    choices=WIRE_FORMATS,
    help="wire precision of the gradient reductions across nodes (strategies only)",
  )
  ap.add_argument("--int8-block", type=int, default=DEFAULT_INT8_BLOCK)
  ap.add_argument("--steps", type=int, default=6)
  ap.add_argument(
    "--skip",
    type=int,
    default=1,
    help="leading steps left out of medians and byte counts (compilation)",
  )
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", default="experiments/results/strategies")
  ap.add_argument(
    "--lora-rank",
    type=int,
    default=0,
    help="LoRA mode: train adapters of this rank only (baselines are full training: "
    "pass --baselines '')",
  )
  ap.add_argument("--lora-alpha", type=float, default=16.0)
  ap.add_argument("--lora-targets", default="wq,wk,wv,wo,w_gate,w_up,w_down")
  ap.add_argument(
    "--calibration",
    default=None,
    metavar="JSON",
    help="reuse another run's calibration.json (the same link rates), e.g. the "
    "full-training benchmark's for the LoRA mode",
  )
  ap.add_argument(
    "--report",
    "--report-only",
    dest="report",
    action="store_true",
    help="only rewrite --out's strategies.md and .png from its strategies.json",
  )
  ap.add_argument(
    "--resume",
    action="store_true",
    help="reuse the runs already in --out (runs/REGIME/LABEL_A*/row.json) whose link "
    "rate is unchanged; run only the missing ones",
  )
  ap.add_argument(
    "--estimate-model",
    default="small",
    help="model of the full-run time estimate printed at the end ('' for none)",
  )
  ap.add_argument("--estimate-steps", type=int, default=6)
  # hidden: subprocess modes
  ap.add_argument(
    "--child", default=None, choices=["calibrate", "inspect", "baseline"], help=argparse.SUPPRESS
  )
  ap.add_argument("--kind", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--names", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--devices", type=int, default=NODES * DEVICES_PER_NODE, help=argparse.SUPPRESS)
  ap.add_argument("--repeats", type=int, default=3, help=argparse.SUPPRESS)
  ap.add_argument("--mesh", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--num-processes", type=int, default=None, help=argparse.SUPPRESS)
  ap.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
  return ap


def run_list(args) -> list[configs.Config]:
  """The configurations of --strategies, --collectives(-for) and --baselines; SystemExit naming
  what is unknown."""
  from paro_jax.core.strategy import VALID_NAMES

  names = (
    [s.strip().upper() for s in args.strategies.split(",")]
    if args.strategies
    else list(VALID_NAMES)
  )
  bad = [n for n in names if n not in VALID_NAMES]
  if bad:
    raise SystemExit(f"unknown strategies {bad}; valid: {', '.join(VALID_NAMES)}")
  baselines = [b for b in args.baselines.split(",") if b] if args.baselines else []
  if bad := [b for b in baselines if b not in BASELINES]:
    raise SystemExit(f"unknown baselines {bad}; choose from {BASELINES}")
  try:
    per = configs.parse_collectives_for(args.collectives_for)
    peers = configs.parse_torch_peers(args.torch_peers)
  except ValueError as e:
    raise SystemExit(str(e)) from None
  if peers and args.remat not in TORCH_REMAT:
    raise SystemExit(
      f"--remat {args.remat} has no torch counterpart: use --remat "
      f"{' or '.join(TORCH_REMAT)} with --torch-peers"
    )
  return configs.run_list(names, baselines, args.collectives, per, peers)


def orchestrate(args, command: str) -> None:
  if os.geteuid() != 0 or not shutil.which("tc"):
    print(
      "warning: not root or no tc: the launcher will run unshaped on loopback and no bytes "
      "will be counted",
      file=sys.stderr,
    )
  config_list = run_list(args)
  reference = args.reference or DEFAULT_REFERENCE
  if reference not in [c.label for c in config_list]:
    print(
      f"note: {reference} is not in the run list: no throughput relative to it",
      file=sys.stderr,
    )
  a_values = [int(x) for x in args.micro_batches.split(",")]
  regime_names = [r for r in args.regimes.split(",") if r]
  os.makedirs(args.out, exist_ok=True)
  log_path = os.path.join(args.out, "children.log")
  if not args.resume:
    open(log_path, "w").close()
  t_start = time.perf_counter()

  meta = {
    "command": command,
    "argv": sys.argv,
    "cwd": os.getcwd(),
    "machine": f"{machine_line()}, {platform.platform()}",
    "nodes": NODES,
    "devices_per_node": DEVICES_PER_NODE,
    "model": args.model,
    "batch_size": args.batch_size,
    "seq_len": args.seq_len,
    "dtype": args.dtype,
    "remat": args.remat,
    "steps": args.steps,
    "skip": args.skip,
    "collectives": args.collectives,
    "torch_peers": configs.parse_torch_peers(args.torch_peers) or None,
    "collectives_for": configs.parse_collectives_for(args.collectives_for) or None,
    "reference": reference,
    "inter_wire": {
      "params": args.inter_params,
      "grads": args.inter_grads,
      "int8_block": args.int8_block,
    },
    "inter_latency": "not emulated (no netem on this kernel): rate only",
    "lora": (
      {"rank": args.lora_rank, "alpha": args.lora_alpha, "targets": args.lora_targets}
      if args.lora_rank
      else None
    ),
    "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
  }

  calib = calibration.calibration_for(args, log_path)
  regimes = calibration.regimes_table(
    regime_names, calib["effective_flop_per_s_per_device"], configs.WIRE_ITEMSIZE
  )
  calibration.print_regimes(regimes)

  print("\ncompiling every configuration for its HLO traffic ...", flush=True)
  hlo, inspect_wall = traffic.inspect_all(args, config_list, a_values, log_path)

  def write(rows, est=None, calib_target=None):
    meta["wall_s"] = time.perf_counter() - t_start
    result = {
      "meta": meta,
      "calibration": calib,
      "estimate_calibration": calib_target,
      "regimes": regimes,
      "hlo": hlo,
      "runs": rows,
      "summary": report.summary(rows, reference),
      "full_run_estimate": est or {},
    }
    with open(os.path.join(args.out, "strategies.json"), "w") as f:
      json.dump(result, f, indent=2)
    md_text = report.markdown(rows, regimes, calib, meta, reference)
    with open(os.path.join(args.out, "strategies.md"), "w") as f:
      f.write(md_text)
    return md_text, report.plot(rows, os.path.join(args.out, "strategies.png"), reference)

  rows = []
  for g in regimes:
    for config in config_list:
      for a in a_values:
        r = runs.run_one(args, g, config, a, runs.run_dir(args.out, g, config, a))
        rows.append(r)
        print(runs.progress_line(r), flush=True)
        # Partial results survive an interrupted run.
        write(report.summarize(rows, hlo, reference))
  report.summarize(rows, hlo, reference)
  calib_target = calib
  if args.estimate_model and args.estimate_model != args.model:
    print(f"\ncalibrating {args.estimate_model} for the full-run estimate ...", flush=True)
    calib_target = calibration.calibrate(args, args.estimate_model, log_path)
  est = (
    estimates.estimate(args, rows, calib, calib_target, inspect_wall, hlo)
    if args.estimate_model
    else {}
  )
  md_text, png = write(rows, est, calib_target)
  print("\n" + md_text)
  if est:
    print(estimates.describe(est))
  print(
    f"wrote {args.out}/strategies.json, strategies.md"
    + (
      ", strategies.png"
      if png
      else f" (no plot: matplotlib missing or no {reference} run to compare with)"
    )
    + f" in {meta['wall_s']:.0f} s"
  )


def report_only(out: str, reference: str | None = None) -> None:
  """Rewrite strategies.md and strategies.png from strategies.json (no runs), relative to
  `reference` (default: the one it was written with)."""
  with open(os.path.join(out, "strategies.json")) as f:
    result = json.load(f)
  reference = reference or result["meta"].get("reference") or DEFAULT_REFERENCE
  rows = report.summarize(result["runs"], result["hlo"], reference)
  result["summary"] = report.summary(rows, reference)
  with open(os.path.join(out, "strategies.json"), "w") as f:
    json.dump(result, f, indent=2)
  md_text = report.markdown(
    rows, result["regimes"], result["calibration"], result["meta"], reference
  )
  with open(os.path.join(out, "strategies.md"), "w") as f:
    f.write(md_text)
  report.plot(rows, os.path.join(out, "strategies.png"), reference)
  print(md_text)


def main(argv: list[str] | None = None, entry: list[str] | None = None) -> None:
  """The benchmark's command line. `entry`: how it was invoked, for the command recorded in
  strategies.json (default sys.argv[0], the script path)."""
  ap = parser()
  args = ap.parse_args(argv)
  if args.child == "calibrate":
    calibration.child_calibrate(args)
  elif args.child == "inspect":
    traffic.child_inspect(args)
  elif args.child == "baseline":
    from experiments.bench import baselines

    baselines.child_baseline(args)
  elif args.report:
    report_only(args.out, args.reference)
  else:
    if args.skip >= args.steps:
      ap.error(f"--skip {args.skip} must be below --steps {args.steps}")
    words = [*(entry or sys.argv[:1]), *(sys.argv[1:] if argv is None else argv)]
    orchestrate(args, shlex.join([sys.executable.rsplit("/", 1)[-1], *words]))


if __name__ == "__main__":
  main(entry=["-m", "experiments.bench.strategies"])
