"""PyTorch peers of the strategy benchmark: the same model, batches and step on one emulated node.

Run by `paro-jax launch` once per node, as the strategies are (`python -m
experiments.bench.torch_peer --peer full_shard ...`, with the launcher's --mesh, --coordinator,
--num-processes and --process-id appended): each node process starts one torch process per
device (gloo, CPU),
rank = node x devices per node + device, so the ranks of a node share its network namespace and
its shaped link, and the link counters count torch's inter-node bytes as they count ours.

The model is the preset as an HF LLaMA config (`config_to_hf`, models/hf_config.py), built by
transformers' `LlamaForCausalLM`; the batches are the built-in corpus's (`paro_jax.data.streams.
Batches`, same seed: the same tokens per step and micro-batches as `train`); AdamW in fp32 (or
bf16 autocast with `--dtype bf16`); `--remat full` checkpoints every decoder layer, so backward
recomputes what `train --remat full` recomputes. Peers (`--peer`):

- `full_shard`: FSDP2 `fully_shard` over all ranks (ZeRO-3): per micro-batch, every layer's
  parameters all-gathered in forward and again in backward, gradients reduce-scattered.
- `hsdp`: FSDP2 on a (nodes, devices) mesh: sharded within a node, replicated across nodes;
  per micro-batch, a reduce-scatter within the node and an all-reduce across nodes.
- `hsdp_deferred`: `hsdp` with the cross-node all-reduce at the last micro-batch only
  (`set_requires_all_reduce`): one gradient sync between nodes per step.
- `ddp_no_sync`: DistributedDataParallel, `no_sync()` until the last micro-batch.

The optimizer: AdamW at a constant `--lr` (`--schedule constant`, the strategy benchmark's: its
runs time a few steps), or `train`'s own (`--schedule train`: core/state.py OptimConfig's betas,
eps and weight decay on matrices only, its warm-up and cosine decay over `--steps` from its
optax schedule, gradients clipped to its global norm), so that a loss compares with `train`'s at
equal tokens. `--eval-batches K` scores the model after the last step on K batches of the
held-out split, the batches `train --eval-batches K` scores (the last metrics row's `eval_loss`).
The initial weights are transformers' (its initializer under `torch.manual_seed(--seed)`), not
ours.

Rank 0 appends one row per step to OUT/metrics.jsonl (step, loss, step_time_s, tokens_per_s: the
strategy benchmark's monitor reads the link counters as rows appear) and writes OUT/peer.json
(the peer, torch's version, each rank's model-state bytes: local parameter, gradient and
optimizer-state shards, counted from the tensors).

Needs `pip install -e ".[bench]"` (CPU torch, transformers).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import signal
import time

PEERS = ("full_shard", "hsdp", "hsdp_deferred", "ddp_no_sync")
SCHEDULES = ("constant", "train")
REMAT = ("full", "none")  # what backward recomputes: every decoder layer's forward, or nothing


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--peer", required=True, choices=PEERS)
  p.add_argument("--model", default="tiny")
  p.add_argument("--micro-batches", type=int, default=1)
  p.add_argument("--batch-size", type=int, default=32, help="global sequences per micro-batch")
  p.add_argument("--seq-len", type=int, default=512)
  p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
  p.add_argument(
    "--remat",
    default="none",
    choices=REMAT,
    help="full: checkpoint every decoder layer (backward recomputes its forward, as "
    "`train --remat full` does); none: keep the activations",
  )
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--lr", type=float, default=3e-4)
  p.add_argument(
    "--schedule",
    default="constant",
    choices=SCHEDULES,
    help="constant: AdamW at --lr; train: `train`'s AdamW, warm-up, cosine decay and clipping",
  )
  p.add_argument("--warmup", type=int, default=10, help="warm-up steps of --schedule train")
  p.add_argument(
    "--eval-batches", type=int, default=0, help="held-out batches scored after the last step"
  )
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", required=True)
  p.add_argument("--mesh", default="1x1", help="NODESxDEVICES (the launcher sets it)")
  p.add_argument("--coordinator", default="127.0.0.1:29500")
  p.add_argument("--num-processes", type=int, default=1)
  p.add_argument("--process-id", type=int, default=0)
  return p.parse_args(argv)


def _die_with_parent() -> None:
  """A torch rank ends when its node process does (the launcher kills node processes)."""
  try:
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except OSError:
    pass


def _state_bytes(model, optim) -> dict:
  """This rank's bytes of parameters, gradients and optimizer states (local shards)."""

  def local(t):
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()

  params = sum(local(p) for p in model.parameters())
  grads = sum(local(p.grad) for p in model.parameters() if p.grad is not None)
  opt = sum(local(v) for s in optim.state.values() for v in s.values() if hasattr(v, "numel"))
  return {"params": params, "grads": grads, "opt": opt, "total": params + grads + opt}


def build(args, world: int, nodes: int):
  """The wrapped LlamaForCausalLM and its AdamW for `args.peer`."""
  import torch
  from torch.distributed.device_mesh import init_device_mesh
  from transformers import LlamaConfig as HFConfig
  from transformers import LlamaForCausalLM

  from models.hf_config import config_to_hf
  from models.presets import get_config

  torch.manual_seed(args.seed)
  model = LlamaForCausalLM(HFConfig(**config_to_hf(get_config(args.model))))
  if args.remat == "full":
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
  if args.peer == "ddp_no_sync":
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(model)
  else:
    from torch.distributed.fsdp import fully_shard

    if args.peer == "full_shard":
      mesh = init_device_mesh("cpu", (world,))
    else:
      mesh = init_device_mesh("cpu", (nodes, world // nodes), mesh_dim_names=("nodes", "devices"))
    for layer in model.model.layers:
      fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
  return model, optimizer(args, model)


def train_optim(args):
  """`train`'s optimizer settings for --lr, --warmup and --steps (core/state.py)."""
  from paro_jax.core.state import OptimConfig

  return OptimConfig(learning_rate=args.lr, warmup_steps=args.warmup, total_steps=args.steps)


def optimizer(args, model):
  """AdamW at a constant --lr, or with `train`'s settings (--schedule train): weight decay on
  the matrices only, as core/state.py `decay_mask` (the norms' scales are vectors)."""
  import torch

  if args.schedule == "constant":
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
  opt = train_optim(args)
  params = list(model.parameters())
  groups = [
    {"params": [p for p in params if p.ndim >= 2], "weight_decay": opt.weight_decay},
    {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
  ]
  return torch.optim.AdamW(groups, lr=args.lr, betas=(opt.b1, opt.b2), eps=opt.eps)


def learning_rates(args) -> list[float]:
  """The learning rate of each step 1..--steps (optax counts the first update as 0)."""
  if args.schedule == "constant":
    return [args.lr] * args.steps
  schedule = train_optim(args).lr_schedule()
  return [float(schedule(t)) for t in range(args.steps)]


def eval_loss(model, batches, rows) -> float:
  """The mean next-token loss over the held-out batch's micro-batches (each rank its rows; the
  ranks' rows are alike in count, so the mean over ranks is the batch's)."""
  import torch
  import torch.distributed as dist

  tokens = torch.from_numpy(batches(0, rows)).long()  # [K, b, L+1]
  total = 0.0
  with torch.no_grad():
    for x in tokens:
      logits = model(input_ids=x[:, :-1]).logits
      total += torch.nn.functional.cross_entropy(
        logits.float().flatten(0, 1), x[:, 1:].flatten()
      ).item()
  mean = torch.tensor([total / len(tokens)])
  dist.all_reduce(mean)
  return mean.item() / dist.get_world_size()


def rank_main(local: int, args, nodes: int, per_node: int) -> None:
  import contextlib

  import torch
  import torch.distributed as dist

  from models.presets import get_config
  from paro_jax.data.config import DataConfig
  from paro_jax.data.streams import Batches, load_tokens, split_eval

  _die_with_parent()
  torch.set_num_threads(1)
  world, rank = nodes * per_node, args.process_id * per_node + local
  host, port = args.coordinator.rsplit(":", 1)
  dist.init_process_group(
    "gloo",
    init_method=f"tcp://{host}:{port}",
    rank=rank,
    world_size=world,
    timeout=datetime.timedelta(minutes=30),
  )
  model, optim = build(args, world, nodes)
  A, B, L = args.micro_batches, args.batch_size, args.seq_len
  if B % world:
    raise ValueError(f"--batch-size {B} does not split over {world} ranks")
  rows = (rank * B // world, (rank + 1) * B // world)
  data = DataConfig()  # the built-in corpus, and its train split, as `train` reads them
  vocab = get_config(args.model).vocab
  tokens, held_out = split_eval(load_tokens(data, vocab), data.eval_fraction)
  batches = Batches(tokens, A, B, L, args.seed)
  rates = learning_rates(args)
  clip = train_optim(args).clip_norm if args.schedule == "train" else None
  autocast = (
    torch.autocast("cpu", dtype=torch.bfloat16)
    if args.dtype == "bf16"
    else contextlib.nullcontext()
  )
  metrics = os.path.join(args.out, "metrics.jsonl")
  for step in range(1, args.steps + 1):
    tokens = torch.from_numpy(batches(step - 1, rows)).long()  # [A, b, L+1]
    t0 = time.perf_counter()
    total = 0.0
    for a in range(A):
      last = a == A - 1
      if args.peer == "ddp_no_sync":
        sync = contextlib.nullcontext() if last else model.no_sync()
      else:
        sync = contextlib.nullcontext()
        if args.peer == "hsdp_deferred":
          model.set_requires_all_reduce(last)
      with sync, autocast:
        x = tokens[a]
        logits = model(input_ids=x[:, :-1]).logits  # next-token loss as `train` computes it
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        (loss / A).backward()
      total += loss.item() / A
    if clip is not None:
      torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    for group in optim.param_groups:
      group["lr"] = rates[step - 1]
    optim.step()
    optim.zero_grad(set_to_none=False)
    loss_t = torch.tensor([total])
    dist.all_reduce(loss_t)  # the mean loss over ranks (a few bytes)
    dt = time.perf_counter() - t0
    row = {"step": step, "loss": loss_t.item() / world, "step_time_s": dt}
    row["tokens_per_s"] = A * B * L / dt
    if step == args.steps and args.eval_batches:  # after the step's time: not in tokens/s
      held = Batches(held_out, args.eval_batches, B, L, args.seed)
      row["eval_loss"] = eval_loss(model, held, rows)
    if rank == 0:
      with open(metrics, "a") as f:
        f.write(json.dumps(row) + "\n")
  states = _state_bytes(model, optim)
  gathered = [None] * world
  dist.all_gather_object(gathered, states)
  if rank == 0:
    with open(os.path.join(args.out, "peer.json"), "w") as f:
      json.dump(
        {"peer": args.peer, "torch": torch.__version__, "world": world, "state_bytes": gathered},
        f,
        indent=1,
      )
  dist.destroy_process_group()


def main(argv=None) -> None:
  import torch.multiprocessing as mp

  from paro_jax.core.names import parse_mesh_shape

  args = parse_args(argv)
  nodes, per_node = parse_mesh_shape(args.mesh)
  if nodes != args.num_processes:
    raise SystemExit(f"--mesh {args.mesh} has {nodes} nodes but {args.num_processes} processes")
  os.makedirs(args.out, exist_ok=True)
  mp.start_processes(rank_main, args=(args, nodes, per_node), nprocs=per_node, start_method="spawn")


if __name__ == "__main__":
  main()
