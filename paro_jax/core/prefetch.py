"""The layer stack as one `custom_vjp` that prefetches, as FSDP does (the model's `run_layers`).

Per layer the traffic is the schedule's: its weights all-gathered over S(P) in forward and again
in backward (full remat), its gradient reduce-scattered over S(Gr) into the sink. What this
module changes is *when* they are issued, so that XLA's latency-hiding scheduler can run them
beside compute:

* forward (`forward`): the gather of layer i+1 is issued in the iteration that computes layer i
  (its result is only carried to the next iteration, so it does not wait for layer i and layer i
  does not wait for it);
* backward (`backward`), iteration i (layers in reverse): the re-gather of layer i-1 (prefetch)
  and the reduce-scatter of layer i+1's gradient (deferred one iteration) are issued beside the
  recompute and backward of layer i.

The first and last iterations are peeled out of the loops, so no collective is issued twice or
for nothing: the bytes per step are exactly the formula's. The price is memory: two layers of
full weights alive in forward (this one and the next), and in backward two layers of weights
plus one full layer gradient waiting for its reduce-scatter. A per-layer `custom_vjp` gather
under `jax.checkpoint` (the model's own scan) cannot express this: its collectives are tied to
the layer whose iteration uses them, so XLA can only run them before or after that layer's
compute, never beside it.

With `sync` (the last micro-batch of a step), each layer's reduce-scattered gradient is added to
`acc` (the layers' gradients accumulated over the earlier micro-batches, at Gr; None: none) and
synced at once by `sync(tree, dims)`, the accumulation boundary's collectives: the layer's final
gradient, at the OS placement (the sinks' then), leaves while the layers below it still run
their backward.

Residuals are what full remat keeps: each layer's input activation, plus the P-placed shards
(inputs anyway). Gradients: the sinks' are the reduce-scattered per-layer gradients at placement
Gr; the P-placed parameters get none. Frozen (LoRA base) leaves, the Shards with no sink, are
gathered but never differentiated nor reduce-scattered: backward takes the vjp with respect to
the activation and the trained leaves only.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from paro_jax.core import buckets
from paro_jax.core.wire import WireConfig
from paro_jax.core.names import GLOBAL_AXES
from paro_jax.core.rings import to_varying, varying_axes
from paro_jax.core.shards import is_shard, join_trainable, split_trainable


@dataclasses.dataclass(frozen=True)
class Stack:
  """What one call's forward and backward share; static (the custom_vjp's nondiff argument)."""

  block_fn: Callable  # one layer of full weights: block_fn(x, weights) -> x
  mask: Any  # tree of bools: True for the trained leaves
  dims_t: Any  # sharded dimension of each trained leaf (None for the frozen)
  dims_f: Any  # ... of each frozen leaf
  sink_types: Any  # ShapeDtypeStruct of each sink
  sink_axes: Any  # the mesh axes each sink is typed varying over (check_vma)
  n: int  # layers
  gather_axes: tuple
  scatter_axes: tuple
  impl: str
  wire: WireConfig
  sync: Callable | None  # the boundary's sync of a tree of layer gradients (last micro-batch)
  bucket: bool
  bits: bool  # the layer's weights gathered as their bits (buckets.as_bits; the Engine's choice)


def run_layers(
  block_fn,
  x,
  shards,
  acc=None,
  *,
  gather_axes,
  scatter_axes,
  impl,
  wire=WireConfig(),
  sync=None,
  bucket: bool = True,
  bits: bool = False,
):
  """The model's `run_layers` hook: `x` through the stacked layer `shards` (a tree of Shards,
  leading `layers` axis), prefetching each layer's gather; gradients into the sinks."""
  fields = lambda f: jax.tree.map(f, shards, is_leaf=is_shard)
  mask = fields(lambda sh: sh.sink is not None)
  params, dims = fields(lambda sh: sh.param), fields(lambda sh: sh.dim)
  sinks = split_trainable(fields(lambda sh: sh.sink), mask)
  stack = Stack(
    block_fn=block_fn,
    mask=mask,
    dims_t=split_trainable(dims, mask),
    dims_f=split_trainable(dims, mask, False),
    sink_types=jax.tree.map(lambda k: jax.ShapeDtypeStruct(k.shape, k.dtype), sinks),
    sink_axes=jax.tree.map(varying_axes, sinks),
    n=jax.tree.leaves(params)[0].shape[0],
    gather_axes=gather_axes,
    scatter_axes=scatter_axes,
    impl=impl,
    wire=wire,
    sync=sync,
    bucket=bucket,
    bits=bits,
  )
  trained, frozen = split_trainable(params, mask), split_trainable(params, mask, False)
  return _stack(stack, x, trained, frozen, sinks, acc)


# A layer's leaves travel as one bucket (core/buckets.py): with the hand-written rings always, one
# chain of ring steps per layer rather than one per leaf, so that every HO-Ring step is a single
# intra and a single inter transfer; with XLA's collectives if `bucket` (on GPUs), one gather and
# one reduce-scatter per layer. Per leaf, XLA kept nine collectives per layer loop body apart, and
# its scheduler left some of the backward's re-gathers with no matmul beside them (7b IIG on 2x4
# H100: 89% of the per-micro-batch bytes beside compute; bucketed: 95%).
def _gather(s: Stack, trees, dims):
  """All-gather the leaves of several trees over S(P) (one bucket: rings, or `bucket`)."""
  full = buckets.tree_all_gather(
    trees, dims, s.gather_axes, s.impl, wire=s.wire.params_codec, bucket=s.bucket, bits=s.bits
  )
  return jax.tree.map(lambda w: to_varying(w, GLOBAL_AXES), full)


def _scatter(s: Stack, tree, dims):
  return buckets.tree_reduce_scatter(
    tree, dims, s.scatter_axes, s.impl, wire=s.wire.grads_codec, bucket=s.bucket
  )


def _layer(tree, i):
  """Layer i of a stacked tree; i static or traced."""
  return jax.tree.map(lambda p: lax.dynamic_index_in_dim(p, i, keepdims=False), tree)


def _gather_layer(s: Stack, trained, frozen, i):
  return _gather(s, (_layer(trained, i), _layer(frozen, i)), (s.dims_t, s.dims_f))


def _block(s: Stack, x, w):
  return s.block_fn(x, join_trainable(s.mask, *w))


def forward(s: Stack, x, trained, frozen):
  """The stack's output and the input of every layer (saved for backward, as full remat saves
  it), each layer's gather issued one iteration ahead."""
  n = s.n
  # Written in place into one buffer of n rows rather than the scan's n-1 outputs and the last
  # input apart: a row of it is then picked with an index XLA cannot fold (`_after`).
  xs = lax.dynamic_update_index_in_dim(jnp.zeros((n, *x.shape), x.dtype), x, 0, 0)
  with jax.named_scope("layer_gather"):
    w = _gather_layer(s, trained, frozen, 0)
  if n > 1:

    def body(carry, i):
      x, w, xs = carry
      with jax.named_scope("layer_gather"):  # prefetch: used by the next iteration
        w_next = _gather_layer(s, trained, frozen, i + 1)
      x = _block(s, x, w)
      return (x, w_next, lax.dynamic_update_index_in_dim(xs, x, i + 1, 0)), None

    (x, w, xs), _ = lax.scan(body, (x, w, xs), jnp.arange(n - 1))
  return _block(s, x, w), xs


def _after(n: int, i, ct):
  """i, as an index XLA cannot constant-fold: it depends on the cotangent `ct` at run time (and
  is i whatever ct holds). What is indexed with it is computed after `ct`, as jax.checkpoint ties
  its recomputation to backward (with an optimization barrier, which XLA:CPU expands before its
  last CSE pass and its scheduler, so it does not hold here).

  Used for each layer's re-gather: where the index would be a constant (the peeled iterations; a
  loop of one trip, which XLA inlines), the gather would be the same instruction on the same
  operand as forward's gather of that layer, and XLA would merge them (CSE): one gather fewer
  than the schedule, the full weights alive from forward to backward. And for each layer's saved
  input: otherwise XLA may recompute a peeled layer beside the backward of the layer above it,
  with both layers' activations alive."""
  x = ct.reshape(-1)[0]
  return jnp.minimum(i, n - 1 + (x != x).astype(jnp.int32))  # x != x: only for NaN


def _regather(s: Stack, trained, frozen, i, ct):
  with jax.named_scope("layer_regather"):
    return _gather_layer(s, trained, frozen, _after(s.n, i, ct))


def _saved_input(s: Stack, xs, i, ct):
  return lax.dynamic_index_in_dim(xs, _after(s.n, i, ct), keepdims=False)


# The gradient buffers hold one flat row per layer ([n, size]), written row by row, so they keep
# the default layout. Shaped [n, ...], a leaf's buffer was laid out the way the layer's gradient
# leaves its matmul (dimensions transposed), and XLA transposed the whole stack into the default
# layout at the end: a second copy of it (7b ING on 2x4 H100).
def _flat(tree):
  return jax.tree.map(lambda a: a.reshape(a.shape[0], -1), tree)


def _unflat(s: Stack, tree):
  return jax.tree.map(lambda b, t: b.reshape(t.shape), tree, s.sink_types)


def uninitialised(shape, dtype):
  """A buffer to be written in full: allocated, not filled (`lax.empty`; on GPUs no kernel)."""
  return lax.empty(shape, dtype)


def _scatter_into(s: Stack, gbuf, i, g, acc_rows):
  """Layer i's full gradient `g` reduce-scattered into row i of `gbuf`; with `acc_rows` (the
  earlier micro-batches' sum: in gbuf itself unless syncing) added, and with `sync` synced."""
  with jax.named_scope("layer_grad_scatter"):
    g = _scatter(s, g, s.dims_t)
  # Reduced in the compute dtype, accumulated in the sink's (compute or fp32).
  g = jax.tree.map(lambda b, g: g.astype(b.dtype), gbuf, g)
  if acc_rows is not None:
    rows = acc_rows if s.sync is not None else gbuf
    g = jax.tree.map(lambda r, g: jnp.add(_layer(r, i).reshape(g.shape), g), rows, g)
  if s.sync is not None:
    with jax.named_scope("layer_grad_sync"):
      g = s.sync(g, s.dims_t)
  return jax.tree.map(lambda b, g: lax.dynamic_update_index_in_dim(b, g.reshape(-1), i, 0), gbuf, g)


def _layer_vjp(s: Stack, x, w, ct):
  """Recompute one layer's forward, then its backward: (ct of x, gradient of the trained w)."""
  w_t, w_f = w
  _, vjp = jax.vjp(lambda x, w_t: _block(s, x, (w_t, w_f)), x, w_t)
  return vjp(ct)


def backward(s: Stack, xs, trained, frozen, acc, ct):
  """(ct of the stack's input, the sinks' gradients): layers in reverse, each layer's re-gather
  one iteration ahead and its reduce-scatter one iteration behind its backward."""
  n = s.n
  acc_rows = None if acc is None else _flat(acc)
  if acc is not None and s.sync is None:  # accumulate in place: gbuf is the accumulator
    gbuf = acc
  else:  # every row is written below: uninitialised, not zero-filled first (one write fewer)
    gbuf = jax.tree.map(
      lambda t, axes: to_varying(uninitialised(t.shape, t.dtype), tuple(axes)),
      s.sink_types,
      s.sink_axes,
    )
  gbuf = _flat(gbuf)
  w = _regather(s, trained, frozen, n - 1, ct)
  if n == 1:
    ct, g = _layer_vjp(s, _saved_input(s, xs, 0, ct), w, ct)
    return ct, _unflat(s, _scatter_into(s, gbuf, 0, g, acc_rows))
  w_prev = _regather(s, trained, frozen, n - 2, ct)
  ct, g = _layer_vjp(s, _saved_input(s, xs, n - 1, ct), w, ct)
  carry = (ct, w_prev, g, gbuf)  # g: the full gradient of layer i+1, not yet scattered
  if n > 2:

    def body(carry, i):  # layer i, from n-2 down to 1
      ct, w, g_next, gbuf = carry
      w_prev = _regather(s, trained, frozen, i - 1, ct)
      gbuf = _scatter_into(s, gbuf, i + 1, g_next, acc_rows)
      ct, g = _layer_vjp(s, _saved_input(s, xs, i, ct), w, ct)
      return (ct, w_prev, g, gbuf), None

    carry, _ = lax.scan(body, carry, jnp.arange(1, n - 1), reverse=True)
  ct, w, g_next, gbuf = carry
  gbuf = _scatter_into(s, gbuf, 1, g_next, acc_rows)
  ct, g = _layer_vjp(s, _saved_input(s, xs, 0, ct), w, ct)
  return ct, _unflat(s, _scatter_into(s, gbuf, 0, g, acc_rows))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _stack(s: Stack, x, trained, frozen, sinks, acc):
  del sinks, acc  # only receive the gradients; only used by them
  return forward(s, x, trained, frozen)[0]


def _stack_fwd(s, x, trained, frozen, sinks, acc):
  y, xs = forward(s, x, trained, frozen)
  return y, (xs, trained, frozen, acc)


def _stack_bwd(s, res, ct_y):
  ct_x, grads = backward(s, *res, ct_y)
  return ct_x, None, None, grads, None


_stack.defvjp(_stack_fwd, _stack_bwd)
