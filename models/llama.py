"""A Flax LLaMA: RMSNorm, RoPE (plain, linear or llama3-scaled), grouped-query attention, SwiGLU
MLP, and an output head of its own or tied to the embedding table. The family's switches
(models/config.py FAMILIES) make it Qwen2's (q/k/v biases), Qwen3's (per-head q/k RMSNorm before
RoPE) or Mistral's (a sliding attention window).

Every parameter is declared once, with its logical axes (`embed`, `mlp`, `heads`, ...), through
`nn.with_logical_partitioning`; the sharding layer maps those names onto the mesh. The layers are
stacked on a leading `layers` axis and run with `lax.scan`, so compile time does not grow with
depth. `Llama.apply` takes a `materialize` hook that turns each stored parameter subtree into
full weights just before use: the identity for a dense model, a per-layer all-gather for a
sharded one (see paro_jax/core/step.py).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from models.loss import tiled_cross_entropy, tiled_lookup, tiled_scores
from models.config import (
  ATTENTION_IMPLS,
  LAYERS,
  MAX_SEGMENTS,
  VOCAB_CHUNK,
  LlamaConfig,
  LoraConfig,
  vocab_tiled,
)


# What each layer keeps for backward. "full": nothing (all of the layer, its weight gather
# included, is recomputed); "layer": its matmul outputs (less recompute, more activation memory;
# the weights are still gathered again); "none": no recomputation, so every layer's gathered
# weights and activations stay alive until backward.
REMAT_POLICIES = {
  "full": jax.checkpoint_policies.nothing_saveable,
  "layer": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  "none": None,
}


def _init(std: float, axes: tuple[str, ...]):
  return nn.with_logical_partitioning(nn.initializers.normal(std), axes)


# --- LoRA ------------------------------------------------------------------------------------
LORA_SUFFIXES = ("_lora_a", "_lora_b")


def is_lora_path(path) -> bool:
  """Whether a parameter path (a jax key path) names a LoRA adapter leaf."""
  last = path[-1]
  return str(getattr(last, "key", last)).endswith(LORA_SUFFIXES)


def lora_delta(
  module: nn.Module,
  lora: LoraConfig | None,
  name: str,
  x,
  in_axis: str,
  out_axis: str,
  out_shape: tuple[int, ...],
):
  """(alpha/r) x A B for target `name` (x: ... x in), shaped ... x out_shape; 0 if no adapter.

  Declared inside the module that owns the weight, as `{name}_lora_a` and `{name}_lora_b`.
  """
  if lora is None or name not in lora.targets:
    return 0
  n_in, n_out = x.shape[-1], math.prod(out_shape)
  a = module.param(
    f"{name}_lora_a",
    nn.with_logical_partitioning(
      nn.initializers.normal(1 / math.sqrt(n_in)), (in_axis, "lora_rank")
    ),
    (n_in, lora.rank),
  )
  b = module.param(
    f"{name}_lora_b",
    nn.with_logical_partitioning(nn.initializers.zeros, ("lora_rank", out_axis)),
    (lora.rank, n_out),
  )
  y = (x @ a.astype(x.dtype)) @ b.astype(x.dtype) * jnp.asarray(lora.scale, x.dtype)
  return y.reshape(*x.shape[:-1], *out_shape)


class RMSNorm(nn.Module):
  """RMS-normalises the last axis, whose logical name is `axis` (`head_dim` for Qwen3's q/k
  norms, which normalise each head)."""

  eps: float
  axis: str = "embed"

  @nn.compact
  def __call__(self, x_BxLxD):
    scale_D = self.param(
      "scale",
      nn.with_logical_partitioning(nn.initializers.ones, (self.axis,)),
      (x_BxLxD.shape[-1],),
      jnp.float32,
    )
    x = x_BxLxD.astype(jnp.float32)
    x = x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    return (x * scale_D.astype(jnp.float32)).astype(x_BxLxD.dtype)


def inverse_frequencies(cfg: LlamaConfig):
  """RoPE's K/2 inverse frequencies (fp32), with the config's scaling, as transformers computes
  them (modeling_rope_utils.py: the default, `_compute_linear_scaling_rope_parameters`,
  `_compute_llama3_parameters`; neither scaling changes the attention factor, 1.0)."""
  K = cfg.head_dim
  inv_freq = 1.0 / cfg.rope_theta ** (jnp.arange(0, K, 2, dtype=jnp.float32) / K)
  s = cfg.rope_scaling
  if s is None:
    return inv_freq
  if s.kind == "linear":
    return inv_freq / s.factor
  # llama3: wavelengths above original/low_freq_factor are divided by `factor`, those below
  # original/high_freq_factor kept, and the band between interpolated smoothly.
  low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
  high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
  smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
    s.high_freq_factor - s.low_freq_factor
  )
  smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
  medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
  return jnp.where(medium, smoothed, scaled)


def rope_tables(seq_len: int, cfg: LlamaConfig):
  """sin and cos tables, each L x K/2, in fp32."""
  angles_LxK2 = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inverse_frequencies(cfg)[None, :]
  return jnp.sin(angles_LxK2), jnp.cos(angles_LxK2)


def segment_positions(segments_BxL):
  """Each token's position in its segment (a run of equal ids): 0 where a run starts."""
  L = segments_BxL.shape[1]
  index_BxL = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), segments_BxL.shape)
  starts = jnp.concatenate(
    [jnp.ones_like(segments_BxL[:, :1], bool), segments_BxL[:, 1:] != segments_BxL[:, :-1]], 1
  )
  return index_BxL - lax.cummax(jnp.where(starts, index_BxL, 0), axis=1)


def segment_rope_tables(segments_BxL, cfg: LlamaConfig):
  """sin and cos tables, each B x L x K/2 (fp32), at the positions in each segment: a packed
  example is rotated as it would be alone in a row (the same values as `rope_tables`)."""
  positions_BxL = segment_positions(segments_BxL).astype(jnp.float32)
  angles_BxLxK2 = positions_BxL[..., None] * inverse_frequencies(cfg)
  return jnp.sin(angles_BxLxK2), jnp.cos(angles_BxLxK2)


def apply_rope(x_BxLxHxK, sin, cos):
  """Rotate pairs (first half, second half) of each head, as HF LLaMA does (rotate_half). The
  tables are L x K/2 (every row alike) or B x L x K/2 (positions per segment)."""
  x = x_BxLxHxK.astype(jnp.float32)
  x1, x2 = jnp.split(x, 2, axis=-1)
  sin, cos = sin[..., None, :], cos[..., None, :]  # a heads axis; a rows axis if missing
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxLxHxK.dtype)


def fused_attention(
  q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, implementation: str, sliding_window: int | None = None
):
  """Causal grouped-query attention through jax.nn.dot_product_attention (scale 1/sqrt(K)),
  each token seeing itself and the `sliding_window - 1` before it where a window is given.

  `implementation="cudnn"` is the GPU kernel; "xla" is the same call on any backend, which the
  tests compare with the written-out attention."""
  window = None if sliding_window is None else (sliding_window - 1, 0)
  return jax.nn.dot_product_attention(
    q_BxLxHxK,
    k_BxLxGxK,
    v_BxLxGxK,
    is_causal=True,
    local_window_size=window,
    implementation=implementation,
  )


def visible_mask(L: int, sliding_window: int | None):
  """L x L: whether query i sees key j: causal (j <= i) and, with a sliding window W, one of
  the W latest (i - j < W), as transformers' sliding-window mask (masking_utils.py)."""
  i, j = jnp.arange(L)[:, None], jnp.arange(L)[None, :]
  if sliding_window is None:
    return j <= i
  return (j <= i) & (i - j < sliding_window)


def check_window_fits_kernel(sliding_window: int | None, L: int, packed: bool) -> None:
  """cuDNN's packed-rows kernel (jax's wrapper with offsets) takes no window here: a window
  that binds (shorter than the rows) is refused rather than ignored."""
  if packed and sliding_window is not None and sliding_window < L:
    raise ValueError(
      f"sliding_window {sliding_window} is shorter than the sequence length {L}, and cuDNN "
      f"attention over packed rows does not apply a window: use --attention xla (or a sequence "
      f"length of at most {sliding_window})"
    )


def segment_runs(segments_BxL, runs: int):
  """(offsets B x runs+1, lengths B x runs) of each row's runs of equal segment ids (its
  examples and the padding after them), -1 past the last: cuDNN's packed layout."""
  L = segments_BxL.shape[1]
  starts_BxL = jnp.concatenate(
    [jnp.ones_like(segments_BxL[:, :1], bool), segments_BxL[:, 1:] != segments_BxL[:, :-1]], 1
  )
  first = lambda row: jnp.nonzero(row, size=runs + 1, fill_value=L)[0]
  offsets = jax.vmap(first)(starts_BxL).astype(jnp.int32)  # each run's start, then L
  lengths = offsets[:, 1:] - offsets[:, :-1]
  lengths = jnp.where(offsets[:, :-1] < L, lengths, -1)
  return jnp.where(offsets < L, offsets, -1), lengths


def packed_fused_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segments_BxL):
  """Causal attention inside each segment with cuDNN's fused kernel, in its packed layout
  (jax's wrapper of it: each row's runs as offsets and lengths; Hopper GPUs and later)."""
  from jax._src.cudnn import fused_attention_stablehlo as fa  # the only jax API with offsets

  offsets, lengths = segment_runs(segments_BxL, MAX_SEGMENTS + 1)
  return fa.dot_product_attention(
    q_BxLxHxK,
    k_BxLxGxK,
    v_BxLxGxK,
    q_seqlen=lengths,
    kv_seqlen=lengths,
    q_offsets=offsets,
    kv_offsets=offsets,
    scale=1 / math.sqrt(q_BxLxHxK.shape[-1]),
    mask_type=fa.MaskType.PADDING_CAUSAL,
  )


def written_attention(q_BxLxHxK, k_BxMxGxK, v_BxMxGxK, visible):
  """Grouped-query attention written out (R = H/G query heads share each key/value head):
  softmax in fp32 over the keys each query sees, `visible` broadcasting to B x G x R x L x M."""
  B, L, H, K = q_BxLxHxK.shape
  G = k_BxMxGxK.shape[2]
  q_BxLxGxRxK = q_BxLxHxK.reshape(B, L, G, H // G, K)
  scores_BxGxRxLxM = jnp.einsum(
    "blgrk,bmgk->bgrlm", q_BxLxGxRxK, k_BxMxGxK, preferred_element_type=jnp.float32
  ) / jnp.sqrt(K).astype(jnp.float32)
  scores_BxGxRxLxM = jnp.where(visible, scores_BxGxRxLxM, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores_BxGxRxLxM, axis=-1).astype(q_BxLxHxK.dtype)
  out_BxLxGxRxK = jnp.einsum("bgrlm,bmgk->blgrk", probs, v_BxMxGxK)
  return out_BxLxGxRxK.reshape(B, L, H, K)


def cache_visible(start_B, length, L: int, T: int, sliding_window: int | None):
  """B x L x T: whether the query in cache slot length+l sees the key in slot t: causal, not
  in its row's left padding (slots before start_B), and with a window one of the W latest. A
  row's tokens fill consecutive slots, so slot distances are position distances."""
  query_L = length + jnp.arange(L)
  key_T = jnp.arange(T)
  visible_BxLxT = (key_T[None, None, :] <= query_L[None, :, None]) & (
    key_T[None, None, :] >= start_B[:, None, None]
  )
  if sliding_window is not None:
    visible_BxLxT &= (query_L[:, None] - key_T[None, :] < sliding_window)[None]
  return visible_BxLxT


class Attention(nn.Module):
  cfg: LlamaConfig
  lora: LoraConfig | None = None
  impl: str = "xla"  # "xla" or "cudnn" (resolve_attention)

  @nn.compact
  def __call__(self, x_BxLxD, sin, cos, segments_BxL=None, cache=None):
    """`segments_BxL`: the example each token belongs to (0: padding); a token attends to the
    earlier tokens of its own example only. None: one sequence per row (plain causal).

    `cache` (decoding, `Llama.decode`): this layer's (keys, values, start_B, length) of a
    `KVCache`; the tokens are its slots length.. length+L-1 and see the cache's earlier slots.
    Then returns (output, (keys, values)) with theirs written in."""
    c = self.cfg
    D, H, G, K = c.dim, c.heads, c.kv_heads, c.head_dim
    dt = x_BxLxD.dtype
    wq_DxHxK = self.param("wq", _init(c.init_std, ("embed", "heads", "head_dim")), (D, H, K))
    wk_DxGxK = self.param("wk", _init(c.init_std, ("embed", "kv_heads", "head_dim")), (D, G, K))
    wv_DxGxK = self.param("wv", _init(c.init_std, ("embed", "kv_heads", "head_dim")), (D, G, K))
    wo_HxKxD = self.param("wo", _init(c.init_std, ("heads", "head_dim", "embed")), (H, K, D))
    lora = lambda name, x, out_shape, in_axis="embed", out_axis="lora_out": lora_delta(
      self, self.lora, name, x, in_axis, out_axis, out_shape
    )
    q_BxLxHxK = jnp.einsum("bld,dhk->blhk", x_BxLxD, wq_DxHxK.astype(dt)) + lora(
      "wq", x_BxLxD, (H, K)
    )
    k_BxLxGxK = jnp.einsum("bld,dgk->blgk", x_BxLxD, wk_DxGxK.astype(dt)) + lora(
      "wk", x_BxLxD, (G, K)
    )
    v_BxLxGxK = jnp.einsum("bld,dgk->blgk", x_BxLxD, wv_DxGxK.astype(dt)) + lora(
      "wv", x_BxLxD, (G, K)
    )
    if c.qkv_bias:
      q_BxLxHxK = q_BxLxHxK + self._bias("bq", H, K, dt)
      k_BxLxGxK = k_BxLxGxK + self._bias("bk", G, K, dt)
      v_BxLxGxK = v_BxLxGxK + self._bias("bv", G, K, dt)
    if c.qk_norm:  # Qwen3: each head's query and key, before RoPE
      q_BxLxHxK = RMSNorm(c.norm_eps, "head_dim", name="q_norm")(q_BxLxHxK)
      k_BxLxGxK = RMSNorm(c.norm_eps, "head_dim", name="k_norm")(k_BxLxGxK)
    q_BxLxHxK = apply_rope(q_BxLxHxK, sin, cos)
    k_BxLxGxK = apply_rope(k_BxLxGxK, sin, cos)
    B, L = x_BxLxD.shape[:2]
    if cache is not None:  # decoding: a few queries over the cache, always written out
      k_BxTxGxK, v_BxTxGxK, start_B, length = cache
      k_BxTxGxK = lax.dynamic_update_slice_in_dim(k_BxTxGxK, k_BxLxGxK, length, axis=1)
      v_BxTxGxK = lax.dynamic_update_slice_in_dim(v_BxTxGxK, v_BxLxGxK, length, axis=1)
      visible = cache_visible(start_B, length, L, k_BxTxGxK.shape[1], c.sliding_window)
      out_BxLxHxK = written_attention(q_BxLxHxK, k_BxTxGxK, v_BxTxGxK, visible[:, None, None])
      return self._out(out_BxLxHxK.reshape(B, L, H * K), wo_HxKxD, lora), (k_BxTxGxK, v_BxTxGxK)
    if self.impl == "cudnn":
      if segments_BxL is None:
        out_BxLxHxK = fused_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, "cudnn", c.sliding_window)
      else:
        check_window_fits_kernel(c.sliding_window, L, packed=True)
        out_BxLxHxK = packed_fused_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segments_BxL)
      return self._out(out_BxLxHxK.reshape(B, L, H * K), wo_HxKxD, lora)
    causal_LxL = visible_mask(L, c.sliding_window)
    if segments_BxL is None:
      visible = causal_LxL
    else:  # causal and inside the token's own example: B x 1 x 1 x L x L
      same_BxLxL = segments_BxL[:, :, None] == segments_BxL[:, None, :]
      visible = (causal_LxL & same_BxLxL)[:, None, None]
    out_BxLxHxK = written_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, visible)
    return self._out(out_BxLxHxK.reshape(B, L, H * K), wo_HxKxD, lora)

  def _bias(self, name: str, heads: int, K: int, dt):
    """A projection's bias, heads x K. Stored flat (heads * K, HF's layout), on the logical
    axis `proj_out`: the sharding layer splits it there, a dimension as divisible as the
    projection's output."""
    b = self.param(
      name, nn.with_logical_partitioning(nn.initializers.zeros, ("proj_out",)), (heads * K,)
    )
    return b.reshape(heads, K).astype(dt)

  def _out(self, out_BxLxHK, wo_HxKxD, lora):
    B, L, _ = out_BxLxHK.shape
    H, K, D = wo_HxKxD.shape
    out_BxLxHxK = out_BxLxHK.reshape(B, L, H, K)
    return jnp.einsum("blhk,hkd->bld", out_BxLxHxK, wo_HxKxD.astype(out_BxLxHK.dtype)) + lora(
      "wo", out_BxLxHK, (D,), in_axis="lora_in", out_axis="embed"
    )


class MLP(nn.Module):
  cfg: LlamaConfig
  lora: LoraConfig | None = None

  @nn.compact
  def __call__(self, x_BxLxD):
    c, dt = self.cfg, x_BxLxD.dtype
    w_gate_DxF = self.param("w_gate", _init(c.init_std, ("embed", "mlp")), (c.dim, c.mlp))
    w_up_DxF = self.param("w_up", _init(c.init_std, ("embed", "mlp")), (c.dim, c.mlp))
    w_down_FxD = self.param("w_down", _init(c.init_std, ("mlp", "embed")), (c.mlp, c.dim))
    lora = lambda name, x, out_shape, in_axis="embed", out_axis="lora_out": lora_delta(
      self, self.lora, name, x, in_axis, out_axis, out_shape
    )
    gate_BxLxF = x_BxLxD @ w_gate_DxF.astype(dt) + lora("w_gate", x_BxLxD, (c.mlp,))
    up_BxLxF = x_BxLxD @ w_up_DxF.astype(dt) + lora("w_up", x_BxLxD, (c.mlp,))
    h_BxLxF = jax.nn.silu(gate_BxLxF) * up_BxLxF
    return h_BxLxF @ w_down_FxD.astype(dt) + lora(
      "w_down", h_BxLxF, (c.dim,), in_axis="lora_in", out_axis="embed"
    )


class Block(nn.Module):
  cfg: LlamaConfig
  lora: LoraConfig | None = None
  attention: str = "xla"

  @nn.compact
  def __call__(self, x_BxLxD, sin, cos, segments_BxL=None, cache=None):
    """The layer's output; with a `cache` (Attention's), (output, the layer's new keys and
    values)."""
    with jax.named_scope("attention"):
      h = RMSNorm(self.cfg.norm_eps, name="attn_norm")(x_BxLxD)
      attention = Attention(self.cfg, self.lora, self.attention, name="attn")
      attended = attention(h, sin, cos, segments_BxL, cache)
      if cache is not None:
        attended, kv = attended
      x_BxLxD = x_BxLxD + attended
    with jax.named_scope("mlp"):
      h = RMSNorm(self.cfg.norm_eps, name="mlp_norm")(x_BxLxD)
      out_BxLxD = x_BxLxD + MLP(self.cfg, self.lora, name="mlp")(h)
    return out_BxLxD if cache is None else (out_BxLxD, kv)


class Embed(nn.Module):
  cfg: LlamaConfig
  dtype: Any

  @nn.compact
  def __call__(self, tokens_BxL):
    table_VxD = self.param(
      "embedding", _init(self.cfg.init_std, ("vocab", "embed")), (self.cfg.vocab, self.cfg.dim)
    )
    return jnp.take(table_VxD, tokens_BxL, axis=0).astype(self.dtype)


def _logits(equation: str, x, w):
  return jnp.einsum(equation, x, w, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def head_logits(equation: str, x, w):
  """fp32 logits of the compute-dtype `x` and `w` (`jnp.einsum(equation, ...)`), whose backward
  runs on the compute dtype too: the logits' fp32 cotangent is rounded once to x's dtype, and
  both backward matmuls take it with fp32 accumulation and a compute-dtype result, as every
  other matmul's backward does. Differentiated plainly, the fp32 cotangent made both of them
  fp32 matmuls (TF32 on an H100, at half the bf16 rate: 3.4 of 44.7 ms of 7b's layer step). In
  fp32 the same as plain differentiation."""
  return _logits(equation, x, w)


def _head_logits_fwd(equation, x, w):
  return _logits(equation, x, w), (x, w)


def _head_logits_bwd(equation, res, ct_logits):
  x, w = res
  _, vjp = jax.vjp(lambda x, w: jnp.einsum(equation, x, w), x, w)
  return vjp(ct_logits.astype(x.dtype))


head_logits.defvjp(_head_logits_fwd, _head_logits_bwd)


class Head(nn.Module):
  """The final norm and the output projection: its own D x V kernel, or, tied, the embedding
  table (V x D) handed in by the caller. The logits are fp32 (the loss and its softmax are);
  the projection's backward is in the compute dtype (`head_logits`)."""

  cfg: LlamaConfig

  def __call__(self, x_BxLxD, table_VxD=None):
    h_BxLxD, w, vocab_axis = self.project(x_BxLxD, table_VxD)
    return head_logits(HEAD_EQUATIONS[vocab_axis], h_BxLxD, w)

  @nn.compact
  def project(self, x_BxLxD, table_VxD=None):
    """(the normed input, the projection in the compute dtype, its vocabulary axis): what the
    logits are made of, for a loss that never holds all of them (models/loss.py)."""
    x_BxLxD = RMSNorm(self.cfg.norm_eps, name="norm")(x_BxLxD)
    if self.cfg.tie_embeddings:
      return x_BxLxD, table_VxD.astype(x_BxLxD.dtype), 0
    w_DxV = self.param(
      "kernel", _init(self.cfg.init_std, ("embed", "vocab")), (self.cfg.dim, self.cfg.vocab)
    )
    return x_BxLxD, w_DxV.astype(x_BxLxD.dtype), 1


# The logits' einsum by the projection's vocabulary axis: 1 for the head's kernel, 0 for the table.
HEAD_EQUATIONS = {1: "bld,dv->blv", 0: "bld,vd->blv"}


def _identity(tree):
  return tree


class Llama:
  """The whole model as three Flax modules (embed, a scanned block, head) and pure functions."""

  def __init__(
    self,
    cfg: LlamaConfig,
    dtype=jnp.float32,
    remat: str = "full",
    lora: LoraConfig | None = None,
    attention: str = "xla",
    vocab_chunk: int = VOCAB_CHUNK,
  ):
    if remat not in REMAT_POLICIES:
      raise ValueError(f"unknown remat policy {remat!r}; choose one of {tuple(REMAT_POLICIES)}")
    if attention not in ATTENTION_IMPLS[1:]:
      raise ValueError(f"attention must be resolved to one of {ATTENTION_IMPLS[1:]}: {attention!r}")
    self.cfg, self.dtype, self.remat, self.lora = cfg, dtype, remat, lora
    self.attention = attention
    if vocab_chunk < 1:
      raise ValueError(f"vocab_chunk must be at least 1, got {vocab_chunk}")
    # The vocabulary's tile (models/loss.py; VOCAB_CHUNK is the size meant for real
    # vocabularies; tests pass a small one) and whether the model uses tiles at all
    # (`vocab_tiled`, models/config.py: only where the vocabulary needs more than one).
    self.vocab_chunk = vocab_chunk
    self.vocab_tiled = vocab_tiled(cfg.vocab, vocab_chunk)
    self.embed, self.head = Embed(cfg, dtype), Head(cfg)
    self.block = Block(cfg, lora, attention)

  def _boxed_init(self, rng):
    k_embed, k_layers, k_head = jax.random.split(rng, 3)
    tokens = jnp.zeros((1, 2), jnp.int32)
    x = jnp.zeros((1, 2, self.cfg.dim), jnp.float32)
    sin, cos = rope_tables(2, self.cfg)
    layer_keys = jax.random.split(k_layers, self.cfg.layers)
    # The parameters do not depend on how attention is computed: initialise through the
    # written-out attention, which traces on any backend.
    block = Block(self.cfg, self.lora)
    layers = jax.vmap(lambda k: block.init(k, x, sin, cos)["params"])(layer_keys)
    return {
      "embed": self.embed.init(k_embed, tokens)["params"],
      LAYERS: layers,
      "head": self.head.init(k_head, x, jnp.zeros((self.cfg.vocab, self.cfg.dim)))["params"],
    }

  def init(self, rng) -> dict:
    """fp32 parameters; the per-layer leaves are stacked on a leading `layers` axis."""
    if not hasattr(self, "_init_fn"):
      self._init_fn = jax.jit(lambda rng: nn.meta.unbox(self._boxed_init(rng)))
    return self._init_fn(rng)

  def logical_axes(self) -> dict:
    """A tree like init()'s whose leaves are tuples of logical axis names."""
    boxed = jax.eval_shape(self._boxed_init, jax.random.key(0))
    is_box = lambda x: isinstance(x, nn.Partitioned)
    axes = jax.tree.map(lambda b: tuple(b.names), boxed, is_leaf=is_box)
    # vmap stacked the layer leaves without recording the new leading axis: add it here.
    axes[LAYERS] = jax.tree.map(
      lambda a: (LAYERS, *a), axes[LAYERS], is_leaf=lambda x: isinstance(x, tuple)
    )
    return axes

  def stack_param_count(self) -> int:
    """Parameters of the whole scanned layer stack, adapters included (the ones recomputed in
    backward); `LlamaConfig.layer_param_count` counts one layer without adapters."""
    c = self.cfg
    adapters = self.lora.layer_params(c) if self.lora else 0
    return c.layers * (c.layer_param_count() + adapters)

  def param_count(self) -> int:
    """All parameters, adapters included (Ψ)."""
    return self.cfg.param_count() + (
      self.cfg.layers * self.lora.layer_params(self.cfg) if self.lora else 0
    )

  def trainable_count(self) -> int:
    """Parameters that are trained (Ψ'): the adapters with LoRA, else all."""
    return (
      self.cfg.layers * self.lora.layer_params(self.cfg) if self.lora else self.cfg.param_count()
    )

  def trainable_mask(self) -> dict:
    """A tree like init()'s of bools: True for the trained leaves (all, or the LoRA adapters)."""
    shapes = jax.eval_shape(self._boxed_init, jax.random.key(0))
    shapes = nn.meta.unbox(shapes)
    if self.lora is None:
      return jax.tree.map(lambda _: True, shapes)
    return jax.tree_util.tree_map_with_path(lambda path, _: is_lora_path(path), shapes)

  def with_adapters(self, base, rng) -> dict:
    """Base weights (e.g. from HF) plus freshly initialised adapters: a full parameter tree."""
    if self.lora is None:
      return base

    def overlay(full, given):
      return (
        {
          k: overlay(v, given[k]) if isinstance(v, dict) else given.get(k, v)
          for k, v in full.items()
        }
        if isinstance(given, dict)
        else given
      )

    return overlay(self.init(rng), base)

  def merge_lora(self, params) -> dict:
    """The base model's parameters with every adapter folded in: W + (alpha/r) A @ B."""
    if self.lora is None:
      return params
    params = jax.tree.map(lambda x: x, params)  # a copy of the dict structure
    owners = {
      "wq": "attn",
      "wk": "attn",
      "wv": "attn",
      "wo": "attn",
      "w_gate": "mlp",
      "w_up": "mlp",
      "w_down": "mlp",
    }
    for t in self.lora.targets:
      mod = dict(params[LAYERS][owners[t]])
      a, b = mod.pop(f"{t}_lora_a"), mod.pop(f"{t}_lora_b")
      w = mod[t]  # layers x in... x out...
      delta = jnp.einsum("lir,lro->lio", a, b) * self.lora.scale
      mod[t] = w + delta.reshape(w.shape).astype(w.dtype)
      params[LAYERS] = {**params[LAYERS], owners[t]: mod}
    return params

  def apply(
    self,
    params,
    tokens_BxL,
    materialize: Callable = _identity,
    run_layers: Callable | None = None,
    segments_BxL=None,
  ):
    """Logits (fp32) for the tokens, B x L x V: for tests and references; the step and the eval
    forward take `token_losses`, which never holds them all. Arguments as `head_inputs`'."""
    h_BxLxD, w, vocab_axis = self.head_inputs(
      params, tokens_BxL, materialize, run_layers, segments_BxL
    )
    return head_logits(HEAD_EQUATIONS[vocab_axis], h_BxLxD, w)

  def token_losses(
    self,
    params,
    tokens_BxL,
    targets_BxL,
    materialize: Callable = _identity,
    run_layers: Callable | None = None,
    segments_BxL=None,
  ):
    """Each token's cross-entropy against its target (fp32, B x L): where the vocabulary needs
    several tiles (`vocab_tiled`), from the head's product tiled over the vocabulary
    (models/loss.py), equal within fp32 rounding to `token_cross_entropy(self.apply(...),
    targets_BxL)` without its B x L x V logits; else that. Arguments as `head_inputs`'."""
    if not self.vocab_tiled:  # the whole logits
      h_BxLxD, w, vocab_axis = self.head_inputs(
        params, tokens_BxL, materialize, run_layers, segments_BxL
      )
      with jax.named_scope("cross_entropy"):
        logits_BxLxV = head_logits(HEAD_EQUATIONS[vocab_axis], h_BxLxD, w)
        return token_cross_entropy(logits_BxLxV, targets_BxL)
    tiled = self._tiled_head_inputs(params, tokens_BxL, materialize, run_layers, segments_BxL)
    h_BxLxD, head, vocab_axis, head_take = tiled
    B, L, D = h_BxLxD.shape
    with jax.named_scope("cross_entropy"):
      ce_T = tiled_cross_entropy(
        h_BxLxD.reshape(B * L, D),
        head,
        targets_BxL.reshape(B * L),
        vocab_axis,
        self.vocab_chunk,
        head_take,
      )
    return ce_T.reshape(B, L)

  def token_scores(
    self, params, tokens_BxL, targets_BxL, materialize: Callable = _identity, segments_BxL=None
  ):
    """(each target's log-probability, fp32 B x L; whether it is its logits' argmax, the first
    column of the max on a tie as `jnp.argmax`, bool B x L), for evaluation (no gradient):
    where the vocabulary needs several tiles, from the head's product tiled over the vocabulary
    (models/loss.py `tiled_scores`), equal to those of `self.apply(...)`'s logits without its
    B x L x V of them; else from those logits. Arguments as `head_inputs`'."""
    if not self.vocab_tiled:  # the whole logits
      logits_BxLxV = self.apply(params, tokens_BxL, materialize, None, segments_BxL)
      logp_BxLxV = jax.nn.log_softmax(logits_BxLxV, axis=-1)
      target_BxL = jnp.take_along_axis(logp_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]
      return target_BxL, jnp.argmax(logits_BxLxV, axis=-1) == targets_BxL
    tiled = self._tiled_head_inputs(params, tokens_BxL, materialize, None, segments_BxL)
    h_BxLxD, head, vocab_axis, head_take = tiled
    B, L, D = h_BxLxD.shape
    flat = (h_BxLxD.reshape(B * L, D), head, targets_BxL.reshape(B * L), vocab_axis)
    logp_T, greedy_T = tiled_scores(*flat, self.vocab_chunk, head_take)
    return logp_T.reshape(B, L), greedy_T.reshape(B, L)

  def _tiled_head_inputs(self, params, tokens_BxL, materialize, run_layers, segments_BxL):
    """`head_inputs` in vocabulary tiles: (the final norm's output B x L x D, the head as stored
    (the table, tied), its vocabulary axis, the `take` that makes a tile of it whole in the
    compute dtype). The table is looked up one tile at a time, each made whole by `materialize`
    (models/loss.py); no device holds it or the head whole."""
    lookup_take = lambda part: materialize(part).astype(self.dtype)
    table = params["embed"]["embedding"]
    x_BxLxD = tiled_lookup(table, tokens_BxL, self.vocab_chunk, lookup_take)
    x_BxLxD = self._layer_stack(params, x_BxLxD, materialize, run_layers, segments_BxL)
    norm = {"params": materialize(params["head"]["norm"])}
    h_BxLxD = RMSNorm(self.cfg.norm_eps).apply(norm, x_BxLxD)
    head, vocab_axis = (table, 0) if self.cfg.tie_embeddings else (params["head"]["kernel"], 1)
    head_take = lambda part: materialize(part).astype(h_BxLxD.dtype)
    return h_BxLxD, head, vocab_axis, head_take

  def head_inputs(
    self,
    params,
    tokens_BxL,
    materialize: Callable = _identity,
    run_layers: Callable | None = None,
    segments_BxL=None,
  ):
    """(the final norm's output B x L x D, the head's projection, its vocabulary axis): the
    embedding, the layer stack (`_layer_stack`), then `Head.project`. `materialize(subtree)`
    returns full weights for a subtree. Tied, the table is one parameter with two uses: gathered
    once per micro-batch, it serves as the embedding and as the head, and autodiff adds the two
    uses' gradients before its one reduce-scatter into its sink. The full table is then alive
    through the layer stack, and its full gradient through backward, where an untied model
    drops each table after its use.
    """
    embed_weights = materialize(params["embed"])
    x_BxLxD = self.embed.apply({"params": embed_weights}, tokens_BxL)
    x_BxLxD = self._layer_stack(params, x_BxLxD, materialize, run_layers, segments_BxL)
    table_VxD = embed_weights["embedding"] if self.cfg.tie_embeddings else None
    head_weights = {"params": materialize(params["head"])}
    return self.head.apply(head_weights, x_BxLxD, table_VxD, method=Head.project)

  def _layer_stack(self, params, x_BxLxD, materialize, run_layers, segments_BxL):
    """The layer stack's output for its input `x_BxLxD`.

    `run_layers(block_fn, x_BxLxD, stacked_layer_params) -> x_BxLxD`, if given, runs the whole
    layer stack instead of the default scan: `block_fn(x_BxLxD, full_layer_weights)` is one
    layer whose weights are already full, and `stacked_layer_params` is `params["layers"]` as
    stored (leading `layers` axis, not materialized). The caller then owns the gathering,
    rematerialisation and gradient routing of the stack (the engine uses it to prefetch the
    next layer's weights, paro_jax/core/prefetch.py). Without it: `lax.scan` over the layers, each
    under `jax.checkpoint` with the model's remat policy, weights through `materialize`.

    `segments_BxL` (int32; None: one sequence per row): several examples packed in a row, each
    a run of equal ids (0 for padding). Each example attends only to itself and its positions
    start at 0, so its logits are those it would get alone in a row.
    """
    if segments_BxL is None:
      sin, cos = rope_tables(x_BxLxD.shape[1], self.cfg)
    else:
      sin, cos = segment_rope_tables(segments_BxL, self.cfg)

    def layer(x_BxLxD, layer_params):
      with jax.named_scope("layer"):
        weights = {"params": materialize(layer_params)}
        return self.block.apply(weights, x_BxLxD, sin, cos, segments_BxL), None

    if REMAT_POLICIES[self.remat] is not None:
      # Recompute each layer (its parameter gather included) in backward: only one layer's full
      # weights are alive at a time. The embedding and head are not recomputed: the head is the
      # last op of forward and the first of backward, and the embedding's gradient needs only
      # the token ids.
      layer = jax.checkpoint(layer, policy=REMAT_POLICIES[self.remat])
    if run_layers is None:
      return lax.scan(layer, x_BxLxD, params[LAYERS])[0]

    def block_fn(x_BxLxD, layer_weights):
      with jax.named_scope("layer"):
        return self.block.apply({"params": layer_weights}, x_BxLxD, sin, cos, segments_BxL)

    return run_layers(block_fn, x_BxLxD, params[LAYERS])

  def decode(self, params, tokens_BxL, cache: KVCache, materialize: Callable = _identity):
    """(the fp32 logits of each row's last token, B x V; the cache with the tokens' keys and
    values written in): the tokens fill slots length.. length+L-1 of each row and attend to
    its earlier slots (a prompt's prefill, then one token per step). A row's positions count
    from its `start_B`, so a left-padded row is rotated as it would be alone; the logits equal
    `apply`'s at the same tokens. The layers run in a scan without remat (no backward)."""
    L = tokens_BxL.shape[1]
    positions_BxL = cache.length + jnp.arange(L)[None, :] - cache.start_B[:, None]
    angles_BxLxK2 = jnp.maximum(positions_BxL, 0).astype(jnp.float32)[..., None]
    angles_BxLxK2 = angles_BxLxK2 * inverse_frequencies(self.cfg)
    sin, cos = jnp.sin(angles_BxLxK2), jnp.cos(angles_BxLxK2)

    def layer(x_BxLxD, inputs):
      layer_params, k_BxTxGxK, v_BxTxGxK = inputs
      with jax.named_scope("layer"):
        weights = {"params": materialize(layer_params)}
        layer_cache = (k_BxTxGxK, v_BxTxGxK, cache.start_B, cache.length)
        return self.block.apply(weights, x_BxLxD, sin, cos, None, layer_cache)

    embed_weights = materialize(params["embed"])
    x_BxLxD = self.embed.apply({"params": embed_weights}, tokens_BxL)
    x_BxLxD, (k, v) = lax.scan(
      layer, x_BxLxD, (params[LAYERS], cache.k_NxBxTxGxK, cache.v_NxBxTxGxK)
    )
    table_VxD = embed_weights["embedding"] if self.cfg.tie_embeddings else None
    head = {"params": materialize(params["head"])}
    logits_Bx1xV = self.head.apply(head, x_BxLxD[:, -1:], table_VxD)
    return logits_Bx1xV[:, 0], KVCache(k, v, cache.start_B, cache.length + L)


@flax.struct.dataclass
class KVCache:
  """What decoding keeps between steps: each layer's keys and values (N x B x T x G x K, after
  RoPE) in T slots per row, each row's tokens in consecutive slots from `start_B` (the slots
  before it are the row's left padding, seen by no query), and `length`, the slots written."""

  k_NxBxTxGxK: jax.Array
  v_NxBxTxGxK: jax.Array
  start_B: jax.Array  # int32
  length: jax.Array  # int32, a scalar

  @classmethod
  def empty(cls, cfg: LlamaConfig, start_B, slots: int, dtype) -> KVCache:
    """A cache of `slots` slots per row, nothing written; `start_B`: each row's padding."""
    shape = (cfg.layers, start_B.shape[0], slots, cfg.kv_heads, cfg.head_dim)
    zeros = jnp.zeros(shape, dtype)
    return cls(zeros, zeros, jnp.asarray(start_B, jnp.int32), jnp.zeros((), jnp.int32))


def token_cross_entropy(logits_BxLxV, targets_BxL):
  """Each token's cross-entropy, in fp32 (B x L).

  With one-hot labels (`optax.softmax_cross_entropy`) rather than integer ones: the one-hot is an
  iota compare that XLA fuses, so the logits' cotangent (softmax less the one-hot) is one
  elementwise kernel, with its rounding to the compute dtype (`head_logits`) in it. Integer
  labels pick each target's logit with a gather, whose transpose is a scatter-add: a kernel of
  its own that reads and writes the fp32 cotangent, and one more to round it (for 7b, 1.0 GB
  more per micro-batch of 2048 tokens)."""
  import optax  # local: models/ does not otherwise need optax

  logits = logits_BxLxV.astype(jnp.float32)
  labels = jax.nn.one_hot(targets_BxL, logits.shape[-1], dtype=jnp.float32)
  return optax.softmax_cross_entropy(logits, labels)


def next_token_loss(logits_BxLxV, targets_BxL):
  """Mean cross-entropy in fp32."""
  return token_cross_entropy(logits_BxLxV, targets_BxL).mean()


def weighted_token_loss(logits_BxLxV, targets_BxL, weights_BxL):
  """The sum of the cross-entropies (fp32) of the targets whose weight is 1 (0: not a target,
  e.g. a prompt or padding token). A sum, not a mean: the caller divides by the target count of
  the whole step, so that micro-batches and devices with more targets weigh more."""
  return weighted_sum(token_cross_entropy(logits_BxLxV, targets_BxL), weights_BxL)


def weighted_sum(ce_BxL, weights_BxL):
  """The sum of the token losses whose weight is 1 (`weighted_token_loss` of given losses)."""
  # where, not a product: a padding position's loss must not reach the sum even if not finite
  return jnp.sum(jnp.where(weights_BxL > 0, ce_BxL, 0.0))
