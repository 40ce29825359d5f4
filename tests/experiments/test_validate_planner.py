"""The planner validation (experiments/bench/validate.py and its parts): rank statistics, fits,
merging runs, judging the pick."""

import json
import math
import statistics

import pytest

from experiments.bench import cluster_model, judge, results, stats, validate
from paro_jax.analysis.planner.inputs import TIE
from paro_jax.core.strategy import VALID_NAMES


def test_ranks_and_spearman():
  assert stats.ranks([3.0, 1.0, 3.0, 2.0]) == [3.5, 1.0, 3.5, 2.0]
  assert stats.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
  assert stats.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
  # Ties: x has ranks (1.5, 1.5, 3, 4), y is increasing.
  assert stats.spearman([1, 1, 2, 3], [1, 2, 3, 4]) == pytest.approx(
    stats.pearson([1.5, 1.5, 3, 4], [1, 2, 3, 4])
  )


def test_nnls_recovers_nonnegative_coefficients():
  rows = [[1.0, x, x * x] for x in range(6)]
  assert stats.nnls(rows, [2 + 3 * r[1] for r in rows]) == pytest.approx([2, 3, 0], abs=1e-9)
  ys = [2 - 3 * r[1] for r in rows]  # the best fit has a negative slope: clipped to 0
  assert min(stats.nnls(rows, ys)) >= 0


def _truth():
  """The constants the synthetic benchmarks' "measured" step times are made with."""
  return cluster_model.Constants(
    1 / 0.8e9, {"all_gather": 2e-4, "reduce_scatter": 9e-4, "all_reduce": 5e-4}, 2e-9, 1.1, "truth"
  )


def _synthetic_bench(truth, collectives=None):
  """Every strategy "measured" at the planner's own estimate; `collectives` (strategy ->
  --collectives) goes into the rows as the benchmark writes it."""
  collectives = collectives or {}
  bench = {
    "meta": {
      "nodes": 2,
      "devices_per_node": 4,
      "model": "tiny",
      "batch_size": 32,
      "seq_len": 512,
      "dtype": "fp32",
      "command": "synthetic",
    },
    "calibration": {"effective_flop_per_s_per_device": 5e9},
    "regimes": [
      {"regime": "slow", "rate": "20mbit", "rate_bps": 20e6},
      {"regime": "unshaped", "rate": "100gbit", "rate_bps": 100e9},
    ],
    "runs": [{"regime": "slow", "name": "jit-fsdp", "micro_batches": 1, "median_step_s": 1.0}],
  }
  for g in bench["regimes"]:
    for a in (1, 4):
      for n in VALID_NAMES:
        t = cluster_model.predict(bench, g, a, [n], truth, collectives).ranking[0].step_time_s
        row = {"regime": g["regime"], "name": n, "micro_batches": a, "median_step_s": t}
        if n in collectives:
          row["collectives"] = collectives[n]
        bench["runs"].append(row)
  return bench


def test_validation_on_noise_free_synthetic_results(tmp_path):
  """Results the planner's own model produced: the fit reproduces them, rank correlation 1."""
  truth = _truth()
  bench = _synthetic_bench(truth)
  path = tmp_path / "strategies.json"
  path.write_text(json.dumps(bench))
  assert validate.main(["--results", str(path), "--out", str(tmp_path / "out")]) == 0
  summary = json.loads((tmp_path / "out" / "validate.json").read_text())
  assert [(r["regime"], r["micro_batches"]) for r in summary["results"]] == [
    ("slow", 1),
    ("slow", 4),
  ]
  for r in summary["results"]:
    assert r["spearman"] == pytest.approx(1.0) and r["pick_speed_vs_best"] >= 1 - TIE
    assert r["strategies"] == 14
  assert summary["met"]
  assert (tmp_path / "out" / "validate.md").read_text().startswith("# Planner against")


def test_two_level_bytes_are_the_compiled_programs():
  """A collective over both axes on the two-level rings crosses the link with 1/m of the payload:
  the per-device bytes of `tiny` GGG, A=4, batch 32 x 512, fp32 on 2 x 4 with `hring+xla`, as
  the compiled program has them (the strategy benchmark's HLO count, hlo.json of its
  `--collectives auto` run: inter 6,167,054, intra 37,002,240), against XLA:CPU's flat ring
  (every ring byte crosses: 43,169,280)."""
  bench = _synthetic_bench(_truth())
  flat = cluster_model.features(bench, "GGG", 4, cluster_model.global_model("xla"))
  two = cluster_model.features(bench, "GGG", 4, cluster_model.global_model("hring+xla"))
  assert (flat["inter"], flat["intra"]) == (pytest.approx(43_169_280), 0)
  assert two["inter"] == pytest.approx(6_167_054, rel=1e-5)
  assert two["intra"] == pytest.approx(37_002_240, rel=1e-5)
  # One collective per level.
  assert two["counts"] == {k: 2 * v for k, v in flat["counts"].items()}
  # Strategies without collectives over both axes are the same either way.
  assert cluster_model.features(bench, "IIG", 4, "hierarchical") == cluster_model.features(
    bench, "IIG", 4, "flat"
  )


def test_validation_models_each_strategy_with_its_collectives(tmp_path):
  """Rows run on the two-level rings (`--collectives auto`'s hring+xla) are predicted with the
  two-level model, the rest flat: results the planner made that way validate perfectly, and the
  flat model alone would predict the ring strategies slower than measured."""
  truth = _truth()
  auto = dict.fromkeys(("NNN", "NGG", "GGG", "IGG", "GIG", "GNG"), "hring+xla")
  bench = _synthetic_bench(truth, auto)
  path = tmp_path / "strategies.json"
  path.write_text(json.dumps(bench))
  assert validate.main(["--results", str(path), "--out", str(tmp_path / "out")]) == 0
  summary = json.loads((tmp_path / "out" / "validate.json").read_text())
  assert summary["constants"]["compute_scale"] == pytest.approx(truth.compute_scale, rel=1e-6)
  for r in summary["results"]:
    assert r["spearman"] == pytest.approx(1.0) and r["strategies"] == 14
  slow = bench["regimes"][0]
  ring = cluster_model.predict(bench, slow, 4, ["GGG"], truth, auto).ranking[0].step_time_s
  flat = cluster_model.predict(bench, slow, 4, ["GGG"], truth).ranking[0].step_time_s
  assert flat > 2 * ring


def test_validation_judges_the_pick_on_the_remeasured_contenders(tmp_path):
  """--remeasured: the pick is compared with the contenders measured again; a (regime, A) whose
  contenders were not all re-measured keeps the full run's figure."""
  truth = _truth()
  path = tmp_path / "strategies.json"
  path.write_text(json.dumps(_synthetic_bench(truth)))
  assert validate.main(["--results", str(path), "--out", str(tmp_path / "a")]) == 0
  pick = json.loads((tmp_path / "a" / "validate.json").read_text())["results"][0]["pick"]
  # Measured again at A=1 only: the pick 25% slower than every other strategy.
  again = {
    "meta": {"command": "again", "steps": 7, "skip": 1},
    "runs": [
      {"regime": "slow", "name": n, "micro_batches": 1, "median_step_s": 2.5 if n == pick else 2.0}
      for n in VALID_NAMES
    ],
  }
  again_path = tmp_path / "again.json"
  again_path.write_text(json.dumps(again))
  # --margin 10: every strategy is a contender.
  assert (
    validate.main(
      [
        "--results",
        str(path),
        "--out",
        str(tmp_path / "b"),
        "--remeasured",
        str(again_path),
        "--margin",
        "10",
      ]
    )
    == 0
  )
  summary = json.loads((tmp_path / "b" / "validate.json").read_text())
  a1, a4 = summary["results"]
  assert a1["remeasured"]["covered"] and len(a1["remeasured"]["contenders"]) == 14
  assert a1["remeasured"]["pick_speed_vs_best"] == pytest.approx(0.8)
  assert a1["remeasured"]["best"] != pick
  assert a1["pick_speed_vs_best"] >= 1 - TIE  # the full run's figure is kept beside it
  assert not a4["remeasured"]["covered"] and len(a4["remeasured"]["missing"]) == 14
  assert judge.pick_score(a4) == a4["pick_speed_vs_best"]
  assert not summary["met"]  # judged on the re-measured 0.8
  md = (tmp_path / "b" / "validate.md").read_text()
  assert "Re-measured (`again`: 7 steps" in md and "not re-measured" in md
  # A=1 was re-measured in full: ranked on both runs too (the re-measurement alone ties 13
  # strategies, so its correlation with the prediction is well below the full run's 1).
  full = a1["remeasured"]["all"]
  assert full["spearman_again"] < 0.5 and set(full["combined_step_s"]) == set(VALID_NAMES)
  assert full["runs"] == 2 and judge.spearman_score(a1) == full["spearman_combined"]
  assert "all" not in a4["remeasured"]
  assert judge.spearman_score(a4) == a4["spearman"]


def test_validation_merges_remeasurements_split_over_files(tmp_path):
  """Two --remeasured files (one per A), a common 10% slowdown: every cell is re-measured in
  full and ranked on both runs; a third file measuring A=1 again with noise is a third run of
  those configurations, combined by geometric mean."""
  truth = _truth()
  bench = _synthetic_bench(truth)
  path = tmp_path / "strategies.json"
  path.write_text(json.dumps(bench))
  files = []
  for a in (1, 4):
    runs = [
      dict(r, median_step_s=1.1 * r["median_step_s"])
      for r in bench["runs"]
      if r["regime"] == "slow" and r["micro_batches"] == a and r["name"] in VALID_NAMES
    ]
    files.append(tmp_path / f"again{a}.json")
    files[-1].write_text(
      json.dumps({"meta": {"command": f"again A={a}", "steps": 7, "skip": 1}, "runs": runs})
    )
  assert (
    validate.main(
      [
        "--results",
        str(path),
        "--out",
        str(tmp_path / "out"),
        "--remeasured",
        str(files[0]),
        "--remeasured",
        str(files[1]),
      ]
    )
    == 0
  )
  summary = json.loads((tmp_path / "out" / "validate.json").read_text())
  assert summary["met"] and summary["noise"]["sigma"] == pytest.approx(0.0, abs=1e-9)
  for r in summary["results"]:
    assert r["remeasured"]["all"]["runs"] == 2
    assert r["remeasured"]["all"]["spearman_combined"] == pytest.approx(1.0)
    assert r["spearman_noise_ceiling_combined"] == pytest.approx(1.0)
  md = (tmp_path / "out" / "validate.md").read_text()
  assert "Every strategy re-measured" in md and "again A=1`; `again A=4" in md

  # A third run of A=1: every strategy's time x 1.1 x (1 + 0.3 or 1 - 0.3, alternating).
  third = json.loads(files[0].read_text())
  for i, r in enumerate(third["runs"]):
    r["median_step_s"] *= 1.3 if i % 2 else 0.7
  files.append(tmp_path / "again1b.json")
  files[-1].write_text(json.dumps(third))
  assert (
    validate.main(
      [
        "--results",
        str(path),
        "--out",
        str(tmp_path / "three"),
        *(x for f in files for x in ("--remeasured", str(f))),
      ]
    )
    == 0
  )
  summary = json.loads((tmp_path / "three" / "validate.json").read_text())
  a1, a4 = summary["results"]
  assert a1["remeasured"]["all"]["runs"] == 3 and a4["remeasured"]["all"]["runs"] == 2
  slow1 = {
    r["name"]: r["median_step_s"]
    for r in bench["runs"]
    if r["regime"] == "slow" and r["micro_batches"] == 1 and r["name"] in VALID_NAMES
  }
  third_t = {r["name"]: r["median_step_s"] for r in third["runs"]}
  for n, t in a1["remeasured"]["all"]["combined_step_s"].items():
    assert t == pytest.approx((slow1[n] * 1.1 * slow1[n] * third_t[n]) ** (1 / 3))
  # 14 + 14 pairs with the full run at A=1, 14 at A=4; the +-30% runs make the noise visible.
  assert summary["noise"]["pairs"] == 42 and summary["noise"]["sigma"] > 0.1
  assert "| slow | 1 | 3 |" in (tmp_path / "three" / "validate.md").read_text()


def test_contenders_are_those_near_the_best_plus_the_pick():
  measured = {"NNI": 10.0, "INI": 11.0, "III": 11.6, "GGG": 30.0}
  assert judge.contenders(measured, "GGG", 0.15) == ["GGG", "INI", "NNI"]
  assert judge.contenders(measured, "NNI", 0.2) == ["III", "INI", "NNI"]


def test_noise_sigma_ignores_a_common_shift_and_the_unshaped_reference():
  first = {("slow", 1): {"A": 1.0, "B": 2.0, "C": 4.0}, ("unshaped", 1): {"A": 1.0, "B": 1.0}}
  shifted = {
    ("slow", 1): {"A": [1.1], "B": [2.2], "C": [4.4]},
    ("unshaped", 1): {"A": [9.0], "B": [1.0]},
  }
  got = judge.noise_sigma(first, shifted)
  assert got["pairs"] == 3 and got["sigma"] == pytest.approx(0.0, abs=1e-12)
  assert got["mean_log_ratio"] == pytest.approx(math.log(1.1))
  noisy = {("slow", 1): {"A": [1.0], "B": [4.0], "C": [4.0]}}
  logs = [0.0, math.log(2.0), 0.0]
  assert judge.noise_sigma(first, noisy)["sigma"] == pytest.approx(
    statistics.stdev(logs) / math.sqrt(2)
  )
  # Every re-measurement of a configuration is one pair with the full run.
  twice = {("slow", 1): {"A": [1.0, 2.0], "B": [4.0]}}
  logs = [0.0, math.log(2.0), math.log(2.0)]
  got = judge.noise_sigma(first, twice)
  assert got["pairs"] == 3 and got["sigma"] == pytest.approx(statistics.stdev(logs) / math.sqrt(2))
  assert judge.noise_sigma(first, {("slow", 1): {"A": [1.0]}}) is None


def test_spearman_ceiling_falls_with_noise_against_the_spread():
  spread = [2.0**k for k in range(10)]  # neighbours 2x apart
  assert stats.spearman_ceiling(spread, 0.0, draws=50) == pytest.approx(1.0)
  assert stats.spearman_ceiling(spread, 0.02, draws=200) == pytest.approx(1.0)
  close = [1.0 + 0.001 * k for k in range(10)]  # 0.1% apart, 30% noise: ranks are a lottery
  assert abs(stats.spearman_ceiling(close, 0.3, draws=200)) < 0.5


def test_validation_merges_regimes_from_several_results_files(tmp_path):
  """--results repeats: a regime benchmarked into its own --out (the unshaped references copied)
  is judged beside the first file's; a different setup, or one configuration measured twice with
  different times, is refused by name."""
  truth = _truth()
  bench = _synthetic_bench(truth)
  slower = {"regime": "slower", "rate": "5mbit", "rate_bps": 5e6}
  second = dict(
    bench,
    meta=dict(bench["meta"], command="second"),
    regimes=[slower, bench["regimes"][1]],
    runs=[r for r in bench["runs"] if r["regime"] == "unshaped"],
  )
  for a in (1, 4):
    for n in VALID_NAMES:
      t = cluster_model.predict(bench, slower, a, [n], truth).ranking[0].step_time_s
      second["runs"].append({"regime": "slower", "name": n, "micro_batches": a, "median_step_s": t})
  paths = [tmp_path / "first.json", tmp_path / "second.json"]
  paths[0].write_text(json.dumps(bench))
  paths[1].write_text(json.dumps(second))
  assert (
    validate.main(
      ["--results", str(paths[0]), "--results", str(paths[1]), "--out", str(tmp_path / "out")]
    )
    == 0
  )
  summary = json.loads((tmp_path / "out" / "validate.json").read_text())
  assert [(r["regime"], r["micro_batches"]) for r in summary["results"]] == [
    ("slow", 1),
    ("slow", 4),
    ("slower", 1),
    ("slower", 4),
  ]
  assert all(r["spearman"] == pytest.approx(1.0) for r in summary["results"]) and summary["met"]
  # The fit saw each unshaped run once: the copies did not double them.
  assert "fitted on the 28 unshaped runs" in summary["constants"]["source"]
  assert "`synthetic`; `second`" in (tmp_path / "out" / "validate.md").read_text()

  other = dict(second, meta=dict(second["meta"], batch_size=64))
  paths.append(tmp_path / "other.json")
  paths[-1].write_text(json.dumps(other))
  with pytest.raises(ValueError, match="differs from `synthetic` in batch_size"):
    validate.main(
      ["--results", str(paths[0]), "--results", str(paths[2]), "--out", str(tmp_path / "x")]
    )
  clash = json.loads(paths[1].read_text())
  clash["runs"][0]["median_step_s"] *= 2
  paths.append(tmp_path / "clash.json")
  paths[-1].write_text(json.dumps(clash))
  with pytest.raises(ValueError, match="unshaped .* measured in two --results files"):
    validate.main(
      ["--results", str(paths[0]), "--results", str(paths[3]), "--out", str(tmp_path / "x")]
    )


def test_remeasured_times_counts_each_run_once():
  """A row copied into another --remeasured file (same median) is one run; a different median of
  the same configuration is another run."""

  def bench(*times):
    return {
      "runs": [
        {"regime": "slow", "name": "IIG", "micro_batches": 1, "median_step_s": t} for t in times
      ]
    }

  got = results.remeasured_times([bench(2.0), bench(2.0), bench(3.0)])
  assert got == {("slow", 1): {"IIG": [2.0, 3.0]}}
  assert stats.gmean([2.0, 8.0]) == pytest.approx(4.0)


def test_validation_judges_strategies_with_the_default_collectives_only(tmp_path):
  """Rows of other collectives (label NAME/IMPL), baselines and torch peers are not what the
  planner models: left out, even when they are the fastest or share a strategy's name."""
  bench = _synthetic_bench(_truth())
  others = [
    {"kind": "paro", "name": "GGG", "label": "GGG/horing", "collectives": "horing"},
    {"kind": "torch", "name": "full_shard", "label": "torch-full_shard", "collectives": None},
    {"kind": "jit", "name": "jit-hsdp", "label": "jit-hsdp", "collectives": None},
  ]
  for regime in ("slow", "unshaped"):
    for extra in others:
      bench["runs"].append(dict(extra, regime=regime, micro_batches=1, median_step_s=1e-3))
  assert [results.planned(r) for r in bench["runs"][-3:]] == [False] * 3
  labelled = dict(bench["runs"][1], kind="paro", label="NNN", collectives="xla")
  assert results.planned(labelled) and not results.planned(dict(labelled, error="exited 1"))
  path = tmp_path / "strategies.json"
  path.write_text(json.dumps(bench))
  assert validate.main(["--results", str(path), "--out", str(tmp_path / "out")]) == 0
  summary = json.loads((tmp_path / "out" / "validate.json").read_text())
  assert "fitted on the 28 unshaped runs" in summary["constants"]["source"]
  for r in summary["results"]:
    assert r["strategies"] == 14 and r["spearman"] == pytest.approx(1.0)
    assert {row["strategy"] for row in r["rows"]} == set(VALID_NAMES)
