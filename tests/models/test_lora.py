"""LoRA: adapters on a frozen base, trained under every strategy like a single-device LoRA loop."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paro_jax.hf.weights import load_hf
from models.llama import Llama
from models.lora import is_lora_path
from models.config import LlamaConfig, LoraConfig
from paro_jax import cli
from paro_jax.run.checkpoint import CHECKPOINTS, Checkpointer
from paro_jax.analysis.planner.costs import model_state_bytes
from paro_jax.core.state import OptimConfig
from paro_jax.core.engine import Engine
from paro_jax.core.shards import join_trainable
from paro_jax.core.step import StepProgram
from paro_jax.analysis.inspect.abstract import compile_step
from paro_jax.analysis.inspect.inspector import report
from paro_jax.core.mesh import make_mesh
from tests.core.test_memory import gradient_sinks
from paro_jax.run.reference import reference_train
from paro_jax.core.strategy import VALID_NAMES, parse_strategy
from paro_jax.core.config import make_config
from paro_jax.run.config import RunConfig
from paro_jax.run.setup import build
from paro_jax.run.train import train

CFG = LlamaConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp=64)
# Every kind of target: q/k/v (A on embed, B on the flattened heads), wo/w_down (A on the
# flattened input, B on embed), gate/up (B on mlp).
LORA = LoraConfig(rank=8, alpha=16.0, targets=("wq", "wv", "wo", "w_up", "w_down"))
OPTIM = OptimConfig(learning_rate=1e-2, warmup_steps=0, total_steps=3, clip_norm=0.5, eps=1e-6)
A, B, L, STEPS = 2, 8, 8, 3


def adapter_count(params) -> int:
  return sum(
    x.size for path, x in jax.tree_util.tree_leaves_with_path(params) if is_lora_path(path)
  )


@pytest.fixture(scope="module")
def setup():
  rng = np.random.default_rng(0)
  start, stride = (rng.integers(0, CFG.vocab, size=(STEPS, A, B, 1)) for _ in range(2))
  batches = list(((start + stride * np.arange(L + 1)) % CFG.vocab).astype(np.int32))
  model = Llama(CFG, lora=LORA)
  params0 = model.init(jax.random.key(1))
  losses, trained = reference_train(model, params0, batches, OPTIM)
  return batches, params0, losses, trained


def test_model_starts_as_its_base_and_merges_exactly():
  base, lora = Llama(CFG), Llama(CFG, lora=LORA)
  params = lora.init(jax.random.key(0))
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, CFG.vocab, (2, 8)), jnp.int32)
  without = jax.tree_util.tree_map_with_path(lambda p, x: None if is_lora_path(p) else x, params)
  # B starts at zero: the adapted model is its base model.
  np.testing.assert_array_equal(lora.apply(params, tokens), base.apply(without, tokens))
  # With non-zero B, folding the adapters into the weights gives the same function.
  params = jax.tree_util.tree_map_with_path(
    lambda p, x: x + 0.05 if str(p[-1].key).endswith("_lora_b") else x, params
  )
  merged = lora.merge_lora(params)
  assert adapter_count(merged) == 0
  np.testing.assert_allclose(base.apply(merged, tokens), lora.apply(params, tokens), atol=1e-5)
  assert np.abs(base.apply(merged, tokens) - base.apply(without, tokens)).max() > 1e-3


def test_counts():
  model = Llama(CFG, lora=LORA)
  params = model.init(jax.random.key(0))
  assert model.param_count() == sum(x.size for x in jax.tree.leaves(params))
  assert model.trainable_count() == adapter_count(params) > 0
  assert sum(jax.tree.leaves(model.trainable_mask())) == 2 * len(LORA.targets)


@pytest.mark.parametrize(
  "kwargs,message",
  [
    ({"targets": ("wq", "q_proj")}, "unknown LoRA targets ['q_proj']"),
    ({"targets": ""}, "unknown LoRA targets (none)"),
    ({"rank": 0}, "LoRA rank must be >= 1"),
  ],
)
def test_bad_lora_config(kwargs, message):
  with pytest.raises(ValueError) as e:
    LoraConfig(**kwargs)
  assert message in str(e.value)


def test_reference_moves_every_adapter(setup):
  _, params0, _, trained = setup
  for path, a in jax.tree_util.tree_leaves_with_path(trained):
    b = params0
    for k in path:
      b = b[k.key]
    assert np.abs(np.asarray(a) - np.asarray(b)).mean() > 1e-4, jax.tree_util.keystr(path)


# LoRA changes what is trained, not how a placement is gathered or reduced: NNN, III and GGG put
# every state at each of the three placements; IIG, ING, NGG and GNG mix them (a frozen base
# gathered per layer or once, adapters synced per micro-batch or at the boundary). Full training
# is checked against the reference for all 14 (tests/core/test_equivalence.py).
LORA_STRATEGIES = ["NNN", "III", "GGG", "IIG", "ING", "NGG", "GNG"]


# With the layers' gradient sync inside the last backward (GPUs' default) for two of them.
BOUNDARY, SYNC = StepProgram.BOUNDARY_SYNC, StepProgram.SYNC_IN_BACKWARD
LORA_CASES = [(s, BOUNDARY) for s in LORA_STRATEGIES] + [("IIG", SYNC), ("NNN", SYNC)]


@pytest.mark.parametrize("strategy,program", LORA_CASES)
def test_lora_equals_single_device(setup, strategy, program):
  batches, params0, ref_losses, ref_trained = setup
  engine = Engine(
    Llama(CFG, lora=LORA),
    parse_strategy(strategy),
    make_mesh(2, 4),
    OPTIM,
    micro_batches=A,
    program=program,
  )
  assert engine.program is program
  state = engine.state_from_params(params0)
  losses = []
  for batch in batches:
    state, metrics = engine.train_step(state, engine.shard_batch(batch))
    losses.append(float(metrics["loss"]))
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
  master = jax.device_get(state.master)
  assert jax.tree.structure(master) == jax.tree.structure(ref_trained)
  for (path, x), y in zip(
    jax.tree_util.tree_leaves_with_path(master), jax.tree.leaves(ref_trained)
  ):
    np.testing.assert_allclose(x, y, atol=2e-5, err_msg=jax.tree_util.keystr(path))
  # The base is frozen: bit for bit what it started as.
  full = jax.device_get(engine.params(state))
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(full), jax.tree.leaves(params0)):
    if not is_lora_path(path):
      np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


def bytes_per_device(tree):
  held = {}
  for leaf in jax.tree.leaves(tree):
    if leaf.ndim == 0:
      continue
    for shard in leaf.addressable_shards:
      held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
  assert len(set(held.values())) == 1 and len(held) == 8, held
  return next(iter(held.values()))


@pytest.mark.parametrize("strategy", VALID_NAMES)
def test_state_bytes_match_formula(setup, strategy):
  """2Ψ/f(P) + 2Ψ'/f(Gr) + 12Ψ'/f(OS), with Ψ' the adapters' parameter count."""
  _, params0, _, _ = setup
  s = parse_strategy(strategy)
  engine = Engine(Llama(CFG, jnp.bfloat16, lora=LORA), s, make_mesh(2, 4), OptimConfig())
  state = engine.state_from_params(params0)
  psi = sum(x.size for x in jax.tree.leaves(params0))
  psi_t = adapter_count(params0)
  expected = model_state_bytes(s, psi, psi_t, inter=2, intra=4, param_bytes=2, grad_bytes=2)
  assert bytes_per_device(engine.params(state)) == expected["params"]
  assert bytes_per_device(gradient_sinks(engine)) == expected["grads"]
  assert bytes_per_device((state.master, state.opt_state)) == expected["opt"]
  assert bytes_per_device((state.frozen,)) == 2 * (psi - psi_t) // s.params.shard_count(2, 4)


@pytest.mark.parametrize("strategy", ["ING", "IIG", "NNG", "GGG"])
def test_traffic_uses_trainable_count(strategy):
  """The compiled step moves what the formula says with Ψ' for gradients and parameter sync."""
  engine = Engine(
    Llama(CFG, jnp.float32, lora=LORA),
    parse_strategy(strategy),
    make_mesh(2, 4),
    OptimConfig(),
    micro_batches=2,
  )
  r = report(engine, compile_step(engine, batch_size=8, seq_len=8))
  assert r["trainable_params"] == engine.model.trainable_count() < r["params"] / 4
  for key in ("inter_bytes", "intra_bytes"):
    assert r["measured"][key] == pytest.approx(r["expected"][key], rel=0.01, abs=64), key
  if strategy == "ING":
    # Only adapter traffic crosses groups (their gradient and parameter sync, fp32 here, each
    # under two adapter copies); the base's gathers stay inside the group.
    assert 0 < r["measured"]["inter_bytes"] < 2 * 2 * 4 * engine.model.trainable_count()


RUN = {
  "model": "test",
  "mesh": (2, 4),
  "batch_size": 8,
  "seq_len": 16,
  "dtype": "fp32",
  "optimizer.warmup": 1,
  "lora.rank": 4,
  "lora.targets": "wq,wv,w_down",
}


def test_train_resume_other_strategy_and_export_merged(tmp_path):
  run = tmp_path / "run"
  train(make_config(RunConfig, {**RUN, "strategy": "ING", "optimizer.steps": 2, "out": str(run)}))
  # Resume on another strategy and mesh; the LoRA flags must match the checkpoint's.
  other = {**RUN, "strategy": "GGG", "mesh": (1, 8), "optimizer.steps": 3, "out": str(run)}
  other = make_config(RunConfig, {**other, "checkpoints.resume": True})
  with pytest.raises(ValueError, match="was written with --lora-rank 4"):
    train(dataclasses.replace(other, lora=dataclasses.replace(other.lora, rank=8)))
  train(other)
  # fp32: the run's own precision, so the comparison below can be exact to 1e-5 (a run from
  # scratch exports bf16 by default, as Llama checkpoints ship).
  cli.main(["export", "--run", str(run), "--out", str(tmp_path / "hf"), "--dtype", "fp32"])
  cfg, exported = load_hf(tmp_path / "hf")
  assert adapter_count(exported) == 0
  # The exported plain LLaMA computes what the trained LoRA model computes.
  engine = build(other)[0]
  ckpt = Checkpointer(os.path.join(run, CHECKPOINTS))
  state, meta = ckpt.restore(engine, "test")
  ckpt.close()
  assert meta.step == 3
  full = jax.device_get(join_trainable(engine.mask, state.master, state.frozen))
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab, (2, 16)), jnp.int32)
  np.testing.assert_allclose(
    Llama(cfg).apply(jax.tree.map(jnp.asarray, exported), tokens),
    engine.model.apply(full, tokens),
    atol=1e-5,
  )


@pytest.mark.parametrize(
  "argv,message",
  [
    (["--lora-rank", "4", "--lora-targets", "wq,q_proj"], "unknown LoRA targets ['q_proj']"),
    (["--lora-rank", "-1"], "lora-rank must be >= 0"),
  ],
)
def test_bad_lora_flags_are_clear_errors(tmp_path, capsys, argv, message):
  with pytest.raises(SystemExit) as e:
    cli.main(
      [
        "train",
        "--model",
        "test",
        "--mesh",
        "2x4",
        "--steps",
        "1",
        "--batch-size",
        "8",
        "--out",
        str(tmp_path),
        *argv,
      ]
    )
  assert e.value.code == 2
  assert message in capsys.readouterr().err
