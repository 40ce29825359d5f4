"""The compiled traffic of every strategy at A=1 and A=4 beside docs/design.md's formulas, and
with int8 between nodes at A=2: the grids tests/analysis/test_inspector.py and
test_inspector_compress.py compile in part, run with those modules' own inspect_report and
int8_figures (their model, mesh 2x4, batch and sequence).

  python experiments/inspector_grid.py --out experiments/results/inspector_grid

On 8 virtual CPU devices, each cell compiles the step (XLA's collectives, nothing runs) and
records the bytes per device its collectives move inside and between nodes, beside the formulas'
bytes and phases. Writes OUT/results.json and OUT/README.md; tests/experiments/
test_inspector_grid.py checks the page with the test's own assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from experiments.families_grid import git_commit  # noqa: E402
from experiments.pages import machine_line, utc_now, write_page  # noqa: E402
from paro_jax.core.strategy import VALID_NAMES  # noqa: E402  (imports no jax)

GRID = [(s, a) for s in VALID_NAMES for a in (1, 4)]
INT8_GRID = list(VALID_NAMES)  # test_inspector_compress's int8 wire (blocks of 64), A=2
KEYS = ("inter_bytes", "intra_bytes")


def run_cell(suite, strategy: str, a: int) -> dict:
  start = time.perf_counter()
  r = suite.inspect_report(strategy, a)
  return {
    "strategy": strategy,
    "micro_batches": a,
    "mesh": r["mesh"],
    "measured": {k: r["measured"][k] for k in KEYS},
    "expected": {k: r["expected"][k] for k in KEYS} | {"phases": r["expected"]["phases"]},
    "seconds": round(time.perf_counter() - start, 1),
  }


def row(c: dict) -> str:
  m, e = c["measured"], c["expected"]
  return (
    f"| {c['strategy']} | {c['micro_batches']} | {m['inter_bytes']:,.0f} | "
    f"{e['inter_bytes']:,.0f} | {m['intra_bytes']:,.0f} | {e['intra_bytes']:,.0f} |"
  )


def int8_row(c: dict) -> str:
  m, e = c["measured"], c["expected"]
  return (
    f"| {c['strategy']} | {m['inter_bytes']:,.0f} | {e['inter_bytes']:,.0f} | "
    f"{c['plain_inter_bytes']:,.0f} | {m['intra_bytes']:,.0f} |"
  )


def page(record: dict) -> str:
  meta = record["meta"]
  return "\n".join(
    [
      "# Compiled traffic of every strategy beside the formulas, A=1 and A=4",
      "",
      f"    {meta['command']}",
      "",
      f"{meta['date']}, commit `{meta['commit']}`; {meta['machine']}; 8 virtual CPU devices",
      "(2 nodes x 4), XLA's collectives; nothing ran. Each cell is `inspect_report` of",
      "`tests/analysis/test_inspector.py` (its model, batch 8, 8 tokens a sequence): bytes per",
      "device per step, measured in the compiled HLO and by the formulas of docs/design.md",
      "(`paro_jax/analysis/planner/costs.py`). `tests/experiments/test_inspector_grid.py` applies",
      "the test's own assertions to `results.json`: each cell within 1% (or 64 bytes: the scalar",
      "metrics), and inter-node bytes flat in A exactly when gradients are N or I and parameters",
      "are not G.",
      "",
      "| strategy | A | inter measured | inter formula | intra measured | intra formula |",
      "|---|---:|---:|---:|---:|---:|",
      *(row(c) for c in record["cells"]),
      "",
      "With int8 parameters and gradients between nodes (blocks of 64, A=2, fp32 compute;",
      "`tests/analysis/test_inspector_compress.py`'s `int8_figures`): each within 1% of the",
      "formula with the wire's sizes, under 0.3 of the uncompressed formula's inter bytes, `s8`",
      "on the wire.",
      "",
      "| strategy | inter measured | inter formula | uncompressed formula | intra measured |",
      "|---|---:|---:|---:|---:|",
      *(int8_row(c) for c in record["int8"]),
      "",
    ]
  )


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default="experiments/results/inspector_grid")
  parser.add_argument("--resume", action="store_true", help="keep the cells already in --out")
  args = parser.parse_args(argv)
  import tests.conftest  # noqa: F401  (the suite's 8 devices and flags, set before jax starts)
  from tests.analysis import test_inspector as suite

  from tests.analysis import test_inspector_compress as compress

  path, done = os.path.join(args.out, "results.json"), {"cells": [], "int8": []}
  if args.resume and os.path.exists(path):
    with open(path) as f:
      done |= json.load(f)
  old = {(c["strategy"], c["micro_batches"]): c for c in done["cells"]}
  cells = []
  for strategy, a in GRID:
    cells.append(old.get((strategy, a)) or run_cell(suite, strategy, a))
    print(row(cells[-1]), f"{cells[-1]['seconds']} s", flush=True)
  old = {c["strategy"]: c for c in done["int8"]}
  int8 = []
  for strategy in INT8_GRID:
    int8.append(old.get(strategy) or {"strategy": strategy} | compress.int8_figures(strategy))
    print(strategy, "int8", int8[-1]["measured"], flush=True)
  meta = {
    "command": f"python experiments/inspector_grid.py --out {args.out}"
    + (" --resume" if args.resume else ""),
    "date": utc_now(),
    "commit": git_commit(),
    "machine": machine_line(),
  }
  record = {"meta": meta, "cells": cells, "int8": int8}
  write_page(args.out, record, "results.json", page(record), "README.md")


if __name__ == "__main__":
  main()
