"""`paro-jax plot`: loss (train and eval) and throughput curves of one or more runs, as a PNG."""

from __future__ import annotations

import json
import os


def read_metrics(run_dir: str) -> list[dict]:
  path = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.isfile(path):
    raise FileNotFoundError(
      f"{path} does not exist: give run directories written by `paro-jax train --out DIR`"
    )
  with open(path) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  if not rows:
    raise ValueError(f"{path} has no rows yet")
  return rows


def plot_runs(run_dirs: list[str], out: str) -> str:
  """Write one PNG: loss vs step (train solid, eval dashed) and tokens/s vs step, a colour a run."""
  try:
    import matplotlib
  except ImportError as e:
    raise ValueError('paro-jax plot needs matplotlib: pip install -e ".[plots]"') from e
  matplotlib.use("Agg")  # files only, no display
  import matplotlib.pyplot as plt

  runs = [(os.path.basename(os.path.normpath(d)) or d, read_metrics(d)) for d in run_dirs]
  fig, (ax_loss, ax_tput) = plt.subplots(1, 2, figsize=(12, 4.5))
  for i, (name, rows) in enumerate(runs):
    color = f"C{i % 10}"
    ax_loss.plot(
      [r["step"] for r in rows], [r["loss"] for r in rows], color=color, label=f"{name} train"
    )
    evals = [r for r in rows if "eval_loss" in r]
    if evals:
      ax_loss.plot(
        [r["step"] for r in evals],
        [r["eval_loss"] for r in evals],
        "o--",
        color=color,
        markersize=3,
        label=f"{name} eval",
      )
    # A process's first step includes compilation: leave it out of the throughput.
    timed = rows[1:] if len(rows) > 1 else rows
    ax_tput.plot(
      [r["step"] for r in timed], [r["tokens_per_s"] for r in timed], color=color, label=name
    )
  ax_loss.set(xlabel="step", ylabel="loss", title="loss")
  ax_tput.set(xlabel="step", ylabel="tokens/s", title="throughput")
  for ax in (ax_loss, ax_tput):
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig.savefig(out, dpi=100)
  plt.close(fig)
  return out
