"""Overhead of the PaRO engine itself: strategy NNN on a 1x1 mesh vs a plain jitted optax step.

Both train the same model (same remat, dtype, optimizer, batch) on one device; the ratio of
their median step times is the cost of the engine's machinery (shard_map, gradient sinks, the
hand-clipped AdamW). Goal: within 5%.

  python experiments/bench_overhead.py --model tiny --batch-size 16 --seq-len 128 --steps 30
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from models.presets import get_config
from models.loss import next_token_loss
from paro_jax.core.config import StepConfig
from paro_jax.core.state import OptimConfig, decay_mask
from paro_jax.core.factory import build_engine
from paro_jax.core.mesh import make_mesh


def median_step_time(step, state, batch, steps, warmup=3):
  for _ in range(warmup):
    state = step(state, batch)
  jax.block_until_ready(state)
  times = []
  for _ in range(steps):
    t = time.perf_counter()
    state = step(state, batch)
    jax.block_until_ready(state)
    times.append(time.perf_counter() - t)
  return statistics.median(times), state


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--model", default="tiny")
  ap.add_argument("--batch-size", type=int, default=16)
  ap.add_argument("--seq-len", type=int, default=128)
  ap.add_argument("--steps", type=int, default=30)
  ap.add_argument("--rounds", type=int, default=3, help="alternate the two, best-of-rounds")
  ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
  ap.add_argument("--out", default="experiments/results/overhead.json")
  args = ap.parse_args()

  cfg = get_config(args.model)
  optim = OptimConfig(total_steps=10_000)
  step = StepConfig(strategy="NNN", dtype=args.dtype, attention="xla")
  engine = build_engine(step, cfg, make_mesh(1, 1, jax.devices()[:1]), optim)
  model = engine.model  # the plain loop below computes with the same model
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.vocab, size=(1, args.batch_size, args.seq_len + 1), dtype=np.int32)
  params = model.init(jax.random.key(0))

  engine_batch = engine.shard_batch(tokens)
  engine_state = engine.state_from_params(params)

  def engine_step(state, batch):
    return engine.train_step(state, batch)[0]

  tx = optim.reference_tx(decay_mask(model.logical_axes()))

  @functools.partial(jax.jit, donate_argnums=0)  # the engine donates its state too
  def plain_step(state, tokens_1xBxL1):
    params, opt_state = state
    # Same numerics as the engine: compute-dtype params, fp32 master and moments.
    loss_fn = lambda p: next_token_loss(
      model.apply(jax.tree.map(lambda w: w.astype(model.dtype), p), tokens_1xBxL1[0, :, :-1]),
      tokens_1xBxL1[0, :, 1:],
    )
    grads = jax.grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  plain_state = (params, tx.init(params))
  plain_batch = jnp.asarray(tokens)

  engine_times, plain_times = [], []
  for _ in range(args.rounds):
    t, engine_state = median_step_time(engine_step, engine_state, engine_batch, args.steps)
    engine_times.append(t)
    t, plain_state = median_step_time(plain_step, plain_state, plain_batch, args.steps)
    plain_times.append(t)
  engine_t, plain_t = min(engine_times), min(plain_times)
  ratio = engine_t / plain_t
  result = {
    "model": args.model,
    "params": cfg.param_count(),
    "batch_size": args.batch_size,
    "seq_len": args.seq_len,
    "dtype": args.dtype,
    "steps": args.steps,
    "rounds": args.rounds,
    "engine_nnn_1x1_step_s": engine_t,
    "plain_jit_step_s": plain_t,
    "ratio": ratio,
    "device": jax.devices()[0].device_kind,
    "machine": platform.machine(),
    "cpu_count": os.cpu_count(),
    "jax": jax.__version__,
  }
  print(f"{'':28s}{'median step (ms)':>18s}")
  print(f"{'plain jit + optax':28s}{plain_t * 1e3:18.2f}")
  print(f"{'paro_jax NNN on 1x1 mesh':28s}{engine_t * 1e3:18.2f}")
  print(f"ratio engine/plain: {ratio:.3f} ({(ratio - 1) * 100:+.1f}%; goal within 5%)")
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
