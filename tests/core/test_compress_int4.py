"""The 4-bit wire format (`--inter-grads int4` with `--outer-sync`: core/compress.py).

* Round trip: 15 levels of a block's largest magnitude, off by at most max|block| / 14 per
  element; two values per byte.
* The reduce-scatter over `inter` that the outer loop sums its pseudo-gradients with, against
  the exact sum in float64: each device's chunk is off by at most the sum over the g senders of
  their blocks' bounds (each term is quantized once, by its sender, and summed in fp32).
* The compiled collective really carries half int8's value bytes (the scales unchanged).
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from paro_jax.analysis.hlo.collectives import parse_collectives
from paro_jax.core import collectives as C
from paro_jax.core.compress import pack_int4, quantize, roundtrip, unpack_int4
from paro_jax.core.config import OuterOptions, StepConfig, WireOptions
from paro_jax.core.wire import Codec

BLOCK = 16
INT4 = Codec("int4", BLOCK)


@pytest.mark.parametrize("n", [1, 15, 16, 33, 1000])
def test_int4_roundtrip_within_block_bound(n):
  rng = np.random.RandomState(n)
  x = rng.standard_normal(n).astype(np.float32) * rng.choice([1e-3, 1.0, 1e3], n)
  packed, scales = quantize(jnp.asarray(x), INT4)
  assert packed.dtype == jnp.uint8 and packed.shape == (-(-n // 2),)  # two values a byte
  assert scales.shape == (-(-n // BLOCK),)
  y = np.asarray(roundtrip(jnp.asarray(x), INT4))
  for start in range(0, n, BLOCK):
    blk = slice(start, start + BLOCK)
    assert np.abs(y[blk] - x[blk]).max() <= np.abs(x[blk]).max() / 14 * (1 + 1e-6)
  assert n < 4 or np.abs(y - x).max() > 0  # it did round


def test_pack_keeps_every_level():
  q = jnp.asarray(np.arange(-7, 8, dtype=np.int8))  # 15 values: an odd count
  np.testing.assert_array_equal(np.asarray(unpack_int4(pack_int4(q), 15)), np.asarray(q))


G, ELEMS = 2, 8 * 37  # chunks of 37 x intra elements: a shorter last block


@pytest.fixture(scope="module")
def scattered():
  """Per wire format: (each device's reduce-scattered chunk over `inter`, the compiled text)."""
  mesh = jax.make_mesh((G, 4), ("inter", "intra"), devices=jax.devices()[:8])
  spec = P(("inter", "intra"))
  x = np.random.RandomState(0).standard_normal((8, G * ELEMS)).astype(np.float32)
  out = {}
  for fmt in ("int8", "int4"):
    fn = jax.jit(
      jax.shard_map(
        lambda b, fmt=fmt: C.reduce_scatter(
          b[0], ("inter",), dim=0, impl="xla", wire=Codec(fmt, BLOCK)
        )[None],
        mesh=mesh,
        in_specs=spec,
        out_specs=spec,
        check_vma=False,
      )
    )
    arg = jax.device_put(x, NamedSharding(mesh, spec))
    out[fmt] = (np.asarray(fn(arg)), fn.lower(arg).compile().as_text())
  return x, out


def test_int4_sum_within_the_derived_bound(scattered):
  x, out = scattered
  got = out["int4"][0]
  for d in range(8):  # device d = k*4 + l: chunk k of the senders k' = 0..G-1 at local rank l
    k, l = divmod(d, 4)
    terms = [x[kk * 4 + l].reshape(G, ELEMS)[k].astype(np.float64) for kk in range(G)]
    exact = sum(terms)
    blocks = lambda t: np.repeat(
      [np.abs(t[i : i + BLOCK]).max() for i in range(0, ELEMS, BLOCK)], BLOCK
    )[:ELEMS]
    bound = sum(blocks(t) / 14 for t in terms) * (1 + 1e-5)
    err = np.abs(got[d] - exact)
    assert np.all(err <= bound) and err.max() > 0
    # int8 on the same data is ~18x closer: the two formats' levels (127 / 7)
    assert np.abs(out["int8"][0][d] - exact).max() < err.max()


def test_int4_halves_the_value_bytes_on_the_wire(scattered):
  _, out = scattered

  def payload(text):  # bytes per device of the all-to-all's operands, by dtype
    by = {}
    for c in parse_collectives(text):
      if c.kind == "all-to-all":  # one dtype each: the values' or the scales'
        (dt,) = set(c.dtypes)
        by[dt] = by.get(dt, 0) + c.out_bytes * c.count
    return by

  int8, int4 = payload(out["int8"][1]), payload(out["int4"][1])
  n = G * ELEMS  # values a device sends (its own chunk included)
  assert int8 == {"s8": n, "f32": 4 * -(-ELEMS // BLOCK) * G}
  assert int4 == {"u8": n // 2, "f32": int8["f32"]}


def test_int4_only_for_the_outer_loop():
  with pytest.raises(ValueError, match="--inter-grads int4 is the outer loop's"):
    StepConfig(strategy="IIG", wire=WireOptions(inter_grads="int4"))
  StepConfig(strategy="III", wire=WireOptions(inter_grads="int4"), outer=OuterOptions(sync=2))
