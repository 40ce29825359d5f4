"""Grouped-query attention: the module (its q/k/v/o projections, Qwen2's biases, Qwen3's q/k
norms, RoPE, LoRA adapters) and its ways to attend: written out (an fp32 softmax under a causal,
per-example or sliding-window mask, or over a decoding cache, `KVCache`), through
jax.nn.dot_product_attention (XLA's or cuDNN's kernel), and cuDNN's kernel over packed rows."""

from __future__ import annotations

import math

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from models.config import MAX_SEGMENTS, LlamaConfig, LoraConfig
from models.layers import RMSNorm, normal_init
from models.lora import lora_delta
from models.rope import apply_rope


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
    weight = lambda name, axes, shape: self.param(name, normal_init(c.init_std, axes), shape)
    wq_DxHxK = weight("wq", ("embed", "heads", "head_dim"), (D, H, K))
    wk_DxGxK = weight("wk", ("embed", "kv_heads", "head_dim"), (D, G, K))
    wv_DxGxK = weight("wv", ("embed", "kv_heads", "head_dim"), (D, G, K))
    wo_HxKxD = weight("wo", ("heads", "head_dim", "embed"), (H, K, D))
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
