"""The output head's cross-entropy, tiled over the vocabulary: no buffer of fp32 logits of every
token over the whole vocabulary exists, in forward or backward.

Each token's loss is `logsumexp(logits) - logits[target]`, computed one tile of the vocabulary
at a time (a `lax.scan` over tiles of `chunk` columns of the head): the tile's logits
(tokens x chunk, fp32) give a running max and sum of exponentials (the online log-sum-exp) and
the target's logit where the tile holds it. Backward (a `custom_vjp`) recomputes each tile's
logits from the saved log-sum-exp, rounds their cotangent once to the compute dtype (as
`head_logits` does), and writes the tile's columns of the head's gradient from one matmul over
all tokens, so the head's gradient is rounded once, as the untiled product's is; the tiles'
parts of the input's gradient (tokens x D) are summed in fp32. Tiling the vocabulary rather than
the sequence keeps that property: over sequence chunks the head's gradient (D x V) would be a
sum of chunks, either rounded to the compute dtype at every chunk or held in fp32 (an fp32
copy of the head).

Equal to `token_cross_entropy` of the full logits within fp32 rounding (the order of the sums).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from models.config import VOCAB_CHUNK, tiles

# The logits' einsum for the head's two layouts: its own kernel (D x V, vocabulary axis 1) or
# the tied embedding table (V x D, axis 0); and the transposes of its backward.
_LOGITS = {1: "td,dv->tv", 0: "td,vd->tv"}
_INPUT_GRAD = {1: "tv,dv->td", 0: "tv,vd->td"}
_HEAD_GRAD = {1: "td,tv->dv", 0: "td,tv->vd"}


def _varying_as(x, *like):
  """`x` typed varying over every mesh axis one of `like` varies over (a scan's carry must keep
  its type; under check_vma=False there are none)."""
  vma = lambda a: frozenset(
    getattr(getattr(jax.typeof(a), "manual_axis_type", None), "varying", ()) or ()
  )
  missing = frozenset().union(*map(vma, like)) - vma(x)
  return lax.pcast(x, tuple(sorted(missing)), to="varying") if missing else x


def _tile(w, x, targets_T, c, size: int, axis: int):
  """Tile `c` of the head `w`: (its fp32 logits T x size, the tile's one-hot targets, the
  columns counted first here). The last tile ends at the vocabulary's end, overlapping the one
  before it where `size` does not divide the vocabulary (no padded copy of the head): its
  columns below c * size were counted by that tile already."""
  V = w.shape[axis]
  start = jnp.minimum(c * size, V - size)
  w_tile = lax.dynamic_slice_in_dim(w, start, size, axis)
  logits_TxC = jnp.einsum(_LOGITS[axis], x, w_tile, preferred_element_type=jnp.float32)
  column_C = start + jnp.arange(size)
  # None where the tiles do not overlap: no mask to apply
  fresh = column_C[None] >= c * size if -(-V // size) * size != V else None
  return w_tile, logits_TxC, column_C[None] == targets_T[:, None], fresh


def _forward(x_TxD, w, targets_T, axis: int, chunk: int):
  """(each token's cross-entropy, its log-sum-exp), both fp32 of length T."""
  n, size = tiles(w.shape[axis], chunk)
  T = x_TxD.shape[0]

  def tile(carry, c):
    top_T, total_T, target_T = carry
    _, logits, is_target, fresh = _tile(w, x_TxD, targets_T, c, size, axis)
    if fresh is not None:
      logits, is_target = jnp.where(fresh, logits, -jnp.inf), is_target & fresh
    new_top = jnp.maximum(top_T, jnp.max(logits, axis=-1))
    total_T = total_T * jnp.exp(top_T - new_top) + jnp.sum(jnp.exp(logits - new_top[:, None]), -1)
    target_T = target_T + jnp.sum(jnp.where(is_target, logits, 0.0), axis=-1)
    return (new_top, total_T, target_T), None

  zeros = _varying_as(jnp.zeros((T,), jnp.float32), x_TxD, w, targets_T)
  (top, total, target), _ = lax.scan(tile, (zeros - jnp.inf, zeros, zeros), jnp.arange(n))
  lse_T = top + jnp.log(total)
  return lse_T - target, lse_T


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def tiled_cross_entropy(x_TxD, w, targets_T, axis: int, chunk: int = VOCAB_CHUNK):
  """Each token's cross-entropy (fp32, length T) of the logits `x_TxD @ w` (w: D x V with
  `axis` 1, or V x D with `axis` 0), computed `chunk` vocabulary columns at a time. `x_TxD` and
  `w` in the compute dtype; the products accumulate in fp32."""
  return _forward(x_TxD, w, targets_T, axis, chunk)[0]


def _tiled_fwd(x_TxD, w, targets_T, axis, chunk):
  ce_T, lse_T = _forward(x_TxD, w, targets_T, axis, chunk)
  return ce_T, (x_TxD, w, targets_T, lse_T)


def _tiled_bwd(axis, chunk, res, ct_T):
  x_TxD, w, targets_T, lse_T = res
  n, size = tiles(w.shape[axis], chunk)

  def tile(carry, c):
    dx_TxD, dw = carry
    w_tile, logits, is_target, fresh = _tile(w, x_TxD, targets_T, c, size, axis)
    # softmax less the one-hot, times the loss's cotangent: the logits' cotangent (fp32), rounded
    # once to the compute dtype, which both products take (head_logits' backward)
    dlogits = ((jnp.exp(logits - lse_T[:, None]) - is_target) * ct_T[:, None]).astype(x_TxD.dtype)
    counted = dlogits if fresh is None else jnp.where(fresh, dlogits, jnp.zeros((), dlogits.dtype))
    dx_TxD = dx_TxD + jnp.einsum(
      _INPUT_GRAD[axis], counted, w_tile, preferred_element_type=jnp.float32
    )
    # every column of the tile, overlap included: an overlapped column's gradient is the same
    # value the tile before wrote
    dw_tile = jnp.einsum(_HEAD_GRAD[axis], x_TxD, dlogits).astype(w.dtype)
    start = jnp.minimum(c * size, w.shape[axis] - size)
    return (dx_TxD, lax.dynamic_update_slice_in_dim(dw, dw_tile, start, axis)), None

  init = (jnp.zeros(x_TxD.shape, jnp.float32), jnp.zeros(w.shape, w.dtype))
  init = tuple(_varying_as(z, x_TxD, w, targets_T, lse_T, ct_T) for z in init)
  (dx_TxD, dw), _ = lax.scan(tile, init, jnp.arange(n))
  return dx_TxD.astype(x_TxD.dtype), dw, None


tiled_cross_entropy.defvjp(_tiled_fwd, _tiled_bwd)
