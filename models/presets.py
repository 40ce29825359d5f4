"""The model presets (`tiny` and `small` for runs on CPU, the Llama 1/2/3.x, Qwen2.5/3 and Mistral
shapes as their HF config.json files give them) and `get_config`, which takes a preset's name or
an HF `config.json`. Pure Python (no jax), like models/config.py."""

from __future__ import annotations

import os

from models.config import LlamaConfig, RopeScaling
from models.hf_config import read_config


def _llama3(dim: int, layers: int, heads: int, mlp: int, factor: float, tied: bool = False):
  """A Llama 3.1/3.2 shape: vocabulary 128,256, 8 KV heads, RoPE theta 500,000 with the llama3
  scaling (low 1, high 4, from 8,192 positions), RMSNorm eps 1e-5."""
  return LlamaConfig(
    vocab=128_256,
    dim=dim,
    layers=layers,
    heads=heads,
    kv_heads=8,
    head_dim=dim // heads,
    mlp=mlp,
    rope_theta=500_000.0,
    norm_eps=1e-5,
    rope_scaling=RopeScaling("llama3", factor, 1.0, 4.0, 8192),
    tie_embeddings=tied,
  )


def _qwen(family: str, dim: int, layers: int, heads: int, kv_heads: int, mlp: int, **kw):
  """A Qwen2.5 or Qwen3 shape as its HF config.json gives it: head dim 128, RoPE theta
  1,000,000, RMSNorm eps 1e-6, vocabulary 151,936 unless given."""
  return LlamaConfig(
    vocab=kw.pop("vocab", 151_936),
    dim=dim,
    layers=layers,
    heads=heads,
    kv_heads=kv_heads,
    head_dim=128,
    mlp=mlp,
    rope_theta=1_000_000.0,
    norm_eps=1e-6,
    family=family,
    **kw,
  )


PRESETS: dict[str, LlamaConfig] = {
  # ~1.05M parameters: tests and quick starts.
  "tiny": LlamaConfig(vocab=256, dim=128, layers=4, heads=4, kv_heads=2, head_dim=32, mlp=512),
  # ~25M parameters: CPU benchmarks.
  "small": LlamaConfig(vocab=256, dim=512, layers=8, heads=8, kv_heads=4, head_dim=64, mlp=1536),
  # The LLaMA-1 shapes (Touvron et al., 2023), for the inspector and planning.
  "7b": LlamaConfig(
    vocab=32000, dim=4096, layers=32, heads=32, kv_heads=32, head_dim=128, mlp=11008, norm_eps=1e-6
  ),
  "13b": LlamaConfig(
    vocab=32000, dim=5120, layers=40, heads=40, kv_heads=40, head_dim=128, mlp=13824, norm_eps=1e-6
  ),
  "65b": LlamaConfig(
    vocab=32000, dim=8192, layers=80, heads=64, kv_heads=64, head_dim=128, mlp=22016, norm_eps=1e-5
  ),
  # The Llama 3.1 and 3.2 shapes, as their HF config.json files give them (meta-llama/Llama-3.1-8B
  # and so on; Llama 3.3 70B is 3.1 70B's): 8.03B, 70.55B, 405.85B, 1.24B, 3.21B parameters.
  "llama3.1-8b": _llama3(dim=4096, layers=32, heads=32, mlp=14336, factor=8.0),
  "llama3.1-70b": _llama3(dim=8192, layers=80, heads=64, mlp=28672, factor=8.0),
  "llama3.1-405b": _llama3(dim=16384, layers=126, heads=128, mlp=53248, factor=8.0),
  "llama3.2-1b": _llama3(dim=2048, layers=16, heads=32, mlp=8192, factor=32.0, tied=True),
  "llama3.2-3b": _llama3(dim=3072, layers=28, heads=24, mlp=8192, factor=32.0, tied=True),
  # Qwen/Qwen3-0.6B, -8B, -32B and Qwen/Qwen2.5-7B as their config.json files give them:
  # 0.60B (tied), 8.19B, 32.76B, 7.62B parameters.
  "qwen3-0.6b": _qwen("qwen3", 1024, 28, 16, 8, 3072, tie_embeddings=True),
  "qwen3-8b": _qwen("qwen3", 4096, 36, 32, 8, 12288),
  "qwen3-32b": _qwen("qwen3", 5120, 64, 64, 8, 25600),
  "qwen2.5-7b": _qwen("qwen2", 3584, 28, 28, 4, 18944, vocab=152_064),
  # mistralai/Mistral-7B-v0.3 (v0.1's sliding window of 4096 is gone since v0.2): 7.25B.
  "mistral-7b": LlamaConfig(
    vocab=32768,
    dim=4096,
    layers=32,
    heads=32,
    kv_heads=8,
    head_dim=128,
    mlp=14336,
    rope_theta=1_000_000.0,
    norm_eps=1e-5,
    family="mistral",
  ),
}


# Not listed in help or errors: a model that compiles and trains in moments, for tests.
HIDDEN_PRESETS: dict[str, LlamaConfig] = {
  "test": LlamaConfig(vocab=256, dim=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp=64),
}


def get_config(name: str) -> LlamaConfig:
  """A preset by name, or the shapes of an HF LLaMA `config.json` (the file or its directory;
  no weights are read: the model starts from scratch)."""
  if name in HIDDEN_PRESETS:
    return HIDDEN_PRESETS[name]
  if name in PRESETS:
    return PRESETS[name]
  if os.path.isdir(name) or (name.endswith(".json") and os.path.isfile(name)):
    return read_config(name)
  if name.endswith(".json") or os.sep in name:
    exists = os.path.exists(name)
    what = "is not a .json file nor a directory" if exists else "does not exist"
    raise (ValueError if exists else FileNotFoundError)(
      f"--model {name} {what}: give an HF LLaMA config.json (or its directory), or a "
      f"preset: {', '.join(PRESETS)}"
    )
  raise ValueError(
    f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}, or give the path of an "
    f"HF LLaMA config.json"
  )
