"""Rotary position embeddings (RoPE) as transformers computes them: the inverse frequencies with
the config's scaling (none, linear or llama3), the sin and cos tables for rows of one sequence or
of packed examples (each example's positions from 0), and the rotation of each head's halves."""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from models.config import LlamaConfig


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
