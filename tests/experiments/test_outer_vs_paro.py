"""experiments/results/outer_vs_paro/ (experiments/outer_vs_paro.py): PaRO against DiLoCo on the
emulated cluster. The page's JSON is checked for its own consistency (the bytes tc counted per
step against the rounds in the window, the table against the rows), never for timing."""

import argparse
import json
import os
import re
import shutil

import pytest

from experiments import outer_vs_paro
from experiments import outer_vs_paro_page as page_text

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(REPO, "experiments", "results")
# the 100 Mbit/s link (every configuration), the 1 Gbit/s link (a selection), a few
# configurations at 10 Gbit/s and on 4 nodes x 2 devices at 1 Gbit/s; the same with `small`
PAGES = ["outer_vs_paro", "outer_vs_paro_1gbit", "outer_vs_paro_10gbit", "outer_vs_paro_1gbit_4x2"]
PAGES += [
  "outer_vs_paro_small_1gbit",
  "outer_vs_paro_small_10gbit",
  "outer_vs_paro_small_1gbit_4x2",
  "outer_vs_paro_small_10gbit_4x2",
]
pages = pytest.mark.parametrize("page", PAGES)


def _record(page) -> dict:
  with open(os.path.join(RESULTS, page, "outer_vs_paro.json")) as f:
    return json.load(f)


def _rows(page) -> dict:
  """The page's runs that finished (a failed run is a line of its own on the page)."""
  return {r["label"]: r for r in _record(page)["runs"] if not r.get("error")}


def _per_step(row) -> dict[int, float]:
  return {int(s): b for s, b in row["bytes_per_step"].items()}


@pages
def test_every_run_trained_the_same_tokens(page):
  """Every row is a configuration of the script; the labels the last command ran with --only are
  on the page beside the rows it kept (a page without --only predates some configurations)."""
  rows, settings = _rows(page), _record(page)["settings"]
  seeds = max(r["seed"] for r in rows.values()) + 1  # kept rows may have more than --seeds
  defined = [c["label"] for c in outer_vs_paro.configurations(settings["steps"], seeds)]
  ran = settings["only"].split(",") if settings["only"] else []
  assert set(rows) <= set(defined) and set(ran) <= set(rows) and {"IIG", "bound"} <= set(rows)
  for r in rows.values():
    assert r["exit_code"] == 0 and r["steps"] == settings["steps"]
  with open(os.path.join(RESULTS, page, "README.md")) as f:
    text = f.read()
  for r in _record(page)["runs"]:  # a failed run: said on the page, with why
    assert (
      not r.get("error")
      or f"| {r['label']} | seed {r['seed']} | | | failed: {r['error']} |" in text
    )


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
  for wire in ("bf16", "int8", "int4", "int8 I", "int8 I m=0"):
    ten = rows.get(f"DiLoCo H=10 {wire}")
    if ten is None:
      continue
    if f"DiLoCo H=50 {wire}" in rows:
      rounds = {h: _round(rows[f"DiLoCo H={h} {wire}"], quiet) for h in (10, 50)}
      assert rounds[10] == pytest.approx(rounds[50], rel=0.1), (wire, rounds)
    if f"DiLoCo H=100 {wire}" in rows:  # one round, at step 100: it may spill past the window
      assert 0.5 < _round(rows[f"DiLoCo H=100 {wire}"], quiet) / _round(ten, quiet) < 1.1, wire
  # int8 sends fewer bytes per round than bf16 (both with the outer state at G)
  if {"DiLoCo H=10 bf16", "DiLoCo H=10 int8"} <= set(rows):
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
  at int8 under half of G's at int8 (9 bytes) or bf16 (10); int4 halves the pseudo-gradient's w
  of the round at G."""
  rows = _rows(page)
  at_g = next((x for x in ("DiLoCo H=10 int8", "DiLoCo H=10 bf16") if x in rows), None)
  if at_g is None:
    pytest.skip("no DiLoCo H=10 int8 or bf16 with the outer state at G on this page")
  quiet, g = rows["bound"]["inter_bytes_per_step"], rows[at_g]
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
  stream = "Streaming DiLoCo H=20 F=4 tau=1 int8 I"
  label = next((x for x in (stream, f"{stream} m=0") if x in rows), None)
  if label is None:
    pytest.skip("no Streaming run on this page")
  r, quiet = rows[label], rows["bound"]["inter_bytes_per_step"]
  # the outer momentum moves no byte: either DiLoCo H=10 int8 I's round is the same
  whole = _round(next(rows[x] for x in rows if x.startswith("DiLoCo H=10 int8 I")), quiet)
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
  share, largest = page_text.streaming_busiest(row, quiet)
  assert share == pytest.approx(4 / 10)
  # tiny: 4 layers of 246,016 parameters, one a fragment; each fragment 64 of the vocabulary's 256
  # rows of the embedding and of the head (2 x 64 x 128), the last also the final norm (128)
  assert largest == pytest.approx((246016 + 2 * 64 * 128 + 128) / 1049728)


@pages
def test_the_synchronous_step_sends_every_step(page):
  rows = _rows(page)
  iig, int8 = rows["IIG"], rows["IIG int8"]
  assert min(_per_step(iig).values()) > 0.5 * iig["inter_bytes_per_step"]
  assert int8["inter_bytes_per_step"] < 0.5 * iig["inter_bytes_per_step"]
  diloco = next(rows[x] for x in rows if x.startswith("DiLoCo H=10 int8"))
  assert diloco["inter_bytes_per_step"] < iig["inter_bytes_per_step"] / 4


@pages
def test_tokens_per_s_is_the_window_over_its_time(page):
  s = _record(page)["settings"]
  for r in _rows(page).values():
    tokens = s["batch_size"] * s["seq_len"] * len(r["step_times_s"])
    assert r["tokens_per_s"] == pytest.approx(tokens / sum(r["step_times_s"]))


# 31e31ab (an all-gather's block layout) changed IIG int8's step in a last bit of its rounding
# (the int8 parameter sync gathers along a minor dimension); its runs on either side differ
INT8_GATHER_CHANGED = "2026-12-06T23:59:22+00:00"


@pytest.mark.parametrize(
  "slow, fast",
  [
    ("outer_vs_paro_small_1gbit", "outer_vs_paro_small_10gbit"),
    ("outer_vs_paro_small_1gbit_4x2", "outer_vs_paro_small_10gbit_4x2"),
  ],
)
def test_the_link_s_rate_moves_no_loss(slow, fast):
  """A run is deterministic and the link's rate only delays its bytes: every run on both pages of
  one mesh ends at the same losses to the bit at 1 and 10 Gbit/s (so a configuration's losses
  read at one rate hold at the other), but IIG int8's runs measured on either side of 31e31ab."""
  a, b = _rows(slow), _rows(fast)
  after = lambda row: row["date"] > INT8_GATHER_CHANGED  # noqa: E731
  moved = {
    k for k in a.keys() & b.keys() if k.startswith("IIG int8") and after(a[k]) != after(b[k])
  }
  same = (a.keys() & b.keys()) - moved
  assert len(same) >= 15 and len(moved) <= 3
  for k in same:
    assert (a[k]["eval_loss"], a[k]["final_loss"]) == (b[k]["eval_loss"], b[k]["final_loss"]), k


@pages
def test_the_page_table_is_the_json(page):
  record = _record(page)
  with open(os.path.join(RESULTS, page, "README.md")) as f:
    text = f.read()
  for line in page_text.table(record["runs"]):
    assert line in text
  for line in page_text.goals(record["runs"]):
    assert line in text
  # read back: each configuration's line carries the mean over its seeds' rows (the labels
  # grouped here by their own suffix) of tokens/s and bytes per step as the JSON has them
  cells = {c[1].strip(): c for c in (line.split("|") for line in text.splitlines()) if len(c) == 13}
  groups = {}
  for r in record["runs"]:
    if not r.get("error"):
      groups.setdefault(re.sub(r" seed\d+$", "", r["label"]), []).append(r)
  for label, runs in groups.items():
    mean = lambda key: sum(r[key] for r in runs) / len(runs)  # noqa: E731
    assert cells[label][2].strip() == ("1 seed" if len(runs) == 1 else f"{len(runs)} seeds")
    assert float(cells[label][5]) == pytest.approx(mean("tokens_per_s"), abs=0.5)
    assert float(cells[label][7]) == pytest.approx(mean("inter_bytes_per_step") / 1e6, abs=5e-4)


def _fake(label, seed, loss, speed=100.0, kind="diloco", **extra) -> dict:
  """A made-up run's row: what the page reads of it."""
  name = f"{label} seed{seed}" if seed else label
  row = dict(label=name, seed=seed, kind=kind, h=10 if kind == "diloco" else None, wire="int8")
  row.update(tokens_per_s=speed, inter_bytes_per_step=2e6, planned_bytes_per_step=1e6)
  return {**row, "eval_loss": loss, **extra}


FAKE = [
  _fake("IIG", 0, 2.0, 100.0, kind="sync"),
  _fake("IIG", 1, 2.1, 110.0, kind="sync"),
  _fake("IIG", 2, 2.2, 120.0, kind="sync"),
  _fake("D", 0, 2.0, 90.0),
  _fake("D", 1, 2.2, 96.0),
  _fake("D", 2, None, error="launch exited 1; see its log"),
  _fake("E", 0, 2.03, 80.0),
  _fake("bound", 0, 5.0, 100.0, kind="bound"),
  _fake("bound", 1, 5.0, 120.0, kind="bound"),
]


def test_a_configuration_reads_the_means_over_its_seeds():
  """Made-up runs: IIG at seeds 0-2 (eval loss 2.0, 2.1, 2.2), D at seeds 0 and 1 (2.0, 2.2; its
  seed 2 failed), E at seed 0 (2.03), the bound at seeds 0 and 1 (100 and 120 tokens/s). D is
  judged against IIG's and the bound's means over seeds 0 and 1 (2.05, 110 tokens/s), E against
  their seed 0."""
  groups = {g["label"]: g for g in page_text.by_configuration(FAKE)}
  assert list(groups) == ["IIG", "D", "E", "bound"]
  d = groups["D"]
  assert d["seeds"] == [0, 1] and d["eval_losses"] == [2.0, 2.2]
  assert d["eval_loss"] == pytest.approx(2.1) and d["tokens_per_s"] == pytest.approx(93.0)
  assert page_text.spread(groups["IIG"]["eval_losses"]) == pytest.approx(0.2 / 2.1)
  ratio, shared = page_text.against(d, groups["IIG"], "eval_loss")
  assert shared == [0, 1] and ratio == pytest.approx(2.1 / 2.05)
  ratio, shared = page_text.against(groups["E"], groups["IIG"], "eval_loss")
  assert shared == [0] and ratio == pytest.approx(1.015)
  ratio, shared = page_text.against(groups["IIG"], groups["bound"], "tokens_per_s")
  assert shared == [0, 1] and ratio == pytest.approx(105 / 110)
  lines = page_text.table(FAKE)
  # tokens/s 93 (93 / 110 = 0.845 of the bound), 2 MB and 1 MB a step, eval loss 2.1 (each
  # seed's and 0.2 / 2.1 = 9.5% apart), +2.44% against IIG's 2.05
  assert "| D | 2 seeds | 10 | int8 | 93 | 0.845 | 2.000 | 1.000 | 2.1000 | 2.0000, 2.2000 " \
    "(9.5%) | +2.44% |" in lines  # fmt: skip
  assert "| E | 1 seed | 10 | int8 | 80 | 0.800 | 2.000 | 1.000 | 2.0300 | - | +1.50% |" in lines
  assert "| IIG | 3 seeds | - | int8 | 110 | 0.955 | 2.000 | 1.000 | 2.1000 | 2.0000, 2.1000, " \
    "2.2000 (9.5%) | +0.00% |" in lines  # fmt: skip
  assert sum("D seed2 | seed 2 | | | failed: launch exited 1" in line for line in lines) == 1
  goals = page_text.goals(FAKE)
  assert goals[0] == (
    "- D (2 seeds): tokens/s 0.85 of the bound's mean over seeds 0, 1: NOT met (>= 0.90); eval "
    "loss +2.4% against IIG's mean over seeds 0, 1: NOT met (within 2%; IIG's 3 seeds span 9.5%, "
    "its own 9.5%)"
  )
  assert goals[1] == (
    "- E (1 seed): tokens/s 0.80 of the bound's seed 0: NOT met (>= 0.90); eval loss +1.5% "
    "against IIG's seed 0: met (within 2%; IIG's 3 seeds span 9.5%)"
  )
  # IIG's tokens/s 100, 110, 120: 20 / 110 = 18.2% apart
  assert "its tokens/s (the same work) 100, 110, 120 (spread 18.2%)" in goals[2]


def test_a_round_s_cost_is_read_within_its_own_runs():
  """Made-up step times: D's two runs, each with one step of five at twice the others' time (a
  mean 1.2x the median) and one at 1.5x of four (1.125x); the bound's steps all alike. The
  goal's line says D's rounds add 16.25%, whatever the bound's tokens/s on its day."""
  rows = [
    _fake("IIG", 0, 2.0, kind="sync"),
    _fake("D", 0, 2.0, 50.0, step_times_s=[1.0, 1.0, 2.0, 1.0, 1.0]),
    _fake("D", 1, 2.0, 50.0, step_times_s=[3.0, 2.0, 2.0, 2.0]),
    _fake("bound", 0, 5.0, kind="bound", step_times_s=[0.5, 0.5, 0.5]),
    _fake("bound", 1, 5.0, kind="bound", step_times_s=[0.5, 0.5, 0.5]),
  ]
  groups = {g["label"]: g for g in page_text.by_configuration(rows)}
  assert page_text.round_cost(groups["D"]) == pytest.approx((0.2 + 0.125) / 2)
  assert page_text.round_cost(groups["IIG"]) is None  # no step times kept: no figure
  assert (
    "its rounds add 16.2% to its median step within its own runs (the bound's steps 0.0% to "
    "theirs)" in page_text.goals(rows)[0]
  )


@pages
def test_the_page_is_its_json_rendered(page, tmp_path):
  """`--render` writes a page from its JSON alone; the committed page is that text (the page
  follows the script's text, the JSON is left as it was)."""
  source = os.path.join(RESULTS, page)
  shutil.copy(os.path.join(source, "outer_vs_paro.json"), tmp_path)
  outer_vs_paro.main(["--render", "--out", str(tmp_path)])
  for name in ("README.md", "outer_vs_paro.json"):
    with open(os.path.join(source, name)) as a, open(tmp_path / name) as b:
      assert b.read() == a.read(), name


def test_a_page_of_one_seed_says_so():
  rows = [_fake("IIG", 0, 2.0, kind="sync"), _fake("D", 0, 2.1), _fake("bound", 0, 5, kind="bound")]
  assert page_text.goals(rows) == [
    "- D (1 seed): tokens/s 1.00 of the bound's seed 0: met (>= 0.90); eval loss +5.0% against "
    "IIG's seed 0: NOT met (within 2%; IIG has 1 seed: no spread to judge it by)"
  ]
  assert page_text.seeds_left_out(rows, ["IIG", "D", "F", "bound"]) == (
    "F not run on this page; seed 0 of every configuration"
  )
  assert page_text.seeds_text([0, 2]) == "2 seeds (0, 2)"
  # a loss below IIG's by more than 2% meets the goal (no worse than IIG's by more than 2%)
  rows[1] = _fake("D", 0, 1.9)
  assert (
    "eval loss -5.0% against IIG's seed 0: met, lower than IIG's (within 2%;"
    in (page_text.goals(rows)[0])
  )


def test_a_page_without_iig_or_the_bound_yet_renders():
  """A new page's first run (the bound, or a DiLoCo row before IIG's) renders, saying in the cells
  what it has no run to compare with: the page, and with it the JSON of the run, is written."""
  bound_only = [_fake("bound", 0, 5.0, 100.0, kind="bound")]
  assert "| bound | 1 seed | - | int8 | 100 | 1.000 | 2.000 | 1.000 | - | - | - |" in (
    page_text.table(bound_only)
  )
  lines = page_text.table([_fake("D", 0, 2.1, 90.0)])
  d = "| D | 1 seed | 10 | int8 | 90 | no bound run | 2.000 | 1.000 | 2.1000 | - | no IIG run |"
  assert d in lines
  assert page_text.goals(bound_only) == []


def test_the_left_out_text_names_each_configurations_seeds():
  """IIG at seeds 0-2, E at seed 0, D and the bound (the most configurations) at seeds 0 and 1."""
  assert page_text.seeds_left_out(FAKE, ["IIG", "D", "E", "bound"]) == (
    "seeds 0, 1, 2 of IIG; seed 0 of E; seeds 0, 1 of every other configuration"
  )


def test_seeds_run_every_configuration_only_names():
  """--seeds 3: every configuration at seeds 0, 1, 2 with the same flags; --only names a
  configuration (each seed) or one run; a name of neither is an error."""
  configs = outer_vs_paro.configurations(101, 3)
  by = {c["label"]: c for c in configs}
  assert [by[f"IIG int8{s}"]["seed"] for s in ("", " seed1", " seed2")] == [0, 1, 2]
  assert by["DiLoCo H=10 int8 I m=0 seed2"]["flags"] == by["DiLoCo H=10 int8 I m=0"]["flags"]
  assert len(configs) == 3 * len(outer_vs_paro.configurations(101, 1))
  chosen = outer_vs_paro.selected(configs, "IIG,DiLoCo H=50 int8 I m=0 seed2")
  assert [c["label"] for c in chosen] == [
    "IIG",
    "IIG seed1",
    "IIG seed2",
    "DiLoCo H=50 int8 I m=0 seed2",
  ]
  with pytest.raises(SystemExit, match="--only names no configuration: IIG seed3"):
    outer_vs_paro.selected(configs, "IIG,IIG seed3")


def _args(tmp_path, **kw):
  settings = dict(model="tiny", steps=101, batch_size=16, seq_len=64, dtype="fp32", eval_batches=8)
  settings.update(seeds=1, rate="1gbit", loopback=False, only=None, resume=True, out=str(tmp_path))
  settings.update(mesh="2x4")
  return argparse.Namespace(**{**settings, **kw})


def test_only_keeps_the_seeds_it_does_not_run(tmp_path):
  """A page with IIG at seeds 0-2 and the bound, measured with --seeds 3; `--only IIG --seeds 1`
  runs IIG's seed 0 and keeps its seeds 1 and 2 (the seeds are no setting of a run), and orders
  the page by every configuration at 3 seeds."""
  runs = [_fake("IIG", s, 2.0, kind="sync") for s in range(3)] + [
    _fake("bound", 0, 5, kind="bound")
  ]
  record = {"date": "then", "settings": vars(_args(tmp_path, seeds=3)), "runs": runs}
  with open(tmp_path / "outer_vs_paro.json", "w") as f:
    json.dump(record, f)
  args = _args(tmp_path, only="IIG")
  earlier = outer_vs_paro.earlier_rows(args)
  kept, order = outer_vs_paro.kept_rows(args, earlier, {"IIG"})
  assert sorted(kept) == ["IIG seed1", "IIG seed2", "bound"]
  assert kept["IIG seed1"]["date"] == "then" and kept["bound"]["planned_bytes_per_step"] == 0
  assert order.index("IIG seed2") < order.index("IIG int8") < order.index("bound seed2")
  with pytest.raises(SystemExit, match="measured with other rate"):
    outer_vs_paro.earlier_rows(_args(tmp_path, only="IIG", rate="100mbit"))


def test_resume_reuses_the_row_of_an_unchanged_command(tmp_path):
  """No runs/ folder (not kept in git): --resume reuses the JSON's row where its command is the
  run's (nothing is launched), with what the script derives as it is now."""
  args = _args(tmp_path)
  config = outer_vs_paro.configurations(101, 2)[1]  # IIG seed1
  directory = str(tmp_path / "runs" / "IIG_seed1")
  row = {"label": "IIG seed1", "eval_loss": 2.5, "planned_bytes_per_step": -1}
  row["command"] = outer_vs_paro.train_argv(args, config, directory)
  got = outer_vs_paro.run(args, {**config, "planned_bytes_per_step": 7}, directory, row)
  assert got["eval_loss"] == 2.5 and got["planned_bytes_per_step"] == 7 and got["seed"] == 1


def test_torch_hsdp_trains_the_same_tokens_with_trains_optimizer(tmp_path):
  """The torch row's command: HSDP (the strategy benchmark's fastest torch configuration at A = 1
  on slow links) on the same model, steps, batch, seed and held-out batches as the train runs,
  with train's own optimizer, learning rate and warm-up (experiments/bench/torch_peer.py
  `--schedule train`, which tests/experiments/test_torch_peer.py checks against a plain loop);
  planned as III's synchronous step."""
  from paro_jax.run.config import OptimizerOptions

  args = _args(tmp_path)
  configs = {c["label"]: c for c in outer_vs_paro.configurations(101, 2)}
  torch_row, iig = configs[outer_vs_paro.TORCH + " seed1"], configs["IIG seed1"]
  argv = outer_vs_paro.command(args, torch_row, "D")
  value = lambda cmd, flag: cmd[cmd.index(flag) + 1]  # noqa: E731
  assert argv[:5] == ["python", "-m", "experiments.bench.torch_peer", "--peer", "hsdp"]
  train = outer_vs_paro.command(args, iig, "D")
  for flag in ("--model", "--steps", "--batch-size", "--seq-len", "--dtype", "--seed", "--out"):
    assert value(argv, flag) == value(train, flag), flag
  assert value(argv, "--eval-batches") == value(train, "--eval-batches")
  assert value(argv, "--schedule") == "train" and value(argv, "--remat") == "full"
  o = OptimizerOptions()
  assert float(value(argv, "--lr")) == o.lr and int(value(argv, "--warmup")) == o.warmup
  iii = {**iig, "flags": ["--strategy", "III"]}
  assert outer_vs_paro.planned_bytes(args, torch_row) == outer_vs_paro.planned_bytes(args, iii)


def test_torch_row_without_torch_says_how_to_get_it(tmp_path, monkeypatch):
  """Where torch is not installed, the torch row is an error row naming the extra; nothing is
  launched and the run's folder of an earlier run is kept."""
  import importlib.util

  real = importlib.util.find_spec
  monkeypatch.setattr(
    importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a)
  )
  config = outer_vs_paro.configurations(101, 1)[-2]
  assert config["label"] == outer_vs_paro.TORCH
  directory = tmp_path / "runs" / "torch"
  directory.mkdir(parents=True)
  (directory / "row.json").write_text("{}")  # an earlier run's (another command: not reused)
  row = outer_vs_paro.run(_args(tmp_path), config, str(directory), None)
  assert (directory / "row.json").read_text() == "{}"
  assert row["error"] == "torch is not installed: pip install -e '.[bench]'"
  assert row["label"] == outer_vs_paro.TORCH and "tokens_per_s" not in row
