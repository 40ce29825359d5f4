"""An HF model directory's `config.json` to and from our `LlamaConfig`: Llama, Qwen2/2.5, Qwen3 and
Mistral, in transformers 4's and 5's spellings of RoPE; anything we cannot run is refused in one
line. Pure Python (no jax), like models/config.py."""

from __future__ import annotations

import json
import os

from models.config import FAMILIES, ROPE_SCALINGS, LlamaConfig, RopeScaling

CONFIG = "config.json"  # an HF model directory's config file

# transformers' LlamaConfig defaults for fields a config.json may leave out.
HF_DEFAULT_THETA, HF_DEFAULT_MAX_POSITIONS = 10_000.0, 2048


def config_from_hf(hf: dict, where: str = CONFIG) -> LlamaConfig:
  """Our LlamaConfig for an HF LLaMA config.json (as a dict); anything we cannot run is an error.

  RoPE is read in both spellings, as transformers 5 reads them (PreTrainedConfig's
  convert_rope_params_to_dict and standardize_rope_params): transformers 4's `rope_scaling` (with
  `rope_type`, or the older `type`) and top-level `rope_theta`, or transformers 5's
  `rope_parameters` (which holds `rope_theta`); `rope_scaling` wins where both are given."""

  def refuse(why):
    raise ValueError(f"{where}: unsupported HF config: {why}")

  if not isinstance(hf, dict):
    refuse(f"a JSON {type(hf).__name__}, not an object of fields (vocab_size, hidden_size, ...)")
  family = _family_from_hf(hf, refuse)
  missing = [
    k
    for k in (
      "vocab_size",
      "hidden_size",
      "num_hidden_layers",
      "num_attention_heads",
      "intermediate_size",
    )
    if k not in hf
  ]
  if missing:
    refuse(f"missing field(s) {', '.join(missing)}")
  if hf.get("hidden_act", "silu") != "silu":
    refuse(f"hidden_act {hf['hidden_act']!r}; our MLP is SwiGLU (silu)")
  theta, scaling = _rope_from_hf(hf, refuse)
  heads, dim = hf["num_attention_heads"], hf["hidden_size"]
  head_dim = hf.get("head_dim")
  if head_dim is None:
    if dim % heads:
      refuse(
        f"hidden_size {dim} is not a multiple of num_attention_heads {heads} and no "
        f"head_dim is given"
      )
    head_dim = dim // heads
  kv_heads = hf.get("num_key_value_heads") or heads
  try:
    return LlamaConfig(
      vocab=hf["vocab_size"],
      dim=dim,
      layers=hf["num_hidden_layers"],
      heads=heads,
      kv_heads=kv_heads,
      head_dim=head_dim,
      mlp=hf["intermediate_size"],
      rope_theta=theta,
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      init_std=float(hf.get("initializer_range", 0.02)),
      rope_scaling=scaling,
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      family=family,
      sliding_window=_sliding_window_from_hf(hf, family, refuse),
    )
  except ValueError as e:
    refuse(str(e))


def _family_from_hf(hf: dict, refuse) -> str:
  """The family (a key of FAMILIES) of an HF config; other architectures and the fields of a
  supported one that our model lacks are refused, by name."""
  family, archs = hf.get("model_type", "llama"), hf.get("architectures") or []
  if family not in FAMILIES or (archs and FAMILIES[family] not in archs):
    supported = ", ".join(f"{t} ({a})" for t, a in FAMILIES.items())
    refuse(f"model_type {family!r}, architectures {archs}: supported are {supported}")
  # Llama's attention_bias puts biases on o_proj too, Qwen3's as well; Qwen2's q/k/v biases
  # are built into its attention (no field).
  for key in ("attention_bias", "mlp_bias"):
    if hf.get(key, False):
      refuse(f"{key} is true; our {family} model has no such biases")
  return family


def _sliding_window_from_hf(hf: dict, family: str, refuse) -> int | None:
  """Mistral's sliding_window (None: none); Qwen's sliding layers are refused. Qwen2/3 keep a
  sliding_window that transformers uses only with use_sliding_window (in transformers 5, for the
  layers layer_types names sliding_attention): with neither it is ignored, as there."""
  if family == "mistral":  # transformers' Mistral reads no layer_types: every layer slides
    window = hf.get("sliding_window")
    return None if window is None else int(window)
  layer_types = hf.get("layer_types") or []
  if hf.get("use_sliding_window", False):
    refuse("use_sliding_window is true; only full attention is supported for " + family)
  if any(t != "full_attention" for t in layer_types):
    refuse(
      f"layer_types {sorted(set(layer_types))}: only full_attention layers are supported for "
      f"{family}"
    )
  return None  # (transformers' Llama reads no sliding_window either)


def _rope_from_hf(hf: dict, refuse) -> tuple[float, RopeScaling | None]:
  """(rope_theta, scaling) of an HF config; a RoPE type we do not run is refused, by name."""
  rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
  spelling = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
  if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
    refuse(f"{spelling} {rope}: only one RoPE for every layer is supported")
  kind = rope.get("rope_type", rope.get("type", "default"))
  theta = float(rope.get("rope_theta", hf.get("rope_theta", HF_DEFAULT_THETA)))
  partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
  if partial != 1.0:
    refuse(f"partial_rotary_factor {partial}; only RoPE over the whole head is supported")
  if kind == "default":
    return theta, None
  if kind not in ROPE_SCALINGS:
    refuse(
      f"RoPE type {kind!r} ({spelling} {rope}); supported: default, {', '.join(ROPE_SCALINGS)}"
    )
  needed = ("factor",) + (("low_freq_factor", "high_freq_factor") if kind == "llama3" else ())
  if absent := [k for k in needed if rope.get(k) is None]:
    refuse(f"{spelling} of RoPE type {kind!r} has no {', '.join(absent)}")
  if kind == "linear":
    return theta, RopeScaling("linear", float(rope["factor"]))
  # transformers falls back to the top-level field, then to max_position_embeddings
  original = rope.get(
    "original_max_position_embeddings",
    hf.get(
      "original_max_position_embeddings",
      hf.get("max_position_embeddings", HF_DEFAULT_MAX_POSITIONS),
    ),
  )
  try:
    return theta, RopeScaling(
      "llama3",
      float(rope["factor"]),
      float(rope["low_freq_factor"]),
      float(rope["high_freq_factor"]),
      int(original),
    )
  except ValueError as e:
    refuse(str(e))


def rope_to_hf(c: LlamaConfig) -> dict:
  """The RoPE fields of an HF config.json, in both spellings, so that transformers 4
  (`rope_theta`, `rope_scaling`) and 5 (`rope_parameters`) read the same RoPE."""
  s = c.rope_scaling
  scaling = None
  if s is not None:
    scaling = {"rope_type": s.kind, "factor": s.factor}
    if s.kind == "llama3":
      scaling.update(
        low_freq_factor=s.low_freq_factor,
        high_freq_factor=s.high_freq_factor,
        original_max_position_embeddings=s.original_max_position_embeddings,
      )
  return {
    "rope_theta": c.rope_theta,
    "rope_scaling": scaling,
    "rope_parameters": {"rope_type": "default", **(scaling or {}), "rope_theta": c.rope_theta},
  }


def config_to_hf(c: LlamaConfig) -> dict:
  """The config.json of our model's family (LlamaForCausalLM, Qwen2ForCausalLM, ...) with its
  shapes, as transformers writes it."""
  return {
    "architectures": [FAMILIES[c.family]],
    "model_type": c.family,
    "vocab_size": c.vocab,
    "hidden_size": c.dim,
    "num_hidden_layers": c.layers,
    "num_attention_heads": c.heads,
    "num_key_value_heads": c.kv_heads,
    "head_dim": c.head_dim,
    "intermediate_size": c.mlp,
    "hidden_act": "silu",
    "rms_norm_eps": c.norm_eps,
    **rope_to_hf(c),
    **_family_fields_to_hf(c),
    "tie_word_embeddings": c.tie_embeddings,
    "initializer_range": c.init_std,
    "torch_dtype": "float32",
  }


def _family_fields_to_hf(c: LlamaConfig) -> dict:
  """The fields of config.json that differ by family, as their configs spell them."""
  if c.family == "mistral":
    return {"sliding_window": c.sliding_window}
  qwen = {"use_sliding_window": False, "layer_types": ["full_attention"] * c.layers}
  return {
    "llama": {"attention_bias": False, "mlp_bias": False},
    "qwen2": qwen,
    "qwen3": {**qwen, "attention_bias": False},
  }[c.family]


def read_config(directory: str) -> LlamaConfig:
  """Only the model config of an HF LLaMA directory, or of its config.json (no weights)."""
  if os.path.isfile(directory) and directory.endswith(".json"):
    path = directory
  else:
    path = os.path.join(check_hf_dir(directory), CONFIG)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{directory} has no {CONFIG}: not an HF model directory")
  try:
    with open(path) as f:
      hf = json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path} is not valid JSON: {e}") from e
  return config_from_hf(hf, path)


def check_hf_dir(directory: str) -> str:
  """The directory, if it is one; else an error saying what an HF model directory holds."""
  if not os.path.isdir(directory):
    raise FileNotFoundError(
      f"HF model directory {directory} does not exist (or is not a "
      f"directory); pass a local directory holding config.json and "
      f"model.safetensors"
    )
  return directory
