"""experiments/results/equivalence_grid/ (experiments/equivalence_grid.py): the grid of
tests/core/test_equivalence.py, of which the suite trains one mesh a strategy, and of
tests/core/test_masked_equivalence.py's packed rows, of which it trains four strategies. Every
strategy on two nodes of 4 and four nodes of 2, the one-node programs, every strategy with a tied
table, each hand-written collective under four strategies, every strategy on packed rows: each
cell there once, trained with the test's settings, equal to the single-device loop within the
test's tolerances. And every strategy with int8 between nodes (tests/core/test_engine_compress.py
trains four): close to the loop and not equal, by that test's own assertion. Reads the page only:
nothing is trained here."""

import json
import os

import numpy as np
import pytest

from paro_jax.core.strategy import VALID_NAMES
from tests.core import test_engine_compress as compress
from tests.core import test_equivalence as suite
from tests.core import test_masked_equivalence as masked

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = os.path.join(REPO, "experiments", "results", "equivalence_grid")
with open(os.path.join(PAGE, "results.json")) as _f:
  RECORD = json.load(_f)
CELLS = RECORD["cells"]
# What the page promises (the module docstring), written out apart from the script's grid.
GRID = (
  {("fp32", s, mesh, "xla") for s in VALID_NAMES for mesh in ("2x4", "4x2")}
  | {("fp32", s, "1x8", "xla") for s in ("NNN", "III", "GGG", "IIG", "NIG")}
  | {("tied", s, "2x4", "xla") for s in VALID_NAMES}
  | {
    ("collectives", s, "2x4", c)
    for s in ("NNN", "NIG", "IIG", "GGG")
    for c in ("ring", "hring", "horing")
  }
  | {("packed", s, "2x4", "xla") for s in VALID_NAMES}
  | {("int8", s, "2x4", "xla") for s in VALID_NAMES}
)


def test_every_cell_of_the_grid_is_there_once():
  got = [(c["group"], c["strategy"], c["mesh"], c["collectives"]) for c in CELLS]
  assert sorted(got) == sorted(GRID)


def test_the_cells_are_the_suites():
  """The settings and tolerances of tests/core/test_equivalence.py, whose cells the script ran."""
  meta = RECORD["meta"]
  assert (meta["steps"], meta["micro_batches"]) == (suite.STEPS, suite.A)
  assert meta["packed_steps"] == masked.STEPS and masked.A == suite.A
  for tests in (suite, masked):
    assert (meta["loss_rtol"], meta["param_atol"]) == (tests.LOSS_RTOL, tests.PARAM_ATOL)
  assert meta["command"].startswith("python experiments/equivalence_grid.py")
  assert meta["date"] and meta["commit"] and "cores" in meta["machine"]


def _shape(cell):
  """The model the test trains on the cell's mesh: (family, tied)."""
  if cell["group"] == "tied":
    return (suite.TIED.family, True)
  if cell["group"] == "packed":
    return (masked.CFG.family, False)
  return (suite.QWEN2 if cell["mesh"] == "4x2" else suite.CFG).family, False


@pytest.mark.parametrize(
  "cell", CELLS, ids=lambda c: f"{c['group']}-{c['strategy']}-{c['mesh']}-{c['collectives']}"
)
def test_each_cell_equals_the_single_device_loop(cell):
  assert (cell["family"], cell["tied"]) == _shape(cell)
  if cell["group"] == "int8":
    assert len(cell["losses"]) == len(cell["reference_losses"]) == suite.STEPS
    compress.assert_close_not_equal(cell["figures"])
    assert cell["passes"]
    return
  if cell["group"] == "packed":
    assert cell["targets_match"]  # each step counted the targets its batches hold
    steps = masked.STEPS
  else:
    assert cell["program"] == "boundary-sync"  # the CPU's, as in the test
    steps = suite.STEPS
  assert len(cell["losses"]) == len(cell["reference_losses"]) == steps
  # the record's own losses give its figure: a page that claims a pass it does not hold fails
  np.testing.assert_allclose(cell["losses"], cell["reference_losses"], rtol=suite.LOSS_RTOL)
  rel = max(abs(a - b) / abs(b) for a, b in zip(cell["losses"], cell["reference_losses"]))
  assert cell["loss_rel_diff"] == pytest.approx(rel, rel=1e-6, abs=1e-12)
  assert cell["param_abs_diff"] <= suite.PARAM_ATOL and cell["passes"]
  if cell["tied"]:
    assert cell["head_leaves"] == ["norm"]  # the table is the head: no head kernel


def test_the_readme_table_is_the_record():
  text = open(os.path.join(PAGE, "README.md")).read()
  assert RECORD["meta"]["command"] in text
  for c in CELLS:
    line = f"| {c['group']} | {c['strategy']} | {c['mesh']} | {c['collectives']} | "
    assert line in text and f"{c['param_abs_diff']:.1e}" in text, line
  assert f"{len(CELLS)} of {len(CELLS)} cells pass." in text
