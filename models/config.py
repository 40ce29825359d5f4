"""The model's configuration: `LlamaConfig`, the presets, the mapping to and from an HF
`config.json` (Llama, Qwen2/2.5, Qwen3, Mistral), and the LoRA adapters' `LoraConfig`.

Pure Python (no jax, no numpy): what the planner, the CLI's argument checks and the HF reader
need before anything is compiled. models/llama.py (the Flax model) and paro_jax/hf/weights.py
(the HF weights) both import it; it imports neither.
"""

from __future__ import annotations

import dataclasses
import json
import os

CONFIG = "config.json"  # an HF model directory's config file
# The stacked layers: the parameters' key of the layer stack (models/llama.py), and the logical
# axis its leaves are stacked on.
LAYERS = "layers"


# RoPE scalings we run, as transformers names them (`rope_type`): the reference semantics are
# transformers' modeling_rope_utils.py (`_compute_linear_scaling_rope_parameters`,
# `_compute_llama3_parameters`); models/llama.py `inverse_frequencies` computes them.
ROPE_SCALINGS = ("linear", "llama3")

# The HF decoders we run, by config.json's model_type -> its architecture. Each is the Llama
# decoder with switches (transformers' modeling_qwen2.py, modeling_qwen3.py, modeling_mistral.py):
# Qwen2/2.5 add biases to the q, k and v projections; Qwen3 drops them and RMS-normalises each
# head's queries and keys (q_norm, k_norm, over head_dim) before RoPE; Mistral is Llama's layout
# with an optional sliding window.
FAMILIES = {
  "llama": "LlamaForCausalLM",
  "qwen2": "Qwen2ForCausalLM",
  "qwen3": "Qwen3ForCausalLM",
  "mistral": "MistralForCausalLM",
}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """A RoPE frequency scaling. `linear` divides every frequency by `factor`; `llama3` (Llama
  3.1+) divides the low frequencies (wavelength above original/low_freq_factor) by `factor`,
  keeps the high ones (below original/high_freq_factor) and interpolates between the two."""

  kind: str  # one of ROPE_SCALINGS
  factor: float
  low_freq_factor: float = 1.0  # llama3 only
  high_freq_factor: float = 4.0  # llama3 only
  original_max_position_embeddings: int = 8192  # llama3 only: the pre-training context

  def __post_init__(self):
    if self.kind not in ROPE_SCALINGS:
      raise ValueError(
        f"RoPE scaling {self.kind!r} is not supported; supported: {', '.join(ROPE_SCALINGS)}"
      )
    if not self.factor > 0:
      raise ValueError(f"RoPE scaling factor must be positive, got {self.factor}")
    if self.kind == "llama3" and not (
      0 < self.low_freq_factor < self.high_freq_factor and self.original_max_position_embeddings > 0
    ):
      raise ValueError(
        f"llama3 RoPE scaling needs 0 < low_freq_factor < high_freq_factor and a positive "
        f"original_max_position_embeddings, got {self}"
      )


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  vocab: int = 256
  dim: int = 128
  layers: int = 4
  heads: int = 4
  kv_heads: int = 2
  head_dim: int = 32
  mlp: int = 512
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-5
  init_std: float = 0.02
  rope_scaling: RopeScaling | None = None  # None: plain RoPE
  # The output head is the embedding table (HF's tie_word_embeddings): one parameter, two uses.
  tie_embeddings: bool = False
  family: str = "llama"  # a key of FAMILIES: the HF architecture, and its switches
  # Mistral's: each token attends to itself and the sliding_window - 1 tokens before it. None:
  # the whole causal prefix.
  sliding_window: int | None = None

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ValueError(f"LlamaConfig.family {self.family!r} is not one of {', '.join(FAMILIES)}")
    if self.sliding_window is not None and (self.family != "mistral" or self.sliding_window <= 0):
      raise ValueError(
        f"LlamaConfig.sliding_window {self.sliding_window}: only a positive window of the "
        f"mistral family is supported (family {self.family!r})"
      )
    for field in ("vocab", "dim", "layers", "heads", "kv_heads", "head_dim", "mlp"):
      if getattr(self, field) <= 0:
        raise ValueError(f"LlamaConfig.{field} must be positive, got {getattr(self, field)}")
    if self.heads % self.kv_heads:
      raise ValueError(
        f"LlamaConfig: heads ({self.heads}) must be a multiple of kv_heads "
        f"({self.kv_heads}) for grouped-query attention"
      )
    if self.head_dim % 2:
      raise ValueError(f"LlamaConfig: head_dim ({self.head_dim}) must be even for RoPE")
    if isinstance(self.rope_scaling, dict):  # as read back from JSON (a checkpoint's metadata)
      object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))

  @property
  def qkv_bias(self) -> bool:
    """Biases on the q, k and v projections (Qwen2's, built into its attention)."""
    return self.family == "qwen2"

  @property
  def qk_norm(self) -> bool:
    """An RMSNorm over head_dim of each query and key head before RoPE (Qwen3's)."""
    return self.family == "qwen3"

  def layer_matmul_count(self) -> int:
    """The weights of one layer's matmuls: the four attention projections and the MLP's three."""
    attn = self.dim * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
    return attn + 3 * self.dim * self.mlp

  def layer_param_count(self) -> int:
    """Parameters of one transformer layer: its matmuls, the two norms, and the q/k/v biases
    or the q/k norms of the families that have them."""
    biases = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
    qk_norms = 2 * self.head_dim if self.qk_norm else 0
    return self.layer_matmul_count() + 2 * self.dim + biases + qk_norms

  def outer_param_count(self) -> int:
    """Parameters outside the layer stack: the embedding, the final norm and the head's kernel
    (none when tied: the head is the embedding table, counted once)."""
    return (1 if self.tie_embeddings else 2) * self.vocab * self.dim + self.dim

  def param_count(self) -> int:
    return self.layers * self.layer_param_count() + self.outer_param_count()

  def flops_per_token(self, seq_len: int) -> float:
    """Training FLOPs per token: 6 x matmul params + attention scores (forward + backward). The
    matmuls are the layers' weights and the head's V x D (tied or not); the embedding is a
    lookup."""
    matmul = self.layers * self.layer_matmul_count() + self.vocab * self.dim
    return 6 * matmul + 12 * self.layers * self.heads * self.head_dim * seq_len


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


# --- HF config.json -------------------------------------------------------------------------
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


# How attention is computed. "xla" writes it out: scores in fp32, causal mask, softmax, weighted
# sum (the numerics of every CPU run and test). "cudnn" is jax.nn.dot_product_attention's cuDNN
# fused kernel (flash attention: the L x L scores never reach memory), GPUs only, bf16/fp16, head
# dim a multiple of 8. "auto" (resolve_attention) picks cudnn where it applies, else xla.
ATTENTION_IMPLS = ("auto", "xla", "cudnn")
# Examples in one packed row, at most (run/packing.py packs no more): cuDNN's kernel takes a
# packed row as its runs (these examples and the padding after them), in arrays of static size.
MAX_SEGMENTS = 64
FUSED_DTYPES = ("bfloat16", "float16")
# Vocabulary columns per tile of the loss (models/loss.py): a tile's fp32 logits are 32 KiB per
# token (64 MiB for 2048 tokens), against 0.5 MiB per token for all of Llama 3's 128,256.
VOCAB_CHUNK = 8192


def tiles(vocab: int, chunk: int = VOCAB_CHUNK) -> tuple[int, int]:
  """(how many tiles, columns per tile) of a vocabulary of `vocab` in tiles of at most `chunk`:
  as few tiles as that allows, as even as can be (Llama 3's 128,256 in 16 of 8,016: no overlap)."""
  n = -(-vocab // min(chunk, vocab))
  return n, -(-vocab // n)


def vocab_tiled(vocab: int, chunk: int = VOCAB_CHUNK) -> bool:
  """Whether the model runs its loss (and its embedding and head) one vocabulary tile at a time:
  only where the vocabulary needs more than one tile. The policy's one place, for the model and
  the planner alike. A vocabulary of one tile keeps the whole micro-batch's fp32 logits (they are
  no bigger than a tile's), and with them the program compiled before the tiles existed: with the
  tiles XLA:GPU's scheduler orders the same last-backward loop body differently and leaves NNI's
  inter-node gradient all-reduce without a matmul in its window
  (tests/analysis/test_gpu_program.py, whose models have a vocabulary of 256)."""
  return tiles(vocab, chunk)[0] > 1


@dataclasses.dataclass(frozen=True)
class VocabPasses:
  """What one micro-batch sends of the embedding table and the head (models/llama.py
  `token_losses`), in passes over `rows` x D elements: all-gathered in forward, again in
  backward, and reduce-scattered (their gradients). The one place the step's traffic formula
  (paro_jax/analysis/planner/costs.py `step_traffic`) and its collective count take them from.

  One tile: each stored matrix is gathered once and its gradient scattered once (tied: the
  table's two uses share one gather, autodiff adds their gradients before the one scatter).
  Several tiles (models/loss.py): the lookup's tiles once, the head's (the table again where
  tied) in forward and again in backward (`tiled_cross_entropy`'s backward re-takes each tile),
  and each use's gradient scattered tile by tile; a pass covers the tiles' n x C rows (the last
  tile overlapping the one before), tied or not."""

  vocab: int
  dim: int
  stored: int  # V x D matrices stored: 1 tied, 2 untied (what param_count counts)
  rows: int  # of one pass: the vocabulary, or the tiles' n x C
  tiles: int  # collectives of one pass: one per tile
  forward: int
  backward: int
  scattered: int

  def beyond_stored(self, trained: bool = True) -> tuple[int, int, int]:
    """Elements (gathered in forward, gathered in backward, gradients scattered) beyond one
    gather and one scatter of each stored element (docs/design.md's formula); a frozen table
    and head (LoRA's base) scatter no gradient."""
    per_pass, stored = self.rows * self.dim, self.stored * self.vocab * self.dim
    scattered = self.scattered * per_pass - stored if trained else 0
    return self.forward * per_pass - stored, self.backward * per_pass, scattered


def vocab_passes(cfg: LlamaConfig, chunk: int = VOCAB_CHUNK) -> VocabPasses:
  """The embedding table's and head's passes of one micro-batch (`VocabPasses`)."""
  stored = 1 if cfg.tie_embeddings else 2
  shape = dict(vocab=cfg.vocab, dim=cfg.dim, stored=stored)
  if not vocab_tiled(cfg.vocab, chunk):
    return VocabPasses(
      **shape, rows=cfg.vocab, tiles=1, forward=stored, backward=0, scattered=stored
    )
  n, size = tiles(cfg.vocab, chunk)
  return VocabPasses(**shape, rows=n * size, tiles=n, forward=2, backward=1, scattered=2)


def resolve_attention(
  requested: str, platform: str, dtype, head_dim: int, packed_window: bool = False
) -> tuple[str, str]:
  """(the attention implementation to run, why) for --attention on `platform` ("cpu", "gpu",
  "cuda"). Asking for cudnn where it cannot run is an error, not a quiet fallback.
  `packed_window`: packed rows (--pack) longer than the model's sliding window, which cuDNN's
  packed kernel here does not apply (models/llama.py check_window_fits_kernel)."""
  # here: this module starts without numpy; ml_dtypes registers bfloat16
  import ml_dtypes  # noqa: F401
  import numpy as np

  if requested not in ATTENTION_IMPLS:
    raise ValueError(f"unknown --attention {requested!r}; choose one of {ATTENTION_IMPLS}")
  gpu = platform in ("gpu", "cuda")
  fits = np.dtype(dtype).name in FUSED_DTYPES and head_dim % 8 == 0 and head_dim <= 128
  if requested == "cudnn":
    if not gpu:
      raise ValueError(
        f"--attention cudnn needs NVIDIA GPUs (this run is on {platform}); use --attention xla"
      )
    if not fits:
      raise ValueError(
        f"--attention cudnn needs --dtype bf16 and a head dim that is a multiple of 8 and at most "
        f"128 (got {np.dtype(dtype).name}, {head_dim}); use --attention xla"
      )
    if packed_window:
      raise ValueError(
        "--attention cudnn: the model's sliding_window is shorter than --seq-len and cuDNN's "
        "kernel over packed rows (--pack) applies no window; use --attention xla"
      )
  if requested != "auto":
    return requested, f"{requested} (asked for)"
  if gpu and fits and packed_window:
    return "xla", "auto, a sliding window over packed rows, which cuDNN's kernel does not apply"
  if gpu and fits:
    return "cudnn", "auto on GPUs in bf16: cuDNN's fused kernel"
  why = "not on GPUs" if not gpu else "cuDNN's kernel needs bf16 and head dim <= 128, % 8 == 0"
  return "xla", f"auto, {why}: attention written out in XLA"


# --- LoRA ------------------------------------------------------------------------------------
LORA_TARGETS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Low-rank adapters W + (alpha/rank) A @ B on the named weights (Hu et al., 2021).

  A (in x rank) starts random and B (rank x out) at zero, so an adapted model starts equal to its
  base. Each adapter is stored as two 2-D matrices whose big dimension carries the shard: A's
  input (`embed`, or `lora_in` for wo/w_down) and B's output (`embed`, or `lora_out`).
  """

  rank: int = 8
  alpha: float = 16.0
  targets: tuple[str, ...] = ("wq", "wv")  # as PEFT's default for LLaMA (q_proj, v_proj)

  def __post_init__(self):
    if isinstance(self.targets, str):
      object.__setattr__(self, "targets", tuple(t for t in self.targets.split(",") if t))
    object.__setattr__(self, "targets", tuple(self.targets))  # e.g. a list read from JSON
    if self.rank < 1:
      raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
    bad = [t for t in self.targets if t not in LORA_TARGETS]
    if bad or not self.targets:
      raise ValueError(
        f"unknown LoRA targets {bad or '(none)'}; choose from "
        f"{', '.join(LORA_TARGETS)} (comma-separated, e.g. wq,wv)"
      )

  @classmethod
  def from_flags(cls, rank: int, alpha: float, targets) -> LoraConfig | None:
    """The adapters `--lora-rank/--lora-alpha/--lora-targets` ask for; None for rank 0."""
    if rank < 0:
      raise ValueError(f"--lora-rank must be >= 0 (0: full training), got {rank}")
    return cls(rank, alpha, targets) if rank else None

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  def shapes(self, cfg: LlamaConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target weight."""
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    io = {
      "wq": (cfg.dim, q),
      "wk": (cfg.dim, kv),
      "wv": (cfg.dim, kv),
      "wo": (q, cfg.dim),
      "w_gate": (cfg.dim, cfg.mlp),
      "w_up": (cfg.dim, cfg.mlp),
      "w_down": (cfg.mlp, cfg.dim),
    }
    return {t: io[t] for t in self.targets}

  def layer_params(self, cfg: LlamaConfig) -> int:
    """Adapter parameters per layer."""
    return sum(self.rank * (i + o) for i, o in self.shapes(cfg).values())
