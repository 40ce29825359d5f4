"""Llama checkpoints as Hugging Face ships them today, against transformers' own numbers.

The references are tests/fixtures/hf_llama, written by transformers
(tests/fixtures/make_hf_llama.py): one tiny random model per configuration (Llama 2 MHA, Llama 3
GQA, Llama 3.1's llama3 RoPE scaling, Llama 3.2's tied embeddings with it, an explicit head_dim,
a vocabulary of 1001), with transformers' per-window losses on a fixed text and its RoPE inverse
frequencies. No torch is
needed here; with torch and transformers installed the live tests compute the same numbers
with transformers itself.
"""

import copy
import dataclasses
import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import LlamaConfig, RopeScaling
from models.hf_config import config_from_hf, read_config
from models.presets import PRESETS
from paro_jax.hf.weights import load_hf
from models.llama import Llama
from models.loss import next_token_loss
from models.rope import inverse_frequencies
from paro_jax import cli
from paro_jax.core.state import OptimConfig
from paro_jax.core.engine import Engine
from paro_jax.core.mesh import make_mesh
from paro_jax.core.strategy import parse_strategy
from paro_jax.run.reference import reference_train

FIXTURES = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "hf_llama"
)
with open(os.path.join(FIXTURES, "losses.json")) as _f:
  REF = json.load(_f)
VARIANTS = sorted(k for k in os.listdir(FIXTURES) if os.path.isdir(os.path.join(FIXTURES, k)))
LLAMA3 = dict(rope_theta=500_000.0, kv_heads=2, heads=4, dim=32, head_dim=8, vocab=288)

# What each variant's config.json says, written out by hand from make_hf_llama.py's VARIANTS.
EXPECTED = {
  "llama2_mha": dict(LLAMA3, kv_heads=4, rope_theta=10_000.0),
  "llama3_gqa": LLAMA3,
  "llama31_rope": dict(LLAMA3, rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 256)),
  "llama32_tied": dict(
    LLAMA3, rope_scaling=RopeScaling("llama3", 32.0, 1.0, 4.0, 256), tie_embeddings=True
  ),
  "head_dim": dict(LLAMA3, head_dim=16),
  "odd_vocab": dict(LLAMA3, vocab=1001, dim=16, heads=2, kv_heads=1),
}


def hf_config(directory) -> dict:
  with open(os.path.join(directory, "config.json")) as f:
    return json.load(f)


def windows(variant: str) -> np.ndarray:
  """The fixture's windows: consecutive, non-overlapping, SEQ_LEN + 1 tokens from token 0."""
  ids, s = REF[variant]["token_ids"], REF[variant]["seq_len"]
  n = len(ids) // (s + 1)
  return np.asarray(ids[: n * (s + 1)], np.int32).reshape(n, s + 1)


@functools.cache
def loaded(variant: str):
  return load_hf(os.path.join(FIXTURES, variant))


def window_losses(cfg: LlamaConfig, params, tokens_NxL1) -> np.ndarray:
  """Our fp32 forward's mean next-token loss of each window."""
  model = Llama(cfg, jnp.float32)

  @jax.jit
  def per_window(params, tokens_NxL1):
    logits = model.apply(params, tokens_NxL1[:, :-1])
    return jax.vmap(next_token_loss)(logits[:, None], tokens_NxL1[:, None, 1:])

  return np.asarray(per_window(jax.tree.map(jnp.asarray, params), jnp.asarray(tokens_NxL1)))


# --- against transformers' committed numbers ------------------------------------------------
def test_every_variant_has_a_reference():
  assert VARIANTS == sorted(EXPECTED) and set(VARIANTS) < set(REF)


@pytest.mark.parametrize("variant", VARIANTS)
def test_config_reads_as_written(variant):
  cfg = read_config(os.path.join(FIXTURES, variant))
  for field, want in EXPECTED[variant].items():
    assert getattr(cfg, field) == want, field
  # The rest is the default: plain RoPE, an untied head.
  assert cfg.rope_scaling == EXPECTED[variant].get("rope_scaling")
  assert cfg.tie_embeddings == EXPECTED[variant].get("tie_embeddings", False)


@pytest.mark.parametrize("variant", VARIANTS)
def test_rope_frequencies_are_transformers(variant):
  cfg, _ = loaded(variant)
  np.testing.assert_allclose(inverse_frequencies(cfg), REF[variant]["inv_freq"], rtol=1e-6)


@pytest.mark.parametrize("case", sorted(REF["rope_cases"]))
def test_rope_cases_are_transformers(case):
  """Linear scaling (both spellings, the old `type` key too), the real Llama 3.1 8B and 3.2 1B
  RoPE, and llama3 without original_max_position_embeddings."""
  shapes = {"vocab_size": 256, "num_hidden_layers": 1, "intermediate_size": 64}
  cfg = config_from_hf({**shapes, **REF["rope_cases"][case]["config"]})
  want = REF["rope_cases"][case]["inv_freq"]
  np.testing.assert_allclose(inverse_frequencies(cfg), want, rtol=1e-6)


@pytest.mark.parametrize("variant", VARIANTS)
def test_window_losses_equal_transformers(variant):
  cfg, params = loaded(variant)
  ours = window_losses(cfg, params, windows(variant))
  np.testing.assert_allclose(ours, REF[variant]["window_losses"], rtol=1e-4)
  np.testing.assert_allclose(ours.mean(), REF[variant]["mean_loss"], rtol=1e-4)


@pytest.mark.parametrize("variant", ["llama31_rope", "llama32_tied"])
def test_the_rope_scaling_shows_in_the_losses(variant):
  """Without its scaling the model scores far outside the 1e-4 the test above allows: the
  comparison sees the RoPE."""
  cfg, params = loaded(variant)
  plain = dataclasses.replace(cfg, rope_scaling=None)
  ours = window_losses(plain, params, windows(variant))
  assert np.abs(ours / np.asarray(REF[variant]["window_losses"]) - 1).max() > 1e-2


def test_tied_fixture_has_one_table():
  cfg, params = loaded("llama32_tied")
  assert set(params["head"]) == {"norm"} and params["embed"]["embedding"].shape == (288, 32)
  assert cfg.param_count() == sum(x.size for x in jax.tree.leaves(params))


# --- the two spellings ----------------------------------------------------------------------
def transformers4(hf: dict) -> dict:
  """transformers 5's `rope_parameters` written as transformers 4's `rope_theta`/`rope_scaling`."""
  hf = copy.deepcopy(hf)
  rope = hf.pop("rope_parameters")
  hf["rope_theta"] = rope.pop("rope_theta")
  hf["rope_scaling"] = None if rope["rope_type"] == "default" else rope
  return hf


def transformers5(hf: dict) -> dict:
  hf = copy.deepcopy(hf)
  rope = hf.pop("rope_scaling") or {"rope_type": "default"}
  hf["rope_parameters"] = {**rope, "rope_theta": hf.pop("rope_theta")}
  return hf


@pytest.mark.parametrize("variant", VARIANTS)
def test_both_spellings_read_alike(variant):
  hf = hf_config(os.path.join(FIXTURES, variant))
  other = transformers5(hf) if "rope_scaling" in hf else transformers4(hf)
  assert config_from_hf(other) == config_from_hf(hf)


# --- what stays refused -----------------------------------------------------------------------
BASE = hf_config(os.path.join(FIXTURES, "llama3_gqa"))
ROPE = BASE["rope_parameters"]


@pytest.mark.parametrize(
  "changes,message",
  [
    ({"rope_parameters": {**ROPE, "rope_type": "yarn", "factor": 4.0}}, "RoPE type 'yarn'"),
    ({"rope_parameters": {**ROPE, "rope_type": "dynamic", "factor": 2.0}}, "RoPE type 'dynamic'"),
    ({"rope_parameters": {**ROPE, "rope_type": "longrope"}}, "RoPE type 'longrope'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "RoPE type 'dynamic'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "has no low_freq_factor"),
    ({"rope_scaling": {"rope_type": "linear"}}, "RoPE type 'linear' has no factor"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    (
      {"rope_parameters": {"full_attention": ROPE, "sliding_attention": ROPE}},
      "only one RoPE for every layer",
    ),
    ({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]}, "'qwen3_moe'"),
    ({"model_type": "gemma", "architectures": ["GemmaForCausalLM"]}, "model_type 'gemma'"),
    ({"tie_word_embeddings": True, "vocab_size": 0}, "vocab must be positive"),
  ],
)
def test_unsupported_is_one_line_naming_it(changes, message):
  with pytest.raises(ValueError) as e:
    config_from_hf({**BASE, **changes}, "x/config.json")
  assert message in str(e.value) and "\n" not in str(e.value)
  assert str(e.value).startswith("x/config.json: unsupported HF config: ")


def test_a_tied_checkpoint_with_a_different_head_is_refused(tmp_path):
  from safetensors.numpy import load_file, save_file

  out = tmp_path / "tied"
  shutil.copytree(os.path.join(FIXTURES, "llama32_tied"), out)
  tensors = load_file(out / "model.safetensors")
  table = tensors["model.embed_tokens.weight"]
  # The same table stored twice (some tied checkpoints do) loads as one.
  save_file({**tensors, "lm_head.weight": table}, out / "model.safetensors")
  _, params = load_hf(out)
  np.testing.assert_array_equal(
    params["embed"]["embedding"], loaded("llama32_tied")[1]["embed"]["embedding"]
  )
  save_file({**tensors, "lm_head.weight": table + 1}, out / "model.safetensors")
  with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
    load_hf(out)


# --- odd vocabularies on any mesh -----------------------------------------------------------
@pytest.mark.parametrize("strategy", ["IIG", "GGG"])
def test_odd_vocabulary_trains_like_one_device(strategy):
  """A vocabulary of 1001 (no mesh divides it) under IIG and GGG on 2x4: the tables are sharded
  along `embed` (16 = 2 x 8), never along the vocabulary, and the steps equal the single-device
  loop."""
  cfg, params = loaded("odd_vocab")
  optim = OptimConfig(learning_rate=1e-2, warmup_steps=0, total_steps=2, clip_norm=0.5, eps=1e-6)
  ids = windows("odd_vocab")[:32]  # 2 steps of 2 micro-batches of 8 windows
  batches = [ids[:16].reshape(2, 8, -1), ids[16:].reshape(2, 8, -1)]
  engine = Engine(Llama(cfg), parse_strategy(strategy), make_mesh(2, 4), optim, micro_batches=2)
  state, losses = engine.state_from_params(params), []
  for batch in batches:
    state, metrics = engine.train_step(state, engine.shard_batch(batch))
    losses.append(float(metrics["loss"]))
  ref_losses, ref_params = reference_train(Llama(cfg), params, batches, optim)
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
  for x, y in zip(jax.tree.leaves(jax.device_get(state.master)), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(x, y, atol=2e-5)


# --- presets ----------------------------------------------------------------------------------
def _hf_llama3(hidden, layers, heads, mlp, factor, tied):
  """The fields of meta-llama's config.json for Llama 3.1 and 3.2 (transformers 4's spelling)."""
  return {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": hidden,
    "num_hidden_layers": layers,
    "num_attention_heads": heads,
    "num_key_value_heads": 8,
    "intermediate_size": mlp,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
      "factor": factor,
      "high_freq_factor": 4.0,
      "low_freq_factor": 1.0,
      "original_max_position_embeddings": 8192,
      "rope_type": "llama3",
    },
    "tie_word_embeddings": tied,
    "hidden_act": "silu",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
  }


# (HF config.json, the parameter count published for the model, in billions)
PUBLISHED = {
  "llama3.1-8b": (_hf_llama3(4096, 32, 32, 14336, 8.0, False), 8.03),
  "llama3.1-70b": (_hf_llama3(8192, 80, 64, 28672, 8.0, False), 70.6),
  "llama3.1-405b": (_hf_llama3(16384, 126, 128, 53248, 8.0, False), 405.9),
  "llama3.2-1b": (_hf_llama3(2048, 16, 32, 8192, 32.0, True), 1.24),
  "llama3.2-3b": (_hf_llama3(3072, 28, 24, 8192, 32.0, True), 3.21),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_are_the_published_configs(name):
  hf, billions = PUBLISHED[name]
  assert PRESETS[name] == config_from_hf({**hf, "initializer_range": 0.02})
  assert round(PRESETS[name].param_count() / 1e9, 1 if billions > 50 else 2) == billions


def test_plan_takes_a_llama3_preset(capsys):
  cli.main(["plan", "--model", "llama3.1-8b", "--nodes", "4", "--gpu", "h100", "--json"])
  plan = json.loads(capsys.readouterr().out)
  assert plan["inputs"]["model"] == "llama3.1-8b" and plan["pick"]
  assert plan["inputs"]["params"] == PRESETS["llama3.1-8b"].param_count() == 8_030_261_248


# --- live: transformers itself ----------------------------------------------------------------
def _transformers():
  pytest.importorskip("torch", reason="torch not installed: live transformers check skipped")
  return pytest.importorskip(
    "transformers", reason="transformers not installed: live transformers check skipped"
  )


@pytest.mark.parametrize("variant", VARIANTS)
def test_live_transformers_scores_the_fixture_as_we_do(variant):
  transformers = _transformers()
  import torch

  model = transformers.LlamaForCausalLM.from_pretrained(
    os.path.join(FIXTURES, variant), dtype=torch.float32, attn_implementation="eager"
  ).eval()
  tokens = torch.as_tensor(windows(variant)).long()
  with torch.no_grad():
    logits = model(input_ids=tokens[:, :-1]).logits.float()
  ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
  theirs = ce.mean(dim=1).numpy()
  cfg, params = loaded(variant)
  np.testing.assert_allclose(window_losses(cfg, params, windows(variant)), theirs, rtol=1e-4)
  # and the committed numbers are what this transformers computes
  np.testing.assert_allclose(theirs, REF[variant]["window_losses"], rtol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_live_tokenizer_makes_the_fixture_tokens(variant):
  transformers = _transformers()
  tok = transformers.AutoTokenizer.from_pretrained(os.path.join(FIXTURES, variant))
  with open(os.path.join(FIXTURES, REF["text"]), encoding="utf-8") as f:
    text = f.read()
  assert tok(text).input_ids + [tok.eos_token_id] == REF[variant]["token_ids"]
  assert tok.bos_token_id == hf_config(os.path.join(FIXTURES, variant))["bos_token_id"]


@pytest.mark.parametrize("kind", ["linear", "llama3"])
def test_live_rope_scalings_over_a_grid(kind):
  """Ours against transformers' for factors, thetas and head dims beyond the fixtures."""
  transformers = _transformers()
  from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

  for factor in (2.0, 8.0, 32.0):
    for theta, head_dim, original in ((1e4, 64, 2048), (5e5, 128, 8192), (5e5, 16, 64)):
      rope = {"rope_type": kind, "rope_theta": theta, "factor": factor}
      if kind == "llama3":
        rope.update(
          low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=original
        )
      hf = dict(
        vocab_size=256,
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        intermediate_size=64,
        num_hidden_layers=1,
        max_position_embeddings=4 * original,
        rope_parameters=rope,
      )
      theirs = LlamaRotaryEmbedding(transformers.LlamaConfig(**hf)).inv_freq.numpy()
      np.testing.assert_allclose(inverse_frequencies(config_from_hf(hf)), theirs, rtol=1e-6)
