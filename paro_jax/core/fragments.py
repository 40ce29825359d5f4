"""Streaming DiLoCo's fragments (Douillard et al., arXiv 2501.18512): the outer loop's weights
synced in F parts at staggered steps (`--outer-fragments F`; core/groups.py, core/outer.py).

A fragment is a contiguous range of the layer stack, the layers split as evenly as they go (the
first fragments take one more where F does not divide them), plus the leaves outside the stack:
the embedding goes with the first fragment (it feeds the first layers), the final norm and the
head (every other top-level leaf) with the last (they read the last layers' output).

Fragment f is synced after the steps whose count t (after the step) has t mod H = (f+1) H/F
mod H: each fragment every H steps, the fragments H/F steps apart, the last one at the round's
end. F = 1 is DiLoCo's schedule, and at any step at most one fragment is exchanged.

The layer axis is never sharded (sharding.ShardingRules.never_shard), so a fragment's slice of
a stacked leaf is local on every device at every placement: taking and putting it back moves
nothing.
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
    size, extra = divmod(self.layers, self.count)
    start = f * size + min(f, extra)
    return start, start + size + (f < extra)

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

  def roles(self, tree, f: int):
    """A tree like `tree` whose leaves say what fragment f holds of each: a slice of the layer
    axis, WHOLE or SKIP (None stays None: the frozen leaves of a LoRA run)."""
    start, stop = self.layer_range(f)
    layers = WHOLE if (start, stop) == (0, self.layers) else slice(start, stop)
    owner = lambda key: 0 if key == "embed" else self.count - 1

    def role(path, _):
      key = path[0].key
      if key == LAYERS:
        return layers
      return WHOLE if owner(key) == f else SKIP

    return jax.tree_util.tree_map_with_path(role, tree)

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
    return x if r == WHOLE or isinstance(x, int) else x[r]

  return jax.tree.map(part, tree, roles, is_leaf=_none)


def with_fragment_part(tree, part, roles):
  """`tree` with the fragment's part replaced by `part` (as `fragment_part` cut it)."""

  def one(x, p, r):
    if x is None or isinstance(r, str):
      return x
    if r == WHOLE:
      return p
    return lax.dynamic_update_slice_in_dim(x, p.astype(x.dtype), r.start, 0)

  return jax.tree.map(one, tree, part, roles, is_leaf=_none)
