"""`paro-jax plot`: loss (train and eval) and throughput curves of one or more runs, as a PNG."""

from __future__ import annotations

import math
import os

from paro_jax.run.metrics import read_rows


def read_metrics(run_dir: str) -> list[dict]:
  path = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.isfile(path):
    raise FileNotFoundError(
      f"{path} does not exist: give run directories written by `paro-jax train --out DIR`"
    )
  rows = read_rows(path)
  if not rows:
    raise ValueError(f"{path} has no rows yet")
  return rows


def _finite(value):
  """None (a gap) for null, NaN and Inf; older runs wrote NaN into metrics.jsonl."""
  return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def plot_runs(run_dirs: list[str], out: str) -> str:
  """Write one PNG: loss vs step (train solid, eval dashed) and tokens/s vs step, a colour a run."""
  try:
    import matplotlib  # optional: the [plots] extra
  except ImportError as e:
    raise ValueError('paro-jax plot needs matplotlib: pip install -e ".[plots]"') from e
  matplotlib.use("Agg")  # files only, no display
  import matplotlib.pyplot as plt

  runs = [(os.path.basename(os.path.normpath(d)) or d, read_metrics(d)) for d in run_dirs]
  fig, (ax_loss, ax_tput) = plt.subplots(1, 2, figsize=(12, 4.5))
  for i, (name, rows) in enumerate(runs):
    color = f"C{i % 10}"
    ax_loss.plot(
      [r["step"] for r in rows],
      [_finite(r["loss"]) for r in rows],  # a gap at a non-finite step...
      color=color,
      label=f"{name} train",
    )
    bad = [r["step"] for r in rows if _finite(r["loss"]) is None or r.get("skipped")]
    if bad:  # ... and a red cross on the axis, so a NaN run never looks healthy
      ax_loss.plot(
        bad,
        [0] * len(bad),
        "x",
        color="red",
        transform=ax_loss.get_xaxis_transform(),
        clip_on=False,
        label=f"{name}: {len(bad)} non-finite steps",
      )
    evals = [r for r in rows if "eval_loss" in r]
    if evals:
      ax_loss.plot(
        [r["step"] for r in evals],
        [_finite(r["eval_loss"]) for r in evals],
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
  # The file named: its suffix picks the format if matplotlib knows it, else PNG.
  suffix = os.path.splitext(out)[1][1:].lower()
  fmt = suffix if suffix in fig.canvas.get_supported_filetypes() else "png"
  fig.savefig(out, dpi=100, format=fmt)
  plt.close(fig)
  return out


def add_parser(sub) -> None:
  plot = sub.add_parser("plot", help="PNG of loss (train, eval) and throughput of runs")
  plot.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (--out of train)")
  plot.add_argument("--out", default="runs/plot.png", help="the PNG to write")


def main(args, inv) -> None:
  print(f"paro-jax: wrote {plot_runs(args.runs, args.out)}")
