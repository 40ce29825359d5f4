"""Each hand-written implementation's collectives over named axes, with their transposes.

Stacked forms (a shard_map body): all-gather takes a chunk S to [k, *S] in combined axes order,
reduce-scatter takes [k, *S] to this device's sum S. `ring`: one flat ring (paro_jax/core/rings.py);
`hring`: a ring per axis; `horing`: HO-Ring over two axes (paro_jax/core/horing.py), over one
level the runtime's collective inside the node and the ring across. `ag`, `rs` and `ar` are the
tiled forms as custom VJPs whose backward is the transpose with the same implementation.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

from paro_jax.core.horing import horing_ag, horing_rs, one_level_ag, one_level_rs
from paro_jax.core.rings import (
  hier_ag_gen,
  hier_rs_gen,
  ring_ag_gen,
  ring_rs_gen,
  run,
  sizes,
  to_varying,
)


def ag_stacked(x, axes: tuple, impl: str):
  k = math.prod(sizes(axes))
  if impl == "ring" or (impl == "hring" and len(axes) == 1):
    return run(ring_ag_gen(x, axes))
  if impl == "hring" or len(axes) > 2:  # horing is defined for two levels; more: hring
    out = run(hier_ag_gen(x, axes, tuple(reversed(axes))))
    return out.reshape((k,) + x.shape)
  if len(axes) == 1 or 1 in sizes(axes):  # one level only
    return one_level_ag(x, axes)
  with jax.named_scope("horing"):  # the inspector finds HO-Ring's steps by this scope
    return horing_ag(x, axes)


def rs_stacked(x, axes: tuple, impl: str):
  ns = sizes(axes)
  S = x.shape[1:]
  if impl == "ring" or (impl == "hring" and len(axes) == 1):
    return run(ring_rs_gen(x, axes))
  if impl == "hring" or len(axes) > 2:  # horing is defined for two levels; more: hring
    return run(hier_rs_gen(x.reshape(ns + S), axes, tuple(axes)))
  if len(axes) == 1 or 1 in ns:  # one level only
    return one_level_rs(x, axes)
  with jax.named_scope("horing"):
    return horing_rs(x, axes)


# The shapes around a stacked collective (`gather`/`scatter` take and give the stacked layout
# [k, ...]), shared by the plain collectives below and the compressed ones.


def gather_along(gather, x, axes, dim):
  """All-gather `x` along `dim` through `gather(x_stacked)`."""
  k = math.prod(sizes(axes))
  xm = jnp.moveaxis(x, dim, 0)
  out = gather(xm).reshape((k * xm.shape[0],) + xm.shape[1:])
  return jnp.moveaxis(out, 0, dim)


def scatter_along(scatter, x, axes, dim):
  """Reduce-scatter `x` along `dim` through `scatter(x_stacked)`."""
  k = math.prod(sizes(axes))
  xm = jnp.moveaxis(x, dim, 0)
  if xm.shape[0] % k:
    raise ValueError(
      f"reduce_scatter: dimension {dim} of size {xm.shape[0]} is not "
      f"divisible by the {k} devices of axes {axes}"
    )
  xs = xm.reshape((k, xm.shape[0] // k) + xm.shape[1:])
  return jnp.moveaxis(scatter(xs), 0, dim)


def reduce_flat(scatter, gather, x, axes):
  """All-reduce `x` as a reduce-scatter then an all-gather of its flattened, padded values."""
  k = math.prod(sizes(axes))
  n = x.size
  flat = x.reshape(-1)
  pad = (-n) % k
  if pad:
    flat = jnp.concatenate([flat, jnp.zeros((pad,), flat.dtype)])
  full = gather(scatter(flat.reshape(k, -1))).reshape(-1)
  return full[:n].reshape(x.shape)


def _ag_impl(x, axes, dim, impl):
  return gather_along(lambda v: ag_stacked(v, axes, impl), x, axes, dim)


def _rs_impl(x, axes, dim, impl):
  return scatter_along(lambda v: rs_stacked(v, axes, impl), x, axes, dim)


def _ar_impl(x, axes, impl):
  return reduce_flat(
    lambda v: rs_stacked(v, axes, impl), lambda v: ag_stacked(v, axes, impl), x, axes
  )


# --------------------------------------------------------------------------
# custom VJPs: AG^T = RS, RS^T = AG, AR^T = AR (same impl)
# --------------------------------------------------------------------------


def with_transpose(forward, transpose, n_static: int):
  """`forward(x, axes, *static)` as a custom_vjp whose backward is `transpose` (same impl)."""

  @partial(jax.custom_vjp, nondiff_argnums=tuple(range(1, 1 + n_static)))
  def op(x, *static):
    return forward(x, *static)

  def fwd(x, *static):
    return forward(x, *static), None

  def bwd(*args):  # (*static, residual, cotangent)
    static, g = args[:n_static], args[-1]
    return (transpose(to_varying(g, static[0]), *static),)

  op.defvjp(fwd, bwd)
  return op


ag = with_transpose(_ag_impl, _rs_impl, 3)  # (axes, dim, impl)
rs = with_transpose(_rs_impl, _ag_impl, 3)
ar = with_transpose(_ar_impl, _ar_impl, 2)  # (axes, impl)
