"""How an HF tensor's axes become our parameter's, written once per tensor as a pattern.

A pattern names the HF tensor's axes, then ours: `"(h k) d -> d h k"` is q_proj, stored as
(heads*head_dim, dim) and held by us as (dim, heads, head_dim). A parenthesised HF axis is the
product of its names, the first outermost (row-major, as `reshape` splits it); our side names
each axis once. The sizes of the names come from the model's config (hf/weights.py
`axis_sizes`). From one pattern come both shapes and the conversion of whole arrays each way
(`to_ours`, `to_hf`; numpy's or jax's: the streaming import runs `to_ours` on the devices).
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

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


def in_order(axes: Axes) -> bool:
  """Whether our axes are the HF names in their order: each layout is then a reshape."""
  return _order(axes) == list(range(len(axes.ours)))


def to_ours(w: np.ndarray, axes: Axes, sizes: dict) -> np.ndarray:
  """A whole HF tensor in our layout."""
  split = [sizes[n] for group in axes.hf for n in group]
  return w.reshape(split).transpose(_order(axes))


def to_hf(w: np.ndarray, axes: Axes, sizes: dict) -> np.ndarray:
  """A whole parameter of ours in the HF tensor's layout."""
  back = np.argsort(_order(axes))
  return w.transpose(back).reshape(hf_shape(axes, sizes))
