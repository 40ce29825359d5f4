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

The head and the embedding table may be given as stored rather than whole (`source`, with
`take`): each tile's rows or columns are cut from every array of `source` (`tile_of`) and `take`
makes the tile's weights of them (the step's `materialize`: an all-gather of the tile from its
shards along D, whose backward reduce-scatters the tile's gradient into its sink's rows). No
device then holds the whole table or head, only one tile (C x D); the head's tiles are gathered
again in backward, as the remat layers' weights are. `tiled_lookup` is the embedding's lookup in
the same tiles; `tiled_scores` eval's log-probability of each target and whether it is the
argmax, from the same tiles (forward only).
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


def _identity(w):
  return w


def vocab_size(source, axis: int) -> int:
  """The vocabulary of a head or table as stored (`source`: an array, or a tree of arrays that
  all hold the whole vocabulary along `axis`, such as the step's Shards)."""
  return jax.tree.leaves(source)[0].shape[axis]


def tile_of(source, start, size: int, axis: int):
  """Entries [start, start + size) along the vocabulary axis `axis` of every array of `source`
  (sharded along another axis, if at all: each leaf keeps its own other dimensions)."""
  return jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, start, size, axis), source)


def _start(c, size: int, V: int):
  """Tile `c`'s first entry: the last tile ends at the vocabulary's end, overlapping the one
  before it where `size` does not divide the vocabulary (no padded copy of the head)."""
  return jnp.minimum(c * size, V - size)


def _tile(source, take, x, targets_T, c, size: int, axis: int):
  """Tile `c` of the head: (its weights in the compute dtype, its fp32 logits T x size, the
  tile's one-hot targets, the columns counted first here), the weights `take` of the tile's
  part of `source`. The last tile's columns below c * size were counted by the one before."""
  V = vocab_size(source, axis)
  start = _start(c, size, V)
  w_tile = take(tile_of(source, start, size, axis))
  logits_TxC = jnp.einsum(_LOGITS[axis], x, w_tile, preferred_element_type=jnp.float32)
  column_C = start + jnp.arange(size)
  # None where the tiles do not overlap: no mask to apply
  fresh = column_C[None] >= c * size if -(-V // size) * size != V else None
  return w_tile, logits_TxC, column_C[None] == targets_T[:, None], fresh


def _fresh_logits(x_TxD, w, targets_T, c, size: int, axis: int, take):
  """Tile `c`'s (fp32 logits T x size, one-hot targets), the columns the tile before counted
  (the last tile's overlap) at -inf and no target's: each column counted in one tile only."""
  _, logits, is_target, fresh = _tile(w, take, x_TxD, targets_T, c, size, axis)
  if fresh is None:
    return logits, is_target
  return jnp.where(fresh, logits, -jnp.inf), is_target & fresh


def _online_lse(carry, logits_TxC, is_target_TxC):
  """The running (max, sum of exponentials below it, target's logit) of each token, one tile's
  logits added."""
  top_T, total_T, target_T = carry
  new_top = jnp.maximum(top_T, jnp.max(logits_TxC, axis=-1))
  total_T = total_T * jnp.exp(top_T - new_top) + jnp.sum(jnp.exp(logits_TxC - new_top[:, None]), -1)
  target_T = target_T + jnp.sum(jnp.where(is_target_TxC, logits_TxC, 0.0), axis=-1)
  return new_top, total_T, target_T


def _lse_start(x_TxD, w, targets_T):
  """The online log-sum-exp's carry before the first tile (typed as its inputs vary)."""
  zeros = _varying_as(
    jnp.zeros(targets_T.shape, jnp.float32), x_TxD, *jax.tree.leaves(w), targets_T
  )
  return zeros - jnp.inf, zeros, zeros


def _forward(x_TxD, w, targets_T, axis: int, chunk: int, take):
  """(each token's cross-entropy, its log-sum-exp), both fp32 of length T."""
  n, size = tiles(vocab_size(w, axis), chunk)

  def tile(carry, c):
    logits, is_target = _fresh_logits(x_TxD, w, targets_T, c, size, axis, take)
    return _online_lse(carry, logits, is_target), None

  (top, total, target), _ = lax.scan(tile, _lse_start(x_TxD, w, targets_T), jnp.arange(n))
  lse_T = top + jnp.log(total)
  return lse_T - target, lse_T


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def tiled_cross_entropy(x_TxD, w, targets_T, axis: int, chunk: int = VOCAB_CHUNK, take=_identity):
  """Each token's cross-entropy (fp32, length T) of the logits `x_TxD @ w` (w: D x V with
  `axis` 1, or V x D with `axis` 0), computed `chunk` vocabulary columns at a time. `x_TxD` and
  `w` in the compute dtype; the products accumulate in fp32. With `take`, `w` is the head as
  stored and `take(tile_of(w, ...))` each tile's weights in the compute dtype (see above)."""
  return _forward(x_TxD, w, targets_T, axis, chunk, take)[0]


def _tiled_fwd(x_TxD, w, targets_T, axis, chunk, take):
  ce_T, lse_T = _forward(x_TxD, w, targets_T, axis, chunk, take)
  return ce_T, (x_TxD, w, targets_T, lse_T)


def _tiled_bwd(axis, chunk, take, res, ct_T):
  x_TxD, w, targets_T, lse_T = res
  V = vocab_size(w, axis)
  n, size = tiles(V, chunk)

  def tile(carry, c):
    dx_TxD, dw = carry
    start = _start(c, size, V)
    # the tile's weights again (gathered again, where `take` gathers) and the pull-back of
    # `take`: the tile's gradient into the tile's part of `w` (reduce-scattered into its sinks)
    w_tile, pull = jax.vjp(take, tile_of(w, start, size, axis))
    _, logits, is_target, fresh = _tile(w, lambda _: w_tile, x_TxD, targets_T, c, size, axis)
    # softmax less the one-hot, times the loss's cotangent: the logits' cotangent (fp32), rounded
    # once to the compute dtype, which both products take (head_logits' backward)
    dlogits = ((jnp.exp(logits - lse_T[:, None]) - is_target) * ct_T[:, None]).astype(x_TxD.dtype)
    counted = dlogits if fresh is None else jnp.where(fresh, dlogits, jnp.zeros((), dlogits.dtype))
    dx_TxD = dx_TxD + jnp.einsum(
      _INPUT_GRAD[axis], counted, w_tile, preferred_element_type=jnp.float32
    )
    # every column of the tile, overlap included: an overlapped column's gradient is the same
    # value the tile before wrote, so writing over it (not adding) counts it once
    dw_tile = jnp.einsum(_HEAD_GRAD[axis], x_TxD, dlogits).astype(w_tile.dtype)
    (d_part,) = pull(dw_tile)
    write = lambda acc, d: lax.dynamic_update_slice_in_dim(acc, d.astype(acc.dtype), start, axis)
    return (dx_TxD, jax.tree.map(write, dw, d_part)), None

  like = (x_TxD, *jax.tree.leaves(w), targets_T, lse_T, ct_T)
  dx0 = _varying_as(jnp.zeros(x_TxD.shape, jnp.float32), *like)
  # each part of w's gradient typed as that part (a cotangent's type is its primal's)
  dw0 = jax.tree.map(lambda a: _varying_as(jnp.zeros(a.shape, a.dtype), a), w)
  (dx_TxD, dw), _ = lax.scan(tile, (dx0, dw0), jnp.arange(n))
  return dx_TxD.astype(x_TxD.dtype), dw, None


tiled_cross_entropy.defvjp(_tiled_fwd, _tiled_bwd)


def tiled_scores(x_TxD, w, targets_T, axis: int, chunk: int = VOCAB_CHUNK, take=_identity):
  """(each token's log-probability of its target, fp32 T; whether the target is its logits'
  argmax, bool T) of the logits `x_TxD @ w`, `chunk` vocabulary columns at a time (arguments as
  `tiled_cross_entropy`'s; no gradient): lm-eval's loglikelihood and its greedy flag. The
  log-probability is minus the tiled cross-entropy; the argmax is carried through the tiles with
  the running max, as the first column of the max (`jnp.argmax`'s tie rule): a tile's own first
  max replaces it only where that tile's max is strictly greater, so on a tie an earlier tile,
  whose columns are all lower, keeps it; the last tile's overlap is counted by the tile before
  (-inf here). Equal to `jnp.argmax(logits) == target` of the same logits, ties included."""
  V = vocab_size(w, axis)
  n, size = tiles(V, chunk)

  def tile(carry, c):
    lse, first_T = carry
    logits, is_target = _fresh_logits(x_TxD, w, targets_T, c, size, axis, take)
    later = jnp.max(logits, axis=-1) > lse[0]
    first_T = jnp.where(later, _start(c, size, V) + jnp.argmax(logits, axis=-1), first_T)
    return (_online_lse(lse, logits, is_target), first_T), None

  start = _lse_start(x_TxD, w, targets_T)
  first0 = _varying_as(jnp.zeros(targets_T.shape, jnp.int32), *start)
  ((top, total, target), first_T), _ = lax.scan(tile, (start, first0), jnp.arange(n))
  return target - (top + jnp.log(total)), first_T == targets_T


def tiled_lookup(table, tokens_BxL, chunk: int = VOCAB_CHUNK, take=_identity):
  """The embedding table's rows of the tokens (B x L x D, in `take`'s dtype), one vocabulary
  tile at a time: each tile's rows `take(tile_of(table, ...))` (V x D as stored: vocabulary axis
  0), the tokens that fall in it looked up there. Exactly one tile gives each token its row (the
  last, overlapping tile only the tokens the one before did not hold), the others add zeros:
  exact. Differentiated plainly: each tile's cotangent rows reach its part of `table` (through
  `take`'s backward: a reduce-scatter into the sink's rows)."""
  V = vocab_size(table, 0)
  n, size = tiles(V, chunk)

  def rows_of_tile(c):
    start = _start(c, size, V)
    table_CxD = take(tile_of(table, start, size, 0))
    hit_BxL = (tokens_BxL >= c * size) & (tokens_BxL < start + size)
    rows = jnp.take(table_CxD, jnp.clip(tokens_BxL - start, 0, size - 1), axis=0)
    return jnp.where(hit_BxL[..., None], rows, jnp.zeros((), rows.dtype))

  # the first tile's rows start the sum: its shape, dtype and type are the carry's
  add_tile = lambda x_BxLxD, c: (x_BxLxD + rows_of_tile(c), None)
  x_BxLxD, _ = lax.scan(add_tile, rows_of_tile(0), jnp.arange(1, n))
  return x_BxLxD


def token_cross_entropy(logits_BxLxV, targets_BxL):
  """Each token's cross-entropy, in fp32 (B x L).

  With one-hot labels (`optax.softmax_cross_entropy`) rather than integer ones: the one-hot is an
  iota compare that XLA fuses, so the logits' cotangent (softmax less the one-hot) is one
  elementwise kernel, with its rounding to the compute dtype (`head_logits`) in it. Integer
  labels pick each target's logit with a gather, whose transpose is a scatter-add: a kernel of
  its own that reads and writes the fp32 cotangent, and one more to round it (for 7b, 1.0 GB
  more per micro-batch of 2048 tokens)."""
  import optax  # local: models/ does not otherwise need optax

  logits = logits_BxLxV.astype(jnp.float32)
  labels = jax.nn.one_hot(targets_BxL, logits.shape[-1], dtype=jnp.float32)
  return optax.softmax_cross_entropy(logits, labels)


def next_token_loss(logits_BxLxV, targets_BxL):
  """Mean cross-entropy in fp32."""
  return token_cross_entropy(logits_BxLxV, targets_BxL).mean()


def weighted_token_loss(logits_BxLxV, targets_BxL, weights_BxL):
  """The sum of the cross-entropies (fp32) of the targets whose weight is 1 (0: not a target,
  e.g. a prompt or padding token). A sum, not a mean: the caller divides by the target count of
  the whole step, so that micro-batches and devices with more targets weigh more."""
  return weighted_sum(token_cross_entropy(logits_BxLxV, targets_BxL), weights_BxL)


def weighted_sum(ce_BxL, weights_BxL):
  """The sum of the token losses whose weight is 1 (`weighted_token_loss` of given losses)."""
  # where, not a product: a padding position's loss must not reach the sum even if not finite
  return jnp.sum(jnp.where(weights_BxL > 0, ce_BxL, 0.0))
