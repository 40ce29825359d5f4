"""The strategy benchmark's pieces that need no cluster (experiments/bench/): link-rate mapping,
the run list and its labels, the report's comparisons per label, and the compile child."""

import argparse
import json
import os
import subprocess
import sys

import pytest

from models.presets import get_config

from experiments.bench import calibration, configs, report, runs, strategies
from experiments.bench.configs import Config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "experiments", "bench_strategies.py")


def test_regime_link_rates():
  # 5 GFLOP/s per device, 4 devices a node; paper cloud = 21,000 FLOP per (bf16) byte. With fp32
  # on the wire (4 bytes a value) the link is twice as fast: the same FLOP per value moved.
  table = calibration.regimes_table(["paper_cloud", "1gbit"], 5e9, 4)
  regimes = {g["regime"]: g for g in table}
  want_bps = 4 * 5e9 * (4 / 2) / 21_000 * 8
  assert regimes["paper_cloud"]["rate"] == f"{want_bps / 1e6:.0f}mbit"
  assert regimes["1gbit"]["rate_bps"] == 1e9
  assert regimes["1gbit"]["flop_per_byte"] == pytest.approx(4 * 5e9 * 2 / (1e9 / 8))
  assert list(regimes)[-1] == calibration.UNSHAPED  # the reference runs last


def test_collectives_for_parsing_and_the_run_list():
  per = configs.parse_collectives_for(["GGG,igg=xla,hring", "GGG=horing,hring"])
  assert per == {"GGG": ["xla", "hring", "horing"], "IGG": ["xla", "hring"]}
  assert configs.parse_collectives_for(None) == {}
  for bad, match in [
    ("GGG", "STRATEGIES=IMPLEMENTATIONS"),
    ("GGG=", "STRATEGIES=IMPLEMENTATIONS"),
    ("XYZ=xla", "unknown strategies"),
    ("GGG=fast", "unknown collectives"),
  ]:
    with pytest.raises(ValueError, match=match):
      configs.parse_collectives_for([bad])
  # The listed strategies run once per implementation (the default one keeps the plain label);
  # IGG, not in --strategies, is added after them; the baselines come last.
  got = configs.run_list(["IIG", "GGG"], ["jit-fsdp"], "xla", per)
  assert [c.label for c in got] == [
    "IIG",
    "GGG",
    "GGG/hring",
    "GGG/horing",
    "IGG",
    "IGG/hring",
    "jit-fsdp",
  ]
  assert [c.kind for c in got] == ["paro"] * 6 + ["jit"]
  assert got[3] == Config("paro", "GGG", "horing", "GGG/horing")
  assert got[1].collectives == "xla" and got[-1].collectives is None
  # A label names its configuration back (the compile child gets labels).
  for c in got:
    assert Config.from_label(c.label, "xla") == c
  # Against another default the plain label is that default's run.
  assert Config.from_label("GGG", "horing") == Config("paro", "GGG", "horing", "GGG")
  assert [c.label for c in configs.run_list(["GGG"], [], "horing", {"GGG": ["xla"]})] == ["GGG/xla"]
  # The command line: --collectives-for repeats; a bad spec is refused by name.
  args = strategies.parser().parse_args(
    [
      "--strategies",
      "IIG",
      "--baselines",
      "",
      "--collectives",
      "xla",
      "--collectives-for",
      "GGG=xla,horing",
      "--collectives-for",
      "NGG=hring",
    ]
  )
  assert [c.label for c in strategies.run_list(args)] == ["IIG", "GGG", "GGG/horing", "NGG/hring"]
  args.collectives_for = ["GGG=warp"]
  with pytest.raises(SystemExit, match="unknown collectives"):
    strategies.run_list(args)
  # Each label has its own run directory.
  regime = {"regime": "slow"}
  assert runs.run_dir("out", regime, got[3], 4) == os.path.join(
    "out", "runs", "slow", "GGG@horing_A4"
  )
  assert runs.run_dir("out", regime, got[1], 1) == os.path.join("out", "runs", "slow", "GGG_A1")


def _row(regime, label, a, step_s, kind=None):
  name, _, impl = label.partition("/")
  row = {"regime": regime, "name": name, "micro_batches": a, "wall_s": 10.0}
  if kind is not None:  # rows written before labels have none of these keys
    row.update(kind=kind, label=label, collectives=impl or "xla")
  return dict(row, median_step_s=step_s, tokens_per_s=1000 / step_s, wire_per_step={"total": 2**20})


def _rows():
  """Two collectives of GGG (and IIG, a baseline) in one shaped regime and unshaped."""
  rows = []
  for regime, slow in (("slow", 4.0), (calibration.UNSHAPED, 1.0)):
    rows += [
      _row(regime, "GGG", 1, 2.0 * slow),  # an old row: no label, kind or collectives
      _row(regime, "GGG/horing", 1, 1.0 * slow, "paro"),
      _row(regime, "IIG", 1, 0.5 * slow, "paro"),
      _row(regime, "jit-fsdp", 1, 1.6 * slow, "jit"),
    ]
  return rows


def test_summary_keeps_the_labels_of_one_strategy_apart(tmp_path):
  hlo = {"GGG/1": {"measured": {"inter_bytes": 8.0}}, "GGG/horing/1": {"measured": {}}}
  rows = report.summarize(_rows(), hlo, "GGG")
  by = {(r["regime"], configs.label_of(r)): r for r in rows}
  ggg, horing = by[("slow", "GGG")], by[("slow", "GGG/horing")]
  # Overhead against the same label's unshaped run, throughput against GGG's (xla) run.
  assert ggg["comm_overhead"] == pytest.approx(4.0) and horing["comm_overhead"] == pytest.approx(4)
  assert horing["throughput_vs_ggg"] == pytest.approx(2.0) and ggg["throughput_vs_ggg"] == 1.0
  assert ggg["hlo_inter_bytes_per_device"] == 8.0 and horing["hlo_inter_bytes_per_device"] is None
  (s,) = report.summary(rows, "GGG")
  assert s["ranking"] == ["IIG", "GGG/horing", "GGG"]
  assert s["best"] == "IIG" and s["vs_GGG"] == pytest.approx(4.0)
  assert s["best_jit"] == "jit-fsdp" and s["vs_best_jit"] == pytest.approx(3.2)
  md = report.markdown(
    rows,
    [],
    {"single_device": {"flop_per_s": 1e9}, "effective_flop_per_s_per_device": 1e9},
    _meta(),
  )
  assert "| slow | GGG/horing | horing | 1 | 4.000 | 250 | 4.00 | 2.00 |" in md
  assert "| slow | GGG | xla | 1 | 8.000 | 125 | 4.00 | 1.00 |" in md  # an old row: xla
  assert "vs GGG (ZeRO-3)" in md and "| IIG GGG/horing GGG |" in md

  # Relative to another configuration: its label names the keys and columns.
  rows = report.summarize(rows, hlo, "GGG/horing")
  assert all("throughput_vs_ggg" not in r for r in rows)  # no stale comparison is left
  assert by[("slow", "GGG")]["throughput_vs_ggg/horing"] == pytest.approx(0.5)
  (s,) = report.summary(rows, "GGG/horing")
  assert s["vs_GGG/horing"] == pytest.approx(2.0) and "vs_GGG" not in s
  md = report.markdown(
    rows,
    [],
    {"single_device": {"flop_per_s": 1e9}, "effective_flop_per_s_per_device": 1e9},
    _meta(),
    "GGG/horing",
  )
  assert "| vs GGG/horing | vs NGG (ZeRO-2) |" in md and "| vs GGG/horing | wire MiB/step" in md


def _meta():
  return {
    "command": "synthetic",
    "machine": "test",
    "model": "tiny",
    "batch_size": 32,
    "seq_len": 512,
    "dtype": "fp32",
    "steps": 3,
    "skip": 1,
  }


def test_report_only_rewrites_the_tables_relative_to_the_reference(tmp_path, capsys):
  result = {
    "meta": _meta(),
    "calibration": {"single_device": {"flop_per_s": 1e9}, "effective_flop_per_s_per_device": 1e9},
    "regimes": calibration.regimes_table(["1gbit"], 1e9, 4),
    "hlo": {},
    "runs": _rows(),
  }
  (tmp_path / "strategies.json").write_text(json.dumps(result))
  strategies.main(["--report-only", "--out", str(tmp_path)])
  assert "| slow | 1 | IIG | 500 | 4.00x |" in (tmp_path / "strategies.md").read_text()
  strategies.main(["--report", "--out", str(tmp_path), "--reference", "GGG/horing"])
  written = json.loads((tmp_path / "strategies.json").read_text())
  assert written["summary"][0]["vs_GGG/horing"] == pytest.approx(2.0)
  assert "| vs GGG/horing |" in (tmp_path / "strategies.md").read_text()
  capsys.readouterr()


def test_wire_monitor_counts_the_steps_after_skip():
  mon = runs.WireMonitor("unused", tag=0)
  # metrics.jsonl lines seen -> (time, {node: tc bytes so far}); the line of step 1 includes
  # setup and compilation.
  mon.samples = {
    1: (0.0, {0: 500, 1: 700}),
    2: (1.0, {0: 600, 1: 900}),
    3: (2.0, {0: 700, 1: 1100}),
  }
  got = mon.per_step_bytes(skip=1)
  assert got == {"per_node": {0: 100.0, 1: 200.0}, "total": 300.0, "steps": 2}
  assert mon.per_step_bytes(skip=3) is None


def test_resume_reuses_a_row_of_the_same_label_rate_collectives_and_remat(tmp_path, monkeypatch):
  ran = []
  monkeypatch.setattr(runs, "command", lambda *a: ["train"])
  monkeypatch.setattr(runs, "launch_row", lambda *a: ran.append(a[2].label) or {"new": True})
  args = argparse.Namespace(resume=True, remat="full")
  regime = {"regime": "slow", "rate": "17mbit"}
  ggg = Config.paro("GGG", "xla", "xla")
  directory = runs.run_dir(str(tmp_path), regime, ggg, 1)
  os.makedirs(directory)
  # A row written before labels: name only.
  row = {"regime": "slow", "rate": "17mbit", "name": "GGG", "micro_batches": 1}
  (tmp_path / directory / "row.json").write_text(json.dumps(row))
  assert runs.run_one(args, regime, ggg, 1, directory) == dict(row, resumed=True)
  assert runs.run_one(args, dict(regime, rate="44mbit"), ggg, 1, directory) == {
    "new": True,
    "remat": "full",
  }
  (tmp_path / directory / "row.json").write_text(json.dumps(dict(row, collectives="horing")))
  assert runs.run_one(args, regime, ggg, 1, directory) == {"new": True, "remat": "full"}
  assert ran == ["GGG", "GGG"]
  assert json.loads((tmp_path / directory / "row.json").read_text()) == {
    "new": True,
    "remat": "full",
  }
  # A row of another --remat is run again; rows from before the column were remat full.
  (tmp_path / directory / "row.json").write_text(json.dumps(dict(row, remat="full")))
  assert runs.run_one(args, regime, ggg, 1, directory)["resumed"]
  (tmp_path / directory / "row.json").write_text(json.dumps(dict(row, remat="none")))
  assert runs.run_one(args, regime, ggg, 1, directory) == {"new": True, "remat": "full"}
  assert ran == ["GGG", "GGG", "GGG"]


def test_torch_peers_in_the_summary():
  """Torch rows are peers, not strategies: the summary names the fastest and compares the least
  communication overhead of each side; the per-run table says they ran on torch's gloo."""
  rows = _rows()
  for regime, slow in (("slow", 1.0), (calibration.UNSHAPED, 0.0)):
    rows += [
      _row(regime, "torch-full_shard", 1, 3.0 if slow else 1.5, "torch"),
      _row(regime, "torch-hsdp_deferred", 1, 0.8 if slow else 0.6, "torch"),
    ]
  rows = report.summarize(rows, {}, "GGG")
  (s,) = report.summary(rows, "GGG")
  assert s["ranking"] == ["IIG", "GGG/horing", "GGG"]  # ours only
  assert s["best_torch"] == "torch-hsdp_deferred"
  assert s["vs_best_torch"] == pytest.approx((1000 / 2.0) / (1000 / 0.8))
  assert s["min_overhead"] == pytest.approx(4.0)  # every one of ours is 4x slower shaped
  assert s["min_overhead_torch"] == pytest.approx(0.8 / 0.6)
  md = report.markdown(
    rows,
    [],
    {"single_device": {"flop_per_s": 1e9}, "effective_flop_per_s_per_device": 1e9},
    _meta(),
  )
  assert s["min_exposed_s"] == pytest.approx(4.0 * 0.5 - 0.5)  # IIG: 2.0 s shaped, 0.5 unshaped
  assert s["min_exposed_s_torch"] == pytest.approx(0.8 - 0.6)
  assert "| 0.40x (torch-hsdp_deferred) | 4.00 / 1.33 | 1.5 / 0.2 |" in md
  assert "| slow | torch-full_shard | torch gloo | 1 | 3.000 |" in md
  torch = Config("torch", "full_shard", None, "torch-full_shard")
  with pytest.raises(ValueError, match="torch_row"):
    runs.command(None, torch, 1, "unused")


def test_inspect_child_strategy_and_baseline():
  """The benchmark's compile child: a PaRO strategy's traffic is the formula's, the plain-jit
  FSDP baseline (weights constrained to replicated per layer) gathers its weights, and a label
  with other collectives compiles with them."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = REPO
  proc = subprocess.run(
    [
      sys.executable,
      SCRIPT,
      "--child",
      "inspect",
      "--model",
      "test",
      "--names",
      "GGG,GGG/hring,jit-fsdp",
      "--collectives",
      "xla",
      "--micro-batches",
      "1",
      "--batch-size",
      "8",
      "--seq-len",
      "8",
      "--dtype",
      "fp32",
      "--mesh",
      "2x4",
    ],
    capture_output=True,
    text=True,
    env=env,
    cwd=REPO,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = next(x for x in proc.stdout.splitlines() if x.startswith("INSPECT "))
  out = json.loads(line[len("INSPECT ") :])
  ggg, fsdp = out["GGG/1"], out["jit-fsdp/1"]
  assert ggg["measured"]["inter_bytes"] == pytest.approx(ggg["expected"]["inter_bytes"], rel=0.01)
  # H-Ring runs GGG's global collectives hierarchically: only its inter-level steps cross the
  # node boundary (the two-level formula), where XLA's one flat ring crosses it with every byte;
  # the same bytes in all.
  hring = out["GGG/hring/1"]
  for level in ("inter_bytes", "intra_bytes"):
    assert hring["measured"][level] == pytest.approx(hring["expected"][level], rel=0.01)
  total = lambda r: r["expected"]["inter_bytes"] + r["expected"]["intra_bytes"]
  assert total(hring) == pytest.approx(total(ggg))
  assert hring["measured"]["inter_bytes"] < 0.5 * ggg["measured"]["inter_bytes"]
  # The baseline holds fp32 weights and both Adam moments, every leaf sharded 8 ways: 12 bytes a
  # parameter over 8 devices (the moments' step counter adds a few bytes).
  psi = get_config("test").param_count()
  assert fsdp["model_states_bytes"] == pytest.approx(12 * psi / 8, rel=0.01)
  # XLA's schedule gathers every fp32 weight at least once per step, (n-1)/n x 4 bytes x psi per
  # device; with activations batch-sharded it moves no more than a few times GGG's traffic.
  assert 7 / 8 * 4 * psi <= fsdp["measured"]["inter_bytes"] < 4 * ggg["measured"]["inter_bytes"]


def test_auto_default_and_torch_peers_in_the_run_list():
  """The default collectives are train's `auto` on this cluster, resolved per strategy and kept
  in the configuration (so the compile child and train run the same program); torch peers are
  configurations labelled torch-PEER."""
  got = configs.run_list(["GGG", "IIG"], ["jit-fsdp"], "auto", None, ["full_shard", "hsdp"])
  assert [(c.kind, c.label, c.collectives) for c in got] == [
    ("paro", "GGG", "hring+xla"),  # collectives over both axes: a ring per level
    ("paro", "IIG", "xla"),  # one-level collectives only
    ("jit", "jit-fsdp", None),
    ("torch", "torch-full_shard", None),
    ("torch", "torch-hsdp", None),
  ]
  for c in got:
    assert Config.from_label(c.label, "auto") == c
  assert configs.parse_torch_peers("all") == ["full_shard", "hsdp", "hsdp_deferred", "ddp_no_sync"]
  assert configs.parse_torch_peers("") == []
  with pytest.raises(ValueError, match="unknown peers.*fsdp1"):
    configs.parse_torch_peers("fsdp1")
  args = strategies.parser().parse_args(["--strategies", "NNI", "--torch-peers", "ddp_no_sync"])
  assert [c.label for c in strategies.run_list(args)][-1] == "torch-ddp_no_sync"


def test_remat_reaches_every_configuration():
  """--remat is the models' policy names, goes to every command (train, the jit and inspect
  children, the torch peers) and is refused with torch peers where torch has no counterpart."""
  from models.llama import REMAT_POLICIES

  assert configs.REMAT == tuple(REMAT_POLICIES)
  args = strategies.parser().parse_args(["--remat", "none", "--steps", "2"])
  for config in (Config.paro("IIG", "xla", "xla"), Config.from_label("jit-hsdp", "xla")):
    argv = runs.command(args, config, 4, "out")
    assert argv[argv.index("--remat") + 1] == "none"
  assert runs.common_flags(args, 4, "out").count("--remat") == 1  # the torch peers' flags
  args = strategies.parser().parse_args(["--remat", "layer", "--torch-peers", "hsdp"])
  with pytest.raises(SystemExit, match="--remat layer has no torch counterpart"):
    strategies.run_list(args)
