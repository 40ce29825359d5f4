"""paro_jax.core.buckets: one flat-buffer collective == the per-array lax collectives, exactly.

Small random integers stored as float32, so any summation order is exact and a misplaced chunk
shows as a mismatch. Shapes and sharded dimensions differ between the arrays of a bucket, as a
layer's weights do.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from paro_jax.core import buckets

AXES = [("intra",), ("inter",), ("intra", "inter")]
IMPLS = ["xla", "ring", "hring", "horing"]
# (shape of each device's block, dim) per array: 2-D and 3-D, sharded on the first or last dim.
SHARDS = [((4, 3), 0), ((2, 5), 1), ((3, 2, 2), -1)]


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((2, 4), ("inter", "intra"), devices=jax.devices()[:8])


def _blocks(mesh, shapes, seed):
  rng = np.random.RandomState(seed)
  spec = NamedSharding(mesh, P(("inter", "intra")))
  return [
    jax.device_put(jnp.asarray(rng.randint(-4, 5, (8,) + s).astype(np.float32)), spec)
    for s in shapes
  ]


def _run(mesh, fn, xs):
  """fn over each device's blocks (leading device dim dropped inside), results stacked again."""
  spec = P(("inter", "intra"))
  body = lambda *blocks: [y[None] for y in fn([b[0] for b in blocks])]
  return jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(xs), out_specs=spec, check_vma=False)
  )(*xs)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("axes", AXES)
def test_all_gather_bucket_equals_lax(mesh, axes, impl):
  dims = [d for _, d in SHARDS]
  xs = _blocks(mesh, [s for s, _ in SHARDS], seed=1)
  got = _run(mesh, lambda b: buckets.all_gather_bucket(b, axes, dims, impl), xs)
  want = _run(
    mesh,
    lambda b: [lax.all_gather(x, axes, axis=d % x.ndim, tiled=True) for x, d in zip(b, dims)],
    xs,
  )
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("axes", AXES)
def test_reduce_scatter_bucket_equals_lax(mesh, axes, impl):
  k = {("intra",): 4, ("inter",): 2, ("intra", "inter"): 8}[axes]
  # Full-size inputs: the sharded dim holds k chunks.
  shapes = [tuple(n * k if i == d % len(s) else n for i, n in enumerate(s)) for s, d in SHARDS]
  dims = [d for _, d in SHARDS]
  xs = _blocks(mesh, shapes, seed=2)
  got = _run(mesh, lambda b: buckets.reduce_scatter_bucket(b, axes, dims, impl), xs)
  want = _run(
    mesh,
    lambda b: [
      lax.psum_scatter(x, axes, scatter_dimension=d % x.ndim, tiled=True) for x, d in zip(b, dims)
    ],
    xs,
  )
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("impl", ["xla", "horing"])
def test_bucket_gradients_are_the_transpose(mesh, impl):
  """d/dx of <w, all_gather_bucket(x)> is reduce_scatter of w: the per-array lax gradient."""
  axes, dims = ("intra", "inter"), [d for _, d in SHARDS]
  xs = _blocks(mesh, [s for s, _ in SHARDS], seed=3)
  full = [s[: d % len(s)] + (s[d % len(s)] * 8,) + s[d % len(s) + 1 :] for s, d in SHARDS]
  ws = _blocks(mesh, full, seed=4)

  def grads(gather):
    def fn(blocks):
      x, w = blocks[:3], blocks[3:]
      loss = lambda x: sum(jnp.sum(a * b) for a, b in zip(gather(x), w))
      return jax.grad(loss)(x)

    return _run(mesh, fn, xs + ws)

  got = grads(lambda x: buckets.all_gather_bucket(x, axes, dims, impl))
  want = grads(
    lambda x: [lax.all_gather(a, axes, axis=d % a.ndim, tiled=True) for a, d in zip(x, dims)]
  )
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_bucket_refuses_mixed_dtypes_and_indivisible_dims(mesh):
  def mixed(blocks):
    return buckets.all_gather_bucket([blocks[0], blocks[1].astype(jnp.bfloat16)], "intra", [0, 0])

  xs = _blocks(mesh, [(4, 3), (4, 3)], seed=5)
  with pytest.raises(ValueError, match="one dtype"):
    _run(mesh, mixed, xs)
  with pytest.raises(ValueError, match="does not split into the 4 devices"):
    _run(mesh, lambda b: buckets.reduce_scatter_bucket(b, "intra", [0]), _blocks(mesh, [(6, 2)], 6))


def test_tree_collectives_take_mixed_dtypes_leaf_by_leaf(mesh):
  """A tree of several dtypes cannot be one bucket: with the hand-written rings its leaves go one
  by one (shards.make_gather gathers a module's leaves so), each equal to lax's; asked for a
  bucket, it is refused as above."""
  xs = _blocks(mesh, [(4, 3), (4, 3)], seed=7)

  def gather(blocks, bucket=False):
    tree = (blocks[0], blocks[1].astype(jnp.bfloat16))
    return list(buckets.tree_all_gather(tree, (0, 1), ("intra",), "ring", bucket=bucket))

  got = _run(mesh, gather, xs)
  want = _run(
    mesh,
    lambda b: [
      lax.all_gather(b[0], "intra", axis=0, tiled=True),
      lax.all_gather(b[1].astype(jnp.bfloat16), "intra", axis=1, tiled=True),
    ],
    xs,
  )
  assert [g.dtype for g in got] == [jnp.float32, jnp.bfloat16]
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  k = 4  # reduce-scatter over intra: full-size leaves
  ys = _blocks(mesh, [(4 * k, 3), (4, 3 * k)], seed=8)

  def scatter(blocks):
    tree = (blocks[0], blocks[1].astype(jnp.bfloat16))
    return list(buckets.tree_reduce_scatter(tree, (0, 1), ("intra",), "ring"))

  got = _run(mesh, scatter, ys)
  want = _run(
    mesh,
    lambda b: [
      lax.psum_scatter(b[0], "intra", scatter_dimension=0, tiled=True),
      lax.psum_scatter(b[1].astype(jnp.bfloat16), "intra", scatter_dimension=1, tiled=True),
    ],
    ys,
  )
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  with pytest.raises(ValueError, match="one dtype"):
    _run(mesh, lambda b: gather(b, bucket=True), xs)
