"""The benchmark's jax children: starting one from the orchestrator, and setting jax up in one.

The orchestrator never imports jax. What needs it (calibration, compiling every configuration,
the plain-jit baselines) runs as `python experiments/bench_strategies.py --child KIND ...`: the
entry script, because `paro_jax.cluster.launch` runs scripts by path (the baselines run under
it, one process per emulated node).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time

from experiments.bench.configs import DEVICES_PER_NODE, NODES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENTRY = os.path.join(ROOT, "experiments", "bench_strategies.py")


def setup_jax(mesh_text: str | None, multi=(None, None, None), devices: int | None = None):
  """Devices and jax.distributed, before jax touches devices (as bench_collectives.py does)."""
  from paro_jax.cluster import distributed
  from paro_jax.core.names import parse_mesh_shape
  from paro_jax.core.xla_flags import add_xla_flags, provide_cpu_devices

  processes = distributed.process_count(*multi)
  if mesh_text:
    inter, intra = parse_mesh_shape(mesh_text)
    provide_cpu_devices(inter * intra // processes)
  elif devices:
    provide_cpu_devices(devices)
  add_xla_flags()
  distributed.maybe_initialize(*multi)


def run_child(argv: list[str], tag: str, log_path: str) -> dict:
  """Run `python ENTRY --child ...` in one process of 8 virtual devices; parse its `TAG {json}`
  line. Its output is appended to `log_path`."""
  from paro_jax.cluster.launch import child_env

  t = time.perf_counter()
  proc = subprocess.run(
    [sys.executable, ENTRY, *argv],
    capture_output=True,
    text=True,
    env=child_env(NODES * DEVICES_PER_NODE),
    cwd=ROOT,
  )
  with open(log_path, "a") as f:
    f.write(f"$ {shlex.join(argv)}\n{proc.stdout}\n{proc.stderr}\n")
  if proc.returncode:
    raise RuntimeError(
      f"child {argv[:2]} failed ({proc.returncode}); see {log_path}:\n{proc.stderr[-2000:]}"
    )
  line = next(line for line in proc.stdout.splitlines() if line.startswith(tag + " "))
  out = json.loads(line[len(tag) + 1 :])
  out["wall_s"] = time.perf_counter() - t
  return out


def batch_flags(args) -> list[str]:
  """--batch-size, --seq-len, --dtype and --remat: the step's shape and what its backward
  recomputes, for every child and configuration."""
  return [
    "--batch-size",
    str(args.batch_size),
    "--seq-len",
    str(args.seq_len),
    "--dtype",
    args.dtype,
    "--remat",
    args.remat,
  ]
