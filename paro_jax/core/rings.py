"""Ring collectives over named mesh axes, built from `lax.ppermute`, for `shard_map` bodies.

The building blocks of the hand-written implementations (paro_jax/core/collectives.py): the axis
arithmetic (the combined index over ``axes=(a0, a1)`` is ``i0 * n1 + i1``), one flat ring over
the devices of some axes (``ring``), and one ring per axis, one level after the other
(``hring``). Rings are generators: each ``yield`` follows one ppermute, so two schedules can be
interleaved step by step; `run` drives one to its end.
"""

from __future__ import annotations

import math
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.xla_metadata import set_xla_metadata


def norm_axes(axes) -> tuple:
  if axes is None:
    return ()
  if isinstance(axes, str):
    return (axes,)
  return tuple(axes)


def lax_axes(axes: tuple):
  return axes[0] if len(axes) == 1 else axes


def sizes(axes: Sequence[str]) -> tuple:
  return tuple(int(lax.axis_size(a)) for a in axes)


def varying_axes(x) -> frozenset:
  """The mesh axes `x` is typed varying over (none under check_vma=False)."""
  mat = getattr(jax.typeof(x), "manual_axis_type", None)
  return frozenset(getattr(mat, "varying", ()) or ())


def to_varying(x, axes: tuple):
  """pcast ``x`` to varying over those of ``axes`` it is not varying over yet.

  Values that are replicated (invariant) over an axis get an automatic psum of their cotangent
  over it in backward. Typing gathered weights as varying keeps that psum out of every
  micro-batch, so gradients are reduced exactly where the strategy says. Under
  ``check_vma=False`` the type carries no axes and the cast is a no-op.
  """
  missing = tuple(a for a in axes if a not in varying_axes(x))
  if missing:
    x = lax.pcast(x, missing, to="varying")
  return x


def _mesh_axis_order(axes: tuple) -> tuple:
  """``axes`` in the order the current mesh lists them.

  ``lax.ppermute`` over several axes numbers devices by their position in
  the (sorted) device group, i.e. in *mesh* axis order, whatever order the
  tuple is written in (unlike ``axis_index`` / ``all_gather``).
  """
  try:
    names = tuple(jax.sharding.get_abstract_mesh().axis_names)
  except Exception:  # pragma: no cover - no mesh context
    names = ()
  if all(a in names for a in axes):
    return tuple(sorted(axes, key=names.index))
  return axes


def ring_perm(axes: tuple, shift: int) -> tuple:
  """(axis_name, perm) for a ring over the combined ``axes`` index.

  Device with combined (axes-order, major-first) index ``f`` sends to
  ``f + shift``.  The pairs are written in ppermute's own numbering.
  """
  ns = sizes(axes)
  k = math.prod(ns)
  if len(axes) == 1:
    return axes[0], tuple((f, (f + shift) % k) for f in range(k))
  order = _mesh_axis_order(axes)
  pos = [axes.index(a) for a in order]
  osizes = [ns[p] for p in pos]

  def to_perm_index(f):
    digits = []
    for n in reversed(ns):
      digits.append(f % n)
      f //= n
    digits = digits[::-1]  # per axis, in axes order
    q = 0
    for p, n in zip(pos, osizes):
      q = q * n + digits[p]
    return q

  perm = tuple((to_perm_index(f), to_perm_index((f + shift) % k)) for f in range(k))
  return order, perm


# HO-Ring's two transfers of a step run on two communication streams on GPUs. XLA:GPU gives every
# async collective one stream unless told otherwise (ExecutionStreamAssignment reads the
# `_xla_stream_annotation` frontend attribute of a collective), and its latency-hiding scheduler
# keeps a second collective in flight only with a
# --xla_gpu_experimental_parallel_collective_overlap_limit above 1 (core/xla_flags.py). Elsewhere
# the attribute is inert.
INTRA_STREAM, INTER_STREAM = "0", "1"


def ppermute_on(x, axis, perm, stream: str):
  """``lax.ppermute`` whose GPU transfer runs on communication stream ``stream``."""
  with set_xla_metadata(_xla_stream_annotation=stream):
    return lax.ppermute(x, axis, perm)


def _take(x, i):
  return lax.dynamic_index_in_dim(x, i, axis=0, keepdims=False)


# --------------------------------------------------------------------------
# ring building blocks (generators: each ``yield`` follows one ppermute, so
# two schedules can be interleaved step by step)
# --------------------------------------------------------------------------


def ring_ag_gen(x, axes: tuple) -> Iterator[None]:
  """Ring all-gather of chunk ``x`` over combined ``axes``; returns [k, *x.shape].

  Step s (1..k-1): send what arrived last step to the left neighbour and
  receive chunk (r + s) mod k from the right one.
  """
  k = math.prod(sizes(axes))
  if k == 1:
    return x[None]
  r = lax.axis_index(lax_axes(axes))
  name, perm = ring_perm(axes, -1)
  parts, cur = [x], x
  for _ in range(1, k):
    cur = lax.ppermute(cur, name, perm)
    yield
    parts.append(cur)
  stacked = jnp.stack(parts)  # parts[s] holds chunk (r + s) mod k
  return jnp.roll(stacked, r, axis=0)


def ring_rs_gen(x, axes: tuple) -> Iterator[None]:
  """Ring reduce-scatter of stacked ``x`` ([k, ...]); returns sum_devices x[r].

  Partial sums travel right (r -> r + 1); after step t device r holds the
  partial sum of chunk (r - 1 - t) mod k and adds its own copy of it.
  After k-1 steps device r holds the full sum of chunk r.
  """
  k = math.prod(sizes(axes))
  if k == 1:
    return x[0]
  r = lax.axis_index(lax_axes(axes))
  name, perm = ring_perm(axes, +1)
  acc = _take(x, (r - 1) % k)
  for t in range(1, k):
    acc = lax.ppermute(acc, name, perm)
    yield
    acc = acc + _take(x, (r - 1 - t) % k)
  return acc


def hier_ag_gen(x, axes: tuple, order: tuple) -> Iterator[None]:
  """Hierarchical ring all-gather: one ring per axis, in ``order``.

  Returns [n_a for a in axes] + x.shape (axes-order, major first).
  """
  cur = x
  for a in order:  # each level prepends one axis to the stacked dims
    cur = yield from ring_ag_gen(cur, (a,))
  done = tuple(reversed(order))  # current leading-dim order
  perm = [done.index(a) for a in axes] + list(range(len(axes), cur.ndim))
  return jnp.transpose(cur, perm)


def hier_rs_gen(x, axes: tuple, order: tuple) -> Iterator[None]:
  """Hierarchical ring reduce-scatter of ``x`` shaped [n_a for a in axes] + S.

  Reduces one axis after the other in ``order``; returns S.
  """
  m = len(axes)
  cur = jnp.transpose(x, [axes.index(a) for a in order] + list(range(m, x.ndim)))
  for a in order:
    cur = yield from ring_rs_gen(cur, (a,))
  return cur


def run(gen):
  """Drive a ring generator to its end; its return value."""
  try:
    while True:
      next(gen)
  except StopIteration as stop:
    return stop.value
