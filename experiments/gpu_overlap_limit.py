"""XLA's limit on collectives in flight at once against HO-Ring's overlap: GGG on HO-Ring compiled
for H100 (no GPU needed) with `xla_gpu_experimental_parallel_collective_overlap_limit` at 1, 2
and 4 (the project's, core/xla_flags.py GPU_FLAGS), by tests/analysis/test_gpu_program.py's own
gpu_report, which compiles the limit of 1 on 2x4 only.

  python experiments/gpu_overlap_limit.py --out experiments/results/gpu_overlap_limit

Two configurations: the `test` model on 2 nodes x 4 GPUs (the test's), and `tiny` with 128
tokens a sequence on 4 nodes x 8, where the chains of several collectives run side by side. Each
records the share of per-micro-batch collective bytes with compute in their window and the HO-Ring
steps with both levels in flight. Writes OUT/results.json and OUT/README.md;
tests/experiments/test_gpu_program_pages.py checks the page.
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
FLAG = "xla_gpu_experimental_parallel_collective_overlap_limit"
# (model, tokens a sequence, mesh)
CONFIGS = (("test", 32, (2, 4)), ("tiny", 128, (4, 8)))
FIELDS = ("collective_bytes_fraction", "horing_steps", "horing_steps_concurrent")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default="experiments/results/gpu_overlap_limit")
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
  meta = {
    "command": f"python experiments/gpu_overlap_limit.py --out {args.out}",
    "date": utc_now(),
    "commit": git_commit(),
    "machine": machine_line(),
    "strategy": "GGG",
    "collectives": "horing",
    "micro_batches": suite.A,
    "default_limit": GPU_FLAGS[FLAG],
  }
  record = {"meta": meta, "rows": rows}
  write_page(args.out, record, "results.json", page(record), "README.md")


def page(record: dict) -> str:
  meta = record["meta"]
  lines = [
    "# XLA's overlap limit against HO-Ring's overlap (GGG, compiled for H100)",
    "",
    f"    {meta['command']}",
    "",
    f"{meta['date']}, commit `{meta['commit']}`; {meta['machine']}; compiled without a GPU,",
    f"nothing ran. GGG on HO-Ring, A={meta['micro_batches']}, one sequence per GPU; the project's",
    f"limit is {meta['default_limit']}. `tests/experiments/test_gpu_program_pages.py` checks it.",
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
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  main()
