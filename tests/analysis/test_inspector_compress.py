"""Inspector bytes per level with compressed inter traffic == the formula with the wire sizes
(docs/design.md, "Compressed inter-node traffic"), scales included: int8 for four strategies
here, for all 14 on the page experiments/results/inspector_grid/ (its int8 cells, checked with
this module's assertion by tests/experiments/test_inspector_grid.py)."""

import jax.numpy as jnp
import pytest

from models.config import LoraConfig
from models.llama import Llama
from paro_jax.analysis.inspect.abstract import compile_step
from paro_jax.analysis.inspect.inspector import expected_traffic, format_report, report
from paro_jax.core.wire import WireConfig
from paro_jax.core.state import OptimConfig
from paro_jax.core.engine import Engine
from paro_jax.core.mesh import make_mesh
from paro_jax.core.strategy import parse_strategy
from tests.analysis.test_inspector import CFG

# The formula counts 4 bytes of scale per `block` elements; the program sends one more scale for
# a chunk's short last block. On this tiny model (chunks of a few hundred elements) block 64 keeps
# that within the 1% the test asks; on real models chunks are far larger than a block.
INT8 = WireConfig("int8", "int8", block=64)


def engine_for(strategy, wire, collectives="xla", grad="compute"):
  return Engine(
    Llama(CFG, jnp.float32),
    parse_strategy(strategy),
    make_mesh(2, 4),
    OptimConfig(),
    micro_batches=2,
    collectives=collectives,
    wire=wire,
    grad_dtype=grad,
  )


def inspect(strategy, wire, collectives="xla", grad="compute"):
  engine = engine_for(strategy, wire, collectives, grad)
  return report(engine, compile_step(engine, batch_size=8, seq_len=8))


def assert_formula(r, inter_factor=1.0):
  for key, factor in (("inter_bytes", inter_factor), ("intra_bytes", 1.0)):
    measured, expected = r["measured"][key], r["expected"][key] * factor
    assert measured == pytest.approx(expected, rel=0.01, abs=64), (key, measured, expected)


def int8_figures(strategy) -> dict:
  """What assert_int8_bytes_equal_formula reads of the int8 step's compile (a page records it)."""
  r = inspect(strategy, INT8)
  return {
    "measured": {k: r["measured"][k] for k in ("inter_bytes", "intra_bytes")},
    "expected": {k: r["expected"][k] for k in ("inter_bytes", "intra_bytes")},
    "plain_inter_bytes": expected_traffic(engine_for(strategy, WireConfig())).inter,
    "inter_dtypes": sorted({c["dtype"] for c in r["collectives"] if c["level"] == "inter"}),
  }


def assert_int8_bytes_equal_formula(f):
  assert_formula(f)
  # fp32 compute: int8 + scales is about a quarter of the uncompressed inter bytes (the formula
  # without compression, which test_inspector checks against the compiled program)
  assert f["measured"]["inter_bytes"] < 0.3 * f["plain_inter_bytes"]
  # (a collective over all devices counts as inter uncompressed: no intra comparison here)
  assert any("s8" in dtype for dtype in f["inter_dtypes"])


@pytest.mark.parametrize("strategy", ["NNN", "NIG", "IIG", "GGG"])
def test_int8_bytes_equal_formula(strategy):
  assert_int8_bytes_equal_formula(int8_figures(strategy))


@pytest.mark.parametrize("collectives", ["ring", "horing"])
def test_int8_bytes_equal_formula_hand_written(collectives):
  assert_formula(inspect("GGG", INT8, collectives))


def test_bf16_wire_on_cpu_is_f32():
  """XLA:CPU runs bf16 collectives in f32: bf16 inter traffic measures 2x its formula here."""
  r = inspect("IIG", WireConfig("bf16", "bf16"))
  assert_formula(r, inter_factor=2.0)
  assert any("XLA:CPU" in n for n in r["notes"])
  # The report compares with what this compile moves (the formula in f32), not the bf16 one.
  for key in ("inter_bytes", "intra_bytes"):
    assert r["measured"][key] == pytest.approx(r["expected_here"][key], rel=0.01, abs=64), key
  assert "+100.00%" not in format_report(r) and "+99." not in format_report(r)


def test_bf16_compute_on_cpu_compares_with_the_f32_bytes():
  """`paro-jax inspect` in bf16 on CPU: the bytes XLA:CPU moves are the formula at 4 bytes per
  value, twice the bf16 formula, and the report's difference is against them."""
  engine = Engine(
    Llama(CFG, jnp.bfloat16), parse_strategy("IIG"), make_mesh(2, 4), OptimConfig(), 2
  )
  r = report(engine, compile_step(engine, batch_size=8, seq_len=8))
  for key in ("inter_bytes", "intra_bytes"):
    assert r["expected_here"][key] == pytest.approx(2 * r["expected"][key]), key
    assert r["measured"][key] == pytest.approx(r["expected_here"][key], rel=0.01, abs=64), key
  rows = [line.split() for line in format_report(r).splitlines() if line.startswith("in")]
  assert [row[0] for row in rows] == ["inter_bytes", "intra_bytes"]
  assert all(abs(float(row[-1].rstrip("%"))) < 1 for row in rows), rows


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "model-scan"])
def test_bf16_lora_on_cpu_gathers_its_weights_as_16_bit_words(prefetch):
  """A bf16 LoRA step on CPU gathers its weights as their bits (Engine.gather_bits): those
  gathers are u16, at the bf16 formula's bytes, the rest (adapter syncs, gradients) in f32; the
  report's expected bytes here count them so, and the measured equal them."""
  lora = LoraConfig(rank=2, alpha=4.0, targets=("wq", "wv"))
  engine = Engine(
    Llama(CFG, jnp.bfloat16, lora=lora),
    parse_strategy("ING"),
    make_mesh(2, 4),
    OptimConfig(),
    2,
    prefetch=prefetch,
  )
  assert engine.gather_bits
  r = report(engine, compile_step(engine, batch_size=8, seq_len=8))
  per_micro_batch = [c for c in r["collectives"] if c["phase"] in ("forward", "backward (remat)")]
  assert per_micro_batch and {c["dtype"] for c in per_micro_batch} == {"u16"}
  for key in ("inter_bytes", "intra_bytes"):
    assert r["measured"][key] == pytest.approx(r["expected_here"][key], rel=0.01, abs=64), key
  # the frozen base's gathers (intra on ING) at 2 bytes: the bf16 formula's, not twice it
  assert r["expected_here"]["intra_bytes"] == pytest.approx(r["expected"]["intra_bytes"])


def test_fp32_grads_double_boundary_bytes():
  """bf16 compute, --grad-dtype fp32: the boundary sync moves fp32 (as does bf16 on XLA:CPU, so
  the inter bytes are the formula's); int8 grads are then quantized from fp32."""
  engine = Engine(
    Llama(CFG, jnp.bfloat16),
    parse_strategy("IIG"),
    make_mesh(2, 4),
    OptimConfig(),
    micro_batches=2,
    wire=WireConfig(grads="int8", block=64),
    grad_dtype="fp32",
  )
  r = report(engine, compile_step(engine, batch_size=8, seq_len=8))
  assert r["grad_dtype"] == "float32"
  assert r["memory"]["model_states"]["grads"] == 4 * CFG.param_count() // 4
  sync = [c for c in r["collectives"] if c["phase"] == "gradient sync" and c["level"] == "inter"]
  assert sync and all("s8" in c["dtype"] or c["dtype"] == "f32" for c in sync)
  exp = r["expected"]["phases"]
  assert exp["grad sync/inter"] == pytest.approx(1 / 2 * CFG.param_count() / 4 * (1 + 4 / 64))
