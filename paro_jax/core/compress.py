"""Compressed inter-node communication: the wire precision of the collectives' `inter` level.

A `Codec` says what one collective carries over the `inter` axis: `same` (the operand's dtype),
`bf16`, or `int8` (or `int4`) with one fp32 scale per block of `block` consecutive elements (the
last block of a chunk may be shorter: nothing is padded onto the wire but int4's odd nibble).
Intra-node traffic is never compressed. Where it is used (docs/collectives.md, "Compressed
inter-node traffic"):

* all-gather: each chunk is quantized once, by its owner; the compressed payload crosses `inter`
  (forwarded unchanged by a ring), and every device, the owner included, dequantizes it into the
  operand's dtype, so all replicas hold the same values;
* reduce-scatter: each device quantizes its g chunks once and sends chunk j straight to device j
  (an all-to-all over `inter`: the ring's bytes); the receiver dequantizes and sums in fp32. No
  partial sum is ever re-quantized, so the error does not compound with the number of nodes;
* all-reduce: that reduce-scatter, then that all-gather of the reduced chunk.

`int4` is int8's scheme with 15 levels (scale = max|block| / 7), two values packed per byte, as
Streaming DiLoCo sends its pseudo-gradients: half int8's value bytes, the same scales.

Error bound of int8 (round to nearest, scale = max|block| / 127): each element is off by at most
scale / 2 = max|block| / 254 (int4: max|block| / 14); a sum of g quantized terms is off by at
most the sum of the g terms' bounds, and for independent errors its root-mean-square error grows
like sqrt(g), as the exact sum itself does: the relative error does not depend on g
(tests/core/test_compress.py).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

# The formats themselves (no jax: the planner uses them): core/wire.py.
from paro_jax.core.wire import Codec


def _split_blocks(flat, block: int):
  """(full blocks [nb, block], tail [r]) of a 1-D array."""
  n = flat.shape[0]
  nb = n // block
  return flat[: nb * block].reshape(nb, block), flat[nb * block :]


# The largest magnitude of each integer format: its values lie in [-levels, levels].
INT_LEVELS = {"int8": 127, "int4": 7}


def quantize(x, codec: Codec):
  """The wire payload of `x`: a tuple of arrays (int8 values or int4 pairs packed in bytes, and
  fp32 scales; or one bf16)."""
  if codec.fmt == "bf16":
    return (x.astype(jnp.bfloat16),)
  if codec.fmt not in INT_LEVELS:
    return (x,)
  levels = INT_LEVELS[codec.fmt]
  flat = x.reshape(-1).astype(jnp.float32)
  main, tail = _split_blocks(flat, codec.block)
  parts, scales = [], []
  for blocks in (main, tail[None] if tail.shape[0] else None):
    if blocks is None or blocks.shape[0] == 0:
      continue
    scale = jnp.max(jnp.abs(blocks), axis=1) / levels
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(blocks / safe[:, None]), -levels, levels).astype(jnp.int8)
    parts.append(q.reshape(-1))
    scales.append(scale)
  values = jnp.concatenate(parts)
  return (pack_int4(values) if codec.fmt == "int4" else values, jnp.concatenate(scales))


def pack_int4(q):
  """int8 values in [-7, 7] -> uint8, two per byte (element 2i in the low nibble, 2i+1 in the
  high one, each offset by 8 to [1, 15]); an odd count gets one zero nibble."""
  nibbles = (q.astype(jnp.int32) + 8).astype(jnp.uint8)
  if nibbles.shape[0] % 2:
    nibbles = jnp.concatenate([nibbles, jnp.full((1,), 8, jnp.uint8)])
  pairs = nibbles.reshape(-1, 2)
  return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack_int4(packed, n: int):
  """The first `n` values `pack_int4` packed, as int8 in [-7, 7]."""
  pairs = jnp.stack([packed & 0xF, packed >> 4], axis=1).reshape(-1)[:n]
  return (pairs.astype(jnp.int32) - 8).astype(jnp.int8)


def dequantize(payload, codec: Codec, shape, dtype):
  """`x` back from `quantize(x, codec)`, in `dtype` (int8 and int4 dequantize in fp32 first)."""
  if codec.fmt not in INT_LEVELS:
    return payload[0].reshape(shape).astype(dtype)
  q, scales = payload
  if codec.fmt == "int4":
    q = unpack_int4(q, math.prod(shape))
  main, tail = _split_blocks(q.astype(jnp.float32), codec.block)
  nb = main.shape[0]
  out = [(main * scales[:nb, None]).reshape(-1)]
  if tail.shape[0]:
    out.append(tail * scales[nb])
  return jnp.concatenate(out).reshape(shape).astype(dtype)


def roundtrip(x, codec: Codec, dtype=None):
  """What a device receives for `x` sent with `codec` (the owner keeps the same values)."""
  return dequantize(quantize(x, codec), codec, x.shape, dtype or x.dtype)


# --------------------------------------------------------------------------
# the inter level: one axis, stacked chunks
# --------------------------------------------------------------------------


def _stack_payload(payloads):
  return tuple(jnp.stack(p) for p in zip(*payloads))


def gather_axis(x, axis: str, codec: Codec, impl: str, ring_ag, permute):
  """All-gather of chunk `x` over one mesh `axis`, carrying `codec`'s payload: [k, *x.shape].

  Every device dequantizes every chunk, its own included. `ring_ag(payload_leaf, (axis,))`
  gathers one payload array with the hand-written ring ([k, ...]); `permute` is unused here.
  """
  del permute
  payload = quantize(x, codec)
  if impl == "xla":
    # typed replicated over `axis` (as lax.psum is): an all-reduce built from it stays so
    gathered = tuple(lax.all_gather(p, axis, axis=0, tiled=False, to="invarying") for p in payload)
  else:
    gathered = tuple(ring_ag(p, (axis,)) for p in payload)
  k = gathered[0].shape[0]
  return jnp.stack(
    [dequantize(tuple(g[i] for g in gathered), codec, x.shape, x.dtype) for i in range(k)]
  )


def scatter_axis(x, axis: str, codec: Codec, impl: str, permute, residual=None):
  """Reduce-scatter (sum) of stacked `x` ([k, *S]) over one mesh `axis`: S, in x.dtype.

  Quantize once, send chunk j straight to device j (an all-to-all: `lax.all_to_all` for `xla`,
  k-1 direct permutes for the rings), dequantize and sum in fp32. `permute(payload, axis, perm)`
  is the hand-written rings' ppermute.

  With `residual` (fp32, x.size elements: error feedback), what is sent is `x + residual`, and
  the result is (sum, new residual): `x + residual` minus what its quantized chunks carry.
  """
  k = x.shape[0]
  r = lax.axis_index(axis)
  S, dtype = x.shape[1:], x.dtype
  if residual is not None:
    x, residual = with_feedback(x, residual, codec)
  payloads = [quantize(x[j], codec) for j in range(k)]
  if impl == "xla":
    stacked = _stack_payload(payloads)  # [k, ...]: row j is for device j
    received = tuple(lax.all_to_all(p, axis, 0, 0, tiled=False) for p in stacked)
    terms = [dequantize(tuple(p[i] for p in received), codec, S, jnp.float32) for i in range(k)]
  else:
    stacked = _stack_payload(payloads)
    own = tuple(lax.dynamic_index_in_dim(p, r, 0, keepdims=False) for p in stacked)
    terms = [dequantize(own, codec, S, jnp.float32)]
    for shift in range(1, k):  # device i sends its chunk for device i + shift, directly
      send = tuple(lax.dynamic_index_in_dim(p, (r + shift) % k, 0, keepdims=False) for p in stacked)
      perm = tuple((i, (i + shift) % k) for i in range(k))
      got = tuple(permute(p, axis, perm) for p in send)
      terms.append(dequantize(got, codec, S, jnp.float32))
  total = terms[0]
  for t in terms[1:]:
    total = total + t
  if residual is not None:
    return total.astype(dtype), residual
  return total.astype(dtype)


def with_feedback(x, residual, codec: Codec):
  """Error feedback (as error-feedback SGD and 1-bit Adam do): the stacked chunks `x` ([k, *S])
  corrected by the fp32 `residual` of the last quantization (x.size elements), and the new
  residual, what quantizing the corrected chunks loses. Returns (corrected x in fp32, new flat
  residual). The chunks are quantized as `scatter_axis` quantizes them (one chunk at a time), so
  the residual is exactly what the wire did not carry."""
  corrected = x.astype(jnp.float32) + residual.reshape(x.shape)
  sent = jnp.stack([roundtrip(corrected[j], codec, jnp.float32) for j in range(x.shape[0])])
  return corrected, (corrected - sent).reshape(-1)
