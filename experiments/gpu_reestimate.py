"""The runs measured on one H100 (experiments/results/gpu_measure/) estimated again without a GPU.

Each measured run is compiled here for the H100 target as it was measured: the same model,
layers, micro-batches, sequence length, remat and attention, on one GPU (IIG, mesh 1x1), with
the code of before the GPU step's changes (experiments/gpu_variants.py undone(all): the
measurements were taken before them). Its step is then estimated (paro_jax/analysis/gpu/
estimate.py compose: the roofline of every kernel at the hardware's efficiencies, XLA's
scheduler for the waiting on collectives), and the page puts the estimate beside the
measurement.

  python experiments/gpu_reestimate.py --cache /tmp/gpu_reestimate       # compiles, then the page
  python experiments/gpu_reestimate.py --cache /tmp/gpu_reestimate --resume

Each compile (experiments/gpu_compile.py, one process each) keeps its HLO in --cache; --resume
compiles only the runs not there. Writes experiments/results/gpu_reestimate/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEASURED = os.path.join(ROOT, "experiments", "results", "gpu_measure")
OUT = os.path.join(ROOT, "experiments", "results", "gpu_reestimate")


def measured_runs() -> list[dict]:
  """Every measured run of the gpu_measure page (its JSON), named by its file."""
  runs = []
  for path in sorted(glob.glob(os.path.join(MEASURED, "*.json"))):
    with open(path) as f:
      r = json.load(f)
    if "measured_step_s" in r:
      r["name"] = os.path.basename(path)[: -len(".json")]
      runs.append(r)
  return runs


# The GPU step's goals: these runs faster than measured by at least this fraction.
GOALS = {"7b-L4-A1": 0.10, "7b-L8-A2": 0.08}
NOW = "-now"  # the cache's name for a goal run's program with the code as it is


def compile_args(r: dict, old: str = "all") -> list[str]:
  """gpu_compile.py's arguments for the program of measured run `r`, as it was measured (`old`
  "all"), or with the code as it is ("none")."""
  inter, intra = r["mesh"]
  return [
    "--model", r["model"], "--layers", str(r["layers"]), "--mesh", f"{inter}x{intra}",
    "--strategy", r["strategy"], "--micro-batches", str(r["micro_batches"]),
    "--seq-len", str(r["seq_len"]), "--remat", r["remat"], "--attention", r["attention"],
    "--old", old,
  ]  # fmt: skip


def compile_all(cache: str, resume: bool, runs) -> None:
  env = {**os.environ, "PYTHONPATH": ROOT}
  env.pop("XLA_FLAGS", None)
  for name, args in runs:
    prefix = os.path.join(cache, name)
    if resume and os.path.exists(prefix + ".json"):
      continue
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "gpu_compile.py"), *args]
    proc = subprocess.run([*cmd, "--out", prefix], env=env, cwd=ROOT, text=True,
                          capture_output=True)  # fmt: skip
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    print(f"{name}: " + (tail[-1] if tail else f"exit {proc.returncode}"), flush=True)


KINDS = ("matmul", "attention", "other")
BAND = (0.87, 1.15)  # every run within 15% of its estimate (the GPU step's goal)


def kernel_times(hlo_text: str, peak_flops: float, bandwidth: float) -> dict[str, float]:
  """Per step, the time of each kind of kernel (matmul, attention, other: memory-bound) at the
  peaks (kernel_time.PEAK), as the measured trace sorts them (gpu_measure.py trace_summary)."""
  from paro_jax.analysis.gpu import estimate, kernel_time, roofline
  from paro_jax.analysis.hlo.collectives import computation_counts

  comps, entry = roofline.parse_computations(hlo_text)
  counts = computation_counts(hlo_text)
  out = dict.fromkeys(KINDS, 0.0)
  for comp in {entry} | estimate.sequenced_computations(comps):
    n = counts.get(comp, 0)
    types = {i.name: i.type_text for i in comps.get(comp, [])}
    for i in comps.get(comp, []) if n else []:
      t = kernel_time.kernel_seconds(i, comps, types, peak_flops, bandwidth)
      flops = roofline.instruction_flops(i, comps, types)
      kind = "attention" if roofline.is_attention(i) else "matmul" if flops else "other"
      out[kind] += n * t
  return out


def efficiencies(rows: list[dict]) -> dict[str, float]:
  """Per kind, the roofline's kernel time over the measured one, summed over `rows`."""
  return {
    k: sum(r["roofline_s"][k] for r in rows) / sum(r["measured_kernel_s"].get(k, 0.0) for r in rows)
    for k in KINDS
  }


def reestimate(cache: str) -> list[dict]:
  """Every measured run whose compile is in `cache`: measured, the estimate (estimate.compose
  at kernel_time.H100), the roofline by kind and the measured kernels by kind."""
  from paro_jax.analysis.gpu import estimate, kernel_time, targets

  peak = targets.target_gpu("h100").peak_flops
  bandwidth = targets.memory_bandwidth("h100")
  rows = []
  for r in measured_runs():
    prefix = os.path.join(cache, r["name"])
    if not os.path.exists(prefix + ".json"):
      continue
    with open(prefix + ".hlo") as f:
      text = f.read()
    with open(prefix + ".log") as f:
      stats = estimate.parse_statistics(f.read())
    c = estimate.compose(text, stats, peak, bandwidth, kernel_time.H100)
    rows.append(
      {
        "run": r["name"],
        "measured_s": r["measured_step_s"],
        "busy_s": r["trace"]["busy_s"],
        "estimate_s": c["step_s"],
        "ratio": r["measured_step_s"] / c["step_s"],
        "roofline_s": kernel_times(text, peak, bandwidth),
        "measured_kernel_s": r["trace"]["kernel_s"],
        "previous_estimate_s": r["estimate"].get("step_s"),
      }
    )
  return rows


def goals(cache: str, rows: list[dict]) -> list[dict]:
  """For each run of GOALS whose programs are both in `cache`: the step estimated with the code
  as measured and as it is now, and the measurement scaled by their ratio (an estimate of what
  the GPU would measure now, not a measurement)."""
  from paro_jax.analysis.gpu import estimate, kernel_time, targets

  peak = targets.target_gpu("h100").peak_flops
  bandwidth = targets.memory_bandwidth("h100")
  out = []
  for r in rows:
    prefix = os.path.join(cache, r["run"] + NOW)
    if r["run"] not in GOALS or not os.path.exists(prefix + ".json"):
      continue
    with open(prefix + ".hlo") as f, open(prefix + ".log") as g:
      c = estimate.compose(f.read(), estimate.parse_statistics(g.read()), peak, bandwidth,
                           kernel_time.H100)  # fmt: skip
    out.append(
      {
        "run": r["run"],
        "goal": GOALS[r["run"]],
        "measured_s": r["measured_s"],
        "estimate_before_s": r["estimate_s"],
        "estimate_now_s": c["step_s"],
        "projected_s": r["measured_s"] * c["step_s"] / r["estimate_s"],
      }
    )
  return out


def goals_section(gs: list[dict]) -> list[str]:
  ms = lambda s: f"{s * 1e3:.2f}"  # noqa: E731
  lines = [
    "",
    "## The GPU step's goals, estimated (not measured)",
    "",
    "The same runs compiled with the code as it is (`--old none`), estimated the same way; "
    "`projected` is the measured step scaled by the two estimates' ratio. A goal is met only "
    "when the GPU measures it (`python experiments/gpu_measure.py --suite`); this says what "
    "the estimate expects.",
    "",
    "| run: goal | measured before (ms) | estimate before | estimate now | projected now | "
    "faster by | goal met by the estimate |",
    "|---|---:|---:|---:|---:|---:|---|",
  ]
  for g in gs:
    faster = 1 - g["estimate_now_s"] / g["estimate_before_s"]
    lines.append(
      f"| {g['run']}: {g['goal']:.0%} faster | {ms(g['measured_s'])} | "
      f"{ms(g['estimate_before_s'])} | {ms(g['estimate_now_s'])} | {ms(g['projected_s'])} | "
      f"{faster:.1%} | {'yes' if faster >= g['goal'] else 'no'} |"
    )
  return lines


def leave_one_out(rows: list[dict]) -> dict[str, float]:
  """Each run's measured / estimate with the efficiencies and the host's gap taken from the
  other runs only (the same composition, kernels summed by kind)."""
  import statistics

  out = {}
  for r in rows:
    rest = [q for q in rows if q is not r]
    eff = efficiencies(rest)
    gap = statistics.median(q["measured_s"] - q["busy_s"] for q in rest)
    est = sum(r["roofline_s"][k] / eff[k] for k in KINDS) + gap
    out[r["run"]] = r["measured_s"] / est
  return out


def page(rows: list[dict], command: str, gs: list[dict] = ()) -> str:
  import statistics

  from experiments.pages import machine_line
  from paro_jax.analysis.gpu import estimate, kernel_time

  eff = efficiencies(rows)
  gap = statistics.median(r["measured_s"] - r["busy_s"] for r in rows)
  loo = leave_one_out(rows)
  ms = lambda s: f"{s * 1e3:.2f}"  # noqa: E731
  lines = [
    "# The measured H100 runs, estimated again without a GPU",
    "",
    f"`{command}` ({datetime.date.today()}, {machine_line()}, no GPU). Each run of "
    "experiments/results/gpu_measure/ (one H100 SXM, 2026-11-25) compiled here for the H100 "
    "target as it was measured: its model, layers, micro-batches, sequence, remat and "
    "attention, IIG on one GPU, with the code of before the GPU step's changes "
    "(experiments/gpu_variants.py undone(all)), then estimated by "
    "paro_jax/analysis/gpu/estimate.py compose: each kernel at the efficiencies below "
    "(kernel_time.H100), XLA's scheduler's waiting on collectives (none on one GPU), the "
    "loops' trip counts, and the host's gap per step. What ran there was compiled by jax "
    "0.11.2 on the GPU (cuBLAS GEMMs, autotuned); what is estimated here is jax 0.10.2's "
    "deviceless compile of the same step (Triton GEMMs, untuned): the kernels differ in places, "
    "the work does not.",
    "",
    "| run | measured (ms) | estimate (ms) | measured / estimate | leave-one-out | "
    "before this estimate (measured / estimate) |",
    "|---|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    prev = r["previous_estimate_s"]
    lines.append(
      f"| {r['run']} | {ms(r['measured_s'])} | {ms(r['estimate_s'])} | {r['ratio']:.3f} | "
      f"{loo[r['run']]:.3f} | " + (f"{r['measured_s'] / prev:.2f}" if prev else "-") + " |"
    )
  worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
  within = all(BAND[0] <= r["ratio"] <= BAND[1] for r in rows)
  lines += [
    "",
    f"Every ratio within [{BAND[0]}, {BAND[1]}]: {'yes' if within else 'NO'}"
    f" (furthest: {worst['run']}, {worst['ratio']:.3f}); tests/experiments/test_gpu_reestimate.py "
    "reads this page.",
    "",
    "## The constants, and where they come from",
    "",
    "Four global constants, none per run: per kind of kernel the measured kernel time (the "
    "profiler trace's, summed over the 15 runs) over the same kernels' roofline at the "
    "H100's peaks (989 TFLOP/s bf16, TF32 at half; 3.35 TB/s), and the median over the runs of "
    "the measured step less the GPU's busy time (the host). Leave-one-out: the same "
    "composition with the constants taken from the other 14 runs.",
    "",
    "| constant | from these measurements | in the code |",
    "|---|---:|---:|",
    f"| matmul efficiency | {eff['matmul']:.3f} | {kernel_time.H100.matmul} |",
    f"| attention efficiency | {eff['attention']:.3f} | {kernel_time.H100.attention} |",
    f"| memory-bound efficiency | {eff['other']:.3f} | {kernel_time.H100.memory} |",
    f"| host gap per step (ms) | {gap * 1e3:.2f} | {estimate.HOST_GAP_S * 1e3:.2f} |",
    "",
    "| run | matmul: measured / roofline (ms) | attention | other |",
    "|---|---:|---:|---:|",
  ]
  for r in rows:
    m, t = r["measured_kernel_s"], r["roofline_s"]
    lines.append(
      f"| {r['run']} | " + " | ".join(f"{ms(m.get(k, 0.0))} / {ms(t[k])}" for k in KINDS) + " |"
    )
  if gs:
    lines += goals_section(gs)
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--cache", required=True, help="folder for the compiled programs")
  ap.add_argument("--resume", action="store_true", help="compile only what --cache lacks")
  ap.add_argument("--only", default=None, help="these runs only (comma-separated)")
  ap.add_argument("--no-compile", action="store_true", help="the page from --cache as it is")
  ap.add_argument("--out", default=OUT)
  args = ap.parse_args(argv)
  sys.path.insert(0, ROOT)
  runs = [(r["name"], compile_args(r)) for r in measured_runs()]
  runs += [
    (r["name"] + NOW, compile_args(r, "none")) for r in measured_runs() if r["name"] in GOALS
  ]
  if args.only:
    runs = [x for x in runs if x[0] in args.only.split(",")]
  if not args.no_compile:
    compile_all(args.cache, args.resume, runs)
  rows = reestimate(args.cache)
  gs = goals(args.cache, rows)
  command = "python experiments/gpu_reestimate.py " + " ".join(
    argv if argv is not None else sys.argv[1:]
  )
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "gpu_reestimate.json"), "w") as f:
    json.dump(
      {"command": command, "date": str(datetime.date.today()), "rows": rows, "goals": gs},
      f,
      indent=1,
    )
  text = page(rows, command, gs)
  with open(os.path.join(args.out, "README.md"), "w") as f:
    f.write(text)
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
