"""Compiled traffic and memory of every configuration, beside the formula (hlo.json).

`child_inspect` (`--child inspect`, one process of 8 virtual devices, nothing allocated) compiles
each configuration's step from abstract shapes. A PaRO strategy goes through the library's
inspector (paro_jax.analysis.inspect.inspector: compiled HLO bytes per level, the formula of
paro_jax.analysis.planner.costs, model-state and compiled memory). A plain-jit baseline has no
engine for it: its HLO is read with the same paro_jax.analysis.hlo.collectives functions, its
states' bytes from their shardings. `inspect_all` is the orchestrator's side: one child per A for
the configurations hlo.json lacks (`--resume` keeps the rest).

Keys of hlo.json: "LABEL/A" (experiments/bench/configs.py), e.g. "GGG/1", "GGG/horing/4".
"""

from __future__ import annotations

import json
import os
import sys
import time

from experiments.bench import child
from experiments.bench.child import batch_flags
from experiments.bench.configs import DEVICES_PER_NODE, NODES, Config
from experiments.bench.runs import lora_flags, wire_flags


def hlo_traffic(hlo_text: str, n: int, intra: int) -> dict:
  """Inter- and intra-node bytes per step of the busiest device, as inspector.report counts
  them (ring bytes per device; a device's traffic is inter-node if it crosses groups)."""
  from paro_jax.analysis.hlo.collectives import crosses_groups, device_bytes, parse_collectives

  per = {}
  for c in parse_collectives(hlo_text):
    for d, b in device_bytes(c, n).items():
      lvl = "inter" if crosses_groups(c, d, intra) else "intra"
      per.setdefault(d, {"inter": 0.0, "intra": 0.0})[lvl] += c.count * b
  return {
    "inter_bytes": max((v["inter"] for v in per.values()), default=0.0),
    "intra_bytes": max((v["intra"] for v in per.values()), default=0.0),
  }


def shard_bytes(shape, sharding) -> int:
  local = sharding.shard_shape(shape.shape)
  size = 1
  for d in local:
    size *= d
  return size * shape.dtype.itemsize


def _baseline_entry(args, name: str, a: int, inter: int, intra: int) -> dict:
  import jax
  import jax.numpy as jnp

  from experiments.bench import baselines

  mesh = baselines.auto_mesh(inter, intra)
  model, jinit, jstep, state_sh, batch_sh = baselines.build(
    name, args.model, args.dtype, a, 1000, mesh
  )
  shapes = jax.eval_shape(jinit, jax.random.key(0))
  state = jax.tree.map(
    lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, state_sh
  )
  batch = jax.ShapeDtypeStruct((a, args.batch_size, args.seq_len + 1), jnp.int32, sharding=batch_sh)
  compiled = jstep.lower(state, batch).compile()
  mem = compiled.memory_analysis()
  return {
    "measured": hlo_traffic(compiled.as_text(), inter * intra, intra),
    "expected": None,
    "model_states_bytes": sum(
      shard_bytes(s, sh) for s, sh in zip(jax.tree.leaves(shapes), jax.tree.leaves(state_sh))
    ),
    "peak_bytes": (
      mem.argument_size_in_bytes
      + mem.output_size_in_bytes
      - mem.alias_size_in_bytes
      + mem.temp_size_in_bytes
    ),
  }


def _strategy_entry(args, config: Config, a: int, inter: int, intra: int) -> dict:
  from models.presets import get_config
  from paro_jax.analysis.inspect.abstract import compile_step
  from paro_jax.analysis.inspect.inspector import report
  from paro_jax.core.config import LoraOptions, StepConfig, WireOptions
  from paro_jax.core.factory import build_engine
  from paro_jax.core.mesh import make_mesh

  step = StepConfig(
    strategy=config.name,
    dtype=args.dtype,
    remat=args.remat,
    attention="xla",
    micro_batches=a,
    collectives=config.collectives,
    wire=WireOptions(
      inter_params=args.inter_params, inter_grads=args.inter_grads, int8_block=args.int8_block
    ),
    lora=LoraOptions(rank=args.lora_rank, alpha=args.lora_alpha, targets=args.lora_targets),
  )
  engine = build_engine(step, get_config(args.model), make_mesh(inter, intra))
  r = report(engine, compile_step(engine, args.batch_size, args.seq_len))
  return {
    "measured": r["measured"],
    "expected": {k: r["expected"][k] for k in ("inter_bytes", "intra_bytes")},
    "model_states_bytes": r["memory"]["model_states"]["total"],
    "peak_bytes": r["memory"]["compiled"]["peak_bytes"],
    "notes": r["notes"],
  }


def child_inspect(args) -> None:
  """Compile each configuration of --names (labels) at each A of --micro-batches (abstract
  shapes, 1 process, 8 devices) and print its traffic and memory per device as one JSON
  object."""
  child.setup_jax(args.mesh)
  from paro_jax.core.names import parse_mesh_shape

  inter, intra = parse_mesh_shape(args.mesh)
  out = {}
  for label in args.names.split(","):
    config = Config.from_label(label, args.collectives)
    for a in [int(x) for x in args.micro_batches.split(",")]:
      t = time.perf_counter()
      if config.kind == "jit":
        entry = _baseline_entry(args, config.name, a, inter, intra)
      else:
        entry = _strategy_entry(args, config, a, inter, intra)
      entry["compile_s"] = time.perf_counter() - t
      out[f"{label}/{a}"] = entry
      print(f"inspected {label} A={a}: {entry['compile_s']:.1f} s", file=sys.stderr, flush=True)
  print("INSPECT " + json.dumps(out), flush=True)


def inspect_all(
  args, configs: list[Config], a_values: list[int], log_path: str
) -> tuple[dict, float]:
  """hlo.json under --out, completed: (its entries, the wall time spent compiling). Torch peers
  are not compiled here."""
  t = time.perf_counter()
  hlo_path = os.path.join(args.out, "hlo.json")
  hlo = {}
  if args.resume and os.path.exists(hlo_path):
    with open(hlo_path) as f:
      hlo = json.load(f)
  labels = [c.label for c in configs if c.kind in ("paro", "jit")]
  for a in a_values:
    missing = [label for label in labels if f"{label}/{a}" not in hlo]
    if missing:
      got = child.run_child(
        [
          "--child",
          "inspect",
          "--model",
          args.model,
          "--names",
          ",".join(missing),
          "--micro-batches",
          str(a),
          *batch_flags(args),
          "--mesh",
          f"{NODES}x{DEVICES_PER_NODE}",
          "--collectives",
          args.collectives,
          *lora_flags(args),
          *wire_flags(args),
        ],
        "INSPECT",
        log_path,
      )
      got.pop("wall_s", None)
      hlo.update(got)
      with open(hlo_path, "w") as f:
        json.dump(hlo, f, indent=2)
  return hlo, time.perf_counter() - t
