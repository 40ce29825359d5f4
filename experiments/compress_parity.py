"""Loss parity of compressed inter-node traffic: `tiny` on the built-in corpus, 2x4 mesh, the
same seed and batches with --inter-params/--inter-grads same, bf16 and int8; eval loss per step.

  python -m experiments.compress_parity --strategies IIG GGG NIG --steps 300 \
      --out experiments/results/compress_parity

writes OUT/runs/<strategy>-<wire>/metrics.jsonl, OUT/parity.json, OUT/parity.md (the eval loss at
the last step and its change against `same`, pass or fail against the targets) and one plot per
strategy, OUT/<strategy>.png (train and eval loss of the three runs together).

The default compute dtype is fp32, so that `same` sends fp32 and bf16 halves the bytes (in bf16
compute a bf16 wire changes nothing).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform

from paro_jax.core.names import DEFAULT_INT8_BLOCK

# eval-loss change allowed against `same`: tight on `tiny` (300 steps), looser on the larger
# `small`, whose 100 steps leave it further from convergence.
TARGETS = {"tiny": {"bf16": 0.005, "int8": 0.015}, "small": {"bf16": 0.005, "int8": 0.02}}


def run_one(strategy, wire, args):
  from paro_jax.run.train import RunConfig, train

  cfg = RunConfig(
    model=args.model,
    strategy=strategy,
    mesh=(2, 4),
    batch_size=args.batch_size,
    seq_len=args.seq_len,
    dtype=args.dtype,
    steps=args.steps,
    warmup=10,
    eval_every=args.steps // 10 or 1,
    eval_batches=args.eval_batches,
    inter_params=wire,
    inter_grads=wire,
    int8_block=args.block,
    out=os.path.join(args.out, "runs", f"{strategy}-{wire}"),
  )
  rows = [json.loads(line) for line in open(train(cfg))]
  return {
    "eval": [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r],
    "run_dir": cfg.out,
  }


def report(results, args) -> str:
  lines = [
    f"`{args.model}`, built-in corpus, 2x4 mesh, {args.dtype} compute, batch {args.batch_size} x "
    f"{args.seq_len}, {args.steps} steps, int8 block {args.block}; eval loss at step {args.steps} "
    f"over {args.eval_batches} fixed batches of the held-out split.",
    "",
    "| strategy | inter wire | eval loss | vs same | target | met |",
    "|---|---|---:|---:|---:|---|",
  ]
  for (strategy, wire), r in results.items():
    last, base = r["eval"][-1][1], results[(strategy, "same")]["eval"][-1][1]
    change = last / base - 1
    target = TARGETS.get(args.model, TARGETS["tiny"]).get(wire)
    met = "" if target is None else ("yes" if abs(change) <= target else "**no**")
    tgt = "" if target is None else f"{target:.1%}"
    vs = "" if wire == "same" else f"{change:+.2%}"
    lines.append(f"| {strategy} | {wire} | {last:.4f} | {vs} | {tgt} | {met} |")
  return "\n".join(lines) + "\n"


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--strategies", nargs="+", default=["IIG"])
  p.add_argument("--wires", nargs="+", default=["same", "bf16", "int8"])
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--model", default="tiny")
  p.add_argument("--dtype", default="fp32")
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--batch-size", type=int, default=16)
  p.add_argument("--block", type=int, default=DEFAULT_INT8_BLOCK)
  p.add_argument(
    "--eval-batches",
    type=int,
    default=32,
    help="eval loss over this many fixed batches (one batch is too few to tell runs apart)",
  )
  p.add_argument("--out", default="runs/compress_parity")
  args = p.parse_args(argv)
  if "same" not in args.wires:
    p.error("--wires must include 'same', the reference")
  results = {(s, w): run_one(s, w, args) for s in args.strategies for w in args.wires}
  table = report(results, args)
  print(table)
  os.makedirs(args.out, exist_ok=True)
  stamp = f"{datetime.date.today()}, {platform.node() or 'this machine'} (CPU, 8 virtual devices)"
  with open(os.path.join(args.out, "parity.md"), "w") as f:
    f.write(f"# Loss parity of compressed inter-node traffic\n\nMeasured {stamp}:\n\n")
    f.write("    python -m experiments.compress_parity " + " ".join(argv or []) + "\n\n" + table)
  with open(os.path.join(args.out, "parity.json"), "w") as f:
    json.dump({f"{s}-{w}": r for (s, w), r in results.items()} | {"args": vars(args)}, f, indent=1)
  plot(results, args, os.path.join(args.out, "parity.png"))


def plot(results, args, path):
  """The eval-loss curves: one panel a strategy, a line a wire format."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, len(args.strategies), figsize=(5 * len(args.strategies), 4))
  for ax, s in zip(list(getattr(axes, "flat", [axes])), args.strategies):
    for w in args.wires:
      steps, losses = zip(*results[(s, w)]["eval"])
      ax.plot(steps, losses, "o-", markersize=3, label=f"inter {w}")
    ax.set(title=s, xlabel="step", ylabel=f"eval loss ({args.eval_batches} batches)")
    ax.grid(alpha=0.3)
    ax.legend()
  fig.suptitle(f"{args.model}, 2x4, {args.dtype} compute, int8 block {args.block}")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  return path


if __name__ == "__main__":
  import sys

  from paro_jax.core.xla_flags import provide_cpu_devices

  provide_cpu_devices(8)
  main(sys.argv[1:])
