"""experiments/results/compress_cost/ (its script retired at 8ebf865): the wire bytes of every row
are the format's, counted again here."""

import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _wire(fmt: str, n: int) -> int:
  # int8: one byte a value and a 4-byte fp32 scale per block of 32 (the last one short); bf16: 2
  return n + -(-n // 32) * 4 if fmt == "int8" else 2 * n


def test_results_page_counts_the_wire_bytes():
  page = os.path.join(REPO, "experiments", "results", "compress_cost", "compress_cost.json")
  with open(page) as f:
    rows = json.load(f)["rows"]
  assert rows and all(r["wire_bytes"] == _wire(r["format"], r["elements"]) for r in rows)
