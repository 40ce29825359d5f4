"""experiments/results/gpu_bytes/ (its script retired at 8ebf865): the GPU step's byte targets on
the step compiled for H100, read from the page and its JSON."""

import json
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = os.path.join(REPO, "experiments", "results", "gpu_bytes")


def _rows() -> dict:
  with open(os.path.join(PAGE, "gpu_bytes.json")) as f:
    return {r["name"]: r for r in json.load(f)["rows"]}


def test_purposes_sum_to_the_total():
  for r in _rows().values():
    for side in ("before", "after"):
      assert abs(sum(r[side]["by_purpose"].values()) - r[side]["non_matmul_bytes"]) < 1e3


def test_issue_45_targets_are_met():
  """7b-L4 1x1 A=1 at most 50 GB of non-matmul bytes per step; 7b-L4 1x8 IIG A=1 at most 21 GB
  per GPU with at least 73% of its per-micro-batch collective bytes beside compute; both fewer
  than before the changes."""
  rows = _rows()
  one, eight = rows["7b-L4 1x1 A=1"], rows["7b-L4 1x8 IIG A=1"]
  assert one["after"]["non_matmul_bytes"] <= 50e9 < one["before"]["non_matmul_bytes"]
  assert eight["after"]["non_matmul_bytes"] <= 21e9 < eight["before"]["non_matmul_bytes"]
  assert eight["after"]["collective_bytes_fraction"] >= 0.73


def test_page_says_what_the_json_holds():
  with open(os.path.join(PAGE, "README.md")) as f:
    page = f.read()
  totals = [float(x) for x in re.findall(r"\*\*([\d.]+)\*\*", page)]
  expected = [r[s]["non_matmul_bytes"] / 1e9 for r in _rows().values() for s in ("before", "after")]
  assert totals == [round(x, 2) for x in expected]
  assert "NOT met" not in page and page.count(": met") == 3
