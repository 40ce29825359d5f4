"""Collectives over named mesh axes, for use inside ``jax.shard_map`` bodies.

Every function takes ``axes``: a tuple of mesh axis names, *major first*.  The
combined index over ``axes=(a0, a1)`` is ``i0 * n1 + i1``; with the PaRO layout
``P(('intra', 'inter'))`` a globally sharded dimension therefore uses
``axes=('intra', 'inter')``.  An empty tuple is the identity.

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
  ``_intra_all_gather``); the inter ring, and its pairing with the intra
  level, is what the runtime does not do.  With more than two axes it is hring.
* ``"hring+xla"``, ``"horing+xla"`` -- ``hring`` / ``horing`` for a collective
  over two axes of more than one device each, the ``lax`` collective otherwise
  (and for both levels of a compressed collective, which runs them one after
  the other anyway). ``--collectives auto`` picks ``hring+xla`` where the
  runtime's own collective over both axes would be one flat ring crossing the
  inter-node link on every hop (XLA:CPU's gloo, one process per node).
For a single axis ``hring`` is the ring; ``horing`` is the runtime's collective inside the node
and the ring across.

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
from functools import partial
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.xla_metadata import set_xla_metadata

from paro_jax.core import compress
from paro_jax.core.names import COLLECTIVE_IMPLS, INTER, MIXED_IMPLS
from paro_jax.core.names import resolve_collectives as resolve

__all__ = [
  "IMPLS",
  "all_gather",
  "reduce_scatter",
  "all_reduce",
  "to_varying",
  "varying_axes",
  "concrete_impl",
  "resolve",
]

IMPLS = COLLECTIVE_IMPLS


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def _norm_axes(axes) -> tuple:
  if axes is None:
    return ()
  if isinstance(axes, str):
    return (axes,)
  return tuple(axes)


def _check_impl(impl: str) -> None:
  if impl not in IMPLS:
    raise ValueError(f"unknown collective impl {impl!r}; valid impls are {IMPLS}")


def concrete_impl(impl: str, axes) -> str:
  """The implementation one collective over `axes` runs: `impl`, with a mixed one resolved
  (``hring+xla``: ``hring`` over two axes of more than one device each, else ``xla``; the same
  for ``horing+xla``). Inside shard_map."""
  if impl not in MIXED_IMPLS:
    return impl
  return MIXED_IMPLS[impl] if sum(s > 1 for s in _sizes(_norm_axes(axes))) >= 2 else "xla"


def _lax_axes(axes: tuple):
  return axes[0] if len(axes) == 1 else axes


def _sizes(axes: Sequence[str]) -> tuple:
  return tuple(int(lax.axis_size(a)) for a in axes)


def varying_axes(x) -> frozenset:
  """The mesh axes `x` is typed varying over (none under check_vma=False)."""
  mat = getattr(jax.typeof(x), "manual_axis_type", None)
  return frozenset(getattr(mat, "varying", ()) or ())


def to_varying(x, axes: tuple):
  """pcast ``x`` to varying over those of ``axes`` it is not varying over yet.

  Values that are replicated (invariant) over an axis get an automatic psum of their cotangent
  over it in backward. Typing gathered weights as varying keeps that psum out of every
  micro-batch, so gradients are reduced exactly where the strategy says. Under
  ``check_vma=False`` the type carries no axes and the cast is a no-op.
  """
  missing = tuple(a for a in axes if a not in varying_axes(x))
  if missing:
    x = lax.pcast(x, missing, to="varying")
  return x


def _mesh_axis_order(axes: tuple) -> tuple:
  """``axes`` in the order the current mesh lists them.

  ``lax.ppermute`` over several axes numbers devices by their position in
  the (sorted) device group, i.e. in *mesh* axis order, whatever order the
  tuple is written in (unlike ``axis_index`` / ``all_gather``).
  """
  try:
    names = tuple(jax.sharding.get_abstract_mesh().axis_names)
  except Exception:  # pragma: no cover - no mesh context
    names = ()
  if all(a in names for a in axes):
    return tuple(sorted(axes, key=names.index))
  return axes


def _ring_perm(axes: tuple, shift: int) -> tuple:
  """(axis_name, perm) for a ring over the combined ``axes`` index.

  Device with combined (axes-order, major-first) index ``f`` sends to
  ``f + shift``.  The pairs are written in ppermute's own numbering.
  """
  sizes = _sizes(axes)
  k = math.prod(sizes)
  if len(axes) == 1:
    return axes[0], tuple((f, (f + shift) % k) for f in range(k))
  order = _mesh_axis_order(axes)
  pos = [axes.index(a) for a in order]
  osizes = [sizes[p] for p in pos]

  def to_perm_index(f):
    digits = []
    for n in reversed(sizes):
      digits.append(f % n)
      f //= n
    digits = digits[::-1]  # per axis, in axes order
    q = 0
    for p, n in zip(pos, osizes):
      q = q * n + digits[p]
    return q

  perm = tuple((to_perm_index(f), to_perm_index((f + shift) % k)) for f in range(k))
  return order, perm


# HO-Ring's two transfers of a step run on two communication streams on GPUs. XLA:GPU gives every
# async collective one stream unless told otherwise (ExecutionStreamAssignment reads the
# `_xla_stream_annotation` frontend attribute of a collective), and its latency-hiding scheduler
# keeps a second collective in flight only with a
# --xla_gpu_experimental_parallel_collective_overlap_limit above 1 (core/xla_flags.py). Elsewhere
# the attribute is inert.
INTRA_STREAM, INTER_STREAM = "0", "1"


def _ppermute_on(x, axis, perm, stream: str):
  """``lax.ppermute`` whose GPU transfer runs on communication stream ``stream``."""
  with set_xla_metadata(_xla_stream_annotation=stream):
    return lax.ppermute(x, axis, perm)


def _take(x, i):
  return lax.dynamic_index_in_dim(x, i, axis=0, keepdims=False)


# --------------------------------------------------------------------------
# ring building blocks (generators: each ``yield`` follows one ppermute, so
# two schedules can be interleaved step by step)
# --------------------------------------------------------------------------


def _ring_ag_gen(x, axes: tuple) -> Iterator[None]:
  """Ring all-gather of chunk ``x`` over combined ``axes``; returns [k, *x.shape].

  Step s (1..k-1): send what arrived last step to the left neighbour and
  receive chunk (r + s) mod k from the right one.
  """
  k = math.prod(_sizes(axes))
  if k == 1:
    return x[None]
  r = lax.axis_index(_lax_axes(axes))
  name, perm = _ring_perm(axes, -1)
  parts, cur = [x], x
  for _ in range(1, k):
    cur = lax.ppermute(cur, name, perm)
    yield
    parts.append(cur)
  stacked = jnp.stack(parts)  # parts[s] holds chunk (r + s) mod k
  return jnp.roll(stacked, r, axis=0)


def _ring_rs_gen(x, axes: tuple) -> Iterator[None]:
  """Ring reduce-scatter of stacked ``x`` ([k, ...]); returns sum_devices x[r].

  Partial sums travel right (r -> r + 1); after step t device r holds the
  partial sum of chunk (r - 1 - t) mod k and adds its own copy of it.
  After k-1 steps device r holds the full sum of chunk r.
  """
  k = math.prod(_sizes(axes))
  if k == 1:
    return x[0]
  r = lax.axis_index(_lax_axes(axes))
  name, perm = _ring_perm(axes, +1)
  acc = _take(x, (r - 1) % k)
  for t in range(1, k):
    acc = lax.ppermute(acc, name, perm)
    yield
    acc = acc + _take(x, (r - 1 - t) % k)
  return acc


def _hier_ag_gen(x, axes: tuple, order: tuple) -> Iterator[None]:
  """Hierarchical ring all-gather: one ring per axis, in ``order``.

  Returns [n_a for a in axes] + x.shape (axes-order, major first).
  """
  cur = x
  for a in order:  # each level prepends one axis to the stacked dims
    cur = yield from _ring_ag_gen(cur, (a,))
  done = tuple(reversed(order))  # current leading-dim order
  perm = [done.index(a) for a in axes] + list(range(len(axes), cur.ndim))
  return jnp.transpose(cur, perm)


def _hier_rs_gen(x, axes: tuple, order: tuple) -> Iterator[None]:
  """Hierarchical ring reduce-scatter of ``x`` shaped [n_a for a in axes] + S.

  Reduces one axis after the other in ``order``; returns S.
  """
  m = len(axes)
  cur = jnp.transpose(x, [axes.index(a) for a in order] + list(range(m, x.ndim)))
  for a in order:
    cur = yield from _ring_rs_gen(cur, (a,))
  return cur


def _run(gen):
  try:
    while True:
      next(gen)
  except StopIteration as stop:
    return stop.value


# HO-Ring's intra level is the runtime's own collective over the intra axis (NCCL on GPUs); its
# inter level is the hand-written ring. XLA's table of measured H100 collective throughput
# (xla/service/gpu/model/collective_interpolator_data.h, sm_90) has a one-way ring permute of
# 64 MiB at 76 GB/s and an all-gather of the same size over 8 GPUs at 314 GB/s: a layer's weights
# gathered by intra permutes take about three times as long as by NCCL's all-gather, longer than
# the layer's compute, and XLA's scheduler (which costs each step with that table) leaves the
# first steps of every chain with no compute beside them.


def _tie(x, after, idx):
  """``x``, made to depend on ``after``; ``idx`` is a device index (>= 0).

  A select on a predicate that always holds at run time but is not a compile-time constant: a
  real data dependency (an optimization barrier is dropped by XLA:CPU), no change to the value,
  one cheap elementwise pass. HO-Ring ties each intra sub-round to the one before: the
  sub-rounds are otherwise independent, and XLA's all-gather and reduce-scatter combiners merge
  independent collectives into one, which would wait for every inter step the merged sub-rounds
  need and leave no step with both levels in flight.
  """
  first = jnp.broadcast_to(after.reshape(-1)[0], x.shape)
  return lax.select(jnp.broadcast_to(idx >= 0, x.shape), x, first)


def _intra_all_gather(x, axis):
  """[*S] -> [n, *S] over one axis, by the runtime's collective, on HO-Ring's intra stream."""
  with set_xla_metadata(_xla_stream_annotation=INTRA_STREAM):
    return lax.all_gather(x, axis, axis=0, tiled=False)


def _intra_reduce_scatter(x, axis):
  """[n, *S] -> S over one axis, by the runtime's collective, on HO-Ring's intra stream."""
  with set_xla_metadata(_xla_stream_annotation=INTRA_STREAM):
    return lax.psum_scatter(x, axis, scatter_dimension=0, tiled=False)


def _horing_ag(x, axes: tuple):
  """HO-Ring all-gather over two axes ``(A, B)`` (major, minor); returns [nA*nB, *x.shape].

  With ``axes=('intra', 'inter')``: B = inter (size g, index k), A = intra
  (size m); device (k, l) holds chunk c[l*g + k].

  * Inter ring (g-1 steps, single chunks, k -> k+1): step e forwards the chunk
    received at step e-1 (its own at e=1); after it the device holds column
    chunk c[l*g + (k-e) mod g].
  * Intra level: g sub-rounds, sub-round j an all-gather over A of column j.
  * Step t runs inter step t+1 (if t+1 <= g-1) beside sub-round t: both only
    read column t, so neither waits for the other. g steps; per level exactly
    hring's bytes (inter: g-1 chunks, intra: g*(m-1) chunks per device).
  """
  A, B = axes
  m, g = _sizes(axes)
  kb = lax.axis_index(B)
  name_b, perm_b = _ring_perm((B,), +1)  # inter: send to k+1
  cols, rows = [x], []  # cols[j] = c[l*g + (k-j) mod g]
  l = lax.axis_index(A)
  for t in range(g):
    if t + 1 <= g - 1:
      cols.append(_ppermute_on(cols[t], name_b, perm_b, INTER_STREAM))
    col = cols[t] if t == 0 else _tie(cols[t], rows[-1], l)
    rows.append(_intra_all_gather(col, A))
  R = jnp.stack(rows)
  # R[j, l'] = c[l'*g + (k-j) mod g]; reorder j -> q = (k - j) mod g:  out[q] = R[(k - q) mod g]
  R = jnp.roll(jnp.flip(R, axis=0), kb + 1, axis=0)
  return jnp.swapaxes(R, 0, 1).reshape((m * g,) + x.shape)


def _horing_rs(x, axes: tuple):
  """HO-Ring reduce-scatter over ``(A, B)`` of stacked ``x`` ([nA*nB, *S]); returns S.

  The transpose of :func:`_horing_ag`.  With ``axes=('intra', 'inter')``
  (B = inter, size g, index k; A = intra, size m):

  * Intra level: g sub-rounds, the last column first; sub-round j is a
    reduce-scatter over A of the node's column chunks x[l'*g + (k-j) mod g],
    leaving P_j, the node's sum of chunk l*g + (k-j) mod g (the share of
    device (k-j, l)).
  * Inter ring (g-1 steps, k -> k-1): step e sends (received partial +)
    P_{g-e}; after step g-1 the device adds P_0.
  * Step t runs sub-round g-1-t beside inter step t (t >= 1), which carries
    the sum of the sub-round before. g steps; per level exactly hring's bytes.
  """
  A, B = axes
  m, g = _sizes(axes)
  S = x.shape[1:]
  kb = lax.axis_index(B)
  name_b, perm_b = _ring_perm((B,), -1)  # inter partial sums: k -> k-1
  l = lax.axis_index(A)
  X = x.reshape((m, g) + S)
  P, inter = {}, None
  for t in range(g):
    j = g - 1 - t
    col = lax.dynamic_index_in_dim(X, (kb - j) % g, axis=1, keepdims=False)
    if t >= 1:  # inter step t carries the sub-round before, P[j + 1], beside sub-round j
      send = P[j + 1] if t == 1 else inter + P[j + 1]
      inter = _ppermute_on(send, name_b, perm_b, INTER_STREAM)
      col = _tie(col, P[j + 1], l)
    P[j] = _intra_reduce_scatter(col, A)
  return inter + P[0]


# --------------------------------------------------------------------------
# stacked forms: AG: chunk S -> [k, *S];  RS: [k, *S] -> S
# --------------------------------------------------------------------------


def _level(axes: tuple):
  """The one axis of ``axes`` with more than one device (None: there is none or several)."""
  big = [a for a, n in zip(axes, _sizes(axes)) if n > 1]
  return big[0] if len(big) == 1 else None


def _one_level_ag(x, axes: tuple):
  """HO-Ring over one level: the runtime's collective inside the node, the ring across."""
  a = _level(axes)
  if a is not None and a != INTER:
    return lax.all_gather(x, a, axis=0, tiled=False)
  return _run(_ring_ag_gen(x, axes))


def _one_level_rs(x, axes: tuple):
  a = _level(axes)
  if a is not None and a != INTER:
    return lax.psum_scatter(x, a, scatter_dimension=0, tiled=False)
  return _run(_ring_rs_gen(x, axes))


def _ag_stacked(x, axes: tuple, impl: str):
  k = math.prod(_sizes(axes))
  if impl == "ring" or (impl == "hring" and len(axes) == 1):
    return _run(_ring_ag_gen(x, axes))
  if impl == "hring" or len(axes) > 2:  # horing is defined for two levels; more: hring
    out = _run(_hier_ag_gen(x, axes, tuple(reversed(axes))))
    return out.reshape((k,) + x.shape)
  if len(axes) == 1 or 1 in _sizes(axes):  # one level only
    return _one_level_ag(x, axes)
  with jax.named_scope("horing"):  # the inspector finds HO-Ring's steps by this scope
    return _horing_ag(x, axes)


def _rs_stacked(x, axes: tuple, impl: str):
  sizes = _sizes(axes)
  S = x.shape[1:]
  if impl == "ring" or (impl == "hring" and len(axes) == 1):
    return _run(_ring_rs_gen(x, axes))
  if impl == "hring" or len(axes) > 2:  # horing is defined for two levels; more: hring
    return _run(_hier_rs_gen(x.reshape(sizes + S), axes, tuple(axes)))
  if len(axes) == 1 or 1 in sizes:  # one level only
    return _one_level_rs(x, axes)
  with jax.named_scope("horing"):
    return _horing_rs(x, axes)


def _ag_impl(x, axes, dim, impl):
  k = math.prod(_sizes(axes))
  xm = jnp.moveaxis(x, dim, 0)
  out = _ag_stacked(xm, axes, impl)
  out = out.reshape((k * xm.shape[0],) + xm.shape[1:])
  return jnp.moveaxis(out, 0, dim)


def _rs_impl(x, axes, dim, impl):
  k = math.prod(_sizes(axes))
  xm = jnp.moveaxis(x, dim, 0)
  if xm.shape[0] % k:
    raise ValueError(
      f"reduce_scatter: dimension {dim} of size {xm.shape[0]} is not "
      f"divisible by the {k} devices of axes {axes}"
    )
  xs = xm.reshape((k, xm.shape[0] // k) + xm.shape[1:])
  return jnp.moveaxis(_rs_stacked(xs, axes, impl), 0, dim)


def _ar_impl(x, axes, impl):
  k = math.prod(_sizes(axes))
  n = x.size
  flat = x.reshape(-1)
  pad = (-n) % k
  if pad:
    flat = jnp.concatenate([flat, jnp.zeros((pad,), flat.dtype)])
  part = _rs_stacked(flat.reshape(k, -1), axes, impl)
  full = _ag_stacked(part, axes, impl).reshape(-1)
  return full[:n].reshape(x.shape)


# --------------------------------------------------------------------------
# custom VJPs: AG^T = RS, RS^T = AG, AR^T = AR (same impl)
# --------------------------------------------------------------------------


def _with_transpose(forward, transpose, n_static: int):
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


_ag = _with_transpose(_ag_impl, _rs_impl, 3)  # (axes, dim, impl)
_rs = _with_transpose(_rs_impl, _ag_impl, 3)
_ar = _with_transpose(_ar_impl, _ar_impl, 2)  # (axes, impl)


# --------------------------------------------------------------------------
# compressed inter level (paro_jax/core/compress.py): the `inter` axis carries the codec's
# payload, the other axis the operand's dtype; two levels, one after the other
# --------------------------------------------------------------------------


def _inter_permute(x, axis, perm):
  return _ppermute_on(x, axis, perm, INTER_STREAM)


def _ring_ag_one(x, axes):
  return _run(_ring_ag_gen(x, axes))


def _plain_ag_stacked(x, axes, impl):  # [*S] -> [k, *S] over the uncompressed axes
  if impl == "xla":
    return lax.all_gather(x, _lax_axes(axes), axis=0, tiled=False, to="invarying")
  return _ag_stacked(x, axes, impl)


def _plain_rs_stacked(x, axes, impl):  # [k, *S] -> S over the uncompressed axes
  if impl == "xla":
    return lax.psum_scatter(x, _lax_axes(axes), scatter_dimension=0, tiled=False)
  return _rs_stacked(x, axes, impl)


def _split_inter(axes: tuple):
  if len(axes) > 2:
    raise ValueError(f"compressed collectives span at most two axes, got {axes}")
  rest = tuple(a for a in axes if a != INTER)
  return rest, bool(rest) and axes.index(INTER) == 0  # inter major?


def _ag_c_stacked(x, axes, impl, codec):
  """[*S] -> [k, *S] in combined axes order; the inter level carries `codec`'s payload."""
  rest, inter_major = _split_inter(axes)
  out = compress.gather_axis(x, INTER, codec, impl, _ring_ag_one, _inter_permute)  # [g, *S]
  if rest:
    out = _plain_ag_stacked(out, rest, impl)  # [k_rest, g, *S]
    if inter_major:
      out = jnp.swapaxes(out, 0, 1)
    out = out.reshape((-1,) + x.shape)
  return out


def _rs_c_stacked(x, axes, impl, codec, residual=None):
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
  k = math.prod(_sizes(axes))
  xm = jnp.moveaxis(x, dim, 0)
  out = _ag_c_stacked(xm, axes, impl, codec).reshape((k * xm.shape[0],) + xm.shape[1:])
  return jnp.moveaxis(out, 0, dim)


def _rs_c_impl(x, axes, dim, impl, codec):
  k = math.prod(_sizes(axes))
  xm = jnp.moveaxis(x, dim, 0)
  if xm.shape[0] % k:
    raise ValueError(
      f"reduce_scatter: dimension {dim} of size {xm.shape[0]} is not "
      f"divisible by the {k} devices of axes {axes}"
    )
  xs = xm.reshape((k, xm.shape[0] // k) + xm.shape[1:])
  return jnp.moveaxis(_rs_c_stacked(xs, axes, impl, codec), 0, dim)


def _ar_c_impl(x, axes, impl, codec):
  k = math.prod(_sizes(axes))
  n = x.size
  flat = x.reshape(-1)
  pad = (-n) % k
  if pad:
    flat = jnp.concatenate([flat, jnp.zeros((pad,), flat.dtype)])
  part = _rs_c_stacked(flat.reshape(k, -1), axes, impl, codec)
  full = _ag_c_stacked(part, axes, impl, codec).reshape(-1)
  return full[:n].reshape(x.shape)


_ag_c = _with_transpose(_ag_c_impl, _rs_c_impl, 4)  # (axes, dim, impl, codec)
_rs_c = _with_transpose(_rs_c_impl, _ag_c_impl, 4)
_ar_c = _with_transpose(_ar_c_impl, _ar_c_impl, 3)  # (axes, impl, codec)


def _compressed(x, axes: tuple, wire) -> bool:
  """Whether `wire` (a compress.Codec or None) changes this collective: it spans `inter` and the
  codec changes what `x`'s dtype sends."""
  return wire is not None and INTER in axes and wire.active_for(x.dtype)


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
  axes = _norm_axes(axes)
  _check_impl(impl)
  if not axes:
    return x
  dim = dim % x.ndim
  if _compressed(x, axes, wire):
    impl = "xla" if impl in MIXED_IMPLS else impl
    return _ag_c(to_varying(x, axes), axes, dim, impl, wire)
  impl = concrete_impl(impl, axes)
  if impl == "xla":
    return lax.all_gather(x, _lax_axes(axes), axis=dim, tiled=True)
  return _ag(to_varying(x, axes), axes, dim, impl)


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
  axes = _norm_axes(axes)
  _check_impl(impl)
  if not axes:
    return x
  dim = dim % x.ndim
  if _compressed(x, axes, wire):
    impl = "xla" if impl in MIXED_IMPLS else impl
    return _rs_c(to_varying(x, axes), axes, dim, impl, wire)
  impl = concrete_impl(impl, axes)
  if impl == "xla":
    return lax.psum_scatter(x, _lax_axes(axes), scatter_dimension=dim, tiled=True)
  return _rs(to_varying(x, axes), axes, dim, impl)


def all_reduce(x, axes, *, impl: str = "xla", wire=None):
  """Sum of ``x`` over mesh ``axes``; equals ``lax.psum(x, axes)``.

  Non-xla impls run ``reduce_scatter`` then ``all_gather`` (same impl
  schedule) on a flattened view padded to a multiple of the device count.
  Transpose: ``all_reduce`` with the same ``impl``.

  ``wire``: as for ``reduce_scatter`` then ``all_gather`` (the reduced chunk is quantized once
  more, and every replica dequantizes the same payload).
  """
  axes = _norm_axes(axes)
  _check_impl(impl)
  if not axes:
    return x
  if _compressed(x, axes, wire):
    impl = "xla" if impl in MIXED_IMPLS else impl
    return _ar_c(to_varying(x, axes), axes, impl, wire)
  impl = concrete_impl(impl, axes)
  if impl == "xla":
    return lax.psum(x, _lax_axes(axes))
  return _ar(to_varying(x, axes), axes, impl)


# --------------------------------------------------------------------------
# error feedback: the compressed inter level with a residual (not differentiable: for the
# accumulation boundary's gradient sync, which nothing differentiates)
# --------------------------------------------------------------------------


def reduce_scatter_feedback(flat, residual, axes, *, impl: str, wire):
  """Reduce-scatter (sum) of the flat `flat` over `axes` (spanning `inter`, its length divisible
  by their devices), the inter level carrying `wire` with error feedback: `residual` (fp32,
  `feedback_rules.feedback_size` elements) is added to what this device quantizes. Returns (its
  chunk, the new residual)."""
  axes = _norm_axes(axes)
  _check_impl(impl)
  impl = "xla" if impl in MIXED_IMPLS else impl
  k = math.prod(_sizes(axes))
  return _rs_c_stacked(to_varying(flat, axes).reshape(k, -1), axes, impl, wire, residual)


def all_reduce_feedback(flat, residual, axes, *, impl: str, wire):
  """Sum of the flat `flat` over `axes` (spanning `inter`): `reduce_scatter_feedback`, then the
  compressed all-gather of the reduced chunk (quantized once, by its owner). Returns (the sum,
  the new residual)."""
  axes = _norm_axes(axes)
  _check_impl(impl)
  impl = "xla" if impl in MIXED_IMPLS else impl
  k = math.prod(_sizes(axes))
  n = flat.shape[0]
  pad = (-n) % k
  flat = to_varying(flat, axes)
  if pad:
    flat = jnp.concatenate([flat, jnp.zeros((pad,), flat.dtype)])
  part, residual = _rs_c_stacked(flat.reshape(k, -1), axes, impl, wire, residual)
  full = _ag_c_stacked(part, axes, impl, wire).reshape(-1)
  return full[:n], residual
