import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from models.llama import Llama
from models.config import LlamaConfig
from paro_jax.core.mesh import make_mesh
from paro_jax.core.sharding import ShardingRules, placement_spec, shard_dims, state_specs
from paro_jax.core.strategy import Placement, parse_strategy

CFG = LlamaConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp=64)


@pytest.fixture(scope="module")
def model_trees():
  model = Llama(CFG)
  logical = model.logical_axes()
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  return logical, shapes, shard_dims(logical)


def test_stored_specs_iig(model_trees):
  # Written out by hand: every leaf is split along its `embed` dimension.
  logical, shapes, dims = model_trees
  specs = state_specs(shapes, dims, parse_strategy("IIG"), make_mesh(2, 4))
  G = ("intra", "inter")
  assert specs.params["layers"]["attn"]["wq"] == P(None, "intra", None, None)
  assert specs.params["layers"]["attn"]["wo"] == P(None, None, None, "intra")
  assert specs.params["layers"]["mlp"]["w_down"] == P(None, None, "intra")
  assert specs.params["embed"]["embedding"] == P(None, "intra")
  assert specs.params["head"]["norm"]["scale"] == P("intra")
  assert specs.grads["layers"]["mlp"]["w_up"] == P(None, "intra", None)
  assert specs.opt["layers"]["mlp"]["w_up"] == P(None, G, None)
  assert specs.opt["head"]["kernel"] == P(G, None)
  ddp = state_specs(shapes, dims, parse_strategy("NNN"), make_mesh(2, 4))
  assert all(s == P() for s in jax.tree.leaves(ddp.opt, is_leaf=lambda x: isinstance(x, P)))


def test_g_shard_lies_inside_i_shard():
  mesh = make_mesh(2, 4)
  x = np.arange(64)
  i_shards = jax.device_put(
    x, NamedSharding(mesh, placement_spec("x", (64,), -1, Placement.I, mesh))
  )
  g_shards = jax.device_put(
    x, NamedSharding(mesh, placement_spec("x", (64,), -1, Placement.G, mesh))
  )
  i_by_dev = {s.device: set(np.asarray(s.data).tolist()) for s in i_shards.addressable_shards}
  seen = set()
  for s in g_shards.addressable_shards:
    g = set(np.asarray(s.data).tolist())
    assert len(g) == 8 and g <= i_by_dev[s.device]
    seen |= g
  assert seen == set(range(64))
  # Device (inter k, intra l) holds global chunk l*g + k (docs/design.md's layout).
  for s in g_shards.addressable_shards:
    k, l = np.argwhere(mesh.devices == s.device)[0]
    assert np.asarray(s.data)[0] == (l * 2 + k) * 8


def test_non_dividing_dimension_names_leaf_shape_and_mesh(model_trees):
  logical, shapes, dims = model_trees
  with pytest.raises(
    ValueError,
    match=r"cannot shard layers/attn/wq \(shape \(2, 32, 4, 8\)\) "
    r"with placement G: its dimension 1 has size 32, not "
    r"divisible by 48 \(mesh inter=6 x intra=8\)",
  ):
    placement_spec("layers/attn/wq", (2, 32, 4, 8), -3, Placement.G, _FakeMesh(6, 8))


class _FakeMesh:
  def __init__(self, inter, intra):
    self.shape = {"inter": inter, "intra": intra}


def test_leaf_without_shardable_axis_is_an_error():
  with pytest.raises(
    ValueError,
    match=r"parameter w with logical axes \('mlp',\) has none of "
    + re.escape(f"the shardable axes {ShardingRules().shard_axes}"),
  ):
    shard_dims({"w": ("mlp",)})
  with pytest.raises(ValueError, match="both shardable and never_shard"):
    ShardingRules(shard_axes=("layers",))


def test_placement_n_is_replicated():
  assert placement_spec("x", (3, 5), -1, Placement.N, make_mesh(2, 4)) == P()
