"""`plan --target --compile-top K`: which strategies are compiled (analysis/planner/rerank.py).

The compile itself is `inspect --target`'s, tested in test_estimate.py; here only the choice of
candidates, on plans whose step times are read back from the plan.
"""

import pytest

from models.presets import get_config
from paro_jax.analysis.planner import inputs, planner, rerank

INPUTS = {"device_memory_bytes": 80e9, "usable_memory": 0.9}  # what run_plan records


@pytest.mark.parametrize("gbit,k", [(25, 1), (100, 3), (400, 5)])
def test_candidates_are_top_k_and_near_ties(gbit, k):
  w = inputs.Workload(get_config("7b"), micro_batches=8)
  links = inputs.Links(gbit * 1e9 / 8, 300e9)
  p = planner.plan(w, inputs.Cluster(4, 8, links, 989e12, device_memory=80e9), INPUTS)
  fitting = sorted((e for e in p.ranking if e.fits), key=lambda e: e.step_time_s)
  chosen = rerank.candidates(p, k)
  assert chosen[: min(k, len(fitting))] == [e.strategy for e in fitting[:k]]
  for e in fitting[k:]:
    near = e.step_time_s <= fitting[0].step_time_s * 1.1
    assert (e.strategy in chosen) == near, e.strategy
  for e in p.ranking:
    if not e.fits:  # compiled only when faster and within the memory model's error of the budget
      slack = e.memory_bytes <= 80e9 * 0.9 * 1.3 and e.step_time_s < fitting[0].step_time_s
      assert (e.strategy in chosen) == (slack and e.feasible), e.strategy


def test_a_faster_strategy_just_over_the_memory_budget_is_compiled():
  """65b on 4 x 8 H100, A=8: the analytic memory puts IIG at 72.3 GB against the 72.0 GB budget
  (its compiled peak is 70.4 GB, experiments/results/gpu_estimates), ahead of IGG, the first that
  fits; IIG is compiled after the fitting ones, and the strategies far over are not."""
  w = inputs.Workload(get_config("65b"), micro_batches=8)
  links = inputs.Links(100e9 / 8, 300e9)
  p = planner.plan(w, inputs.Cluster(4, 8, links, 989e12, device_memory=80e9), INPUTS)
  iig = p.get("IIG")
  assert not iig.fits and 72e9 < iig.memory_bytes < 72e9 * 1.3
  chosen = rerank.candidates(p, 3)
  assert chosen[:3] == [e.strategy for e in p.ranking if e.fits][:3]
  assert "IIG" in chosen[3:]
  assert "NNN" not in chosen  # 1.2 TB


def test_table_shows_xla_and_repriced_steps_beside_the_analytic_rank():
  w = inputs.Workload(get_config("7b"), micro_batches=8)
  p = planner.plan(
    w, inputs.Cluster(4, 8, inputs.Links(100e9 / 8, 300e9), 989e12, device_memory=80e9)
  )
  order = [e.strategy for e in sorted(p.ranking, key=lambda e: e.step_time_s) if e.fits]
  other = next(s for s in order if s != p.pick)
  est = dict(step_s=2.5, compute_s=2.0, exposed_comm_s=0.5, step_s_repriced=2.1, step_bound="link")
  r = {
    "target": "h100",
    "k": 2,
    "within": 0.1,
    "pick": other,  # XLA's fastest below
    "compiled": [
      {"strategy": p.pick, "estimate": {**est, "step_s": 3.0}, "fits": True, "compile_s": 60},
      {"strategy": other, "estimate": est, "fits": True, "compile_s": 50, "compiled_bytes": 3e10},
    ],
    "memory_slack": 0.3,
    "budget_bytes": 72e9,
  }
  r["compiled"][0]["compiled_bytes"] = 2e10
  lines = rerank.format_rerank(p, r).splitlines()
  assert lines[1].split() == [
    "#", "strategy", "step", "s", "compute", "exposed", "repriced", "analytic", "s",
    "analytic", "#", "compile", "s", "memory", "set", "by",
  ]  # fmt: skip
  row = lines[2].split()
  assert row[:6] == ["1", other, "2.500", "2.000", "0.500", "2.100"]
  assert row[7] == str(order.index(other) + 1)
  assert row[9:] == ["30.0", "GB", "link"]
  assert lines[-1] == f"pick by XLA's estimate: {other} (differs from the analytic {p.pick})"
  # XLA's fastest is the analytic pick: the last line says so, with its object
  r["compiled"][0]["estimate"]["step_s"] = 2.0
  last = rerank.format_rerank(p, {**r, "pick": p.pick}).splitlines()[-1]
  assert last == f"pick by XLA's estimate: {p.pick} (agrees with the analytic pick)"


# --- `train --strategy auto` on GPUs (analysis/planner/auto.py) ---------------------------------
def _tiny_plan():
  """The plan `train --strategy auto` makes for tiny on a probed 2x4 mesh of 80 GB devices."""
  profile = {"flop_per_s": 400e12, "collectives": {}}
  p = planner.plan_for_profile(get_config("tiny"), 2, 4, 1, 2, 64, 2, profile, device_memory=80e9)
  assert p.pick is not None and p.inputs["device_memory_bytes"] == 80e9
  return p


def test_auto_on_a_gpu_without_xla_times_keeps_the_analytic_pick():
  from paro_jax.analysis.planner import auto

  p = _tiny_plan()
  for kind, reason in [
    ("NVIDIA A100-SXM4-80GB", "no time-based estimator for compute capability 8.0"),
    ("Tesla T4", "no --target describes a Tesla T4"),
  ]:
    pick, why, table = auto.check_by_xla(p, [], kind, None, 3)
    assert (pick, table) == (p.pick, None) and reason in why, why
  pick, why, table = auto.check_by_xla(p, [], "NVIDIA H100 80GB HBM3", None, 0)
  assert (pick, table) == (p.pick, None) and why.startswith("--compile-top 0: the analytic pick")


def test_auto_on_h100_compiles_the_runs_step_and_picks_by_xla(monkeypatch):
  """On an H100 (its device_kind), the candidates are compiled for the run's own step by
  `inspect --target h100` and the fastest by XLA's estimate is taken: one compile here."""
  from paro_jax.analysis.planner import auto
  from paro_jax.core.config import LoraOptions
  from paro_jax.run.config import RunConfig

  monkeypatch.setattr(rerank, "WITHIN", 0.0)  # the top 1 alone: one compile
  p = _tiny_plan()
  step = RunConfig(
    strategy="auto", micro_batches=2, batch_size=8, seq_len=64, lora=LoraOptions(rank=2)
  )
  flags = auto.run_step_flags(step, (2, 4), "xla", "xla")
  pick, why, table = auto.check_by_xla(p, flags, "NVIDIA H100 80GB HBM3", 100e9, 1)
  (compiled,) = [c for c in rerank.candidates(p, 1)]
  assert pick == compiled, why
  assert why.startswith("fastest by XLA's estimate of the compiled step for h100 at 100 Gbit/s")
  assert f"(analytic pick {p.pick})" in why
  rows = [line.split() for line in table.splitlines() if line.split()[:2] == ["1", pick]]
  assert len(rows) == 1 and float(rows[0][2]) > 0  # XLA's step time, in the table
  assert auto.inter_node_bits_per_s(
    {"collectives": {"all_gather": {"inter": {"bandwidth": 3.125e9}}}}, 4
  ) == pytest.approx(100e9)  # 4 devices of a node at 3.125 GB/s each: 100 Gbit/s
  assert auto.inter_node_bits_per_s({"collectives": {}}, 4) is None
