"""Qwen2, Qwen3 and Mistral trained under both sharded strategies, exported, and scored again by
us and by transformers: the grid the in-suite test (tests/hf/test_families.py) samples one cell
a family of.

  python experiments/families_grid.py --hf-python /work/venv-hf/bin/python \\
      --out experiments/results/families_grid

For each family of tests/fixtures/hf_families (qwen2, qwen3, mistral) and each of IIG on 2x4 and
GGG on 4x2 (and Qwen2 again with LoRA adapters on its q/k/v projections, on both), on 8 virtual
CPU devices: 20 steps from the fixture on tests/fixtures/hf_llama/text.txt with the settings of
the test's journeys, `paro-jax export` in fp32 (and, with LoRA, `--adapter`), then `paro-jax
eval` of the run (on 2x4 under IIG) and of the exported directory over the same windows. With
--hf-python (a python with torch and transformers, and peft for the adapters), the script
experiments/families_grid_hf.py loads each export in transformers (fp32, eager attention) and
scores the same windows (cut from transformers' tokens of the text in the fixtures'
reference.json); each LoRA adapter is loaded with peft onto the fixture and its logits compared
with the merged export's. Writes OUT/results.json and OUT/README.md;
tests/experiments/test_families_grid.py checks what the page claims.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import subprocess
import sys
import tempfile
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from experiments.pages import machine_line, utc_now, write_page  # noqa: E402

FIXTURES = os.path.join(ROOT, "tests", "fixtures")
HF = os.path.join(FIXTURES, "hf_families")
TEXT = os.path.join(FIXTURES, "hf_llama", "text.txt")
HF_SCRIPT = os.path.join(ROOT, "experiments", "families_grid_hf.py")
# The settings of tests/hf/test_families.py's journeys (the page's test checks them against it).
SEQ, BATCH, STEPS = 16, 8, 20
TRAIN = {"optimizer.lr": 1e-3, "optimizer.warmup": 2}
LORA = {"lora.rank": 4, "lora.alpha": 8.0, "lora.targets": "wq,wk,wv", "optimizer.lr": 3e-2}
STRATEGIES = (("IIG", "2x4"), ("GGG", "4x2"))
FAMILIES = (("qwen2", False), ("qwen2", True), ("qwen3", False), ("mistral", False))
# The run is scored as the test scores it: on two nodes of 4 under IIG, whatever it trained on.
RUN_EVAL = ("--mesh", "2x4", "--strategy", "IIG")
PEFT_IDS = (2, 32)  # the test's peft check: the first 64 reference tokens as two rows of 32
COLUMNS = (
  "cell",
  "first loss",
  "last loss",
  "eval of the run",
  "eval of the export",
  "transformers",
  "peft max abs logit diff",
)


def cell_name(family: str, lora: bool, strategy: str, mesh: str) -> str:
  return f"{family}{'-lora' if lora else ''} {strategy} {mesh}"


def cells() -> list[dict]:
  return [
    {"cell": cell_name(f, lora, s, m), "family": f, "lora": lora, "strategy": s, "mesh": m}
    for f, lora in FAMILIES
    for s, m in STRATEGIES
  ]


def evaluate(source: str, *flags: str) -> dict:
  """`paro-jax eval SOURCE --json` in fp32 over text.txt's windows: its JSON line."""
  from paro_jax import cli

  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    cli.main(["eval", source, "--json", "--dtype", "fp32", "--data", TEXT, "--seq-len", str(SEQ),
              "--batch-size", str(BATCH), *flags])  # fmt: skip
  return json.loads(printed.getvalue().strip().splitlines()[-1])


def train_and_export(cell: dict, work: str) -> dict:
  """20 steps from the family's fixture, the fp32 export (and adapter), both scored."""
  from paro_jax import cli
  from paro_jax.core.config import make_config
  from paro_jax.run.config import RunConfig
  from paro_jax.run.train import train

  slug = cell["cell"].replace(" ", "_")
  run, exported = os.path.join(work, slug), os.path.join(work, f"{slug}-hf")
  changes = {
    "batch_size": BATCH,
    "seq_len": SEQ,
    "dtype": "fp32",
    "optimizer.steps": STEPS,
    **TRAIN,
    "out": run,
    "init_from": os.path.join(HF, cell["family"]),
    "data.paths": (TEXT,),
    "strategy": cell["strategy"],
    "mesh": tuple(int(n) for n in cell["mesh"].split("x")),
    **(LORA if cell["lora"] else {}),
  }
  with contextlib.redirect_stdout(sys.stderr):  # the run's own lines, kept off the page's stdout
    train(make_config(RunConfig, changes))
    cli.main(["export", run, "--out", exported, "--dtype", "fp32"])
    adapter = None
    if cell["lora"]:
      adapter = f"{run}-adapter"
      cli.main(["export", run, "--out", adapter, "--dtype", "fp32", "--adapter"])
  with open(os.path.join(run, "metrics.jsonl")) as f:
    losses = [json.loads(line)["loss"] for line in f if '"loss"' in line]
  ours, theirs = evaluate(run, *RUN_EVAL), evaluate(exported)
  with open(os.path.join(exported, "config.json")) as f:
    architectures = json.load(f)["architectures"]
  return {
    **cell,
    "train_losses": losses,
    "first_loss": losses[0],
    "last_loss": losses[-1],
    "run_eval": ours["loss"],
    "export_eval": theirs["loss"],
    "eval_windows": ours["windows"],
    "export_eval_windows": theirs["windows"],
    "export_architectures": architectures,
    "export": exported,
    "adapter": adapter,
  }


def reference_windows(family: str):
  """transformers' tokens of text.txt (the fixtures' reference.json) cut into windows of SEQ+1."""
  import numpy as np

  with open(os.path.join(HF, "reference.json")) as f:
    ids = json.load(f)[family]["token_ids"]
  n = len(ids) // (SEQ + 1)
  return np.asarray(ids[: n * (SEQ + 1)], np.int32).reshape(n, SEQ + 1), np.asarray(
    ids[: PEFT_IDS[0] * PEFT_IDS[1]], np.int32
  ).reshape(PEFT_IDS)


def transformers_scores(rows: list[dict], hf_python: str, work: str) -> dict:
  """experiments/families_grid_hf.py's record of every exported directory (run by hf_python)."""
  import numpy as np

  jobs = []
  for row in rows:
    windows, ids = reference_windows(row["family"])
    np.save(windows_path := os.path.join(work, f"{row['family']}-windows.npy"), windows)
    np.save(ids_path := os.path.join(work, f"{row['family']}-ids.npy"), ids)
    job = {"cell": row["cell"], "export": row["export"], "windows": windows_path}
    if row["adapter"]:
      job.update(base=os.path.join(HF, row["family"]), adapter=row["adapter"], ids=ids_path)
    jobs.append(job)
  with open(jobs_path := os.path.join(work, "hf_jobs.json"), "w") as f:
    json.dump(jobs, f)
  out = os.path.join(work, "hf_scores.json")
  subprocess.run([hf_python, HF_SCRIPT, jobs_path, out], check=True, env=_without_pythonpath())
  with open(out) as f:
    return json.load(f)


def _without_pythonpath() -> dict:
  """The environment for the other python: this tree's PYTHONPATH is not for its packages."""
  return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _figure(x, fmt: str) -> str:
  return "—" if x is None else format(x, fmt)


def table(rows: list[dict]) -> str:
  lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
  for r in rows:
    figures = [r["first_loss"], r["last_loss"], r["run_eval"], r["export_eval"]]
    lines.append(
      f"| {r['cell']} | "
      + " | ".join(format(x, ".7f") for x in figures)
      + f" | {_figure(r['transformers_loss'], '.7f')}"
      + f" | {_figure(r['peft_max_abs_logit_diff'], '.2e')} |"
    )
  return "\n".join(lines)


def strategies_apart(rows: list[dict]) -> float:
  """The largest relative difference between two strategies' losses at a step, of one model."""
  by_model = {}
  for r in rows:
    by_model.setdefault((r["family"], r["lora"]), []).append(r["train_losses"])
  return max(abs(a / b - 1) for runs in by_model.values() for a, b in zip(*runs[:2], strict=True))


def summary(rows: list[dict]) -> str:
  """The page's claims, with the worst figure of each (tests/experiments/test_families_grid.py
  holds them to the test's tolerances)."""
  worst = max(abs(r["export_eval"] / r["run_eval"] - 1) for r in rows)
  said = [
    f"IIG on 2x4 and GGG on 4x2 give the same loss at every step within "
    f"{strategies_apart(rows):.1e} relative (allowed 1e-5)",
    f"the export scores as the run within {worst:.1e} relative (allowed 1e-6)",
  ]
  if hf := [
    abs(r["transformers_loss"] / r["export_eval"] - 1) for r in rows if r["transformers_loss"]
  ]:
    said.append(
      f"transformers scores it within {max(hf):.1e} (allowed 1e-5), as its family's class"
    )
  if peft := [
    r["peft_max_abs_logit_diff"] for r in rows if r["peft_max_abs_logit_diff"] is not None
  ]:
    said.append(f"peft's logits equal the merged export's within {max(peft):.1e} (allowed 1e-5)")
  return "Every cell trained (last loss below the first); " + "; ".join(said) + "."


def page(record: dict) -> str:
  meta, rows = record["meta"], record["cells"]
  versions = meta["transformers_versions"]
  if versions:
    peft = f", peft {versions['peft']}" if versions.get("peft") else ""
    hf_line = (
      f"transformers {versions['transformers']}, torch {versions['torch']}{peft} "
      f"(`{meta['hf_python']}`)"
    )
  else:
    hf_line = "not run (no --hf-python): the transformers and peft columns are empty"
  prose = [
    f"{meta['date']}, commit `{meta['commit']}`; {meta['machine']}; 8 virtual CPU devices. "
    f"transformers' side: {hf_line}.",
    f"Each cell: {STEPS} steps from the family's tiny random fixture "
    f"(`tests/fixtures/hf_families/`, written by transformers) on "
    f"`tests/fixtures/hf_llama/text.txt`, {BATCH} windows of {SEQ} tokens a step, fp32, "
    f"lr {TRAIN['optimizer.lr']:g} (LoRA: rank {LORA['lora.rank']}, alpha "
    f"{LORA['lora.alpha']:g} on `{LORA['lora.targets']}`, lr {LORA['optimizer.lr']:g}), warmup "
    f"{TRAIN['optimizer.warmup']}: the settings of `tests/hf/test_families.py`'s journeys, which "
    f"train one cell a family. First and last loss are the training losses of steps 1 and "
    f'{STEPS}; "eval of the run" is `paro-jax eval` of the run\'s checkpoint on 2x4 under IIG, '
    f'"eval of the export" of its `paro-jax export --dtype fp32` directory, both over the '
    f'{rows[0]["eval_windows"]} windows of {SEQ + 1} tokens of the text; "transformers" is '
    f"transformers' mean cross-entropy of the exported directory over the same windows (eager "
    f'attention, fp32); "peft max abs logit diff" is the largest absolute difference between the '
    f"logits of peft's `PeftModel` (the fixture with the run's `export --adapter` directory) and "
    f"the merged export's, on two rows of 32 tokens.",
  ]
  closing = [
    summary(rows),
    "`results.json` holds every figure above, with each step's training loss; "
    "`tests/experiments/test_families_grid.py` checks the page against it.",
  ]
  fill = functools.partial(textwrap.fill, width=100, break_on_hyphens=False)
  blocks = [
    "# Qwen2, Qwen3 and Mistral under IIG 2x4 and GGG 4x2: trained, exported, scored again",
    f"    {meta['command']}",
    *map(fill, prose),
    table(rows),
    *map(fill, closing),
  ]
  return "\n\n".join(blocks) + "\n"


def git_commit() -> str:
  head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True)
  return head.stdout.decode().strip() or "unknown"


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default="experiments/results/families_grid")
  parser.add_argument("--hf-python", help="a python with torch and transformers (and peft)")
  parser.add_argument("--work", help="where the runs and exports go (default: a temporary folder)")
  args = parser.parse_args(argv)

  from paro_jax.core.xla_flags import add_xla_flags  # imports no jax

  add_xla_flags(("--xla_force_host_platform_device_count=8",))
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax

  jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="families-grid-jit-"))
  work = args.work or tempfile.mkdtemp(prefix="families-grid-")
  rows = []
  for cell in cells():
    rows.append(train_and_export(cell, work))
    r = rows[-1]
    print(f"families_grid: {r['cell']}: loss {r['first_loss']:.6f} -> {r['last_loss']:.6f}, "
          f"eval {r['run_eval']:.7f}, export {r['export_eval']:.7f}", flush=True)  # fmt: skip
  scores = transformers_scores(rows, args.hf_python, work) if args.hf_python else {"cells": {}}
  versions = {k: v for k, v in scores.items() if k != "cells"}
  for r in rows:
    hf = scores["cells"].get(r["cell"], {})
    r["transformers_loss"] = hf.get("loss")
    r["transformers_windows"] = hf.get("windows")
    r["transformers_class"] = hf.get("class")
    r["peft_max_abs_logit_diff"] = hf.get("peft_max_abs_logit_diff")
    r["peft_moved_from_base"] = hf.get("peft_moved_from_base")
    if hf.get("peft"):
      versions["peft"] = hf["peft"]
    del r["export"], r["adapter"]  # temporary paths
  command = (
    "python experiments/families_grid.py"
    + (f" --hf-python {args.hf_python}" if args.hf_python else "")
    + f" --out {args.out}"
  )
  meta = {
    "command": command,
    "date": utc_now(),
    "commit": git_commit(),
    "machine": machine_line(),
    "hf_python": args.hf_python,
    "transformers_versions": versions if args.hf_python else None,
    "settings": {
      "seq_len": SEQ,
      "batch_size": BATCH,
      "steps": STEPS,
      "train": TRAIN,
      "lora": LORA,
      "run_eval": list(RUN_EVAL),
    },
  }
  record = {"meta": meta, "cells": rows}
  write_page(args.out, record, "results.json", page(record), "README.md")
  print(table(rows))


if __name__ == "__main__":
  main()
