"""Every strategy's step against the single-device loop on every mesh, with tied embeddings, on
each hand-written collective and on packed rows: the grid tests/core/test_equivalence.py and
tests/core/test_masked_equivalence.py check a few cells of, run with those modules' own cells
(their models, batches, optimizer and tolerances).

  python experiments/equivalence_grid.py --out experiments/results/equivalence_grid

On 8 virtual CPU devices, each cell trains 3 steps of 2 micro-batches from the initial parameters
of the single-device optax loop (run/reference.py) on the same batches, and records the largest
relative difference of a step's loss from the loop's and the largest absolute difference of a
final parameter; a cell passes under the test's tolerances. Writes OUT/results.json and
OUT/README.md; tests/experiments/test_equivalence_grid.py checks the page.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from experiments.families_grid import git_commit  # noqa: E402
from experiments.pages import machine_line, utc_now, write_page  # noqa: E402
from paro_jax.core.strategy import VALID_NAMES  # noqa: E402  (imports no jax)

# (group, strategy, mesh, collectives). fp32: every strategy on two nodes of 4 (the Llama shape)
# and four nodes of 2 (the Qwen2 shape), and on one node of 8 the programs the 14 collapse to;
# tied: the Qwen3 shape with a tied table, every strategy on 2x4; collectives: the rings under
# four strategies on 2x4; packed: test_masked_equivalence's packed rows (loss weights, segments),
# every strategy on 2x4; int8: test_engine_compress's int8 inter-node traffic, every strategy on
# 2x4 (close to the loop, not equal: its own bounds).
ONE_NODE = ("NNN", "III", "GGG", "IIG", "NIG")
GRID = (
  [("fp32", s, mesh, "xla") for mesh in ("2x4", "4x2") for s in VALID_NAMES]
  + [("fp32", s, "1x8", "xla") for s in ONE_NODE]
  + [("tied", s, "2x4", "xla") for s in VALID_NAMES]
  + [
    ("collectives", s, "2x4", impl)
    for s in ("NNN", "NIG", "IIG", "GGG")
    for impl in ("ring", "hring", "horing")
  ]
  + [("packed", s, "2x4", "xla") for s in VALID_NAMES]
  + [("int8", s, "2x4", "xla") for s in VALID_NAMES]
)
COLUMNS = ("group", "strategy", "mesh", "collectives", "loss rel diff", "param abs diff", "passes")


def run_cell(setups: dict, cell: tuple) -> dict:
  """One cell trained as its test trains it, against its config's single-device run."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from tests.core import test_engine_compress as compress
  from tests.core import test_equivalence as suite
  from tests.core import test_masked_equivalence as masked

  group, strategy, mesh, impl = cell
  tol = masked if group == "packed" else suite  # (the same tolerances: the page's test says so)
  if group == "packed":
    cfg, setup = masked.CFG, masked.reference_setup
  else:
    cfg = suite.TIED if group == "tied" else suite.QWEN2 if mesh == "4x2" else suite.CFG
    setup = lambda: suite.reference_setup(cfg)  # noqa: E731
  if (group == "packed", cfg) not in setups:
    setups[group == "packed", cfg] = setup()
  batches, params0, ref_losses, ref_params = setups[group == "packed", cfg]
  start = time.perf_counter()
  extra = {}
  if group == "packed":
    losses, targets, params = masked.run_engine(strategy, batches, params0, collectives=impl)
    extra["targets_match"] = targets == [b.targets() for b in batches]
  elif group == "int8":
    losses, state = compress.run(strategy, batches, params0, compress.INT8, impl)
    params = jax.device_get(state.master)
    extra["figures"] = compress.close_not_equal(losses, state, ref_losses, ref_params)
    try:
      compress.assert_close_not_equal(extra["figures"])
      extra["close_not_equal"] = True
    except AssertionError:
      extra["close_not_equal"] = False
  else:
    shape = tuple(int(n) for n in mesh.split("x"))
    losses, params, engine, _ = suite.train_engine(
      strategy, shape, batches, params0, jnp.float32, impl, cfg
    )
    extra["program"] = engine.program.value
  loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
  param_diff = max(
    float(np.abs(np.asarray(a) - np.asarray(b)).max())
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params))
  )
  return {
    "group": group,
    "strategy": strategy,
    "mesh": mesh,
    "collectives": impl,
    "family": cfg.family,
    "tied": cfg.tie_embeddings,
    **extra,
    "head_leaves": sorted(params["head"]),
    "losses": [float(x) for x in losses],
    "reference_losses": [float(x) for x in ref_losses],
    "loss_rel_diff": float(loss_diff),
    "param_abs_diff": param_diff,
    "passes": extra["close_not_equal"]
    if group == "int8"
    else bool(
      loss_diff <= tol.LOSS_RTOL and param_diff <= tol.PARAM_ATOL and extra.get("targets_match", 1)
    ),
    "seconds": round(time.perf_counter() - start, 1),
  }


def key(c: dict) -> tuple:
  return (c["group"], c["strategy"], c["mesh"], c["collectives"])


def row(r: dict) -> str:
  return (
    f"| {r['group']} | {r['strategy']} | {r['mesh']} | {r['collectives']} | "
    f"{r['loss_rel_diff']:.1e} | {r['param_abs_diff']:.1e} | {'yes' if r['passes'] else 'NO'} |"
  )


def fill(text: str) -> str:
  return textwrap.fill(text, width=100, break_on_hyphens=False)


def page(record: dict) -> str:
  meta, cells = record["meta"], record["cells"]
  failed = [c for c in cells if not c["passes"]]
  return "\n".join(
    [
      "# Every strategy against the single-device loop: the whole grid",
      "",
      f"    {meta['command']}",
      "",
      fill(f"{meta['date']}, commit `{meta['commit']}`; {meta['machine']}; 8 virtual CPU devices."),
      "",
      fill(
        "Each cell is a cell of `tests/core/test_equivalence.py` (its models, batches and "
        f"optimizer: {meta['steps']} steps of {meta['micro_batches']} micro-batches, fp32), "
        "which checks one mesh a strategy, four strategies with a tied table and one strategy a "
        "hand-written collective, or, packed, of `tests/core/test_masked_equivalence.py` (rows "
        "packed with examples of random lengths, loss weights on their completions only; "
        f"{meta['packed_steps']} steps; four strategies there), or, int8, of "
        "`tests/core/test_engine_compress.py` (int8 parameters and gradients between nodes, "
        "blocks of 64: close to the loop, not equal; a cell passes under that test's bounds, "
        "`assert_close_not_equal`; four strategies there). fp32 on 2x4 and 1x8 is the "
        "Llama shape, on 4x2 the Qwen2 shape "
        "(biases on q, k and v); tied is the Qwen3 shape with its embedding table as the head "
        "(vocabulary 61, which no mesh divides). A cell passes when every step's loss is within "
        f"a relative {meta['loss_rtol']:g} of the single-device loop's and every final parameter "
        f"within {meta['param_atol']:g} of its (the test's tolerances)."
      ),
      "",
      f"{len(cells) - len(failed)} of {len(cells)} cells pass"
      + (
        ": " + ", ".join(f"{c['group']} {c['strategy']} {c['mesh']}" for c in failed) + " fail."
        if failed
        else "."
      ),
      "",
      "| " + " | ".join(COLUMNS) + " |",
      "|" + "---|" * 4 + "---:|" * 2 + "---|",
      *(row(c) for c in cells),
      "",
      fill(
        "`results.json` holds every cell with its losses and the reference's; "
        "`tests/experiments/test_equivalence_grid.py` checks the page against it."
      ),
      "",
    ]
  )


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default="experiments/results/equivalence_grid")
  parser.add_argument("--resume", action="store_true", help="keep the passing cells in --out")
  args = parser.parse_args(argv)

  # The suite's 8 devices and compile flags (set by tests/conftest.py before jax starts): the
  # tests' own programs.
  import tests.conftest  # noqa: F401
  from tests.core import test_equivalence as suite
  from tests.core import test_masked_equivalence as masked

  path, done = os.path.join(args.out, "results.json"), {}
  if args.resume and os.path.exists(path):
    with open(path) as f:
      done = {key(c): c for c in json.load(f)["cells"] if c["passes"]}
  setups, cells = {}, []
  for cell in GRID:
    cells.append(done.get(cell) or run_cell(setups, cell))
    print(row(cells[-1]), f"{cells[-1]['seconds']} s", flush=True)
  meta = {
    "command": f"python experiments/equivalence_grid.py --out {args.out}"
    + (" --resume" if args.resume else ""),
    "date": utc_now(),
    "commit": git_commit(),
    "machine": machine_line(),
    "steps": suite.STEPS,
    "packed_steps": masked.STEPS,
    "micro_batches": suite.A,
    "loss_rtol": suite.LOSS_RTOL,
    "param_atol": suite.PARAM_ATOL,
  }
  record = {"meta": meta, "cells": cells}
  write_page(args.out, record, "results.json", page(record), "README.md")


if __name__ == "__main__":
  main()
