"""Random bf16 HF directories of real model shapes (Llama 3.2 1B and 3B, Llama 3.1 8B), for the
real-size measurements (experiments/model_io.py, experiments/model_io_limits.py); never committed.

  python experiments/model_io.py make --dir /tmp/llama1b --shape 1b
"""

from __future__ import annotations

import json
import os

from models.presets import get_config

# Each shape's model, as the project's registry (models/presets.py) defines it.
SHAPES = {"1b": "llama3.2-1b", "3b": "llama3.2-3b", "8b": "llama3.1-8b"}
SHARD_BYTES = 2 * 2**30  # a new safetensors file after this many bytes (bf16)


def shape_config(shape: str) -> dict:
  """config.json of a `make` directory of `shape` (a key of SHAPES)."""
  c = get_config(SHAPES[shape])
  return {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": c.vocab,
    "num_key_value_heads": c.kv_heads,
    "hidden_size": c.dim,
    "num_hidden_layers": c.layers,
    "num_attention_heads": c.heads,
    "head_dim": c.head_dim,
    "intermediate_size": c.mlp,
    "tie_word_embeddings": c.tie_embeddings,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
  }


def hf_tensors(config: dict) -> dict:
  """Every HF tensor's name and shape, in the order a checkpoint stores them."""
  d, f, k = config["hidden_size"], config["intermediate_size"], config["head_dim"]
  h, g = config["num_attention_heads"], config["num_key_value_heads"]
  layer = {
    "self_attn.q_proj.weight": (h * k, d),
    "self_attn.k_proj.weight": (g * k, d),
    "self_attn.v_proj.weight": (g * k, d),
    "self_attn.o_proj.weight": (d, h * k),
    "mlp.gate_proj.weight": (f, d),
    "mlp.up_proj.weight": (f, d),
    "mlp.down_proj.weight": (d, f),
    "input_layernorm.weight": (d,),
    "post_attention_layernorm.weight": (d,),
  }
  names = {"model.embed_tokens.weight": (config["vocab_size"], d)}
  for i in range(config["num_hidden_layers"]):
    names |= {f"model.layers.{i}.{n}": s for n, s in layer.items()}
  names["model.norm.weight"] = (d,)
  if not config["tie_word_embeddings"]:
    names["lm_head.weight"] = (config["vocab_size"], d)
  return names


def make(directory: str, shape: str = "1b", seed: int = 0) -> None:
  """The random bf16 directory of `shape`, in safetensors files of about SHARD_BYTES, written
  one file at a time."""
  import ml_dtypes
  import numpy as np
  from safetensors.numpy import save_file

  config = shape_config(shape)
  shards, size = [{}], 0
  for name, s in hf_tensors(config).items():
    if size and size + 2 * np.prod(s) > SHARD_BYTES:
      shards, size = shards + [{}], 0
    shards[-1][name], size = s, size + 2 * int(np.prod(s))
  os.makedirs(directory, exist_ok=True)
  rng, weight_map = np.random.default_rng(seed), {}
  for n, names in enumerate(shards, 1):
    file = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
    tensors = {
      name: (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
      for name, shape in names.items()
    }
    save_file(tensors, os.path.join(directory, file), metadata={"format": "pt"})
    weight_map |= {name: file for name in names}
    del tensors
  with open(os.path.join(directory, "model.safetensors.index.json"), "w") as out:
    json.dump({"metadata": {}, "weight_map": weight_map}, out)
  with open(os.path.join(directory, "config.json"), "w") as out:
    json.dump(config, out, indent=2)
