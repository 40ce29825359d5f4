"""validate.md and validate.png: the planner validation's tables and its predicted-against-measured
plot."""

from __future__ import annotations

import math

from experiments.bench.cluster_model import Constants
from experiments.bench.judge import goal_met, pick_score, spearman_score


def markdown(
  bench: dict,
  c: Constants,
  results: list[dict],
  alt: list[dict] | None,
  command: str,
  again_meta: dict | None = None,
  margin: float = 0.15,
  noise: dict | None = None,
) -> str:
  meta = bench["meta"]
  intra = 1 / c.intra_s_per_byte / 1e9 if c.intra_s_per_byte else float("inf")
  lines = [
    f"# Planner against the strategy benchmark ({meta['nodes']}x{meta['devices_per_node']} "
    "emulated cluster)",
    "",
    f"`{command}`",
    "",
    f"Benchmark: `{meta['command']}` (model {meta['model']}, batch {meta['batch_size']}x"
    f"{meta['seq_len']}, {meta['dtype']}).",
    "",
    f"Constants ({c.source}): intra {intra:.3g} GB/s per "
    f"device, per collective "
    + ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in c.latency_s.items())
    + ", gloo "
    f"{c.gloo_s_per_byte * 1e9:.3g} s/GB per device on the inter link, compute x"
    f"{c.compute_scale:.2f} of the calibration.",
    "",
    "| regime | link | A | strategies | Spearman | pick | measured best | pick speed / best |",
    "|---|---|---:|---:|---:|---|---|---:|",
  ]
  for r in results:
    lines.append(
      f"| {r['regime']} | {r['rate']} | {r['micro_batches']} | {r['strategies']} | "
      f"{r['spearman']:.3f} | {r['pick']} | {r['measured_best']} | "
      f"{r['pick_speed_vs_best']:.3f} |"
    )
  if again_meta is not None:
    lines += [
      "",
      f"Re-measured (`{again_meta['command']}`: {again_meta['steps']} steps, median "
      f"of steps {again_meta['skip'] + 1}..{again_meta['steps']}): the contenders, every "
      f"strategy measured within {margin:.0%} of the best above plus the pick.",
      "",
      "| regime | A | contenders (re-measured s) | best | pick | pick speed / best |",
      "|---|---:|---|---|---|---:|",
    ]
    for r in results:
      rm = r["remeasured"]
      if not rm["covered"]:
        lines.append(
          f"| {r['regime']} | {r['micro_batches']} | not re-measured: "
          f"{', '.join(rm['missing'])} | - | {r['pick']} | - |"
        )
        continue
      times = ", ".join(
        f"{n} {rm['steps_s'][n]:.3f}" for n in sorted(rm["contenders"], key=rm["steps_s"].get)
      )
      lines.append(
        f"| {r['regime']} | {r['micro_batches']} | {times} | {rm['best']} | "
        f"{r['pick']} | {rm['pick_speed_vs_best']:.3f} |"
      )
    full = [r for r in results if r["remeasured"].get("all")]
    if full:
      lines += [
        "",
        "Every strategy re-measured: Spearman against the full run, the "
        "re-measurement(s) (geometric mean where several) and every run combined "
        "(geometric mean of the full run's and each re-measurement's step times; what the "
        "goal is judged on here).",
        "",
        "| regime | A | runs | full run | re-measured | combined | perfect predictor vs combined |",
        "|---|---:|---:|---:|---:|---:|---:|",
      ]
      lines += [
        f"| {r['regime']} | {r['micro_batches']} | {r['remeasured']['all']['runs']} | "
        f"{r['spearman']:.3f} | "
        f"{r['remeasured']['all']['spearman_again']:.3f} | "
        f"{r['remeasured']['all']['spearman_combined']:.3f} | "
        + (
          f"{r['spearman_noise_ceiling_combined']:.3f}"
          if "spearman_noise_ceiling_combined" in r
          else "-"
        )
        + " |"
        for r in full
      ]
    if noise:
      lines += [
        "",
        f"Run-to-run noise of one step time, from {noise['pairs']} pairs of a shaped "
        f"configuration's full run and its re-measurement: {noise['sigma']:.1%} (log-normal sigma; "
        f"the re-measurement ran {math.expm1(noise['mean_log_ratio']):+.1%} on average). "
        "A perfect predictor's Spearman correlation against one measurement that noisy "
        "(median of 2,000 draws): "
        + ", ".join(
          f"{r['regime']} A={r['micro_batches']} {r['spearman_noise_ceiling']:.3f}" for r in results
        )
        + ".",
      ]
  if again_meta is not None:
    lines += [
      "",
      "Judged (goal: Spearman >= 0.9 and the pick >= 0.95 of the best; every run "
      "combined where re-measured):",
      "",
      "| regime | A | Spearman | pick speed / best | goal |",
      "|---|---:|---:|---:|---|",
    ]
    lines += [
      f"| {r['regime']} | {r['micro_batches']} | {spearman_score(r):.3f} | "
      f"{pick_score(r):.3f} | "
      f"{'met' if goal_met(r) else 'NOT met'} |"
      for r in results
    ]
  if alt:
    lines += [
      "",
      "Without fitting (--no-fit constants):",
      "",
      "| regime | A | Spearman | pick | pick speed / best |",
      "|---|---:|---:|---|---:|",
    ]
    lines += [
      f"| {r['regime']} | {r['micro_batches']} | {r['spearman']:.3f} | {r['pick']} | "
      f"{r['pick_speed_vs_best']:.3f}"
      + (f" ({pick_score(r):.3f} re-measured)" if r.get("remeasured", {}).get("covered") else "")
      + " |"
      for r in alt
    ]
  for r in results:
    lines += [
      "",
      f"{r['regime']}, A={r['micro_batches']}:",
      "",
      "| strategy | predicted s | measured s | predicted rank | measured rank |",
      "|---|---:|---:|---:|---:|",
    ]
    for row in sorted(r["rows"], key=lambda x: x["measured_step_s"]):
      lines.append(
        f"| {row['strategy']} | {row['predicted_step_s']:.3f} | "
        f"{row['measured_step_s']:.3f} | {row['predicted_rank']:g} | "
        f"{row['measured_rank']:g} |"
      )
  return "\n".join(lines) + "\n"


def plot(results: list[dict], path: str) -> str | None:
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  if not results:
    return None
  # A grid: one column per regime, one row per A.
  regimes = list(dict.fromkeys(r["regime"] for r in results))
  a_values = sorted({r["micro_batches"] for r in results})
  fig, axes = plt.subplots(
    len(a_values), len(regimes), figsize=(4.2 * len(regimes), 4 * len(a_values)), squeeze=False
  )
  for ax in axes.flat:
    ax.set_visible(False)
  for r in results:
    ax = axes[a_values.index(r["micro_batches"])][regimes.index(r["regime"])]
    ax.set_visible(True)
    xs = [row["predicted_step_s"] for row in r["rows"]]
    ys = [row["measured_step_s"] for row in r["rows"]]
    ax.scatter(xs, ys, s=14)
    for row, x, y in zip(r["rows"], xs, ys):
      ax.annotate(row["strategy"], (x, y), fontsize=7, xytext=(2, 2), textcoords="offset points")
    lo, hi = min(xs + ys), max(xs + ys)
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_title(
      f"{r['regime']} ({r['rate']}), A={r['micro_batches']}: rho={r['spearman']:.2f}", fontsize=9
    )
    ax.set_xlabel("predicted step (s)")
    ax.set_ylabel("measured step (s)")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path
