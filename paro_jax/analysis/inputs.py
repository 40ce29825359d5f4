"""Abstract inputs of a training step: shapes and shardings, no memory behind them."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def abstract_inputs(engine, batch_size: int, seq_len: int):
  """Abstract (state, batch) for engine.train_step, with shardings and no memory behind them."""
  engine.check_batch_size(batch_size)
  shapes = jax.eval_shape(lambda: engine.init_state(jax.random.key(0)))
  state = jax.tree.map(
    lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
    shapes,
    engine.state_shardings,
  )
  batch = jax.ShapeDtypeStruct(
    (engine.micro_batches, batch_size, seq_len + 1), jnp.int32, sharding=engine.batch_sharding
  )
  return state, batch
