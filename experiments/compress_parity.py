"""Loss parity of compressed inter-node traffic over several seeds, paired: each compressed run
against the uncompressed run with the same seed (same initial weights, same batches), the same
compute dtype and the same --grad-dtype.

  python -m experiments.compress_parity --model tiny --steps 300 --dtype bf16 --seeds 5 \
      --variants psame-gsame pint8-gint8 pint8-gint8-noef \
      --out experiments/results/compress_parity/tiny-300-bf16 --resume

A variant is `p<params wire>-g<grads wire>` with optional suffixes `-noef` (--no-error-feedback),
`-nodelta` (--no-param-delta), `-b<N>` (--int8-block N) and `-ring` (--collectives ring: the
same sums in another order, a control that perturbs the run without compressing anything);
`psame-gsame` is the baseline and is always run. Each run writes one JSON,
OUT/runs/<variant>/seed<k>.json (its eval curve and per-step train loss); with --resume the runs
whose JSON exists are not run again, so a long grid can be stopped and continued. Then
OUT/parity.md (per-seed eval losses, each variant's paired gap against the baseline per seed, and
their mean, standard deviation and range, against the targets), OUT/parity.json and OUT/parity.png
(the eval-loss curves: mean over seeds with the band from the lowest to the highest seed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import time

from experiments.pages import machine_line, utc_now
from paro_jax.core.names import DEFAULT_INT8_BLOCK

BASELINE = "psame-gsame"
# Mean paired eval-loss gap allowed against the baseline (over the seeds), by the variant's wire:
# the bf16 wire and int8 parameters and gradients (README.md, docs/collectives.md).
TARGETS = {"bf16": 0.003, "int8": 0.005}
VARIANT = re.compile(r"^p(same|bf16|int8)-g(same|bf16|int8)((?:-noef|-nodelta|-ring|-b\d+)*)$")


def parse_variant(name: str) -> dict:
  """`pint8-gint8-noef-nodelta-b64` -> RunConfig fields."""
  m = VARIANT.match(name)
  if not m:
    raise ValueError(
      f"bad variant {name!r}: write p<wire>-g<wire> with wires same, bf16 or int8, and optional "
      f"-noef, -nodelta, -ring and -b<block> (e.g. pint8-gint8-noef)"
    )
  suffix = m.group(3)
  block = re.search(r"-b(\d+)", suffix)
  return {
    "inter_params": m.group(1),
    "inter_grads": m.group(2),
    "error_feedback": False if "-noef" in suffix else None,
    "param_delta": False if "-nodelta" in suffix else None,
    "collectives": "ring" if "-ring" in suffix else "xla",
    "int8_block": int(block.group(1)) if block else DEFAULT_INT8_BLOCK,
  }


def target_of(name: str) -> float | None:
  fields = parse_variant(name)
  wires = {fields["inter_params"], fields["inter_grads"]} - {"same"}
  if wires == {"bf16"}:
    return TARGETS["bf16"]
  if fields["inter_params"] == fields["inter_grads"] == "int8":
    return TARGETS["int8"]
  return None


def run_path(args, variant: str, seed: int) -> str:
  return os.path.join(args.out, "runs", variant, f"seed{seed}.json")


def run_one(args, variant: str, seed: int) -> dict:
  """Train one run and write its JSON (the run directory, checkpoints included, is removed)."""
  from paro_jax.run.train import RunConfig, train

  work = os.path.join(args.out, "runs", variant, f"seed{seed}")
  cfg = RunConfig(
    model=args.model,
    strategy=args.strategy,
    mesh=(2, 4),
    micro_batches=args.micro_batches,
    batch_size=args.batch_size,
    seq_len=args.seq_len,
    dtype=args.dtype,
    grad_dtype=args.grad_dtype,
    steps=args.steps,
    seed=seed,
    lr=args.lr,
    warmup=10,
    eval_every=args.steps // 10 or 1,
    eval_batches=args.eval_batches,
    out=work,
    **parse_variant(variant),
  )
  start = time.perf_counter()
  rows = [json.loads(line) for line in open(train(cfg))]
  record = {
    "variant": variant,
    "seed": seed,
    "wall_s": round(time.perf_counter() - start, 1),
    "eval": [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r],
    "train": [r["loss"] for r in rows if "loss" in r],
  }
  with open(run_path(args, variant, seed) + ".tmp", "w") as f:
    json.dump(record, f)
  os.replace(run_path(args, variant, seed) + ".tmp", run_path(args, variant, seed))
  shutil.rmtree(work, ignore_errors=True)
  return record


def summary(gaps: list[float]) -> dict:
  """Mean, spread and the 95% Student-t interval of the mean of the paired gaps."""
  n = len(gaps)
  mean = statistics.fmean(gaps)
  std = statistics.stdev(gaps) if n > 1 else 0.0
  half = t_quantile(n - 1) * std / n**0.5 if n > 1 else float("nan")
  return {
    "mean": mean,
    "std": std,
    "se": std / n**0.5,
    "low": mean - half,
    "high": mean + half,
    "min": min(gaps),
    "max": max(gaps),
    "n": n,
  }


def t_quantile(df: int) -> float:
  """The 97.5% quantile of Student's t with df degrees of freedom (two-sided 95%)."""
  from scipy.stats import t

  return float(t.ppf(0.975, df))


def seeds_to_resolve(st: dict, target: float) -> int | None:
  """Seeds after which a 95% interval of this width around this mean would no longer contain
  the target (the measured mean and standard deviation taken as the truth); None when over 1000
  or when the mean is the target."""
  room = abs(target - st["mean"])
  if st["std"] == 0:
    return st["n"]
  for n in range(2, 1001):
    if t_quantile(n - 1) * st["std"] / n**0.5 < room:
      return n
  return None


def analyse(records: dict, args) -> dict:
  """{variant: {"gaps": {seed: gap}, **summary}} of the paired relative gaps at the last step."""
  final = {(v, s): r["eval"][-1][1] for (v, s), r in records.items()}
  out = {}
  for v in args.variants:
    if v == BASELINE:
      continue
    gaps = {
      s: final[(v, s)] / final[(BASELINE, s)] - 1
      for s in args.seed_list
      if (v, s) in final and (BASELINE, s) in final
    }
    if gaps:
      out[v] = {"gaps": gaps, **summary(list(gaps.values()))}
  return out


def report(records: dict, stats: dict, args) -> str:
  final = {(v, s): r["eval"][-1][1] for (v, s), r in records.items()}
  lines = [
    f"`{args.model}`, {args.strategy} on a 2x4 mesh, {args.dtype} compute, --grad-dtype "
    f"{args.grad_dtype}, A={args.micro_batches}, batch {args.batch_size} x {args.seq_len}, "
    f"{args.steps} steps, lr {args.lr} (10 warm-up steps, cosine decay); eval loss at step "
    f"{args.steps} over {args.eval_batches} fixed held-out batches, scored with the exact "
    f"master weights. Seeds {', '.join(map(str, args.seed_list))}: a seed sets the initial "
    f"weights and the batches, shared by every variant (paired).",
    "",
    "Eval loss per seed (the gap against the baseline of the same seed in brackets):",
    "",
    "| seed | " + " | ".join(args.variants) + " |",
    "|---|" + "---:|" * len(args.variants),
  ]
  for s in args.seed_list:
    cells = []
    for v in args.variants:
      if (v, s) not in final:
        cells.append("")
      elif v == BASELINE or (BASELINE, s) not in final:
        cells.append(f"{final[(v, s)]:.4f}")
      else:
        cells.append(f"{final[(v, s)]:.4f} ({final[(v, s)] / final[(BASELINE, s)] - 1:+.2%})")
    lines.append(f"| {s} | " + " | ".join(cells) + " |")
  lines += [
    "",
    "Paired gap (variant / baseline - 1, per seed) over the seeds:",
    "",
    "| variant | seeds | mean gap | std | std error | 95% interval of the mean | min | max | "
    "target (mean) | met | seeds to resolve |",
    "|---|---:|---:|---:|---:|---|---:|---:|---:|---|---:|",
  ]
  for v, st in stats.items():
    target = target_of(v)
    tgt, need = ("", "") if target is None else (f"{target:.1%}", seeds_to_resolve(st, target))
    need = "" if st["n"] < 2 else need  # one seed has no spread to extrapolate
    interval = f"{st['low']:+.2%} to {st['high']:+.2%}" if st["n"] > 1 else ""
    lines.append(
      f"| {v} | {st['n']} | {st['mean']:+.2%} | {st['std']:.2%} | {st['se']:.2%} | {interval} | "
      f"{st['min']:+.2%} | {st['max']:+.2%} | {tgt} | {verdict(st, target)} | "
      f"{'over 1000' if need is None else need} |"
    )
  walls = [r["wall_s"] for r in records.values() if "wall_s" in r]
  lines += [
    "",
    "The interval is the mean plus or minus Student's t (97.5%, n - 1 degrees of freedom) times",
    "the standard error. Met: the interval within the target; not met: the interval beyond it;",
    "otherwise these seeds do not resolve it. Seeds to resolve: how many seeds an interval this",
    "wide around this mean would need to leave the target on one side (if the measured mean and",
    "standard deviation were the truth).",
  ]
  if walls:
    lines += [
      "",
      f"Wall time per run: median {statistics.median(walls):.0f} s, {min(walls):.0f} to "
      f"{max(walls):.0f} s over {len(walls)} runs (the runs that recorded it).",
    ]
  return "\n".join(lines) + "\n"


def verdict(st: dict, target: float | None) -> str:
  """Met when the 95% interval of the mean gap lies within the target, not met when it lies
  beyond it, otherwise not resolved by these seeds."""
  if target is None or st["n"] < 2:
    return ""
  if st["high"] <= target:
    return "yes"
  if st["low"] > target:
    return "**no**"
  return "not resolved"


def plot(records: dict, args, path: str) -> str:
  """Eval-loss curves: per variant the mean over seeds, with the lowest-to-highest seed band."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4.5))
  for v in args.variants:
    curves = [records[(v, s)]["eval"] for s in args.seed_list if (v, s) in records]
    if not curves:
      continue
    steps = [p[0] for p in curves[0]]
    by_step = list(zip(*[[p[1] for p in c] for c in curves]))
    mean = [statistics.fmean(x) for x in by_step]
    line = ax.plot(steps, mean, "o-", markersize=3, label=f"{v} ({len(curves)} seeds)")[0]
    low, high = [min(x) for x in by_step], [max(x) for x in by_step]
    ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.15)
  ax.set(xlabel="step", ylabel=f"eval loss ({args.eval_batches} batches)")
  ax.set_ylim(top=min(ax.get_ylim()[1], 4.0))
  ax.grid(alpha=0.3)
  ax.legend()
  ax.set_title(
    f"{args.model}, {args.strategy} 2x4, {args.dtype} compute, grads {args.grad_dtype}: "
    "mean and seed range"
  )
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  return path


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--variants", nargs="+", default=[BASELINE, "pbf16-gbf16", "pint8-gint8"])
  p.add_argument("--seeds", type=int, default=5, help="seeds 1..N (default 5)")
  p.add_argument("--strategy", default="IIG")
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--model", default="tiny")
  p.add_argument("--dtype", default="bf16", help="compute dtype (default bf16, the trainer's)")
  p.add_argument("--grad-dtype", default="compute", choices=("compute", "fp32"))
  p.add_argument("--micro-batches", type=int, default=2)
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--batch-size", type=int, default=16)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument(
    "--eval-batches",
    type=int,
    default=16,
    help="eval loss over this many fixed batches (one batch is too few to tell runs apart)",
  )
  p.add_argument("--out", default="runs/compress_parity")
  p.add_argument("--resume", action="store_true", help="keep the runs whose JSON exists")
  p.add_argument("--report-only", action="store_true", help="no new runs: report those done")
  args = p.parse_args(argv)
  for v in args.variants:
    try:
      parse_variant(v)
    except ValueError as e:
      p.error(str(e))
  if BASELINE not in args.variants:
    args.variants.insert(0, BASELINE)
  args.seed_list = list(range(1, args.seeds + 1))
  records = {}
  for s in args.seed_list:  # seed by seed: a stopped grid leaves complete pairs behind
    for v in args.variants:
      path = run_path(args, v, s)
      if (args.resume or args.report_only) and os.path.exists(path):
        with open(path) as f:
          records[(v, s)] = json.load(f)
      elif not args.report_only:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        records[(v, s)] = run_one(args, v, s)
  stats = analyse(records, args)
  table = report(records, stats, args)
  print(table)
  stamp = f"{utc_now()}, {machine_line()} (CPU, 8 virtual devices)"
  with open(os.path.join(args.out, "parity.md"), "w") as f:
    f.write(f"# Loss parity of compressed inter-node traffic\n\nMeasured {stamp}:\n\n")
    f.write("    python -m experiments.compress_parity " + " ".join(argv or []) + "\n\n" + table)
    f.write("\n![eval loss, mean and seed range](parity.png)\n")
  with open(os.path.join(args.out, "parity.json"), "w") as f:
    json.dump(
      {"stats": stats, "args": {k: v for k, v in vars(args).items()}}, f, indent=1, default=str
    )
  plot(records, args, os.path.join(args.out, "parity.png"))


if __name__ == "__main__":
  import sys

  from paro_jax.core.xla_flags import provide_cpu_devices

  provide_cpu_devices(8)
  main(sys.argv[1:])
