"""experiments/results/inspector_grid/ (experiments/inspector_grid.py): every strategy's compiled
traffic at A=1 and A=4 beside the formulas, the grid tests/analysis/test_inspector.py compiles
four strategies of, and with int8 between nodes, of which tests/analysis/
test_inspector_compress.py compiles four. The tests' own assertions, on the page's record:
nothing is compiled here."""

import json
import os

import pytest

from paro_jax.core.strategy import VALID_NAMES
from tests.analysis import test_inspector as suite
from tests.analysis import test_inspector_compress as compress

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = os.path.join(REPO, "experiments", "results", "inspector_grid")
with open(os.path.join(PAGE, "results.json")) as _f:
  RECORD = json.load(_f)
CELLS = {(c["strategy"], c["micro_batches"]): c for c in RECORD["cells"]}


def test_every_strategy_at_both_micro_batch_counts_once():
  assert sorted((c["strategy"], c["micro_batches"]) for c in RECORD["cells"]) == sorted(
    (s, a) for s in VALID_NAMES for a in (1, 4)
  )
  assert all(c["mesh"] == {"inter": 2, "intra": 4} for c in RECORD["cells"])
  meta = RECORD["meta"]
  assert meta["command"].startswith("python experiments/inspector_grid.py")
  assert meta["date"] and meta["commit"] and "cores" in meta["machine"]


@pytest.mark.parametrize("strategy", VALID_NAMES)
@pytest.mark.parametrize("a", [1, 4])
def test_measured_bytes_equal_formula(strategy, a):
  suite.assert_bytes_equal_formula(CELLS[strategy, a])


@pytest.mark.parametrize("strategy", VALID_NAMES)
def test_inter_traffic_frequency(strategy):
  suite.assert_inter_frequency(strategy, CELLS[strategy, 1], CELLS[strategy, 4])


def test_every_strategy_with_int8_once():
  assert sorted(c["strategy"] for c in RECORD["int8"]) == sorted(VALID_NAMES)


@pytest.mark.parametrize("cell", RECORD["int8"], ids=lambda c: c["strategy"])
def test_int8_bytes_equal_formula(cell):
  compress.assert_int8_bytes_equal_formula(cell)


def test_the_readme_table_is_the_record():
  text = open(os.path.join(PAGE, "README.md")).read()
  assert RECORD["meta"]["command"] in text
  for c in RECORD["cells"]:
    m = c["measured"]
    assert f"| {c['strategy']} | {c['micro_batches']} | {m['inter_bytes']:,.0f} | " in text
