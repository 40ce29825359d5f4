"""Measured step time on the GPUs present, beside XLA's estimate of the same program.

The step is compiled once, on the real GPUs, with XLA's scheduler statistics logged (the same
figures `paro-jax inspect --target` composes, paro_jax/analysis/estimate.py), then run: `--warmup`
steps, then `--steps` timed ones (each waited for), and a `jax.profiler` trace of a few more
under `--out`. Prints and writes (`gpu_measure.json`) the median measured step against the
estimate: a ratio near 1 (within the 4-10% mean error published CPU-only predictors of LLM step
time report on A100/H100 clusters) means the estimates of docs/gpu.md can be trusted for
ranking and sizing.

  python experiments/gpu_measure.py --model small --mesh 1x1 --out runs/gpu_measure
  python experiments/gpu_measure.py --model 7b --mesh 1x8 --strategy IIG --micro-batches 2

Without a GPU it exits with a one-line message (code 2).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--model", default="small")
  ap.add_argument("--mesh", default=None, help="NODESxGPUS (default: 1 x the GPUs present)")
  ap.add_argument("--strategy", default="IIG")
  ap.add_argument("--collectives", default="xla")
  ap.add_argument("--micro-batches", type=int, default=1)
  ap.add_argument("--seq-len", type=int, default=2048)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--steps", type=int, default=20)
  ap.add_argument("--inter-bandwidth", default=None, help="as inspect's (multi-node meshes)")
  ap.add_argument("--out", default=None, help="folder for gpu_measure.json and the trace")
  args = ap.parse_args(argv)
  sys.path.insert(0, ROOT)
  from paro_jax.analysis import estimate, gpu
  from paro_jax.core.names import parse_mesh_shape
  from paro_jax.core.units import parse_rate

  rate = parse_rate(args.inter_bandwidth) if args.inter_bandwidth else None
  mesh_shape = parse_mesh_shape(args.mesh) if args.mesh else None
  # before jax starts: XLA reads its logging and network options once
  estimate.prepare_environment(rate, mesh_shape[1] if mesh_shape else 8)
  import jax

  gpus = [d for d in jax.devices() if d.platform == "gpu"]
  if not gpus:
    print("gpu_measure: no GPU here (jax sees only " + jax.devices()[0].platform + ")")
    return 2
  from models.llama import Llama, get_config
  from paro_jax.analysis.hardware import peak_flops
  from paro_jax.analysis.abstract import abstract_inputs
  from paro_jax.core.engine import DTYPES, Engine, OptimConfig
  from paro_jax.core.mesh import make_mesh
  from paro_jax.core.strategy import parse_strategy

  inter, intra = mesh_shape or (1, len(gpus))
  engine = Engine(
    Llama(get_config(args.model), DTYPES["bf16"], "full", None, "cudnn"),
    parse_strategy(args.strategy),
    make_mesh(inter, intra),
    OptimConfig(),
    micro_batches=args.micro_batches,
    collectives=args.collectives,
  )
  n = inter * intra
  state_shape, batch_shape = abstract_inputs(engine, n, args.seq_len)
  with estimate.captured_stderr() as log:
    compiled = engine.train_step.lower(state_shape, batch_shape).compile()
  text = compiled.as_text()
  kind = gpus[0].device_kind
  # the target description of this GPU (for its memory bandwidth in the roofline part)
  target = next((t for t in ("h200", "h100", "a100-80gb") if t[:4] in kind.lower()), "h100")
  tokens = args.micro_batches * n * args.seq_len
  cc = tuple(int(x) for x in str(getattr(gpus[0], "compute_capability", "9.0")).split("."))
  est = estimate.estimate(
    text,
    log[0],
    compute_capability=cc,
    peak_flops=peak_flops(kind),
    memory_bandwidth=gpu.memory_bandwidth(target),
    devices=n,
    tokens_per_step=tokens,
    flops_per_step=engine.model.cfg.flops_per_token(args.seq_len) * tokens,
    inter_bits_per_s=rate,
    gpus_per_node=intra,
  )
  state = engine.init_state(jax.random.key(0))
  batch = jax.device_put(
    jax.random.randint(jax.random.key(1), batch_shape.shape, 0, engine.model.cfg.vocab),
    engine.batch_sharding,
  )
  for _ in range(args.warmup):
    state, metrics = compiled(state, batch)
  jax.block_until_ready(metrics)
  times = []
  for _ in range(args.steps):
    t = time.perf_counter()
    state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - t)
  out = args.out or tempfile.mkdtemp(prefix="gpu_measure-")
  os.makedirs(out, exist_ok=True)
  with jax.profiler.trace(os.path.join(out, "trace")):
    for _ in range(3):
      state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
  measured = statistics.median(times)
  r = {
    "date": str(datetime.date.today()),
    "device": kind,
    "mesh": [inter, intra],
    "model": args.model,
    "strategy": args.strategy,
    "micro_batches": args.micro_batches,
    "seq_len": args.seq_len,
    "measured_step_s": measured,
    "measured_steps_s": times,
    "estimate": {k: v for k, v in est.items() if k != "computations"},
  }
  if est.get("step_s"):
    r["measured_over_estimate"] = measured / est["step_s"]
  with open(os.path.join(out, "gpu_measure.json"), "w") as f:
    json.dump(r, f, indent=1)
  print(
    f"{kind} x {n}, {args.model} {args.strategy}: measured {measured * 1e3:.2f} ms per step "
    f"(median of {args.steps}), XLA's estimate "
    + (f"{est['step_s'] * 1e3:.2f} ms: ratio {r['measured_over_estimate']:.2f}" if est.get("step_s")
       else f"none ({est.get('unavailable')})")
    + f"; trace in {out}/trace"
  )  # fmt: skip
  return 0


if __name__ == "__main__":
  sys.exit(main())
