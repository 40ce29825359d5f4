"""The outer loop of DiLoCo (Douillard et al., arXiv 2311.08105) on the (inter, intra) mesh.

Each group (a node: one row of the mesh) trains on its own as an independent replica along
`inter` (core/groups.py). Every H steps the groups sync:

  1. the outer weights (fp32, sharded over all devices: G) are all-gathered to the placement the
     groups hold their master weights at (OS of the inner strategy, N or I);
  2. each group's pseudo-gradient, outer weights minus its inner weights, is reduce-scattered
     back to G and divided by the devices that summed it: the mean over groups (the copies
     inside a group are equal, so with OS = N the sum over the node counts each group m times
     and the division by n = g m still gives the mean); the inter level on the wire as
     `--inter-grads` says, with error feedback;
  3. the outer optimizer, optax SGD with Nesterov momentum, updates the outer weights at G;
  4. the new outer weights are all-gathered to OS again, and every group restarts from them.
     The inner optimizer state is kept.

Because G nests inside I (docs/design.md, "Layout"), for OS = I both collectives run over
`inter` alone, on 1/m of the weights: what crosses nodes per round is 4 bytes (the outer
weights) out and w bytes (the pseudo-gradient's wire format) back per parameter, times
(g-1)/g / m, once every H steps.

With `--outer-state I` (`sync_at_node`) every node holds the outer weights and momentum itself,
sharded over its own m devices (I, the same on every node): a device's pseudo-gradient is its I
shard's, outer minus inner; its mean over `inter` is one all-reduce (the pseudo-gradient's
wire with error feedback: a reduce-scatter, then an all-gather of the quantized sum, so every
node dequantizes the same values); every node applies the same outer step to its shard, and
the restart weights are gathered over `intra` only where OS = N. Nothing fp32 crosses nodes:
2w bytes per parameter, times (g-1)/g / m, for 8 bytes per parameter over m devices instead of n.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from paro_jax.core import buckets
from paro_jax.core.config import OuterOptions
from paro_jax.core.fragments import fragment_part, with_fragment_part
from paro_jax.core.names import INTER
from paro_jax.core.shards import gather_invariant
from paro_jax.core.strategy import Placement, Strategy
from paro_jax.core.wire import Codec


class OuterState(NamedTuple):
  params: Any  # fp32 outer weights of the trained leaves, at --outer-state (G or I)
  opt_state: Any  # the outer optimizer's state (momentum where the weights are)
  residual: Any = None  # error feedback of the pseudo-gradient's wire: fp32, one vector a device
  # --outer-delay: each group's weights of a fragment as of its sync step (stacked like master)
  pending: Any = None


def outer_tx(outer: OuterOptions) -> optax.GradientTransformation:
  """The outer optimizer: SGD with Nesterov momentum (the paper's: lr 0.7, momentum 0.9)."""
  return optax.sgd(outer.lr, momentum=outer.momentum, nesterov=True)


def sync_axes(strategy: Strategy) -> tuple[str, ...]:
  """The axes between the groups' master placement and G (major first): S(G) minus S(OS)."""
  return tuple(a for a in Placement.G.axes if a not in strategy.opt.axes)


def sync(
  inner,
  outer: OuterState,
  dims,
  strategy: Strategy,
  tx,
  impl: str,
  codec: Codec | None,
  at: Placement = Placement.G,
) -> tuple[Any, OuterState]:
  """One round's end on this device (inside the shard_map): (the weights every group restarts
  from, at OS; the new outer state). `inner`: this group's fp32 master weights at OS; `at`:
  where the outer state lives (--outer-state)."""
  if at == Placement.I:
    return sync_at_node(inner, outer, dims, strategy, tx, impl, codec)
  axes = sync_axes(strategy)
  devices = 1
  for a in axes:
    devices *= jax.lax.axis_size(a)
  with jax.named_scope("outer_sync"):
    start = buckets.tree_all_gather(outer.params, dims, axes, impl)
    delta = jax.tree.map(jnp.subtract, start, inner)
    residual = outer.residual
    if residual is None:
      summed = buckets.tree_reduce_scatter(delta, dims, axes, impl, codec)
    else:
      summed, residual = buckets.tree_reduce_scatter_feedback(
        delta, dims, axes, residual, impl, codec
      )
    pseudo_grad = jax.tree.map(lambda s: s / devices, summed)
    return _step_and_restart(outer, pseudo_grad, residual, dims, axes, tx, impl)


def _step_and_restart(outer: OuterState, pseudo_grad, residual, dims, axes, tx, impl: str):
  """(the weights every group restarts from, at OS: the new outer weights gathered over `axes`;
  the new outer state) after the outer optimizer's step on the mean pseudo-gradient."""
  updates, opt_state = tx.update(pseudo_grad, outer.opt_state, outer.params)
  params = optax.apply_updates(outer.params, updates)
  # Every device of a group holds the restart weights at OS: typed so (replicated over the axes
  # OS does not shard) with XLA's collectives; the rings' results are typed varying.
  if impl == "xla":
    restart = jax.tree.map(lambda w, d: gather_invariant(w, axes, d), params, dims)
  else:
    restart = buckets.tree_all_gather(params, dims, axes, impl)
  return restart, OuterState(params, opt_state, residual)


def own_chunk(x, axes: tuple[str, ...], dim: int):
  """This device's chunk of `x` along `dim` over `axes` (major first), as tiled all-gather over
  `axes` would place it: a slice, nothing moved."""
  for a in axes:
    size = x.shape[dim % x.ndim] // jax.lax.axis_size(a)
    x = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(a) * size, size, dim % x.ndim)
  return x


def sync_at_node(
  inner, outer: OuterState, dims, strategy: Strategy, tx, impl: str, codec: Codec | None
) -> tuple[Any, OuterState]:
  """`sync` with the outer state at I (--outer-state I): each node's copy of it, sharded over
  its devices. Only the pseudo-gradient crosses nodes, all-reduced over `inter`."""
  axes = strategy.outer_node_axes  # ('intra',) for OS = N, else ()
  groups = jax.lax.axis_size(INTER)
  with jax.named_scope("outer_sync"):
    # OS = N: a device's I shard of its group's weights is a slice of them (no collective).
    mine = jax.tree.map(lambda w, d: own_chunk(w, axes, d), inner, dims)
    delta = jax.tree.map(jnp.subtract, outer.params, mine)
    residual = outer.residual
    if residual is None:
      summed = buckets.tree_all_reduce(delta, (INTER,), impl, codec)
    else:
      summed, residual = buckets.tree_all_reduce_feedback(delta, (INTER,), residual, impl, codec)
    pseudo_grad = jax.tree.map(lambda s: s / groups, summed)
    # Every node holds the same sum (a compressed one is dequantized from the same payload
    # everywhere), so every node's outer step is the same and the copies stay equal.
    return _step_and_restart(outer, pseudo_grad, residual, dims, axes, tx, impl)


def sync_fragment(
  inner,
  outer: OuterState,
  dims,
  strategy: Strategy,
  tx,
  impl: str,
  codec,
  fragments,
  f,
  span,
  at: Placement = Placement.G,
):
  """Fragment f's sync (core/fragments.py): `sync` on the fragment's part of the weights, the
  outer state and the residual (its `span` of the flat residual: each fragment quantizes its own
  pseudo-gradient). Returns (the fragment's restart weights at OS, the fragment's roles for
  `fragments.with_fragment_part`, the new outer state, whole)."""
  roles = fragments.roles(outer.params, dims, f)
  state_roles = fragments.state_roles(tx, outer.opt_state, roles)
  residual = outer.residual
  whole = residual is None or span == (0, residual.shape[0])
  part = OuterState(
    fragment_part(outer.params, roles),
    fragment_part(outer.opt_state, state_roles),
    residual if whole else residual[span[0] : span[1]],
  )
  with jax.named_scope(f"fragment_{f}"):
    restart, part = sync(
      fragment_part(inner, roles), part, fragment_part(dims, roles), strategy, tx, impl, codec, at
    )
  if not whole:
    residual = jax.lax.dynamic_update_slice_in_dim(residual, part.residual, span[0], 0)
  new = outer._replace(
    params=with_fragment_part(outer.params, part.params, roles),
    opt_state=with_fragment_part(outer.opt_state, part.opt_state, state_roles),
    residual=part.residual if whole else residual,
  )
  return restart, roles, new
