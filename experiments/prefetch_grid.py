"""The prefetching layer stack against the plain layer scan on the whole grid: every strategy
tests/core/test_prefetch.py samples, on stacks of 1, 2 and 3 layers, with and without LoRA, run
with that module's own cells (its model, batch, mesh and tolerances).

  python experiments/prefetch_grid.py --out experiments/results/prefetch_grid

On 8 virtual CPU devices (2 nodes x 4), each cell computes every device's gradients at Gr for one
micro-batch through both stacks and records, over all leaves, the largest amount by which the
prefetched gradient's difference from the plain one exceeds the test's relative tolerance (it
passes at most the absolute tolerance) and the smallest leaf's largest plain gradient (a gradient
that is there). Writes OUT/results.json and OUT/README.md; tests/experiments/test_prefetch_grid.py
checks the page.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from experiments.families_grid import git_commit  # noqa: E402
from experiments.pages import machine_line, utc_now, write_page  # noqa: E402

# (strategy, layers, lora): the strategies whose parameters are sharded (the stack prefetches
# their gathers), without LoRA; with LoRA, the test's two.
GRID = [(s, n, False) for s in ("ING", "IIG", "IGG", "GNG", "GIG", "GGG") for n in (1, 2, 3)]
GRID += [(s, n, True) for s in ("ING", "GGG") for n in (1, 2, 3)]
COLUMNS = ("strategy", "layers", "lora", "leaves", "largest excess", "smallest gradient", "passes")


def run_cell(suite, cell: tuple) -> dict:
  import jax
  import numpy as np

  strategy, layers, lora = cell
  start = time.perf_counter()
  plain, prefetched = suite.both_grads(strategy, layers, suite.LORA if lora else None)
  paths = jax.tree_util.tree_leaves_with_path(plain)
  pairs = list(zip((np.asarray(a) for _, a in paths), map(np.asarray, jax.tree.leaves(prefetched))))
  # np.max, not max: a NaN anywhere makes the cell fail
  excess = float(np.max([(np.abs(b - a) - suite.RTOL * np.abs(a)).max() for a, b in pairs]))
  smallest = min(float(np.abs(a).max()) for a, _ in pairs)
  names = [str(p[-1].key) for p, _ in paths]
  return {
    "strategy": strategy,
    "layers": layers,
    "lora": lora,
    "leaves": len(pairs),
    "prefetched_leaves": len(jax.tree.leaves(prefetched)),
    "adapters_only": all(n.endswith(("_lora_a", "_lora_b")) for n in names),
    "excess": excess,
    "smallest_gradient": smallest,
    "passes": bool(excess <= suite.ATOL and smallest > 0 and len(pairs) > 0),
    "seconds": round(time.perf_counter() - start, 1),
  }


def row(r: dict) -> str:
  return (
    f"| {r['strategy']} | {r['layers']} | {'yes' if r['lora'] else 'no'} | {r['leaves']} | "
    f"{r['excess']:.1e} | {r['smallest_gradient']:.1e} | {'yes' if r['passes'] else 'NO'} |"
  )


def page(record: dict) -> str:
  meta, cells = record["meta"], record["cells"]
  return "\n".join(
    [
      "# The prefetching layer stack against the plain scan: the whole grid",
      "",
      f"    {meta['command']}",
      "",
      f"{meta['date']}, commit `{meta['commit']}`; {meta['machine']}; 8 virtual CPU devices",
      "(2 nodes x 4). Each cell is a cell of `tests/core/test_prefetch.py`: every device's",
      "gradients at Gr for one micro-batch through the plain layer scan and the prefetching stack.",
      '"largest excess" is the largest |prefetched - plain| - rtol |plain| over every element',
      f"(rtol {meta['rtol']:g}); a cell passes when it is at most atol {meta['atol']:g} (the",
      'test\'s assert_allclose) and every leaf has a gradient ("smallest gradient": the smallest',
      "leaf's largest plain gradient). With LoRA only the adapters have gradients.",
      "",
      f"{sum(c['passes'] for c in cells)} of {len(cells)} cells pass.",
      "",
      "| " + " | ".join(COLUMNS) + " |",
      "|---|---:|---|---:|---:|---:|---|",
      *(row(c) for c in cells),
      "",
      "`results.json` holds every cell; `tests/experiments/test_prefetch_grid.py` checks the page.",
      "",
    ]
  )


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default="experiments/results/prefetch_grid")
  args = parser.parse_args(argv)
  import tests.conftest  # noqa: F401  (the suite's 8 devices and flags, set before jax starts)
  from tests.core import test_prefetch as suite

  cells = []
  for cell in GRID:
    cells.append(run_cell(suite, cell))
    print(row(cells[-1]), f"{cells[-1]['seconds']} s", flush=True)
  meta = {
    "command": f"python experiments/prefetch_grid.py --out {args.out}",
    "date": utc_now(),
    "commit": git_commit(),
    "machine": machine_line(),
    "rtol": suite.RTOL,
    "atol": suite.ATOL,
  }
  record = {"meta": meta, "cells": cells}
  write_page(args.out, record, "results.json", page(record), "README.md")


if __name__ == "__main__":
  main()
