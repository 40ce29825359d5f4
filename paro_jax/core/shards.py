"""Parameters as the step holds them: Shards at the P placement, and the gathers that use them.

A `Shard` is one parameter at its P placement beside the zero "gradient sink" of the Gr shape its
gradient is routed into (docs/design.md, "the gradient sink"); frozen (LoRA base) leaves carry
no sink. Trees of trained or frozen leaves keep the full parameter structure with None for the
other leaves (`split_trainable`, `join_trainable`).
"""

from __future__ import annotations

import functools

import flax.struct
import jax
from jax import lax

from paro_jax.core import collectives as comm
from paro_jax.core.wire import WireConfig
from paro_jax.core.names import GLOBAL_AXES
from paro_jax.core.rings import to_varying


def split_trainable(tree, mask, trained: bool = True):
  """The leaves of `tree` where `mask` is `trained`; None in place of the others."""
  return jax.tree.map(lambda m, x: x if m == trained else None, mask, tree)


def join_trainable(mask, trained, frozen):
  """The full tree from its trained and frozen parts (as `split_trainable` splits it)."""
  return jax.tree.map(lambda m, a, b: a if m else b, mask, trained, frozen)


@flax.struct.dataclass
class Shard:
  """One parameter at its P placement, with the Gr-shaped sink its gradient is routed into."""

  param: jax.Array
  sink: jax.Array
  dim: int = flax.struct.field(pytree_node=False)  # sharded dimension, counted from the end


def is_shard(x) -> bool:
  return isinstance(x, Shard)


def gather_invariant(x, axes, dim):
  """All-gather typed as replicated over `axes` (for results that leave the shard_map)."""
  return lax.all_gather(x, axes, axis=dim % x.ndim, tiled=True, to="invarying") if axes else x


def make_gather(gather_axes, scatter_axes, impl, wire=WireConfig(), grad_dtype=None):
  """Per-layer weight gather over S(P) whose backward reduce-scatters over S(Gr) into the sink.

  The reduce-scatter runs in the compute dtype; its result is cast to the sink's (`grad_dtype`),
  where it is accumulated. Both collectives carry `wire`'s precision on their inter level."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
  def gather(param, sink, dim):
    del sink  # only receives the gradient
    full = comm.all_gather(
      param, gather_axes, dim=dim % param.ndim, impl=impl, wire=wire.params_codec
    )
    return to_varying(full, GLOBAL_AXES)

  def fwd(param, sink, dim):
    return gather(param, sink, dim), None

  def bwd(dim, _, ct):
    g = comm.reduce_scatter(ct, scatter_axes, dim=dim % ct.ndim, impl=impl, wire=wire.grads_codec)
    return None, g.astype(grad_dtype or ct.dtype)

  gather.defvjp(fwd, bwd)
  return gather
