"""Does the planner rank the strategies as the emulated cluster measures them?

Reads the strategy benchmark's results (experiments/bench_strategies.py, strategies.json) and, for
every shaped link regime and A it holds, predicts the step time of each measured strategy with
paro_jax.analysis.planner.planner configured for the emulated cluster:

- nodes x devices per node from the benchmark (2 x 4), the regime's tc rate as each node's link;
- each strategy's collectives over both axes as its row ran them (cluster_model.global_model):
  "flat" with XLA's (XLA:CPU runs one ring through gloo, and tc counts every device's ring
  bytes on the link: GGG's wire bytes are 4x the per-device formula), "hierarchical" with the
  two-level rings `--collectives auto` picks on this cluster (1/m of the payload crosses);
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

Only PaRO strategies run with the benchmark's default collectives are judged: baselines, torch
peers and labels NAME/IMPL (another collectives implementation) are left out
(experiments/bench/results.py).

Writes validate.json, validate.md and (with matplotlib) validate.png under --out. Pure Python
apart from the model presets (models/llama.py imports jax but touches no device). The same:
`python -m experiments.bench.validate`. Its parts: cluster_model.py (the planner for the
emulated cluster, and the fit), judge.py (correlation, pick, noise, goal), results.py (reading
and merging strategies.json files), stats.py, validate_report.py (validate.md, validate.png).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

from experiments.bench import validate_report
from experiments.bench.cluster_model import Constants, fit_constants
from experiments.bench.judge import GOAL, evaluate, goal_met, noise_sigma
from experiments.bench.results import measured_times, merge_results, planned, remeasured_times
from experiments.bench.stats import spearman_ceiling
from paro_jax.analysis.planner.profile import load_profile
from paro_jax.core import names, units

DEFAULT_RESULTS = "experiments/results/strategies/strategies.json"


def main(argv: list[str] | None = None, entry: str = "experiments/validate_planner.py") -> int:
  """The validation's command line; `entry`, how it was invoked, goes into the command recorded
  in validate.json and validate.md."""
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
  runs = [r for r in bench["runs"] if planned(r)]
  intra = units.parse_bandwidth(args.intra_bandwidth, "--intra-bandwidth")
  latency = dict.fromkeys(names.SCHEDULE_COLLECTIVES, units.parse_latency(args.latency))
  source = f"--intra-bandwidth {args.intra_bandwidth}, --latency {args.latency}"
  if args.profile:
    fits = load_profile(args.profile)["collectives"]
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
  command = " ".join(["python", entry, *(argv or sys.argv[1:])])
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
  text = validate_report.markdown(
    bench, primary, results, alt, command, again_meta, args.margin, noise
  )
  with open(os.path.join(args.out, "validate.md"), "w") as f:
    f.write(text)
  png = validate_report.plot(results, os.path.join(args.out, "validate.png"))
  print(text)
  print(
    "goal (Spearman >= 0.9, pick >= 0.95 of the best"
    + (", re-measured where covered" if again else "")
    + f") {'met' if summary['met'] else 'NOT met'}"
    f"; wrote {args.out}/validate.json, validate.md" + (", validate.png" if png else "")
  )
  return 0


if __name__ == "__main__":
  sys.exit(main(entry="-m experiments.bench.validate"))
