"""How far apart identical fp32 runs are: one process (twice) and two processes (several times).

  python -m experiments.multiprocess_repro --runs 3 --out experiments/results/multiprocess_repro

Each configuration is trained once per repetition in fresh processes: one process holding the
whole mesh, and `paro-jax launch --loopback` of two processes joined by jax.distributed (gloo).
Writes OUT/repro.json (the losses of every run, the largest relative difference per step between
any two runs of the same kind and between the kinds, the command, date and machine) and
OUT/README.md (a table). tests/cluster/test_slurm.py and test_mpi.py compare their multi-process
losses within the measured bound.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from experiments.pages import machine_line, utc_now, write_page

# name: (train flags, mesh, processes x devices). "issue" is the command a user tried first;
# "tests" is the SLURM and MPI tests' run.
CONFIGS = {
  "tests": ("--batch-size 8 --seq-len 16 --warmup 1 --steps 40", "2x4", (2, 4)),
  "issue": ("--batch-size 8 --seq-len 32 --steps 40", "2x2", (2, 2)),
  # The same with the ring collectives (collective-permutes and adds in a fixed order).
  "issue-ring": ("--batch-size 8 --seq-len 32 --steps 40 --collectives ring", "2x2", (2, 2)),
}
COMMON = "train --model tiny --strategy IIG --dtype fp32"


def _env() -> dict:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
  return env


def _losses(out: str) -> list[float]:
  with open(os.path.join(out, "metrics.jsonl")) as f:
    return [json.loads(line)["loss"] for line in f]


def run(config: str, multi: bool, out: str) -> list[float]:
  flags, mesh, (nodes, devices) = CONFIGS[config]
  train = f"{COMMON} {flags} --out {out}".split()
  if multi:
    cmd = [sys.executable, "-m", "paro_jax", "launch", "--nodes", str(nodes)]
    cmd += ["--devices-per-node", str(devices), "--loopback", "--", *train]
  else:
    cmd = [sys.executable, "-m", "paro_jax", *train, "--mesh", mesh]
  proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True)
  if proc.returncode:
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
  return _losses(out)


def spread(runs: list[list[float]]) -> list[float]:
  """Per step, the largest |a - b| / |b| over every pair of runs."""
  a = np.array(runs, dtype=np.float64)
  worst = np.zeros(a.shape[1])
  for i in range(len(a)):
    for j in range(len(a)):
      worst = np.maximum(worst, np.abs(a[i] - a[j]) / np.abs(a[j]))
  return worst.tolist()


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--runs", type=int, default=3, help="two-process runs per configuration")
  p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
  p.add_argument("--out", default="experiments/results/multiprocess_repro")
  args = p.parse_args()
  results = {}
  page_path = os.path.join(args.out, "repro.json")
  if os.path.exists(page_path):  # keep the configurations not rerun now
    with open(page_path) as f:
      before = json.load(f)
    results = before["configs"]
    for r in results.values():  # pages written before each configuration kept its own run
      r.setdefault("date", before["date"])
      r.setdefault("run", before["command"])
  with tempfile.TemporaryDirectory() as tmp:
    for config in args.configs:
      one = [run(config, False, os.path.join(tmp, f"{config}-one-{k}")) for k in range(2)]
      two = [run(config, True, os.path.join(tmp, f"{config}-two-{k}")) for k in range(args.runs)]
      results[config] = {
        "command": f"{COMMON} {CONFIGS[config][0]}",
        "mesh": CONFIGS[config][1],
        "one_process": one,
        "two_processes": two,
        "spread_one_process": spread(one),
        "spread_two_processes": spread(two),
        "two_vs_one": spread([one[0], *two]),
        "date": utc_now(),
        "run": "python -m experiments.multiprocess_repro " + " ".join(sys.argv[1:]),
      }
      print(config, "done", flush=True)
  page = {
    "command": "python -m experiments.multiprocess_repro " + " ".join(sys.argv[1:]),
    "date": utc_now(),
    "machine": machine_line(),
    "configs": results,
  }
  write_page(args.out, page, "repro.json", _readme(page), "README.md")


def _readme(page: dict) -> str:
  lines = [
    "# Reproducibility of fp32 runs, one process and two processes",
    "",
    f"Latest run `{page['command']}`, {page['date']}, {page['machine']}.",
    "",
    "Largest relative loss difference between any two runs of a kind, per step (0: bit-exact).",
    "Multi-process CPU runs lower reduce-scatter as an all-reduce and a slice",
    "(paro_jax/cluster/gloo_rs.py; XLA:CPU's own through gloo sometimes sums stale data,",
    "[gloo_rs_race](../gloo_rs_race/README.md)); measurements dated before 2026-11-25T06:40 used",
    "XLA's reduce-scatter.",
    "",
  ]
  for name, r in page["configs"].items():
    steps = len(r["one_process"][0])
    shown = [s for s in (1, 2, 3, 5, 10, 12, 20, 30, 40) if s <= steps]
    lines += [
      f"## {name}: `{r['command']}`, mesh {r['mesh']}",
      "",
      *([f"Measured by `{r['run']}`, {r['date']}.", ""] if "date" in r else []),
      "| step | " + " | ".join(str(s) for s in shown) + " |",
      "|---|" + "---|" * len(shown),
    ]
    for label, key in (
      ("one process, 2 runs", "spread_one_process"),
      (f"two processes, {len(r['two_processes'])} runs", "spread_two_processes"),
      ("two processes vs one", "two_vs_one"),
    ):
      lines.append(f"| {label} | " + " | ".join(f"{r[key][s - 1]:.1e}" for s in shown) + " |")
    lines.append("")
  return "\n".join(lines)


if __name__ == "__main__":
  main()
