"""Measured step time on the GPUs present, beside the estimate of the same program.

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
# the changes the suite undoes one at a time on one GPU (per-leaf is for several GPUs of a node)
CHANGES_ON_ONE_GPU = ("head-backward", "loss", "one-device", "zero-fill", "weights-copy")


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
  ap.add_argument("--old", default="none", help="undo these of the GPU step's changes "
                  "(comma-separated, `all` or `none`; gpu_variants.py names them)")  # fmt: skip
  ap.add_argument("--suite", action="store_true", help="the before/after suite on one GPU "
                  "(SUITE, in priority order within --budget-s): one page in --out")  # fmt: skip
  ap.add_argument("--budget-s", type=float, default=450.0, help="the suite starts no run that "
                  "would end after this many seconds (default 450)")  # fmt: skip
  ap.add_argument(
    "--only", default=None, help="the suite's runs of these names only (comma-separated)"
  )
  ap.add_argument("--dry-run", action="store_true", help="the plumbing on the CPU, `test` model")
  ap.add_argument("--out", default=None, help="folder for gpu_measure.json and the trace")
  ap.add_argument("--report", default=None, metavar="DIR", help="write DIR/README.md (no GPU)")
  args = ap.parse_args(argv)
  if args.report:
    return report(args.report)
  sys.path.insert(0, ROOT)
  from experiments import gpu_variants
  from paro_jax.analysis.gpu import estimate
  from paro_jax.core.names import parse_mesh_shape
  from paro_jax.core.units import parse_rate

  args.old = gpu_variants.parse(args.old)
  rate = parse_rate(args.inter_bandwidth) if args.inter_bandwidth else None
  mesh_shape = parse_mesh_shape(args.mesh) if args.mesh else None
  # before jax starts: XLA reads its logging and network options once
  estimate.prepare_environment(rate, mesh_shape[1] if mesh_shape else 8)
  if args.dry_run:
    os.environ["JAX_PLATFORMS"] = "cpu"
  import jax

  devices = jax.devices() if args.dry_run else [d for d in jax.devices() if d.platform == "gpu"]
  if not devices:
    print("gpu_measure: no GPU here (jax sees only " + jax.devices()[0].platform + ")")
    return 2
  out = args.out or tempfile.mkdtemp(prefix="gpu_measure-")
  os.makedirs(out, exist_ok=True)
  if args.suite:
    return suite(args, devices, out)
  r = measure(args, devices, out, rate, mesh_shape)
  with open(os.path.join(out, "gpu_measure.json"), "w") as f:
    json.dump(r, f, indent=1)
  _print_run(r, out)
  return 0


def measure(args, devices, out: str, rate=None, mesh_shape=None) -> dict:
  """One run: the step of `args` (with the changes in args.old undone) compiled on `devices`,
  `args.warmup` steps, `args.steps` timed ones, a trace of 3 more under `out`; the result."""
  import jax

  from experiments import gpu_variants
  from paro_jax.analysis.gpu import estimate, targets
  from paro_jax.analysis.inspect.abstract import abstract_inputs
  from paro_jax.analysis.gpu.hardware import peak_flops
  from paro_jax.core.mesh import make_mesh

  t0 = time.perf_counter()
  inter, intra = mesh_shape or (1, len(devices))
  mesh = make_mesh(inter, intra, devices=devices[: inter * intra])
  engine = gpu_variants.engine_for(args, mesh, args.old)
  n = inter * intra
  kind = devices[0].device_kind
  with gpu_variants.undone(args.old, engine):
    state_shape, batch_shape = abstract_inputs(engine, n, args.seq_len)
    with estimate.captured_stderr() as log:
      compiled = engine.train_step.lower(state_shape, batch_shape).compile()
  compile_s = time.perf_counter() - t0
  text = compiled.as_text()
  # the target description of this GPU (for its memory bandwidth in the roofline part)
  target = next((t for t in ("h200", "h100", "a100-80gb") if t[:4] in kind.lower()), "h100")
  tokens = args.micro_batches * n * args.seq_len
  flops = engine.model.cfg.flops_per_token(args.seq_len) * tokens
  cc = tuple(int(x) for x in str(getattr(devices[0], "compute_capability", "9.0")).split("."))
  est = estimate.estimate(
    text,
    log[0],
    compute_capability=cc,
    peak_flops=peak_flops(kind) or peak_flops("H100"),
    memory_bandwidth=targets.memory_bandwidth(target),
    devices=n,
    tokens_per_step=tokens,
    flops_per_step=flops,
    inter_bits_per_s=rate,
    gpus_per_node=intra,
  )
  state = engine.init_state(jax.random.key(0))
  batch = jax.device_put(
    jax.random.randint(jax.random.key(1), batch_shape.shape, 0, engine.model.cfg.vocab),
    engine.batch_sharding,
  )
  losses = []
  for _ in range(args.warmup):
    state, metrics = compiled(state, batch)
    losses.append(float(metrics["loss"]))
  times = []
  for _ in range(args.steps):
    t = time.perf_counter()
    state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - t)
    losses.append(float(metrics["loss"]))
  with open(os.path.join(out, "step.hlo"), "w") as f:
    f.write(text)
  traced = 3
  with jax.profiler.trace(os.path.join(out, "trace")):
    for _ in range(traced):
      state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
  del state, compiled
  measured = statistics.median(times)
  r = {
    "date": str(datetime.date.today()),
    "device": kind,
    "jax": jax.__version__,
    "mesh": [inter, intra],
    "model": args.model,
    "layers": engine.model.cfg.layers,
    "attention": args.attention,
    "remat": args.remat,
    "strategy": args.strategy,
    "micro_batches": args.micro_batches,
    "seq_len": args.seq_len,
    "old": list(args.old),
    "compile_s": compile_s,
    "measured_step_s": measured,
    "measured_steps_s": times,
    "losses": losses,
    "estimate": est,
  }
  if est.get("step_s"):
    r["measured_over_estimate"] = measured / est["step_s"]
  if peak_flops(kind):
    r["measured_mfu"] = flops / measured / (peak_flops(kind) * n)
  r["trace"] = trace_summary(os.path.join(out, "trace"), traced)
  r["wall_s"] = time.perf_counter() - t0
  return r


def _print_run(r: dict, out: str) -> None:
  est, t = r["estimate"], r["trace"]
  if "busy_s" in t:
    print(
      f"trace: GPU busy {t['busy_s'] * 1e3:.2f} ms per step over {t['streams']} streams; kernels "
      + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in t["kernel_s"].items())
    )
  n = r["mesh"][0] * r["mesh"][1]
  print(
    f"{r['device']} x {n}, {r['model']} ({r['layers']} layers) {r['strategy']}"
    + (f", old: {','.join(r['old'])}" if r["old"] else "")
    + f": measured {r['measured_step_s'] * 1e3:.2f} ms per step "
    f"(median of {len(r['measured_steps_s'])}), "
    + "the estimate "
    + (f"{est['step_s'] * 1e3:.2f} ms: ratio {r['measured_over_estimate']:.2f}" if est.get("step_s")
       else f"none ({est.get('unavailable')})")
    + f"; trace in {out}/trace"
  )  # fmt: skip


# The before/after suite of the GPU step's changes on one GPU, in priority order (the budget cuts
# from the end):
# each row (name, layers of 7b, micro-batches, changes undone).
SUITE = (
  ("7b-L4-A1", 4, 1, "none"),
  ("7b-L4-A1-before", 4, 1, "all"),
  ("io-1b", None, None, None),  # experiments/gpu_io.py: the import and export, not a step
  ("7b-L8-A2", 8, 2, "none"),
  ("7b-L8-A2-before", 8, 2, "all"),
  *((f"7b-L4-A1-old-{c}", 4, 1, c) for c in CHANGES_ON_ONE_GPU),
)
# The goals: how much faster than before each run must be, and the runs it compares.
GOALS = {"7b-L4-A1": 0.10, "7b-L8-A2": 0.08}


def suite(args, devices, out: str) -> int:
  """The SUITE's runs, each within the budget (a run is started only if the longest so far
  would still end before it), and one page: out/README.md."""
  import jax

  from experiments import gpu_io, gpu_variants

  started, results, skipped, io = time.perf_counter(), [], [], None
  longest = 0.0
  for name, layers, micro, old in SUITE:
    if args.only and name not in args.only.split(","):
      continue
    planned = gpu_io.SECONDS if name == gpu_io.NAME else longest
    if time.perf_counter() - started + planned > args.budget_s:
      skipped.append(name)
      continue
    if name == gpu_io.NAME:
      io = gpu_io.io_run(devices[0].device_kind, jax.__version__, args.dry_run)
      with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(io, f, indent=1)
      print(json.dumps(io), flush=True)
      continue
    run = argparse.Namespace(**{**vars(args), "layers": layers, "micro_batches": micro,
                                "old": gpu_variants.parse(old)})  # fmt: skip
    if args.dry_run:  # the test model on the CPU (where cuDNN's attention is not)
      run.model, run.layers, run.seq_len, run.attention = "test", layers // 2, 64, "xla"
    folder = os.path.join(out, name)
    os.makedirs(folder, exist_ok=True)
    r = measure(run, devices, folder)
    r["name"] = name
    with open(os.path.join(out, f"{name}.json"), "w") as f:
      json.dump(r, f, indent=1)
    _print_run(r, folder)
    results.append(r)
    longest = max(longest, r["wall_s"])
  page = suite_page(results, skipped, args, io)
  with open(os.path.join(out, "README.md"), "w") as f:
    f.write(page)
  print(page)
  return 0


def suite_page(results: list[dict], skipped: list[str], args, io: dict | None = None) -> str:
  """The suite's results page: per run the measured step, MFU, kernels and estimate; the goals
  (each run against its `-before`); the numerics (each run's losses against its `-before`'s);
  the import and export (`io`, experiments/gpu_io.py), where run."""
  from experiments.gpu_io import io_lines

  first = (results or [io])[0]  # (io has the device, jax and date of a step's run)
  ms = lambda s: f"{s * 1e3:.2f}"
  how = "one command"
  if args.dry_run:
    how = "a CPU dry run of the plumbing, `test` model: no figure here is a GPU measurement"
  lines = [
    "# The step before and after the GPU step's changes's changes, measured on one GPU",
    "",
    f"{first['device']}, jax {first['jax']}, {first['date']}. `python experiments/gpu_measure.py "
    f"--suite --out DIR` ({how}): the median of {args.steps} steps after {args.warmup} of "
    "warm-up, kernels from a trace of 3 more; `old`: the changes undone "
    "(experiments/gpu_variants.py), `all` being the step before them. Estimate: `paro-jax "
    "inspect --target`'s for the same program.",
    "",
    "| run | layers | A | old | compile (s) | step (ms) | min-max (ms) | MFU | matmul | "
    "attention | other | estimate (ms) | measured / estimate |",
    "|---|---:|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
  ]
  for r in results:
    k = r["trace"].get("kernel_s", {})
    est = r["estimate"].get("step_s")
    mfu = r.get("measured_mfu")
    lines.append(
      f"| {r['name']} | {r['layers']} | {r['micro_batches']} | {','.join(r['old']) or '-'} | "
      f"{r['compile_s']:.0f} | {ms(r['measured_step_s'])} | "
      f"{ms(min(r['measured_steps_s']))}-{ms(max(r['measured_steps_s']))} | "
      + (f"{mfu:.3f}" if mfu else "-")
      + f" | {ms(k.get('matmul', 0))} | {ms(k.get('attention', 0))} | {ms(k.get('other', 0))} | "
      + (f"{ms(est)} | {r['measured_step_s'] / est:.2f}" if est else "- | -")
      + " |"
    )
  by_name = {r["name"]: r for r in results}
  lines += ["", "## Goals and numerics", ""]
  for name, goal in GOALS.items():
    now, before = by_name.get(name), by_name.get(f"{name}-before")
    if now is None or before is None:
      lines.append(f"- {name}: not measured (it or its `-before` was not run)")
      continue
    gain = 1 - now["measured_step_s"] / before["measured_step_s"]
    loss_gap = max(
      abs(a - b) / abs(b) for a, b in zip(now["losses"], before["losses"])
    )  # the same data and initialisation: the losses step by step
    lines.append(
      f"- {name}: {ms(now['measured_step_s'])} ms against {ms(before['measured_step_s'])} ms "
      f"before, {gain:.1%} faster (goal {goal:.0%}: {'met' if gain >= goal else 'not met'}); "
      f"losses over its {len(now['losses'])} steps within {loss_gap:.2%} of before's"
    )
  for r in results:
    if r["name"].startswith("7b-L4-A1-old-") and "7b-L4-A1" in by_name:
      cost = r["measured_step_s"] / by_name["7b-L4-A1"]["measured_step_s"] - 1
      lines.append(f"- {r['name']}: undoing it alone makes 7b-L4-A1 {cost:+.1%} slower")
  if skipped:
    lines.append(f"- not run (the {args.budget_s:.0f} s budget): {', '.join(skipped)}")
  if io:
    lines += io_lines(io)
  return "\n".join(lines) + "\n"


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
