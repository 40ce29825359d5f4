"""Streaming DiLoCo's fragments (Douillard et al., arXiv 2501.18512): the outer loop's weights
synced in F parts at staggered steps (`--outer-fragments F`; core/groups.py, core/outer.py).

A fragment is a contiguous range of the layer stack, the layers split as evenly as they go (the
first fragments take one more where F does not divide them), plus a slice of each leaf outside
the stack: the embedding's and the head's rows of the vocabulary split the same way (with a 128k
vocabulary they are 13% of an 8B model: whole in the first and last fragment they would make
those two exchanges the busiest, 0.28 of a round at F = 4). A leaf outside the stack with no
axis to cut (the final norm: its one axis is the one placements shard) goes whole with the last
fragment.

Fragment f is synced after the steps whose count t (after the step) has t mod H = (f+1) H/F
mod H: each fragment every H steps, the fragments H/F steps apart, the last one at the round's
end. F = 1 is DiLoCo's schedule, and at any step at most one fragment is exchanged.

Every cut is along an axis no placement shards: the layer axis (sharding.ShardingRules.
never_shard), and for a leaf outside the stack its largest axis other than the one it is
sharded along (sharding.shard_dims; the vocabulary). So a fragment's slice of a leaf is the same
entries on every device at every placement, and taking and putting it back moves nothing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from jax import lax

from models.config import LAYERS

WHOLE = slice(None)  # a leaf wholly in the fragment
SKIP = "skip"  # a leaf of another fragment


@dataclasses.dataclass(frozen=True)
class Cut:
  """A fragment's entries [start, stop) of a leaf along `axis` (a leaf of a role tree)."""

  axis: int
  start: int
  stop: int

  def shape(self, shape) -> tuple[int, ...]:
    return tuple(self.stop - self.start if a == self.axis else n for a, n in enumerate(shape))


def split(n: int, count: int, f: int) -> tuple[int, int]:
  """[start, stop) of part f of n entries in `count` parts as even as they go (the first ones
  one longer where `count` does not divide n)."""
  size, extra = divmod(n, count)
  start = f * size + min(f, extra)
  return start, start + size + (f < extra)


@dataclasses.dataclass(frozen=True)
class Fragments:
  """F fragments of a model with `layers` layers, each synced every `every` (H) steps."""

  count: int
  every: int
  layers: int

  def __post_init__(self):
    if self.count < 1 or self.every % self.count:
      raise ValueError(
        f"--outer-fragments {self.count} must divide --outer-sync {self.every} (the fragments "
        f"are synced H/F steps apart): pass a divisor of {self.every}"
      )
    if self.count > self.layers:
      raise ValueError(
        f"--outer-fragments {self.count} splits the layer stack into fragments, and the model "
        f"has {self.layers} layers: pass at most {self.layers}"
      )

  def layer_range(self, f: int) -> tuple[int, int]:
    """Layers [start, stop) of fragment f."""
    return split(self.layers, self.count, f)

  def offset(self, f: int) -> int:
    """Fragment f is synced after steps t with t mod H == offset(f)."""
    return (f + 1) * (self.every // self.count) % self.every

  def due(self, step, late: int = 0):
    """The fragment synced after the step count `step` (traced), or `count` for none; with
    `late`, the fragment whose sync step was `late` steps before (none before step `late`+1)."""
    apart = self.every // self.count
    r = (step - late) % self.every
    fragment = jnp.where(r % apart == 0, (r // apart - 1) % self.count, self.count)
    return jnp.where(step > late, fragment, self.count)

  def roles(self, tree, dims, f: int):
    """A tree like `tree` whose leaves say what fragment f holds of each: a Cut, WHOLE or SKIP
    (None stays None: the frozen leaves of a LoRA run). `dims`: each leaf's sharded axis
    (counted from the end, as sharding.shard_dims gives it)."""
    start, stop = self.layer_range(f)
    layers = WHOLE if (start, stop) == (0, self.layers) else Cut(0, start, stop)

    def role(path, x, d):
      if path[0].key == LAYERS:
        return layers
      if self.count == 1:
        return WHOLE
      rank = len(x.shape)
      free = [a for a in range(rank) if a != d % rank and x.shape[a] >= self.count]
      if not free:  # nothing to cut along: with the last fragment
        return WHOLE if f == self.count - 1 else SKIP
      axis = max(free, key=lambda a: x.shape[a])
      return Cut(axis, *split(x.shape[axis], self.count, f))

    return jax.tree_util.tree_map_with_path(role, tree, dims)

  def state_roles(self, tx: optax.GradientTransformation, state, roles):
    """`roles` laid over the optimizer state `state` of `tx` (its leaves that are not
    parameter-shaped, e.g. a count, WHOLE: the outer optimizer, constant-lr SGD, has none)."""
    return optax.tree_map_params(
      tx,
      lambda _, r: r,
      state,
      roles,
      transform_non_params=lambda v: jax.tree.map(lambda _: WHOLE, v),
      is_leaf=_none,
    )


def _none(x) -> bool:
  return x is None


def fragment_part(tree, roles):
  """The fragment's part of `tree` (None in place of other fragments' leaves). Integer leaves
  (a leaf's sharded dimension, counted from the end) are the part's as they are."""

  def part(x, r):
    if x is None or isinstance(r, str):
      return None
    if r == WHOLE or isinstance(x, int):
      return x
    return lax.slice_in_dim(x, r.start, r.stop, axis=r.axis)

  return jax.tree.map(part, tree, roles, is_leaf=_none)


def with_fragment_part(tree, part, roles):
  """`tree` with the fragment's part replaced by `part` (as `fragment_part` cut it)."""

  def one(x, p, r):
    if x is None or isinstance(r, str):
      return x
    if r == WHOLE:
      return p
    return lax.dynamic_update_slice_in_dim(x, p.astype(x.dtype), r.start, r.axis)

  return jax.tree.map(one, tree, part, roles, is_leaf=_none)
