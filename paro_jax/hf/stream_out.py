"""Our parameters, wherever they are placed, written as an HF directory a tensor at a time
(`stream_hf`): the way out that hf/stream.py's import is the way in.

Every output tensor's name, shape and dtype is known from the table (hf/weights.py
`tensor_table`) before anything is read, so the shards are planned first, as `save_hf` plans them
(huggingface_hub's `split_state_dict_into_shards_factory`, here over the tensors' sizes alone):
the same files, names and index. Then each tensor (one layer of a stacked leaf) is gathered from
the devices (one process: assembled on its host from the shards; several: a jitted slice whose
output is replicated, each process reading its own copy), converted (layout, dtype, the NaN/Inf
check: XLA's transposes, not numpy's strided copies) and added to its shard; a shard is
written the moment its last tensor arrives, by process 0 alone: after each of its writes the
processes agree that it went through (an error there stops every one). Host memory holds at
most the shard being filled and one tensor. A LoRA run's adapters are merged into their base
layer by layer, as models/llama.py `merge_lora` merges the whole stack:
W + (alpha / r) A @ B, in fp32, each device its block of the layer, so that the devices hold
each merged layer once.
"""

from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
from huggingface_hub import split_state_dict_into_shards_factory
from jax.sharding import NamedSharding, PartitionSpec
from safetensors.numpy import save_file

from models.config import LAYERS, LlamaConfig, LoraConfig
from models.lora import LORA_SUFFIXES
from paro_jax.hf.layout import hf_shape, in_order, to_hf
from paro_jax.hf.weights import (
  INDEX,
  MAX_SHARD_SIZE,
  SHARDS,
  WEIGHT_DTYPES,
  axis_sizes,
  tensor_table,
  write_config,
)


class NonFinite(ValueError):
  """A gathered tensor holds NaN or Inf: the export is refused (its caller names the step)."""


def _replicated(x: jax.Array) -> NamedSharding:
  return NamedSharding(x.sharding.mesh, PartitionSpec())


def _to_file(w, dtype):
  """(`w` (our layout) in `dtype`; whether that holds NaN or Inf: the source's, or a value the
  cast took out of range), on the devices. The HF layout's transpose is a program of its own
  (`_in_hf_layout`): on XLA:CPU a transpose given beside any other output, or after any other
  work, is laid out as a strided copy, four times slower than the tiled transpose it makes of a
  transpose alone."""
  w = w.astype(dtype)
  return w, ~jnp.isfinite(w).all()


def _in_hf_layout(w, layout):
  """`w` (ours) in the HF tensor's layout (`layout`: the pattern's Axes and its sizes)."""
  return to_hf(w, layout[0], dict(layout[1]))


def _product_spec(layer, a) -> PartitionSpec | None:
  """The placement of the adapters' product (in, out) that gives each device the block of the
  base layer `layer` (in... x out...) it holds: its in and out groups' leading dims' entries;
  None where a dim after a group's first is split (the product would be resharded)."""
  spec = tuple(jax.typeof(layer).sharding.spec)
  spec += (None,) * (layer.ndim - len(spec))
  k = next(k for k in range(layer.ndim + 1) if math.prod(layer.shape[:k]) == a.shape[-2])
  if any(e is not None for e in spec[1:k] + spec[k + 1 :]):
    return None
  return PartitionSpec(spec[0], spec[k])


def _merged(w, a, b, i, scale, dtype):
  """Layer `i` of the stacked `w` with its adapters folded in, as `merge_lora` computes it:
  where the layer is (each device its block of the product, (alpha / r) A @ B over the small
  adapters, added to its block of W), not on every device whole."""
  w, a, b = (lax.dynamic_index_in_dim(x, i, keepdims=False) for x in (w, a, b))
  spec, mesh = _product_spec(w, a), jax.typeof(w).sharding.mesh
  if spec is None:  # a split the product cannot follow: the layer merged whole, as before
    w, a, b = (jax.sharding.reshard(x, NamedSharding(mesh, PartitionSpec())) for x in (w, a, b))
  else:  # the mesh's axes are explicit: the product's placement follows its operands'
    a = jax.sharding.reshard(a, NamedSharding(mesh, PartitionSpec(spec[0], None)))
    b = jax.sharding.reshard(b, NamedSharding(mesh, PartitionSpec(None, spec[1])))
  delta = jnp.einsum("ir,ro->io", a.astype(jnp.float32), b.astype(jnp.float32)) * scale
  delta = delta.reshape(w.shape, out_sharding=jax.typeof(w).sharding)
  return _to_file(w.astype(jnp.float32) + delta, dtype)


def _layer(x, i, dtype):
  return _to_file(jax.lax.dynamic_index_in_dim(x, i, keepdims=False), dtype)


def _host(x: jax.Array) -> np.ndarray:
  """`x` as numpy: one process assembles its shards on the host; with several, each reads its
  copy of the replicated array."""
  return np.asarray(x) if x.is_fully_addressable else np.asarray(x.addressable_data(0))


_STATIC = ("dtype",)


def _gather(leaf, i, lora_of, scale, layout=None, dtype=np.float32) -> tuple[np.ndarray, bool]:
  """(Layer `i` of a stacked leaf (the whole leaf when `i` is None), merged with `lora_of`'s
  adapters (a, b) where it has them, in the HF layout `layout` (ours: None) and `dtype`, read
  to host from every device's copy; whether it holds NaN or Inf)."""
  if not isinstance(leaf, jax.Array):
    w = np.asarray(leaf, np.float32)
    w = w if i is None else w[i]
    bad = not np.isfinite(w).all()
    w = w if layout is None else to_hf(w, layout[0], dict(layout[1]))
    return np.ascontiguousarray(w.astype(dtype)), bad
  out, dtype = _replicated(leaf), jnp.dtype(dtype)
  # One process converts the tensor where its shards are and assembles it on the host (`_host`):
  # no device holds it whole (8 CPU devices held 8 fp32 copies of a 1B model's table). Several
  # processes take it replicated, each reading its own copy. A LoRA layer is merged where its
  # blocks are too (8 CPU devices held 8 fp32 copies of each merged layer).
  whole = {"out_shardings": (out, out)} if jax.process_count() > 1 else {}
  if lora_of is not None:
    a, b = lora_of
    merge = jax.jit(_merged, static_argnames=("scale", *_STATIC), **whole)
    w, bad = merge(leaf, a, b, i, scale=scale, dtype=dtype)
  elif i is None:
    w, bad = jax.jit(_to_file, static_argnames=_STATIC, **whole)(leaf, dtype)
  else:
    w, bad = jax.jit(_layer, static_argnames=_STATIC, **whole)(leaf, i, dtype)
  if layout is not None and not in_order(layout[0]):
    one = {"out_shardings": out} if whole else {}
    w = jax.jit(_in_hf_layout, static_argnames="layout", **one)(w, layout)
  w = _host(w)  # a layout in our order is a reshape: a view of it here
  return (w if layout is None else w.reshape(hf_shape(layout[0], dict(layout[1])))), bool(bad)


def gather_adapters(master: dict) -> dict:
  """The LoRA leaves of `master` ({layers: {attn|mlp: {wq_lora_a: ...}}}, any placement, any
  process count) as fp32 numpy on every process; NonFinite on NaN or Inf."""
  adapters: dict = {}
  for owner, module in master[LAYERS].items():
    for key, w in module.items() if isinstance(module, dict) else ():
      if key.endswith(LORA_SUFFIXES):
        adapters.setdefault(owner, {})[key], bad = _gather(w, None, None, 1.0)
        if bad:
          raise NonFinite(f"{LAYERS}/{owner}/{key} holds NaN or Inf")
  return {LAYERS: adapters}


def _raise(error: BaseException | None) -> None:
  if error is not None:
    raise error


def _attempt(fn, *args) -> BaseException | None:
  """`fn(*args)`'s error, or None: said to every process (`stream_hf`'s check) before raised."""
  try:
    fn(*args)
  except Exception as e:  # noqa: BLE001 - any error of the writer's stops every process
    return e
  return None


def _add(open_shards: dict, split, name: str, w: np.ndarray, directory: str, umask: int):
  """`w` (the tensor as the file holds it) into its shard; the shard written the moment it is
  complete, then freed."""
  file = split.tensor_to_filename[name]
  shard = open_shards.setdefault(file, {})
  shard[name] = w
  if len(shard) == len(split.filename_to_tensors[file]):
    out = os.path.join(directory, file)
    save_file(open_shards.pop(file), out, metadata={"format": "pt"})
    os.chmod(out, 0o666 & ~umask)


def _get(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def plan_shards(cfg: LlamaConfig, dtype: str, max_shard_size):
  """[(HF name, our path, layer or None, layout)] in save_hf's order, and huggingface_hub's
  split of their sizes in `dtype` into shards of at most `max_shard_size`."""
  sizes, itemsize = axis_sizes(cfg), np.dtype(WEIGHT_DTYPES[dtype][0]).itemsize
  tensors = []
  for path, (name, axes) in tensor_table(cfg).items():
    for i in range(cfg.layers) if path[0] == LAYERS else [None]:
      tensors.append((name.format(i) if i is not None else name, path, i, axes))
  nbytes = {name: math.prod(hf_shape(axes, sizes)) * itemsize for name, _, _, axes in tensors}
  try:
    split = split_state_dict_into_shards_factory(
      nbytes, get_storage_size=lambda n: n, filename_pattern=SHARDS, max_shard_size=max_shard_size
    )
  except ValueError as e:  # huggingface_hub's parse of "5GB"
    raise ValueError(
      f"--max-shard-size {max_shard_size!r}: {e} (e.g. 5GB, 500MB, or a number of bytes)"
    ) from None
  return tensors, split


def stream_hf(
  cfg: LlamaConfig,
  params: dict,
  directory: str,
  base_config: dict | None = None,
  dtype: str = "fp32",
  max_shard_size: int | str = MAX_SHARD_SIZE,
  lora: LoraConfig | None = None,
  adapters: dict | None = None,
  check=None,
) -> list[str]:
  """Write `params` (our tree of base weights, jax Arrays on any mesh or numpy) as `save_hf`
  writes it, a tensor at a time (module docstring); with `lora`, `adapters` ({layers: {attn|mlp:
  {wq_lora_a: ...}}}) merged in. Every process must call it (the gathers are collective); only
  process 0 writes (`directory` is read there alone). `check(error)`, called on every process
  after each of process 0's writes with that process's error or None, raises where any process
  failed (cluster/agree.py `OneWriter.check`: the others would wait in the next gather); by
  default the error is raised. Returns the weight files' names. Raises NonFinite on NaN or Inf."""
  check = check or _raise
  if dtype not in WEIGHT_DTYPES:
    raise ValueError(
      f"unknown dtype {dtype!r} for the HF weights; choose one of {list(WEIGHT_DTYPES)}"
    )
  tensors, split = plan_shards(cfg, dtype, max_shard_size)
  writer = jax.process_index() == 0
  check(_attempt(write_config, cfg, directory, base_config, dtype) if writer else None)
  umask = os.umask(0)  # safetensors creates its files 0600: readable like config.json
  os.umask(umask)
  sizes, np_dtype = axis_sizes(cfg), WEIGHT_DTYPES[dtype][0]
  open_shards: dict[str, dict] = {}
  for name, path, i, axes in tensors:
    lora_of = None
    if lora is not None and path[0] == LAYERS and path[-1] in lora.targets:
      owner = adapters[LAYERS][path[1]]
      lora_of = owner[f"{path[-1]}_lora_a"], owner[f"{path[-1]}_lora_b"]
    layout = (axes, tuple(sizes.items()))
    scale = lora.scale if lora else 1.0
    w, bad = _gather(_get(params, path), i, lora_of, scale, layout, np_dtype)
    if bad:
      raise NonFinite(f"{name} holds NaN or Inf")
    error = None
    if writer:  # in the file's layout and dtype: added to its shard
      error = _attempt(_add, open_shards, split, name, w, directory, umask)
    del w
    check(error)
  if writer and split.is_sharded:
    with open(os.path.join(directory, INDEX), "w") as f:
      json.dump({"metadata": split.metadata, "weight_map": split.tensor_to_filename}, f, indent=2)
      f.write("\n")
  return sorted(split.filename_to_tensors)
