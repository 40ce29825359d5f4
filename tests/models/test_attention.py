"""--attention: the written-out attention (every CPU run) and the fused kernel (GPUs) agree.

cuDNN's kernel cannot run on a CPU. What the model adds around it is checked here: the fused
path (`models.attention.fused_attention`, jax.nn.dot_product_attention) is run with XLA's
implementation of the same call and must give the written-out attention's logits and gradients,
so the layout, grouped-query heads, causal mask and scale are wired the same way. That the GPU
program really uses cuDNN's kernel is checked on the compiled program
(tests/analysis/test_gpu_program.py).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import attention as attention_module
from models.llama import Llama
from models.loss import next_token_loss
from models.config import LlamaConfig, resolve_attention

CFG = LlamaConfig(vocab=64, dim=64, layers=2, heads=4, kv_heads=2, head_dim=16, mlp=96)


@pytest.mark.parametrize(
  "requested,platform,dtype,head_dim,want",
  [
    ("auto", "cpu", jnp.bfloat16, 128, "xla"),
    ("auto", "cuda", jnp.bfloat16, 128, "cudnn"),
    ("auto", "gpu", jnp.bfloat16, 32, "cudnn"),
    ("auto", "cuda", jnp.float32, 128, "xla"),  # the kernel takes bf16/fp16 only
    ("auto", "cuda", jnp.bfloat16, 12, "xla"),  # head dim not a multiple of 8
    ("auto", "cuda", jnp.bfloat16, 256, "xla"),
    ("xla", "cuda", jnp.bfloat16, 128, "xla"),
    ("cudnn", "cuda", jnp.bfloat16, 64, "cudnn"),
  ],
)
def test_resolution(requested, platform, dtype, head_dim, want):
  got, why = resolve_attention(requested, platform, dtype, head_dim)
  assert got == want and why


@pytest.mark.parametrize(
  "platform,dtype,head_dim,message",
  [
    ("cpu", jnp.bfloat16, 64, "--attention cudnn needs NVIDIA GPUs (this run is on cpu)"),
    ("cuda", jnp.float32, 64, "--attention cudnn needs --dtype bf16"),
    ("cuda", jnp.bfloat16, 20, "a multiple of 8 and at most 128 (got bfloat16, 20)"),
  ],
)
def test_cudnn_where_it_cannot_run_is_an_error(platform, dtype, head_dim, message):
  with pytest.raises(ValueError, match="use --attention xla") as e:
    resolve_attention("cudnn", platform, dtype, head_dim)
  assert message in str(e.value)


def test_unknown_attention():
  with pytest.raises(ValueError, match="unknown --attention 'flash'"):
    resolve_attention("flash", "cpu", jnp.float32, 64)
  with pytest.raises(ValueError, match="must be resolved"):
    Llama(CFG, attention="auto")


# Mistral's sliding window (5, of rows of 32): the fused call's local window as the written mask.
WINDOWED = dataclasses.replace(CFG, family="mistral", sliding_window=5)


@pytest.mark.parametrize("cfg", [CFG, WINDOWED], ids=["causal", "sliding-window"])
def test_fused_path_equals_written_out(monkeypatch, cfg):
  """Logits and gradients of the whole model, fp32: fused path (XLA's kernel) = written out."""
  written = Llama(cfg, jnp.float32)
  params = written.init(jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, cfg.vocab)
  calls = []
  kernel = attention_module.fused_attention

  def on_cpu(q, k, v, implementation, sliding_window=None):
    calls.append(implementation)
    return kernel(q, k, v, "xla", sliding_window)

  monkeypatch.setattr(attention_module, "fused_attention", on_cpu)
  fused = Llama(cfg, jnp.float32, attention="cudnn")

  def loss(model, p):
    return next_token_loss(model.apply(p, tokens[:, :-1]), tokens[:, 1:])

  want_loss, want_grads = jax.value_and_grad(lambda p: loss(written, p))(params)
  assert not calls
  got_loss, got_grads = jax.value_and_grad(lambda p: loss(fused, p))(params)
  assert calls and set(calls) == {"cudnn"}  # the model asked for the fused kernel
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
  for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-6)
  logits = fused.apply(params, tokens[:, :-1])
  np.testing.assert_allclose(logits, written.apply(params, tokens[:, :-1]), rtol=1e-5, atol=1e-5)


def test_the_parameters_do_not_depend_on_the_attention():
  a = Llama(CFG, jnp.bfloat16).init(jax.random.key(3))
  b = Llama(CFG, jnp.bfloat16, attention="cudnn").init(jax.random.key(3))  # traces on CPU
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)
