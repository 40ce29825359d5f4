"""`plan --target --compile-top K`: which strategies are compiled (analysis/plan_compile.py).

The compile itself is `inspect --target`'s, tested in test_estimate.py; here only the choice of
candidates, on plans whose step times are read back from the plan.
"""

import pytest

from models.llama import get_config
from paro_jax.analysis import plan_compile, planner


@pytest.mark.parametrize("gbit,k", [(25, 1), (100, 3), (400, 5)])
def test_candidates_are_top_k_and_near_ties(gbit, k):
  w = planner.Workload(get_config("7b"), micro_batches=8)
  links = planner.Links(gbit * 1e9 / 8, 300e9)
  p = planner.plan(w, planner.Cluster(4, 8, links, 989e12, device_memory=80e9))
  fitting = sorted((e for e in p.ranking if e.fits), key=lambda e: e.step_time_s)
  chosen = plan_compile.candidates(p, k)
  assert chosen[: min(k, len(fitting))] == [e.strategy for e in fitting[:k]]
  for e in fitting[k:]:
    near = e.step_time_s <= fitting[0].step_time_s * 1.1
    assert (e.strategy in chosen) == near, e.strategy
  assert all(p.get(s).fits for s in chosen)


def test_table_shows_xla_and_repriced_steps_beside_the_analytic_rank():
  w = planner.Workload(get_config("7b"), micro_batches=8)
  p = planner.plan(
    w, planner.Cluster(4, 8, planner.Links(100e9 / 8, 300e9), 989e12, device_memory=80e9)
  )
  order = [e.strategy for e in sorted(p.ranking, key=lambda e: e.step_time_s) if e.fits]
  other = next(s for s in order if s != p.pick)
  est = dict(step_s=2.5, compute_s=2.0, exposed_comm_s=0.5, step_s_repriced=2.1)
  r = {
    "target": "h100",
    "k": 2,
    "within": 0.1,
    "pick": other,  # XLA's fastest below
    "compiled": [
      {"strategy": p.pick, "estimate": {**est, "step_s": 3.0}, "fits": True, "compile_s": 60},
      {"strategy": other, "estimate": est, "fits": True, "compile_s": 50},
    ],
  }
  lines = plan_compile.format_rerank(p, r).splitlines()
  assert lines[1].split() == [
    "#", "strategy", "XLA", "step", "s", "compute", "exposed", "repriced", "analytic", "s",
    "analytic", "#", "compile", "s",
  ]  # fmt: skip
  row = lines[2].split()
  assert row[:6] == ["1", other, "2.500", "2.000", "0.500", "2.100"]
  assert row[7] == str(order.index(other) + 1)
  assert lines[-1] == f"pick by XLA's estimate: {other} (differs from the analytic {p.pick})"
