"""Decoding with a KV cache (models/llama.py `Llama.decode`) against the training forward
without one (`Llama.apply`, itself checked against transformers in tests/models/test_llama3.py
and tests/hf/test_families.py): each step's logits are those of the whole sequence so far
recomputed from scratch, for left-padded rows of different lengths, in every family's shape
(tied head and llama3 RoPE scaling, Qwen2's biases, Qwen3's q/k norms, Mistral's sliding
window shorter than the sequence, LoRA adapters on every weight, grouped-query attention
throughout)."""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import LlamaConfig, LoraConfig, RopeScaling
from models.attention import KVCache
from models.llama import Llama

BASE = LlamaConfig(vocab=61, dim=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp=64)
CONFIGS = {
  "tied_llama3_rope": dataclasses.replace(
    BASE,
    tie_embeddings=True,
    rope_scaling=RopeScaling("llama3", 8.0, original_max_position_embeddings=16),
  ),
  "qwen2_biases": dataclasses.replace(BASE, family="qwen2"),
  "qwen3_qk_norm": dataclasses.replace(BASE, family="qwen3"),
  "mistral_window": dataclasses.replace(BASE, family="mistral", sliding_window=3),
  "lora": BASE,  # with adapters on every weight (LORA)
}
LORA = LoraConfig(rank=2, targets=("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"))
PROMPTS = (5, 2, 7)  # tokens per row: the shorter rows are left-padded to 7
STEPS = 4


def randomized(model, seed):
  """Parameters whose biases and norm scales are not their zero/one initial values (else a
  family's switch would compute as if off)."""
  params = model.init(jax.random.key(seed))
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  return treedef.unflatten(
    [w + 0.1 * jax.random.normal(k, w.shape, w.dtype) for w, k in zip(leaves, keys)]
  )


@pytest.mark.parametrize("name", CONFIGS)
def test_cached_decode_equals_the_full_forward_recomputed(name):
  cfg = CONFIGS[name]
  model = Llama(cfg, lora=LORA if name == "lora" else None)
  params = randomized(model, 0)  # B of each adapter too: not zero
  rng = np.random.default_rng(1)
  rows = [rng.integers(0, cfg.vocab, n) for n in PROMPTS]
  longest, total = max(PROMPTS), max(PROMPTS) + STEPS
  tokens = np.zeros((len(rows), longest), np.int32)
  start = np.array([longest - len(r) for r in rows], np.int32)
  for b, r in enumerate(rows):
    tokens[b, start[b] :] = r
  # The reference: each row alone, unpadded, right-padded to one length (a causal model's
  # logits at t do not depend on later tokens), so that one program serves every step.
  full = jax.jit(lambda p, t: model.apply(p, t))
  decode = jax.jit(model.decode)
  cache = KVCache.empty(cfg, jnp.asarray(start), total, jnp.float32)
  logits, cache = decode(params, jnp.asarray(tokens), cache)
  sequences = [list(r) for r in rows]
  for step in range(STEPS):
    for b, seq in enumerate(sequences):
      padded = np.zeros((1, total), np.int32)
      padded[0, : len(seq)] = seq
      want = full(params, jnp.asarray(padded))[0, len(seq) - 1]
      np.testing.assert_allclose(logits[b], want, rtol=2e-5, atol=2e-5, err_msg=f"{name} {step}")
    # The next tokens are drawn at random, not argmax: rows that repeat themselves would not
    # show a cache slot read at the wrong position.
    new = rng.integers(0, cfg.vocab, len(rows)).astype(np.int32)
    for b, seq in enumerate(sequences):
      seq.append(int(new[b]))
    logits, cache = decode(params, jnp.asarray(new[:, None]), cache)
  assert int(cache.length) == longest + STEPS


def test_the_window_and_a_damaged_cache_slot_show():
  """The comparison can fail: a cached key damaged in a slot the window sees changes the next
  token's logits; one in a slot out of the window (3 tokens: itself and 2 before) does not."""
  cfg = CONFIGS["mistral_window"]
  model = Llama(cfg)
  params = randomized(model, 0)
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab, (1, 6)), jnp.int32)
  want = jax.jit(model.apply)(params, tokens)[0, -1]
  decode = jax.jit(model.decode)
  _, cache = decode(
    params, tokens[:, :5], KVCache.empty(cfg, jnp.zeros(1, jnp.int32), 8, jnp.float32)
  )

  def damaged(slot):
    k = cache.k_NxBxTxGxK.at[:, :, slot].set(0.0)
    return decode(params, tokens[:, 5:], dataclasses.replace(cache, k_NxBxTxGxK=k))[0][0]

  np.testing.assert_allclose(damaged(2), want, rtol=2e-5, atol=2e-5)  # slot 2: out of sight
  assert not np.allclose(damaged(3), want, rtol=1e-3, atol=1e-3)


def _vocab_buffers(hlo: str, vocab: int) -> set[tuple[int, ...]]:
  """The fp32 buffers with a vocabulary axis, by how many entries they hold across it."""
  shapes = {tuple(int(d) for d in s.split(",") if d) for s in re.findall(r"f32\[([0-9,]*)\]", hlo)}
  return {math.prod(s) // vocab for s in shapes if vocab in s}


def test_the_prefill_takes_the_head_at_the_last_position_only():
  """A prompt's prefill needs only its last position's logits (the next token's): its compiled
  program holds B x V fp32 of them and nothing of B x L x V, which the whole forward of the same
  tokens holds (the check can see them). B x L = 2 x 40, above the head's D = 32 rows."""
  cfg = BASE
  model = Llama(cfg)
  params = jax.eval_shape(model.init, jax.random.key(0))
  tokens = jax.ShapeDtypeStruct((2, 40), jnp.int32)
  cache = KVCache.empty(cfg, jnp.zeros(2, jnp.int32), 48, jnp.float32)
  prefill = jax.jit(model.decode).lower(params, tokens, cache).compile().as_text()
  whole = jax.jit(model.apply).lower(params, tokens).compile().as_text()
  assert 2 * 40 in _vocab_buffers(whole, cfg.vocab)
  assert 2 in _vocab_buffers(prefill, cfg.vocab)
  assert max(_vocab_buffers(prefill, cfg.vocab)) < 2 * 40
