"""The model's layers besides attention: RMSNorm, the SwiGLU MLP, the embedding, and the output
head (its own D x V kernel, or the embedding table when tied), whose logits are fp32 and whose
backward runs in the compute dtype (`head_logits`). Every parameter is declared once, with its
logical axes (`normal_init`)."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from models.config import LlamaConfig, LoraConfig
from models.lora import lora_delta


def normal_init(std: float, axes: tuple[str, ...]):
  """A weight's initializer, normal with `std`, and its logical axes (the sharding layer's)."""
  return nn.with_logical_partitioning(nn.initializers.normal(std), axes)


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


class MLP(nn.Module):
  cfg: LlamaConfig
  lora: LoraConfig | None = None

  @nn.compact
  def __call__(self, x_BxLxD):
    c, dt = self.cfg, x_BxLxD.dtype
    w_gate_DxF = self.param("w_gate", normal_init(c.init_std, ("embed", "mlp")), (c.dim, c.mlp))
    w_up_DxF = self.param("w_up", normal_init(c.init_std, ("embed", "mlp")), (c.dim, c.mlp))
    w_down_FxD = self.param("w_down", normal_init(c.init_std, ("mlp", "embed")), (c.mlp, c.dim))
    lora = lambda name, x, out_shape, in_axis="embed", out_axis="lora_out": lora_delta(
      self, self.lora, name, x, in_axis, out_axis, out_shape
    )
    gate_BxLxF = x_BxLxD @ w_gate_DxF.astype(dt) + lora("w_gate", x_BxLxD, (c.mlp,))
    up_BxLxF = x_BxLxD @ w_up_DxF.astype(dt) + lora("w_up", x_BxLxD, (c.mlp,))
    h_BxLxF = jax.nn.silu(gate_BxLxF) * up_BxLxF
    return h_BxLxF @ w_down_FxD.astype(dt) + lora(
      "w_down", h_BxLxF, (c.dim,), in_axis="lora_in", out_axis="embed"
    )


class Embed(nn.Module):
  cfg: LlamaConfig
  dtype: Any

  @nn.compact
  def __call__(self, tokens_BxL):
    table_VxD = self.param(
      "embedding",
      normal_init(self.cfg.init_std, ("vocab", "embed")),
      (self.cfg.vocab, self.cfg.dim),
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
      "kernel", normal_init(self.cfg.init_std, ("embed", "vocab")), (self.cfg.dim, self.cfg.vocab)
    )
    return x_BxLxD, w_DxV.astype(x_BxLxD.dtype), 1


# The logits' einsum by the projection's vocabulary axis: 1 for the head's kernel, 0 for the table.
HEAD_EQUATIONS = {1: "bld,dv->blv", 0: "bld,vd->blv"}
