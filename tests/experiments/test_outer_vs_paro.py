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
  """Every row is a configuration of the script; the labels the last command ran with --only are
  on the page beside the rows it kept (a page without --only predates some configurations)."""
  rows, settings = _rows(page), _record(page)["settings"]
  defined = [c["label"] for c in outer_vs_paro.configurations(settings["steps"], settings["seeds"])]
  ran = settings["only"].split(",") if settings["only"] else []
  assert set(rows) <= set(defined) and set(ran) <= set(rows) and {"IIG", "bound"} <= set(rows)
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
  for wire in ("bf16", "int8", "int8 I"):
    if f"DiLoCo H=10 {wire}" not in rows:
      continue
    rounds = {h: _round(rows[f"DiLoCo H={h} {wire}"], quiet) for h in (10, 50)}
    assert rounds[10] == pytest.approx(rounds[50], rel=0.1), (wire, rounds)
  if "DiLoCo H=100 int8 I" in rows:  # one round, at step 100: its bytes may spill past the window
    assert (
      0.5
      < _round(rows["DiLoCo H=100 int8 I"], quiet) / _round(rows["DiLoCo H=10 int8 I"], quiet)
      < 1.1
    )
  # int8 sends fewer bytes per round than bf16
  if "DiLoCo H=10 bf16" in rows:
    bf16, int8 = rows["DiLoCo H=10 bf16"], rows["DiLoCo H=10 int8"]
    assert int8["inter_bytes_per_step"] < bf16["inter_bytes_per_step"]


def _round(r, quiet) -> float:
  """A DiLoCo run's bytes a round: the window's bytes at the rounds' ends (and the step after
  each) less the quiet level, over the rounds; every other step sends nothing but metrics."""
  per_step, h = _per_step(r), r["h"]
  ends = [s for s in per_step if s % h == 0]
  near = {s for e in ends for s in (e, e + 1) if s in per_step}
  others = [b for s, b in per_step.items() if s not in near]
  assert max(others) < 20 * quiet + 50e3, (r["label"], max(others))  # nothing but metrics
  return (sum(per_step[s] for s in near) - quiet * len(near)) / len(ends)


@pages
def test_the_round_at_i_and_int4_send_fewer_bytes(page):
  """`--outer-state I` sends 2w bytes a parameter a round, the round at G 8 + w (docs/outer.md):
  at int8 under half; int4 halves the pseudo-gradient's w of the round at G."""
  rows = _rows(page)
  quiet, g = rows["bound"]["inter_bytes_per_step"], rows["DiLoCo H=10 int8"]
  if "DiLoCo H=10 int8 I" in rows:
    assert _round(rows["DiLoCo H=10 int8 I"], quiet) < 0.5 * _round(g, quiet)
  if "DiLoCo H=10 int4" in rows:
    assert _round(rows["DiLoCo H=10 int4"], quiet) < _round(g, quiet)


@pages
def test_streaming_sends_a_fragment_at_a_time(page):
  """Streaming DiLoCo (F = 4, TAU = 1) sends a fragment during the step after each sync step
  (every H/F steps) and nothing else; its fragments together are one round of the same wire and
  outer state (DiLoCo H=10 int8 I's round, measured in another run), each a part of it."""
  rows = _rows(page)
  label = "Streaming DiLoCo H=20 F=4 tau=1 int8 I"
  if label not in rows:
    pytest.skip("no Streaming run on this page")
  r, quiet = rows[label], rows["bound"]["inter_bytes_per_step"]
  whole = _round(rows["DiLoCo H=10 int8 I"], quiet)
  per_step = _per_step(r)
  exchanges = [e for e in per_step if e > 1 and (e - 1) % 5 == 0]  # the sync steps t = 5, 10, ...
  # tc's counter is read as a metrics line appears, late under load: an exchange may be counted
  # in the step before or after its own
  near = {s for e in exchanges for s in (e - 1, e, e + 1)}
  assert max(b for s, b in per_step.items() if s not in near) < 20 * quiet + 50e3
  sent = {e: sum(per_step.get(s, quiet) - quiet for s in (e - 1, e, e + 1)) for e in exchanges}
  by_fragment = [[b for e, b in sent.items() if (e - 1) // 5 % 4 == f] for f in range(4)]
  assert sum(sum(b) / len(b) for b in by_fragment) == pytest.approx(whole, rel=0.15)
  assert all(0.15 * whole < b < 0.4 * whole for b in sent.values()), (whole, sent)


def test_the_streaming_goal_reads_each_exchange_against_the_round():
  """The goal's figure on a made-up run: fragments of 1, 2, 3 and 4 units exchanged at the step
  after their sync steps (t = 5, 10, 15, 20 mod 20), part spilling into the next step, and one
  exchange counted a step early (the metrics line of its sync step read late)."""
  quiet, units = 1000.0, {1: 1e5, 2: 2e5, 3: 3e5, 0: 4e5}  # by t // 5 mod 4: the fragment
  per_step = {s: quiet for s in range(2, 101)}
  for t in range(5, 100, 5):
    per_step[t + 1] += units[t // 5 % 4] - 1e4
    per_step[t + 2] += 1e4
  per_step[46] -= 5e4  # the exchange after t = 45 (fragment 0: 4 units) partly in step 45
  per_step[45] += 5e4
  row = dict(h=20, fragments=4, bytes_per_step={str(s): b for s, b in per_step.items()})
  row["command"] = ["train", "--model", "tiny", "--outer-delay", "1"]
  share, largest = outer_vs_paro.streaming_busiest(row, quiet)
  assert share == pytest.approx(4 / 10)
  # tiny: 4 layers of 246,016 parameters; the embedding (32,768) with the first, the norm and the
  # head (128 + 32,768) with the last
  assert largest == pytest.approx((246016 + 32896) / 1049728)


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
