"""experiments/results/model_io_limits/ (experiments/model_io_limits.py): what the page claims is
true of its record. Every row the script defines is there; each limit is the rule the script's
docstring states, recomputed here from the directories' recorded bytes; a row is 'met' exactly
when it ran and its peak is within its limit; the LoRA checkpoint's share of its base is its
bytes over the base's. Reads the page only: nothing is run here."""

import json
import os

import pytest

from tests.docs_claims import markdown_table

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = os.path.join(REPO, "experiments", "results", "model_io_limits")
with open(os.path.join(PAGE, "results.json")) as _f:
  RECORD = json.load(_f)
with open(os.path.join(PAGE, "README.md")) as _f:
  README = _f.read()
ROWS = RECORD["rows"]
# What the page must measure: the real-size paths and transformers beside them.
NAMES = {
  "eval 1B GGG 1x8",
  "eval 1B IIG 2x4",
  "eval 3B 1x1",
  "eval 8B 1x1",
  "LoRA 1B ING 2x4: train 2 steps",
  "LoRA 1B ING 2x4: resume to step 3",
  "LoRA 1B ING 2x4: export merged",
  "LoRA 1B ING 2x4: export --adapter",
  "LoRA 1B GGG, 2 processes x 4: train 2 steps (largest process)",
  "LoRA 1B GGG, 2 processes: export merged (1 process x 8)",
  "LoRA 1B GGG, 2 processes: export --adapter (1 process x 8)",
  "transformers: load + forward 1B",
  "transformers: load + forward 3B",
  "transformers: load + save_pretrained 1B",
}


def test_every_row_is_there_once():
  assert sorted(r["name"] for r in ROWS) == sorted(NAMES)


def _limit(terms):
  """The docstring's rules: a fixed number of GB; factor x the checkpoint + slack; or W (the
  checkpoint x the placement's copies) + two bf16 layers per device (gathered: devices > 1)
  + slack."""
  if "fixed" in terms:
    return terms["fixed"]
  ckpt = RECORD["checkpoint_bytes"][terms["model"]]
  if "factor" in terms:
    return terms["factor"] * ckpt / 1e9 + terms["slack"]
  layers = (
    2 * RECORD["layer_bytes"][terms["model"]] * terms["devices"] if terms["devices"] > 1 else 0
  )
  return (ckpt * terms["copies"] + layers) / 1e9 + terms["slack"]


@pytest.mark.parametrize("row", [r for r in ROWS if not r["peer"]], ids=lambda r: r["name"])
def test_each_limit_is_the_stated_rule(row):
  assert row["limit_gb"] == pytest.approx(_limit(row["limit_terms"]), abs=0.006)


def test_the_layer_bytes_are_the_shapes():
  """One decoder layer of the Llama 3.2 1B shape in bf16: q, k, v, o, three MLP matrices, two
  norms (hidden 2048, 32 x 64 query and 8 x 64 key/value heads, MLP 8192)."""
  d, f, q, kv = 2048, 8192, 32 * 64, 8 * 64
  assert RECORD["layer_bytes"]["llama1b"] == 2 * (d * q * 2 + d * kv * 2 + 3 * d * f + 2 * d)


def test_the_table_is_the_record():
  table = markdown_table(README, "| what |")
  assert [r["what"] for r in table] == [r["name"] for r in ROWS]
  for line, row in zip(table, ROWS):
    assert int(line["rc"]) == row["rc"]
    assert float(line["peak RSS (GB)"]) == row["peak_rss_gb"]
    met = row["rc"] == 0 and row["peak_rss_gb"] <= row["limit_gb"] if row["limit_gb"] else None
    assert line["met"] == {True: "yes", False: "NO", None: "-"}[met]


def test_the_lora_checkpoint_share_is_its_bytes_over_the_base():
  steps = RECORD["lora_step_bytes"]
  share = 100 * max(steps.values()) / RECORD["lora_base_bytes"]
  assert f"{share:.2f}% of the 1B base's bytes" in README
