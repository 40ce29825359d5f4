"""The strategy benchmark's results as the planner validation reads them.

strategies.json files (experiments/bench/strategies.py) of one setup merge into one benchmark,
and their rows into step times per (regime, A) and strategy. The validation judges the planner
on PaRO strategies with the benchmark's default collectives: rows of other kinds (plain-jit
baselines, torch peers) and of other collectives (labels NAME/IMPL) are left out.
"""

from __future__ import annotations

from experiments.bench.calibration import UNSHAPED
from experiments.bench.configs import kind_of, label_of
from paro_jax.core.strategy import VALID_NAMES


def planned(r: dict) -> bool:
  """A successful run of a PaRO strategy with the default collectives: what the planner models."""
  return (
    not r.get("error")
    and kind_of(r) == "paro"
    and r["name"] in VALID_NAMES
    and label_of(r) == r["name"]
  )


def merge_runs(benches: list[dict], flag: str) -> list[dict]:
  """The benchmarks' successful strategy runs, each configuration once.

  A configuration in two of them must be the same run (a copied, `--resume`d row, as the
  unshaped references of a regime run into its own --out), else it is ambiguous and raises."""
  seen: dict[tuple[str, str, int], dict] = {}
  for bench in benches:
    for r in bench["runs"]:
      if not planned(r):
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
