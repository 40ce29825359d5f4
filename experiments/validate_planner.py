"""Does the planner rank the strategies as the emulated cluster measures them?

Reads the strategy benchmark's results (experiments/bench_strategies.py, strategies.json) and, for
every shaped link regime and A it holds, predicts the step time of each measured strategy with
paro_jax.analysis.planner configured for the emulated cluster:

- nodes x devices per node from the benchmark (2 x 4), the regime's tc rate as each node's link;
- global collectives "flat": XLA:CPU runs a collective over all devices through gloo, and tc
  counts every device's ring bytes on the link (strategies_smoke: GGG's wire bytes are 4x the
  per-device formula);
- traffic in 4-byte values (XLA:CPU widens bf16 collectives to f32; the benchmark trains fp32);
- compute: the benchmark's calibration (model FLOP/s of one virtual device while all 8 run at
  once, `effective_flop_per_s_per_device`), MFU 1.

What the calibration does not give, the intra-node bandwidth, the cost of one collective of each
kind (all-gather, reduce-scatter, all-reduce: what a probe profile holds per kind), gloo's own
cost per byte on the inter link (in series with the tc rate) and a scale on the compute time, is
fitted by non-negative least squares on the *unshaped* runs only (the same strategies on a
100 Gbit/s link), so the shaped regimes the ranking is judged on are not fitted to. `--no-fit`
uses --intra-bandwidth / --latency (or a probe profile, --profile) instead.

Per (regime, A): Spearman correlation between predicted and measured step times (average ranks
for ties), and the measured throughput of the planner's pick relative to the measured best.
Goal: correlation >= 0.9 and the pick within 5% of the best.

The best few strategies often differ by less than the noise of a short benchmark run. With
`--remeasured` (the strategies.json of another benchmark run of those strategies with more
steps; repeatable: files split over regimes merge, and a configuration in several of them counts
as measured again in each), the pick is judged against the contenders measured again (the
geometric mean of their re-measurements): every strategy measured within --margin (15%) of the
best in the full run, plus the pick; a (regime, A) whose contenders were not all re-measured
keeps the full run's figure. Where every strategy of a (regime, A) was measured again, the
Spearman correlation the goal is judged on is the one against every run combined (the geometric
mean of the full run's and each re-measurement's step times, less noisy than any one); the one
against the full run alone is reported beside it. The run-to-run noise, from the configurations
measured more than once, gives the Spearman correlation a perfect predictor would reach against
measurements that noisy.

  python experiments/validate_planner.py \
      --results experiments/results/strategies/strategies.json --out experiments/results/planner \
      [--results experiments/results/strategies_commodity/strategies.json] \
      [--remeasured experiments/results/strategies_top/strategies.json [--remeasured ...]]

`--results` repeats: benchmark runs of one setup (model, batch, mesh, the same calibration and so
the same link rates) merge into one, so a regime benchmarked later into its own --out (with
`--calibration` of the first run's calibration.json) is judged beside the others.

Writes validate.json, validate.md and (with matplotlib) validate.png under --out. Pure Python
apart from the model presets (models/llama.py imports jax but touches no device).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from paro_jax.analysis import planner  # noqa: E402
from paro_jax.core import names, units  # noqa: E402
from paro_jax.core.strategy import VALID_NAMES, parse_strategy  # noqa: E402

UNSHAPED = "unshaped"
DEFAULT_RESULTS = "experiments/results/strategies/strategies.json"
WIRE_ITEMSIZE = 4


# --- statistics (no scipy) -----------------------------------------------------------------------
def ranks(xs: list[float]) -> list[float]:
  """1-based ranks, ties sharing their average rank."""
  order = sorted(range(len(xs)), key=lambda i: xs[i])
  out = [0.0] * len(xs)
  i = 0
  while i < len(order):
    j = i
    while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
      j += 1
    for k in range(i, j + 1):
      out[order[k]] = (i + j) / 2 + 1
    i = j + 1
  return out


def pearson(xs: list[float], ys: list[float]) -> float:
  mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
  sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
  sxx = sum((x - mx) ** 2 for x in xs)
  syy = sum((y - my) ** 2 for y in ys)
  return sxy / math.sqrt(sxx * syy) if sxx and syy else float("nan")


def spearman(xs: list[float], ys: list[float]) -> float:
  return pearson(ranks(xs), ranks(ys))


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
  """Gaussian elimination with partial pivoting; None when singular."""
  n = len(b)
  m = [row[:] + [v] for row, v in zip(a, b)]
  for c in range(n):
    p = max(range(c, n), key=lambda r: abs(m[r][c]))
    if abs(m[p][c]) < 1e-300:
      return None
    m[c], m[p] = m[p], m[c]
    for r in range(n):
      if r != c:
        f = m[r][c] / m[c][c]
        m[r] = [x - f * y for x, y in zip(m[r], m[c])]
  return [m[i][n] / m[i][i] for i in range(n)]


def nnls(rows: list[list[float]], ys: list[float]) -> list[float]:
  """min |X w - y| with w >= 0, by trying every set of free coefficients (a handful here).

  Columns are scaled to unit norm first, so seconds-per-byte and seconds-per-collective
  coefficients are solved on the same footing.
  """
  k = len(rows[0])
  norms = [math.sqrt(sum(r[j] ** 2 for r in rows)) or 1.0 for j in range(k)]
  xs = [[r[j] / norms[j] for j in range(k)] for r in rows]
  best, best_err = [0.0] * k, sum(y * y for y in ys)
  for size in range(1, k + 1):
    for free in itertools.combinations(range(k), size):
      a = [[sum(x[i] * x[j] for x in xs) for j in free] for i in free]
      b = [sum(x[i] * y for x, y in zip(xs, ys)) for i in free]
      sol = _solve(a, b)
      if sol is None or min(sol) < 0:
        continue
      w = [0.0] * k
      for i, v in zip(free, sol):
        w[i] = v
      err = sum((sum(wj * xj for wj, xj in zip(w, x)) - y) ** 2 for x, y in zip(xs, ys))
      if err < best_err:
        best, best_err = w, err
  return [w / n for w, n in zip(best, norms)]


# --- the planner for the emulated cluster -------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Constants:
  """What the planner needs beyond the benchmark's own figures."""

  intra_s_per_byte: float  # 1 / intra bandwidth per device
  latency_s: dict  # collective kind -> seconds per collective, either level
  gloo_s_per_byte: float  # gloo's own cost per inter-node byte per device, in series with tc
  compute_scale: float  # x the calibrated compute time
  source: str


def workload(bench: dict) -> planner.Workload:
  from models.llama import get_config

  meta = bench["meta"]
  n = meta["nodes"] * meta["devices_per_node"]
  return planner.Workload(
    get_config(meta["model"]),
    micro_batch=max(1, meta["batch_size"] // n),
    micro_batches=1,
    seq_len=meta["seq_len"],
    itemsize=WIRE_ITEMSIZE,
  )


def cluster(bench: dict, rate_bps: float, c: Constants) -> planner.Cluster:
  meta = bench["meta"]
  m = meta["devices_per_node"]
  # Per device: m / node_rate (its share of tc's link) + gloo's cost, in series.
  inter_bw = 1 / (8 * m / rate_bps + c.gloo_s_per_byte)
  intra_bw = 1 / max(c.intra_s_per_byte, 1e-30)
  # Every (collective, level) as a probe profile would give it; a global collective is flat.
  measured = {
    (kind, level): (intra_bw if level == "intra" else inter_bw, c.latency_s[kind])
    for kind in names.SCHEDULE_COLLECTIVES
    for level in names.LEVELS
  }
  network = planner.Links(
    inter_bandwidth=inter_bw * m,
    intra_bandwidth=intra_bw,
    global_collectives="flat",
    measured=measured,
  )
  flops = bench["calibration"]["effective_flop_per_s_per_device"] / c.compute_scale
  return planner.Cluster(meta["nodes"], m, network, flop_per_s=flops, mfu=1.0)


def features(bench: dict, name: str, a: int) -> dict:
  """Per step: calibrated compute seconds, intra and inter bytes per device, collectives of
  each kind."""
  w = dataclasses.replace(workload(bench), micro_batches=a)
  meta = bench["meta"]
  unit = planner.Cluster(
    meta["nodes"],
    meta["devices_per_node"],
    planner.Links(1.0, 1.0),
    bench["calibration"]["effective_flop_per_s_per_device"],
    mfu=1.0,
  )
  s = parse_strategy(name)
  traffic = planner.traffic_of(s, w, unit)
  sched = planner.schedule(s, w)
  counts = {kind: 0 for kind in names.SCHEDULE_COLLECTIVES}
  for key in traffic.phases:
    counts[sched[key][0]] += sched[key][2]
  return {
    "compute": planner.compute_seconds(w, unit),
    "intra": traffic.intra,
    "inter": traffic.inter,
    "counts": counts,
  }


def fit_constants(bench: dict, runs: list[dict]) -> Constants | None:
  """NNLS on the unshaped runs: step - inter bytes / link = s C + intra / B' + gloo E
  + sum over kinds of lat_kind K_kind."""
  meta = bench["meta"]
  m = meta["devices_per_node"]
  rate = next((g["rate_bps"] for g in bench["regimes"] if g["regime"] == UNSHAPED), None)
  ref = [r for r in runs if r["regime"] == UNSHAPED]
  if rate is None or len(ref) < 4:
    return None
  rows, ys = [], []
  for r in ref:
    f = features(bench, r["name"], r["micro_batches"])
    rows.append(
      [f["compute"], f["intra"], f["inter"], *(f["counts"][k] for k in names.SCHEDULE_COLLECTIVES)]
    )
    ys.append(r["median_step_s"] - f["inter"] * m * 8 / rate)
  coef = nnls(rows, ys)
  scale, intra, gloo, *lat = coef
  steps = [r["median_step_s"] for r in ref]
  rel = [(sum(c * x for c, x in zip(coef, row)) - y) / t for row, y, t in zip(rows, ys, steps)]
  rms = math.sqrt(sum(e * e for e in rel) / len(rel))
  return Constants(
    intra,
    dict(zip(names.SCHEDULE_COLLECTIVES, lat)),
    gloo,
    scale or 1.0,
    f"fitted on the {len(ref)} unshaped runs by NNLS, rms error {rms:.1%} there",
  )


def predict(bench: dict, regime: dict, a: int, names: list[str], c: Constants) -> planner.Plan:
  w = dataclasses.replace(workload(bench), micro_batches=a)
  cl = cluster(bench, regime["rate_bps"], c)
  est = {n: planner.estimate(parse_strategy(n), w, cl) for n in VALID_NAMES}
  # The planner's pick among the strategies that were measured (no memory limit on CPU).
  sub = [est[n] for n in names]
  pick = planner.tie_break(sub)
  ranking = [pick] + sorted((e for e in sub if e is not pick), key=lambda e: e.step_time_s)
  return planner.Plan(pick.strategy, "", ranking, {})


def merge_runs(benches: list[dict], flag: str) -> list[dict]:
  """The benchmarks' successful strategy runs, each configuration once.

  A configuration in two of them must be the same run (a copied, `--resume`d row, as the
  unshaped references of a regime run into its own --out), else it is ambiguous and raises."""
  seen: dict[tuple[str, str, int], dict] = {}
  for bench in benches:
    for r in bench["runs"]:
      if r.get("error") or r["name"] not in VALID_NAMES:
        continue
      key = (r["regime"], r["name"], r["micro_batches"])
      if key in seen and seen[key]["median_step_s"] != r["median_step_s"]:
        raise ValueError(
          f"{r['regime']} {r['name']} A={r['micro_batches']} was measured in "
          f"two {flag} files ({seen[key]['median_step_s']} s, "
          f"{r['median_step_s']} s): give each configuration once"
        )
      seen.setdefault(key, r)
  return list(seen.values())


def measured_times(bench: dict) -> dict[tuple[str, int], dict[str, float]]:
  """{(regime, A): {strategy: median step s}} over a (merged) benchmark's strategy runs."""
  out: dict[tuple[str, int], dict[str, float]] = {}
  for r in merge_runs([bench], "--results"):
    out.setdefault((r["regime"], r["micro_batches"]), {})[r["name"]] = r["median_step_s"]
  return out


def remeasured_times(benches: list[dict]) -> dict[tuple[str, int], dict[str, list[float]]]:
  """{(regime, A): {strategy: [median step s of each re-measurement]}}.

  Files split over regimes or A merge; a configuration measured again in several files counts
  each run (in file order). A row copied between files (the same median, as the unshaped
  references a `--resume`d run reuses) is one run, not two."""
  out: dict[tuple[str, int], dict[str, list[float]]] = {}
  for bench in benches:
    for r in merge_runs([bench], "--remeasured"):
      times = out.setdefault((r["regime"], r["micro_batches"]), {}).setdefault(r["name"], [])
      if r["median_step_s"] not in times:
        times.append(r["median_step_s"])
  return out


def gmean(xs: list[float]) -> float:
  return math.exp(sum(math.log(x) for x in xs) / len(xs))


SAME_SETUP = ("nodes", "devices_per_node", "model", "batch_size", "seq_len", "dtype")


def merge_results(benches: list[dict]) -> dict:
  """Several runs of the strategy benchmark on one setup as one benchmark (a regime run later
  into its own --out, e.g. commodity): regimes and strategy runs merged, each configuration
  once. Runs of different setups (model, batch, mesh, calibrated link rates) do not compare and
  are refused, naming what differs."""
  first = benches[0]
  for b in benches[1:]:
    diff = [k for k in SAME_SETUP if b["meta"].get(k) != first["meta"].get(k)]
    if (
      b["calibration"]["effective_flop_per_s_per_device"]
      != first["calibration"]["effective_flop_per_s_per_device"]
    ):
      diff.append("calibration (run it with --calibration of the first one's calibration.json)")
    if diff:
      raise ValueError(
        f"--results `{b['meta']['command']}` differs from `"
        f"{first['meta']['command']}` in {', '.join(diff)}: their step times do "
        "not compare; give benchmark runs of one setup"
      )
  regimes: dict[str, dict] = {}
  for b in benches:
    for g in b["regimes"]:
      if regimes.setdefault(g["regime"], g)["rate_bps"] != g["rate_bps"]:
        raise ValueError(
          f"regime {g['regime']} has two link rates in the --results files "
          f"({regimes[g['regime']]['rate']}, {g['rate']})"
        )
  # The reference last, as the benchmark orders it.
  order = sorted(regimes, key=lambda n: n == UNSHAPED)
  meta = dict(
    first["meta"], command="`; `".join(dict.fromkeys(b["meta"]["command"] for b in benches))
  )
  return dict(
    first, meta=meta, regimes=[regimes[n] for n in order], runs=merge_runs(benches, "--results")
  )


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


def spearman_ceiling(times: list[float], sigma: float, draws: int = 2000, seed: int = 0) -> float:
  """The median Spearman correlation between `times` and the same times with log-normal noise
  `sigma`: what a perfect predictor reaches against one measurement that noisy. `times` are
  themselves measured, so their spread is a little overstated and so is the ceiling."""
  rng = random.Random(seed)
  rhos = sorted(
    spearman(times, [t * math.exp(rng.gauss(0.0, sigma)) for t in times]) for _ in range(draws)
  )
  return rhos[draws // 2]


def evaluate(
  bench: dict, c: Constants, again: dict | None = None, margin: float = 0.15
) -> list[dict]:
  """Per shaped (regime, A): Spearman over all measured strategies and the pick's speed relative
  to the best; with `again` (remeasured_times) also that speed re-measured (the geometric mean
  of a contender's re-measurements), and where every strategy was measured again, the Spearman
  correlation against every run combined (geometric mean of the full run and each
  re-measurement)."""
  runs = [r for r in bench["runs"] if not r.get("error") and r["name"] in VALID_NAMES]
  out = []
  for regime in bench["regimes"]:
    if regime["regime"] == UNSHAPED:
      continue
    for a in sorted({r["micro_batches"] for r in runs if r["regime"] == regime["regime"]}):
      measured = {
        r["name"]: r["median_step_s"]
        for r in runs
        if r["regime"] == regime["regime"] and r["micro_batches"] == a
      }
      if len(measured) < 2:
        continue
      names = [n for n in VALID_NAMES if n in measured]
      p = predict(bench, regime, a, names, c)
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


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument(
    "--results",
    action="append",
    default=None,
    metavar="JSON",
    help="strategies.json of the strategy benchmark (repeatable: runs of one setup "
    "merge, e.g. a regime benchmarked into its own --out; default "
    f"{DEFAULT_RESULTS})",
  )
  ap.add_argument("--out", default="experiments/results/planner")
  ap.add_argument(
    "--no-fit", action="store_true", help="do not fit on the unshaped runs: use the constants below"
  )
  ap.add_argument(
    "--intra-bandwidth",
    default="1GB/s",
    help="--no-fit: per device (default 1GB/s, bench_collectives' in-process rate)",
  )
  ap.add_argument("--latency", default="300us", help="--no-fit: per collective, every kind")
  ap.add_argument(
    "--profile",
    default=None,
    help="--no-fit: a `paro-jax probe --mesh 2x4` profile for intra bandwidth and "
    "latencies (its intra fits)",
  )
  ap.add_argument(
    "--remeasured",
    action="append",
    default=[],
    metavar="JSON",
    help="strategies.json of another benchmark run with more steps (repeatable; a "
    "configuration in several files is measured again in each): the pick's "
    "speed relative to the best is judged on it, among the contenders; a "
    "(regime, A) re-measured in full is ranked on every run combined",
  )
  ap.add_argument(
    "--margin",
    type=float,
    default=0.15,
    help="contenders: measured within this fraction of the best (default 0.15)",
  )
  args = ap.parse_args(argv)
  args.results = args.results or [DEFAULT_RESULTS]
  benches = []
  for path in args.results:
    with open(path) as f:
      benches.append(json.load(f))
  bench = merge_results(benches)
  again, again_meta = None, None
  if args.remeasured:
    rebenches = []
    for path in args.remeasured:
      with open(path) as f:
        rebenches.append(json.load(f))
    again = remeasured_times(rebenches)
    again_meta = {
      "command": "`; `".join(b["meta"]["command"] for b in rebenches),
      "steps": "/".join(sorted({str(b["meta"]["steps"]) for b in rebenches})),
      "skip": min(b["meta"]["skip"] for b in rebenches),
    }
  runs = [r for r in bench["runs"] if not r.get("error") and r["name"] in VALID_NAMES]
  intra = units.parse_bandwidth(args.intra_bandwidth, "--intra-bandwidth")
  latency = dict.fromkeys(names.SCHEDULE_COLLECTIVES, units.parse_latency(args.latency))
  source = f"--intra-bandwidth {args.intra_bandwidth}, --latency {args.latency}"
  if args.profile:
    fits = planner.load_profile(args.profile)["collectives"]
    intra = fits["all_gather"]["intra"]["bandwidth"]
    latency = {k: fits[k]["intra"]["latency"] for k in names.SCHEDULE_COLLECTIVES}
    source = f"profile {args.profile}"
  given = Constants(1 / intra, latency, 0.0, 1.0, source)
  fitted = None if args.no_fit else fit_constants(bench, runs)
  if fitted is None and not args.no_fit:
    print("no unshaped runs to fit on: using the --no-fit constants", file=sys.stderr)
  primary = fitted or given
  results = evaluate(bench, primary, again, args.margin)
  alt = evaluate(bench, given, again, args.margin) if fitted else None
  noise = noise_sigma(measured_times(bench), again) if again else None
  if noise:
    for r in results:
      r["spearman_noise_ceiling"] = spearman_ceiling(
        [x["measured_step_s"] for x in r["rows"]], noise["sigma"]
      )
      if full := r["remeasured"].get("all"):
        # The geometric mean of k independent measurements: noise sigma / sqrt(k).
        r["spearman_noise_ceiling_combined"] = spearman_ceiling(
          list(full["combined_step_s"].values()), noise["sigma"] / math.sqrt(full["runs"])
        )
  if not results:
    print(
      f"{', '.join(args.results)} has no shaped regime with two or more strategies measured",
      file=sys.stderr,
    )
    return 1
  command = " ".join(["python", "experiments/validate_planner.py", *(argv or sys.argv[1:])])
  os.makedirs(args.out, exist_ok=True)
  summary = {
    "command": command,
    "results_file": args.results,
    "constants": dataclasses.asdict(primary),
    "results": results,
    "no_fit_results": alt,
    "remeasured_file": args.remeasured,
    "margin": args.margin,
    "noise": noise,
    "goal": GOAL,
    "met": all(goal_met(r) for r in results),
  }
  with open(os.path.join(args.out, "validate.json"), "w") as f:
    json.dump(summary, f, indent=2)
  text = markdown(bench, primary, results, alt, command, again_meta, args.margin, noise)
  with open(os.path.join(args.out, "validate.md"), "w") as f:
    f.write(text)
  png = plot(results, os.path.join(args.out, "validate.png"))
  print(text)
  print(
    "goal (Spearman >= 0.9, pick >= 0.95 of the best"
    + (", re-measured where covered" if again else "")
    + f") {'met' if summary['met'] else 'NOT met'}"
    f"; wrote {args.out}/validate.json, validate.md" + (", validate.png" if png else "")
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
