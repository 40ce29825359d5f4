"""An HF LLaMA directory placed straight onto a mesh, a slice at a time (`import_hf`).

Each leaf of our parameter tree is made with `jax.make_array_from_callback` for the sharding it
is asked at: the callback of each of this process's devices reads, with safetensors'
`safe_open(...).get_slice`, only the block of the HF tensor (per layer, for the stacked layer
axis) that the device holds, converts it to our layout (hf/layout.py) and to the asked dtype, and
checks it for NaN and Inf. No process holds more than one leaf's own blocks on the host at a
time, nor any other process's: a 70B model enters 8 nodes as each node's share. The names, shapes
and count of the tensors are checked first, from the files' headers, with hf/weights.py's
one-line errors, before anything is read.
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np
from safetensors import safe_open

from models.config import LAYERS, LlamaConfig
from paro_jax.hf.layout import our_shape, slice_of
from paro_jax.hf.weights import (
  EMBEDDING,
  HEAD,
  axis_sizes,
  check_finite,
  check_tensors,
  tensor_table,
  tied_head_differs,
  unreadable,
  weight_files,
)


class Tensors:
  """The tensors of an HF directory as their files' headers list them: which file holds each
  and its shape. `opened()` reads blocks of them while it lasts (the files are mapped only then:
  the pages read leave this process's memory when it ends)."""

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
  def opened(self):
    """A reader `read(name, hf_index) -> np.ndarray` (the block as stored) over open files."""
    handles: dict = {}

    def read(name: str, hf_index: tuple) -> np.ndarray:
      path = self.files[name]
      if path not in handles:
        handles[path] = stack.enter_context(self._open(path))
      try:
        return handles[path].get_slice(name)[hf_index]
      except Exception as e:  # noqa: BLE001 - a short or damaged file
        raise unreadable(path, e) from None

    with contextlib.ExitStack() as stack:
      yield read


def import_hf(directory: str, cfg: LlamaConfig, shardings, dtype):
  """Our parameter tree's leaves named by `shardings` (a tree like the parameters', a Sharding
  per leaf to import, None for the others) read from HF directory `directory` (its config
  `cfg`, as read_config gives it), each made at its sharding in `dtype`, this process reading
  only its own devices' blocks."""
  tensors = Tensors(directory)
  check_tensors(cfg, tensors.shapes, directory)
  table, sizes, dtype = tensor_table(cfg), axis_sizes(cfg), np.dtype(dtype)
  tied_copy = cfg.tie_embeddings and HEAD in tensors.shapes

  def block(read, name: str, axes, index: tuple) -> np.ndarray:
    def read_checked(hf_index):
      w = read(name, hf_index)
      check_finite(w, name, directory, tuple(s.start for s in hf_index))
      if name == EMBEDDING and tied_copy and not np.array_equal(w, read(HEAD, hf_index)):
        raise tied_head_differs(directory)
      return w

    w = slice_of(read_checked, axes, sizes, index)
    if w.dtype != dtype:  # via fp32, exactly as the whole-model path (fp16 -> bf16 included)
      w = w.astype(np.float32).astype(dtype)
    return w

  def leaf(path: tuple, sharding):
    name, axes = table[path]
    layered = path[0] == LAYERS
    shape = our_shape(axes, sizes)
    shape = (cfg.layers, *shape) if layered else shape
    blocks: dict = {}  # devices holding the same block (a partly replicated placement) share it

    def callback(index):
      key = tuple(s.indices(n) for s, n in zip(index, shape))
      if key not in blocks:
        with tensors.opened() as read:
          if not layered:
            blocks[key] = np.ascontiguousarray(block(read, name, axes, index))
          else:
            layers = range(*index[0].indices(cfg.layers))
            out = None
            for j, i in enumerate(layers):  # one layer's block at a time, into the stack
              w = block(read, name.format(i), axes, index[1:])
              if out is None:
                out = np.empty((len(layers), *w.shape), dtype)
              out[j] = w
            blocks[key] = out
      return blocks[key]

    return jax.make_array_from_callback(shape, sharding, callback, dtype=dtype)

  # None (a leaf not asked for) is an empty subtree to jax: it stays None.
  return jax.tree_util.tree_map_with_path(
    lambda keys, sharding: leaf(tuple(k.key for k in keys), sharding), shardings
  )
