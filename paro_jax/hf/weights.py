"""Hugging Face weights: read and write `LlamaForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`
and `MistralForCausalLM` directories (safetensors).

`load_hf(directory)` reads `config.json` and `model.safetensors` (or the shards listed in
`model.safetensors.index.json`) into a `LlamaConfig` and our fp32 parameter tree;
`save_hf(cfg, params, directory)` writes them back, in fp32, bf16 or fp16, in shards of at most
`max_shard_size` with their index as transformers writes them (huggingface_hub's
`split_state_dict_into_shards_factory`: model-00001-of-0000N.safetensors and
model.safetensors.index.json, whose metadata.total_size and weight_map transformers reads).
Neither needs torch.

HF stores each `nn.Linear` weight as (out, in); ours are (in, out) with the heads split out:
  q_proj (H*K, D) -> wq (D, H, K)      o_proj (D, H*K) -> wo (H, K, D)
  k_proj, v_proj (G*K, D) -> (D, G, K)  gate_proj, up_proj (F, D) -> (D, F)
  down_proj (D, F) -> w_down (F, D)     lm_head (V, D) -> head/kernel (D, V)
A tied model (`tie_word_embeddings`) has one table, embed_tokens; its head has no kernel.
Qwen2's q/k/v biases (H*K,), (G*K,) are ours as stored (attn/bq, bk, bv); Qwen3's q_norm and
k_norm (K,) are attn/q_norm/scale and attn/k_norm/scale.
Both sides use the "rotate_half" RoPE layout (first half / second half of each head), so the
query and key weights need no permutation. Per-layer tensors are stacked on a leading axis.
"""

from __future__ import annotations

import json
import os

import ml_dtypes  # registers bfloat16 with numpy, so bf16 safetensors load
import numpy as np
from huggingface_hub import split_state_dict_into_shards_factory
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from paro_jax.hf.layout import hf_shape, our_shape, parse, to_hf, to_ours
from models.config import LAYERS, LlamaConfig
from models.hf_config import CONFIG, config_to_hf, read_config

WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
SHARDS = "model{suffix}.safetensors"  # transformers' names: model-00001-of-00004.safetensors
MAX_SHARD_SIZE = "5GB"  # transformers' and huggingface_hub's default (decimal units)
# The dtypes an export writes: our name -> (numpy's, the name config.json gives it,
# safetensors' header name).
WEIGHT_DTYPES = {
  "fp32": (np.float32, "float32", "F32"),
  "bf16": (ml_dtypes.bfloat16, "bfloat16", "BF16"),
  "fp16": (np.float16, "float16", "F16"),
}
HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"
_IGNORED = ("rotary_emb.inv_freq",)  # buffers some older checkpoints carry; recomputed here


def axis_sizes(c: LlamaConfig) -> dict:
  """The sizes of the names the layout patterns use (`hk`, `gk`: a projection's bias, flat)."""
  return {
    "v": c.vocab,
    "d": c.dim,
    "h": c.heads,
    "g": c.kv_heads,
    "k": c.head_dim,
    "f": c.mlp,
    "hk": c.heads * c.head_dim,
    "gk": c.kv_heads * c.head_dim,
  }


def _layer_map(c: LlamaConfig) -> dict:
  """Per-layer HF tensor suffix -> (our path, layout pattern: HF axes -> ours, hf/layout.py)."""
  family = {}
  if c.qkv_bias:  # Qwen2's: stored flat, as HF does
    family = {
      f"self_attn.{x}_proj.bias": (("attn", f"b{x}"), f"{n} -> {n}")
      for x, n in (("q", "hk"), ("k", "gk"), ("v", "gk"))
    }
  if c.qk_norm:  # Qwen3's: one scale over head_dim, shared by the heads
    family = {
      f"self_attn.{x}_norm.weight": (("attn", f"{x}_norm", "scale"), "k -> k") for x in "qk"
    }
  return {
    **family,
    "self_attn.q_proj.weight": (("attn", "wq"), "(h k) d -> d h k"),
    "self_attn.k_proj.weight": (("attn", "wk"), "(g k) d -> d g k"),
    "self_attn.v_proj.weight": (("attn", "wv"), "(g k) d -> d g k"),
    "self_attn.o_proj.weight": (("attn", "wo"), "d (h k) -> h k d"),
    "mlp.gate_proj.weight": (("mlp", "w_gate"), "f d -> d f"),
    "mlp.up_proj.weight": (("mlp", "w_up"), "f d -> d f"),
    "mlp.down_proj.weight": (("mlp", "w_down"), "d f -> f d"),
    "input_layernorm.weight": (("attn_norm", "scale"), "d -> d"),
    "post_attention_layernorm.weight": (("mlp_norm", "scale"), "d -> d"),
  }


def _global_map(c: LlamaConfig) -> dict:
  """HF tensor name -> (our path, layout pattern) outside the layer stack. A tied model has no
  lm_head.weight: transformers saves the shared table once, as the embedding."""
  tensors = {
    EMBEDDING: (("embed", "embedding"), "v d -> v d"),
    "model.norm.weight": (("head", "norm", "scale"), "d -> d"),
  }
  if not c.tie_embeddings:
    tensors[HEAD] = (("head", "kernel"), "v d -> d v")
  return tensors


def tensor_table(c: LlamaConfig) -> dict:
  """Our leaf path -> (HF name of layer i (`str.format`-ed with i; no `{}` outside the layer
  stack), parsed layout): the one description of which HF tensor each leaf is, and how."""
  table = {path: (name, parse(p)) for name, (path, p) in _global_map(c).items()}
  for suffix, (path, p) in _layer_map(c).items():
    table[(LAYERS, *path)] = (f"model.layers.{{}}.{suffix}", parse(p))
  return table


# --- weights ---------------------------------------------------------------------------------
def unreadable(path: str, e: Exception) -> Exception:
  """safetensors' error on a damaged file (SafetensorError, a bad header or a short file, is no
  ValueError) as one clear ValueError; an OSError stays what it is."""
  if isinstance(e, OSError):
    return e
  why = str(e).splitlines()[0] if str(e) else type(e).__name__
  return ValueError(
    f"{path} is not a readable safetensors file ({why}): it is damaged or incomplete; "
    f"download or export it again"
  )


def _load_file(path: str) -> dict[str, np.ndarray]:
  try:
    return load_file(path)
  except Exception as e:  # noqa: BLE001 - said by unreadable()
    raise unreadable(path, e) from None


def weight_files(directory: str) -> list[str]:
  """The safetensors files of an HF directory: model.safetensors, or the shards its index lists
  (each must be there)."""
  single, index = os.path.join(directory, WEIGHTS), os.path.join(directory, INDEX)
  if os.path.isfile(single):
    return [single]
  if os.path.isfile(index):
    with open(index) as f:
      weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict):
      raise ValueError(f"{index} has no weight_map")
    files = []
    for shard in sorted(set(weight_map.values())):
      path = os.path.join(directory, shard)
      if not os.path.isfile(path):
        raise FileNotFoundError(f"{index} lists shard {shard}, which is missing from {directory}")
      files.append(path)
    return files
  others = [n for n in os.listdir(directory) if n.endswith((".bin", ".pt", ".pth"))]
  hint = (
    f" (it holds {', '.join(sorted(others))}: convert them to safetensors first)" if others else ""
  )
  raise FileNotFoundError(f"{directory} has neither {WEIGHTS} nor {INDEX}{hint}")


def tied_head_differs(directory: str) -> ValueError:
  # Some tied checkpoints store the shared table twice; it must then be the same table.
  return ValueError(
    f"{directory}: tie_word_embeddings is true but {HEAD} differs from {EMBEDDING}: set "
    f"tie_word_embeddings to false in its config.json to load them as two tables"
  )


def check_tensors(cfg: LlamaConfig, shapes: dict, where: str) -> None:
  """Every tensor the config implies is there (`shapes`: HF name -> shape, as stored), in its
  shape, and no other (but a tied model's second copy of its table, and ignored buffers)."""
  sizes, left = axis_sizes(cfg), dict(shapes)
  if cfg.tie_embeddings:
    left.pop(HEAD, None)
  for name, axes in tensor_table(cfg).values():
    want = hf_shape(axes, sizes)
    for each in [name.format(i) for i in range(cfg.layers)] if "{}" in name else [name]:
      if each not in left:
        raise ValueError(f"{where}: tensor {each} is missing")
      if tuple(left.pop(each)) != want:
        raise ValueError(
          f"{where}: tensor {each} has shape {tuple(shapes[each])}, but config.json implies {want}"
        )
  extra = sorted(n for n in left if not n.endswith(_IGNORED))
  if extra:
    raise ValueError(
      f"{where}: unexpected tensor(s) {', '.join(extra[:8])}"
      f"{' ...' if len(extra) > 8 else ''} (is num_hidden_layers right?)"
    )


def non_finite_counts(w: np.ndarray) -> tuple[int, int, tuple | None]:
  """(NaN count, Inf count, index of the first of either or None) of an array."""
  finite = np.isfinite(w)
  if finite.all():
    return 0, 0, None
  nan, first = int(np.isnan(w).sum()), np.unravel_index(int(np.argmin(finite)), w.shape)
  return nan, w.size - int(finite.sum()) - nan, tuple(int(i) for i in first)


def non_finite(name: str, where: str, nan: int, inf: int, first: tuple) -> ValueError:
  # Checked as loaded: a NaN in a row the data rarely touches would train on unseen and
  # make every checkpoint unsavable; one in a weight used every step would read as divergence.
  return ValueError(
    f"{where}: tensor {name} holds {nan} NaN and {inf} Inf values (the first at index "
    f"{first}): these weights are damaged; download or export them again"
  )


def check_finite(w: np.ndarray, name: str, where: str) -> None:
  """Refuse tensor `name` holding NaN or Inf, naming the first by its index."""
  nan, inf, first = non_finite_counts(w)
  if first is not None:
    raise non_finite(name, where, nan, inf, first)


def put(tree: dict, path: tuple, value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _get(tree: dict, path: tuple):
  for key in path:
    tree = tree[key]
  return tree


def load_hf(directory: str) -> tuple[LlamaConfig, dict]:
  """(config, fp32 parameter tree as numpy arrays) of a local HF LLaMA directory, read whole
  (hf/stream.py `import_hf` places it on a mesh a slice at a time)."""
  cfg = read_config(directory)
  tensors: dict = {}
  for path in weight_files(directory):
    tensors.update(_load_file(path))
  check_tensors(cfg, {n: w.shape for n, w in tensors.items()}, directory)
  if cfg.tie_embeddings and HEAD in tensors:
    if not np.array_equal(tensors.pop(HEAD), tensors[EMBEDDING]):
      raise tied_head_differs(directory)
  params: dict = {}
  sizes = axis_sizes(cfg)
  for path, (name, axes) in tensor_table(cfg).items():
    names = [name.format(i) for i in range(cfg.layers)] if path[0] == LAYERS else [name]
    stack = []
    for each in names:
      w = np.asarray(tensors.pop(each), np.float32)
      check_finite(w, each, directory)
      stack.append(to_ours(w, axes, sizes))
    put(params, path, np.stack(stack) if path[0] == LAYERS else stack[0])
  return cfg, params


def expected_shapes(cfg: LlamaConfig) -> dict:
  """Our parameter tree's shapes for `cfg`, as tuples."""
  shapes: dict = {}
  for path, (_, axes) in tensor_table(cfg).items():
    shape = our_shape(axes, axis_sizes(cfg))
    put(shapes, path, (cfg.layers, *shape) if path[0] == LAYERS else shape)
  return shapes


def weights_dtype(directory: str) -> str | None:
  """The dtype an HF directory's weights are stored in ("bf16", "fp16", "fp32"), as the
  safetensors header gives the embedding table's; None if it cannot be read or is another."""
  single, index = os.path.join(directory, WEIGHTS), os.path.join(directory, INDEX)
  try:
    path = single
    if not os.path.isfile(single):
      with open(index) as f:
        path = os.path.join(directory, json.load(f)["weight_map"][EMBEDDING])
    with safe_open(path, framework="numpy") as f:
      stored = f.get_slice(EMBEDDING).get_dtype()
  except Exception:  # noqa: BLE001 - missing, damaged or another layout: unknown
    return None
  return next((name for name, (_, _, header) in WEIGHT_DTYPES.items() if header == stored), None)


def write_config(cfg: LlamaConfig, directory: str, base_config: dict | None, dtype: str) -> None:
  """config.json of a model of `cfg` whose weights are in `dtype`: `base_config`'s fields (the
  config.json the model came from) with ours over them."""
  torch_name = WEIGHT_DTYPES[dtype][1]
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, CONFIG), "w") as f:
    config = {**(base_config or {}), **config_to_hf(cfg), "torch_dtype": torch_name}
    if "dtype" in config:  # newer transformers' name for torch_dtype
      config["dtype"] = torch_name
    json.dump(config, f, indent=2)
    f.write("\n")


def save_hf(
  cfg: LlamaConfig,
  params: dict,
  directory: str,
  base_config: dict | None = None,
  dtype: str = "fp32",
  max_shard_size: int | str = MAX_SHARD_SIZE,
) -> str:
  """Write `params` (our tree, any array type) as an HF LlamaForCausalLM directory, its tensors
  in `dtype` (a key of WEIGHT_DTYPES), in shards of at most `max_shard_size` (bytes, or "5GB"-style
  with KB/MB/GB/TB) with their index when they do not fit one. `base_config`: the config.json
  the model came from; the fields we do not set (bos_token_id, eos_token_id,
  max_position_embeddings, ...) are kept."""
  if dtype not in WEIGHT_DTYPES:
    raise ValueError(
      f"unknown dtype {dtype!r} for the HF weights; choose one of {list(WEIGHT_DTYPES)}"
    )
  np_dtype = WEIGHT_DTYPES[dtype][0]
  tensors, shapes = {}, expected_shapes(cfg)

  def fetch(path):
    try:
      w = np.asarray(_get(params, path), np.float32)
    except (KeyError, TypeError) as e:
      raise ValueError(f"params has no {'/'.join(path)}") from e
    want = _get(shapes, path)
    if w.shape != tuple(want):
      raise ValueError(
        f"params {'/'.join(path)} has shape {w.shape}, but the config implies {tuple(want)}"
      )
    return w

  sizes = axis_sizes(cfg)
  for path, (name, axes) in tensor_table(cfg).items():
    w = fetch(path)
    for i, layer in enumerate(w) if path[0] == LAYERS else [(None, w)]:
      hf = to_hf(layer, axes, sizes).astype(np_dtype)
      tensors[name.format(i) if i is not None else name] = np.ascontiguousarray(hf)
  try:
    split = split_state_dict_into_shards_factory(
      tensors,
      get_storage_size=lambda w: w.nbytes,
      filename_pattern=SHARDS,
      max_shard_size=max_shard_size,
    )
  except ValueError as e:  # huggingface_hub's parse of "5GB"
    raise ValueError(
      f"--max-shard-size {max_shard_size!r}: {e} (e.g. 5GB, 500MB, or a number of bytes)"
    ) from None
  write_config(cfg, directory, base_config, dtype)
  # safetensors creates its files 0600; readable like config.json beside them (the umask applies).
  umask = os.umask(0)
  os.umask(umask)
  for file, names in split.filename_to_tensors.items():
    path = os.path.join(directory, file)
    save_file({n: tensors[n] for n in names}, path, metadata={"format": "pt"})
    os.chmod(path, 0o666 & ~umask)
  if split.is_sharded:
    with open(os.path.join(directory, INDEX), "w") as f:
      json.dump({"metadata": split.metadata, "weight_map": split.tensor_to_filename}, f, indent=2)
      f.write("\n")
  return directory
