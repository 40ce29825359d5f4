"""The output head's backward runs in the compute dtype (models/layers.py `head_logits`).

The logits are fp32, so their cotangent is fp32; differentiated plainly, both backward matmuls
then took an fp32 operand (fp32/TF32 GEMMs on a GPU). `head_logits` rounds the cotangent once to
the compute dtype. Checked here: no matmul of the bf16 loss's gradient takes an fp32 operand,
the gradients equal plain differentiation's within bf16 rounding of the cotangent (and exactly
in fp32), for the untied head and the tied one.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import LlamaConfig
from models.layers import Head, RMSNorm
from models.loss import next_token_loss

B, L = 2, 16


def _cfg(tied: bool):
  return LlamaConfig(vocab=96, dim=32, layers=1, heads=4, kv_heads=2, head_dim=8, mlp=64,
                     tie_embeddings=tied)  # fmt: skip


def _inputs(cfg):
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k1, (B, L, cfg.dim), jnp.float32)
  table = 0.02 * jax.random.normal(k2, (cfg.vocab, cfg.dim), jnp.float32)
  targets = jax.random.randint(k3, (B, L), 0, cfg.vocab)
  params = nn.meta.unbox(Head(cfg).init(jax.random.key(1), x, table)["params"])
  return x, table, targets, params


def _loss(cfg, dtype, plain: bool = False):
  """The head's loss of (x, table, params) in `dtype`; `plain`: the einsum differentiated
  plainly (the head before `head_logits`), as the reference."""

  def loss(x, table, params):
    x, table = x.astype(dtype), table.astype(dtype)
    if not plain:
      logits = Head(cfg).apply({"params": params}, x, table)
    else:
      h = RMSNorm(cfg.norm_eps).apply({"params": params["norm"]}, x)
      if cfg.tie_embeddings:
        logits = jnp.einsum("bld,vd->blv", h, table, preferred_element_type=jnp.float32)
      else:
        w = params["kernel"].astype(dtype)
        logits = jnp.einsum("bld,dv->blv", h, w, preferred_element_type=jnp.float32)
    return next_token_loss(logits, TARGETS[cfg.tie_embeddings])

  return loss


TARGETS = {t: _inputs(_cfg(t))[2] for t in (False, True)}


def dot_generals(jaxpr):
  """Every dot_general of a jaxpr, nested jaxprs (custom_vjp, pjit, scan) included."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      yield eqn
    for p in eqn.params.values():
      for q in p if isinstance(p, (list, tuple)) else (p,):
        inner = getattr(q, "jaxpr", q)
        if isinstance(inner, jax.extend.core.Jaxpr):
          yield from dot_generals(inner)


@pytest.mark.parametrize("tied", [False, True])
def test_no_matmul_of_the_bf16_gradient_takes_fp32(tied):
  cfg = _cfg(tied)
  x, table, _, params = _inputs(cfg)
  grad = jax.grad(_loss(cfg, jnp.bfloat16), argnums=(0, 1, 2))
  dots = list(dot_generals(jax.make_jaxpr(grad)(x, table, params).jaxpr))
  # the forward product (in the custom_vjp's primal and its forward rule) and its two transposes
  assert len(dots) >= 3
  operands = [[str(v.aval.dtype) for v in eqn.invars] for eqn in dots]
  assert all(o == ["bfloat16", "bfloat16"] for o in operands), operands
  # the check can fail: differentiated plainly, the transposes take the fp32 cotangent
  plain = jax.grad(_loss(cfg, jnp.bfloat16, plain=True), argnums=(0, 1, 2))
  plain_dots = list(dot_generals(jax.make_jaxpr(plain)(x, table, params).jaxpr))
  assert any("float32" in [str(v.aval.dtype) for v in eqn.invars] for eqn in plain_dots)


@pytest.mark.parametrize("tied", [False, True])
def test_gradients_equal_plain_differentiation(tied):
  cfg = _cfg(tied)
  x, table, _, params = _inputs(cfg)
  args = (x, table, params)
  grads = lambda dtype, plain: jax.grad(_loss(cfg, dtype, plain), argnums=(0, 1, 2))(*args)
  # fp32: the cotangent's rounding to the compute dtype is a no-op, so the same gradients
  for a, b in zip(jax.tree.leaves(grads(jnp.float32, False)),
                  jax.tree.leaves(grads(jnp.float32, True))):  # fmt: skip
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  # bf16: the cotangent rounded once to bf16 (relative 2^-9) before both matmuls; each gradient
  # within 1% of its largest element of plain differentiation's, which keeps it in fp32
  for a, b in zip(jax.tree.leaves(grads(jnp.bfloat16, False)),
                  jax.tree.leaves(grads(jnp.bfloat16, True))):  # fmt: skip
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.max(np.abs(a - b)) <= 1e-2 * np.max(np.abs(b)), (np.max(np.abs(a - b)), np.max(b))
