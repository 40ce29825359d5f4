"""Per-state shardings: logical axes + a placement -> a PartitionSpec on the (inter, intra) mesh.

Each leaf is sharded along one dimension, the first of its logical axes that the rules allow.
I shards that dimension over `intra`; G over (`intra`, `inter`), intra-major, so a device's G
chunk (index l*g + k) lies inside its I chunk (index l): I->G is then a reduce-scatter over
`inter` alone. Nothing is ever silently replicated: a leaf that cannot be split as its placement
says is an error.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from paro_jax.core.mesh import mesh_shape
from paro_jax.core.strategy import Placement, Strategy


@dataclasses.dataclass(frozen=True)
class ShardingRules:
  """Which logical axes may carry the data-parallel shard, in order of preference."""

  # `lora_out`/`lora_in`: a LoRA adapter's big dimension where it has no `embed` (models/lora.py).
  # `proj_out`: a q/k/v bias (Qwen2's), flat heads x head_dim; `head_dim`: a q/k norm's scale
  # (Qwen3's), the only axis it has (head_dim devices at most under G).
  shard_axes: tuple[str, ...] = ("embed", "lora_out", "lora_in", "proj_out", "head_dim")
  never_shard: tuple[str, ...] = ("layers",)  # scanned over: must stay whole on every device

  def __post_init__(self):
    if overlap := set(self.shard_axes) & set(self.never_shard):
      raise ValueError(f"ShardingRules: axes {sorted(overlap)} are both shardable and never_shard")


def _path_name(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def shard_dims(logical_tree, rules: ShardingRules = ShardingRules()):
  """The dimension each leaf is sharded along, counted from the end (negative), so that it
  stays valid after the scan over layers strips the leading `layers` axis."""

  def pick(path, axes):
    for name in rules.shard_axes:
      if name in axes:
        return axes.index(name) - len(axes)
    raise ValueError(
      f"parameter {_path_name(path)} with logical axes {axes} has none of the "
      f"shardable axes {rules.shard_axes}: add one of its axes to "
      f"ShardingRules.shard_axes"
    )

  return jax.tree_util.tree_map_with_path(pick, logical_tree, is_leaf=_is_axes)


def _is_axes(x) -> bool:
  return isinstance(x, tuple) and all(isinstance(a, str) for a in x)


def placement_spec(
  name: str, shape: tuple[int, ...], dim: int, placement: Placement, mesh: Mesh
) -> PartitionSpec:
  """PartitionSpec that splits dimension `dim` of a leaf as `placement` says, or an error."""
  if placement is Placement.N:
    return PartitionSpec()
  inter, intra = mesh_shape(mesh)
  ways = placement.shard_count(inter, intra)
  if shape[dim] % ways:
    raise ValueError(
      f"cannot shard {name} (shape {tuple(shape)}) with placement {placement.name}: its dimension "
      f"{dim % len(shape)} has size {shape[dim]}, not divisible by {ways} "
      f"(mesh inter={inter} x intra={intra}). Choose a mesh or model size that divides it, or a "
      f"coarser placement."
    )
  spec = [None] * len(shape)
  axes = placement.axes
  spec[dim % len(shape)] = axes[0] if len(axes) == 1 else axes
  return PartitionSpec(*spec)


def tree_specs(shapes_tree, dims_tree, placement: Placement, mesh: Mesh):
  """PartitionSpecs for a whole tree (leaves of shapes_tree need a .shape)."""
  return jax.tree_util.tree_map_with_path(
    lambda path, x, d: placement_spec(_path_name(path), x.shape, d, placement, mesh),
    shapes_tree,
    dims_tree,
  )


@dataclasses.dataclass(frozen=True)
class StateSpecs:
  """PartitionSpec trees for the three states of one strategy (same tree structure as params)."""

  params: object
  grads: object
  opt: object


def state_specs(shapes_tree, dims_tree, strategy: Strategy, mesh: Mesh) -> StateSpecs:
  return StateSpecs(
    params=tree_specs(shapes_tree, dims_tree, strategy.params, mesh),
    grads=tree_specs(shapes_tree, dims_tree, strategy.grads, mesh),
    opt=tree_specs(shapes_tree, dims_tree, strategy.opt, mesh),
  )


def named(mesh: Mesh, specs):
  is_spec = lambda x: isinstance(x, PartitionSpec)
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=is_spec)


def local_shape(shape: tuple[int, ...], dim: int, ways: int) -> tuple[int, ...]:
  """Shape of one device's shard when dimension `dim` is split `ways` ways."""
  out = list(shape)
  out[dim] //= ways
  return tuple(out)
