"""The GPU program pages (experiments/gpu_program.py: the step compiled for H100 meshes without a
GPU) hold what tests/analysis/test_gpu_program.py checks on the `test` model, for every strategy
with both XLA's collectives and HO-Ring at 7b: the grid the suite compiles only in part."""

import json
import os

import pytest

from paro_jax.core.strategy import VALID_NAMES
from tests.analysis import test_gpu_program as gpu_program_tests

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


def grid_record():
  with open(os.path.join(RESULTS, "gpu_program_grid", "results.json")) as f:
    return json.load(f)


def test_overlap_limit_lets_both_levels_overlap():
  """experiments/results/gpu_program_grid/ (GGG on HO-Ring, compiled for H100 with XLA's limit
  on collectives in flight at 1, 2 and 4): at 1 no HO-Ring step has both levels in flight; on 4
  nodes x 8 GPUs (`tiny`), where the chains of several collectives run side by side, the
  project's 4 puts more steps' levels in flight together and more per-micro-batch bytes beside
  compute than 2 does (tests/analysis/test_gpu_program.py compiles only the limit of 1)."""
  record = grid_record()
  assert record["meta"]["command"].startswith("python experiments/gpu_program_grid.py")
  assert (record["meta"]["strategy"], record["meta"]["collectives"]) == ("GGG", "horing")
  assert record["meta"]["default_limit"] == 4
  rows = {(r["model"], r["mesh"], r["limit"]): r for r in record["rows"]}
  assert set(rows) == {
    (m, mesh, n) for m, mesh in (("test", "2x4"), ("tiny", "4x8")) for n in (1, 2, 4)
  }
  for model, mesh in (("test", "2x4"), ("tiny", "4x8")):
    one = rows[model, mesh, 1]
    assert one["horing_steps"] > 0 and one["horing_steps_concurrent"] == 0, one
  two, four = rows["tiny", "4x8", 2], rows["tiny", "4x8", 4]
  assert four["collective_bytes_fraction"] > two["collective_bytes_fraction"]
  assert four["horing_steps_concurrent"] > two["horing_steps_concurrent"]


@pytest.mark.parametrize(
  "strategy,impl",
  [(s, "xla") for s in ("GGG", "IGG", "IIG")] + [(s, "horing") for s in ("GGG", "IGG")],
)
def test_layers_are_fetched_ahead(strategy, impl):
  """The page's layer loops (`tiny`, 2x4) by tests/analysis/test_gpu_program.py's own assertion,
  on the strategies it compiles only GGG of."""
  cells = {(f["strategy"], f["impl"]): f for f in grid_record()["fetch_ahead"]}
  assert len(cells) == 5
  gpu_program_tests.assert_fetched_ahead(strategy, impl, cells[strategy, impl])
