"""HO-Ring, the hierarchical overlapping ring of PaRO, over the two mesh axes (a shard_map body).

All-gather over ``('intra', 'inter')`` (g nodes, m devices each): the inter ring
(``lax.ppermute``) forwards single chunks (g-1 steps) while the intra level runs g sub-rounds,
sub-round j the runtime's own all-gather over the node of the chunk the inter ring delivered at
its step j; step t pairs inter step t+1 with sub-round t, which only share their input (g steps),
and each level sends exactly hring's bytes. Reduce-scatter is the transpose. Over one level
alone: the runtime's collective inside the node, the ring across (`one_level_ag`).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental.xla_metadata import set_xla_metadata

from paro_jax.core.names import INTER
from paro_jax.core.rings import (
  INTER_STREAM,
  INTRA_STREAM,
  ppermute_on,
  ring_ag_gen,
  ring_perm,
  ring_rs_gen,
  run,
  sizes,
)

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


def horing_ag(x, axes: tuple):
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
  m, g = sizes(axes)
  kb = lax.axis_index(B)
  name_b, perm_b = ring_perm((B,), +1)  # inter: send to k+1
  cols, rows = [x], []  # cols[j] = c[l*g + (k-j) mod g]
  l = lax.axis_index(A)
  for t in range(g):
    if t + 1 <= g - 1:
      cols.append(ppermute_on(cols[t], name_b, perm_b, INTER_STREAM))
    col = cols[t] if t == 0 else _tie(cols[t], rows[-1], l)
    rows.append(_intra_all_gather(col, A))
  R = jnp.stack(rows)
  # R[j, l'] = c[l'*g + (k-j) mod g]; reorder j -> q = (k - j) mod g:  out[q] = R[(k - q) mod g]
  R = jnp.roll(jnp.flip(R, axis=0), kb + 1, axis=0)
  return jnp.swapaxes(R, 0, 1).reshape((m * g,) + x.shape)


def horing_rs(x, axes: tuple):
  """HO-Ring reduce-scatter over ``(A, B)`` of stacked ``x`` ([nA*nB, *S]); returns S.

  The transpose of :func:`horing_ag`.  With ``axes=('intra', 'inter')``
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
  m, g = sizes(axes)
  S = x.shape[1:]
  kb = lax.axis_index(B)
  name_b, perm_b = ring_perm((B,), -1)  # inter partial sums: k -> k-1
  l = lax.axis_index(A)
  X = x.reshape((m, g) + S)
  P, inter = {}, None
  for t in range(g):
    j = g - 1 - t
    col = lax.dynamic_index_in_dim(X, (kb - j) % g, axis=1, keepdims=False)
    if t >= 1:  # inter step t carries the sub-round before, P[j + 1], beside sub-round j
      send = P[j + 1] if t == 1 else inter + P[j + 1]
      inter = ppermute_on(send, name_b, perm_b, INTER_STREAM)
      col = _tie(col, P[j + 1], l)
    P[j] = _intra_reduce_scatter(col, A)
  return inter + P[0]


def _level(axes: tuple):
  """The one axis of ``axes`` with more than one device (None: there is none or several)."""
  big = [a for a, n in zip(axes, sizes(axes)) if n > 1]
  return big[0] if len(big) == 1 else None


def one_level_ag(x, axes: tuple):
  """HO-Ring over one level: the runtime's collective inside the node, the ring across."""
  a = _level(axes)
  if a is not None and a != INTER:
    return lax.all_gather(x, a, axis=0, tiled=False)
  return run(ring_ag_gen(x, axes))


def one_level_rs(x, axes: tuple):
  a = _level(axes)
  if a is not None and a != INTER:
    return lax.psum_scatter(x, a, scatter_dimension=0, tiled=False)
  return run(ring_rs_gen(x, axes))
