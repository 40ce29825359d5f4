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
