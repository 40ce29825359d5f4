"""The GPU step's non-matmul HBM bytes before and after issue 45's changes, by purpose, compiled
for H100 without a GPU (`paro-jax inspect --target h100`'s accounting: paro_jax/analysis/gpu/
traffic.py), and the share of per-micro-batch collective bytes with compute in their window.

Before: the code each change replaced put back (experiments/gpu_variants.py undone(all)); after:
the code as it is. One compile per process (experiments/gpu_compile.py, kept in --cache).

  python experiments/gpu_bytes.py --cache /tmp/gpu_bytes     # writes experiments/results/gpu_bytes/

The page states issue 45's targets and whether each is met; tests/experiments/test_gpu_bytes.py
reads it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "experiments", "results", "gpu_bytes")
# name -> gpu_compile.py's arguments: 7b with 4 layers, 2048 tokens per GPU per micro-batch,
# remat full, cuDNN attention, IIG with XLA's collectives
CONFIGS = {
  "7b-L4 1x1 A=1": ["--model", "7b", "--layers", "4", "--mesh", "1x1"],
  "7b-L4 1x8 IIG A=1": ["--model", "7b", "--layers", "4", "--mesh", "1x8"],
}
# issue 45's targets: non-matmul bytes per GPU per step at most, and the collective bytes
# fraction at least (None: none set)
TARGETS = {"7b-L4 1x1 A=1": (50e9, None), "7b-L4 1x8 IIG A=1": (21e9, 0.73)}


def compile_one(cache: str, name: str, old: str, resume: bool) -> dict:
  prefix = os.path.join(cache, name.replace(" ", "_").replace("=", "") + f"-old-{old}")
  if not (resume and os.path.exists(prefix + ".json")):
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "gpu_compile.py"), *CONFIGS[name]]
    subprocess.run([*cmd, "--old", old, "--out", prefix], env=env, cwd=ROOT, check=True)
  with open(prefix + ".json") as f:
    run = json.load(f)
  with open(prefix + ".hlo") as f:  # counted again: the accounting as it is now
    run["report"]["traffic"] = breakdown(f.read())
  return run


def breakdown(hlo_text: str) -> dict:
  from paro_jax.analysis.gpu import estimate, roofline, traffic

  comps, _ = roofline.parse_computations(hlo_text)
  return traffic.breakdown(traffic.kernels(hlo_text, estimate.sequenced_computations(comps)))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--cache", required=True, help="folder for the compiled programs")
  ap.add_argument("--resume", action="store_true", help="reuse the compiles already in --cache")
  ap.add_argument("--out", default=OUT)
  args = ap.parse_args(argv)
  sys.path.insert(0, ROOT)
  from experiments.pages import machine_line

  rows = []
  for name in CONFIGS:
    before = compile_one(args.cache, name, "all", args.resume)
    after = compile_one(args.cache, name, "none", args.resume)
    rows.append({"name": name, "before": _figures(before), "after": _figures(after)})
  command = "python experiments/gpu_bytes.py " + " ".join(
    argv if argv is not None else sys.argv[1:]
  )
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "gpu_bytes.json"), "w") as f:
    json.dump({"command": command, "date": str(datetime.date.today()), "rows": rows}, f, indent=1)
  page = _page(rows, command, machine_line())
  with open(os.path.join(args.out, "README.md"), "w") as f:
    f.write(page)
  print(page)
  return 0


def _figures(run: dict) -> dict:
  r = run["report"]
  return {
    "non_matmul_bytes": r["traffic"]["non_matmul_bytes"],
    "by_purpose": r["traffic"]["by_purpose"],
    "collective_bytes_fraction": r["overlap"]["collective_bytes_fraction"],
    "compile_s": run["compile_s"],
  }


def _met(name: str, after: dict) -> list[str]:
  most, least = TARGETS[name]
  out = []
  gb = after["non_matmul_bytes"]
  out.append(
    f"non-matmul bytes {gb / 1e9:.2f} GB <= {most / 1e9:.0f} GB: "
    + ("met" if gb <= most else "NOT met")
  )
  if least is not None:
    frac = after["collective_bytes_fraction"]
    out.append(
      f"collective bytes with compute in their window {frac:.1%} >= {least:.0%}: "
      + ("met" if frac is not None and frac >= least else "NOT met")
    )
  return out


def _page(rows: list[dict], command: str, machine: str) -> str:
  purposes = list(dict.fromkeys(p for r in rows for k in ("before", "after")
                                for p in r[k]["by_purpose"]))  # fmt: skip
  lines = [
    "# Non-matmul HBM bytes of the GPU step, before and after issue 45's changes",
    "",
    f"`{command}` ({datetime.date.today()}, {machine}, no GPU: each step compiled for H100 "
    "without one). Per GPU per step, the bytes each kernel other than a matmul or cuDNN's "
    "attention moves, by purpose (`paro-jax inspect --target h100`'s accounting, "
    "paro_jax/analysis/gpu/traffic.py); 7b with 4 layers, one sequence of 2048 tokens per GPU, "
    "remat full, cuDNN attention, IIG, XLA's collectives. Before: experiments/gpu_variants.py "
    "undone(all), the code each change replaced; after: the code as it is. Collective fraction: "
    "the share of per-micro-batch collective bytes with compute in their window.",
    "",
    "| GB per GPU per step | "
    + " | ".join(f"{r['name']} {k}" for r in rows for k in ("before", "after"))
    + " |",  # fmt: skip
    "|---|" + "---:|" * (2 * len(rows)),
  ]
  cell = lambda v: "-" if v is None else f"{v / 1e9:.2f}"  # noqa: E731
  for p in purposes:
    vals = [r[k]["by_purpose"].get(p) for r in rows for k in ("before", "after")]
    lines.append(f"| {p} | " + " | ".join(cell(v) for v in vals) + " |")
  tot = [r[k]["non_matmul_bytes"] for r in rows for k in ("before", "after")]
  lines.append("| **total** | " + " | ".join(f"**{v / 1e9:.2f}**" for v in tot) + " |")
  frac = [r[k]["collective_bytes_fraction"] for r in rows for k in ("before", "after")]
  lines.append(
    "| collective fraction | " + " | ".join("-" if f is None else f"{f:.1%}" for f in frac) + " |"
  )
  lines += ["", "## Issue 45's targets (after)", ""]
  for r in rows:
    for line in _met(r["name"], r["after"]):
      lines.append(f"- {r['name']}: {line}")
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  sys.exit(main())
