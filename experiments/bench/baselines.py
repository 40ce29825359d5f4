"""The plain-jit baselines: XLA's own partitioning of the same training step.

One `jax.jit` training step (the same model, remat and optax AdamW with global-norm clipping as
the strategies) with NamedSharding annotations only, XLA partitioning the rest, "as most JAX
users would write it": `jit-fsdp` shards every state over all 8 devices, `jit-hsdp` over the 4
devices of a node (replicated across nodes). `child_baseline` is one training run of it under
the launcher (`--child baseline`), writing metrics.jsonl as `paro-jax train` does; `build` is
also compiled by experiments/bench/traffic.py for its HLO traffic.
"""

from __future__ import annotations

import json
import os
import time

from experiments.bench import child


def auto_mesh(inter: int, intra: int):
  """paro_jax's (inter, intra) device order, with Auto axes: what a plain-jit user has."""
  from jax.sharding import AxisType, Mesh

  from paro_jax.core.mesh import make_mesh

  m = make_mesh(inter, intra)
  return Mesh(m.devices, m.axis_names, axis_types=(AxisType.Auto,) * 2)


def build(
  kind: str,
  model_name: str,
  dtype: str,
  micro_batches: int,
  steps: int,
  mesh,
  remat: str = "full",
  attention: str = "xla",
):
  """(init_fn, jitted step, state shardings, batch sharding) of a plain-jit baseline;
  `attention` as models/llama.py takes it (resolved: "xla" or "cudnn")."""
  import jax
  import jax.numpy as jnp
  import optax
  from jax import lax
  from jax.sharding import NamedSharding, PartitionSpec as P

  from models.llama import Llama
  from models.loss import next_token_loss
  from models.presets import get_config
  from paro_jax.core.state import DTYPES, OptimConfig, decay_mask
  from paro_jax.core.sharding import shard_dims

  model = Llama(get_config(model_name), DTYPES[dtype], remat, None, attention)
  logical = model.logical_axes()
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  dims = shard_dims(logical)  # the `embed` dimension of every leaf, as paro_jax shards it
  axes = {"jit-fsdp": ("inter", "intra"), "jit-hsdp": "intra"}[kind]

  def spec(x, d):
    s = [None] * x.ndim
    s[d % x.ndim] = axes
    return P(*s)

  param_specs = jax.tree.map(spec, shapes, dims)
  tx = OptimConfig(total_steps=steps).reference_tx(decay_mask(logical))
  opt_shapes = jax.eval_shape(tx.init, shapes)
  opt_specs = optax.tree_map_params(
    tx,
    lambda _, s: s,
    opt_shapes,
    param_specs,
    transform_non_params=lambda _: P(),
    is_leaf=lambda x: isinstance(x, P),
  )
  is_spec = lambda x: isinstance(x, P)
  state_sh = jax.tree.map(
    lambda s: NamedSharding(mesh, s), (param_specs, opt_specs), is_leaf=is_spec
  )
  batch_sh = NamedSharding(mesh, P(None, ("inter", "intra"), None))

  replicated = NamedSharding(mesh, P())

  def gather(subtree):
    # The FSDP recipe of the JAX docs and MaxText: weights stored sharded, constrained to
    # replicated where a layer uses them, so XLA all-gathers them per layer (and reduce-scatters
    # their gradients). Without it XLA:SPMD keeps the weights sharded along `embed` and shards
    # the activations instead: 18x GGG's inter-node bytes on tiny (strategies_smoke).
    return jax.tree.map(lambda w: lax.with_sharding_constraint(w, replicated), subtree)

  def init(rng):
    params = model.init(rng)
    return params, tx.init(params)

  def step(state, tokens_AxBxL1):
    params, opt_state = state

    def loss_fn(p, tokens_BxL1):
      pc = jax.tree.map(lambda w: w.astype(model.dtype), p)
      logits = model.apply(pc, tokens_BxL1[:, :-1], materialize=gather)
      return next_token_loss(logits, tokens_BxL1[:, 1:])

    def micro(acc, tokens_BxL1):
      loss, g = jax.value_and_grad(loss_fn)(params, tokens_BxL1)
      return jax.tree.map(jnp.add, acc, g), loss

    acc, losses = lax.scan(micro, jax.tree.map(jnp.zeros_like, params), tokens_AxBxL1)
    grads = jax.tree.map(lambda g: g / micro_batches, acc)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return (params, opt_state), {"loss": jnp.mean(losses), "grad_norm": optax.global_norm(grads)}

  jstep = jax.jit(
    step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None), donate_argnums=0
  )
  jinit = jax.jit(init, out_shardings=state_sh)
  return model, jinit, jstep, state_sh, batch_sh


def child_baseline(args) -> None:
  """One plain-jit baseline training run under the launcher; process 0 writes metrics.jsonl."""
  child.setup_jax(args.mesh, (args.coordinator, args.num_processes, args.process_id))
  import jax

  from paro_jax.core.names import parse_mesh_shape
  from paro_jax.data.config import DataConfig
  from paro_jax.data.streams import Batches, load_tokens, split_eval

  inter, intra = parse_mesh_shape(args.mesh)
  mesh = auto_mesh(inter, intra)
  a = int(args.micro_batches)
  model, jinit, jstep, _, batch_sh = build(
    args.kind, args.model, args.dtype, a, args.steps, mesh, args.remat
  )
  tokens, _ = split_eval(load_tokens(DataConfig(), model.cfg.vocab), 0.01)
  batches = Batches(tokens, a, args.batch_size, args.seq_len, args.seed)
  shape = batches.shape
  rows = batches.process_rows(jax.process_index(), jax.process_count())

  def place(step):
    return jax.make_array_from_process_local_data(batch_sh, batches(step, rows), shape)

  state = jinit(jax.random.key(args.seed))
  main = jax.process_index() == 0
  os.makedirs(args.out, exist_ok=True)
  tokens_per_step = a * args.batch_size * args.seq_len
  last = time.perf_counter()
  with open(os.path.join(args.out, "metrics.jsonl") if main else os.devnull, "w") as log:

    def record(step, metrics):  # as paro_jax/run/train.py: read step s after s+1 is dispatched
      nonlocal last
      jax.block_until_ready(metrics)
      now = time.perf_counter()
      row = {
        "step": step,
        **{k: float(v) for k, v in metrics.items()},
        "step_time_s": now - last,
        "tokens_per_s": tokens_per_step / (now - last),
      }
      last = now
      log.write(json.dumps(row) + "\n")
      log.flush()
      if main:
        print(json.dumps(row), flush=True)

    pending = None
    for step in range(args.steps):
      state, metrics = jstep(state, place(step))
      if pending is not None:
        record(*pending)
      pending = (step + 1, metrics)
    record(*pending)
