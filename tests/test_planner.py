"""The planner (paro_jax/analysis/planner.py), the probe, `train --strategy auto`, validation math.

The paper's conclusions are checked on realistic clusters: 16 nodes x 8 A100-80GB, a 100 Gbit/s
link per node (a slow cloud) against 300 GB/s NVLink, A=8 micro-batches of one 2,048-token
sequence per device.
"""

import json
import math
import os
import statistics
import sys

import pytest

from models.llama import PRESETS, Llama, get_config
from paro_jax.analysis import hardware, planner
from paro_jax.core import names, units
from paro_jax.cli import main
from paro_jax.analysis.costs import step_traffic
from paro_jax.core.strategy import VALID_NAMES, parse_strategy

sys.path.insert(
  0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments")
)
import validate_planner  # noqa: E402

PARTIAL = [n for n in VALID_NAMES if "I" in n]  # some state sharded within a node only


def paper_plan(
  model="7b", trainable_fraction=1.0, memory="80GB", global_collectives="hierarchical", nodes=16
):
  cfg = get_config(model)
  psi = cfg.param_count()
  w = planner.Workload(
    cfg, micro_batch=1, micro_batches=8, seq_len=2048, trainable=round(trainable_fraction * psi)
  )
  net = planner.Links(
    units.parse_bandwidth("100gbit"),
    units.parse_bandwidth("300GB/s"),
    global_collectives=global_collectives,
  )
  card = hardware.GPUS["a100-80gb"]
  return planner.plan(
    w, planner.Cluster(nodes, 8, net, card.peak_flops, device_memory=units.parse_size(memory))
  )


@pytest.mark.parametrize("global_collectives", ["flat", "hierarchical"])
def test_slow_inter_full_training_partial_redundancy_beats_zero(global_collectives):
  """Paper: on slow inter-node links a partial-redundancy strategy beats ZeRO-2 and ZeRO-3."""
  p = paper_plan("65b", global_collectives=global_collectives)
  assert p.pick == "IIG", p.explain  # the paper's 65B pick; NGG does not fit, GGG is slower
  assert p.get("GGG").step_time_s > 2 * p.get("IIG").step_time_s
  assert not p.get("NGG").fits
  p = paper_plan("7b", global_collectives=global_collectives)  # memory to spare
  assert p.pick not in ("GGG", "NGG"), p.explain
  best_partial = min(p.get(n).step_time_s for n in PARTIAL)
  assert p.get(p.pick).step_time_s <= best_partial * (1 + planner.TIE)
  for zero in ("GGG", "NGG"):
    assert p.get(zero).fits and p.get(zero).step_time_s > 2 * best_partial


def test_few_trainable_parameters_pick_ing():
  """Paper: with few trainable parameters (LoRA) and parameters too big to replicate, ING."""
  p = paper_plan("65b", trainable_fraction=0.003)
  assert p.pick == "ING", p.explain
  fastest = min(e.step_time_s for e in p.ranking if e.fits)
  assert p.get("ING").step_time_s <= fastest * (1 + planner.TIE)
  # ING's gradients stay put during the micro-batches: no gradient traffic until the sync.
  assert p.get("ING").times["grad_traffic"] == 0
  assert not any(p.get(n).fits for n in VALID_NAMES if n[0] == "N")  # 130 GB of parameters


def test_tight_memory_only_fully_sharded_fit():
  p = paper_plan("65b", memory="40GB")
  fitting = {e.strategy for e in p.ranking if e.fits}
  assert fitting and all("N" not in n for n in fitting), fitting
  assert "GGG" in fitting and "IIG" not in fitting
  assert "only fully sharded strategies" in p.explain and p.pick in p.explain
  p = paper_plan("65b", memory="16GB", nodes=2)
  assert p.pick is None and p.explain.startswith("nothing fits")


def test_traffic_is_costs_step_traffic():
  """The planner times exactly costs.step_traffic's bytes, phase by phase (no second formula)."""
  cfg = get_config("7b")
  w = planner.Workload(cfg, micro_batches=4, trainable=cfg.param_count() // 100)
  cluster = planner.Cluster(4, 8, planner.Links(12.5e9, 300e9), 312e12)
  regathered = Llama(cfg).layer_param_count()
  assert w.layer_params == regathered
  for name in VALID_NAMES:
    s = parse_strategy(name)
    e = planner.estimate(s, w, cluster)
    t = step_traffic(s, w.psi, w.psi_trained, 4, 8, 4, 2, 2, regathered=regathered)
    assert e.traffic["phases"] == t.phases and e.traffic["inter_bytes"] == t.inter
    assert set(t.phases) <= set(planner.schedule(s, w)), name
    comm = sum(
      planner.collective_seconds(
        *planner.schedule(s, w)[k][:2], b, planner.schedule(s, w)[k][2], cluster
      )
      for k, b in t.phases.items()
    )
    assert e.step_time_s == pytest.approx(e.times["compute"] + comm)


def test_global_collective_models_and_overlap():
  """Two levels send 1/m of a global collective between nodes; overlapping them is faster
  still; hiding traffic behind compute only shortens the step."""
  cfg = get_config("7b")
  w = planner.Workload(cfg)
  times = {}
  for model in planner.GLOBAL_MODELS:
    net = planner.Links(12.5e9, 300e9, global_collectives=model)
    times[model] = planner.estimate(
      parse_strategy("GGG"), w, planner.Cluster(16, 8, net, 312e12)
    ).step_time_s
  assert times["flat"] > times["hierarchical"] > times["overlapped"]
  net = planner.Links(12.5e9, 300e9)
  plain, hidden = (
    planner.estimate(parse_strategy("IIG"), w, planner.Cluster(16, 8, net, 312e12, overlap=o))
    for o in (0.0, 1.0)
  )
  per_mb = plain.times["param_gathers"] + plain.times["grad_traffic"]
  assert hidden.step_time_s == pytest.approx(
    plain.step_time_s - min(per_mb, plain.times["compute"])
  )


def test_layer_params_match_the_model():
  for cfg in PRESETS.values():
    assert planner.Workload(cfg).layer_params == Llama(cfg).layer_param_count()


@pytest.mark.parametrize(
  "text,expected",
  [
    ("80GB", 80e9),
    ("80GiB", 80 * 2**30),
    ("512MiB", 512 * 2**20),
    ("1.5TB", 1.5e12),
    ("4096", 4096),
    ("64KiB", 65536),
  ],
)
def test_parse_size(text, expected):
  assert units.parse_size(text) == pytest.approx(expected)


@pytest.mark.parametrize(
  "text,expected",
  [
    ("300GB/s", 300e9),
    ("100gbit", 12.5e9),
    ("100Gb/s", 12.5e9),
    ("25GiB/s", 25 * 2**30),
    ("400mbit", 50e6),
    ("10gbps", 10e9),
  ],
)  # tc's gbps is gigabytes per second
def test_parse_bandwidth(text, expected):
  assert units.parse_bandwidth(text) == pytest.approx(expected)


@pytest.mark.parametrize(
  "fn,text",
  [
    (units.parse_size, "80 gigs"),
    (units.parse_size, "-1GB"),
    (units.parse_size, "80GB/s"),
    (units.parse_bandwidth, "fast"),
    (units.parse_bandwidth, "300GB"),
  ],
)
def test_parsers_refuse_with_an_example(fn, text):
  with pytest.raises(ValueError, match=f"bad .*{text!r}: write .*e.g."):
    fn(text)


PLAN = [
  "plan",
  "--model",
  "7b",
  "--nodes",
  "16",
  "--devices-per-node",
  "8",
  "--device-memory",
  "80GB",
  "--inter-bandwidth",
  "100gbit",
  "--intra-bandwidth",
  "300GB/s",
  "--micro-batch",
  "1",
  "--micro-batches",
  "8",
]


def test_plan_json_schema(capsys):
  main([*PLAN, "--trainable-fraction", "0.003", "--json"])
  out = json.loads(capsys.readouterr().out)
  assert out["pick"] in VALID_NAMES and out["explain"]
  assert len(out["ranking"]) == 14 and out["ranking"][0]["strategy"] == out["pick"]
  for row in out["ranking"]:
    assert {"strategy", "fits", "memory_bytes", "step_time_s", "tokens_per_s", "times"} <= set(row)
    assert set(row["times"]) == {
      "compute",
      "param_gathers",
      "grad_traffic",
      "grad_sync",
      "param_sync",
    }
  fits = [r["fits"] for r in out["ranking"]]
  assert fits == sorted(fits, reverse=True)  # fitting ones first


def test_plan_table(capsys):
  main(PLAN)
  out = capsys.readouterr().out
  assert "ZeRO-3" in out and "pick " in out and out.count("\n") > 15


@pytest.mark.parametrize(
  "argv,message",
  [
    (["--model", "70b"], "unknown model preset '70b'"),
    (["--device-memory", "80 gigs"], "bad --device-memory '80 gigs'"),
    (["--inter-bandwidth", "fast"], "bad --inter-bandwidth 'fast'"),
    (["--intra-latency", "soon"], "bad --intra-latency 'soon'"),
    (["--nodes", "0"], "nodes (0) and devices per node (8) must be >= 1"),
    (["--gpu", "tpu"], "unknown --gpu 'tpu'"),
    (["--trainable-fraction", "2"], "--trainable-fraction must be in (0, 1]"),
    (["--profile", "/nonexistent/probe.json"], "profile '/nonexistent/probe.json' does not exist"),
  ],
)
def test_plan_bad_input(capsys, argv, message):
  with pytest.raises(SystemExit) as e:
    main([*PLAN, *argv])
  assert e.value.code == 2
  assert message in capsys.readouterr().err


def test_plan_devices_that_do_not_divide_the_model(capsys):
  """tiny's dimension 128 does not split 24 ways: the globally sharded strategies are marked."""
  main(["plan", "--model", "tiny", "--nodes", "3", "--devices-per-node", "8", "--json"])
  rows = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)["ranking"]}
  for name, row in rows.items():
    assert row["feasible"] == (name[2] != "G"), name
    if not row["feasible"]:
      assert not row["fits"] and "does not split 24 ways" in row["note"]


def test_probe_measures_every_collective_and_level(tmp_path):
  from paro_jax.core.mesh import make_mesh
  from paro_jax.analysis.probe import probe, write_profile

  profile = probe(make_mesh(2, 4), sizes=(4096, 65536), repeats=1)
  for kind in names.SCHEDULE_COLLECTIVES:
    for level in names.LEVELS:
      fit = profile["collectives"][kind][level]
      assert fit["bandwidth"] > 0 and fit["latency"] >= 0, (kind, level)
  assert profile["flop_per_s"] > 0
  path = tmp_path / "probe.json"
  write_profile(profile, str(path))
  assert len(planner.measured_links(planner.load_profile(str(path)))) == 9
  name, why = planner.choose_strategy(
    get_config("tiny"), 2, 4, 1, 2, 64, 4, planner.load_profile(str(path))
  )
  assert name in VALID_NAMES and name in why


def test_fit_line():
  from paro_jax.analysis.probe import fit_line

  bw, lat = fit_line([(1e6, 1e-4 + 1e6 / 2e9), (4e6, 1e-4 + 4e6 / 2e9), (8e6, 1e-4 + 8e6 / 2e9)])
  assert bw == pytest.approx(2e9) and lat == pytest.approx(1e-4)
  bw, lat = fit_line([(1e3, 2e-4), (1e4, 1e-4)])  # latency-bound noise: still positive
  assert bw == pytest.approx(1e4 / 1e-4) and lat == pytest.approx(1e-4)


def test_train_strategy_auto(tmp_path, capsys):
  out = tmp_path / "run"
  main(
    [
      "train",
      "--strategy",
      "auto",
      "--model",
      "test",
      "--mesh",
      "2x4",
      "--steps",
      "2",
      "--batch-size",
      "8",
      "--seq-len",
      "16",
      "--dtype",
      "fp32",
      "--out",
      str(out),
    ]
  )
  text = capsys.readouterr().out
  line = next(x for x in text.splitlines() if "--strategy auto picked" in x)
  pick = line.split("picked ")[1][:3]
  assert pick in VALID_NAMES and f"strategy {pick} on mesh 2x4" in text
  rows = (out / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(r)["step"] for r in rows] == [1, 2]


# --- experiments/validate_planner.py ----------------------------------------------------------
def test_ranks_and_spearman():
  assert validate_planner.ranks([3.0, 1.0, 3.0, 2.0]) == [3.5, 1.0, 3.5, 2.0]
  assert validate_planner.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
  assert validate_planner.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
  # Ties: x has ranks (1.5, 1.5, 3, 4), y is increasing.
  assert validate_planner.spearman([1, 1, 2, 3], [1, 2, 3, 4]) == pytest.approx(
    validate_planner.pearson([1.5, 1.5, 3, 4], [1, 2, 3, 4])
  )


def test_nnls_recovers_nonnegative_coefficients():
  rows = [[1.0, x, x * x] for x in range(6)]
  assert validate_planner.nnls(rows, [2 + 3 * r[1] for r in rows]) == pytest.approx(
    [2, 3, 0], abs=1e-9
  )
  ys = [2 - 3 * r[1] for r in rows]  # the best fit has a negative slope: clipped to 0
  assert min(validate_planner.nnls(rows, ys)) >= 0


def _truth():
  """The constants the synthetic benchmarks' "measured" step times are made with."""
  return validate_planner.Constants(
    1 / 0.8e9, {"all_gather": 2e-4, "reduce_scatter": 9e-4, "all_reduce": 5e-4}, 2e-9, 1.1, "truth"
  )


def _synthetic_bench(truth):
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
        t = validate_planner.predict(bench, g, a, [n], truth).ranking[0].step_time_s
        bench["runs"].append(
          {"regime": g["regime"], "name": n, "micro_batches": a, "median_step_s": t}
        )
  return bench


def test_validation_on_noise_free_synthetic_results(tmp_path):
  """Results the planner's own model produced: the fit reproduces them, rank correlation 1."""
  truth = _truth()
  bench = _synthetic_bench(truth)
  path = tmp_path / "strategies.json"
  path.write_text(json.dumps(bench))
  assert validate_planner.main(["--results", str(path), "--out", str(tmp_path / "out")]) == 0
  summary = json.loads((tmp_path / "out" / "validate.json").read_text())
  assert [(r["regime"], r["micro_batches"]) for r in summary["results"]] == [
    ("slow", 1),
    ("slow", 4),
  ]
  for r in summary["results"]:
    assert r["spearman"] == pytest.approx(1.0) and r["pick_speed_vs_best"] >= 1 - planner.TIE
    assert r["strategies"] == 14
  assert summary["met"]
  assert (tmp_path / "out" / "validate.md").read_text().startswith("# Planner against")


def test_validation_judges_the_pick_on_the_remeasured_contenders(tmp_path):
  """--remeasured: the pick is compared with the contenders measured again; a (regime, A) whose
  contenders were not all re-measured keeps the full run's figure."""
  truth = _truth()
  path = tmp_path / "strategies.json"
  path.write_text(json.dumps(_synthetic_bench(truth)))
  assert validate_planner.main(["--results", str(path), "--out", str(tmp_path / "a")]) == 0
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
    validate_planner.main(
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
  assert a1["pick_speed_vs_best"] >= 1 - planner.TIE  # the full run's figure is kept beside it
  assert not a4["remeasured"]["covered"] and len(a4["remeasured"]["missing"]) == 14
  assert validate_planner.pick_score(a4) == a4["pick_speed_vs_best"]
  assert not summary["met"]  # judged on the re-measured 0.8
  md = (tmp_path / "b" / "validate.md").read_text()
  assert "Re-measured (`again`: 7 steps" in md and "not re-measured" in md
  # A=1 was re-measured in full: ranked on both runs too (the re-measurement alone ties 13
  # strategies, so its correlation with the prediction is well below the full run's 1).
  full = a1["remeasured"]["all"]
  assert full["spearman_again"] < 0.5 and set(full["combined_step_s"]) == set(VALID_NAMES)
  assert full["runs"] == 2 and validate_planner.spearman_score(a1) == full["spearman_combined"]
  assert "all" not in a4["remeasured"]
  assert validate_planner.spearman_score(a4) == a4["spearman"]


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
    validate_planner.main(
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
    validate_planner.main(
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
  assert validate_planner.contenders(measured, "GGG", 0.15) == ["GGG", "INI", "NNI"]
  assert validate_planner.contenders(measured, "NNI", 0.2) == ["III", "INI", "NNI"]


def test_noise_sigma_ignores_a_common_shift_and_the_unshaped_reference():
  first = {("slow", 1): {"A": 1.0, "B": 2.0, "C": 4.0}, ("unshaped", 1): {"A": 1.0, "B": 1.0}}
  shifted = {
    ("slow", 1): {"A": [1.1], "B": [2.2], "C": [4.4]},
    ("unshaped", 1): {"A": [9.0], "B": [1.0]},
  }
  got = validate_planner.noise_sigma(first, shifted)
  assert got["pairs"] == 3 and got["sigma"] == pytest.approx(0.0, abs=1e-12)
  assert got["mean_log_ratio"] == pytest.approx(math.log(1.1))
  noisy = {("slow", 1): {"A": [1.0], "B": [4.0], "C": [4.0]}}
  logs = [0.0, math.log(2.0), 0.0]
  assert validate_planner.noise_sigma(first, noisy)["sigma"] == pytest.approx(
    statistics.stdev(logs) / math.sqrt(2)
  )
  # Every re-measurement of a configuration is one pair with the full run.
  twice = {("slow", 1): {"A": [1.0, 2.0], "B": [4.0]}}
  logs = [0.0, math.log(2.0), math.log(2.0)]
  got = validate_planner.noise_sigma(first, twice)
  assert got["pairs"] == 3 and got["sigma"] == pytest.approx(statistics.stdev(logs) / math.sqrt(2))
  assert validate_planner.noise_sigma(first, {("slow", 1): {"A": [1.0]}}) is None


def test_spearman_ceiling_falls_with_noise_against_the_spread():
  spread = [2.0**k for k in range(10)]  # neighbours 2x apart
  assert validate_planner.spearman_ceiling(spread, 0.0, draws=50) == pytest.approx(1.0)
  assert validate_planner.spearman_ceiling(spread, 0.02, draws=200) == pytest.approx(1.0)
  close = [1.0 + 0.001 * k for k in range(10)]  # 0.1% apart, 30% noise: ranks are a lottery
  assert abs(validate_planner.spearman_ceiling(close, 0.3, draws=200)) < 0.5


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
      t = validate_planner.predict(bench, slower, a, [n], truth).ranking[0].step_time_s
      second["runs"].append({"regime": "slower", "name": n, "micro_batches": a, "median_step_s": t})
  paths = [tmp_path / "first.json", tmp_path / "second.json"]
  paths[0].write_text(json.dumps(bench))
  paths[1].write_text(json.dumps(second))
  assert (
    validate_planner.main(
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
    validate_planner.main(
      ["--results", str(paths[0]), "--results", str(paths[2]), "--out", str(tmp_path / "x")]
    )
  clash = json.loads(paths[1].read_text())
  clash["runs"][0]["median_step_s"] *= 2
  paths.append(tmp_path / "clash.json")
  paths[-1].write_text(json.dumps(clash))
  with pytest.raises(ValueError, match="unshaped .* measured in two --results files"):
    validate_planner.main(
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

  got = validate_planner.remeasured_times([bench(2.0), bench(2.0), bench(3.0)])
  assert got == {("slow", 1): {"IIG": [2.0, 3.0]}}
  assert validate_planner.gmean([2.0, 8.0]) == pytest.approx(4.0)
