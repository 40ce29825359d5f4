"""Tied embeddings (HF's tie_word_embeddings, Llama 3.2 1B/3B): the embedding table is also the
output head, one parameter with two uses.

Its gradient is the sum of both uses; it is stored, counted, sharded, synced, checkpointed and
exported once; each micro-batch gathers it once (tests/core/test_equivalence.py checks all 14
strategies against the single-device loop).
"""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from paro_jax.hf.weights import load_hf
from models.llama import Llama
from models.lora import is_lora_path
from models.loss import next_token_loss
from models.config import LlamaConfig, LoraConfig
from paro_jax import cli
from paro_jax.analysis.planner.costs import model_state_bytes
from paro_jax.analysis.inspect.abstract import compile_step
from paro_jax.analysis.inspect.inspector import report
from paro_jax.core.state import OptimConfig
from paro_jax.core.engine import Engine
from paro_jax.core.mesh import make_mesh
from tests.core.test_memory import gradient_sinks
from paro_jax.core.strategy import parse_strategy
from paro_jax.run.checkpoint import CHECKPOINTS, Checkpointer
from paro_jax.run.reference import reference_train
from paro_jax.core.config import make_config
from paro_jax.run.config import RunConfig
from paro_jax.run.setup import build
from paro_jax.run.train import train

CFG = LlamaConfig(
  vocab=61, dim=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp=64, tie_embeddings=True
)
UNTIED = dataclasses.replace(CFG, tie_embeddings=False)
FIXTURE = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
  "fixtures",
  "hf_llama",
  "llama32_tied",
)


def tokens(shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, CFG.vocab, shape), jnp.int32)


def untied_twin(params):
  """The untied model's parameters computing the same function: the head's kernel is the
  table, transposed."""
  return {**params, "head": {**params["head"], "kernel": params["embed"]["embedding"].T}}


def test_one_table_counted_once():
  params = Llama(CFG).init(jax.random.key(0))
  assert set(params["head"]) == {"norm"} and params["embed"]["embedding"].shape == (61, 32)
  assert Llama(CFG).param_count() == sum(x.size for x in jax.tree.leaves(params))
  assert CFG.param_count() == UNTIED.param_count() - CFG.vocab * CFG.dim
  # The head still multiplies by the V x D table: the same FLOPs as untied.
  assert CFG.flops_per_token(64) == UNTIED.flops_per_token(64)


def test_the_gradient_is_the_sum_of_both_uses():
  tied, untied = Llama(CFG), Llama(UNTIED)
  params = tied.init(jax.random.key(0))
  batch = tokens((4, 9))

  def loss(model, p):
    return next_token_loss(model.apply(p, batch[:, :-1]), batch[:, 1:])

  np.testing.assert_array_equal(tied.apply(params, batch), untied.apply(untied_twin(params), batch))
  grad = jax.grad(lambda p: loss(tied, p))(params)
  twin = jax.grad(lambda p: loss(untied, p))(untied_twin(params))
  both = twin["embed"]["embedding"] + twin["head"]["kernel"].T
  # fp32 sums in another order: an element's rounding is of its summands' size, not its own
  # (a small sum of large terms), so the tolerance is relative to the gradient's scale
  scale = float(np.abs(both).max())
  np.testing.assert_allclose(grad["embed"]["embedding"], both, rtol=1e-5, atol=1e-6 * scale)
  # Each use alone is far from the sum: both really contribute.
  for one in (twin["embed"]["embedding"], twin["head"]["kernel"].T):
    assert np.abs(np.asarray(one - both)).max() > 1e-2 * scale


def bytes_per_device(tree):
  held = {}
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
  assert len(set(held.values())) == 1 and len(held) == 8, held
  return next(iter(held.values()))


@pytest.mark.parametrize("strategy", ["NNN", "NIG", "IIG", "GGG"])
def test_states_hold_the_table_once(strategy):
  """2Ψ/f(P) + 2Ψ/f(Gr) + 12Ψ/f(OS), with Ψ counting the table once."""
  s = parse_strategy(strategy)
  engine = Engine(Llama(CFG, jnp.bfloat16), s, make_mesh(2, 4), OptimConfig())
  state = engine.state_from_params(Llama(CFG).init(jax.random.key(0)))
  psi = CFG.param_count()
  want = model_state_bytes(s, psi, psi, inter=2, intra=4, param_bytes=2, grad_bytes=2)
  assert bytes_per_device(engine.params(state)) == want["params"]
  assert bytes_per_device(gradient_sinks(engine)) == want["grads"]
  opt = [x for x in jax.tree.leaves((state.master, state.opt_state)) if x.ndim]
  assert bytes_per_device(opt) == want["opt"]


@pytest.mark.parametrize(
  "strategy,collectives", [("IIG", "xla"), ("GGG", "xla"), ("IGG", "horing")]
)
def test_each_micro_batch_gathers_the_table_once(strategy, collectives):
  """The compiled step's bytes are the formulas' with Ψ counting the table once: one gather
  serves both uses, one reduce-scatter carries both uses' gradient."""
  engine = Engine(
    Llama(CFG, jnp.float32),
    parse_strategy(strategy),
    make_mesh(2, 4),
    OptimConfig(),
    micro_batches=2,
    collectives=collectives,
  )
  r = report(engine, compile_step(engine, batch_size=8, seq_len=8))
  assert r["params"] == CFG.param_count()
  for key in ("inter_bytes", "intra_bytes"):
    assert r["measured"][key] == pytest.approx(r["expected"][key], rel=0.01, abs=64), key


LORA = LoraConfig(rank=4, alpha=8.0, targets=("wq", "wv", "w_down"))
OPTIM = OptimConfig(learning_rate=1e-2, warmup_steps=0, total_steps=3, clip_norm=0.5, eps=1e-6)


@pytest.mark.parametrize("strategy", ["ING", "IIG"])
def test_lora_beside_a_tied_table(strategy):
  """The frozen table serves both uses (no gradient); the adapters train as the single-device
  LoRA loop trains them."""
  rng = np.random.default_rng(0)
  start, stride = (rng.integers(0, CFG.vocab, size=(2, 2, 8, 1)) for _ in range(2))
  batches = list(((start + stride * np.arange(9)) % CFG.vocab).astype(np.int32))
  model = Llama(CFG, lora=LORA)
  params0 = model.init(jax.random.key(1))
  ref_losses, ref_trained = reference_train(model, params0, batches, OPTIM)
  engine = Engine(model, parse_strategy(strategy), make_mesh(2, 4), OPTIM, micro_batches=2)
  state, losses = engine.state_from_params(params0), []
  for batch in batches:
    state, metrics = engine.train_step(state, engine.shard_batch(batch))
    losses.append(float(metrics["loss"]))
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
  master = jax.device_get(state.master)
  for x, y in zip(jax.tree.leaves(master), jax.tree.leaves(ref_trained)):
    np.testing.assert_allclose(x, y, atol=2e-5)
  full = jax.device_get(engine.params(state))
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(full), jax.tree.leaves(params0)):
    if not is_lora_path(path):
      np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


def test_checkpoints_from_before_tied_tables_still_resume():
  """A checkpoint records the model config; one written before `rope_scaling` and
  `tie_embeddings` existed reads back with their defaults, and a tied one is not an untied one."""
  from types import SimpleNamespace

  from paro_jax.run.checkpoint_content import check_model

  old = dataclasses.asdict(UNTIED)
  del old["rope_scaling"], old["tie_embeddings"]
  engine = SimpleNamespace(model=Llama(UNTIED))
  recorded = lambda config: SimpleNamespace(model_config=config, lora=None, model_name="m")
  check_model(recorded(old), engine, "m", "ckpt/2")
  with pytest.raises(ValueError, match="tie_embeddings: True vs False"):
    check_model(recorded(dataclasses.asdict(CFG)), engine, "m", "ckpt/2")


# --- a run: --init-from a tied directory, resume resharded, export --------------------------
RUN = {"batch_size": 8, "seq_len": 16, "dtype": "fp32", "optimizer.warmup": 1, "init_from": FIXTURE}
RUN["data.tokenizer"] = "bytes"  # the built-in corpus, whose bytes the 288 rows hold


def losses_of(metrics):
  with open(metrics) as f:
    return {row["step"]: row["loss"] for row in map(json.loads, f)}


def test_tied_run_resumes_resharded_and_exports_as_transformers_saves(tmp_path):
  run = tmp_path / "run"
  run_of = lambda options: make_config(RunConfig, {**RUN, "optimizer.steps": 3, **options})
  first = train(
    run_of({"strategy": "IIG", "mesh": (2, 4), "checkpoints.every": 2, "out": str(run)})
  )
  straight = losses_of(first)
  # Back to step 2, then on under another strategy on another mesh: the one table is resharded,
  # and step 3 scores what the uninterrupted run scored.
  shutil.rmtree(run / CHECKPOINTS / "3")
  resumed = run_of({"strategy": "GGG", "mesh": (1, 8), "out": str(run), "checkpoints.resume": True})
  np.testing.assert_allclose(losses_of(train(resumed))[3], straight[3], rtol=1e-5)
  engine = build(resumed)[0]
  ckpt = Checkpointer(os.path.join(run, CHECKPOINTS))
  state, meta = ckpt.restore(engine, f"hf:{FIXTURE}")
  ckpt.close()
  master = jax.device_get(state.master)
  assert meta.step == 3 and set(master["head"]) == {"norm"}
  # Export: tie_word_embeddings and the RoPE scaling kept, the table stored once, as the
  # embedding (transformers saves tied models without lm_head.weight).
  cli.main(["export", "--run", str(run), "--out", str(tmp_path / "hf"), "--dtype", "fp32"])
  with open(tmp_path / "hf" / "config.json") as f:
    written = json.load(f)
  assert written["tie_word_embeddings"] is True
  assert written["rope_scaling"]["rope_type"] == written["rope_parameters"]["rope_type"] == "llama3"
  assert "lm_head.weight" not in load_file(tmp_path / "hf" / "model.safetensors")
  cfg, params = load_hf(tmp_path / "hf")
  assert cfg == engine.model.cfg
  for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(master)):
    np.testing.assert_array_equal(x, y)


def test_live_transformers_loads_a_tied_export(tmp_path):
  torch = pytest.importorskip(
    "torch", reason="torch not installed: live transformers check skipped"
  )
  transformers = pytest.importorskip(
    "transformers", reason="transformers not installed: live transformers check skipped"
  )
  from paro_jax.hf.weights import save_hf

  cfg, params = load_hf(FIXTURE)
  rng = np.random.default_rng(0)  # perturbed: not the fixture's own bytes
  params = jax.tree.map(
    lambda w: w + 0.05 * rng.standard_normal(w.shape).astype(np.float32), params
  )
  save_hf(cfg, params, tmp_path / "out")
  model = transformers.LlamaForCausalLM.from_pretrained(
    tmp_path / "out", attn_implementation="eager"
  ).eval()
  assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
  ids = np.random.default_rng(1).integers(0, cfg.vocab, (2, 24))
  with torch.no_grad():
    theirs = model(input_ids=torch.as_tensor(ids)).logits.numpy()
  ours = Llama(cfg).apply(jax.tree.map(jnp.asarray, params), jnp.asarray(ids, jnp.int32))
  np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)
