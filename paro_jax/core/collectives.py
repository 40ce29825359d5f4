"""Collectives over named mesh axes, for use inside ``jax.shard_map`` bodies.

Every function takes ``axes``: a tuple of mesh axis names, *major first*.  The
combined index over ``axes=(a0, a1)`` is ``i0 * n1 + i1``; with the PaRO layout
``P(('intra', 'inter'))`` a globally sharded dimension therefore uses
``axes=('intra', 'inter')``.  An empty tuple is the identity, and so are
``all_gather`` and ``reduce_scatter`` over axes of one device.

Implementations (``impl``), all exactly equal to the ``lax`` reference:

* ``"xla"``    -- the ``lax`` collective itself.
* ``"ring"``   -- one flat ring over every device of ``axes`` built from
  ``lax.ppermute`` (``k - 1`` steps).  With two axes the ring walks the
  combined (axes-order) index, so its hops between minor-axis wrap-arounds
  cross groups.
* ``"hring"``  -- hierarchical ring, one level after the other: all-gather
  runs the minor axis first then the major one (``('intra', 'inter')``:
  inter, then intra); reduce-scatter runs major first then minor (intra, then
  inter).
* ``"horing"`` -- hierarchical *overlapping* ring (PaRO), sending exactly
  hring's bytes on each level.  All-gather over ``('intra', 'inter')`` (g
  nodes, m devices each): the inter ring (``lax.ppermute``) forwards single
  chunks (g-1 steps) while the intra level runs g sub-rounds, sub-round j
  the runtime's own all-gather over the node of the chunk the inter ring
  delivered at its step j; step t pairs inter step t+1 with sub-round t,
  which only share their input (g steps).  Reduce-scatter is the transpose:
  the sub-rounds' reduce-scatters in reverse order, the inter ring reducing
  the finished partial sums beside them.  Over the intra level alone it is
  the runtime's collective; over the inter level alone, the ring.  The intra
  level is the runtime's collective because NCCL gathers inside a node at
  several times the throughput of point-to-point permutes (see
  paro_jax/core/horing.py); the inter ring, and its pairing with the intra
  level, is what the runtime does not do.  With more than two axes it is hring.
* ``"hring+xla"``, ``"horing+xla"`` -- ``hring`` / ``horing`` for a collective
  over two axes of more than one device each, the ``lax`` collective otherwise
  (and for both levels of a compressed collective, which runs them one after
  the other anyway). ``--collectives auto`` picks ``hring+xla`` where the
  runtime's own collective over both axes would be one flat ring crossing the
  inter-node link on every hop (XLA:CPU's gloo, one process per node).
For a single axis ``hring`` is the ring; ``horing`` is the runtime's collective inside the node
and the ring across.

Where each lives: the rings in paro_jax/core/rings.py, HO-Ring in paro_jax/core/horing.py, the
dispatch by implementation and the transposes in paro_jax/core/stacked.py, the compressed inter
level in paro_jax/core/compressed_collectives.py; this module is the public API.

Hand-written ppermute collectives return values typed *varying* over ``axes``
(there is no varying -> invariant cast), so shard_maps using them for
replicated outputs need ``check_vma=False``.  They also work under
``check_vma=True`` when the inputs are varying (invariant inputs are
``pcast`` to varying first).

All functions are reverse-mode differentiable: the transpose of
``all_gather`` is ``reduce_scatter`` with the same impl (and vice versa), and
the transpose of ``all_reduce`` is ``all_reduce``; this matches
``lax`` under ``check_vma=False``.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from paro_jax.core import stacked
from paro_jax.core.compressed_collectives import (
  ag_c,
  ag_c_stacked,
  ar_c,
  compressed,
  rs_c,
  rs_c_stacked,
)
from paro_jax.core.names import COLLECTIVE_IMPLS, MIXED_IMPLS
from paro_jax.core.rings import lax_axes, norm_axes, sizes, to_varying

__all__ = [
  "IMPLS",
  "all_gather",
  "reduce_scatter",
  "all_reduce",
  "concrete_impl",
]

IMPLS = COLLECTIVE_IMPLS


def _check_impl(impl: str) -> None:
  if impl not in IMPLS:
    raise ValueError(f"unknown collective impl {impl!r}; valid impls are {IMPLS}")


def moves_nothing(axes) -> bool:
  """Whether a collective over `axes` involves one device only (no axis, or axes of one
  device): an all-gather or a reduce-scatter is then the identity. Inside shard_map."""
  return math.prod(sizes(norm_axes(axes))) == 1


def concrete_impl(impl: str, axes) -> str:
  """The implementation one collective over `axes` runs: `impl`, with a mixed one resolved
  (``hring+xla``: ``hring`` over two axes of more than one device each, else ``xla``; the same
  for ``horing+xla``). Inside shard_map."""
  if impl not in MIXED_IMPLS:
    return impl
  return MIXED_IMPLS[impl] if sum(s > 1 for s in sizes(norm_axes(axes))) >= 2 else "xla"


# --------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------


def all_gather(x, axes, *, dim: int, impl: str = "xla", wire=None):
  """Tiled all-gather of ``x`` along ``dim`` over mesh ``axes`` (major first).

  Equals ``lax.all_gather(x, axes, axis=dim, tiled=True)``: the output
  concatenates the per-device chunks along ``dim`` in combined-index order.
  Schedules: ``ring`` -- k-1 ppermute steps on a flat ring, each step
  forwarding the chunk received in the previous one; ``hring`` -- a ring
  over the minor axis, then one over the major axis carrying the gathered
  block; ``horing`` -- the inter ring on single chunks pipelined with g
  intra sub-rounds (the runtime's all-gather of one column chunk over the node
  each), each inter permute beside an independent sub-round, hring's bytes on
  each level.
  Transpose: ``reduce_scatter`` with the same ``impl``.

  ``wire`` (a ``compress.Codec``): the precision of the ``inter`` level. When it compresses,
  each chunk is quantized once and dequantized (into ``x.dtype``) by every device, its owner
  included; over two axes the inter level runs first, then the other axis in ``x.dtype``.
  """
  axes = norm_axes(axes)
  _check_impl(impl)
  if moves_nothing(axes):  # one device: nothing to gather (XLA would copy it)
    return x
  dim = dim % x.ndim
  if compressed(x, axes, wire):
    impl = "xla" if impl in MIXED_IMPLS else impl
    return ag_c(to_varying(x, axes), axes, dim, impl, wire)
  impl = concrete_impl(impl, axes)
  if impl == "xla":
    return _xla_all_gather(x, axes, dim)
  return stacked.ag(to_varying(x, axes), axes, dim, impl)


def _xla_all_gather(x, axes, dim: int):
  """`lax.all_gather(x, axes, axis=dim, tiled=True)`, gathered along a new leading axis and the
  devices' blocks then moved into place. Gathered along a minor dimension, XLA picks the
  operand's layout for the collective, and where `x` is cut from a loop's invariant (the loss's
  vocabulary tiles of a tied table sharded along D) it lays the whole invariant out transposed
  once, beside it (the Llama 3.2 1B shape's LoRA step on ING 2x4 compiled for H100: 125 MiB per
  device; temporaries 383 -> 355 MiB). Along a new leading axis `x` keeps its own layout."""
  if dim == 0:
    return lax.all_gather(x, lax_axes(axes), axis=0, tiled=True)
  blocks = jnp.moveaxis(lax.all_gather(x, lax_axes(axes), axis=0), 0, dim)
  return blocks.reshape(x.shape[:dim] + (-1,) + x.shape[dim + 1 :])


def reduce_scatter(x, axes, *, dim: int, impl: str = "xla", wire=None):
  """Tiled reduce-scatter (sum) of ``x`` along ``dim`` over mesh ``axes``.

  Equals ``lax.psum_scatter(x, axes, scatter_dimension=dim, tiled=True)``:
  ``dim`` is split into k chunks and the device with combined index i gets
  the sum over devices of chunk i.
  Schedules: ``ring`` -- k-1 ppermute steps, a partial sum travelling round
  a flat ring and each device adding its own copy; ``hring`` -- a ring over
  the major axis (on blocks of n_minor chunks), then one over the minor
  axis; ``horing`` -- the transpose of the all-gather schedule: intra
  sub-rounds in reverse order, the inter ring reducing beside them. Transpose: ``all_gather``
  with the same ``impl``.

  ``wire`` (a ``compress.Codec``): the precision of the ``inter`` level. When it compresses, the
  other axis is reduced first in ``x.dtype``; then each device quantizes its chunks once and
  sends each straight to its owner (an all-to-all), which sums them in fp32.
  """
  axes = norm_axes(axes)
  _check_impl(impl)
  if moves_nothing(axes):  # one device: nothing to reduce (XLA would transpose it)
    return x
  dim = dim % x.ndim
  if compressed(x, axes, wire):
    impl = "xla" if impl in MIXED_IMPLS else impl
    return rs_c(to_varying(x, axes), axes, dim, impl, wire)
  impl = concrete_impl(impl, axes)
  if impl == "xla":
    return lax.psum_scatter(x, lax_axes(axes), scatter_dimension=dim, tiled=True)
  return stacked.rs(to_varying(x, axes), axes, dim, impl)


def all_reduce(x, axes, *, impl: str = "xla", wire=None):
  """Sum of ``x`` over mesh ``axes``; equals ``lax.psum(x, axes)``.

  Non-xla impls run ``reduce_scatter`` then ``all_gather`` (same impl
  schedule) on a flattened view padded to a multiple of the device count.
  Transpose: ``all_reduce`` with the same ``impl``.

  ``wire``: as for ``reduce_scatter`` then ``all_gather`` (the reduced chunk is quantized once
  more, and every replica dequantizes the same payload).
  """
  axes = norm_axes(axes)
  _check_impl(impl)
  if not axes:
    return x
  if compressed(x, axes, wire):
    impl = "xla" if impl in MIXED_IMPLS else impl
    return ar_c(to_varying(x, axes), axes, impl, wire)
  impl = concrete_impl(impl, axes)
  if impl == "xla":
    return lax.psum(x, lax_axes(axes))
  return stacked.ar(to_varying(x, axes), axes, impl)


# --------------------------------------------------------------------------
# error feedback: the compressed inter level with a residual (not differentiable: for the
# accumulation boundary's gradient sync, which nothing differentiates)
# --------------------------------------------------------------------------


def reduce_scatter_feedback(flat, residual, axes, *, impl: str, wire):
  """Reduce-scatter (sum) of the flat `flat` over `axes` (spanning `inter`, its length divisible
  by their devices), the inter level carrying `wire` with error feedback: `residual` (fp32,
  `feedback_rules.feedback_size` elements) is added to what this device quantizes. Returns (its
  chunk, the new residual)."""
  axes = norm_axes(axes)
  _check_impl(impl)
  impl = "xla" if impl in MIXED_IMPLS else impl
  k = math.prod(sizes(axes))
  return rs_c_stacked(to_varying(flat, axes).reshape(k, -1), axes, impl, wire, residual)


def all_reduce_feedback(flat, residual, axes, *, impl: str, wire):
  """Sum of the flat `flat` over `axes` (spanning `inter`): `reduce_scatter_feedback`, then the
  compressed all-gather of the reduced chunk (quantized once, by its owner). Returns (the sum,
  the new residual)."""
  axes = norm_axes(axes)
  _check_impl(impl)
  impl = "xla" if impl in MIXED_IMPLS else impl
  k = math.prod(sizes(axes))
  n = flat.shape[0]
  pad = (-n) % k
  flat = to_varying(flat, axes)
  if pad:
    flat = jnp.concatenate([flat, jnp.zeros((pad,), flat.dtype)])
  part, residual = rs_c_stacked(flat.reshape(k, -1), axes, impl, wire, residual)
  full = ag_c_stacked(part, axes, impl, wire).reshape(-1)
  return full[:n], residual
