"""Abstract inputs of the training step: shapes and shardings with no memory behind them, so a
step compiles for models far larger than the machine (inspector.py for the host's devices,
gpu.py for a GPU target)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paro_jax.core.batch import Batch
from paro_jax.core.engine import Engine


def abstract_inputs(engine: Engine, batch_size: int, seq_len: int, packed: bool = False):
  """Abstract (state, batch) for engine.train_step, with shardings and no memory behind them.
  `packed`: a Batch of packed rows (instruction data with `--pack`: loss weights and segment
  ids) instead of a token stream's tokens."""
  engine.check_batch_size(batch_size)
  shapes = jax.eval_shape(lambda: engine.init_state(jax.random.key(0)))
  state = jax.tree.map(
    lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
    shapes,
    engine.state_shardings,
  )
  A, sharding = engine.micro_batches, engine.batch_sharding
  batch = jax.ShapeDtypeStruct((A, batch_size, seq_len + 1), jnp.int32, sharding=sharding)
  if packed:
    rows = jax.ShapeDtypeStruct((A, batch_size, seq_len), jnp.int32, sharding=sharding)
    batch = Batch(batch, rows, rows)
  return state, batch
