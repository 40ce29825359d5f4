"""The training step compiled from abstract inputs: shapes and shardings with no memory behind
them, so a step compiles for models far larger than the machine, on this host's devices
(`compile_step`) or for a GPU target without one (`compile_for_target`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paro_jax.analysis.gpu.targets import cudnn_checks
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


def compile_step(engine: Engine, batch_size: int, seq_len: int, packed: bool = False):
  """engine.train_step compiled for the engine's mesh of this host's devices; `packed`: on
  packed rows of instruction data (`abstract_inputs`)."""
  state, batch = abstract_inputs(engine, batch_size, seq_len, packed)
  return engine.train_step.lower(state, batch).compile()


def compile_for_target(
  engine: Engine,
  target: str,
  batch_size: int,
  seq_len: int,
  flags: dict,
  dump_dir: str,
  packed: bool = False,
):
  """engine.train_step compiled for the engine's mesh of compile-only GPUs of `target`
  (gpu/targets.py devices), dumped into dump_dir; `packed`: on packed rows of instruction data
  (`abstract_inputs`)."""
  state, batch = abstract_inputs(engine, batch_size, seq_len, packed)
  with cudnn_checks(target):
    lowered = engine.train_step.lower(state, batch)
  # the schedule dump gives what XLA's scheduler charged each instruction (instruction_costs.py)
  options = {**flags, "xla_dump_to": dump_dir, "xla_dump_latency_hiding_schedule": True}
  compiled = lowered.compile(compiler_options=options)
  platform = engine.mesh.devices.flat[0].platform
  if platform not in ("gpu", "cuda"):  # lowering for CUDA on CPU devices silently compiles CPU
    raise RuntimeError(f"expected a GPU compile, got one for {platform!r} devices")
  return compiled
