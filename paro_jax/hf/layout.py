"""How an HF tensor's axes become our parameter's, written once per tensor as a pattern.

A pattern names the HF tensor's axes, then ours: `"(h k) d -> d h k"` is q_proj, stored as
(heads*head_dim, dim) and held by us as (dim, heads, head_dim). A parenthesised HF axis is the
product of its names, the first outermost (row-major, as `reshape` splits it); our side names
each axis once. The sizes of the names come from the model's config (hf/weights.py
`axis_sizes`). From one pattern come both shapes, the conversion of whole arrays each way
(`to_ours`, `to_hf`), and what a slice of ours needs of the HF tensor (`slice_of`): the
streaming import reads only that.
"""

from __future__ import annotations

import math
import re
from typing import Callable, NamedTuple

import numpy as np


class Axes(NamedTuple):
  """A parsed pattern: each HF axis as the names it flattens (outer first), and our axes."""

  hf: tuple[tuple[str, ...], ...]
  ours: tuple[str, ...]


def parse(pattern: str) -> Axes:
  """`"(h k) d -> d h k"` -> Axes((("h", "k"), ("d",)), ("d", "h", "k")); every name once on
  each side."""
  left, arrow, right = pattern.partition("->")
  hf = tuple(
    tuple(group.split()) if group else (name,)
    for group, name in re.findall(r"\(([^)]*)\)|(\w+)", left)
  )
  ours = tuple(right.split())
  flat = [n for group in hf for n in group]
  if not arrow or sorted(flat) != sorted(ours) or len(set(ours)) != len(ours):
    raise ValueError(f"layout pattern {pattern!r}: each name must appear once on each side")
  return Axes(hf, ours)


def hf_shape(axes: Axes, sizes: dict) -> tuple[int, ...]:
  return tuple(math.prod(sizes[n] for n in group) for group in axes.hf)


def our_shape(axes: Axes, sizes: dict) -> tuple[int, ...]:
  return tuple(sizes[n] for n in axes.ours)


def _order(axes: Axes) -> list[int]:
  """Where each of our axes sits among the HF names, flattened."""
  flat = [n for group in axes.hf for n in group]
  return [flat.index(n) for n in axes.ours]


def to_ours(w: np.ndarray, axes: Axes, sizes: dict) -> np.ndarray:
  """A whole HF tensor in our layout."""
  split = [sizes[n] for group in axes.hf for n in group]
  return w.reshape(split).transpose(_order(axes))


def to_hf(w: np.ndarray, axes: Axes, sizes: dict) -> np.ndarray:
  """A whole parameter of ours in the HF tensor's layout."""
  back = np.argsort(_order(axes))
  return w.transpose(back).reshape(hf_shape(axes, sizes))


def slice_of(
  read: Callable[[tuple[slice, ...]], np.ndarray],
  axes: Axes,
  sizes: dict,
  index: tuple[slice, ...],
) -> np.ndarray:
  """Our parameter's block `index` (one slice per axis of ours), from `read(hf_index)`, which
  returns that block of the HF tensor. A flattened HF axis is read over whole runs of its
  inner names (the outer name's range times their sizes), then cut to their ranges: exact for
  any index, and no more than the block when only the outer name is split (our layouts shard
  `d`, `v` or `f`, never a head's width)."""
  ranges = {n: range(*s.indices(sizes[n])) for n, s in zip(axes.ours, index)}
  if any(r.step != 1 for r in ranges.values()):
    raise ValueError(f"slice_of reads contiguous blocks, got {index}")
  hf_index, split, inner = [], [], []
  for group in axes.hf:
    outer, rest = ranges[group[0]], math.prod(sizes[n] for n in group[1:])
    hf_index.append(slice(outer.start * rest, outer.stop * rest))
    split += [len(outer), *(sizes[n] for n in group[1:])]
    inner += [slice(None), *(slice(ranges[n].start, ranges[n].stop) for n in group[1:])]
  block = read(tuple(hf_index)).reshape(split)[tuple(inner)]
  return block.transpose(_order(axes))
