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

from paro_jax.core import buckets
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


def make_gather(
  gather_axes, scatter_axes, impl, wire=WireConfig(), grad_dtype=None, bits: bool = False
):
  """Weight gather over S(P) whose backward reduce-scatters over S(Gr) into the sinks.

  `gather(params, sinks, dims)` takes tuples (one entry per leaf) and gathers them together:
  one bucket (core/buckets.py) with the hand-written rings, so that a module's leaves make one
  chain of ring steps (with HO-Ring, a chain of its norm scale alone is steps of a few hundred
  bytes, which XLA's scheduler sees no reason to overlap), each leaf on its own with XLA's
  collectives. The reduce-scatter runs in the compute dtype; its result is cast to the sinks'
  (`grad_dtype`), where it is accumulated. Both collectives carry `wire`'s precision on their
  inter level. `bits`: the weights gathered as their bits (buckets.as_bits; the Engine's
  `gather_bits`)."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
  def gather(params, sinks, dims):
    del sinks  # only receive the gradients
    dims = tuple(d % p.ndim for p, d in zip(params, dims))
    full = buckets.tree_all_gather(params, dims, gather_axes, impl, wire.params_codec, bits=bits)
    return tuple(to_varying(w, GLOBAL_AXES) for w in full)

  def fwd(params, sinks, dims):
    return gather(params, sinks, dims), None

  def bwd(dims, _, cts):
    dims = tuple(d % ct.ndim for ct, d in zip(cts, dims))
    grads = buckets.tree_reduce_scatter(cts, dims, scatter_axes, impl, wire.grads_codec)
    return None, tuple(g.astype(grad_dtype or ct.dtype) for g, ct in zip(grads, cts))

  gather.defvjp(fwd, bwd)
  return gather
