"""An HF LLaMA directory placed straight onto a mesh, a tensor at a time (`import_hf`).

Each HF tensor (one layer's, for a stacked leaf) is read once per process, over one handle of
its file, each device's block as stored (`hf_shardings`: the block of the HF tensor that the
leaf's sharding puts on that device, or, where that block's rows would be runs too short to
read fast, a range of whole rows), and placed with `jax.make_array_from_callback`. One jitted
function per kind of leaf then does the rest on the devices: the NaN/Inf check (one
reduction), the exchange of row blocks where they were read so (XLA's all-to-all), our layout's
reshape and transpose (hf/layout.py `to_ours`), the cast to the asked dtype, and, for a
stacked leaf, the write of the layer into the stack in place (donated). XLA's tiled transposes
run some ten times faster than numpy's strided copy of the same block. A leaf too small to be
worth its compiles is converted on the host instead (`_on_host`).

No process reads more of the files than its devices' share of each tensor (a small leaf: the
whole of it), nor holds more on the host than one tensor's share beside the placed weights.
The names, shapes and count of the tensors are checked first, from the files' headers, with
hf/weights.py's one-line errors, before anything is read; a tensor the check refuses is named,
with its counts and first index, by a second read of it on the host.
"""

from __future__ import annotations

import contextlib
import functools
import math

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


def _read(tensors: Tensors, name: str, sharding: NamedSharding) -> jax.Array:
  """Tensor `name` as stored, each of this process's devices holding its block of `sharding`."""
  shape = tensors.shapes[name]
  blocks: dict = {}  # devices holding the same block (a partly replicated placement) share it
  with tensors.opened(name) as read:

    def callback(index):
      key = tuple(s.indices(n) for s, n in zip(index, shape))
      if key not in blocks:
        whole = all(k[:2] == (0, n) for k, n in zip(key, shape))
        blocks[key] = read(None if whole else tuple(slice(*k[:2]) for k in key))
      return blocks[key]

    dtype = jnp.dtype(read((slice(0, 0),)).dtype)
    return jax.make_array_from_callback(shape, sharding, callback, dtype=dtype)


def _bits(dtype) -> jnp.dtype:
  """The unsigned integer of `dtype`'s width: what a layer is written into the stack as. XLA on
  CPU computes bf16 in fp32: an in-place update of a bf16 stack would convert the whole stack
  there and back for each layer; on integers it copies the layer alone (on a GPU the two are
  alike)."""
  return jnp.dtype(f"uint{jnp.dtype(dtype).itemsize * 8}")


@functools.lru_cache
def _jit(fn, out_shardings, donate: bool = False, **static):
  """`fn` with `static` bound, jitted to give `out_shardings` (its first argument donated
  with `donate`): one compile per kind of leaf and placement, across imports."""
  donated = (0,) if donate else ()
  return jax.jit(
    functools.partial(fn, **static), out_shardings=out_shardings, donate_argnums=donated
  )


def _convert(x, layout: tuple, dtype, resharded):
  """(HF tensor `x` in our layout (`layout`: the pattern's Axes and its sizes) and `dtype`;
  whether `x` holds NaN or Inf). The barrier keeps the check its own kernel: fused with the
  transpose, it is one loop reading the source strided, several times slower."""
  axes, sizes = layout[0], dict(layout[1])
  bad = ~jnp.isfinite(x).all()
  x, bad = lax.optimization_barrier((jax.sharding.reshard(x, resharded), bad))
  y = to_ours(x, axes, sizes)
  if y.dtype != dtype:  # via fp32, exactly as the whole-model path (fp16 -> bf16 included)
    y = lax.optimization_barrier(y).astype(jnp.float32).astype(dtype)
  return y, bad


def _put(stack, w, i):
  """Layer `i` of `stack` set to `w`, written as their bits: the stack stays in its own dtype
  (donated: updated in place, never copied), the update is the layer's bytes alone. A stack
  filled as integers and converted at the end was copied by that conversion (XLA aliases a
  donated buffer only to an output of its own dtype): a transient of the whole stack, the
  largest of an import."""
  bits = _bits(stack.dtype)
  stack_bits = lax.bitcast_convert_type(stack, bits)
  updated = lax.dynamic_update_index_in_dim(stack_bits, lax.bitcast_convert_type(w, bits), i, 0)
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

  def leaf(path: tuple, sharding):
    name, axes = table[path]
    names = [name.format(i) for i in range(cfg.layers)] if path[0] == LAYERS else [name]
    if len(names) * math.prod(hf_shape(axes, sizes)) < _DEVICE_ELEMENTS:
      return _on_host(tensors, names, path[0] == LAYERS, axes, sizes, dtype, sharding, tied_copy)
    layout, scalar = (axes, tuple(sizes.items())), NamedSharding(sharding.mesh, PartitionSpec())
    if path[0] != LAYERS:
      reading, resharded = hf_shardings(sharding, axes, sizes)
      convert = _jit(_convert, (sharding, scalar), layout=layout, dtype=dtype, resharded=resharded)
      x = _read(tensors, name, reading)
      w, bad = convert(x)
      if bool(bad):
        raise _refuse(tensors, name, directory)
      if name == EMBEDDING and tied_copy:
        if not bool(_jit(jnp.array_equal, scalar)(x, _read(tensors, HEAD, reading))):
          raise tied_head_differs(directory)
      return w

    # A stack of layers: each converted and written into place (donated: updated in place).
    # The check of layer i is read once layer i + 1 is dispatched, so that reading a layer
    # overlaps the device's work on the one before, two at most in flight.
    layer = NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[1:]))
    reading, resharded = hf_shardings(layer, axes, sizes)
    convert = _jit(_convert, (layer, scalar), layout=layout, dtype=dtype, resharded=resharded)
    put = _jit(_put, sharding, donate=True)
    shape = (cfg.layers, *our_shape(axes, sizes))
    stack = _jit(jnp.zeros, sharding, shape=shape, dtype=dtype)()
    pending = None
    for i in range(cfg.layers):
      w, bad = convert(_read(tensors, name.format(i), reading))
      stack = put(stack, w, i)
      if pending is not None and bool(pending[1]):
        raise _refuse(tensors, pending[0], directory)
      pending = (name.format(i), bad)
    if bool(pending[1]):
      raise _refuse(tensors, pending[0], directory)
    return stack

  # None (a leaf not asked for) is an empty subtree to jax: it stays None.
  return jax.tree_util.tree_map_with_path(
    lambda keys, sharding: leaf(tuple(k.key for k in keys), sharding), shardings
  )
