"""Judging the planner against the benchmark: per shaped (regime, A), the Spearman correlation
of predicted and measured step times and the measured speed of the planner's pick relative to
the best, re-measured where `--remeasured` covers the contenders; the run-to-run noise and the
goal (GOAL)."""

from __future__ import annotations

import math

from experiments.bench.calibration import UNSHAPED
from experiments.bench.cluster_model import Constants, predict
from experiments.bench.results import planned
from experiments.bench.stats import gmean, ranks, spearman
from paro_jax.core.strategy import VALID_NAMES


def contenders(measured: dict[str, float], pick: str, margin: float) -> list[str]:
  """The strategies whose pick-versus-best standing a re-measurement must settle: every one
  measured within `margin` of the best, and the pick."""
  best = min(measured.values())
  return sorted({n for n, t in measured.items() if t <= best * (1 + margin)} | {pick})


def settle(
  result: dict, measured: dict[str, float], again: dict[str, float] | None, margin: float
) -> dict:
  """The pick's speed relative to the best among the contenders, measured again (more steps).

  Covered only if `again` holds every contender; strategies outside them measured more than
  `margin` slower than the best in the full benchmark."""
  names = contenders(measured, result["pick"], margin)
  missing = [n for n in names if not again or n not in again]
  if missing:
    return {"contenders": names, "covered": False, "missing": missing}
  best = min(names, key=again.get)
  return {
    "contenders": names,
    "covered": True,
    "steps_s": {n: again[n] for n in names},
    "best": best,
    "pick_speed_vs_best": again[best] / again[result["pick"]],
  }


def noise_sigma(first: dict, again: dict) -> dict | None:
  """Run-to-run noise of one step-time measurement, from the shaped configurations measured in
  the full run and again (`again` as remeasured_times gives it: every re-measurement is one
  pair with the full run): the standard deviation of log(again / first) about its mean (a shift
  common to all does not change a ranking), over sqrt(2) for two independent measurements."""
  logs = [
    math.log(t / first[k][n])
    for k in again
    if k in first and k[0] != UNSHAPED
    for n in again[k]
    if n in first[k]
    for t in again[k][n]
  ]
  if len(logs) < 3:
    return None
  mean = sum(logs) / len(logs)
  sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (len(logs) - 1))
  return {"sigma": sd / math.sqrt(2), "pairs": len(logs), "mean_log_ratio": mean}


def evaluate(
  bench: dict, c: Constants, again: dict | None = None, margin: float = 0.15
) -> list[dict]:
  """Per shaped (regime, A): Spearman over all measured strategies and the pick's speed relative
  to the best; with `again` (remeasured_times) also that speed re-measured (the geometric mean
  of a contender's re-measurements), and where every strategy was measured again, the Spearman
  correlation against every run combined (geometric mean of the full run and each
  re-measurement)."""
  runs = [r for r in bench["runs"] if planned(r)]
  out = []
  for regime in bench["regimes"]:
    if regime["regime"] == UNSHAPED:
      continue
    for a in sorted({r["micro_batches"] for r in runs if r["regime"] == regime["regime"]}):
      here = [r for r in runs if r["regime"] == regime["regime"] and r["micro_batches"] == a]
      measured = {r["name"]: r["median_step_s"] for r in here}
      if len(measured) < 2:
        continue
      names = [n for n in VALID_NAMES if n in measured]
      p = predict(bench, regime, a, names, c, {r["name"]: r.get("collectives") for r in here})
      predicted = {e.strategy: e.step_time_s for e in p.ranking}
      best = min(names, key=measured.get)
      rho = spearman([predicted[n] for n in names], [measured[n] for n in names])
      out.append(
        {
          "regime": regime["regime"],
          "rate": regime["rate"],
          "micro_batches": a,
          "strategies": len(names),
          "spearman": rho,
          "pick": p.pick,
          "measured_best": best,
          "pick_speed_vs_best": measured[best] / measured[p.pick],
          "rows": [
            {
              "strategy": n,
              "predicted_step_s": predicted[n],
              "measured_step_s": measured[n],
              "predicted_rank": r_p,
              "measured_rank": r_m,
            }
            for n, r_p, r_m in zip(
              names, ranks([predicted[n] for n in names]), ranks([measured[n] for n in names])
            )
          ],
        }
      )
      if again is not None:
        cell = again.get((regime["regime"], a)) or {}
        mean = {n: gmean(ts) for n, ts in cell.items()}
        out[-1]["remeasured"] = settle(out[-1], measured, mean, margin)
        if all(n in cell for n in names):
          combined = [gmean([measured[n], *cell[n]]) for n in names]
          out[-1]["remeasured"]["all"] = {
            "runs": 1 + min(len(cell[n]) for n in names),
            "spearman_again": spearman([predicted[n] for n in names], [mean[n] for n in names]),
            "spearman_combined": spearman([predicted[n] for n in names], combined),
            "combined_step_s": dict(zip(names, combined)),
          }
  return out


def spearman_score(r: dict) -> float:
  """The Spearman correlation the goal is judged on: against every run combined where every
  strategy was re-measured, else against the full run."""
  full = (r.get("remeasured") or {}).get("all")
  return full["spearman_combined"] if full else r["spearman"]


def pick_score(r: dict) -> float:
  """The pick's speed / best that the goal is judged on: re-measured where covered."""
  rm = r.get("remeasured")
  return rm["pick_speed_vs_best"] if rm and rm["covered"] else r["pick_speed_vs_best"]


GOAL = {"spearman": 0.9, "pick_speed_vs_best": 0.95}


def goal_met(r: dict) -> bool:
  return spearman_score(r) >= GOAL["spearman"] and pick_score(r) >= GOAL["pick_speed_vs_best"]
