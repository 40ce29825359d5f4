"""How long the full benchmark would take: the grid of --estimate-model, from this run's
measurements (printed at the end of a run, kept as strategies.json's "full_run_estimate")."""

from __future__ import annotations

import statistics

from experiments.bench.calibration import UNSHAPED, regimes_table
from experiments.bench.configs import (
  BASELINES,
  DEVICES_PER_NODE,
  NODES,
  WIRE_ITEMSIZE,
  label_of,
)


def estimate(
  args, rows: list[dict], calib: dict, calib_target: dict | None, inspect_wall: float, hlo: dict
) -> dict:
  """Wall time of the full grid (--estimate-model, 14 strategies + baselines, A in 1,4,8, every
  named regime + 1gbit + unshaped), from this run's measurements. A rough model:

    run wall = fixed x compile_scale + steps x step
    step     = A x compute + bytes per device (inter + intra) / bw_unshaped
               + one node's inter-node bytes / link rate          (no overlap)

  fixed: this run's median (wall - time of steps 2..K): launcher, jax.distributed, compile,
  teardown; compile_scale: ratio of the two models' single-device compile times; compute: the
  target model's calibrated forward+backward per micro-batch with 8 devices busy; bw_unshaped:
  fitted on this run's unshaped runs (their step minus compute, over their HLO bytes per device);
  bytes: the formula (paro_jax.analysis.planner.costs) for strategies; for baselines this run's
  HLO figure scaled by the parameter ratio (or, absent, the formula of GGG / III). hours_inspect:
  the compiles of its 16 configurations x 3 A, at this run's time per compile x compile_scale.
  """
  from paro_jax.analysis.planner.costs import step_traffic
  from paro_jax.core.strategy import VALID_NAMES, parse_strategy
  from models.llama import Llama
  from models.presets import get_config

  good = [r for r in rows if not r.get("error")]
  ref = [r for r in good if r["regime"] == UNSHAPED]
  if not ref or calib_target is None:
    return {}
  fixed = statistics.median(r["wall_s"] - sum(r["step_times_s"][1:]) for r in good)
  per_call = calib["concurrent"]["seconds"]
  fits = []
  for r in ref:
    h = hlo.get(f"{label_of(r)}/{r['micro_batches']}")
    extra = r["median_step_s"] - per_call * r["micro_batches"]
    nbytes = h and h["measured"]["inter_bytes"] + h["measured"]["intra_bytes"]
    if nbytes and extra > 0:
      fits.append(nbytes / extra)
  bw = statistics.median(fits) if fits else float("inf")
  compile_scale = (
    calib_target["single_device"]["compile_and_first_s"]
    / calib["single_device"]["compile_and_first_s"]
  )
  tcfg = get_config(args.estimate_model)
  model = Llama(tcfg)
  psi, psi_here = tcfg.param_count(), calib["params"]
  itemsize = 4 if args.dtype == "fp32" else 2
  # Link rates for the target model's own calibration (rates scale with its FLOP/s).
  regs = regimes_table(
    ["infiniband", "paper_cloud", "commodity", "1gbit"],
    calib_target["effective_flop_per_s_per_device"],
    WIRE_ITEMSIZE,
  )
  names = list(VALID_NAMES) + list(BASELINES)
  steps = args.estimate_steps
  per_step = {}
  for name in names:
    for a in (1, 4, 8):
      h = hlo.get(f"{name}/{a}")
      if name in BASELINES and h:
        inter = h["measured"]["inter_bytes"] * psi / psi_here
        intra = h["measured"]["intra_bytes"] * psi / psi_here
      else:
        strat = parse_strategy({"jit-fsdp": "GGG", "jit-hsdp": "III"}.get(name, name))
        t = step_traffic(
          strat,
          psi,
          psi,
          NODES,
          DEVICES_PER_NODE,
          a,
          itemsize,
          itemsize,
          regathered=model.stack_param_count(),
        )
        inter, intra = t.inter, t.intra
      per_step[(name, a)] = (
        calib_target["concurrent"]["seconds"] * a + (inter + intra) / bw,
        inter * DEVICES_PER_NODE,
      )
  total, detail = 0.0, {}
  for g in regs:
    sub = sum(
      fixed * compile_scale + steps * (base + node_bytes / (g["rate_bps"] / 8))
      for base, node_bytes in per_step.values()
    )
    detail[g["regime"]] = {"rate": g["rate"], "hours": sub / 3600}
    total += sub
  return {
    "model": args.estimate_model,
    "steps_per_run": steps,
    "runs": len(regs) * len(per_step),
    "hours": total / 3600,
    "by_regime": detail,
    "inputs": {
      "fixed_s_per_run_measured": fixed,
      "compile_scale": compile_scale,
      "unshaped_bytes_per_s_fitted": bw,
      "target_compute_s_per_micro_batch": calib_target["concurrent"]["seconds"],
      "inspect_s_measured": inspect_wall,
      "inspect_s_per_config_measured": inspect_wall / max(1, len(hlo)),
    },
    "hours_inspect": inspect_wall / max(1, len(hlo)) * 16 * 3 * compile_scale / 3600,
  }


def describe(est: dict) -> str:
  return (
    f"full-run estimate ({est['model']}, {est['runs']} runs of {est['steps_per_run']} "
    f"steps): {est['hours']:.1f} h of runs + {est['hours_inspect']:.2f} h of HLO compiles; "
    + ", ".join(f"{k} ({v['rate']}) {v['hours']:.1f} h" for k, v in est["by_regime"].items())
  )
