"""experiments/results/outer_vs_paro/ (experiments/outer_vs_paro.py): PaRO against DiLoCo on the
emulated cluster. The page's JSON is checked for its own consistency (the bytes tc counted per
step against the rounds in the window, the table against the rows), never for timing."""

import json
import os

import pytest

from experiments import outer_vs_paro

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(REPO, "experiments", "results")
# the 100 Mbit/s link (every configuration) and the 1 Gbit/s link (a selection)
PAGES = ["outer_vs_paro", "outer_vs_paro_1gbit"]
pages = pytest.mark.parametrize("page", PAGES)


def _record(page) -> dict:
  with open(os.path.join(RESULTS, page, "outer_vs_paro.json")) as f:
    return json.load(f)


def _rows(page) -> dict:
  return {r["label"]: r for r in _record(page)["runs"]}


def _per_step(row) -> dict[int, float]:
  return {int(s): b for s, b in row["bytes_per_step"].items()}


@pages
def test_every_run_trained_the_same_tokens(page):
  rows, settings = _rows(page), _record(page)["settings"]
  wanted = (
    settings["only"].split(",")
    if settings["only"]
    else [c["label"] for c in outer_vs_paro.configurations(settings["steps"], settings["seeds"])]
  )
  assert sorted(rows) == sorted(wanted) and {"IIG", "bound"} <= set(rows)
  for r in rows.values():
    assert not r.get("error") and r["exit_code"] == 0
    assert r["steps"] == settings["steps"]


@pages
def test_bytes_per_step_is_the_mean_of_the_counted_steps(page):
  for r in _rows(page).values():
    per_step = _per_step(r)
    first, last = r["window"]
    assert sorted(per_step) == list(range(first, last + 1))  # every step of the window counted
    assert r["inter_bytes_per_step"] == pytest.approx(sum(per_step.values()) / len(per_step))


@pages
def test_a_diloco_round_is_what_crosses_the_link_once_every_h_steps(page):
  """Between rounds a DiLoCo step sends what the bound's steps send (the groups' metrics floats,
  the launcher's heartbeats); a round's bytes, the window's bytes over its rounds, are the same
  at H = 10 and 50 (the same round), so the bytes per step scale as 1/H. A step's bytes are read
  between two metrics lines, so a round's bytes may spill into the line after it: rounds are
  counted with the step after each."""
  rows = _rows(page)
  quiet = rows["bound"]["inter_bytes_per_step"]
  for wire in ("bf16", "int8"):
    if f"DiLoCo H=10 {wire}" not in rows:
      continue
    rounds = {}
    for h in (10, 50):
      r = rows[f"DiLoCo H={h} {wire}"]
      per_step = _per_step(r)
      ends = [s for s in per_step if s % h == 0]
      near = {s for e in ends for s in (e, e + 1) if s in per_step}
      others = [b for s, b in per_step.items() if s not in near]
      assert max(others) < 20 * quiet + 50e3, (h, wire, max(others))  # nothing but metrics
      rounds[h] = (sum(per_step[s] for s in near) - quiet * len(near)) / len(ends)
    assert rounds[10] == pytest.approx(rounds[50], rel=0.1), (wire, rounds)
  # int8 sends fewer bytes per round than bf16
  if "DiLoCo H=10 bf16" in rows:
    bf16, int8 = rows["DiLoCo H=10 bf16"], rows["DiLoCo H=10 int8"]
    assert int8["inter_bytes_per_step"] < bf16["inter_bytes_per_step"]


@pages
def test_the_synchronous_step_sends_every_step(page):
  rows = _rows(page)
  iig, int8 = rows["IIG"], rows["IIG int8"]
  assert min(_per_step(iig).values()) > 0.5 * iig["inter_bytes_per_step"]
  assert int8["inter_bytes_per_step"] < 0.5 * iig["inter_bytes_per_step"]
  assert rows["DiLoCo H=10 int8"]["inter_bytes_per_step"] < iig["inter_bytes_per_step"] / 4


@pages
def test_tokens_per_s_is_the_window_over_its_time(page):
  s = _record(page)["settings"]
  for r in _rows(page).values():
    tokens = s["batch_size"] * s["seq_len"] * len(r["step_times_s"])
    assert r["tokens_per_s"] == pytest.approx(tokens / sum(r["step_times_s"]))


@pages
def test_the_page_table_is_the_json(page):
  record = _record(page)
  with open(os.path.join(RESULTS, page, "README.md")) as f:
    text = f.read()
  for line in outer_vs_paro.table(record["runs"]):
    assert line in text
  for line in outer_vs_paro.goals(record["runs"]):
    assert line in text
  # read back: each run's line carries its tokens/s and bytes per step as the JSON has them
  cells = {c[1].strip(): c for c in (line.split("|") for line in text.splitlines()) if len(c) == 11}
  for r in record["runs"]:
    assert float(cells[r["label"]][4]) == pytest.approx(r["tokens_per_s"], abs=0.5)
    assert float(cells[r["label"]][6]) == pytest.approx(r["inter_bytes_per_step"] / 1e6, abs=5e-4)
