"""paro_jax.core.compress and the collectives' `wire` argument.

* Round trips: int8 with per-block scales is off by at most max|block| / 254 per element (the last,
  shorter block included); bf16 by at most 2^-9 relative.
* Compressed collectives == a reference built from `lax` collectives and the round trip: the
  all-gather exactly (each chunk is quantized once and every device dequantizes the same payload);
  the reduce-scatter and all-reduce up to fp32 summation order, for every impl and both the inter
  axis alone and the global (intra, inter) axes. Intra-only collectives are unchanged.
* The error bound of the int8 reduce-scatter: relative error against the exact sum, on random
  data, independent of g for g = 2, 4, 8. The same check rejects a ring that re-quantizes its
  partial sum on every hop (simulated here), so the check can fail.
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from paro_jax.core import collectives as C
from paro_jax.core.rings import lax_axes
from paro_jax.core.wire import Codec, WireConfig
from paro_jax.core.compress import dequantize, quantize, roundtrip

DEV = P(("inter", "intra"))
IMPLS = ["xla", "ring", "hring", "horing"]
AXES = [("inter",), ("intra", "inter"), ("intra",)]
INT8 = Codec("int8", 16)  # small blocks: every chunk below has a shorter last block


# --------------------------------------------------------------------------
# round trips
# --------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 15, 16, 100, 1000])
def test_int8_roundtrip_within_block_bound(n):
  rng = np.random.RandomState(n)
  x = rng.standard_normal(n).astype(np.float32) * rng.choice([1e-3, 1.0, 1e3], n)
  x[: min(n, 3)] = 0.0  # an all-zero start (a zero block when n is small)
  codec = Codec("int8", 16)
  q, scales = quantize(jnp.asarray(x), codec)
  assert q.dtype == jnp.int8 and q.shape == (n,)
  assert scales.dtype == jnp.float32 and scales.shape == (-(-n // 16),)
  assert q.nbytes + scales.nbytes == n + 4 * -(-n // 16)  # a byte each, an fp32 scale a block
  y = np.asarray(roundtrip(jnp.asarray(x), codec))
  for start in range(0, n, 16):  # every block, the shorter last one included
    blk = slice(start, start + 16)
    bound = np.abs(x[blk]).max() / 254 * (1 + 1e-6)
    assert np.abs(y[blk] - x[blk]).max() <= bound
  # ... and not exact: a broken (identity) codec would pass the bound.
  assert n < 16 or np.abs(y - x).max() > 0


def test_bf16_roundtrip_and_dtype():
  x = jnp.asarray(np.random.RandomState(0).standard_normal((7, 9)).astype(np.float32))
  y = roundtrip(x, Codec("bf16"))
  assert y.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(y), np.asarray(x.astype(jnp.bfloat16), np.float32))
  assert np.abs(np.asarray(y - x)).max() <= np.abs(np.asarray(x)).max() * 2**-8
  assert dequantize(quantize(x, Codec("int8")), Codec("int8"), x.shape, jnp.bfloat16).dtype == (
    jnp.bfloat16
  )


def test_codec_refuses_bad_settings():
  with pytest.raises(ValueError, match="wire precision"):
    Codec("int2")
  with pytest.raises(ValueError, match="int8-block"):
    Codec("int8", 0)
  with pytest.raises(ValueError, match="int8-block"):
    WireConfig(grads="int8", block=-4)
  assert not Codec("bf16").active_for(jnp.bfloat16) and Codec("bf16").active_for(jnp.float32)
  assert Codec("int8").active_for(jnp.bfloat16) and not Codec("int8").active_for(jnp.int32)
  assert Codec("int8", 256).bytes_per_element(2) == 1 + 4 / 256
  assert Codec("int4", 256).bytes_per_element(4) == 0.5 + 4 / 256  # two values a byte


# --------------------------------------------------------------------------
# compressed collectives == lax + round trip, on a 2x4 mesh
# --------------------------------------------------------------------------


def _ref_rs(x, axes, codec):
  """Reference of the compressed reduce-scatter of [k*c, ...] (dim 0): exact intra sum first,
  then the round trip of each node-summed chunk, then the exact inter sum."""
  g = lax.axis_size("inter")
  k = g * (lax.axis_size("intra") if len(axes) == 2 else 1)
  xs = x.reshape((k, -1) + x.shape[1:])
  if len(axes) == 2:  # (intra, inter): row l*g + j
    xs = lax.psum_scatter(xs.reshape((-1, g) + xs.shape[1:]), "intra", tiled=False)
  q = jnp.stack([roundtrip(xs[j], codec) for j in range(g)])
  return lax.psum_scatter(q, "inter", tiled=False)


def _ref_ag(x, axes, codec):
  return lax.all_gather(roundtrip(x, codec), lax_axes(axes), axis=0, tiled=True)


@pytest.fixture(scope="module")
def results():
  mesh = jax.make_mesh((2, 4), ("inter", "intra"), devices=jax.devices()[:8])
  rng = np.random.RandomState(0)
  ag_in = rng.standard_normal((8, 40, 3)).astype(np.float32)
  rs_in = rng.standard_normal((8, 8 * 5, 7)).astype(np.float32)  # chunks of 35: a short block
  ar_in = rng.standard_normal((8, 11, 3)).astype(np.float32)  # 33: padded to a multiple of 8
  cases = [(i, a) for i in IMPLS for a in AXES]

  def body(ag, rs, ar):
    ag, rs, ar = ag[0], rs[0], ar[0]
    out = []
    for impl, axes in cases:
      out += [
        C.all_gather(ag, axes, dim=0, impl=impl, wire=INT8),
        C.reduce_scatter(rs, axes, dim=0, impl=impl, wire=INT8),
        C.all_reduce(ar, axes, impl=impl, wire=INT8),
      ]
    for axes in AXES:
      if "inter" in axes:
        rs_ref = _ref_rs(rs, axes, INT8)
        pad = -33 % (8 if len(axes) == 2 else 2)  # all_reduce pads to a multiple of k
        flat = jnp.concatenate([ar.reshape(-1), jnp.zeros((pad,), ar.dtype)])
        ar_ref = _ref_ag(_ref_rs(flat, axes, INT8), axes, INT8)[:33].reshape(ar.shape)
        out += [_ref_ag(ag, axes, INT8), rs_ref, ar_ref]
      else:
        out += [
          lax.all_gather(ag, "intra", axis=0, tiled=True),
          lax.psum_scatter(rs, "intra", scatter_dimension=0, tiled=True),
          lax.psum(ar, "intra"),
        ]
    # bf16 on the wire of an fp32 all-gather / reduce-scatter (xla and horing)
    for impl in ("xla", "horing"):
      out += [
        C.all_gather(ag, ("intra", "inter"), dim=0, impl=impl, wire=Codec("bf16")),
        C.reduce_scatter(rs, ("intra", "inter"), dim=0, impl=impl, wire=Codec("bf16")),
      ]
    out += [
      _ref_ag(ag, ("intra", "inter"), Codec("bf16")),
      _ref_rs(rs, ("intra", "inter"), Codec("bf16")),
      lax.psum_scatter(rs, ("intra", "inter"), scatter_dimension=0, tiled=True),  # exact
    ]
    return [y[None] for y in out]

  put = lambda a: jax.device_put(jnp.asarray(a), NamedSharding(mesh, DEV))
  # check_vma off: replicated results come back stacked per device (out_specs DEV) to compare.
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(DEV,) * 3, out_specs=DEV, check_vma=False))
  outs = [np.asarray(o) for o in fn(put(ag_in), put(rs_in), put(ar_in))]
  n = 3 * len(cases)
  got = {c: outs[3 * i : 3 * i + 3] for i, c in enumerate(cases)}
  refs = {a: outs[n + 3 * i : n + 3 * i + 3] for i, a in enumerate(AXES)}
  bf16 = outs[n + 3 * len(AXES) :]
  return got, refs, bf16


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("axes", AXES)
def test_compressed_collectives_equal_reference(results, impl, axes):
  got, refs, _ = results
  (ag, rs, ar), (ag_ref, rs_ref, ar_ref) = got[(impl, axes)], refs[axes]
  np.testing.assert_array_equal(ag, ag_ref)  # quantized once, dequantized identically
  np.testing.assert_allclose(rs, rs_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ar, ar_ref, rtol=1e-5, atol=1e-5)
  # every replica of the all-reduce holds the same values (the optimizer relies on it)
  # (rows in mesh order: device k*4 + l; replicas share l over inter, k over intra)
  ar = ar.reshape((2, 4) + ar.shape[1:])
  if "inter" in axes:
    assert (ar == ar[:1]).all()
  if "intra" in axes:
    assert (ar == ar[:, :1]).all()


def test_bf16_wire(results):
  _, _, (ag_x, rs_x, ag_h, rs_h, ag_ref, rs_ref, exact) = results
  for ag in (ag_x, ag_h):
    np.testing.assert_array_equal(ag, ag_ref)
  for rs in (rs_x, rs_h):
    np.testing.assert_allclose(rs, rs_ref, rtol=1e-5, atol=1e-5)
    assert np.abs(rs - exact).max() > 0  # bf16 did cross the wire
    np.testing.assert_allclose(rs, exact, rtol=0, atol=np.abs(exact).max() * 2**-7)


# --------------------------------------------------------------------------
# error bound: independent of the number of nodes
# --------------------------------------------------------------------------

ELEMS = 4096  # per chunk


def _rel_err(got, exact):
  return float(np.linalg.norm(got - exact) / np.linalg.norm(exact))


def _data(g, seed=1):
  return np.random.RandomState(seed).standard_normal((g, g * ELEMS)).astype(np.float32)


@pytest.fixture(scope="module")
def scatter_errors():
  errs = {}
  for g in (2, 4, 8):
    mesh = jax.make_mesh((g, 1), ("inter", "intra"), devices=jax.devices()[:g])
    x = _data(g)
    spec = P(("inter", "intra"))
    out = {}
    for impl in ("xla", "horing"):
      fn = jax.shard_map(
        lambda b, impl=impl: C.reduce_scatter(
          b[0], ("inter",), dim=0, impl=impl, wire=Codec("int8")
        )[None],
        mesh=mesh,
        in_specs=spec,
        out_specs=spec,
        check_vma=False,
      )
      got = np.asarray(jax.jit(fn)(jax.device_put(x, NamedSharding(mesh, spec)))).reshape(-1)
      exact = x.astype(np.float64).sum(0)
      out[impl] = _rel_err(got, exact)
    errs[g] = out
  return errs


def _naive_ring_requantizing(x, codec):
  """A ring reduce-scatter that quantizes its running partial sum before every hop."""
  g = x.shape[0]
  chunks = x.reshape(g, g, -1)
  out = []
  for owner in range(g):
    acc = chunks[(owner + 1) % g, owner]
    for t in range(2, g + 1):
      acc = np.asarray(roundtrip(jnp.asarray(acc), codec)) + chunks[(owner + t) % g, owner]
    out.append(acc)
  return np.concatenate(out)


def _bound_holds(errs: dict) -> bool:
  """Below 1% for every g, and no growth with g (within sampling noise)."""
  return max(errs.values()) < 0.01 and max(errs.values()) / min(errs.values()) < 1.25


def test_int8_reduce_scatter_error_independent_of_g(scatter_errors):
  for impl in ("xla", "horing"):
    errs = {g: e[impl] for g, e in scatter_errors.items()}
    assert _bound_holds(errs), errs
    assert min(errs.values()) > 1e-3  # it did quantize
  # The check rejects a scheme whose error compounds hop after hop.
  naive = {
    g: _rel_err(_naive_ring_requantizing(_data(g), Codec("int8")), _data(g).sum(0))
    for g in (2, 4, 8)
  }
  assert not _bound_holds(naive), naive
