"""The model's configuration: `LlamaConfig`, the presets, the mapping to and from an HF
LLaMA `config.json`, and the LoRA adapters' `LoraConfig`.

Pure Python (no jax, no numpy): what the planner, the CLI's argument checks and the HF reader
need before anything is compiled. models/llama.py (the Flax model) and models/hf.py (the HF
weights) both import it; it imports neither.
"""

from __future__ import annotations

import dataclasses
import json
import os

CONFIG = "config.json"  # an HF model directory's config file
# The stacked layers: the parameters' key of the layer stack (models/llama.py), and the logical
# axis its leaves are stacked on.
LAYERS = "layers"


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

  def __post_init__(self):
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

  def layer_param_count(self) -> int:
    """Parameters of one transformer layer: attention, MLP and the two norms."""
    attn = self.dim * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
    return attn + 3 * self.dim * self.mlp + 2 * self.dim

  def outer_param_count(self) -> int:
    """Parameters outside the layer stack: embedding, final norm and the untied head."""
    return 2 * self.vocab * self.dim + self.dim

  def param_count(self) -> int:
    return self.layers * self.layer_param_count() + self.outer_param_count()

  def flops_per_token(self, seq_len: int) -> float:
    """Training FLOPs per token: 6 x matmul params + attention scores (forward + backward)."""
    matmul = self.param_count() - self.vocab * self.dim - (2 * self.layers + 1) * self.dim
    return 6 * matmul + 12 * self.layers * self.heads * self.head_dim * seq_len


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
    raise FileNotFoundError(
      f"--model {name} does not exist: give an HF LLaMA config.json (or its directory), or a "
      f"preset: {', '.join(PRESETS)}"
    )
  raise ValueError(
    f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}, or give the path of an "
    f"HF LLaMA config.json"
  )


# --- HF config.json -------------------------------------------------------------------------
def config_from_hf(hf: dict, where: str = CONFIG) -> LlamaConfig:
  """Our LlamaConfig for an HF LLaMA config.json (as a dict); anything we cannot run is an error."""

  def refuse(why):
    raise ValueError(f"{where}: unsupported HF config: {why}")

  archs = hf.get("architectures") or []
  if hf.get("model_type", "llama") != "llama" or (archs and "LlamaForCausalLM" not in archs):
    refuse(
      f"model_type {hf.get('model_type')!r}, architectures {archs}: only LLaMA "
      f"(LlamaForCausalLM) is supported"
    )
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
  if hf.get("tie_word_embeddings", False):
    refuse("tie_word_embeddings is true, but our model has a separate output head (lm_head)")
  for key in ("attention_bias", "mlp_bias"):
    if hf.get(key, False):
      refuse(f"{key} is true; our model has no biases")
  if hf.get("hidden_act", "silu") != "silu":
    refuse(f"hidden_act {hf['hidden_act']!r}; our MLP is SwiGLU (silu)")
  if hf.get("rope_scaling"):
    refuse(f"rope_scaling {hf['rope_scaling']}; only plain RoPE (no scaling) is supported")
  rope = hf.get("rope_parameters") or {}  # transformers >= 5 keeps rope_theta here
  if rope.get("rope_type", "default") != "default":
    refuse(f"rope_parameters {rope}; only plain RoPE (rope_type 'default') is supported")
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
      rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10_000.0))),
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      init_std=float(hf.get("initializer_range", 0.02)),
    )
  except ValueError as e:
    refuse(str(e))


def config_to_hf(c: LlamaConfig) -> dict:
  """The config.json of a LlamaForCausalLM with our model's shapes."""
  return {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": c.vocab,
    "hidden_size": c.dim,
    "num_hidden_layers": c.layers,
    "num_attention_heads": c.heads,
    "num_key_value_heads": c.kv_heads,
    "head_dim": c.head_dim,
    "intermediate_size": c.mlp,
    "hidden_act": "silu",
    "rms_norm_eps": c.norm_eps,
    "rope_theta": c.rope_theta,
    "rope_scaling": None,
    "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "initializer_range": c.init_std,
    "torch_dtype": "float32",
  }


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
FUSED_DTYPES = ("bfloat16", "float16")


def resolve_attention(requested: str, platform: str, dtype, head_dim: int) -> tuple[str, str]:
  """(the attention implementation to run, why) for --attention on `platform` ("cpu", "gpu",
  "cuda"). Asking for cudnn where it cannot run is an error, not a quiet fallback."""
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
  if requested != "auto":
    return requested, f"{requested} (asked for)"
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
