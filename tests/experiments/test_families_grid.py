"""experiments/results/families_grid/ (experiments/families_grid.py): what the page claims is true
of its record. Every family under both sharded strategies (and Qwen2's LoRA run on both) is there,
trained with the settings of tests/hf/test_families.py's journeys; each export scores as its run,
transformers scores it alike and peft's adapter gives the merged logits, where recorded; the
README's table is the record's. Reads the page only: nothing is trained here."""

import json
import os
import re

import pytest

from models.config import FAMILIES
from tests.docs_claims import markdown_table
from tests.hf import test_families as journeys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = os.path.join(REPO, "experiments", "results", "families_grid")
with open(os.path.join(PAGE, "results.json")) as _f:
  RECORD = json.load(_f)
CELLS = RECORD["cells"]
# What users were promised: each family under IIG on two nodes of 4 and GGG on four nodes of 2;
# Qwen2 also with LoRA adapters on both.
GRID = {
  (family, lora, strategy, mesh)
  for family, lora in (("qwen2", False), ("qwen2", True), ("qwen3", False), ("mistral", False))
  for strategy, mesh in (("IIG", "2x4"), ("GGG", "4x2"))
}


def test_every_cell_of_the_grid_is_there_once():
  got = [(c["family"], c["lora"], c["strategy"], c["mesh"]) for c in CELLS]
  assert sorted(got) == sorted(GRID)


def test_the_settings_are_the_tests_journeys():
  settings = RECORD["meta"]["settings"]
  assert (settings["seq_len"], settings["batch_size"], settings["steps"]) == (
    journeys.SEQ,
    journeys.BATCH,
    journeys.STEPS,
  )
  assert settings["lora"] == journeys.LORA
  assert settings["run_eval"] == ["--mesh", "2x4", "--strategy", "IIG"]


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c["cell"])
def test_each_cell_trained(cell):
  losses = cell["train_losses"]
  assert len(losses) == journeys.STEPS
  assert (cell["first_loss"], cell["last_loss"]) == (losses[0], losses[-1])
  assert cell["last_loss"] < cell["first_loss"]


def test_both_strategies_train_alike():
  """The same model under IIG on 2x4 and GGG on 4x2: the same loss at every step (each equals
  the one-device loop: tests/core/test_equivalence.py)."""
  for family, lora in {(c["family"], c["lora"]) for c in CELLS}:
    iig, ggg = (
      next(c for c in CELLS if (c["family"], c["lora"], c["strategy"]) == (family, lora, s))
      for s in ("IIG", "GGG")
    )
    assert ggg["train_losses"] == pytest.approx(iig["train_losses"], rel=1e-5), (family, lora)


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c["cell"])
def test_the_export_scores_as_the_run(cell):
  assert cell["export_eval"] == pytest.approx(cell["run_eval"], rel=1e-6)
  assert cell["export_eval_windows"] == cell["eval_windows"] > 0
  assert cell["export_architectures"] == [FAMILIES[cell["family"]]]


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c["cell"])
def test_transformers_scores_the_export_alike(cell):
  if cell["transformers_loss"] is None:
    assert RECORD["meta"]["transformers_versions"] is None  # not run at all, as the page says
    return
  assert cell["transformers_class"] == FAMILIES[cell["family"]]
  assert cell["transformers_windows"] == cell["eval_windows"]  # the same windows
  assert cell["transformers_loss"] == pytest.approx(cell["export_eval"], rel=1e-5)


@pytest.mark.parametrize("cell", [c for c in CELLS if c["lora"]], ids=lambda c: c["cell"])
def test_peft_loads_the_adapter_with_the_merged_logits(cell):
  if cell["transformers_loss"] is None:
    pytest.skip("transformers was not run for this page")
  assert cell["peft_max_abs_logit_diff"] <= 1e-5
  assert cell["peft_moved_from_base"] > 1e-3  # the adapter changed the logits: not a no-op


def _shown(text: str, value) -> bool:
  """`text`, a figure as the page prints it, is `value` to the digits it shows (— for none)."""
  if value is None or text == "—":
    return value is None and text == "—"
  m = re.fullmatch(r"-?\d+\.(\d+)(?:e([+-]\d+))?", text)
  assert m, f"not a figure: {text!r}"
  unit = 10.0 ** (int(m.group(2) or 0) - len(m.group(1)))
  return abs(float(text) - value) <= unit / 2 * (1 + 1e-9)


def test_the_readme_table_is_the_record():
  with open(os.path.join(PAGE, "README.md")) as f:
    readme = f.read()
  assert RECORD["meta"]["command"] in readme and RECORD["meta"]["date"] in readme
  rows = markdown_table(readme, "| cell |")
  assert [r["cell"] for r in rows] == [c["cell"] for c in CELLS]
  columns = {
    "first loss": "first_loss",
    "last loss": "last_loss",
    "eval of the run": "run_eval",
    "eval of the export": "export_eval",
    "transformers": "transformers_loss",
    "peft max abs logit diff": "peft_max_abs_logit_diff",
  }
  for row, cell in zip(rows, CELLS):
    for column, key in columns.items():
      assert _shown(row[column], cell[key]), (cell["cell"], column, row[column], cell[key])


def test_the_figure_check_can_fail():
  assert _shown("5.1234567", 5.12345674) and not _shown("5.1234567", 5.1234569)
  assert _shown("1.23e-07", 1.234e-7) and not _shown("1.23e-07", 1.24e-7)
  assert _shown("—", None) and not _shown("—", 0.0)
