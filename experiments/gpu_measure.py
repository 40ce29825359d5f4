"""Measured step time on the GPUs present, beside XLA's estimate of the same program.

The step is compiled once, on the real GPUs, with XLA's scheduler statistics logged (the same
figures `paro-jax inspect --target` composes, paro_jax/analysis/gpu/estimate.py), then run:
`--warmup` steps, then `--steps` timed ones (each waited for), and a `jax.profiler` trace of a
few more under `--out`. Prints and writes (`gpu_measure.json`) the median measured step against the
estimate: a ratio near 1 (within the 4-10% mean error published CPU-only predictors of LLM step
time report on A100/H100 clusters) means the estimates of docs/gpu.md can be trusted for
ranking and sizing.

  python experiments/gpu_measure.py --model small --mesh 1x1 --out runs/gpu_measure
  python experiments/gpu_measure.py --model 7b --mesh 1x8 --strategy IIG --micro-batches 2
  python experiments/gpu_measure.py --model 7b --layers 4 --mesh 1x1   # 7b's layer on one GPU

The trace's GPU kernels are summed per step (`trace_summary`): busy time (the union of the
kernels' intervals over all streams), and the kernel time of matmuls, attention, collectives and
the rest, so that a gap between measurement and estimate can be placed.

Without a GPU it exits with a one-line message (code 2).

`--report DIR` needs no GPU: it reads the measurements in DIR (one gpu_measure.json each,
renamed) and XLA's estimates of the same per-GPU work in DIR/xla (`paro-jax inspect --target
--json` of IIG on one node of 8 for the layer and micro-batch counts in the file names,
L{layers}-A{micro_batches}.json), fits both to the same step model

  step = fixed + A x per_micro_batch + L x per_layer + L x A x per_layer_micro_batch

and writes DIR/README.md: the measured runs, and the terms side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import json
import os
import re
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--model", default="small")
  ap.add_argument("--layers", type=int, default=None, help="override the model's layer count")
  ap.add_argument("--attention", default="cudnn", help="cudnn (default) or xla")
  ap.add_argument("--remat", default="full", help="the model's remat policy (default full)")
  ap.add_argument("--mesh", default=None, help="NODESxGPUS (default: 1 x the GPUs present)")
  ap.add_argument("--strategy", default="IIG")
  ap.add_argument("--collectives", default="xla")
  ap.add_argument("--micro-batches", type=int, default=1)
  ap.add_argument("--seq-len", type=int, default=2048)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--steps", type=int, default=20)
  ap.add_argument("--inter-bandwidth", default=None, help="as inspect's (multi-node meshes)")
  ap.add_argument("--out", default=None, help="folder for gpu_measure.json and the trace")
  ap.add_argument("--report", default=None, metavar="DIR", help="write DIR/README.md (no GPU)")
  args = ap.parse_args(argv)
  if args.report:
    return report(args.report)
  sys.path.insert(0, ROOT)
  from paro_jax.analysis.gpu import estimate, targets
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
  from models.config import get_config
  from paro_jax.analysis.gpu.hardware import peak_flops
  from paro_jax.analysis.inspect.abstract import abstract_inputs
  from paro_jax.core.config import StepConfig
  from paro_jax.core.factory import build_engine
  from paro_jax.core.mesh import make_mesh

  inter, intra = mesh_shape or (1, len(gpus))
  cfg = get_config(args.model)
  if args.layers:
    cfg = dataclasses.replace(cfg, layers=args.layers)
  step = StepConfig(
    strategy=args.strategy,
    dtype="bf16",
    remat=args.remat,
    attention=args.attention,
    micro_batches=args.micro_batches,
    collectives=args.collectives,
  )
  engine = build_engine(step, cfg, make_mesh(inter, intra))
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
    memory_bandwidth=targets.memory_bandwidth(target),
    devices=n,
    tokens_per_step=tokens,
    flops_per_step=engine.model.cfg.flops_per_token(args.seq_len) * tokens,
    inter_bits_per_s=rate,
    gpus_per_node=intra,
  )
  out = args.out or tempfile.mkdtemp(prefix="gpu_measure-")
  os.makedirs(out, exist_ok=True)
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
  with open(os.path.join(out, "step.hlo"), "w") as f:
    f.write(text)
  traced = 3
  with jax.profiler.trace(os.path.join(out, "trace")):
    for _ in range(traced):
      state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
  measured = statistics.median(times)
  r = {
    "date": str(datetime.date.today()),
    "device": kind,
    "jax": jax.__version__,
    "mesh": [inter, intra],
    "model": args.model,
    "layers": cfg.layers,
    "attention": args.attention,
    "remat": args.remat,
    "strategy": args.strategy,
    "micro_batches": args.micro_batches,
    "seq_len": args.seq_len,
    "measured_step_s": measured,
    "measured_steps_s": times,
    "estimate": est,
  }
  if est.get("step_s"):
    r["measured_over_estimate"] = measured / est["step_s"]
  flops = engine.model.cfg.flops_per_token(args.seq_len) * tokens
  if peak_flops(kind):
    r["measured_mfu"] = flops / measured / (peak_flops(kind) * n)
  r["trace"] = trace_summary(os.path.join(out, "trace"), traced)
  with open(os.path.join(out, "gpu_measure.json"), "w") as f:
    json.dump(r, f, indent=1)
  t = r["trace"]
  if "busy_s" in t:
    print(
      f"trace: GPU busy {t['busy_s'] * 1e3:.2f} ms per step over {t['streams']} streams; kernels "
      + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in t["kernel_s"].items())
    )
  print(
    f"{kind} x {n}, {args.model} ({cfg.layers} layers) {args.strategy}: measured "
    f"{measured * 1e3:.2f} ms per step "
    f"(median of {args.steps}), "
    + ("XLA's estimate " if est.get("source") == estimate.SOURCE else "the roofline estimate ")
    + (f"{est['step_s'] * 1e3:.2f} ms: ratio {r['measured_over_estimate']:.2f}" if est.get("step_s")
       else f"none ({est.get('unavailable')})")
    + f"; trace in {out}/trace"
  )  # fmt: skip
  return 0


TERMS = ("fixed", "per_micro_batch", "per_layer", "per_layer_micro_batch")


def fit(points: list[tuple[int, int, float]]) -> dict:
  """Least squares of (layers, micro_batches, seconds) to the step model's four terms."""
  import numpy as np  # only the report needs it

  a = np.array([[1.0, m, n, n * m] for n, m, _ in points])
  terms, *_ = np.linalg.lstsq(a, np.array([t for *_, t in points]), rcond=None)
  return dict(zip(TERMS, terms.tolist()))


def _fit_model(runs, folder: str, model: str) -> tuple[list[str], dict]:
  """The step's terms of one model, measured and by XLA: the page's section, and the fits."""
  fitted = [
    (r["layers"], r["micro_batches"], r["measured_step_s"])
    for _, r in runs
    if r["model"] == model and r["remat"] == "full" and r["attention"] == "cudnn"
    and r["seq_len"] == 2048
  ]  # fmt: skip
  xla = {}
  for path in sorted(glob.glob(os.path.join(folder, "xla", model, "L*-A*.json"))):
    n, m = re.match(r"L(\d+)-A(\d+)", os.path.basename(path)).groups()
    with open(path) as f:
      xla[(int(n), int(m))] = json.load(f)["estimate"]
  measured = fit(fitted)
  xla_compute = fit([(n, m, e["compute_s"]) for (n, m), e in xla.items()])
  repriced = fit(
    [(n, m, e["compute_s"] - e["overpriced"]["overcharge_s"]) for (n, m), e in xla.items()]
  )
  lines = [
    "",
    f"## {model}: the step's terms ({len(fitted)} runs of its layer, remat full, cuDNN "
    "attention, seq 2048)",
    "",
    "Fitted by least squares to step = fixed + A x per micro-batch + L x per layer + L x A x "
    "per layer and micro-batch. XLA: its compute (the step less exposed communication) for the "
    "same work on each GPU of IIG on one node of 8 H100 (`paro-jax inspect --target h100 --model "
    f"{folder}/configs/{model}-L{{4,8}} --mesh 1x8 --strategy IIG --collectives xla "
    "--micro-batches {1,2} --batch-size 8 --seq-len 2048 --json`, with the jax this project "
    "pins), whose optimizer updates an eighth of the parameters (so the fixed and per-layer "
    "terms, mostly the optimizer's, are not comparable); repriced: with the matmuls XLA prices "
    "out of line (paro_jax/analysis/gpu/instruction_costs.py) at the program's typical price.",
    "",
    "| term (ms) | measured | XLA | measured / XLA | XLA repriced | measured / repriced |",
    "|---|---:|---:|---:|---:|---:|",
  ]
  for term in TERMS:
    a, b, c = measured[term], xla_compute[term], repriced[term]
    lines.append(
      f"| {term.replace('_', ' ')} | {a * 1e3:.2f} | {b * 1e3:.2f} | "
      f"{a / b if b > 0 else float('nan'):.2f} | {c * 1e3:.2f} | "
      f"{a / c if c > 0 else float('nan'):.2f} |"
    )
  residual = max(
    abs(t - sum(measured[k] * x for k, x in zip(TERMS, (1, m, n, n * m)))) / t for n, m, t in fitted
  )
  lines += [
    "",
    f"The fit's largest residual over the measured runs: {residual:.1%}"
    + (" (four runs for four terms: an exact solve, not a check)." if len(fitted) == 4 else "."),
  ]
  return lines, {"measured": measured, "xla": xla_compute, "repriced": repriced}


def report(folder: str) -> int:
  runs = []
  for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
    with open(path) as f:
      runs.append((os.path.basename(path)[:-5], json.load(f)))
  first = runs[0][1]
  lines = [
    "# The step measured on one GPU, beside XLA's estimate of the same work",
    "",
    f"{first['device']}, jax {first['jax']}, {first['date']}; each run: `python "
    "experiments/gpu_measure.py --mesh 1x1 --model M [--layers L] [--micro-batches A] "
    "[--seq-len S] [--remat R] [--attention X] --out DIR` (one sequence per micro-batch, bf16, "
    "IIG on one GPU: no communication), the median of 20 steps after 3 of warm-up; the kernel "
    "times are per step, from a trace of 3 more. This page: "
    f"`python experiments/gpu_measure.py --report {folder}`.",
    "",
    "| run | model | layers | A | seq | remat | attention | step (ms) | min-max (ms) | GPU busy "
    "(ms) | matmul | attention | other |",
    "|---|---|---:|---:|---:|---|---|---:|---|---:|---:|---:|---:|",
  ]
  for name, r in runs:
    t, k = r["trace"], r["trace"].get("kernel_s", {})
    lines.append(
      f"| {name} | {r['model']} | {r['layers']} | {r['micro_batches']} | {r['seq_len']} | "
      f"{r['remat']} | {r['attention']} | {r['measured_step_s'] * 1e3:.2f} | "
      f"{min(r['measured_steps_s']) * 1e3:.1f}-{max(r['measured_steps_s']) * 1e3:.1f} | "
      f"{t.get('busy_s', 0) * 1e3:.2f} | {k.get('matmul', 0) * 1e3:.2f} | "
      f"{k.get('attention', 0) * 1e3:.2f} | {k.get('other', 0) * 1e3:.2f} |"
    )
  for model in sorted(os.listdir(os.path.join(folder, "xla"))):
    lines += _fit_model(runs, folder, model)[0]
  with open(os.path.join(folder, "README.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))
  return 0


# GPU kernel names by what they compute (cuBLAS/CUTLASS matmuls, cuDNN/flash attention, NCCL)
KINDS = (
  ("matmul", re.compile(r"gemm|cutlass|nvjet|xmma|cublas|matmul", re.I)),
  ("attention", re.compile(r"fmha|flash|cudnn|attention|sdpa", re.I)),
  ("collective", re.compile(r"nccl", re.I)),
)


def trace_summary(trace_dir: str, steps: int) -> dict:
  """Per step, from the profiler trace: GPU busy time (the union of kernel intervals over every
  stream) and kernel time by kind; {"error": ...} when the trace cannot be read."""
  from jax.profiler import ProfileData  # jax is imported in main, after XLA's options are set

  files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
  if not files:
    return {"error": "no trace file"}
  intervals, by_kind, by_name, streams = [], {}, {}, set()
  for plane in ProfileData.from_file(files[0]).planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    for line in plane.lines:
      if not line.name.startswith("Stream"):
        continue
      for ev in line.events:
        if not ev.duration_ns:
          continue
        streams.add(line.name)
        intervals.append((ev.start_ns, ev.start_ns + ev.duration_ns))
        kind = next((k for k, pattern in KINDS if pattern.search(ev.name)), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + ev.duration_ns
        by_name[ev.name[:80]] = by_name.get(ev.name[:80], 0.0) + ev.duration_ns
  if not intervals:
    return {"error": "no GPU kernels in the trace"}
  intervals.sort()
  busy, (lo, hi) = 0.0, intervals[0]
  for a, b in intervals[1:]:
    if a > hi:
      busy, lo, hi = busy + hi - lo, a, b
    else:
      hi = max(hi, b)
  busy += hi - lo
  return {
    "busy_s": busy / 1e9 / steps,
    "kernel_s": {k: v / 1e9 / steps for k, v in sorted(by_kind.items())},
    "streams": len(streams),
    "top_kernels_s": {
      k: v / 1e9 / steps for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:15]
    },
    "span_s": (intervals[-1][1] - intervals[0][0]) / 1e9 / steps,
  }


if __name__ == "__main__":
  sys.exit(main())
