"""A vocabulary of several tiles: the step and the eval forward gather the embedding table and the
head one vocabulary tile at a time (models/loss.py `tile_of`, through the step's `materialize`),
and equal the plain single-device loop of the whole logits; no device holds the whole table.

The model's vocabulary of 62 in tiles of 16 (4 tiles, the last overlapping the one before), on a
2x4 mesh: a sharded P with a mix of placements (IIG), all sharded (GGG, tied: the table's two
uses each gather their tiles), P replicated (NNI); HO-Ring (the hand-written rings) once. The
reference is `reference_train` of the untiled model (one tile of 8192 holds 62: the whole fp32
logits, weights never sharded), so the tiles and their gathers are checked against code that
has neither.
"""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import LlamaConfig, LoraConfig
from models.llama import Llama
from models.loss import next_token_loss
from paro_jax.core.engine import Engine
from paro_jax.core.mesh import make_mesh
from paro_jax.core.strategy import parse_strategy
from paro_jax.run.reference import reference_train
from tests.core.test_equivalence import OPTIM, assert_trees_close, reference_setup

CFG = LlamaConfig(vocab=62, dim=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp=64)
TIED = dataclasses.replace(CFG, tie_embeddings=True)
CHUNK = 16
CASES = [("IIG", CFG, "xla"), ("GGG", TIED, "xla"), ("NNI", CFG, "xla"), ("IIG", TIED, "horing")]
IDS = ["IIG", "GGG-tied", "NNI", "IIG-tied-horing"]


@pytest.fixture(scope="module")
def references():
  return {cfg: reference_setup(cfg) for cfg in (CFG, TIED)}


def _engine(strategy, cfg, collectives):
  model = Llama(cfg, vocab_chunk=CHUNK)
  assert model.vocab_tiled
  mesh = make_mesh(2, 4)
  return Engine(
    model, parse_strategy(strategy), mesh, OPTIM, micro_batches=2, collectives=collectives
  )


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def trained(request, references):
  """(the case, the engine, its state after the reference's batches, its losses)."""
  strategy, cfg, collectives = request.param
  batches, params0, _, _ = references[cfg]
  engine = _engine(strategy, cfg, collectives)
  state, losses = engine.state_from_params(params0), []
  for batch in batches:
    state, metrics = engine.train_step(state, engine.shard_batch(batch))
    losses.append(float(metrics["loss"]))
  return request.param, engine, state, losses


def test_tiled_step_equals_the_whole_logits_single_device(trained, references):
  (_, cfg, _), _, state, losses = trained
  _, _, ref_losses, ref_params = references[cfg]
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
  assert_trees_close(jax.device_get(state.master), ref_params, atol=2e-5)


def test_tiled_eval_forward_equals_the_whole_logits(trained, references):
  (_, cfg, _), engine, state, _ = trained
  batches, _, _, ref_params = references[cfg]
  params = engine.params(state)
  got = engine.forward.loss(params, engine.shard_batch(batches[0]))
  tokens = jnp.asarray(batches[0]).reshape(-1, batches[0].shape[-1])
  master = jax.device_get(state.master)
  want = next_token_loss(Llama(cfg).apply(master, tokens[:, :-1]), tokens[:, 1:])
  np.testing.assert_allclose(float(got), float(want), rtol=2e-6)


def _shapes(hlo: str, dtype: str = "f32") -> set[tuple[int, ...]]:
  return {
    tuple(int(d) for d in s.split(",") if d) for s in re.findall(rf"{dtype}\[([0-9,]*)\]", hlo)
  }


def test_no_device_holds_the_whole_table_or_head(trained):
  """The compiled step and eval forward of the sharded P placements: their buffers include the
  gathered tile (16 x 32 or 32 x 16), none the table or head (62 x 32, 32 x 62)."""
  (strategy, cfg, _), engine, state, _ = trained
  if strategy.startswith("N"):
    pytest.skip("P replicated: every device holds the whole weights by placement")
  batch = jax.ShapeDtypeStruct((2, 8, 9), jnp.int32, sharding=engine.batch_sharding)
  step = engine.train_step.lower(state, batch).compile().as_text()
  params = engine.params(state)
  forward = engine.forward._loss.lower(params, batch).compile().as_text()
  whole, tile = {(62, 32), (32, 62)}, {(CHUNK, 32), (32, CHUNK)}
  for hlo in (step, forward):
    shapes = _shapes(hlo)
    assert shapes & tile, "the gathered tile: the check can see it"
    assert not shapes & whole


def test_cpu_bf16_forward_holds_no_fp32_copy_of_the_stored_weights(references):
  """XLA:CPU computes bf16 in f32 and would hoist the convert of each loop's stacked weights out
  of the loop: an fp32 copy of every weight a device stores, carried through the loops. The eval
  forward is compiled without that pass on CPU (core/xla_flags.py CPU_BF16_WEIGHTS_OPTIONS): its
  loops carry the stored bf16 shards and no f32 array of a stored shard's shape, and its loss is
  the single-device bf16 model's."""
  batches, params0, _, _ = references[TIED]
  model = Llama(TIED, jnp.bfloat16, vocab_chunk=CHUNK)
  engine = Engine(model, parse_strategy("GGG"), make_mesh(2, 4), OPTIM, micro_batches=2)
  params = engine.params(engine.state_from_params(params0))
  batch = engine.shard_batch(batches[0])
  hlo = engine.forward._loss.lower(params, batch).compile().as_text()
  carried = "\n".join(re.findall(r"= \(([^)]*)\) while\(", hlo))
  stored = {p.sharding.shard_shape(p.shape) for p in jax.tree.leaves(params) if p.ndim > 1}
  assert stored & _shapes(carried, "bf16"), "the loops carry the stored shards: the check sees them"
  assert not stored & _shapes(carried, "f32")
  tokens = jnp.asarray(batches[0]).reshape(-1, batches[0].shape[-1])
  bf16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params0)
  want = next_token_loss(Llama(TIED, jnp.bfloat16).apply(bf16, tokens[:, :-1]), tokens[:, 1:])
  got = engine.forward.loss(params, batch)
  np.testing.assert_allclose(float(got), float(want), rtol=1e-2)


LORA = LoraConfig(rank=2, alpha=4.0, targets=("wq", "wv"))


@pytest.fixture(scope="module")
def lora_step(references):
  """(engine, state, compiled step's HLO) of a bf16 LoRA run of the tied model on GGG 2x4."""
  batches = references[TIED][0]
  model = Llama(TIED, jnp.bfloat16, lora=LORA, vocab_chunk=CHUNK)
  engine = Engine(model, parse_strategy("GGG"), make_mesh(2, 4), OPTIM, micro_batches=2)
  state = engine.init_state(jax.random.key(0))
  batch = engine.shard_batch(batches[0])
  return engine, state, engine.train_step.lower(state, batch).compile().as_text()


def test_cpu_lora_step_holds_no_fp32_copy_of_the_frozen_base(lora_step):
  """The same for a LoRA run's step, whose frozen base is held in bf16 (core/engine.py): its
  loops carry the base's stored shards and no f32 array of their shapes."""
  _, state, hlo = lora_step
  carried = "\n".join(re.findall(r"= \(([^)]*)\) while\(", hlo))
  frozen = {p.sharding.shard_shape(p.shape) for p in jax.tree.leaves(state.frozen) if p.ndim > 1}
  assert frozen & _shapes(carried, "bf16"), "the loops carry the frozen base: the check sees it"
  assert not frozen & _shapes(carried, "f32")


def test_cpu_lora_step_gathers_the_frozen_base_in_16_bits(lora_step):
  """XLA:CPU runs a bf16 all-gather in f32: the gathered layers and tiles of the frozen base
  were held in f32, twice their bytes. A LoRA step on CPU gathers its weights as their bits
  (core/buckets.py as_bits): every all-gather of a frozen weight's layer, a norm or a
  vocabulary tile moves 16-bit words; f32 ones only carry the adapters (the parameter sync of
  their fp32 master)."""
  engine, _, hlo = lora_step
  gathered = re.findall(r"= \(?((?:\w+\[[0-9,]*\][^ ]*(?:, )?)+)\)? all-gather\(", hlo)
  shapes = [re.findall(r"(\w+)\[([0-9,]*)\]", g) for g in gathered]
  sizes = lambda dtype: [  # noqa: E731
    math.prod(int(d) for d in dims.split(",") if d) for s in shapes for t, dims in s if t == dtype
  ]
  adapter = max(math.prod(x.shape[1:]) for x in jax.tree.leaves(engine.trained_shapes))
  frozen_tile = CHUNK * TIED.dim  # a vocabulary tile of the tied table, gathered whole
  assert frozen_tile in sizes("u16"), "the tiles' gathers: the check sees them"
  assert max(sizes("f32"), default=0) <= adapter, sizes("f32")


def test_tiled_lora_step_equals_the_single_device_loop(references):
  """With the frozen base gathered as bits (fp32 here: u32 words), in vocabulary tiles, on ING
  2x4 (the placement of the real-size fine-tune): the losses and adapters of the plain
  single-device LoRA loop of the whole logits."""
  batches, _, _, _ = references[CFG]
  model = Llama(CFG, lora=LORA)
  params0 = model.init(jax.random.key(1))
  ref_losses, ref_trained = reference_train(model, params0, batches, OPTIM)
  tiled = Llama(CFG, lora=LORA, vocab_chunk=CHUNK)
  engine = Engine(tiled, parse_strategy("ING"), make_mesh(2, 4), OPTIM, micro_batches=2)
  assert engine.gather_bits
  state, losses = engine.state_from_params(params0), []
  for batch in batches:
    state, metrics = engine.train_step(state, engine.shard_batch(batch))
    losses.append(float(metrics["loss"]))
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
  assert_trees_close(jax.device_get(state.master), ref_trained, atol=2e-5)
