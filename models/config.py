"""The model's configuration: `LlamaConfig` (its family and RoPE scaling), how attention and the
vocabulary's tiles are chosen, and the LoRA adapters' `LoraConfig`. The presets are in
models/presets.py, the mapping to and from an HF `config.json` in models/hf_config.py.

Pure Python (no jax, no numpy): what the planner, the CLI's argument checks and the HF reader
need before anything is compiled. models/llama.py (the Flax model) and paro_jax/hf/weights.py
(the HF weights) both import it; it imports neither.
"""

from __future__ import annotations

import dataclasses

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
