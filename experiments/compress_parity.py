"""Loss parity of compressed inter-node traffic: `tiny` on the built-in corpus, 2x4 mesh, the
same seed and batches with --inter-params/--inter-grads same, bf16 and int8; eval loss per step.

  python -m experiments.compress_parity --strategies IIG GGG NIG --steps 300 --out runs/compress

writes OUT/<strategy>-<wire>/metrics.jsonl and prints the final eval losses and their ratios.
"""

from __future__ import annotations

import argparse
import json
import os


def run_one(strategy, wire, steps, out, model="tiny", seq_len=64, batch_size=16, dtype="bf16"):
  from paro_jax.run.train import RunConfig, train

  cfg = RunConfig(
    model=model,
    strategy=strategy,
    mesh=(2, 4),
    batch_size=batch_size,
    seq_len=seq_len,
    dtype=dtype,
    steps=steps,
    warmup=10,
    eval_every=steps // 10 or 1,
    inter_params=wire,
    inter_grads=wire,
    out=os.path.join(out, f"{strategy}-{wire}"),
  )
  path = train(cfg)
  rows = [json.loads(line) for line in open(path)]
  return [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--strategies", nargs="+", default=["IIG"])
  p.add_argument("--wires", nargs="+", default=["same", "bf16", "int8"])
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--model", default="tiny")
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--out", default="runs/compress")
  a = p.parse_args(argv)
  results = {}
  for s in a.strategies:
    for w in a.wires:
      results[(s, w)] = run_one(s, w, a.steps, a.out, a.model, a.seq_len)
  for s in a.strategies:
    base = results[(s, a.wires[0])][-1][1]
    for w in a.wires:
      last = results[(s, w)][-1][1]
      print(f"{s} {w:5s} eval loss at step {a.steps}: {last:.4f} ({(last / base - 1) * 100:+.2f}%)")


if __name__ == "__main__":
  from paro_jax.core.xla_flags import provide_cpu_devices

  provide_cpu_devices(8)
  main()
