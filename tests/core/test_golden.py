"""Golden values of one training step: IIG on 2x4, fp32, fixed seed.

The equivalence tests say the step equals a single-device loop; this one says it has not moved
at all since the values were recorded, which catches a change to the model, the initialisation,
the data order or the optimizer that both sides of an equivalence test would share.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.llama import Llama
from models.config import LlamaConfig
from paro_jax.core.state import OptimConfig
from paro_jax.core.engine import Engine
from paro_jax.core.mesh import make_mesh
from paro_jax.core.strategy import parse_strategy

CFG = LlamaConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp=64)
# eps well above float rounding: Adam's first update is nearly sign(g), and a gradient element
# near 0 would otherwise flip a whole lr-sized update on a change of summation order.
OPTIM = OptimConfig(learning_rate=1e-2, warmup_steps=0, total_steps=2, clip_norm=1.0, eps=1e-6)
A, B, L = 2, 8, 16

# Recorded from this test's own run; see WHAT_TO_CHECK before changing them.
GOLDEN = {
  "loss": 4.167024612426758,
  "grad_norm": 0.5316064953804016,
  "checksum": 3.598296789342319,  # of the updated parameters
  "update_checksum": 0.5300617928516353,  # of the update alone (updated minus initial parameters)
}
WHAT_TO_CHECK = """\
the golden step moved. If you meant to change the numerics (the model, its initialisation, the
batches, the optimizer, the loss), check that tests/core/test_equivalence.py still passes (the
step still equals the single-device loop), then record the values printed here in GOLDEN. If you
did not, the change is a bug: a collective, a gradient routed to the wrong shard, a sink added
twice, a changed seed or data order. Run `pytest tests/core/test_equivalence.py` to narrow it."""


def checksum(tree) -> float:
  """Position-weighted sum of every parameter: a swap or a sign change moves it."""
  total = 0.0
  for path, x in sorted(jax.tree_util.tree_leaves_with_path(tree), key=lambda p: str(p[0])):
    x = np.asarray(x, np.float64).ravel()
    total += float(np.sum(x * np.cos(np.arange(x.size))))
  return total


@pytest.fixture(scope="module")
def one_step():
  engine = Engine(
    Llama(CFG, jnp.float32), parse_strategy("IIG"), make_mesh(2, 4), OPTIM, micro_batches=A
  )
  state = engine.init_state(jax.random.key(0))
  before = checksum(jax.device_get(state.master))
  tokens = np.random.default_rng(0).integers(0, CFG.vocab, size=(A, B, L + 1), dtype=np.int32)
  state, metrics = engine.train_step(state, engine.shard_batch(tokens))
  after = checksum(jax.device_get(state.master))
  return {
    "loss": float(metrics["loss"]),
    "grad_norm": float(metrics["grad_norm"]),
    "checksum": after,
    "update_checksum": after - before,
  }


def test_one_step_equals_the_recorded_values(one_step):
  got = {k: f"{v!r}" for k, v in one_step.items()}
  for name, want in GOLDEN.items():
    assert np.isclose(one_step[name], want, rtol=1e-5, atol=0), (
      f"{name}: {one_step[name]!r}, recorded {want!r}: {WHAT_TO_CHECK}\nnow: {got}"
    )
