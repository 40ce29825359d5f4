"""The benchmark's report: comparisons added to the rows, the summary, strategies.md and the plot.

Every configuration label (experiments/bench/configs.py) is its own configuration: `GGG` and
`GGG/horing` are compared, ranked and plotted separately. "vs REFERENCE" is a row's throughput
over the reference configuration's (--reference, default GGG) in the same regime and A; its
keys are `throughput_vs_<reference, lower case>` in a row and `vs_<reference>` in the summary
(`throughput_vs_ggg` and `vs_GGG` by default, as before labels existed). Imports no jax.
"""

from __future__ import annotations

from experiments.bench.calibration import UNSHAPED
from experiments.bench.configs import (
  DEFAULT_REFERENCE,
  DEVICES_PER_NODE,
  NODES,
  kind_of,
  label_of,
)

KNOWN_AS = {"GGG": "ZeRO-3", "NGG": "ZeRO-2"}


def row_key(reference: str = DEFAULT_REFERENCE) -> str:
  """A row's key for its throughput relative to the reference configuration."""
  return f"throughput_vs_{reference.lower()}"


def summary_key(reference: str = DEFAULT_REFERENCE) -> str:
  """The summary's key for the fastest strategy's throughput over the reference's."""
  return f"vs_{reference}"


def _known(label: str) -> str:
  return f" ({KNOWN_AS[label]})" if label in KNOWN_AS else ""


def _impl(row: dict) -> str:
  """The collectives a row ran with: its implementation, torch's gloo, or XLA's partitioner."""
  kind = kind_of(row)
  if kind == "torch":
    return "torch gloo"
  return row.get("collectives") or ("xla" if kind == "paro" or kind == "jit" else "-")


def _mib(x):
  return None if x is None else x / 2**20


def _fmt(x, spec):
  return "-" if x is None else format(x, spec)


def summarize(rows: list[dict], hlo: dict, reference: str = DEFAULT_REFERENCE) -> list[dict]:
  """Add to each row: overhead (vs the same label on the unshaped link), throughput relative to
  the reference configuration, HLO/formula bytes and memory (hlo.json's "LABEL/A")."""
  ok = {(r["regime"], label_of(r), r["micro_batches"]): r for r in rows if not r.get("error")}
  key = row_key(reference)
  for r in ok.values():
    for stale in [k for k in r if k.startswith("throughput_vs_") and k != key]:
      del r[stale]  # relative to another reference (a report rewritten with --reference)
    label = label_of(r)
    ref = ok.get((UNSHAPED, label, r["micro_batches"]))
    r["comm_overhead"] = r["median_step_s"] / ref["median_step_s"] if ref else None
    # the seconds a step waits for the link: fairer than the ratio between sides whose compute
    # differs in speed (the same exposed seconds are a larger ratio of a faster step)
    r["comm_exposed_s"] = r["median_step_s"] - ref["median_step_s"] if ref else None
    g = ok.get((r["regime"], reference, r["micro_batches"]))
    r[key] = r["tokens_per_s"] / g["tokens_per_s"] if g else None
    h = hlo.get(f"{label}/{r['micro_batches']}", {})
    r["hlo_inter_bytes_per_device"] = h.get("measured", {}).get("inter_bytes")
    r["formula_inter_bytes_per_device"] = (h.get("expected") or {}).get("inter_bytes")
    r["model_states_bytes_per_device"] = h.get("model_states_bytes", r.get("model_states_bytes"))
    r["compiled_peak_bytes_per_device"] = h.get("peak_bytes")
    w = r.get("wire_per_step")
    r["wire_bytes_per_step"] = w["total"] if w else None
  return rows


def markdown(
  rows: list[dict],
  regimes: list[dict],
  calib: dict,
  meta: dict,
  reference: str = DEFAULT_REFERENCE,
) -> str:
  lines = [
    f"# PaRO strategies on an emulated {NODES}x{DEVICES_PER_NODE} cluster",
    "",
    f"`{meta['command']}`",
    "",
    f"Machine: {meta['machine']}; model {meta['model']}, batch {meta['batch_size']}x"
    f"{meta['seq_len']} per micro-batch, {meta['dtype']}, remat {meta.get('remat', 'full')}"
    + (
      " (the torch peers checkpoint every decoder layer)"
      if meta.get("torch_peers") and meta.get("remat", "full") == "full"
      else ""
    )
    + f", {meta['steps']} steps "
    f"(median of steps {meta['skip'] + 1}..{meta['steps']})"
    + (
      f"; LoRA mode: rank {meta['lora']['rank']} on {meta['lora']['targets']}, the base frozen"
      if meta.get("lora")
      else ""
    )
    + (
      f"; inter-node wire: params {w['params']}, grads {w['grads']} (int8 block {w['int8_block']})"
      if (w := meta.get("inter_wire")) and {w["params"], w["grads"]} != {"same"}
      else ""
    )
    + (
      f"; collectives {meta['collectives']}, labels NAME/IMPL: the strategy with collectives IMPL"
      if meta.get("collectives_for")
      else ""
    )
    + ".",
    "",
    f"Calibration: one virtual device alone "
    f"{calib['single_device']['flop_per_s'] / 1e9:.2f} GFLOP/s; with all "
    f"{NODES * DEVICES_PER_NODE} busy at once "
    f"{calib['effective_flop_per_s_per_device'] / 1e9:.2f} GFLOP/s each (used below).",
    "",
    "| regime | FLOP per inter-node byte | emulated link | stands for |",
    "|---|---:|---:|---|",
  ]
  for g in regimes:
    fpb = "-" if g["flop_per_byte"] is None else f"{g['flop_per_byte']:,.0f}"
    lines.append(f"| {g['regime']} | {fpb} | {g['rate']} | {g['what']} |")
  lines += ["", "Summary (shaped links):", "", *summary_markdown(rows, reference)]
  lines += [
    "",
    "Per run: median step time, tokens/s, communication overhead (step time / the "
    f"same run's on the unshaped link), throughput relative to {reference} in the same regime "
    "and A, inter-node MiB per optimizer step on the wire (tc, both nodes' egress "
    "summed) beside the compiled HLO's and the formula's inter-node MiB per device "
    "(x4 devices = one node's share if every inter-level byte crossed the link), "
    "model states per device.",
    "",
    f"| regime | strategy | collectives | A | step (s) | tokens/s | overhead | vs {reference} "
    "| wire MiB/step | HLO inter MiB/dev | formula inter MiB/dev | model states MiB/dev "
    "| wall (s) |",
    "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    if r.get("error"):
      lines.append(
        f"| {r['regime']} | {label_of(r)} | {_impl(r)} | {r['micro_batches']} | failed: "
        f"{r['error']} |||||||||"
      )
      continue
    lines.append(
      f"| {r['regime']} | {label_of(r)} | {_impl(r)} | {r['micro_batches']} | "
      f"{r['median_step_s']:.3f} | "
      f"{r['tokens_per_s']:.0f} | {_fmt(r['comm_overhead'], '.2f')} | "
      f"{_fmt(r[row_key(reference)], '.2f')} | {_fmt(_mib(r['wire_bytes_per_step']), '.2f')} | "
      f"{_fmt(_mib(r['hlo_inter_bytes_per_device']), '.2f')} | "
      f"{_fmt(_mib(r['formula_inter_bytes_per_device']), '.2f')} | "
      f"{_fmt(_mib(r['model_states_bytes_per_device']), '.2f')} | {r['wall_s']:.0f} |"
    )
  return "\n".join(lines) + "\n"


def summary(rows: list[dict], reference: str = DEFAULT_REFERENCE) -> list[dict]:
  """Per (shaped regime, A): the fastest PaRO configuration against the reference, ZeRO-2 and
  plain-jit partitioning, and the order of the PaRO configurations (labels)."""
  good = [r for r in rows if not r.get("error") and r["regime"] != UNSHAPED]
  out = []
  for regime in dict.fromkeys(r["regime"] for r in good):
    for a in sorted({r["micro_batches"] for r in good if r["regime"] == regime}):
      here = {label_of(r): r for r in good if r["regime"] == regime and r["micro_batches"] == a}
      ours = {n: r for n, r in here.items() if kind_of(r) == "paro"}
      if not ours:
        continue
      best = max(ours.values(), key=lambda r: r["tokens_per_s"])
      speed = lambda name: here[name]["tokens_per_s"] if name in here else None
      ratio = lambda name: (best["tokens_per_s"] / speed(name)) if speed(name) else None
      jit = [n for n, r in here.items() if kind_of(r) == "jit"]
      best_jit = max(jit, key=speed) if jit else None
      peers = [n for n, r in here.items() if kind_of(r) == "torch"]
      best_torch = max(peers, key=speed) if peers else None
      least = lambda names, key: min(
        (o for n in names if (o := here[n].get(key)) is not None), default=None
      )
      overhead = lambda names: least(names, "comm_overhead")
      out.append(
        {
          "regime": regime,
          "micro_batches": a,
          "best": label_of(best),
          "best_tokens_per_s": best["tokens_per_s"],
          summary_key(reference): ratio(reference),
          "vs_NGG": ratio("NGG"),
          "best_jit": best_jit,
          "vs_best_jit": ratio(best_jit) if best_jit else None,
          "best_torch": best_torch,
          "vs_best_torch": ratio(best_torch) if best_torch else None,
          # the least communication overhead (step / unshaped step) of each side
          "min_overhead": overhead(ours),
          "min_overhead_torch": overhead(peers) if peers else None,
          "min_exposed_s": least(ours, "comm_exposed_s"),
          "min_exposed_s_torch": least(peers, "comm_exposed_s") if peers else None,
          "ranking": sorted(ours, key=lambda n: -ours[n]["tokens_per_s"]),
        }
      )
  return out


def _times(x) -> str:
  return "-" if x is None else f"{x:.2f}x"


def summary_markdown(rows: list[dict], reference: str = DEFAULT_REFERENCE) -> list[str]:
  xs = summary(rows, reference)
  torch = any(x.get("best_torch") for x in xs)
  lines = [
    f"| regime | A | fastest strategy | tokens/s | vs {reference}{_known(reference)} | vs NGG "
    "(ZeRO-2) | vs best plain jit | "
    + (
      "vs best torch | least overhead: ours / torch | least exposed comm. (s): ours / torch | "
      if torch
      else ""
    )
    + "order (fastest first) |",
    "|---|---:|---|---:|---:|---:|---:|" + ("---:|---:|---:|" if torch else "") + "---|",
  ]
  for x in xs:
    jit = "-" if x["best_jit"] is None else f"{x['vs_best_jit']:.2f}x ({x['best_jit']})"
    peer = ""
    if torch:
      peer = "- | - | - | "
      if x.get("best_torch"):
        peer = (
          f"{_times(x['vs_best_torch'])} ({x['best_torch']}) | "
          f"{_fmt(x['min_overhead'], '.2f')} / {_fmt(x['min_overhead_torch'], '.2f')} | "
          f"{_fmt(x.get('min_exposed_s'), '.1f')} / {_fmt(x.get('min_exposed_s_torch'), '.1f')} | "
        )
    lines.append(
      f"| {x['regime']} | {x['micro_batches']} | {x['best']} | "
      f"{x['best_tokens_per_s']:.0f} | {_times(x[summary_key(reference)])} | "
      f"{_times(x['vs_NGG'])} | {jit} | {peer}{' '.join(x['ranking'])} |"
    )
  return lines


def plot(rows: list[dict], path: str, reference: str = DEFAULT_REFERENCE) -> str | None:
  """Throughput relative to the reference, one panel per A, a group of bars per label."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  key = row_key(reference)
  good = [r for r in rows if not r.get("error") and r.get(key) is not None]
  if not good:
    return None
  regimes = list(dict.fromkeys(r["regime"] for r in good))
  a_values = sorted({r["micro_batches"] for r in good})
  names = list(dict.fromkeys(label_of(r) for r in good))
  # One row per A, one group of bars per configuration, one bar per regime.
  fig, axes = plt.subplots(
    len(a_values),
    1,
    figsize=(max(6, 0.25 * len(names) * len(regimes)), 3.6 * len(a_values)),
    squeeze=False,
  )
  width = 0.8 / len(regimes)
  for ax, a in zip(axes[:, 0], a_values):
    for i, reg in enumerate(regimes):
      ys = [
        next(
          (
            r[key]
            for r in good
            if r["regime"] == reg and label_of(r) == n and r["micro_batches"] == a
          ),
          0.0,
        )
        for n in names
      ]
      ax.bar([j + i * width for j in range(len(names))], ys, width, label=reg)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + width * (len(regimes) - 1) / 2 for j in range(len(names))])
    ax.set_xticklabels(names, rotation=60, fontsize=8)
    ax.set_title(f"A={a}")
    ax.set_ylabel(f"throughput / {reference}")
  axes[0][0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)  # one plot per finished run: do not keep them all open
  return path
