"""Which gradient path makes two-process fp32 steps differ: the same step, repeated in one run.

  paro-jax launch --nodes 2 --devices-per-node 2 --loopback -- \
    python experiments/multiprocess_repro_probe.py --out experiments/results/multiprocess_repro

For each strategy and collectives implementation, builds `train --model tiny --dtype fp32
--batch-size 8 --seq-len 32 --warmup 1` on this mesh, then REPS times: a fresh state from seed 0,
one train step on batch 0, and the state's bits. Identical inputs in one run, so any bit that
differs between repetitions comes from the step itself (the order of a reduction), not from the
data, the seed or the processes' start. Process 0 writes OUT/probe.json and OUT/probe.md: per
case, the loss and gradient norm of each repetition and how many bytes of the state
differ from the first repetition's.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from experiments.pages import machine_line, utc_now, write_page

CASES = "xla:NNN,xla:NNI,xla:NII,xla:NIG,xla:IIG,ring:NII,ring:IIG"


def state_bytes(tree) -> np.ndarray:
  """This process's shards of every array of `tree`, as raw bytes."""
  import jax

  parts = []
  for leaf in jax.tree.leaves(tree):
    for shard in sorted(leaf.addressable_shards, key=lambda s: s.device.id):
      parts.append(np.frombuffer(np.asarray(shard.data).tobytes(), np.uint8))
  return np.concatenate(parts)


def probe(collectives: str, strategy: str, mesh: tuple[int, int], reps: int) -> dict:
  import jax

  from paro_jax.run.train import RunConfig, build, place_batch

  cfg = RunConfig(
    model="tiny",
    strategy=strategy,
    mesh=mesh,
    batch_size=8,
    seq_len=32,
    dtype="fp32",
    warmup=1,
    collectives=collectives,
  )
  engine, batches, _ = build(cfg)
  first, rows = None, []
  for _ in range(reps):
    state = engine.init_state(jax.random.key(cfg.seed))
    state, metrics = engine.train_step(state, place_batch(engine, batches, 0))
    words = state_bytes(state)
    first = words if first is None else first
    rows.append(
      {
        "loss": float(metrics["loss"]),
        "grad_norm": float(metrics["grad_norm"]),
        "bytes_differing": int((words != first).sum()),
      }
    )
  return {"collectives": collectives, "strategy": strategy, "bytes": int(first.size), "reps": rows}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--cases", default=CASES, help="comma-separated COLLECTIVES:STRATEGY")
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--out", default="experiments/results/multiprocess_repro")
  p.add_argument("--tag", default="", help="pages OUT/probe-TAG.json and .md (default probe.json)")
  p.add_argument("--mesh", required=True, help="GxM (appended by paro-jax launch)")
  p.add_argument("--coordinator")
  p.add_argument("--num-processes", type=int)
  p.add_argument("--process-id", type=int)
  args = p.parse_args()
  from paro_jax.cluster.distributed import maybe_initialize

  maybe_initialize(args.coordinator, args.num_processes, args.process_id)
  import jax

  mesh = tuple(int(v) for v in args.mesh.split("x"))
  results = []
  for case in args.cases.split(","):
    collectives, strategy = case.split(":")
    results.append(probe(collectives, strategy, mesh, args.reps))
    if jax.process_index() == 0:
      print(json.dumps(results[-1]), flush=True)
  if jax.process_index():
    return
  page = {
    "command": "paro-jax launch --nodes 2 --devices-per-node 2 --loopback -- python "
    "experiments/multiprocess_repro_probe.py " + " ".join(sys.argv[1:]),
    "date": utc_now(),
    "machine": machine_line(),
    "mesh": args.mesh,
    "processes": jax.process_count(),
    "results": results,
  }
  name = f"probe-{args.tag}" if args.tag else "probe"
  write_page(args.out, page, f"{name}.json", _page(page), f"{name}.md")


def _page(page: dict) -> str:
  lines = [
    "# One fp32 train step repeated on identical inputs, two processes",
    "",
    f"`{page['command']}`, {page['date']}, {page['machine']}, mesh {page['mesh']} over "
    f"{page['processes']} processes.",
    "",
    "Bytes of process 0's state (after one step from the same fresh state and batch) that differ "
    "from the first repetition's, and the gradient norm of each repetition.",
    "",
    "| collectives | strategy | bytes differing | gradient norms |",
    "|---|---|---|---|",
  ]
  for r in page["results"]:
    differ = max(x["bytes_differing"] for x in r["reps"])
    norms = ", ".join(repr(x["grad_norm"]) for x in r["reps"])
    lines.append(f"| {r['collectives']} | {r['strategy']} | {differ} of {r['bytes']} | {norms} |")
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  main()
