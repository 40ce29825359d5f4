"""The margins of the CI loss-parity test (tests/run/test_compress_parity.py): its run, int8
parameters and gradients against the uncompressed run of the same seed, with the real int8
quantizer and with broken ones, so that the test's threshold sits between what a correct
quantizer gives and what a broken one does.

  python -m experiments.compress_ci_margin --out experiments/results/compress_parity/ci_margin

Broken quantizers (each replaces compress.quantize for the int8 format):
  saturating: scale = max|block| / 254 with values clipped to +-127 (the uint8 range by mistake:
              every value above half the block's largest is clipped);
  truncating: values cast to int8 without rounding (toward zero: biased, up to a whole step off);
  swapped:    each block dequantized with its neighbour's scale (scales shifted by one block).
Writes OUT/margin.md and OUT/margin.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil

from experiments.pages import machine_line, utc_now

# The CI test's run (tests/run/test_compress_parity.py imports it).
CI_RUN = dict(
  model="tiny",
  strategy="IIG",
  mesh=(2, 4),
  batch_size=16,
  seq_len=32,
  steps=150,
  warmup=10,
  eval_batches=16,
  dtype="fp32",
)
# |eval-loss gap| the CI test allows: between the measured gaps of the correct and the broken
# quantizers (OUT/margin.md). One pair of runs differs by about 1-2% with no compression error at
# all (a trajectory perturbed anywhere drifts: experiments/results/compress_parity/), so the
# threshold catches gross breaks (saturation, misplaced scales), not subtle ones: those are
# tests/core/test_compress.py's (its round-trip bounds).
THRESHOLD = 0.04
# The broken quantizers the threshold must catch (measured beyond it); the others are listed on
# the page with their gap.
CAUGHT = ("saturating", "swapped")


def eval_loss(tmp: str, wire: str, seed: int) -> float:
  """The eval loss at the end of the CI run with `wire` on both int8-capable paths."""
  from paro_jax.run.train import RunConfig, train

  cfg = RunConfig(
    **CI_RUN,
    seed=seed,
    eval_every=CI_RUN["steps"],
    inter_params=wire,
    inter_grads=wire,
    out=os.path.join(tmp, f"{wire}-{seed}"),
  )
  rows = [json.loads(line) for line in open(train(cfg))]
  shutil.rmtree(cfg.out, ignore_errors=True)  # its checkpoints: not needed
  return [r["eval_loss"] for r in rows if "eval_loss" in r][-1]


def _broken(kind: str):
  import jax.numpy as jnp

  from paro_jax.core import compress

  real_quantize, real_dequantize = compress.quantize, compress.dequantize

  def quantize(x, codec):
    if codec.fmt != "int8" or kind == "swapped":
      return real_quantize(x, codec)
    flat = x.reshape(-1).astype(jnp.float32)
    main, tail = compress._split_blocks(flat, codec.block)
    parts, scales = [], []
    for blocks in (main, tail[None] if tail.shape[0] else None):
      if blocks is None or blocks.shape[0] == 0:
        continue
      scale = jnp.max(jnp.abs(blocks), axis=1) / (254.0 if kind == "saturating" else 127.0)
      safe = jnp.where(scale > 0, scale, 1.0)
      v = blocks / safe[:, None]
      v = v if kind == "truncating" else jnp.round(v)
      parts.append(jnp.clip(v, -127, 127).astype(jnp.int8).reshape(-1))
      scales.append(scale)
    return (jnp.concatenate(parts), jnp.concatenate(scales))

  def dequantize(payload, codec, shape, dtype):
    if codec.fmt == "int8" and kind == "swapped":
      q, scales = payload
      payload = (q, jnp.roll(scales, 1))
    return real_dequantize(payload, codec, shape, dtype)

  return quantize, dequantize


@contextlib.contextmanager
def quantizer(kind: str):
  from paro_jax.core import compress

  if kind == "correct":
    yield
    return
  saved = compress.quantize, compress.dequantize
  compress.quantize, compress.dequantize = _broken(kind)
  try:
    yield
  finally:
    compress.quantize, compress.dequantize = saved


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--kinds", nargs="+", default=["correct", "saturating", "truncating", "swapped"])
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="runs/compress_ci_margin")
  p.add_argument("--report-only", action="store_true", help="rewrite the page from margin.json")
  args = p.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  if args.report_only:
    with open(os.path.join(args.out, "margin.json")) as f:
      results = json.load(f)["results"]
  else:
    same = eval_loss(os.path.join(args.out, "runs"), "same", args.seed)
    results = {}
    for kind in args.kinds:
      with quantizer(kind):
        int8 = eval_loss(os.path.join(args.out, "runs", kind), "int8", args.seed)
      results[kind] = {"same": same, "int8": int8, "gap": int8 / same - 1}
  lines = [
    "# Margins of the CI loss-parity test",
    "",
    f"Measured {utc_now()}, {machine_line()} (CPU, 8 virtual devices):",
    "",
    "    python -m experiments.compress_ci_margin " + " ".join(argv or []),
    "",
    f"The CI test's run: {CI_RUN}, seed {args.seed}; int8 parameters and gradients (error "
    "feedback and the delta parameter sync on, their defaults) against the uncompressed run. "
    f"The test allows an eval-loss gap of {THRESHOLD:.1%}.",
    "",
    "| quantizer | eval loss, same | eval loss, int8 | gap | within the threshold | must be |",
    "|---|---:|---:|---:|---|---|",
  ]
  for kind, r in results.items():
    ok = "yes" if abs(r["gap"]) <= THRESHOLD else "no"
    want = {"correct": "yes"}.get(kind, "no" if kind in CAUGHT else "(not caught here)")
    lines.append(
      f"| {kind} | {r['same']:.4f} | {r['int8']:.4f} | {r['gap']:+.2%} | {ok} | {want} |"
    )
  correct = abs(results["correct"]["gap"])
  caught = min((abs(results[k]["gap"]) for k in CAUGHT if k in results), default=None)
  if caught is not None:
    lines += [
      "",
      f"Margins: the correct quantizer's gap is {THRESHOLD - correct:.2%} inside the threshold, "
      f"the smallest caught broken one's {caught - THRESHOLD:.2%} beyond it. Truncation (no "
      "rounding) is within noise here: error feedback and the delta sync carry what it drops "
      "into the next step; tests/core/test_compress.py's round-trip bound catches it.",
    ]
  with open(os.path.join(args.out, "margin.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  with open(os.path.join(args.out, "margin.json"), "w") as f:
    json.dump(
      {"threshold": THRESHOLD, "caught": CAUGHT, "ci_run": CI_RUN, "results": results}, f, indent=1
    )
  print("\n".join(lines))


if __name__ == "__main__":
  import sys

  from paro_jax.core.xla_flags import provide_cpu_devices

  provide_cpu_devices(8)
  main(sys.argv[1:])
