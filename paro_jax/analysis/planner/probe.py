"""`paro-jax probe`: measure this mesh's collectives and compute, as a profile for the planner.

For each collective (all-gather, reduce-scatter, all-reduce; the `lax` ones, as `--collectives
xla` runs them) and level (over `intra`, over `inter`, over both: global), a few message sizes are
timed (median of `repeats` after a warm-up) inside one `shard_map` over the whole mesh, so all
devices of a node send at once, as in training. Each (collective, level) gets a least-squares fit
  time = latency + bytes / bandwidth,
with bytes the ring bytes each device sends (costs.py's convention: (k-1)/k x the per-device
buffer for an all-gather or reduce-scatter over k devices, twice that for an all-reduce), so the
planner can divide costs.step_traffic's bytes by it directly. A concurrent matmul on every device
gives the FLOP/s the planner scales by its MFU.

Multi-process: every process runs the same programs; process 0's numbers are broadcast, so all
processes plan alike (`train --strategy auto` needs one strategy), and only process 0 writes.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from paro_jax.analysis.planner.memory import available_memory
from paro_jax.core.mesh import make_mesh, mesh_shape
from paro_jax.core.units import parse_size
from paro_jax.core.names import (
  ALL_GATHER,
  ALL_REDUCE,
  LEVEL_AXES,
  LEVEL_GLOBAL,
  LEVEL_INTER,
  LEVEL_INTRA,
  LEVELS,
  MESH_AXES,
  REDUCE_SCATTER,
  SCHEDULE_COLLECTIVES,
)

DEFAULT_SIZES = (2**16, 2**20, 2**22)  # per-device buffer bytes: 64 KiB, 1 MiB, 4 MiB
QUICK_SIZES = (2**16, 2**20)  # train --strategy auto


def _ring_bytes(kind: str, size: int, k: int) -> float:
  return (2 if kind == ALL_REDUCE else 1) * (k - 1) / k * size


def _body(kind: str, axes: tuple[str, ...]):
  if kind == ALL_GATHER:
    return lambda x: lax.all_gather(x, axes, tiled=True)
  if kind == REDUCE_SCATTER:
    return lambda x: lax.psum_scatter(x, axes, tiled=True)
  return lambda x: lax.psum(x, axes)


def _timed(fn, x, repeats: int) -> float:
  jax.block_until_ready(fn(x))  # compile and warm up
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn(x))
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def _ones(mesh: Mesh, elems_per_device: int, dtype) -> jax.Array:
  """A global array, `elems_per_device` per device, each process filling only its own shards."""
  n = mesh.devices.size
  sharding = NamedSharding(mesh, P(MESH_AXES))
  return jax.make_array_from_callback(
    (n * elems_per_device,), sharding, lambda idx: np.ones((elems_per_device,), dtype)
  )


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
  """(bandwidth, latency) from (bytes, seconds) points by least squares, t = lat + bytes / bw.

  Noise can make the slope non-positive (all sizes latency-bound); then the bandwidth is the
  largest message over its time and the latency the smallest time.
  """
  xs, ts = [p[0] for p in points], [p[1] for p in points]
  n, mx, mt = len(xs), sum(xs) / len(xs), sum(ts) / len(ts)
  sxx = sum((x - mx) ** 2 for x in xs)
  slope = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / sxx if n > 1 and sxx else 0.0
  if slope <= 0:
    i = max(range(n), key=lambda j: xs[j])
    return xs[i] / ts[i], min(ts)
  return 1 / slope, max(0.0, mt - slope * mx)


def measure_flops(mesh: Mesh, repeats: int = 5) -> float:
  """FLOP/s of one device while every device runs its own matmul (they may share a host)."""
  cpu = mesh.devices.flat[0].platform == "cpu"
  size, dtype = (512, jnp.float32) if cpu else (4096, jnp.bfloat16)
  a = _ones(mesh, size * size, np.float32)
  mm = jax.jit(
    jax.shard_map(
      lambda x: (
        (x.reshape(size, size).astype(dtype) @ x.reshape(size, size).astype(dtype))
        .astype(jnp.float32)
        .reshape(-1)
      ),
      mesh=mesh,
      in_specs=P(MESH_AXES),
      out_specs=P(MESH_AXES),
    )
  )
  return 2 * size**3 / _timed(mm, a, repeats)


def probe(mesh: Mesh, sizes=DEFAULT_SIZES, repeats: int = 5, flops: bool = True) -> dict:
  """The profile of `mesh`: per (collective, level) points and fit, and FLOP/s per device."""
  inter, intra = mesh_shape(mesh)
  group = {LEVEL_INTRA: intra, LEVEL_INTER: inter, LEVEL_GLOBAL: inter * intra}
  table, values = {}, []
  for kind in SCHEDULE_COLLECTIVES:
    for level in LEVELS:
      k = group[level]
      if k == 1:  # nothing to measure: a level of one device moves no data
        continue
      points = []
      # check_vma off: a psum or all-gather result is replicated over the level's axes, but the
      # probe hands every device's copy back (out_specs P(MESH_AXES)) only to time it; with
      # check_vma on, the output spec would have to drop those axes for each level.
      fn = jax.jit(
        jax.shard_map(
          _body(kind, LEVEL_AXES[level]),
          mesh=mesh,
          in_specs=P(MESH_AXES),
          out_specs=P(MESH_AXES),
          check_vma=False,
        )
      )
      for size in sizes:
        elems = max(k, int(size) // 4 // k * k)  # f32, divisible by the group
        local = elems // k if kind == ALL_GATHER else elems  # all-gather: the shard grows k-fold
        seconds = _timed(fn, _ones(mesh, local, np.float32), repeats)
        points.append((_ring_bytes(kind, elems * 4, k), seconds))
      table.setdefault(kind, {})[level] = {"group": k, "points": points}
      values += [t for _, t in points]
  flop_per_s = measure_flops(mesh, repeats) if flops else 0.0
  values.append(flop_per_s)
  if jax.process_count() > 1:  # every process plans with process 0's numbers
    values = [
      float(v) for v in multihost_utils.broadcast_one_to_all(np.asarray(values, np.float32))
    ]
  it = iter(values)
  for levels in table.values():
    for fit in levels.values():
      fit["points"] = [[b, next(it)] for b, _ in fit["points"]]
      fit["bandwidth"], fit["latency"] = fit_line(fit["points"])
  flop_per_s = next(it)
  device = mesh.devices.flat[0]
  return {
    "version": 1,
    "mesh": {"inter": inter, "intra": intra},
    "platform": device.platform,
    "device_kind": device.device_kind,
    "processes": jax.process_count(),
    "jax": jax.__version__,
    "sizes": [int(s) for s in sizes],
    "repeats": repeats,
    "bytes": "ring bytes per device: (k-1)/k x buffer for all_gather / reduce_scatter over k "
    "devices, 2(k-1)/k x buffer for all_reduce; bandwidth in those bytes per second",
    "collectives": table,
    "flop_per_s": flop_per_s or None,
    "device_memory": available_memory(jax.local_devices())[0],  # bytes one device may use
  }


def write_profile(profile: dict, path: str) -> None:
  """Process 0 writes the profile (others return)."""
  if jax.process_index():
    return
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(profile, f, indent=2)


def format_profile(profile: dict) -> str:
  lines = [
    f"mesh {profile['mesh']['inter']}x{profile['mesh']['intra']}, {profile['platform']} "
    f"({profile['device_kind']}), {profile['processes']} process(es)",
    "",
    f"{'collective':16s}{'level':8s}{'devices':>8s}{'GB/s per device':>17s}{'latency us':>12s}",
  ]
  for kind, levels in profile["collectives"].items():
    for level, fit in levels.items():
      lines.append(
        f"{kind:16s}{level:8s}{fit['group']:8d}{fit['bandwidth'] / 1e9:17.3f}"
        f"{fit['latency'] * 1e6:12.1f}"
      )
  if profile.get("flop_per_s"):
    lines += ["", f"matmul: {profile['flop_per_s'] / 1e12:.3f} TFLOP/s per device"]
  return "\n".join(lines)


def run_probe(
  mesh_shape_: tuple[int, int] | None, sizes: str, repeats: int, flops: bool, out: str
) -> dict:
  """`paro-jax probe`: probe the mesh, print the fits, write the profile (process 0)."""
  if repeats < 1:
    raise ValueError(f"--repeats must be >= 1, got {repeats}")
  sizes = [int(parse_size(s, "--sizes entry")) for s in sizes.split(",") if s.strip()]
  if not sizes:
    raise ValueError("--sizes is empty: give per-device buffer sizes, e.g. 64KiB,1MiB,4MiB")
  mesh = make_mesh(*mesh_shape_) if mesh_shape_ else make_mesh()
  profile = probe(mesh, sizes, repeats, flops)
  write_profile(profile, out)
  if jax.process_index() == 0:
    print(format_profile(profile))
    print(f"\nparo-jax: wrote {out}", flush=True)
  return profile
