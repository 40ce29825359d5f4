"""experiments/results/step_copies/ (experiments/step_copies.py): what the outer loop's compiled
step copies on a step that ends no round. The counter is checked on a made-up module; the page
against its JSON and against what the compiles show."""

import json
import os

import pytest

from experiments import step_copies

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(REPO, "experiments", "results")
PAGES = ["step_copies", "step_copies_h100"]  # on this machine's CPU devices; compiled for H100s

# an entry copying 16 bytes, a loop of 3 trips copying 8 bytes a trip, a switch whose last
# branch copies 4 bytes (its first 400), a call copying 2, and a fusion whose copy is its kernel's
MODULE = """HloModule m, is_scheduled=true

%fused (p: f32[100]) -> f32[100] {
  %p = f32[100]{0} parameter(0)
  ROOT %c = f32[100]{0} copy(%p)
}

%body (b: (s32[], f32[2])) -> (s32[], f32[2]) {
  %b = (s32[], f32[2]) parameter(0)
  %x = f32[2]{0} get-tuple-element(%b), index=1
  %y = f32[2]{0} copy(%x)
  %i = s32[] get-tuple-element(%b), index=0
  ROOT %t = (s32[], f32[2]) tuple(%i, %y)
}

%cond (c: (s32[], f32[2])) -> pred[] {
  %c = (s32[], f32[2]) parameter(0)
  ROOT %k = pred[] constant(true)
}

%due (d: f32[100]) -> f32[100] {
  %d = f32[100]{0} parameter(0)
  ROOT %e = f32[100]{0} copy(%d)
}

%quiet (q: f32[100]) -> f32[1] {
  %q = f32[100]{0} parameter(0)
  %s = f32[1]{0} slice(%q), slice={[0:1]}
  ROOT %r = f32[1]{0} copy(%s)
}

%called (a: bf16[1]) -> bf16[1] {
  %a = bf16[1]{0} parameter(0)
  ROOT %z = bf16[1]{0} copy(%a)
}

ENTRY %main (x: f32[4], w: (s32[], f32[2]), v: f32[100], n: s32[], h: bf16[1]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %c0 = f32[4]{0} copy(%x)
  %w = (s32[], f32[2]) parameter(1)
  %l = (s32[], f32[2]) while(%w), condition=%cond, body=%body, \
backend_config={"known_trip_count":{"n":"3"}}
  %v = f32[100]{0} parameter(2)
  %n = s32[] parameter(3)
  %s = f32[1]{0} conditional(%n, %v, %v), branch_computations={%due, %quiet}
  %h = bf16[1]{0} parameter(4)
  %k = bf16[1]{0} call(%h), to_apply=%called
  %f = f32[100]{0} fusion(%v), kind=kLoop, calls=%fused
  ROOT %o = f32[4]{0} add(%c0, %c0)
}
"""


def test_the_quiet_step_counts_each_copy_as_often_as_it_runs():
  assert step_copies.quiet_copies(MODULE) == 16 + 3 * 8 + 4 + 2
  with pytest.raises(ValueError, match="no ENTRY"):
    step_copies.quiet_copies("HloModule m\n")


def _record(page) -> dict:
  with open(os.path.join(RESULTS, page, "step_copies.json")) as f:
    return json.load(f)


@pytest.mark.parametrize("page", PAGES)
def test_the_page_is_its_json(page):
  record = _record(page)
  with open(os.path.join(RESULTS, page, "README.md")) as f:
    assert f.read() == step_copies.page(record)
  assert [r["label"] for r in record["rows"]] == [label for label, _ in step_copies.CONFIGS]
  assert [r["flags"] for r in record["rows"]] == [flags for _, flags in step_copies.CONFIGS]
  assert record["target"] == (None if page == "step_copies" else "h100")


@pytest.mark.parametrize("page", PAGES)
def test_what_a_quiet_step_copies(page):
  """What the pages say of the compiles, in master-sized units: the bound copies about what the
  synchronous step copies (and on a GPU the compute-dtype copy of the weights, the master's size
  in fp32, through the round's switch); the outer state at I (outer weights, momentum and
  residual, each the master's size) is copied at least once a quiet step; Streaming without the
  delay copies what DiLoCo at I does, with it more; on the CPU it also holds at least that outer
  state more in temporaries."""
  rows = {r["label"]: r for r in _record(page)["rows"]}
  sync, bound = rows["III, synchronous"], rows["DiLoCo, no round in the run (the bound)"]
  at_i = rows["DiLoCo H=10 int8 I"]
  plain, delay = (
    rows["Streaming H=20 F=4 int8 I, no delay"],
    rows["Streaming H=20 F=4 tau=1 int8 I"],
  )
  master = delay["master_bytes"]
  assert 0 <= bound["quiet_copy_bytes"] - sync["quiet_copy_bytes"] < 1.25 * master
  assert at_i["quiet_copy_bytes"] - bound["quiet_copy_bytes"] >= 3 * master
  assert plain["quiet_copy_bytes"] == at_i["quiet_copy_bytes"]
  assert delay["quiet_copy_bytes"] - plain["quiet_copy_bytes"] >= master
  if page == "step_copies":
    assert delay["temp_bytes"] - plain["temp_bytes"] >= 3 * master
  else:
    assert 0 < delay["temp_bytes"] - plain["temp_bytes"] < master
