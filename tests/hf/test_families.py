"""Qwen2/2.5, Qwen3 and Mistral checkpoints in and out, against transformers' own numbers.

The references are tests/fixtures/hf_families, written by transformers
(tests/fixtures/make_hf_families.py): a tiny random Qwen2ForCausalLM (q/k/v biases),
Qwen3ForCausalLM (q/k norms, tied, head_dim apart from hidden/heads) and MistralForCausalLM (a
sliding window of 8, shorter than the windows scored), with transformers' fp32 loss of each
window of text.txt. Our fp32 forward and `paro-jax eval` must give them within 1e-5 relative; 20
steps from each directory under a sharded strategy export a directory that scores as the run did
(and, with torch installed, that transformers loads as the same class and scores alike); a LoRA
adapter on the biased projections loads with peft; Qwen's chat templates tokenize and mask as
transformers does.
"""

import copy
import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import FAMILIES
from models.hf_config import config_from_hf, config_to_hf, read_config
from models.presets import PRESETS
from models.llama import Llama
from models.loss import next_token_loss
from paro_jax import cli
from paro_jax.core.config import make_config
from paro_jax.hf.weights import load_hf, save_hf
from paro_jax.run.config import RunConfig
from paro_jax.run.train import train

pytestmark = pytest.mark.usefixtures("compilation_cache")

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
HF = os.path.join(FIXTURES, "hf_families")
TEXT = os.path.join(FIXTURES, "hf_llama", "text.txt")
with open(os.path.join(HF, "reference.json")) as _f:
  REF = json.load(_f)
NAMES = ("mistral", "qwen2", "qwen3")
SHAPE = dict(vocab=288, dim=32, layers=2, heads=4, kv_heads=2, mlp=64, rope_theta=1e6)
# What each config.json says, written out by hand from make_hf_families.py's FAMILIES.
EXPECTED = {
  "qwen2": dict(SHAPE, head_dim=8, family="qwen2", norm_eps=1e-6, sliding_window=None),
  "qwen3": dict(SHAPE, head_dim=16, family="qwen3", norm_eps=1e-6, tie_embeddings=True),
  "mistral": dict(SHAPE, head_dim=8, family="mistral", norm_eps=1e-5, sliding_window=8),
}


def hf_config(directory) -> dict:
  with open(os.path.join(directory, "config.json")) as f:
    return json.load(f)


def windows(name: str, seq_len: int | None = None) -> np.ndarray:
  ids, s = REF[name]["token_ids"], seq_len or REF[name]["seq_len"]
  n = len(ids) // (s + 1)
  return np.asarray(ids[: n * (s + 1)], np.int32).reshape(n, s + 1)


@functools.cache
def loaded(name: str):
  return load_hf(os.path.join(HF, name))


def window_losses(cfg, params, tokens_NxL1) -> np.ndarray:
  model = Llama(cfg, jnp.float32)

  @jax.jit
  def per_window(params, tokens_NxL1):
    logits = model.apply(params, tokens_NxL1[:, :-1])
    return jax.vmap(next_token_loss)(logits[:, None], tokens_NxL1[:, None, 1:])

  return np.asarray(per_window(jax.tree.map(jnp.asarray, params), jnp.asarray(tokens_NxL1)))


# --- configs and transformers' losses ---------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_config_reads_as_written(name):
  cfg = read_config(os.path.join(HF, name))
  for field, want in EXPECTED[name].items():
    assert getattr(cfg, field) == want, field
  assert (cfg.qkv_bias, cfg.qk_norm) == (name == "qwen2", name == "qwen3")
  # the counts the planner and the traffic formulas use: the HF tensors' sizes
  assert cfg.param_count() == sum(x.size for x in jax.tree.leaves(loaded(name)[1]))


@pytest.mark.parametrize("name", NAMES)
def test_window_losses_equal_transformers(name):
  cfg, params = loaded(name)
  ours = window_losses(cfg, params, windows(name))
  np.testing.assert_allclose(ours, REF[name]["window_losses"], rtol=1e-5)


def _without_switch(name, cfg, params):
  """The model less its family's switch: Qwen2's biases zeroed, Qwen3's q/k norms dropped,
  Mistral's window removed."""
  params = copy.deepcopy(params)
  attn = params["layers"]["attn"]
  if name == "qwen2":
    for b in ("bq", "bk", "bv"):
      attn[b] = np.zeros_like(attn[b])
    return cfg, params
  if name == "qwen3":
    del attn["q_norm"], attn["k_norm"]
    return dataclasses.replace(cfg, family="llama"), params
  return dataclasses.replace(cfg, sliding_window=None), params


@pytest.mark.parametrize("name", NAMES)
def test_each_switch_shows_in_the_losses(name):
  """Without its family's switch a model scores far outside the 1e-5 allowed above: the
  comparison sees the biases, the q/k norms and the window."""
  ours = window_losses(*_without_switch(name, *loaded(name)), windows(name))
  assert np.abs(ours / np.asarray(REF[name]["window_losses"]) - 1).max() > 1e-2


@pytest.mark.parametrize("name", NAMES)
def test_save_and_load_round_trip(tmp_path, name):
  cfg, params = loaded(name)
  save_hf(cfg, params, tmp_path / name, base_config=hf_config(os.path.join(HF, name)))
  written = hf_config(tmp_path / name)
  assert written["architectures"] == [FAMILIES[name]] and written["model_type"] == name
  again, back = load_hf(tmp_path / name)
  assert again == cfg
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(back), jax.tree.leaves(params)):
    np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


def transformers4(hf: dict) -> dict:
  hf = copy.deepcopy(hf)
  rope = hf.pop("rope_parameters")
  hf["rope_theta"], hf["torch_dtype"] = rope.pop("rope_theta"), hf.pop("dtype")
  hf["rope_scaling"] = None
  hf.pop("layer_types", None)  # transformers 4's Qwen configs have none
  return hf


@pytest.mark.parametrize("name", NAMES)
def test_both_spellings_read_alike(name):
  hf = hf_config(os.path.join(HF, name))
  assert config_from_hf(transformers4(hf)) == config_from_hf(hf)
  assert config_from_hf(config_to_hf(config_from_hf(hf))) == config_from_hf(hf)


QWEN2 = hf_config(os.path.join(HF, "qwen2"))
QWEN3 = hf_config(os.path.join(HF, "qwen3"))


@pytest.mark.parametrize(
  "base,changes,message",
  [
    (QWEN2, {"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window is true"),
    (QWEN3, {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    (QWEN3, {"attention_bias": True}, "attention_bias is true"),
    (QWEN2, {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"]}, "qwen2_moe"),
    (QWEN3, {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]}, "qwen3_moe"),
    (QWEN2, {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]}, "gemma2"),
    (QWEN2, {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}, "mixtral"),
    (QWEN2, {"architectures": ["Qwen3ForCausalLM"]}, "model_type 'qwen2'"),
  ],
)
def test_what_is_refused_is_one_line_naming_it(base, changes, message):
  with pytest.raises(ValueError) as e:
    config_from_hf({**base, **changes}, "x/config.json")
  assert message in str(e.value) and "\n" not in str(e.value)
  assert str(e.value).startswith("x/config.json: unsupported HF config: ")


# --- presets --------------------------------------------------------------------------------
def _hf(arch, hidden, layers, heads, kv, mlp, vocab=151936, theta=1e6, eps=1e-6, **extra):
  """The fields of the published config.json (transformers 4's spelling, as they ship)."""
  return {
    "architectures": [arch],
    "model_type": {"Qwen2": "qwen2", "Qwen3": "qwen3", "Mistr": "mistral"}[arch[:5]],
    "vocab_size": vocab,
    "hidden_size": hidden,
    "num_hidden_layers": layers,
    "num_attention_heads": heads,
    "num_key_value_heads": kv,
    "intermediate_size": mlp,
    "rope_theta": theta,
    "rms_norm_eps": eps,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    **extra,
  }


QWEN3_EXTRA = dict(head_dim=128, attention_bias=False, use_sliding_window=False)
# (HF config.json, the parameter count in billions as the model cards and safetensors give it)
PUBLISHED = {
  "qwen3-0.6b": (
    _hf("Qwen3ForCausalLM", 1024, 28, 16, 8, 3072, tie_word_embeddings=True, **QWEN3_EXTRA),
    0.60,
  ),
  "qwen3-8b": (_hf("Qwen3ForCausalLM", 4096, 36, 32, 8, 12288, **QWEN3_EXTRA), 8.19),
  "qwen3-32b": (_hf("Qwen3ForCausalLM", 5120, 64, 64, 8, 25600, **QWEN3_EXTRA), 32.76),
  "qwen2.5-7b": (
    _hf(
      "Qwen2ForCausalLM",
      3584,
      28,
      28,
      4,
      18944,
      vocab=152064,
      sliding_window=131072,
      use_sliding_window=False,
      max_window_layers=28,
    ),
    7.62,
  ),
  "mistral-7b": (
    _hf("MistralForCausalLM", 4096, 32, 32, 8, 14336, 32768, 1e6, 1e-5, sliding_window=None),
    7.25,
  ),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_are_the_published_configs(name):
  hf, billions = PUBLISHED[name]
  assert PRESETS[name] == config_from_hf(hf)
  assert round(PRESETS[name].param_count() / 1e9, 2) == billions


def test_plan_and_inspect_take_the_presets(capsys):
  cli.main(["plan", "--model", "qwen3-8b", "--nodes", "4", "--gpu", "h100", "--json"])
  plan = json.loads(capsys.readouterr().out)
  assert plan["inputs"]["model"] == "qwen3-8b" and plan["pick"]
  assert plan["inputs"]["params"] == PRESETS["qwen3-8b"].param_count()


# --- the sliding window ---------------------------------------------------------------------
def test_the_fused_call_applies_the_window_as_written_out():
  """jax.nn.dot_product_attention's local window (the call cuDNN runs) on XLA equals the
  written-out attention's mask (transformers' sliding-window mask)."""
  from models.attention import fused_attention, visible_mask

  q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 12, 4, 8))
  k, v = k[:, :, :2], v[:, :, :2]
  for window in (None, 1, 5, 12):
    out = fused_attention(q, k, v, "xla", window)
    scores = jnp.einsum("blgrk,bmgk->bgrlm", q.reshape(2, 12, 2, 2, 8), k) / jnp.sqrt(8.0)
    scores = jnp.where(visible_mask(12, window), scores, -jnp.inf)
    want = jnp.einsum("bgrlm,bmgk->blgrk", jax.nn.softmax(scores, -1), v).reshape(2, 12, 4, 8)
    np.testing.assert_allclose(out, want, atol=1e-5)


def test_a_window_cudnn_cannot_apply_is_refused():
  from models.attention import check_window_fits_kernel

  check_window_fits_kernel(8, 8, packed=True)  # the window covers the row: nothing to apply
  check_window_fits_kernel(None, 64, packed=True)
  with pytest.raises(ValueError, match="sliding_window 8 is shorter than the sequence length 16"):
    check_window_fits_kernel(8, 16, packed=True)


def test_a_binding_window_over_packed_rows_resolves_to_xla():
  """--attention auto on GPUs takes the written-out attention for it; cudnn is refused before
  anything compiles, in one line."""
  from models.config import resolve_attention

  assert resolve_attention("auto", "cuda", "bfloat16", 128)[0] == "cudnn"
  attention, why = resolve_attention("auto", "cuda", "bfloat16", 128, packed_window=True)
  assert attention == "xla" and "sliding window" in why
  with pytest.raises(ValueError, match="applies no window; use --attention xla$"):
    resolve_attention("cudnn", "cuda", "bfloat16", 128, packed_window=True)


# --- `paro-jax eval`, 20 steps, export ------------------------------------------------------
SEQ, BATCH, STEPS = 16, 8, 20
# One sharded strategy per family: IIG on two nodes of 4, GGG on four nodes of 2. Qwen2's run
# trains LoRA adapters on its biased projections (q, k, v): it also makes the PEFT adapter.
LORA = {"lora.rank": 4, "lora.alpha": 8.0, "lora.targets": "wq,wk,wv", "optimizer.lr": 3e-2}
RUNS = {
  "qwen2": {"strategy": "IIG", "mesh": (2, 4), **LORA},
  "qwen3": {"strategy": "GGG", "mesh": (4, 2)},
  "mistral": {"strategy": "IIG", "mesh": (2, 4)},
}


def evaluate(capsys, source, *flags) -> dict:
  capsys.readouterr()
  cli.main(["eval", str(source), "--json", "--dtype", "fp32", *flags])
  return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("name", NAMES)
def test_eval_equals_transformers(capsys, name):
  directory = os.path.join(HF, name)
  got = evaluate(
    capsys,
    directory,
    *("--data", TEXT, "--seq-len", str(REF[name]["seq_len"]), "--batch-size", "8"),
    *("--mesh", "2x4", "--strategy", "IIG"),
  )
  assert got["windows"] == len(REF[name]["window_losses"])
  assert got["loss"] == pytest.approx(REF[name]["mean_loss"], rel=1e-5)


@pytest.fixture(scope="module")
def journeys(tmp_path_factory):
  """{family: (run, fp32 export)}: 20 steps from the fixture on text.txt, exported in fp32 (and
  Qwen2's LoRA adapters as PEFT's, in {run}-adapter)."""
  root = tmp_path_factory.mktemp("families")
  done = {}
  for name, run_changes in RUNS.items():
    run = root / name
    changes = {
      "batch_size": BATCH,
      "seq_len": SEQ,
      "dtype": "fp32",
      "optimizer.steps": STEPS,
      "optimizer.lr": 1e-3,
      "optimizer.warmup": 2,
      "out": str(run),
      "init_from": os.path.join(HF, name),
      "data.paths": (TEXT,),
      **run_changes,
    }
    train(make_config(RunConfig, changes))
    cli.main(["export", str(run), "--out", str(root / f"{name}-hf"), "--dtype", "fp32"])
    if "lora.rank" in run_changes:
      cli.main(["export", str(run), "--out", f"{run}-adapter", "--dtype", "fp32", "--adapter"])
    done[name] = run, root / f"{name}-hf"
  return done


EVAL = ["--data", TEXT, "--seq-len", str(SEQ), "--batch-size", str(BATCH)]


@pytest.mark.parametrize("name", NAMES)
def test_the_export_scores_as_the_run(journeys, capsys, name):
  run, exported = journeys[name]
  with open(run / "metrics.jsonl") as f:
    losses = [json.loads(line)["loss"] for line in f if '"loss"' in line]
  assert len(losses) >= STEPS and losses[-1] < losses[0]  # trained
  ours = evaluate(capsys, run, *EVAL, "--mesh", "2x4", "--strategy", "IIG")
  assert evaluate(capsys, exported, *EVAL)["loss"] == pytest.approx(ours["loss"], rel=1e-6)
  assert hf_config(exported)["architectures"] == [FAMILIES[name]]
  assert read_config(str(exported)) == read_config(os.path.join(HF, name))


# --- live: transformers and peft ------------------------------------------------------------
def _live():
  torch = pytest.importorskip("torch", reason="torch not installed: live check skipped")
  transformers = pytest.importorskip("transformers", reason="transformers not installed")
  return torch, transformers


@pytest.mark.parametrize("name", NAMES)
def test_live_transformers_scores_the_fixture_and_the_export(journeys, capsys, name):
  torch, transformers = _live()
  load = lambda d: transformers.AutoModelForCausalLM.from_pretrained(
    d, dtype=torch.float32, attn_implementation="eager"
  ).eval()

  def loss(model, seq_len=None):
    tokens = torch.as_tensor(windows(name, seq_len)).long()
    with torch.no_grad():
      logits = model(input_ids=tokens[:, :-1]).logits.float()
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
    return ce.mean(dim=1).numpy()

  np.testing.assert_allclose(
    loss(load(os.path.join(HF, name))), REF[name]["window_losses"], rtol=1e-5
  )
  run, exported = journeys[name]
  model = load(exported)
  assert type(model).__name__ == FAMILIES[name]
  ours = evaluate(capsys, run, *EVAL, "--mesh", "2x4", "--strategy", "IIG")["loss"]
  assert float(loss(model, SEQ).mean()) == pytest.approx(ours, rel=1e-5)


def qwen2_adapter(journeys):
  """(Qwen2's merged export, its PEFT adapter)."""
  run, merged = journeys["qwen2"]
  return merged, f"{run}-adapter"


def test_the_adapter_names_the_biased_projections(journeys):
  from safetensors.numpy import load_file

  _, adapter = qwen2_adapter(journeys)
  with open(os.path.join(adapter, "adapter_config.json")) as f:
    assert json.load(f)["target_modules"] == ["k_proj", "q_proj", "v_proj"]
  names = set(load_file(os.path.join(adapter, "adapter_model.safetensors")))
  assert "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight" in names
  assert not any("bias" in n for n in names)  # the biases are the base's, untouched


def test_live_peft_loads_the_adapter_with_the_merged_logits(journeys):
  torch, transformers = _live()
  peft = pytest.importorskip("peft", reason="peft not installed: live adapter check skipped")
  merged, adapter = qwen2_adapter(journeys)
  ids = torch.tensor(REF["qwen2"]["token_ids"][:64]).reshape(2, 32)
  load = lambda d: transformers.AutoModelForCausalLM.from_pretrained(
    d, dtype=torch.float32, attn_implementation="eager"
  ).eval()
  source = os.path.join(HF, "qwen2")
  with torch.no_grad():
    plain = load(source)(input_ids=ids).logits
    adapted = peft.PeftModel.from_pretrained(load(source), adapter).eval()
    theirs, ours = adapted(input_ids=ids).logits, load(merged)(input_ids=ids).logits
  assert (theirs - plain).abs().max() > 1e-3
  torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


# --- chat templates: ChatML, Qwen3's thinking -------------------------------------------------
CHAT_DIR = os.path.join(FIXTURES, "chat")
# template -> the template whose transformers masks are its own (Qwen's ship no generation blocks)
TEMPLATES = {
  "qwen2.5": "qwen2.5_generation",
  "qwen2.5_generation": "qwen2.5_generation",
  "qwen3": "qwen3_generation",
  "qwen3_generation": "qwen3_generation",
}


def chat_encoder(name: str):
  from paro_jax.data.instruct import CHAT, Encoder
  from paro_jax.data.tokenizers import HFTokenizer

  directory = os.path.join(HF, "qwen3")
  tokenizer = HFTokenizer(os.path.join(directory, "tokenizer.json"))
  return Encoder(CHAT, tokenizer, directory, os.path.join(CHAT_DIR, f"{name}.jinja"))


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_chat_tokens_and_masks_equal_transformers(name):
  """Each chat as transformers tokenizes it; the loss on the assistant's tokens exactly where
  transformers marks them in the template written with generation blocks. Qwen3's own template
  drops earlier answers' reasoning: a chat of two answers is refused, naming the fix."""
  ref = REF["chat"]
  enc = chat_encoder(name)
  for i, chat in enumerate(ref["chats"]):
    answers = sum(m["role"] == "assistant" for m in chat)
    if name == "qwen3" and answers > 1:
      with pytest.raises(ValueError, match="generation %} blocks") as e:
        enc(f"chat {i}", {"messages": chat})
      assert "\n" not in str(e.value)
      continue
    tokens, mask = enc(f"chat {i}", {"messages": chat})
    assert tokens.tolist() == ref[name][i]["ids"], f"chat {i}"
    assert mask.tolist() == ref[TEMPLATES[name]][i]["mask"], f"chat {i}"


def test_chatml_turns_end_at_im_end():
  """The token export adds to generation_config.json's stops: <|im_end|>, for both templates."""
  from paro_jax.data.chat import load_chat_template
  from paro_jax.data.instruct import end_of_turn
  from paro_jax.data.tokenizers import HFTokenizer

  for name in ("qwen2", "qwen3"):
    directory = os.path.join(HF, name)
    tokenizer = HFTokenizer(os.path.join(directory, "tokenizer.json"))
    eot = end_of_turn(load_chat_template(None, directory), tokenizer)
    assert eot == tokenizer.token_id("<|im_end|>"), name
