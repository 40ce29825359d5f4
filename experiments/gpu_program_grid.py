"""The structural checks of tests/analysis/test_gpu_program.py on the cells it compiles only in
part, compiled for H100 (no GPU needed) by that module's own gpu_report:

- XLA's limit on collectives in flight at once against HO-Ring's overlap: GGG on HO-Ring with
  `xla_gpu_experimental_parallel_collective_overlap_limit` at 1, 2 and 4 (the project's,
  core/xla_flags.py GPU_FLAGS), on the `test` model on 2 nodes x 4 GPUs and on `tiny` with 128
  tokens a sequence on 4 nodes x 8, where the chains of several collectives run side by side: the
  share of per-micro-batch collective bytes with compute in their window and the HO-Ring steps
  with both levels in flight (the test compiles the limit of 1 on 2x4);
- the layers fetched ahead (`tiny`, 2x4): GGG, IGG and IIG on XLA's collectives, GGG and IGG on
  HO-Ring, by the test's fetch_ahead_figures (the test compiles GGG on both).

  python experiments/gpu_program_grid.py --out experiments/results/gpu_program_grid

Writes OUT/results.json and OUT/README.md; tests/experiments/test_gpu_program_pages.py checks
the page with the test's own assertions.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from experiments.families_grid import git_commit  # noqa: E402
from experiments.pages import machine_line, utc_now, write_page  # noqa: E402

LIMITS = (1, 2, 4)
SCOPES = ("layer_gather", "layer_regather", "layer_grad_scatter")  # the test's, in its order
FLAG = "xla_gpu_experimental_parallel_collective_overlap_limit"
# (model, tokens a sequence, mesh)
CONFIGS = (("test", 32, (2, 4)), ("tiny", 128, (4, 8)))
FIELDS = ("collective_bytes_fraction", "horing_steps", "horing_steps_concurrent")
FETCH_AHEAD = [(s, "xla") for s in ("GGG", "IGG", "IIG")] + [(s, "horing") for s in ("GGG", "IGG")]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default="experiments/results/gpu_program_grid")
  args = parser.parse_args(argv)
  import tests.conftest  # noqa: F401  (the suite's flags, set before jax starts)
  from paro_jax.core.xla_flags import GPU_FLAGS
  from tests.analysis import test_gpu_program as suite

  rows = []
  for model, seq, mesh in CONFIGS:
    for limit in LIMITS:
      flags = {**GPU_FLAGS, FLAG: limit}
      overlap = suite.gpu_report("GGG", "horing", flags, model=model, seq=seq, mesh=mesh)["overlap"]
      rows.append(
        {"model": model, "seq_len": seq, "mesh": f"{mesh[0]}x{mesh[1]}", "limit": limit}
        | {k: overlap[k] for k in FIELDS}
      )
      print(rows[-1], flush=True)
  fetch = []
  for strategy, impl in FETCH_AHEAD:
    fetch.append({"strategy": strategy, "impl": impl} | suite.fetch_ahead_figures(strategy, impl))
    print(fetch[-1], flush=True)
  meta = {
    "command": f"python experiments/gpu_program_grid.py --out {args.out}",
    "date": utc_now(),
    "commit": git_commit(),
    "machine": machine_line(),
    "strategy": "GGG",
    "collectives": "horing",
    "micro_batches": suite.A,
    "default_limit": GPU_FLAGS[FLAG],
  }
  record = {"meta": meta, "rows": rows, "fetch_ahead": fetch}
  write_page(args.out, record, "results.json", page(record), "README.md")


def page(record: dict) -> str:
  meta = record["meta"]
  lines = [
    "# The GPU program's structure on the test's whole grid (compiled for H100)",
    "",
    f"    {meta['command']}",
    "",
    f"{meta['date']}, commit `{meta['commit']}`; {meta['machine']}; compiled without a GPU,",
    f"nothing ran. GGG on HO-Ring, A={meta['micro_batches']}, one sequence per GPU; the project's",
    f"limit is {meta['default_limit']}. `tests/experiments/test_gpu_program_pages.py` checks it.",
    "",
    "## XLA's overlap limit against HO-Ring's overlap",
    "",
    "| model | tokens | mesh | limit | bytes with compute inside | HO-Ring steps concurrent |",
    "|---|---:|---|---:|---:|---:|",
  ]
  for r in record["rows"]:
    lines.append(
      f"| {r['model']} | {r['seq_len']} | {r['mesh']} | {r['limit']} | "
      + ("-" if r["collective_bytes_fraction"] is None else f"{r['collective_bytes_fraction']:.1%}")
      + " | "
      + f"{r['horing_steps_concurrent']} / {r['horing_steps']} |"
    )
  lines += [
    "",
    "## The layers fetched ahead",
    "",
    "`tiny` (4 layers), 128 tokens, 2x4, A=1: per layer loop, the collectives issued inside its",
    "body, asynchronous / with compute in their window / issued.",
    "",
    "| strategy | collectives | " + " | ".join(SCOPES) + " | permutes among the gathers |",
    "|---|---|" + "---:|" * (len(SCOPES) + 1),
  ]
  for f in record["fetch_ahead"]:
    cells = [f"{f[s]['async']} / {f[s]['with_compute']} / {f[s]['issued']}" for s in SCOPES]
    lines.append(
      f"| {f['strategy']} | {f['impl']} | " + " | ".join(cells) + f" | {f['permutes_in_gather']} |"
    )
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  main()
