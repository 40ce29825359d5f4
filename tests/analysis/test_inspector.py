"""The inspector reads from compiled HLO the traffic that docs/design.md's formulas predict.

Here four strategies at A=1 and A=4 (two whose inter-node traffic is once per step, two whose is
every micro-batch); all 14 at both are the page experiments/results/inspector_grid/
(experiments/inspector_grid.py compiles this module's inspect_report;
tests/experiments/test_inspector_grid.py applies this module's assertions to the page)."""

import dataclasses
import json

import jax.numpy as jnp
import pytest

from models.llama import Llama
from models.config import LlamaConfig
from paro_jax.analysis.hlo.collectives import device_bytes, level_of, parse_collectives, phase_of
from paro_jax.core.state import OptimConfig
from paro_jax.core.engine import Engine
from paro_jax.analysis.inspect.abstract import compile_step
from paro_jax.analysis.inspect.inspector import report
from paro_jax.core.mesh import make_mesh
from paro_jax.core.strategy import parse_strategy

CFG = LlamaConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp=64)


def inspect_report(
  strategy, micro_batches, collectives="xla", mesh=(2, 4), remat="full", seq_len=8, model=None
):
  engine = Engine(
    model or Llama(CFG, jnp.float32, remat),
    parse_strategy(strategy),
    make_mesh(*mesh),
    OptimConfig(),
    micro_batches=micro_batches,
    collectives=collectives,
  )
  return report(engine, compile_step(engine, batch_size=8, seq_len=seq_len))


STRATEGIES = ("NNI", "IIG", "NGG", "GGG")


@pytest.fixture(scope="module")
def reports():
  return {(s, a): inspect_report(s, a) for s in STRATEGIES for a in (1, 4)}


def assert_bytes_equal_formula(r):
  for key in ("inter_bytes", "intra_bytes"):
    measured, expected = r["measured"][key], r["expected"][key]
    # Only scalar metrics (loss, gradient norm) are extra: a few bytes.
    assert measured == pytest.approx(expected, rel=0.01, abs=64), (key, measured, expected)


def assert_inter_frequency(strategy, one, four):
  """Inter-node traffic is m x A + b: m the micro-batches' (parameter gathers, gradient
  reduce-scatters), b the boundary syncs', each from the formulas' phases at A=1 (`one`'s). Once
  per step (G and P not globally sharded: m = 0) A=4 (`four`) moves what A=1 does; on every
  micro-batch, A=4 moves (4m + b) / (m + b) times as much (4x for GGG, whose b is 0)."""
  one_bytes, four_bytes = one["measured"]["inter_bytes"], four["measured"]["inter_bytes"]
  inter = {
    key.split("/")[0]: v for key, v in one["expected"]["phases"].items() if key.endswith("/inter")
  }
  per_micro_batch = ("forward params", "backward params (remat)", "backward grads")
  m = sum(v for phase, v in inter.items() if phase in per_micro_batch)
  b = sum(v for phase, v in inter.items() if phase not in per_micro_batch)
  p, g, _ = strategy
  if g in "NI" and p != "G":
    assert m == 0 and four_bytes == pytest.approx(one_bytes, rel=0.01, abs=64)  # once per step
  else:
    assert m > 0 and four_bytes / one_bytes == pytest.approx((4 * m + b) / (m + b), rel=0.01)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("a", [1, 4])
def test_measured_bytes_equal_formula(reports, strategy, a):
  assert_bytes_equal_formula(reports[(strategy, a)])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_inter_traffic_frequency(reports, strategy):
  assert_inter_frequency(strategy, reports[(strategy, 1)], reports[(strategy, 4)])


def test_phases_and_levels_iig(reports):
  rows = {(c["kind"], c["phase"], c["level"]) for c in reports[("IIG", 4)]["collectives"]}
  assert ("all-gather", "forward", "intra") in rows
  assert ("all-gather", "backward (remat)", "intra") in rows
  assert ("reduce-scatter", "backward", "intra") in rows
  assert ("reduce-scatter", "gradient sync", "inter") in rows
  assert ("all-gather", "parameter sync", "inter") in rows
  assert not any(
    level != "intra" and phase in ("forward", "backward", "backward (remat)")
    for _, phase, level in rows
  )


def test_json_fields(reports):
  r = json.loads(json.dumps(reports[("GGG", 4)]))
  assert r["strategy"] == "GGG" and r["mesh"] == {"inter": 2, "intra": 4}
  assert r["micro_batches"] == 4 and r["params"] == CFG.param_count()
  assert r["step_program"] == "boundary-sync"  # the CPU's choice (core/step.py)
  assert set(r["measured"]) >= {"inter_bytes", "intra_bytes"}
  assert set(r["expected"]) >= {"inter_bytes", "intra_bytes"}
  # The state is an argument of the step: the compiled peak holds at least the model states.
  assert r["collectives"]
  assert r["memory"]["compiled"]["peak_bytes"] >= r["memory"]["model_states"]["total"]


def test_horing_rings_across_nodes_and_runs_the_runtime_collectives_inside():
  """IIG's collectives each span one level: with HO-Ring, those across nodes are the hand-written
  ring (permutes), those inside a node the runtime's all-gather and reduce-scatter."""
  r = inspect_report("IIG", 1, collectives="horing")
  kinds = {
    lvl: {c["kind"] for c in r["collectives"] if c["level"] == lvl} for lvl in ("inter", "intra")
  }
  assert kinds["inter"] == {"collective-permute"}, kinds
  assert {"all-gather", "reduce-scatter"} <= kinds["intra"], kinds
  assert "collective-permute" not in kinds["intra"], kinds


@pytest.mark.parametrize(
  "strategy,collectives", [("GGG", "horing"), ("IGG", "hring"), ("NGG", "horing+xla")]
)
def test_two_level_rings_bytes_per_level_equal_formula(strategy, collectives):
  """The rings' compiled permutes, classified by the devices they connect, send what
  costs.step_traffic(two_level=True) predicts on each level."""
  r = inspect_report(strategy, 2, collectives=collectives)
  for key in ("inter_bytes", "intra_bytes"):
    measured, expected = r["measured"][key], r["expected"][key]
    assert measured == pytest.approx(expected, rel=0.01, abs=64), (key, measured, expected)


@pytest.mark.parametrize(
  "strategy,tied",
  [("GGG", True), ("IIG", False), ("NGG", True)],
  ids=["GGG-tied", "IIG", "NGG-tied"],
)
def test_vocabulary_tiles_bytes_equal_formula(strategy, tied):
  """A vocabulary of 62 in 4 tiles of 16 (the last overlapping): the compiled step sends what
  the formula counts of the table's and head's passes (models/config.py VocabPasses: the head's
  tiles gathered in forward and again in backward, a tied table's two uses each gathered and
  scattered), not the one gather and scatter of each parameter; that count alone would miss."""
  cfg = dataclasses.replace(CFG, vocab=62, tie_embeddings=tied)
  r = inspect_report(strategy, 2, model=Llama(cfg, jnp.float32, vocab_chunk=16))
  untiled = inspect_report(strategy, 2, model=Llama(cfg, jnp.float32))["expected"]
  for key in ("inter_bytes", "intra_bytes"):
    measured, expected = r["measured"][key], r["expected"][key]
    assert measured == pytest.approx(expected, rel=0.01, abs=64), (key, measured, expected)
  total = lambda t: t["inter_bytes"] + t["intra_bytes"]
  assert total(r["measured"]) > total(untiled) + 1024, "the tiles' passes: a visible difference"


def test_remat_policy_trades_memory_for_traffic():
  r = {p: inspect_report("GGG", 2, remat=p, seq_len=64) for p in ("full", "layer", "none")}
  peak = {p: r[p]["memory"]["compiled"]["peak_bytes"] for p in r}
  assert peak["full"] < peak["layer"] < peak["none"]
  # Without remat the layer weights are not gathered again in backward.
  inter = {p: r[p]["measured"]["inter_bytes"] for p in r}
  assert inter["none"] < inter["layer"] == pytest.approx(inter["full"])
  for p in r:
    assert inter[p] == pytest.approx(r[p]["expected"]["inter_bytes"], rel=0.01)


SYNTHETIC = """HloModule m

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %ag = f32[16]{0} all-gather(%x), channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(f)/shard_map/micro_batches/while/body/all_gather"}
  %cp = f32[8]{0} collective-permute(%x), channel_id=2, source_target_pairs={{0,1},{1,0},{4,5},{5,4}}
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %x)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %w = (s32[], f32[8]{0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %ar = f32[8]{0} all-reduce(%a), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add, metadata={op_name="jit(f)/shard_map/grad_sync/psum"}
  ROOT %r = f32[8]{0} copy(%a)
}
"""


def test_hlo_parser_on_synthetic_module():
  found = {c.name: c for c in parse_collectives(SYNTHETIC)}
  ag, cp, ar = found["ag"], found["cp"], found["ar"]
  assert ag.count == 5 and cp.count == 5 and ar.count == 1
  # [4,2]<=[2,4]T(1,0): groups are the columns of the 2x4 mesh: {0,4}, {1,5}, ...
  assert ag.groups == [[0, 4], [1, 5], [2, 6], [3, 7]]
  assert level_of(ag, intra=4) == "inter" and phase_of(ag.op_name) == "forward"
  assert device_bytes(ag, 8)[0] == pytest.approx(0.5 * 64)
  assert level_of(cp, intra=4) == "intra" and device_bytes(cp, 8) == {
    0: 32,
    1: 32,
    4: 32,
    5: 32,
  }
  assert level_of(ar, intra=4) == "global" and phase_of(ar.op_name) == "gradient sync"
  assert device_bytes(ar, 8)[3] == pytest.approx(2 * 7 / 8 * 32)


COMBINED = """HloModule m

ENTRY %main (a: f32[8], b: f32[4]) -> f32[12] {
  %a = f32[8]{0} parameter(0)
  %b = f32[4]{0} parameter(1)
  %rs = f32[2]{0} reduce-scatter(%a), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, to_apply=%add, metadata={op_name="jit(f)/shard_map/micro_batches/transpose(micro_batches)/jvp(layer_grad_sync)/reduce_scatter"}
  %bc = f32[2]{0} bitcast(%rs), metadata={scheduling_name="bc"}
  %cat = f32[6]{0} fusion(%bc, /*index=1*/%b), kind=kLoop, calls=%concat, metadata={scheduling_name="cat"}
  %ars = f32[6]{0} all-reduce-start(%cat), channel_id=2, replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add, metadata={scheduling_name="ars"}
  ROOT %ard = f32[6]{0} all-reduce-done(%ars)
}
"""


def test_a_combined_collective_takes_the_phase_of_its_data():
  """XLA:GPU's all-reduce combiner concatenates per-layer gradients into one all-reduce that
  carries no op_name (NNI's inter-node gradient all-reduces, 96% of its inter bytes, were filed
  under `other`): it takes the name of the nearest named producer of its operands."""
  found = {c.name: c for c in parse_collectives(COMBINED)}
  assert phase_of(found["ars"].op_name) == "gradient sync"
  assert level_of(found["ars"], intra=4) == "inter"
