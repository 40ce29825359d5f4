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

from models.config import (
  CONFIG,
  LAYERS,
  LlamaConfig,
  config_to_hf,
  read_config,
)

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


def _layer_map(c: LlamaConfig) -> dict:
  """Per-layer HF tensor suffix -> (our path, HF shape, HF -> ours, ours -> HF)."""
  D, H, G, K, F = c.dim, c.heads, c.kv_heads, c.head_dim, c.mlp
  split = lambda n: (lambda w: w.T.reshape(D, n, K), lambda w: w.reshape(D, n * K).T)
  t = (lambda w: w.T, lambda w: w.T)
  same = (lambda w: w, lambda w: w)
  family = {}
  if c.qkv_bias:  # Qwen2's: stored flat, as HF does
    family = {
      f"self_attn.{x}_proj.bias": (("attn", f"b{x}"), (n * K,), *same)
      for x, n in (("q", H), ("k", G), ("v", G))
    }
  if c.qk_norm:  # Qwen3's: one scale over head_dim, shared by the heads
    family = {
      f"self_attn.{x}_norm.weight": (("attn", f"{x}_norm", "scale"), (K,), *same) for x in "qk"
    }
  return {
    **family,
    "self_attn.q_proj.weight": (("attn", "wq"), (H * K, D), *split(H)),
    "self_attn.k_proj.weight": (("attn", "wk"), (G * K, D), *split(G)),
    "self_attn.v_proj.weight": (("attn", "wv"), (G * K, D), *split(G)),
    "self_attn.o_proj.weight": (
      ("attn", "wo"),
      (D, H * K),
      lambda w: w.T.reshape(H, K, D),
      lambda w: w.reshape(H * K, D).T,
    ),
    "mlp.gate_proj.weight": (("mlp", "w_gate"), (F, D), *t),
    "mlp.up_proj.weight": (("mlp", "w_up"), (F, D), *t),
    "mlp.down_proj.weight": (("mlp", "w_down"), (D, F), *t),
    "input_layernorm.weight": (("attn_norm", "scale"), (D,), *same),
    "post_attention_layernorm.weight": (("mlp_norm", "scale"), (D,), *same),
  }


def _global_map(c: LlamaConfig) -> dict:
  """HF tensor name -> (our path, HF shape, HF -> ours, ours -> HF) outside the layer stack. A
  tied model has no lm_head.weight: transformers saves the shared table once, as the embedding."""
  tensors = {
    EMBEDDING: (
      ("embed", "embedding"),
      (c.vocab, c.dim),
      lambda w: w,
      lambda w: w,
    ),
    "model.norm.weight": (("head", "norm", "scale"), (c.dim,), lambda w: w, lambda w: w),
  }
  if not c.tie_embeddings:
    tensors[HEAD] = (("head", "kernel"), (c.vocab, c.dim), lambda w: w.T, lambda w: w.T)
  return tensors


# --- weights ---------------------------------------------------------------------------------
def _load_file(path: str) -> dict[str, np.ndarray]:
  """safetensors' load_file, with a damaged file as one clear ValueError."""
  try:
    return load_file(path)
  except Exception as e:  # SafetensorError (a bad header, a short file) is no ValueError
    if isinstance(e, OSError):
      raise
    why = str(e).splitlines()[0] if str(e) else type(e).__name__
    raise ValueError(
      f"{path} is not a readable safetensors file ({why}): it is damaged or incomplete; "
      f"download or export it again"
    ) from None


def _read_tensors(directory: str) -> dict[str, np.ndarray]:
  single, index = os.path.join(directory, WEIGHTS), os.path.join(directory, INDEX)
  if os.path.isfile(single):
    return _load_file(single)
  if os.path.isfile(index):
    with open(index) as f:
      weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict):
      raise ValueError(f"{index} has no weight_map")
    tensors = {}
    for shard in sorted(set(weight_map.values())):
      path = os.path.join(directory, shard)
      if not os.path.isfile(path):
        raise FileNotFoundError(f"{index} lists shard {shard}, which is missing from {directory}")
      tensors.update(_load_file(path))
    return tensors
  others = [n for n in os.listdir(directory) if n.endswith((".bin", ".pt", ".pth"))]
  hint = (
    f" (it holds {', '.join(sorted(others))}: convert them to safetensors first)" if others else ""
  )
  raise FileNotFoundError(f"{directory} has neither {WEIGHTS} nor {INDEX}{hint}")


def _take(tensors: dict, name: str, shape: tuple, where: str) -> np.ndarray:
  if name not in tensors:
    raise ValueError(f"{where}: tensor {name} is missing")
  w = tensors.pop(name)
  if tuple(w.shape) != tuple(shape):
    raise ValueError(
      f"{where}: tensor {name} has shape {tuple(w.shape)}, but config.json implies {tuple(shape)}"
    )
  w = np.asarray(w, np.float32)
  finite = np.isfinite(w)
  if not finite.all():
    # Checked as loaded: a NaN in a row the data rarely touches would train on unseen and
    # make every checkpoint unsavable; one in a weight used every step would read as divergence.
    nan, first = int(np.isnan(w).sum()), np.unravel_index(int(np.argmin(finite)), w.shape)
    raise ValueError(
      f"{where}: tensor {name} holds {nan} NaN and {w.size - int(finite.sum()) - nan} Inf "
      f"values (the first at index {tuple(int(i) for i in first)}): these weights are damaged; "
      f"download or export them again"
    )
  return w


def _put(tree: dict, path: tuple, value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _get(tree: dict, path: tuple):
  for key in path:
    tree = tree[key]
  return tree


def load_hf(directory: str) -> tuple[LlamaConfig, dict]:
  """(config, fp32 parameter tree as numpy arrays) of a local HF LLaMA directory."""
  cfg = read_config(directory)
  tensors = _read_tensors(directory)
  if cfg.tie_embeddings and HEAD in tensors:
    # Some tied checkpoints store the shared table twice; it must then be the same table.
    head = tensors.pop(HEAD)
    if EMBEDDING in tensors and not np.array_equal(head, tensors[EMBEDDING]):
      raise ValueError(
        f"{directory}: tie_word_embeddings is true but {HEAD} differs from {EMBEDDING}: set "
        f"tie_word_embeddings to false in its config.json to load them as two tables"
      )
  params: dict = {}
  for name, (path, shape, to_ours, _) in _global_map(cfg).items():
    _put(params, path, to_ours(_take(tensors, name, shape, directory)))
  for suffix, (path, shape, to_ours, _) in _layer_map(cfg).items():
    stack = [
      to_ours(_take(tensors, f"model.layers.{i}.{suffix}", shape, directory))
      for i in range(cfg.layers)
    ]
    _put(params, (LAYERS, *path), np.stack(stack))
  extra = sorted(n for n in tensors if not n.endswith(_IGNORED))
  if extra:
    raise ValueError(
      f"{directory}: unexpected tensor(s) {', '.join(extra[:8])}"
      f"{' ...' if len(extra) > 8 else ''} (is num_hidden_layers right?)"
    )
  return cfg, params


def expected_shapes(cfg: LlamaConfig) -> dict:
  """Our parameter tree's shapes for `cfg`, as tuples."""
  shapes: dict = {}
  for path, shape, to_ours, _ in _global_map(cfg).values():
    _put(shapes, path, to_ours(np.empty(shape, np.float32)).shape)
  for path, shape, to_ours, _ in _layer_map(cfg).values():
    _put(shapes, (LAYERS, *path), (cfg.layers, *to_ours(np.empty(shape, np.float32)).shape))
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
  np_dtype, torch_name, _ = WEIGHT_DTYPES[dtype]
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

  for name, (path, _, _, to_hf) in _global_map(cfg).items():
    tensors[name] = np.ascontiguousarray(to_hf(fetch(path)).astype(np_dtype))
  for suffix, (path, _, _, to_hf) in _layer_map(cfg).items():
    stack = fetch((LAYERS, *path))
    for i in range(cfg.layers):
      tensors[f"model.layers.{i}.{suffix}"] = np.ascontiguousarray(to_hf(stack[i]).astype(np_dtype))
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
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, CONFIG), "w") as f:
    config = {**(base_config or {}), **config_to_hf(cfg), "torch_dtype": torch_name}
    if "dtype" in config:  # newer transformers' name for torch_dtype
      config["dtype"] = torch_name
    json.dump(config, f, indent=2)
    f.write("\n")
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
