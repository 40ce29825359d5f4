"""An HF LLaMA directory placed straight onto a mesh, a piece of a tensor at a time (`import_hf`).

Each HF tensor (one layer's, for a stacked leaf) is read once per process, over one handle of
its file, each device's block as stored (`hf_shardings`: the block of the HF tensor that the
leaf's sharding puts on that device, or, where that block's rows would be runs too short to
read fast, a range of whole rows), in pieces along the HF axis that holds our first axis where
no placement splits it (`_pieces`: some 4M elements of a device's block each), and placed with
`jax.make_array_from_callback`. On the devices, one jitted function checks it for NaN/Inf
(`_non_finite`: one reduction), one per kind of piece converts it (`_convert`: the exchange of
row blocks where they were read so (XLA's all-to-all), our layout's reshape and transpose
(hf/layout.py `to_ours`), the cast to the asked dtype), and another writes it into place
(`_put`: into its leaf's stack, donated, in place). XLA's tiled transposes run some ten times
faster than numpy's strided copy of the same block. A leaf too small to be worth its compiles
is converted on the host instead (`_on_host`).

Where the time goes, on the 2-core CPU machine of experiments/model_io.py (a VM where the
kernel's first touch of fresh memory runs at ~1.3 GB/s, a copy into touched memory at 10):
before pieces, a 32 MB tensor was read into a fresh buffer, copied to a fresh device buffer
and transposed into a third, each a new mapping faulted in page by page; a piece of 8 MB is
served from memory freed by the piece before. What is left is XLA:CPU's work per byte: the
check, the transpose and the write into place, on one thread per device.

No process reads more of the files than its devices' share of each tensor (a small leaf: the
whole of it), nor holds more on the host than a few pieces (one tensor's share, where it is
read whole) beside the placed weights. The names, shapes and count of the tensors are checked
first, from the files' headers, with hf/weights.py's one-line errors, before anything is read;
a tensor the check refuses is named, with its counts and first index, by a second read of it
on the host.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec
from safetensors import safe_open

from models.config import LAYERS, LlamaConfig
from paro_jax.hf.layout import Axes, hf_shape, our_shape, to_ours
from paro_jax.hf.weights import (
  EMBEDDING,
  HEAD,
  axis_sizes,
  check_finite,
  check_tensors,
  non_finite,
  non_finite_counts,
  tensor_table,
  tied_head_differs,
  unreadable,
  weight_files,
)

# A block read in runs shorter than this (elements of a row) reads at a fraction of a
# contiguous read (safetensors' get_slice copies run by run): 2-3 GB/s from 16 to 1024 elements
# of bf16, 0.5 GB/s at 4 (experiments/model_io.py's machine, from the page cache).
_MIN_RUN = 64
# A leaf of fewer elements is converted on the host: its compiles would cost more than the
# conversion (about 0.1 s each, the time XLA takes to transpose some 30 MB on that machine).
_DEVICE_ELEMENTS = 1 << 20
# A tensor is read and placed in pieces of at most this many elements of a device's block
# (`_pieces`): a buffer this small is reused from one piece to the next, where a larger one is
# a fresh mapping whose every page the kernel must fault in and zero (on the CPU machine of
# experiments/model_io.py, some 1.3 GB/s against 10 GB/s for a copy into memory already
# touched; 8 MB: glibc maps anything over 32 MB afresh), and the host holds a piece, not a
# tensor's share.
_PIECE_ELEMENTS = 1 << 22
# Pieces dispatched before the host waits for the oldest one's check: reading the next pieces
# overlaps the devices' work on these, and no more than this many are held at once.
_IN_FLIGHT = 2
_SCAN_BYTES = 1 << 26  # the rows a refused tensor is counted over at a time (error path only)


class Tensors:
  """The tensors of an HF directory as their files' headers list them: which file holds each
  and its shape. `opened(name)` reads blocks of one while it lasts (its file is mapped only
  then: the pages read leave this process's memory when it ends)."""

  def __init__(self, directory: str):
    self.directory = directory
    self.files: dict[str, str] = {}  # HF name -> its file
    self.shapes: dict[str, tuple] = {}
    for path in weight_files(directory):
      with self._open(path) as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is no mapping
          self.files[name], self.shapes[name] = path, tuple(f.get_slice(name).get_shape())

  @staticmethod
  def _open(path: str):
    try:
      return safe_open(path, framework="numpy")
    except Exception as e:  # noqa: BLE001 - said by unreadable()
      raise unreadable(path, e) from None

  @contextlib.contextmanager
  def opened(self, name: str):
    """A reader `read(hf_index) -> np.ndarray` of tensor `name`'s block (the whole tensor
    for None), as stored, over one handle of its file."""
    path = self.files[name]
    with self._open(path) as f:
      tensor = f.get_slice(name)

      def read(hf_index: tuple | None) -> np.ndarray:
        try:  # get_tensor: a third faster than slicing all of it
          return f.get_tensor(name) if hf_index is None else tensor[hf_index]
        except Exception as e:  # noqa: BLE001 - a short or damaged file
          raise unreadable(path, e) from None

      yield read


def hf_shardings(target: NamedSharding, axes: Axes, sizes: dict):
  """(where an HF tensor is read to, where it is resharded to) on its way to `target` (our
  layout's sharding of it). The second splits the HF axis that holds our split axis, as its
  outer name, alike: then the layout's reshape and transpose are each device's own block,
  with no communication (whole where it is no outer name). It is read there too, but when
  that puts fewer than _MIN_RUN elements of a row in a block: such a block is a copy per
  short run, so the rows are split instead (over the same mesh axes, where they divide them)
  and the devices exchange their blocks (XLA's all-to-all)."""
  spec = tuple(target.spec) + (None,) * (len(axes.ours) - len(target.spec))
  shape = hf_shape(axes, sizes)
  hf_spec = [None] * len(shape)
  for name, entry in zip(axes.ours, spec):
    group = next(i for i, g in enumerate(axes.hf) if name in g)
    if entry is not None and axes.hf[group][0] == name:
      hf_spec[group] = entry
  resharded = NamedSharding(target.mesh, PartitionSpec(*hf_spec))
  split = [a for entry in spec if entry is not None for a in np.atleast_1d(entry)]
  ways = math.prod(target.mesh.shape[a] for a in split)
  block = resharded.shard_shape(shape)
  run = next((math.prod(block[i:]) for i in range(1, len(shape)) if block[i] < shape[i]), None)
  if run is None or run >= _MIN_RUN or shape[0] % ways:
    return resharded, resharded
  rows = PartitionSpec(tuple(split), *[None] * (len(shape) - 1))
  return NamedSharding(target.mesh, rows), resharded


class Pieces(NamedTuple):
  """How an HF tensor is read and placed a piece at a time: along HF axis `axis`, whose outer
  name is our first axis (so that each piece is a contiguous run of our layout's blocks: its
  write into place is a copy of whole rows), `step` entries of it (`unit` of which are one
  entry of that name) at a time."""

  axis: int
  step: int
  unit: int

  def ranges(self, shape: tuple) -> list:
    return [
      (r, min(r + self.step, shape[self.axis])) for r in range(0, shape[self.axis], self.step)
    ]


def _pieces(shape: tuple, axes: Axes, sizes: dict, reading, resharded) -> Pieces:
  """Pieces of at most _PIECE_ELEMENTS of a device's block, all alike (a divisor of the
  entries: one compile), where neither placement splits the HF axis that holds our first axis
  as its outer name; else the whole tensor in one (and where no divisor is near that size, or
  a piece's runs of a row would be shorter than _MIN_RUN)."""
  first = axes.ours[0]
  axis = next(i for i, group in enumerate(axes.hf) if first in group)
  entries = sizes[first]
  unit = shape[axis] // entries
  split = [
    tuple(spec)[axis] if axis < len(spec) else None for spec in (reading.spec, resharded.spec)
  ]
  if axes.hf[axis][0] != first or split != [None, None]:
    return Pieces(axis, shape[axis], unit)
  block = reading.shard_shape(shape)
  across = math.prod(block) // entries  # a device's block, per entry
  most = min(entries, max(1, _PIECE_ELEMENTS // across))
  step = max(d for d in range(1, most + 1) if entries % d == 0)
  run = step * unit * math.prod(block[axis + 1 :])  # of a row, where the axis is not the first
  if step * 8 <= most or (axis > 0 and run < _MIN_RUN):
    step = entries
  return Pieces(axis, step * unit, unit)


def _read(tensors: Tensors, name: str, sharding: NamedSharding, piece: tuple) -> jax.Array:
  """Entries `piece` (axis, start, stop) of tensor `name` as stored, each of this process's
  devices holding its block of `sharding`."""
  shape = tensors.shapes[name]
  axis, start, stop = piece
  sub = (*shape[:axis], stop - start, *shape[axis + 1 :])
  blocks: dict = {}  # devices holding the same block (a partly replicated placement) share it
  with tensors.opened(name) as read:

    def callback(index):
      key = tuple(s.indices(n)[:2] for s, n in zip(index, sub))
      if key not in blocks:
        at = [(a + start, b + start) if i == axis else (a, b) for i, (a, b) in enumerate(key)]
        whole = all(k == (0, n) for k, n in zip(at, shape))
        blocks[key] = read(None if whole else tuple(slice(*k) for k in at))
      return blocks[key]

    dtype = jnp.dtype(read((slice(0, 0),)).dtype)
    return jax.make_array_from_callback(sub, sharding, callback, dtype=dtype)


def _bits(dtype) -> jnp.dtype:
  """The unsigned integer of `dtype`'s width: what a piece is written into its leaf as. XLA on
  CPU computes bf16 in fp32: an in-place update of a bf16 array would convert the whole array
  there and back for each piece; on integers it copies the piece alone (on a GPU the two are
  alike)."""
  return jnp.dtype(f"uint{jnp.dtype(dtype).itemsize * 8}")


@functools.lru_cache
def _jit(fn, out_shardings, donate: bool = False, **static):
  """`fn` with `static` bound, jitted to give `out_shardings` (its first argument donated
  with `donate`): one compile per kind of leaf, piece and placement, across imports."""
  donated = (0,) if donate else ()
  return jax.jit(
    functools.partial(fn, **static), out_shardings=out_shardings, donate_argnums=donated
  )


def _non_finite(x):
  """Whether `x` holds NaN or Inf: its own program, apart from the conversion (`_convert`). On
  XLA:CPU a program that gives a transpose beside any other output lays the transpose out as a
  strided copy, some four times slower than the tiled transpose it makes of a transpose alone
  (the same with an optimization barrier between them)."""
  return ~jnp.isfinite(x).all()


def _convert(x, layout: tuple, dtype, resharded):
  """HF rows `x` in our layout (`layout`: the pattern's Axes and the piece's sizes) and `dtype`.
  Its own program, apart from the write into place (`_put`), too: XLA would fuse the transpose
  into that write, a strided loop some ten times slower than its tiled transpose."""
  axes, sizes = layout[0], dict(layout[1])
  y = to_ours(jax.sharding.reshard(x, resharded), axes, sizes)
  if y.dtype != dtype:  # via fp32, exactly as the whole-model path (fp16 -> bf16 included)
    y = lax.optimization_barrier(y).astype(jnp.float32).astype(dtype)
  return y


def _put(stack, y, at: tuple):
  """`stack` with piece `y` written at slot `at` (its leading indices), as their bits: the
  stack stays in its own dtype (donated: updated in place, never copied), the update is the
  piece's bytes alone. A stack filled as integers and converted at the end was copied by that
  conversion (XLA aliases a donated buffer only to an output of its own dtype): a transient of
  the whole stack, the largest of an import."""
  bits = _bits(stack.dtype)
  y = lax.bitcast_convert_type(y, bits).reshape((1,) * len(at) + y.shape)
  updated = lax.dynamic_update_slice(
    lax.bitcast_convert_type(stack, bits), y, [*at] + [0] * (y.ndim - len(at))
  )
  return lax.bitcast_convert_type(updated, stack.dtype)


def _refuse(tensors: Tensors, name: str, where: str):
  """The one-line error of a tensor the check found NaN or Inf in, its counts and first index
  over the whole tensor, read a run of rows at a time on the host."""
  shape = tensors.shapes[name]
  step = max(1, _SCAN_BYTES // max(1, math.prod(shape[1:]) * 4))
  nan = inf = 0
  first = None
  with tensors.opened(name) as read:
    for start in range(0, shape[0], step):
      n, i, at = non_finite_counts(read((slice(start, min(start + step, shape[0])),)))
      nan, inf = nan + n, inf + i
      if first is None and at is not None:
        first = (at[0] + start, *at[1:])
  return non_finite(name, where, nan, inf, first)


def _on_host(
  tensors: Tensors, names: list, stacked: bool, axes: Axes, sizes, dtype, sharding, tied
):
  """A leaf too small to be worth its compiles (a norm's scales, a tiny model's weights): each
  of its tensors read whole, checked, converted and stacked on the host, as the whole-model
  read does, each device given its block."""
  stack = []
  for name in names:
    with tensors.opened(name) as read:
      w = read(None)
    check_finite(w, name, tensors.directory)
    if name == EMBEDDING and tied:
      with tensors.opened(HEAD) as read:
        if not np.array_equal(w, read(None)):
          raise tied_head_differs(tensors.directory)
    w = to_ours(w, axes, sizes)
    stack.append(w if w.dtype == dtype else w.astype(np.float32).astype(dtype))
  whole = np.stack(stack) if stacked else stack[0]
  return jax.make_array_from_callback(whole.shape, sharding, lambda index: whole[index])


def import_hf(directory: str, cfg: LlamaConfig, shardings, dtype):
  """Our parameter tree's leaves named by `shardings` (a tree like the parameters', a Sharding
  per leaf to import, None for the others) read from HF directory `directory` (its config
  `cfg`, as read_config gives it), each made at its sharding in `dtype`, this process reading
  only its own devices' blocks."""
  tensors = Tensors(directory)
  check_tensors(cfg, tensors.shapes, directory)
  table, sizes, dtype = tensor_table(cfg), axis_sizes(cfg), jnp.dtype(dtype)
  tied_copy = cfg.tie_embeddings and HEAD in tensors.shapes

  def checked(name: str, bad: jax.Array) -> None:
    if bool(bad):
      raise _refuse(tensors, name, directory)

  def leaf(path: tuple, sharding):
    name, axes = table[path]
    stacked = path[0] == LAYERS
    names = [name.format(i) for i in range(cfg.layers)] if stacked else [name]
    if len(names) * math.prod(hf_shape(axes, sizes)) < _DEVICE_ELEMENTS:
      return _on_host(tensors, names, stacked, axes, sizes, dtype, sharding, tied_copy)
    scalar = NamedSharding(sharding.mesh, PartitionSpec())
    block = NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[stacked:]))
    reading, resharded = hf_shardings(block, axes, sizes)
    shape = hf_shape(axes, sizes)
    pieces = _pieces(shape, axes, sizes, reading, resharded)
    ours = our_shape(axes, sizes)
    leaf_shape = (*[cfg.layers][:stacked], *ours)
    count = len(pieces.ranges(shape))
    # Each piece of each HF tensor is read, converted and written into place in a stack made
    # whole first (zeros; donated: updated in place), a piece a slot, of the layers and, where
    # a tensor is read in several, of its pieces; then seen as the leaf (a reshape: no copy).
    # XLA:CPU writes a piece into a slot (the whole of its trailing axes) as one copy; into a
    # 2-D array or part of a layer, with a loop over far more (the array) or element by element.
    # A piece's check is read once _IN_FLIGHT more are dispatched.
    if stacked or count > 1:
      spec = tuple(sharding.spec)
      if count > 1:  # ours[0] is not split
        ours, spec = (count, ours[0] // count, *ours[1:]), (*spec[:stacked], None, *spec[stacked:])
      slots = (*[cfg.layers][:stacked], *ours)
      made = _jit(
        jnp.zeros, NamedSharding(sharding.mesh, PartitionSpec(*spec)), shape=slots, dtype=dtype
      )()
      put = _jit(_put, made.sharding, donate=True)
    pending: collections.deque = collections.deque()  # (name, its check), oldest first
    for i, each in enumerate(names):
      for n, (start, stop) in enumerate(pieces.ranges(shape)):
        layout = (axes, tuple({**sizes, axes.ours[0]: (stop - start) // pieces.unit}.items()))
        convert = _jit(_convert, block, layout=layout, dtype=dtype, resharded=resharded)
        x = _read(tensors, each, reading, (pieces.axis, start, stop))
        bad, y = _jit(_non_finite, scalar)(x), convert(x)
        if stacked or count > 1:
          made = put(made, y, (*[i][:stacked], *[n][: count > 1]))
        else:
          made = y
        if each == EMBEDDING and tied_copy:
          head = _read(tensors, HEAD, reading, (pieces.axis, start, stop))
          if not bool(_jit(jnp.array_equal, scalar)(x, head)):
            raise tied_head_differs(directory)
        pending.append((each, bad))
        if len(pending) > _IN_FLIGHT:
          checked(*pending.popleft())
    for each, bad in pending:
      checked(each, bad)
    if count == 1:
      return made
    return _jit(jnp.reshape, sharding, donate=True, shape=leaf_shape)(made)

  # None (a leaf not asked for) is an empty subtree to jax: it stays None.
  return jax.tree_util.tree_map_with_path(
    lambda keys, sharding: leaf(tuple(k.key for k in keys), sharding), shardings
  )
