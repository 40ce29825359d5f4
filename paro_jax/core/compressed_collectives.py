"""Collectives whose inter level carries a wire codec's payload (paro_jax/core/compress.py).

Two levels, one after the other: the `inter` axis carries the codec's payload (bf16, or int8 with
its scales), the other axis the operand's dtype with the asked implementation. All-gather runs
the inter level first; reduce-scatter reduces the node first, then sends each chunk, quantized
once, to its owner. `rs_c_stacked` also takes an error-feedback residual.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from paro_jax.core import compress
from paro_jax.core.names import INTER
from paro_jax.core.rings import INTER_STREAM, lax_axes, ppermute_on, ring_ag_gen, run
from paro_jax.core.stacked import (
  ag_stacked,
  gather_along,
  reduce_flat,
  rs_stacked,
  scatter_along,
  with_transpose,
)


def _inter_permute(x, axis, perm):
  return ppermute_on(x, axis, perm, INTER_STREAM)


def _ring_ag_one(x, axes):
  return run(ring_ag_gen(x, axes))


def _plain_ag_stacked(x, axes, impl):  # [*S] -> [k, *S] over the uncompressed axes
  if impl == "xla":
    return lax.all_gather(x, lax_axes(axes), axis=0, tiled=False, to="invarying")
  return ag_stacked(x, axes, impl)


def _plain_rs_stacked(x, axes, impl):  # [k, *S] -> S over the uncompressed axes
  if impl == "xla":
    return lax.psum_scatter(x, lax_axes(axes), scatter_dimension=0, tiled=False)
  return rs_stacked(x, axes, impl)


def _split_inter(axes: tuple):
  if len(axes) > 2:
    raise ValueError(f"compressed collectives span at most two axes, got {axes}")
  rest = tuple(a for a in axes if a != INTER)
  return rest, bool(rest) and axes.index(INTER) == 0  # inter major?


def ag_c_stacked(x, axes, impl, codec):
  """[*S] -> [k, *S] in combined axes order; the inter level carries `codec`'s payload."""
  rest, inter_major = _split_inter(axes)
  out = compress.gather_axis(x, INTER, codec, impl, _ring_ag_one, _inter_permute)  # [g, *S]
  if rest:
    out = _plain_ag_stacked(out, rest, impl)  # [k_rest, g, *S]
    if inter_major:
      out = jnp.swapaxes(out, 0, 1)
    out = out.reshape((-1,) + x.shape)
  return out


def rs_c_stacked(x, axes, impl, codec, residual=None):
  """[k, *S] (combined axes order) -> S; the inter level is compress.scatter_axis (with
  `residual`: error feedback, and the result is (S, new residual))."""
  rest, inter_major = _split_inter(axes)
  g = lax.axis_size(INTER)
  S = x.shape[1:]
  if rest:
    kr = x.shape[0] // g
    x = x.reshape(((g, kr) if inter_major else (kr, g)) + S)
    if inter_major:
      x = jnp.swapaxes(x, 0, 1)
    x = _plain_rs_stacked(x, rest, impl)  # [g, *S], summed over the node
  return compress.scatter_axis(x, INTER, codec, impl, _inter_permute, residual)


def _ag_c_impl(x, axes, dim, impl, codec):
  return gather_along(lambda v: ag_c_stacked(v, axes, impl, codec), x, axes, dim)


def _rs_c_impl(x, axes, dim, impl, codec):
  return scatter_along(lambda v: rs_c_stacked(v, axes, impl, codec), x, axes, dim)


def _ar_c_impl(x, axes, impl, codec):
  return reduce_flat(
    lambda v: rs_c_stacked(v, axes, impl, codec),
    lambda v: ag_c_stacked(v, axes, impl, codec),
    x,
    axes,
  )


ag_c = with_transpose(_ag_c_impl, _rs_c_impl, 4)  # (axes, dim, impl, codec)
rs_c = with_transpose(_rs_c_impl, _ag_c_impl, 4)
ar_c = with_transpose(_ar_c_impl, _ar_c_impl, 3)  # (axes, impl, codec)


def compressed(x, axes: tuple, wire) -> bool:
  """Whether `wire` (a compress.Codec or None) changes this collective: it spans `inter` and the
  codec changes what `x`'s dtype sends."""
  return wire is not None and INTER in axes and wire.active_for(x.dtype)
