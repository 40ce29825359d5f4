"""The optimizer's compute-dtype copy of the master (`Engine(weights_copy=True)`, the GPUs'
default): the next parameter sync gathers it instead of casting the master, the same values:
the same losses and weights as with the cast, in bf16, up to the fp32 rounding of the update
(XLA fuses the update with its extra output differently: a last bit here and there)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import LlamaConfig
from models.llama import Llama
from paro_jax.core.state import OptimConfig
from paro_jax.core.engine import Engine
from paro_jax.core.mesh import make_mesh
from paro_jax.core.strategy import parse_strategy

CFG = LlamaConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp=64)
A, B, L, STEPS = 2, 8, 16, 3


def run(strategy: str, weights_copy: bool):
  engine = Engine(
    Llama(CFG, jnp.bfloat16),
    parse_strategy(strategy),
    make_mesh(2, 4),
    OptimConfig(learning_rate=1e-2, warmup_steps=0, total_steps=STEPS),
    micro_batches=A,
    weights_copy=weights_copy,
  )
  state = engine.init_state(jax.random.key(0))
  rng = np.random.default_rng(0)
  losses = []
  for _ in range(STEPS):
    tokens = rng.integers(0, CFG.vocab, size=(A, B, L + 1), dtype=np.int32)
    state, metrics = engine.train_step(state, engine.shard_batch(tokens))
    losses.append(float(metrics["loss"]))
  return engine, state, losses


@pytest.mark.parametrize("strategy", ["IIG", "NNN"])
def test_the_copy_changes_no_value(strategy):
  _, plain, plain_losses = run(strategy, False)
  engine, copied, losses = run(strategy, True)
  assert plain.weights is None and engine.state_specs.weights == engine.trained_specs.opt
  np.testing.assert_allclose(losses, plain_losses, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(copied.master), jax.tree.leaves(plain.master)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
  # the copy is the updated master in the compute dtype, at the master's placement
  for w, m in zip(jax.tree.leaves(copied.weights), jax.tree.leaves(copied.master)):
    assert w.dtype == jnp.bfloat16 and w.sharding == m.sharding
    np.testing.assert_array_equal(np.asarray(w), np.asarray(m.astype(jnp.bfloat16)))
