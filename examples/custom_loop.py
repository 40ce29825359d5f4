"""Train the tiny LLaMA with strategy IIG on a 2x4 mesh, with a training loop of your own.

  python examples/custom_loop.py --steps 20

The library does the sharding and the communication; the script owns the loop: data, logging,
when to stop. On a machine without accelerators it asks for 8 virtual CPU devices first.
"""

import argparse

import paro_jax

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--strategy", default="IIG")
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()

paro_jax.provide_cpu_devices(8)  # before jax starts; harmless where GPUs are the backend
import jax  # noqa: E402

micro_batches, batch_size, seq_len = 2, 16, 64
mesh = paro_jax.make_mesh(2, 4)  # 2 nodes ("inter") x 4 devices each ("intra")
model = paro_jax.Llama(paro_jax.get_config("tiny"))
engine = paro_jax.Engine(
  model,
  paro_jax.parse_strategy(args.strategy),
  mesh,
  paro_jax.OptimConfig(learning_rate=3e-3, warmup_steps=5, total_steps=args.steps),
  micro_batches=micro_batches,
)
state = engine.init_state(jax.random.key(0))  # fp32 master weights, already at their OS shards
batches = paro_jax.Batches(paro_jax.default_corpus(), micro_batches, batch_size, seq_len, seed=0)

for step in range(args.steps):
  state, metrics = engine.train_step(state, engine.shard_batch(batches(step)))
  if step % 5 == 0 or step == args.steps - 1:
    print(f"step {step:3d}  loss {float(metrics['loss']):.3f}", flush=True)
