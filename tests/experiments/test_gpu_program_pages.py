"""The GPU program pages (experiments/gpu_program.py: the step compiled for H100 meshes without a
GPU) hold what tests/analysis/test_gpu_program.py checks on the `test` model, for every strategy
with both XLA's collectives and HO-Ring at 7b: the grid the suite compiles only in part."""

import json
import os

import pytest

from paro_jax.core.strategy import VALID_NAMES

RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "results")
GRIDS = ["gpu_program_7b_2x4", "gpu_program_7b_4x8"]  # every strategy, both implementations
PAGES = GRIDS + ["gpu_program_65b_8x8"]  # four strategies at 65b


def reports(page):
  with open(os.path.join(RESULTS, page, "gpu_program.json")) as f:
    page_json = json.load(f)
  return page_json["command"], page_json["reports"]


@pytest.mark.parametrize("page", GRIDS)
def test_every_strategy_with_both_collectives(page):
  _, rows = reports(page)
  got = sorted((r["strategy"], r["impl"]) for r in rows)
  assert got == sorted((s, impl) for s in VALID_NAMES for impl in ("xla", "horing"))


@pytest.mark.parametrize("page", PAGES)
def test_each_compiled_step_is_as_its_formulas_and_asynchronous(page):
  """XLA's collectives move the formula's bytes at both levels (XLA:GPU keeps bf16 on the
  wire); every step issues its collectives asynchronously on a communication stream, none
  synchronously; the compiled program holds at least the model states."""
  command, rows = reports(page)
  model, mesh = page.split("_")[2:4]
  assert f"--model {model} --mesh {mesh}" in command
  for r in rows:
    where = (page, r["strategy"], r["impl"])
    assert f"{r['mesh']['inter']}x{r['mesh']['intra']}" == mesh, where
    if r["impl"] == "xla":
      for level in ("inter_bytes", "intra_bytes"):
        expected = r["expected"][level]
        assert r["measured"][level] == pytest.approx(expected, rel=0.01, abs=1), (where, level)
    overlap = r["overlap"]
    assert overlap["streams"] and overlap["async_collectives"] > 0, where
    assert overlap["sync_collectives"] == 0, where
    memory = r["memory"]
    assert memory["compiled_bytes"] >= memory["model_states"]["total"], where
