"""One collective for many arrays: a layer's weights gathered, and its gradients reduce-scattered,
as a single flat buffer (a bucket), as FSDP's flat parameters are.

Each array is split along its own dimension over the same mesh axes; device r holds chunk r of
every one. Packing each device's chunks one after the other makes a buffer whose chunk r is
device r's: one all-gather of the buffers, unpacked, is the all-gather of every array. For the
hand-written rings this turns a layer's nine chains of ring steps into one, so each HO-Ring step
is one intra and one inter transfer that the GPU scheduler can run side by side.

Reference semantics: `all_gather_bucket(xs, axes, dims)[i] == collectives.all_gather(xs[i],
axes, dim=dims[i])` and likewise for `reduce_scatter_bucket`; both are differentiable (their
transposes are each other).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from paro_jax.core import collectives as comm


def _ways(axes: tuple) -> int:
  return math.prod(lax.axis_size(a) for a in axes)


def _check_one_dtype(xs: list) -> None:
  if len({x.dtype for x in xs}) > 1:
    raise ValueError(f"a bucket holds one dtype; got {sorted({str(x.dtype) for x in xs})}")


def all_gather_bucket(xs: list, axes, dims: list[int], impl: str = "xla", wire=None) -> list:
  """All-gather each of `xs` along its dim in `dims` over `axes` (major first), as one collective.

  The arrays must share a dtype (a bucket is one buffer). `wire`: the inter level's precision
  (collectives.all_gather); the bucket is quantized as one buffer, per-block scales included.
  """
  axes = tuple(axes) if not isinstance(axes, str) else (axes,)
  if not xs or comm.moves_nothing(axes):  # nothing to gather: no packing (a copy of each)
    return list(xs)
  _check_one_dtype(xs)
  k = _ways(axes)
  moved = [jnp.moveaxis(x, d % x.ndim, 0) for x, d in zip(xs, dims)]
  sizes = [m.size for m in moved]
  local = jnp.concatenate([m.reshape(-1) for m in moved])
  full = comm.all_gather(local, axes, dim=0, impl=impl, wire=wire).reshape(k, local.size)
  out, offset = [], 0
  for x, d, m, n in zip(xs, dims, moved, sizes):
    part = full[:, offset : offset + n].reshape((k * m.shape[0],) + m.shape[1:])
    out.append(jnp.moveaxis(part, 0, d % x.ndim))
    offset += n
  return out


def reduce_scatter_bucket(
  xs: list, axes, dims: list[int], impl: str = "xla", wire=None, residual=None
) -> list:
  """Reduce-scatter (sum) each of `xs` along its dim over `axes`, as one collective (`wire`: as
  collectives.reduce_scatter). With `residual` (error feedback of the bucket's inter level:
  collectives.reduce_scatter_feedback), returns (the list, the new residual)."""
  axes = tuple(axes) if not isinstance(axes, str) else (axes,)
  if not xs or (comm.moves_nothing(axes) and residual is None):  # nothing to reduce: no packing
    return list(xs)
  _check_one_dtype(xs)
  k = _ways(axes)
  moved = [jnp.moveaxis(x, d % x.ndim, 0) for x, d in zip(xs, dims)]
  for x, d, m in zip(xs, dims, moved):
    if m.shape[0] % k:
      raise ValueError(
        f"reduce_scatter_bucket: dimension {d} of shape {x.shape} does not split into the {k} "
        f"devices of axes {axes}"
      )
  # Row r of each (k, -1) view is chunk r of that array: concatenated, row r is device r's.
  rows = jnp.concatenate([m.reshape(k, -1) for m in moved], axis=1)
  if residual is None:
    local = comm.reduce_scatter(rows.reshape(-1), axes, dim=0, impl=impl, wire=wire)
  else:
    local, residual = comm.reduce_scatter_feedback(
      rows.reshape(-1), residual, axes, impl=impl, wire=wire
    )
  out, offset = [], 0
  for x, d, m in zip(xs, dims, moved):
    chunk = (m.shape[0] // k,) + m.shape[1:]
    n = math.prod(chunk)
    out.append(jnp.moveaxis(local[offset : offset + n].reshape(chunk), 0, d % x.ndim))
    offset += n
  return out if residual is None else (out, residual)


# --- whole trees: one bucket with the hand-written rings, XLA's own collectives per leaf unless
# `bucket` (the rings would otherwise run one chain of steps per leaf).
def _flat(tree, dims=None):
  leaves = jax.tree.leaves(tree)
  return leaves, (jax.tree.leaves(dims) if dims is not None else None)


def _unflat(tree, values):
  it = iter(values)
  return jax.tree.map(lambda _: next(it), tree)


def _per_leaf(leaves, impl, axes, bucket) -> bool:
  """Unless `bucket` asks for one: leaves go one by one with XLA's collectives, and where they
  hold several dtypes (a bucket is one buffer)."""
  if not leaves:
    return True
  mixed = len({x.dtype for x in leaves}) > 1
  return not bucket and (mixed or comm.concrete_impl(impl, axes) == "xla")


def tree_all_gather(
  tree, dims, axes, impl: str = "xla", wire=None, bucket: bool = False, bits: bool = False
):
  """Each leaf all-gathered along its dim over `axes` (`collectives.all_gather`); one bucket
  with the hand-written rings (leaves of one width), or with any implementation if `bucket`.
  `bits`: each leaf gathered as its bits (`as_bits`): the same bytes and values, for leaves
  not differentiated through the gather and a `wire` that does not change them."""
  leaves, flat_dims = _flat(tree, dims)
  sent = [as_bits(x) for x in leaves] if bits else leaves
  if _per_leaf(sent, impl, axes, bucket):
    out = [comm.all_gather(x, axes, dim=d, impl=impl, wire=wire) for x, d in zip(sent, flat_dims)]
  else:
    out = all_gather_bucket(sent, axes, flat_dims, impl, wire=wire)
  if bits:
    out = [lax.bitcast_convert_type(o, x.dtype) for o, x in zip(out, leaves)]
  return _unflat(tree, out)


def as_bits(x):
  """`x` as the unsigned integers of its width (bitcast: no copy). XLA:CPU runs a bf16
  collective in f32 (a convert before it and after): a gathered bf16 weight is held in f32, twice
  its bytes; an integer collective runs as it is."""
  return lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def tree_reduce_scatter(tree, dims, axes, impl: str = "xla", wire=None, bucket: bool = False):
  """Each leaf reduce-scattered along its dim over `axes` (`collectives.reduce_scatter`); one
  bucket with the hand-written rings (leaves of one dtype), or with any implementation if
  `bucket`."""
  leaves, flat_dims = _flat(tree, dims)
  if _per_leaf(leaves, impl, axes, bucket):
    out = [
      comm.reduce_scatter(x, axes, dim=d, impl=impl, wire=wire) for x, d in zip(leaves, flat_dims)
    ]
  else:
    out = reduce_scatter_bucket(leaves, axes, flat_dims, impl, wire=wire)
  return _unflat(tree, out)


def tree_all_reduce(tree, axes, impl: str = "xla", wire=None):
  """Each leaf summed over `axes` (`collectives.all_reduce`); the rings reduce one flat buffer."""
  leaves, _ = _flat(tree)
  axes = tuple(axes) if not isinstance(axes, str) else (axes,)
  if not axes or not leaves or comm.concrete_impl(impl, axes) == "xla":
    return _unflat(tree, [comm.all_reduce(x, axes, impl=impl, wire=wire) for x in leaves])
  total = comm.all_reduce(
    jnp.concatenate([x.reshape(-1) for x in leaves]), axes, impl=impl, wire=wire
  )
  out, offset = [], 0
  for x in leaves:
    out.append(total[offset : offset + x.size].reshape(x.shape))
    offset += x.size
  return _unflat(tree, out)


# --- error feedback (collectives.reduce_scatter_feedback): a tree's leaves always as one bucket,
# so that one residual covers them all.
def tree_reduce_scatter_feedback(tree, dims, axes, residual, impl: str = "xla", wire=None):
  """`tree_reduce_scatter` as one bucket whose inter level adds `residual`: (tree, residual)."""
  leaves, flat_dims = _flat(tree, dims)
  out, residual = reduce_scatter_bucket(leaves, axes, flat_dims, impl, wire, residual)
  return _unflat(tree, out), residual


def tree_all_reduce_feedback(tree, axes, residual, impl: str = "xla", wire=None):
  """`tree_all_reduce` of one flat buffer whose inter level adds `residual`: (tree, residual)."""
  leaves, _ = _flat(tree)
  flat = jnp.concatenate([x.reshape(-1) for x in leaves])
  total, residual = comm.all_reduce_feedback(flat, residual, axes, impl=impl, wire=wire)
  out, offset = [], 0
  for x in leaves:
    out.append(total[offset : offset + x.size].reshape(x.shape))
    offset += x.size
  return _unflat(tree, out), residual
