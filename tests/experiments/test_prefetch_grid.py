"""experiments/results/prefetch_grid/ (experiments/prefetch_grid.py): the grid of
tests/core/test_prefetch.py, which the suite samples (GGG on each stack, the rest on 3 layers).
Every sharded strategy on stacks of 1, 2 and 3 layers, and ING and GGG with LoRA: each cell there
once, the prefetching stack's gradients the plain scan's within the test's tolerances. Reads the
page only: nothing is compiled here."""

import json
import os

import pytest

from tests.core import test_prefetch as suite

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = os.path.join(REPO, "experiments", "results", "prefetch_grid")
with open(os.path.join(PAGE, "results.json")) as _f:
  RECORD = json.load(_f)
CELLS = RECORD["cells"]
# What the page promises (the module docstring), written out apart from the script's grid.
GRID = {(s, n, False) for s in ("ING", "IIG", "IGG", "GNG", "GIG", "GGG") for n in (1, 2, 3)}
GRID |= {(s, n, True) for s in ("ING", "GGG") for n in (1, 2, 3)}


def test_every_cell_of_the_grid_is_there_once():
  got = [(c["strategy"], c["layers"], c["lora"]) for c in CELLS]
  assert sorted(got) == sorted(GRID)


def test_the_tolerances_are_the_tests():
  meta = RECORD["meta"]
  assert (meta["rtol"], meta["atol"]) == (suite.RTOL, suite.ATOL)
  assert meta["command"].startswith("python experiments/prefetch_grid.py")
  assert meta["date"] and meta["commit"] and "cores" in meta["machine"]


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: f"{c['strategy']}-{c['layers']}-{c['lora']}")
def test_each_cell_gives_the_plain_scans_gradients(cell):
  assert cell["leaves"] > 0 and cell["prefetched_leaves"] == cell["leaves"]
  assert cell["smallest_gradient"] > 0  # every leaf has a gradient
  assert cell["excess"] <= suite.ATOL and cell["passes"]
  assert cell["adapters_only"] == cell["lora"]  # with LoRA, no gradient for the frozen base


def test_the_readme_table_is_the_record():
  text = open(os.path.join(PAGE, "README.md")).read()
  assert RECORD["meta"]["command"] in text
  for c in CELLS:
    line = f"| {c['strategy']} | {c['layers']} | {'yes' if c['lora'] else 'no'} | {c['leaves']} | "
    assert line in text and f"{c['excess']:.1e}" in text, line
  assert f"{len(CELLS)} of {len(CELLS)} cells pass." in text
