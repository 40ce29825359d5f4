"""How far a healthy run's loss and gradient norm stray from their running band, and how soon a
diverging one leaves it: the evidence behind the divergence guard's defaults (run/divergence.py).

  python -m experiments.divergence_band --model tiny --lrs 1e-3 3e-3 1e-2 3e-2 --diverging 30 1e30 \
      --steps 200 --out experiments/results/divergence_band

trains each learning rate (strategy IIG, mesh 2x4, bf16, batch 16 x 64, the built-in corpus,
--divergence-guard off; a finished run already under OUT/runs is read back) and writes
OUT/<model>.json and OUT/<model>.md: per run, the largest ratio of a step's loss and of its
gradient norm to the mean of the previous `window` steps (after `min_history` steps), the
largest loss, and the first step the default guard flags.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from experiments.pages import machine_line, utc_now


def run_one(model, lr, args):
  """The metrics rows of one run; a finished run of an earlier call is read back (the runs are
  deterministic), so that a failed analysis need not train again."""
  from paro_jax.run.config import OptimizerOptions, RunConfig
  from paro_jax.run.divergence import GuardConfig
  from paro_jax.run.train import train

  out = os.path.join(args.out, "runs", f"{model}-lr{lr:g}")
  path = os.path.join(out, "metrics.jsonl")
  if os.path.exists(path):
    rows = [json.loads(line) for line in open(path)]
    if rows and rows[-1]["step"] == args.steps:
      return finite_or_nan(rows)

  cfg = RunConfig(
    model=model,
    strategy="IIG",
    mesh=(2, 4),
    batch_size=16,
    seq_len=64,
    optimizer=OptimizerOptions(steps=args.steps, lr=lr),
    guard=GuardConfig(mode="off"),
    max_bad_steps=args.steps,
    out=out,
  )
  return finite_or_nan([json.loads(line) for line in open(train(cfg))])


def finite_or_nan(rows):
  """metrics.jsonl writes a non-finite loss or norm as null."""
  for r in rows:
    for key in ("loss", "grad_norm"):
      r[key] = math.nan if r[key] is None else r[key]
  return rows


def band_ratios(rows, window, min_history, patience):
  """The largest loss / band and grad-norm / band ratios of a run (band: the mean of the previous
  `window` finite steps), over the steps after `min_history`; and the largest ratio sustained for
  `patience` steps in a row (the smallest of those steps' ratios), which is what stops a run."""
  ratios = {"loss": [], "grad_norm": []}
  seen = {"loss": [], "grad_norm": []}
  for r in rows:
    for key in ratios:
      v = r[key]
      if not math.isfinite(v):
        ratios[key].append(math.inf)
        continue
      past = seen[key][-window:]
      mean = sum(past) / len(past) if past else 0.0
      if len(past) >= min_history:
        ratios[key].append(v / mean if mean > 0 else math.inf)
      seen[key].append(v)
  out = {}
  for key, rs in ratios.items():
    out[key] = max(rs, default=0.0)
    runs = [min(rs[i : i + patience]) for i in range(len(rs) - patience + 1)]
    out[f"{key}_sustained"] = max(runs, default=0.0)
  return out


def first_flag(rows, vocab):
  """The first step the default guard flags, and why (None: never)."""
  from paro_jax.run.divergence import DivergenceGuard, GuardConfig

  guard = DivergenceGuard(GuardConfig(mode="warn"), vocab)
  for r in rows:
    why = guard.observe(r["step"], r["loss"], r["grad_norm"])
    if why:
      return r["step"], why
  return None


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="tiny")
  p.add_argument("--lrs", nargs="+", type=float, default=[1e-3, 3e-3, 1e-2, 3e-2])
  p.add_argument("--diverging", nargs="+", type=float, default=[30.0, 1e30])
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--out", default="experiments/results/divergence_band")
  args = p.parse_args(argv)
  from paro_jax.core.xla_flags import provide_cpu_devices

  provide_cpu_devices(8)  # before jax is imported
  from models.config import get_config
  from paro_jax.run.divergence import GuardConfig

  defaults = GuardConfig()
  vocab = get_config(args.model).vocab
  results = []
  for lr in args.lrs + args.diverging:
    rows = run_one(args.model, lr, args)
    finite = [r["loss"] for r in rows if math.isfinite(r["loss"])]
    flag = first_flag(rows, vocab)
    results.append(
      {
        "lr": lr,
        "healthy_by_design": lr in args.lrs,
        "final_loss": rows[-1]["loss"],
        "max_loss": max(finite) if finite else math.nan,
        "max_ratio": band_ratios(rows, defaults.window, defaults.min_history, defaults.patience),
        "first_flag": flag,
      }
    )
  page = {
    "command": "python -m experiments.divergence_band "
    + " ".join(sys.argv[1:] if argv is None else argv),
    "date": utc_now(),
    "machine": f"{machine_line()}, 8 virtual CPU devices",
    "model": args.model,
    "steps": args.steps,
    "guard_defaults": defaults.__dict__,
    "runs": results,
  }
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, f"{args.model}.json"), "w") as f:
    json.dump(page, f, indent=1)
  lines = [
    f"# Divergence band: `{args.model}`, {args.steps} steps, IIG 2x4, bf16, batch 16 x 64",
    "",
    f"{page['date']}, {page['machine']}. Command: `{page['command']}`.",
    "",
    f"Ratios against the mean of the previous {defaults.window} steps (after "
    f"{defaults.min_history}); the guard's defaults: loss factor {defaults.loss_factor}, gradient "
    f"norm factor {defaults.grad_factor}, loss cap {defaults.cap_times_uniform} x ln(vocab) = "
    f"{defaults.cap_times_uniform * math.log(vocab):.2f}, patience {defaults.patience}.",
    "",
    f"| lr | final loss | max loss | max loss/band | sustained ({defaults.patience} steps) | "
    f"max grad/band | sustained | first flagged |",
    "|---:|---:|---:|---:|---:|---:|---:|---|",
  ]
  for r in results:
    flag = (
      "never" if r["first_flag"] is None else f"step {r['first_flag'][0]}: {r['first_flag'][1]}"
    )
    lines.append(
      f"| {r['lr']:g} | {r['final_loss']:.4g} | {r['max_loss']:.4g} | "
      f"{r['max_ratio']['loss']:.3f} | {r['max_ratio']['loss_sustained']:.3f} | "
      f"{r['max_ratio']['grad_norm']:.3f} | {r['max_ratio']['grad_norm_sustained']:.3f} | {flag} |"
    )
  with open(os.path.join(args.out, f"{args.model}.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
